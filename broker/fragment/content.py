"""Reading a persisted fragment's content: from its store (brokers) or its signed URL (clients),
decompressed, from any offset, verified against the fragment's SHA-1 whenever the whole fragment
passes through (a mismatch is an error, never silently wrong bytes)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Generator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast, overload

from broker.fragment import codecs
from broker.fragment.fragments import content_name, content_path, digest_of
from broker.fragment.stores import FragmentStore
from broker.fragment.stores.urls import open_url
from broker.protocol import protocol_pb2 as pb

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Bytes = Generator[bytes, None, None]  # Blocks of their own (not views of a reused buffer).

# Bytes read (and decompressed, and hashed) per step: large enough to amortize handing each
# block from the worker thread to the event loop.
READ_SIZE = 4 << 20
# Threads hashing the blocks of verified reads (see `_read`), each in the order it is given
# blocks: a read hashes all of its blocks on one of them (taken in turn), so several reads
# hash at once.
_HASHERS = [
    concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fragment-sha1-{i}")
    for i in range(4)
]
_next_hasher = itertools.count()
# Blocks a verified read reads ahead of its hash at most (each held until it is hashed).
HASH_AHEAD = 2


class FragmentCorrupt(ValueError):
    """A fragment's content does not match its name (its length or SHA-1)."""


def fragment_path(fragment: pb.Fragment) -> str:
    """Where the fragment lives under its store's root."""
    return content_path(fragment.journal, fragment.path_postfix, content_name(fragment))


def describe(fragment: pb.Fragment) -> str:
    return f"{fragment.backing_store}{fragment_path(fragment)}"


class Buffers:
    """Buffers to read blocks into, for a reader that needs no block of its own (a broker
    copies each block into its responses): a buffer is taken again once no view of it is left,
    so that a long read does not allocate a fresh block each time (glibc returns freed 4 MiB
    blocks to the system and page-faults new ones in: that cost the broker more than reading
    them). A buffer with live views cannot be resized, which is how one in use is told apart.
    For one read at a time (one thread takes buffers, others only drop views)."""

    def __init__(self, size: int = READ_SIZE) -> None:
        self.size = size
        self._buffers: list[bytearray] = []

    def __len__(self) -> int:
        return len(self._buffers)

    def take(self) -> bytearray:
        for buffer in self._buffers:
            try:
                buffer.append(0)
            except BufferError:
                continue  # A view of it is still alive.
            del buffer[-1]
            return buffer
        buffer = bytearray(self.size)
        self._buffers.append(buffer)
        return buffer


@overload
def open_in_store(
    store: FragmentStore,
    fragment: pb.Fragment,
    offset: int,
    *,
    verify: bool = True,
    buffers: None = None,
) -> Generator[bytes, None, None]: ...


@overload
def open_in_store(
    store: FragmentStore,
    fragment: pb.Fragment,
    offset: int,
    *,
    verify: bool = True,
    buffers: Buffers,
) -> Generator[bytes | memoryview, None, None]: ...


def open_in_store(
    store: FragmentStore,
    fragment: pb.Fragment,
    offset: int,
    *,
    verify: bool = True,
    buffers: Buffers | None = None,
) -> Generator[bytes | memoryview, None, None]:
    """Content of a persisted fragment from journal `offset`, read from `store`. Without
    `verify`, the SHA-1 is not checked (its length still is): what a broker streaming the
    fragment does, leaving the check to the client that reads it whole, end to end.

    With `buffers` (and not `verify`), uncompressed content is read into them, each block a
    view of one (see Buffers)."""
    path = fragment_path(fragment)
    if fragment.compression_codec == pb.NONE and offset > fragment.begin:
        # Uncompressed: start the read at the offset (the skipped part is not verified).
        source = store.open(path, offset - fragment.begin)
        return _read(source, fragment, offset, start=offset, verify=False, buffers=buffers)
    source = store.open(path, 0)
    return _read(source, fragment, offset, start=fragment.begin, verify=verify, buffers=buffers)


def open_signed_url(
    url: str, fragment: pb.Fragment, offset: int, file_root: Path | None = None
) -> Generator[bytes, None, None]:
    """Content of a persisted fragment from journal `offset`, read from a signed URL that a
    broker returned (what clients do to read history without a broker in the path)."""
    if fragment.compression_codec == pb.NONE and offset > fragment.begin:
        source = open_url(url, offset=offset - fragment.begin, file_root=file_root)
        return cast(_Bytes, _read(source, fragment, offset, start=offset))
    source = open_url(url, file_root=file_root)
    return cast(_Bytes, _read(source, fragment, offset, start=fragment.begin))


def _read(
    source: BinaryIO,
    fragment: pb.Fragment,
    offset: int,
    start: int,
    verify: bool = True,
    buffers: Buffers | None = None,
) -> Generator[bytes | memoryview, None, None]:
    """Decompress `source` (content from journal offset `start`) and yield what follows
    `offset`. Verifies the SHA-1 when `start` is the fragment's begin, and then holds each
    block back until the next one is read, so the last block comes only once the whole
    fragment checked out: a fragment smaller than a block is never handed out unverified, and
    a larger one fails before its end. With `buffers`, blocks read as they are (no check, no
    decompressor) are views of those buffers."""
    codec = fragment.compression_codec if start == fragment.begin else pb.NONE
    # Uncompressed content is read as it is: the source already reads whole blocks.
    reader = source if codec == pb.NONE else codecs.decompressor(codec, source)
    summer = hashlib.sha1() if verify and start == fragment.begin else None
    readinto = getattr(source, "readinto", None) if reader is source and not summer else None
    if buffers is None or buffers.size < READ_SIZE:
        readinto = None
    # Blocks are hashed on a hashing thread while this one reads the next (both release the
    # GIL: reading, decompressing and hashing run on two cores), and while this one waits for
    # its caller to take the next block.
    hasher = _HASHERS[next(_next_hasher) % len(_HASHERS)] if summer is not None else None
    hashing: collections.deque[concurrent.futures.Future[None]] = collections.deque()
    at = start
    held: bytes | memoryview | None = None
    try:
        while at < fragment.end:
            want = min(READ_SIZE, fragment.end - at)
            data: bytes | memoryview
            if readinto is not None and buffers is not None:
                into = memoryview(buffers.take())
                data = into[: readinto(into[:want])]
                del into
            else:
                data = reader.read(want)
            if not data:
                raise FragmentCorrupt(
                    f"fragment {describe(fragment)} ends at offset {at}, before its end "
                    f"{fragment.end}: the store holds wrong content for its name"
                )
            if summer is not None and hasher is not None:
                hashing.append(hasher.submit(summer.update, data))  # In order: one thread.
                while len(hashing) > HASH_AHEAD:
                    hashing.popleft().result()
            begin, at = at, at + len(data)
            if at <= offset:
                continue
            if held is not None:
                yield held
            held = data[offset - begin :] if begin < offset else data
            if summer is None:
                yield held
                held = None
        if start == fragment.begin and reader.read(1):
            raise FragmentCorrupt(
                f"fragment {describe(fragment)} holds more content than its name says "
                f"({fragment.end - fragment.begin} bytes)"
            )
        while hashing:
            hashing.popleft().result()
        if summer is not None and summer.digest() != digest_of(fragment.sum):
            raise FragmentCorrupt(
                f"fragment {describe(fragment)} does not match its SHA-1 "
                f"({summer.hexdigest()} read): the store holds wrong content for its name"
            )
        if held is not None:
            yield held
    except codecs.CodecError as exc:
        raise FragmentCorrupt(f"fragment {describe(fragment)}: {exc}") from None
    finally:
        if reader is not source:
            reader.close()
        source.close()


_END = object()


async def stream_blocks(
    open_blocks: Callable[[], Generator[_T, None, None]], depth: int = 4
) -> AsyncGenerator[_T, None]:
    """The blocks of a blocking generator, produced up to `depth` blocks ahead of the consumer
    (reading, decompressing and hashing overlap with sending), without blocking the event loop.
    Leaving early stops the production and closes the generator.

    Each block is made by its own call on a worker thread of the default executor, which
    returns the thread before waiting for room in the queue: a consumer that stops taking blocks
    (a Read to a slow client) then holds no thread, and the executor's few threads stay free for
    what else runs there (store listings, persists, URL signing, the allocator)."""
    queue: asyncio.Queue[object] = asyncio.Queue(depth)
    producer = asyncio.ensure_future(_produce(_Blocks(open_blocks), queue))
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            yield cast(_T, item)
    finally:
        producer.cancel()
        await _wait_out(producer)
        if not producer.cancelled() and (error := producer.exception()) is not None:
            log.warning("closing a stream of blocks failed: %s", error)


class _Blocks:
    """A blocking generator opened by its first step. Steps and the close run on worker
    threads, one at a time (a generator cannot run on two threads at once)."""

    def __init__(self, open_blocks: Callable[[], Generator[Any, None, None]]) -> None:
        self._open = open_blocks
        self._blocks: Generator[Any, None, None] | None = None

    def step(self) -> object:
        """The next block, or _END."""
        if self._blocks is None:
            self._blocks = self._open()
        return next(self._blocks, _END)

    def close(self) -> None:
        if self._blocks is not None:
            self._blocks.close()


async def _produce(blocks: _Blocks, queue: asyncio.Queue[object]) -> None:
    """Blocks into `queue`, then _END or the exception that ended them (raised in the
    consumer). Cancelled when the consumer leaves; the generator is closed either way."""
    try:
        item: object = _END
        try:
            while (block := await _on_thread(blocks.step)) is not _END:
                await queue.put(block)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # Handed to the consumer, raised there.
            item = exc
        await queue.put(item)
    finally:
        await _on_thread(blocks.close)


async def _on_thread(call: Callable[[], _T]) -> _T:
    """`call()` on a worker thread. A cancellation waits for the call to return (a thread cannot
    be interrupted, and the generator must not be closed while a step runs), then is raised."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        await _wait_out(future)
    except asyncio.CancelledError:
        # Nobody wants the call's outcome now; an exception it raised (a corrupt fragment's,
        # read for a client that left) is seen here, or asyncio logs it as never retrieved.
        if not future.cancelled():
            future.exception()
        raise
    return future.result()


async def _wait_out(future: asyncio.Future[Any]) -> None:
    """Until `future` is done, even when cancelled meanwhile: then CancelledError follows (as a
    TaskGroup waits out its tasks). Its outcome is left to the caller."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
