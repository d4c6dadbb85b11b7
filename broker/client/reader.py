"""Reading a journal: a Read RPC from an offset, yielding content with its journal offset."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from broker.fragment.content import FragmentCorrupt, describe, open_signed_url, stream_blocks
from broker.fragment.fragments import digest_of
from broker.fragment.stores import StoreError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol.wire import ReadContent
from plumbing import auth
from plumbing.backoff import Backoff

log = logging.getLogger(__name__)


class ReadError(RuntimeError):
    def __init__(self, journal: str, status: int) -> None:
        self.journal = journal
        self.status = status
        super().__init__(f"read of {journal}: {pb.Status.Name(status)}")

    def __reduce__(self) -> tuple[type[ReadError], tuple[str, int]]:
        return ReadError, (self.journal, self.status)  # (Pickled: a planning process's.)


@dataclass(frozen=True)
class Chunk:
    offset: int
    content: bytes
    fragment: pb.Fragment | None = None
    write_head: int = 0


async def read(
    stub: pb_grpc.JournalStub,
    journal: str,
    offset: int = 0,
    *,
    block: bool = False,
    end_offset: int = 0,
    direct: bool = False,
    file_root: Path | None = None,
    begin_mod_time: int = 0,
    verify: bool = True,
    do_not_proxy: bool = False,
    on_hole: Callable[[int, int], None] | None = None,
) -> AsyncGenerator[Chunk, None]:
    """Content of `journal` from `offset` (-1: the write head). Non-blocking reads end at the
    write head; blocking reads wait for new commits until cancelled. Offsets may jump forward
    where the journal holds nothing for a span (each chunk carries its own offset).

    Persisted fragments read whole are verified against their SHA-1, whether streamed by the
    broker or, with `direct`, read straight from their store through the signed URL the broker
    returns (file:// URLs under `file_root`; a URL that cannot be read falls back to the
    broker); a fragment's last chunk comes only once it checked out (FragmentCorrupt if not).
    `verify=False` skips the check of fragments the broker streams (SHA-1 costs about 0.6
    CPU-seconds per GiB; the read_broker benchmark reports both). `begin_mod_time` skips
    fragments persisted before it (unix seconds). `do_not_proxy` reads what the broker dialed
    holds itself, as upstream's flag (it must be a replica of the journal).

    `on_hole(begin, end)`: a read that meets a range below the write head that no broker or
    listed store holds (a store dropped from the spec, fragments deleted) goes on past it, at
    the next content the broker's index has, and tells `on_hole` what it skipped. Without it,
    a read stops there (a blocking one waits), as upstream's reader does: the range may be a
    fragment a replica is still persisting. A blocking read with `on_hole` reads without
    blocking until it is caught up, so that it meets such ranges rather than waiting at them."""
    use_urls = direct
    catching_up = block and on_hole is not None
    rechecked = -1
    while True:
        hole: tuple[int, int] | None = None
        request = pb.ReadRequest(
            journal=journal,
            offset=offset,
            block=block and not catching_up,
            end_offset=end_offset,
            do_not_proxy=use_urls or do_not_proxy,
            begin_mod_time=begin_mod_time,
        )
        call = stub.Read(request)
        fragment: pb.Fragment | None = None
        head = 0
        follow: tuple[str, pb.Fragment, int] | None = None
        # The SHA-1 of a persisted fragment read whole, hashed as each response arrives (on the
        # event loop: handing content to a hashing thread cost more than it saved on two cores).
        summer: hashlib._Hash | None = None
        held: Chunk | None = None
        try:
            async for response in call:
                if type(response) is not ReadContent:  # Else content, parsed by hand.
                    if response.status == pb.OFFSET_NOT_YET_AVAILABLE:
                        if on_hole is None:
                            return
                        hole = (response.offset or offset, response.write_head)
                        break
                    if response.status == pb.NOT_JOURNAL_BROKER and use_urls:
                        break  # Not a replica, and told not to proxy: ask again, proxied.
                    if response.status != pb.OK:
                        raise ReadError(journal, response.status)
                    if response.HasField("fragment"):
                        if held is not None:  # A fragment not read to its end: unchecked.
                            yield held
                            held = None
                        fragment, head = response.fragment, response.write_head
                        if on_hole is not None and not begin_mod_time and response.offset > offset:
                            # The broker moved the read past a range nothing holds (content
                            # lost with every replica, or removed from the stores): said, as
                            # any other hole, rather than skipped quietly.
                            on_hole(offset, response.offset)
                        offset = response.offset
                        if use_urls and response.fragment_url:
                            follow = (response.fragment_url, response.fragment, response.offset)
                            break
                        # A persisted fragment streamed from its begin is checked against its
                        # SHA-1 when it ends, its last chunk held back until it checks out.
                        persisted = fragment.mod_time and fragment.backing_store
                        whole = persisted and offset == fragment.begin
                        summer = hashlib.sha1() if verify and whole else None
                        continue
                content = response.content
                offset = response.offset + len(content)
                chunk = Chunk(response.offset, content, fragment, head)
                if summer is None:
                    yield chunk
                    continue
                assert fragment is not None
                summer.update(content)
                if held is not None:
                    yield held
                held = chunk
                if offset >= fragment.end:
                    digest = summer.digest()
                    summer, held = None, None
                    if offset > fragment.end or digest != digest_of(fragment.sum):
                        raise FragmentCorrupt(
                            f"fragment {describe(fragment)}, read through the broker, does not "
                            "match its SHA-1: the store holds wrong content for its name"
                        )
                    yield chunk
            else:
                if held is not None:
                    yield held
                return  # The broker ended the stream: a non-blocking read reached the head.
        finally:
            call.cancel()
        if held is not None:
            yield held
            held = None
        if hole is not None:
            at, head = hole
            if at < head:
                following = await _next_fragment(stub, journal, at)
                if following is not None and following <= at:
                    # Listed as held after all (the index changed meanwhile): read it again,
                    # once; a broker that still has nothing there ends the read.
                    if rechecked == at:
                        return
                    rechecked, offset = at, at
                    continue
                skip_to = head if following is None else following
                assert on_hole is not None
                on_hole(at, skip_to)
                offset = skip_to
                continue
            if not catching_up:
                return
            catching_up, offset = False, at  # Caught up: block for what comes next.
            continue
        if follow is None:
            use_urls = False  # Proxied from here on (the broker was not a replica).
            continue
        url, fragment, offset = follow
        try:
            # Closed here when the reader leaves: left to the loop's finalizer, its stream of
            # blocks was closed while the loop shut down (asyncio logged the error).
            stored = _read_url(url, fragment, offset, end_offset, file_root, head)
            async with contextlib.aclosing(stored):
                async for chunk in stored:
                    offset = chunk.offset + len(chunk.content)
                    yield chunk
        except StoreError as exc:
            log.warning("reading %s directly failed (%s): reading through the broker", url, exc)
            use_urls = False
            continue
        if end_offset and offset >= end_offset:
            return


async def _next_fragment(stub: pb_grpc.JournalStub, journal: str, offset: int) -> int | None:
    """The begin of the first fragment the journal's index holds past `offset`, or None."""
    token = 0
    while True:
        listed = await stub.ListFragments(
            pb.FragmentsRequest(journal=journal, next_page_token=token, page_limit=1000)
        )
        for fragment in listed.fragments:
            if fragment.spec.end > offset:
                return max(int(fragment.spec.begin), offset)
        token = listed.next_page_token
        if not token:
            return None


async def _read_url(
    url: str,
    fragment: pb.Fragment,
    offset: int,
    end_offset: int,
    file_root: Path | None,
    head: int,
) -> AsyncGenerator[Chunk, None]:
    end = min(fragment.end, end_offset) if end_offset else fragment.end
    blocks = stream_blocks(lambda: open_signed_url(url, fragment, offset, file_root))
    try:
        async for block in blocks:
            block = block[: end - offset]
            yield Chunk(offset, block, fragment, head)
            offset += len(block)
            if offset >= end:
                return
    finally:
        await blocks.aclose()


async def write_head(stub: pb_grpc.JournalStub, journal: str) -> int:
    """The journal's write head: the offset the next append will begin at."""
    request = pb.ReadRequest(journal=journal, offset=-1, block=False, metadata_only=True)
    call = stub.Read(request)
    try:
        async for response in call:
            if response.status not in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE):
                raise ReadError(journal, response.status)
            return int(response.write_head)
    finally:
        call.cancel()
    raise ReadError(journal, pb.OFFSET_NOT_YET_AVAILABLE)


# Statuses and codes after which a read can go on a moment later, possibly at another broker.
READ_RETRYABLE = frozenset(
    {pb.NOT_JOURNAL_BROKER, pb.NO_JOURNAL_PRIMARY_BROKER, pb.INSUFFICIENT_JOURNAL_BROKERS}
)
READ_RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
)


async def read_retrying(
    stubs: Callable[[], pb_grpc.JournalStub],
    journal: str,
    offset: int = 0,
    *,
    block: bool = True,
    max_delay: float = 2.0,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    **options: Any,
) -> AsyncIterator[Chunk]:
    """`read`, resumed at the next offset whenever the broker goes away, a blocking read's
    stream ends (its replica moved) or it outlives its token: a RetryReader. `stubs()` names a
    broker to try each time (for example, a Router's default, or a rotation over several
    addresses). Statuses other
    than transient ones end the read with ReadError. With `wait`, transient failures end it too
    once they have lasted that many seconds with nothing read (else it waits for as long as it
    takes, as a consumer's reader does); `on_wait` hears once, when such a wait grows long,
    what it waits through. Other keyword `options` are `read`'s."""
    from broker.client.routes import PROGRESS_AFTER

    backoff = Backoff(maximum=max_delay)
    failing_since: float | None = None
    told = False
    while True:
        try:
            reading = read(stubs(), journal, offset, block=block, **options)
            async with contextlib.aclosing(reading):  # (As `read` closes its direct reads.)
                async for chunk in reading:
                    offset = chunk.offset + len(chunk.content)
                    backoff.reset()
                    failing_since, told = None, False
                    yield chunk
            if not block:
                return
            await backoff.sleep()  # A blocking read's stream ended (its replica moved).
            continue
        except ReadError as exc:
            if exc.status not in READ_RETRYABLE:
                raise
            failure: Exception = exc
            reason = pb.Status.Name(exc.status)
        except grpc.aio.AioRpcError as exc:
            if auth.expired_during_call(exc):
                continue  # The read outlived its token: on from here, with a fresh one.
            if exc.code() not in READ_RETRYABLE_CODES:
                raise
            failure, reason = exc, exc.code().name
        delay = backoff.next_delay()
        now = time.monotonic()
        failing_since = now if failing_since is None else failing_since
        if wait is not None:
            delay = min(delay, wait - (now - failing_since))  # A last try at the deadline.
            if delay <= 0:
                raise failure
            if on_wait is not None and not told and now - failing_since + delay >= PROGRESS_AFTER:
                told = True
                on_wait(f"read of {journal}: {reason}; waiting up to {wait:g}s for it to be served")
        await asyncio.sleep(delay)
