"""Reads that a broker serves from its fragment stores, on a real broker process: clients that
stop reading in the middle of a persisted fragment must not starve the broker's other work
(store listings, persists, URL signing, the allocator), which shares the same worker threads.
Then `stream_blocks`, which reads those fragments: its contract, cancellation included."""

from __future__ import annotations

import asyncio
import gc
import gzip
import hashlib
import io
import os
import threading
import time
from collections.abc import Generator
from pathlib import Path

import grpc
import pytest

from broker.client import JournalsClient
from broker.client.appender import AppendError
from broker.client.journals import dial, grpc_target
from broker.client.routes import append_routed
from broker.fragment.content import fragment_path, stream_blocks
from broker.fragment.fragments import sum_from_digest
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_process
from tests.conftest import start_broker_process
from tests.helpers.journals import routed
from tests.helpers.waiting import until

STORE = "file:///fragments/"
HISTORY = "store-reads/history"
FRESH = "store-reads/fresh"

# The history's content: a 256-byte cycle, so that any offset's bytes are known. Far more than
# a stalled reader's buffers hold (the broker's read-ahead and gRPC's flow-control windows), so
# the broker is left with content to send that the client does not take.
MIB = 1 << 20
SIZE = 128 * MIB
CYCLE = bytes(range(256))

# Throttled readers: eight, as in the issue, and always more than the threads of the broker's
# default executor (min(32, CPUs + 4): six on a two-CPU machine), which reads used to hold.
READERS = max(8, min(32, (os.cpu_count() or 1) + 4) + 2)

# Liveness bounds, not speed targets.
SERVED_WITHIN = 20.0
APPEND_WITHIN = 30.0


def expected(offset: int, length: int) -> bytes:
    start = offset % len(CYCLE)
    repeats = (start + length) // len(CYCLE) + 1
    return (CYCLE * repeats)[start : start + length]


def write_history(root: Path) -> pb.Fragment:
    """One persisted fragment of HISTORY, written straight into the store before any broker
    runs: the broker knows it only from listing the store, so it serves it from there. GZIP
    members of one MiB each (as spools write them), so that the file itself stays small."""
    member = gzip.compress(expected(0, MIB), compresslevel=9, mtime=0)
    digest = hashlib.sha1()
    for _ in range(SIZE // MIB):
        digest.update(expected(0, MIB))
    fragment = pb.Fragment(
        journal=HISTORY,
        begin=0,
        end=SIZE,
        sum=sum_from_digest(digest.digest()),
        compression_codec=pb.GZIP,
    )
    body = member * (SIZE // MIB)
    store = open_store(STORE, file_root=root)
    assert store.put(fragment_path(fragment), io.BytesIO(body), len(body))
    return fragment


def journal(name: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.fragment.length = 1 << 30
    out.fragment.compression_codec = pb.GZIP
    out.fragment.stores.append(STORE)
    out.fragment.refresh_interval.seconds = 60
    return out


class ThrottledReader:
    """A client reading HISTORY through the broker from offset 0 on its own connection, which
    takes the fragment's metadata and its first content, then stops reading (a slow consumer:
    the broker is left blocked on flow control, with the fragment open)."""

    def __init__(self, address: str) -> None:
        # A connection of its own (no subchannel shared with the test's other channels), so that
        # each reader has its own flow-control windows, as separate clients do.
        self.channel = grpc.aio.insecure_channel(
            grpc_target(address), options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stub = pb_grpc.JournalStub(self.channel)  # type: ignore[no-untyped-call]
        # do_not_proxy unset: the broker reads the fragment from its store and streams it.
        self.call = stub.Read(pb.ReadRequest(journal=HISTORY, offset=0))
        self.metadata: pb.ReadResponse | None = None
        self.first: pb.ReadResponse | None = None

    async def take_first_content(self) -> None:
        self.metadata = await self.call.read()
        self.first = await self.call.read()

    async def read_on(self, length: int) -> None:
        """Read on from where it stopped, checking offsets and content."""
        assert self.first is not None
        offset = self.first.offset + len(self.first.content)
        stop = offset + length
        while offset < stop:
            response = await self.call.read()
            assert response is not grpc.aio.EOF, f"the read ended at {offset}"
            assert response.offset == offset, "content continues where it stopped"
            assert response.content == expected(offset, len(response.content))
            offset += len(response.content)

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close(None)


async def first_append(
    address: str, stub: pb_grpc.JournalStub, name: str, seen: list[str]
) -> pb.AppendResponse:
    """Apply a new journal and append to it, waiting (as the library's appender does) while
    its route forms: it is assigned by the allocator, and its replica lists its store before
    taking the append. Statuses met on the way are added to `seen`."""
    async with JournalsClient(address) as client:
        await client.apply([pb.ApplyRequest.Change(upsert=journal(name))])
    return await append_routed(stub, name, b"first record\n", on_wait=seen.append, wait=3600.0)


async def test_slow_store_readers_do_not_starve_appends(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    history = write_history(root)
    broker = start_broker_process(
        etcd_server,
        etcd_prefix,
        tmp_path / "broker.log",
        extra=("--broker.file-root", str(root)),
    )
    channel = dial(broker.address)
    readers: list[ThrottledReader] = []
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        async with JournalsClient(broker.address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=journal(HISTORY))])
            await routed(client, HISTORY, 1)
        # ListFragments answers once the stores were listed: the broker knows the fragment
        # only as persisted (it never held it locally), so it reads it from the store.
        listed = await stub.ListFragments(pb.FragmentsRequest(journal=HISTORY))
        assert [(f.spec.begin, f.spec.end, f.spec.backing_store) for f in listed.fragments] == [
            (0, SIZE, STORE)
        ]

        readers = [ThrottledReader(broker.address) for _ in range(READERS)]
        serving = [asyncio.ensure_future(r.take_first_content()) for r in readers]
        try:
            # A starved broker never serves some of them: whether it does is asserted below,
            # after the append, which is what must not stall.
            await asyncio.wait(serving, timeout=SERVED_WITHIN)
        finally:
            for task in serving:
                task.cancel()
            await asyncio.gather(*serving, return_exceptions=True)

        # A new journal is assigned (the allocator solves on a worker thread), and its first
        # append waits for the first listing of its store (on a worker thread too).
        started = time.monotonic()
        seen: list[str] = []
        try:
            async with asyncio.timeout(APPEND_WITHIN):
                response = await first_append(broker.address, stub, FRESH, seen)
        except (AppendError, TimeoutError) as exc:
            raise AssertionError(
                f"with {READERS} stalled readers of a persisted fragment, a new journal took no "
                f"append in {time.monotonic() - started:.0f} s ({str(exc) or 'timed out'}; "
                f"statuses: {', '.join(dict.fromkeys(seen)) or 'none'})"
            ) from None
        assert response.status == pb.OK
        assert (response.commit.begin, response.commit.end) == (0, 13)

        # Every reader was served from the store, and each goes on where it stopped once it
        # reads again.
        for at, reader in enumerate(readers):
            assert reader.metadata is not None and reader.first is not None, (
                f"reader {at} of {READERS} was never served"
            )
            assert reader.metadata.status == pb.OK
            assert reader.metadata.fragment.backing_store == STORE
            assert reader.metadata.fragment.end == history.end
            assert reader.first.offset == 0
            assert reader.first.content == expected(0, len(reader.first.content))
        async with asyncio.timeout(SERVED_WITHIN * 3):
            await asyncio.gather(*(r.read_on(8 * MIB) for r in readers))
    finally:
        for reader in readers:
            await reader.close()
        await channel.close(None)
        stop_process(broker.proc)


# ---- stream_blocks: its contract, with generators that record what happens on their thread ----


class Recorded:
    """A blocking generator of `count` blocks, recording each step and its close (with the
    thread that ran it), and failing if ever advanced from two threads at once."""

    def __init__(self, count: int = 1 << 30, fail_after: int | None = None) -> None:
        self.count = count
        self.fail_after = fail_after
        self.produced = 0
        self.closed_on: int | None = None
        self.events: list[str] = []
        self.running = threading.Lock()
        self.hold_at: int | None = None  # The step producing this block waits for `release`.
        self.held = threading.Event()
        self.release = threading.Event()

    def blocks(self) -> Generator[bytes, None, None]:
        try:
            for at in range(self.count):
                assert self.running.acquire(blocking=False), "advanced from two threads"
                try:
                    if at == self.hold_at:
                        self.held.set()
                        self.release.wait()
                        self.events.append(f"step {at} returned")
                    if at == self.fail_after:
                        raise ValueError(f"no block {at}")
                    self.produced += 1
                finally:
                    self.running.release()
                yield b"%d" % at
        finally:
            self.closed_on = threading.get_ident()
            self.events.append("closed")


async def test_stream_blocks_hands_over_blocks_then_the_generators_error() -> None:
    source = Recorded(count=5, fail_after=2)
    got = []
    with pytest.raises(ValueError, match="no block 2"):
        async for block in stream_blocks(source.blocks):
            got.append(block)
    assert got == [b"0", b"1"]
    assert source.events == ["closed"]


async def test_stream_blocks_reads_ahead_by_depth_and_closes_the_generator_when_left() -> None:
    source = Recorded()
    blocks = stream_blocks(source.blocks, depth=3)
    assert [await anext(blocks), await anext(blocks)] == [b"0", b"1"]
    # Two consumed, three queued, one waiting for room: and no more.
    await until(lambda: source.produced == 6)
    await asyncio.sleep(0.2)  # A hold: no seventh is produced meanwhile.
    assert source.produced == 6
    await blocks.aclose()
    assert source.events == ["closed"]
    assert source.closed_on not in (None, threading.get_ident()), "closed on a worker thread"


async def test_stream_blocks_cancelled_mid_step_closes_the_generator_after_the_step() -> None:
    source = Recorded()
    source.hold_at = 1
    got: list[bytes] = []

    async def consume() -> None:
        async for block in stream_blocks(source.blocks):
            got.append(block)

    consumer = asyncio.ensure_future(consume())
    try:
        await until(source.held.is_set)
        consumer.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        # A step on a thread cannot be interrupted: the consumer waits it out.
        assert not consumer.done()
    finally:
        source.release.set()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert got == [b"0"]
    assert source.events == ["step 1 returned", "closed"]


async def test_stream_blocks_cancelled_in_a_step_that_fails_leave_no_error_unretrieved() -> None:
    # Found by tests/test_fuzz.py: a client leaving a read of a corrupt fragment while its
    # step ran left the step's FragmentCorrupt in a future nobody retrieved, which asyncio
    # logged with a traceback ("Future exception was never retrieved").
    source = Recorded(fail_after=1)
    source.hold_at = 1
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))

    async def consume() -> None:
        async for _ in stream_blocks(source.blocks):
            pass

    try:
        consumer = asyncio.ensure_future(consume())
        try:
            await until(source.held.is_set)
            consumer.cancel()
        finally:
            source.release.set()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        del consumer
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert source.events == ["step 1 returned", "closed"]
    assert not reported, reported


async def test_stalled_stream_blocks_hold_no_worker_thread() -> None:
    # More stalled streams than the default executor has threads (at most 32): each waits for
    # its consumer, and the executor still runs other work.
    sources = [Recorded() for _ in range(40)]
    streams = [stream_blocks(source.blocks) for source in sources]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    probe: asyncio.Future[str] | None = None
    try:
        await asyncio.wait(firsts, timeout=SERVED_WITHIN)
        served = sum(first.done() for first in firsts)
        assert served == len(streams), f"only {served} of {len(streams)} streams were served"
        assert [first.result() for first in firsts] == [b"0"] * len(streams)
        await until(lambda: all(source.produced == 6 for source in sources))
        probe = asyncio.ensure_future(asyncio.to_thread(lambda: "ran"))
        await asyncio.wait({probe}, timeout=SERVED_WITHIN)
        assert probe.done(), "the executor ran nothing else"
    finally:
        # A stream still making its first block cannot be closed yet: the others go first (with
        # threads held, closing them is what lets the rest run).
        for stream, first in zip(streams, firsts, strict=True):
            if first.done():
                await stream.aclose()
        await asyncio.wait(firsts)
        for stream in streams:
            await stream.aclose()
        if probe is not None:
            await probe
    assert all(source.events == ["closed"] for source in sources)
