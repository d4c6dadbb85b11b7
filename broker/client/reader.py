"""Reading a journal: a Read RPC from an offset, yielding content with its journal offset."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
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


def read(
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
    blocking until it is caught up, so that it meets such ranges rather than waiting at them.

    See `Reader`, which this runs."""
    options = ReadOptions(
        block=block, end_offset=end_offset, direct=direct, file_root=file_root,
        begin_mod_time=begin_mod_time, verify=verify, do_not_proxy=do_not_proxy,
        on_hole=on_hole,
    )  # fmt: skip
    return Reader(stub, journal, offset, options).chunks()


@dataclass(frozen=True)
class ReadOptions:
    """How a `Reader` reads (see `read`)."""

    block: bool = False
    end_offset: int = 0
    direct: bool = False
    file_root: Path | None = None
    begin_mod_time: int = 0
    verify: bool = True
    do_not_proxy: bool = False
    on_hole: Callable[[int, int], None] | None = None


class _Next(enum.Enum):
    """What a reader does once a Read call ended (`Reader.call`)."""

    END = "the read is over"
    HOLE = "the broker has nothing at the offset: skip a hole, or block once caught up"
    PROXIED = "the broker is not a replica: read again, proxied"
    URL = "read a persisted fragment through its signed URL"
    AGAIN = "read again from the offset"


class _SumCheck:
    """A persisted fragment streamed from its begin, checked against its SHA-1 as each chunk
    arrives (on the event loop: handing content to a hashing thread cost more than it saved
    on two cores); its last chunk is held back until it checks out."""

    def __init__(self, fragment: pb.Fragment) -> None:
        self.fragment = fragment
        self.summer = hashlib.sha1()

    def last(self, chunk: Chunk, offset: int) -> bool:
        """Take `chunk` (read through `offset`); whether it ends the fragment (checked: else
        FragmentCorrupt)."""
        self.summer.update(chunk.content)
        fragment = self.fragment
        if offset < fragment.end:
            return False
        if offset > fragment.end or self.summer.digest() != digest_of(fragment.sum):
            raise FragmentCorrupt(
                f"fragment {describe(fragment)}, read through the broker, does not match its "
                "SHA-1: the store holds wrong content for its name"
            )
        return True


class Reader:
    """A reader of one journal from an offset, as upstream's `reader.go`: one Read call after
    another (`call`), each ending in what to do next: skip a hole (`past_hole`), ask again
    proxied, read a persisted fragment through its signed URL (`from_url`), or end."""

    def __init__(
        self, stub: pb_grpc.JournalStub, journal: str, offset: int, options: ReadOptions
    ) -> None:
        self.stub, self.journal, self.offset, self.options = stub, journal, offset, options
        self.use_urls = options.direct  # Until a broker that is not a replica answers.
        # A blocking read with `on_hole` reads without blocking until it is caught up.
        self.catching_up = options.block and options.on_hole is not None
        self.rechecked = -1  # A hole read again, once, after the index listed it as held.
        self.write_head = 0  # As the last fragment's response gave it.
        self.hole: tuple[int, int] = (0, 0)  # (at, write head) of a hole met.
        self.follow: tuple[str, pb.Fragment] | None = None  # A fragment's signed URL.

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        """The journal's content (see `read`)."""
        while True:
            self.next = _Next.AGAIN
            async for chunk in self.call():
                yield chunk
            step = self.next
            if step is _Next.END:
                return
            if step is _Next.HOLE:
                if not await self.past_hole():
                    return
            elif step is _Next.PROXIED:
                self.use_urls = False  # Proxied from here on (the broker was not a replica).
            elif step is _Next.URL:
                assert self.follow is not None
                async for chunk in self.from_url(*self.follow):
                    yield chunk
                end_offset = self.options.end_offset
                if self.next is not _Next.AGAIN and end_offset and self.offset >= end_offset:
                    return

    async def call(self) -> AsyncGenerator[Chunk, None]:
        """One Read call's chunks; `self.next` says what then."""
        options = self.options
        request = pb.ReadRequest(
            journal=self.journal,
            offset=self.offset,
            block=options.block and not self.catching_up,
            end_offset=options.end_offset,
            do_not_proxy=self.use_urls or options.do_not_proxy,
            begin_mod_time=options.begin_mod_time,
        )
        call = self.stub.Read(request)
        fragment: pb.Fragment | None = None
        check: _SumCheck | None = None
        held: Chunk | None = None  # A checked fragment's last chunk so far.
        try:
            async for response in call:
                if type(response) is not ReadContent:  # Else content, parsed by hand.
                    if response.status == pb.OFFSET_NOT_YET_AVAILABLE:
                        if options.on_hole is None:
                            self.next = _Next.END
                        else:
                            self.next = _Next.HOLE
                            self.hole = (response.offset or self.offset, response.write_head)
                        break
                    if response.status == pb.NOT_JOURNAL_BROKER and self.use_urls:
                        self.next = _Next.PROXIED  # Not a replica, and told not to proxy.
                        break
                    if response.status != pb.OK:
                        raise ReadError(self.journal, response.status)
                    if response.HasField("fragment"):
                        if held is not None:  # A fragment not read to its end: unchecked.
                            yield held
                            held = None
                        fragment, self.write_head = response.fragment, response.write_head
                        self._moved_past(response.offset)
                        if self.use_urls and response.fragment_url:
                            self.follow = (response.fragment_url, response.fragment)
                            self.next = _Next.URL
                            break
                        # A persisted fragment streamed from its begin is checked against its
                        # SHA-1 when it ends, its last chunk held back until it checks out.
                        persisted = fragment.mod_time and fragment.backing_store
                        whole = persisted and self.offset == fragment.begin
                        check = _SumCheck(fragment) if options.verify and whole else None
                        continue
                content = response.content
                self.offset = response.offset + len(content)
                chunk = Chunk(response.offset, content, fragment, self.write_head)
                if check is None:
                    yield chunk
                    continue
                if held is not None:
                    yield held
                held = chunk
                if check.last(chunk, self.offset):
                    check, held = None, None
                    yield chunk
            else:
                self.next = _Next.END  # The broker ended the stream: a non-blocking read
                # reached the head (or the read its end).
        finally:
            call.cancel()
        if held is not None:
            yield held

    def _moved_past(self, offset: int) -> None:
        """The broker moved the read to `offset`: past a range nothing holds (content lost
        with every replica, or removed from the stores) is said, as any other hole, rather
        than skipped quietly."""
        on_hole = self.options.on_hole
        if on_hole is not None and not self.options.begin_mod_time and offset > self.offset:
            on_hole(self.offset, offset)
        self.offset = offset

    async def past_hole(self) -> bool:
        """After the broker had nothing at the offset: skip to the next content the index
        lists (telling `on_hole`), or, caught up, block from here on. Whether the read goes
        on."""
        at, head = self.hole
        if at < head:
            following = await _next_fragment(self.stub, self.journal, at)
            if following is not None and following <= at:
                # Listed as held after all (the index changed meanwhile): read it again,
                # once; a broker that still has nothing there ends the read.
                if self.rechecked == at:
                    return False
                self.rechecked, self.offset = at, at
                return True
            skip_to = head if following is None else following
            assert self.options.on_hole is not None
            self.options.on_hole(at, skip_to)
            self.offset = skip_to
            return True
        if not self.catching_up:
            return False
        self.catching_up, self.offset = False, at  # Caught up: block for what comes next.
        return True

    async def from_url(self, url: str, fragment: pb.Fragment) -> AsyncGenerator[Chunk, None]:
        """A persisted fragment read straight from its store through its signed URL; a URL
        that cannot be read falls back to the broker (`self.next` AGAIN, proxied)."""
        try:
            # Closed here when the reader leaves: left to the loop's finalizer, its stream of
            # blocks was closed while the loop shut down (asyncio logged the error).
            stored = _read_url(
                url, fragment, self.offset, self.options.end_offset, self.options.file_root,
                self.write_head,
            )  # fmt: skip
            async with contextlib.aclosing(stored):
                async for chunk in stored:
                    self.offset = chunk.offset + len(chunk.content)
                    yield chunk
        except StoreError as exc:
            log.warning("reading %s directly failed (%s): reading through the broker", url, exc)
            self.use_urls = False
            self.next = _Next.AGAIN


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


def read_retrying(
    stubs: Callable[[], pb_grpc.JournalStub],
    journal: str,
    offset: int = 0,
    *,
    block: bool = True,
    max_delay: float = 2.0,
    wait: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    **options: Any,
) -> AsyncGenerator[Chunk, None]:
    """`read`, resumed at the next offset whenever the broker goes away, a blocking read's
    stream ends (its replica moved) or it outlives its token (see `RetryReader`). `stubs()`
    names a broker to try each time (for example, a Router's default, or a rotation over
    several addresses). Statuses other than transient ones end the read with ReadError. With
    `wait`, transient failures end it too once they have lasted that many seconds with nothing
    read (else it waits for as long as it takes, as a consumer's reader does); `on_wait` hears
    once, when such a wait grows long, what it waits through. Other keyword `options` are
    `read`'s."""
    return RetryReader(stubs, journal, offset, block, max_delay, wait, on_wait, options).chunks()


class RetryReader:
    """A `Reader` started again at the next offset after each transient failure, as
    upstream's `retry_reader.go`: the one backoff between attempts, reset by progress."""

    def __init__(
        self,
        stubs: Callable[[], pb_grpc.JournalStub],
        journal: str,
        offset: int,
        block: bool,
        max_delay: float,
        wait: float | None,
        on_wait: Callable[[str], None] | None,
        options: dict[str, Any],
    ) -> None:
        self.stubs, self.journal, self.offset, self.block = stubs, journal, offset, block
        self.wait, self.on_wait, self.options = wait, on_wait, options
        self.backoff = Backoff(maximum=max_delay)
        self.failing_since: float | None = None  # Since when attempts fail, with nothing read.
        self.told = False  # Whether `on_wait` heard of this wait.

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        while True:
            try:
                reading = read(self.stubs(), self.journal, self.offset, block=self.block, **self.options)  # fmt: skip
                async with contextlib.aclosing(reading):  # (As `read` closes its direct reads.)
                    async for chunk in reading:
                        self.offset = chunk.offset + len(chunk.content)
                        self.backoff.reset()
                        self.failing_since, self.told = None, False
                        yield chunk
                if not self.block:
                    return
                await self.backoff.sleep()  # A blocking read's stream ended (its replica moved).
                continue
            except ReadError as exc:
                if exc.status not in READ_RETRYABLE:
                    raise
                await self.failed(exc, pb.Status.Name(exc.status))
            except grpc.aio.AioRpcError as exc:
                if auth.expired_during_call(exc):
                    continue  # The read outlived its token: on from here, with a fresh one.
                if exc.code() not in READ_RETRYABLE_CODES:
                    raise
                await self.failed(exc, exc.code().name)

    async def failed(self, failure: Exception, reason: str) -> None:
        """After a transient failure: wait out the backoff, or raise `failure` once failures
        have lasted `wait` seconds."""
        from broker.client.routes import PROGRESS_AFTER

        delay = self.backoff.next_delay()
        now = time.monotonic()
        self.failing_since = now if self.failing_since is None else self.failing_since
        wait = self.wait
        if wait is not None:
            delay = min(delay, wait - (now - self.failing_since))  # A last try at the deadline.
            if delay <= 0:
                raise failure
            waited = now - self.failing_since + delay
            if self.on_wait is not None and not self.told and waited >= PROGRESS_AFTER:
                self.told = True
                self.on_wait(f"read of {self.journal}: {reason}; waiting up to {wait:g}s for it to be served")  # fmt: skip
        await asyncio.sleep(delay)
