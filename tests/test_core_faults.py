"""Defects of the broker core found by review (issue 12), each reproduced against real
in-process brokers replicating over real gRPC: blocked reads after route changes, a local spool
failure in the middle of an append, cancellation at the FSM's await points, a persisted fragment
vanishing from the index, and flow control measured from when an append streams."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from broker.client.appender import AppendError, append
from broker.fragment.index import Index
from broker.fragment.spool import Spool
from broker.protocol import protocol_pb2 as pb
from broker.read_api import serve_read
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec, set_journal, started_brokers
from tests.helpers.waiting import until

FRAGMENT_NAME = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{16}-[0-9a-f]{40}")

IDS = ["broker-a", "broker-b", "broker-c"]


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as harnesses:
        yield harnesses


def stub(h: BrokerHarness):  # type: ignore[no-untyped-def]
    return h.broker.service.dialer.journal_stub(h.endpoint)


async def read_all(h: BrokerHarness, journal: str) -> bytes:
    out = bytearray()
    async for r in stub(h).Read(
        pb.ReadRequest(journal=journal, offset=0, block=False, do_not_proxy=True)
    ):
        if r.status == pb.OFFSET_NOT_YET_AVAILABLE:
            break
        assert r.status == pb.OK, r
        out += r.content
    return bytes(out)


# ---- 1. blocked reads after a route change ----------------------------------------------------


async def test_blocked_tails_stay_idle_after_a_route_change(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four tails blocked at the write head; the journal's replication goes from 1 to 3 (its
    assignments change, then the primary writes the new route into them). The tails must not
    wake again and again: the number of index queries stays small while nothing is appended."""
    journal = "faults/tails"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    await append(stub(brokers[0]), journal, b"first\n")

    queries = 0
    original = Index.query

    def counting(self: Index, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal queries
        if self.journal == journal:
            queries += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Index, "query", counting)

    received: list[list[bytes]] = [[] for _ in range(4)]

    async def tail(i: int) -> None:
        request = pb.ReadRequest(journal=journal, offset=-1, block=True, do_not_proxy=True)
        async for r in stub(brokers[0]).Read(request):
            if r.content:
                received[i].append(r.content)

    async with asyncio.TaskGroup() as tg:
        tails = [tg.create_task(tail(i)) for i in range(4)]
        await until(lambda: queries >= 4)
        await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
        # The primary synchronizes the new pipeline and advertises the route (its own write).
        replica = brokers[0].broker.service.resolver.replicas[journal]  # type: ignore[index]
        await until(
            lambda: len(replica.assignments) == 3 and all(kv.raw for kv in replica.assignments),
            timeout=15,
        )
        await asyncio.sleep(0.5)  # A settling time: the tails' wake-ups at the route change pass.
        before = queries
        await asyncio.sleep(1.0)  # The window the idle tails' queries are counted over.
        idle = queries - before
        # Spinning tails query the index thousands of times a second.
        assert idle <= 8, f"{idle} index queries in a second by four idle tails"
        await append(stub(brokers[0]), journal, b"second\n")
        await until(lambda: all(r == [b"second\n"] for r in received))
        for task in tails:
            task.cancel()


async def test_read_inside_a_local_fragment_ends_when_its_replica_stops(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """A reader inside a replica's local fragment, when the replica stops (unassigned): the
    read ends promptly instead of looping on metadata-only responses. The Read handler is
    driven directly, one response at a time (through gRPC, buffers would take the whole
    fragment before the replica stops)."""
    journal = "faults/stopping"
    members = [("local", IDS[0]), ("local", IDS[1])]
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=2), members)
    content = bytes(range(256)) * (8 << 10)  # 2 MiB: several Read chunks.
    # The journal's first fragment is rolled by the append after it: the content read below
    # is in the spool's own (head) fragment.
    await append(stub(brokers[0]), journal, b"first\n")
    await append(stub(brokers[0]), journal, b"second\n")
    head = (await append(stub(brokers[0]), journal, content)).commit
    assert head.begin > 0

    service = brokers[1].broker.service
    request = pb.ReadRequest(journal=journal, offset=head.begin, do_not_proxy=True)
    responses = serve_read(service.ctx, request, context=None)
    first = await anext(responses)
    assert first.status == pb.OK and first.fragment.end == head.end
    chunk = pb.ReadResponse.FromString(await anext(responses))  # (yielded encoded)
    assert chunk.content == content[: len(chunk.content)]

    replica = service.resolver.replicas[journal]  # type: ignore[index]
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), members[:1])
    await until(lambda: journal not in (service.resolver.replicas or {}))
    await until(lambda: replica.stopped and not len(service.resolver.tasks))

    metadata = 0
    async with asyncio.timeout(10):
        async for r in responses:
            if isinstance(r, pb.ReadResponse) and r.HasField("fragment"):
                metadata += 1
                assert metadata < 10, "the read loops on metadata-only responses"
    # The read ended; a client resumes it elsewhere.


# ---- 2. a local spool failure in the middle of an append -------------------------------------


async def test_local_spool_failure_mid_append_rolls_back_everywhere(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The primary's own spool fails (ENOSPC) on an append's second chunk, after its peers took
    it. Nothing of that append may ever commit, on any replica: not through the next pulse
    (which commits whatever the primary's spool holds pending), nor the next append, which
    must succeed without waiting for a route change."""
    journal = "faults/enospc"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
    await append(stub(brokers[0]), journal, b"kept;")

    calls = 0
    original = Spool.apply_content  # Called by the primary's pipeline only.

    def failing(self: Spool, content: bytes, content_delta: int) -> pb.ReplicateResponse:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return original(self, content, content_delta)

    monkeypatch.setattr(Spool, "apply_content", failing)
    # Larger than a group commit's whole append (WHOLE_APPEND): it streams chunk by chunk.
    torn = [b"torn-1;" * 6000, b"torn-2;" * 6000]
    with pytest.raises(grpc.aio.AioRpcError):
        await append(stub(brokers[0]), journal, torn)
    monkeypatch.setattr(Spool, "apply_content", original)

    service = brokers[0].broker.service
    replica = service.resolver.replicas[journal]  # type: ignore[index]
    with contextlib.suppress(Exception):
        await service.pulse(replica)  # A zero-byte commit proposal.
    response = await append(stub(brokers[0]), journal, b"next")
    assert (response.commit.begin, response.commit.end) == (5, 9)
    for h in brokers:
        assert await read_all(h, journal) == b"kept;next"


# ---- 3. cancellation at every await point -----------------------------------------------------

# Await points of the append FSM, each a method the FSM awaits: acquiring the pipeline and the
# spool, the sync's scatter and its answers, a content chunk's scatter, and reading the
# acknowledgements in turn.
# acknowledgements in turn. With a new pipeline (which the victim synchronizes) or one kept from
# earlier appends that are still reading theirs.
AWAIT_POINTS = [
    ("sync", "AppendFSM._take"),
    ("sync", "Pipeline.scatter"),
    ("sync", "Pipeline.read_in_turn"),
    ("stream", "Pipeline.scatter_content"),
    ("stream", "Pipeline.read_in_turn"),
]


@pytest.mark.parametrize(("scenario", "point"), AWAIT_POINTS)
async def test_append_fsm_cancelled_at_each_await_point(
    scenario: str,
    point: str,
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An append FSM cancelled at one of its await points, among pipelined appends: every
    other append either commits (its bytes at its acknowledged offsets on every replica) or
    fails cleanly, the replicas agree byte for byte, and the journal keeps taking appends."""
    from broker import append_fsm, pipeline
    from broker.append_fsm import AppendFSM, Chunk

    journal = f"faults/cancel-{scenario}-{point.lower().replace('.', '-').replace('_', '')}"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
    await append(stub(brokers[0]), journal, b"start;")
    service = brokers[0].broker.service
    replica = service.resolver.replicas[journal]  # type: ignore[index]

    owner_name, method = point.split(".")
    owner = {"AppendFSM": append_fsm.AppendFSM, "Pipeline": pipeline.Pipeline}[owner_name]
    original = getattr(owner, method)
    victims: set[asyncio.Task[None]] = set()
    fired: list[str] = []

    async def cancelling(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        task = asyncio.current_task()
        if task in victims:
            victims.discard(task)  # Once: the FSM's clean-up may await the same method.
            fired.append(point)
            task.cancel()  # Delivered at the first suspension inside the original.
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, cancelling)

    if scenario == "sync":
        # The victim must build and synchronize a new pipeline: drop the current one.
        pln = await replica.pipeline_queue.get()
        if pln is not None:
            await pln.shutdown(expect_err=False)
        replica.pipeline_queue.put_nowait(None)

    async def one(i: int) -> tuple[bytes, pb.AppendResponse | None]:
        payload = f"<{i:03d}>".encode()
        try:
            return payload, await append(stub(brokers[i % 3]), journal, payload)
        except grpc.aio.AioRpcError:
            return payload, None

    victim_payload = b"<victim>"
    chunks = iter(
        [Chunk(pb.AppendRequest(content=victim_payload)), Chunk(pb.AppendRequest()), Chunk(None)]
    )

    async def receive() -> Chunk:
        return next(chunks)

    fsm = AppendFSM(service.ctx, pb.AppendRequest(journal=journal))
    before = [asyncio.ensure_future(one(i)) for i in range(8)] if scenario == "stream" else []
    victim = asyncio.ensure_future(fsm.run(receive))
    victims.add(victim)
    after = [asyncio.ensure_future(one(i)) for i in range(8, 16)]
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert fired == [point], "the victim never reached the await point"
    results = await asyncio.gather(*before, *after)

    final = await append(stub(brokers[0]), journal, b"<final>")
    contents = [await read_all(h, journal) for h in brokers]
    assert contents[0] == contents[1] == contents[2]
    content = contents[0]
    assert content.startswith(b"start;") and content.endswith(b"<final>")
    assert final.commit.end == len(content)
    for payload, response in results:
        if response is not None:
            assert content[response.commit.begin : response.commit.end] == payload
        assert content.count(payload) <= 1
    # What is there is exactly what was appended: nothing torn, nothing twice.
    rest = content[len(b"start;") : -len(b"<final>")]
    pieces = rest.replace(b"><", b">\n<").split(b"\n") if rest else []
    allowed = {p for p, _ in results} | {victim_payload}
    assert all(p in allowed for p in pieces), pieces
    assert len(pieces) == len(set(pieces))


async def test_replicate_handler_cancelled_as_it_takes_the_spool_gives_it_back(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """A Replicate handler waits for the spool (another stream owns it); it is handed over and
    the handler is cancelled in the same instant: the spool must go back to the replica."""
    from broker.replicate_api import serve_replicate

    journal = "faults/replicate-cancel"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
    await append(stub(brokers[0]), journal, b"x")
    # The primary's pipeline owns the replica's spool through its stream: tear it down.
    primary = brokers[0].broker.service.resolver.replicas[journal]  # type: ignore[index]
    pln = await primary.pipeline_queue.get()
    assert pln is not None
    await pln.shutdown(expect_err=False)
    primary.pipeline_queue.put_nowait(None)
    service = brokers[1].broker.service
    replica = service.resolver.replicas[journal]  # type: ignore[index]
    res = await service.resolver.resolve(journal, may_proxy=False, require_primary=False)
    header = pb.Header()
    header.CopyFrom(res.header)
    header.process_id.CopyFrom(service.process_id)

    for spins in range(6):
        async with asyncio.timeout(5):
            spool = await replica.spool_queue.get()  # Ours now, as a stream would own it.
        first = pb.ReplicateRequest(header=header, proposal=spool.fragment, acknowledge=True)

        async def requests() -> AsyncIterator[pb.ReplicateRequest]:
            yield first  # noqa: B023
            await asyncio.Event().wait()

        async def handler() -> None:
            async for _ in serve_replicate(service.ctx, requests(), context=None):
                pass

        task = asyncio.ensure_future(handler())
        # Now waiting for the spool: a getter of the replica's spool slot.
        await until(lambda: bool(replica.spool_queue._getters), "the handler waits for the spool")
        assert not task.done()
        replica.spool_queue.put_nowait(spool)
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert replica.spool_queue.qsize() == 1, f"spool lost (cancelled after {spins} steps)"


# ---- 5. flow control measured from when an append streams -------------------------------------


async def test_a_small_append_queued_behind_a_slow_one_is_not_too_slow(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """A small append waits for the pipeline while a long one (streaming faster than the
    broker's minimum rate, 64 KiB/s here) holds it for three seconds: the wait is not the
    small append's streaming time, and it commits."""
    journal = "faults/flow"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
    await append(stub(brokers[0]), journal, b"x")
    assert brokers[0].broker.service.min_append_rate == 65536

    async def slow_content() -> AsyncIterator[bytes]:
        for _ in range(6):
            yield b"s" * (64 << 10)  # 128 KiB/s on average: above the minimum.
            await asyncio.sleep(0.5)  # The pacing under test: the append holds the pipeline 3 s.

    replica = brokers[0].broker.service.resolver.replicas[journal]  # type: ignore[index]
    # The first append gave the pipeline back; then the slow append holds it.
    await until(lambda: not replica.pipeline_queue.empty(), "the first append let go of it")
    slow = asyncio.ensure_future(append(stub(brokers[0]), journal, slow_content()))
    await until(replica.pipeline_queue.empty, "the slow append holds the pipeline")
    small = await append(stub(brokers[0]), journal, b"small\n")
    done = await slow
    assert small.commit.begin == done.commit.end  # It waited, then committed.
    assert done.commit.end - done.commit.begin == 6 * (64 << 10)


async def test_a_stalled_client_is_still_aborted(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """The other side of the rule: a client that stops streaming is aborted after the grace
    period, rolled back, and the journal takes the next append."""
    journal = "faults/stalled"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])

    async def stalled() -> AsyncIterator[bytes]:
        yield b"partial"
        await asyncio.sleep(2.5)  # Past the grace period of one second.

    with pytest.raises(grpc.aio.AioRpcError, match="min-append-rate"):
        await append(stub(brokers[0]), journal, stalled())
    response = await append(stub(brokers[0]), journal, b"next")
    assert (response.commit.begin, response.commit.end) == (0, 4)


# ---- 8. flushing at a graceful exit -------------------------------------------------------------


async def test_exit_flush_records_the_end_even_when_the_store_cannot_take_it(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flush a broker runs at a graceful exit waits for the store to hold every byte
    before the journal's end, then records the end (its suspension offset). With the store
    refusing writes past FLUSH_TIMEOUT, it records the end all the same and names what the
    store lacks (recording nothing let a restart hand out acknowledged offsets again); the
    persister keeps trying, and a store that comes back before the broker stops gets it all."""
    from broker import append_fsm
    from broker.append_fsm import AppendFSM, Chunk
    from broker.fragment.persister import Persister

    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "faults/flush"
    spec = journal_spec(journal)
    spec.fragment.stores.append("file:///fragments/")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        await append(stub(brokers[0]), journal, b"one;")
        await append(stub(brokers[0]), journal, b"two;")  # Rolls the first write's fragment.
        await append(stub(brokers[0]), journal, b"three;")
        service = brokers[0].broker.service

        async def flush() -> AppendFSM:
            fsm = AppendFSM(
                service.ctx,
                pb.AppendRequest(journal=journal, do_not_proxy=True),
                flush_and_suspend=True,
            )
            commit = iter([Chunk(pb.AppendRequest()), Chunk(None)])

            async def receive() -> Chunk:
                return next(commit)

            await fsm.run(receive)
            return fsm

        async def suspension() -> pb.JournalSpec.Suspend:
            async with brokers[0].client() as client:
                listing = await client.list(pb.LabelSelector())
            return listing.journals[0].spec.suspend

        def refuse(self: Persister, *args: object) -> pb.Fragment:
            raise OSError("the store is down (injected)")

        monkeypatch.setattr(Persister, "_persist_blocking", refuse)
        monkeypatch.setattr(append_fsm, "FLUSH_TIMEOUT", 1.0)
        fsm = await flush()
        assert fsm.status == pb.SUSPENDED, (pb.Status.Name(fsm.status), fsm.store_health_error)
        # [0, 4) may have reached the store before it refused; [4, 14) did not.
        assert fsm.unpersisted in ([(0, 14)], [(4, 14)]), fsm.unpersisted
        suspend = await suspension()
        assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.PARTIAL, 14)

        monkeypatch.undo()  # The store is back; the persister retries with backoff.
        index = service.resolver.replicas[journal].index  # type: ignore[index]
        async with asyncio.timeout(30):
            while not index.persisted_through(14):
                await index.changed.wait()
        # The store health probe lives under the journal's path too (.gazette~health/).
        names = [
            p.name.split("-")
            for p in (root / "fragments" / journal).iterdir()
            if not p.name.startswith(".")
        ]
        assert sorted((int(n[0], 16), int(n[1], 16)) for n in names) == [(0, 4), (4, 14)]


async def test_a_pipeline_that_fails_to_build_gives_the_spool_back(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Building a pipeline fails right after the FSM took the replica's spool: the append
    fails, and the spool is not lost with it (the next append would wait for it forever)."""
    from broker import append_fsm
    from broker.pipeline import Pipeline

    journal = "faults/build"
    await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
    await append(stub(brokers[0]), journal, b"one;")
    replica = brokers[0].broker.service.resolver.replicas[journal]  # type: ignore[index]
    pln = await replica.pipeline_queue.get()
    assert pln is not None
    await pln.shutdown(expect_err=False)
    replica.pipeline_queue.put_nowait(None)  # The next append builds a new pipeline.

    builds = 0

    def failing_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal builds
        builds += 1
        if builds == 1:
            raise RuntimeError("dialing failed (injected)")
        return Pipeline(*args, **kwargs)

    monkeypatch.setattr(append_fsm, "Pipeline", failing_once)
    with pytest.raises(grpc.aio.AioRpcError, match="injected"):
        await append(stub(brokers[0]), journal, b"lost;")
    async with asyncio.timeout(10):
        response = await append(stub(brokers[0]), journal, b"two;")
    assert (response.commit.begin, response.commit.end) == (4, 8)


# ---- 8. the flush at a graceful exit ----------------------------------------------------------


async def test_an_append_queued_behind_the_exit_flush_is_not_acknowledged_below_its_suspension(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault campaign's finding 1 (`sigterm-all`): while the exit flush of the primary
    waits for the store, an append arrives, resolved under the spec that is not suspended yet,
    and waits for the pipeline. Once the flush has recorded the journal's suspension at its
    end and lets go of the pipeline, that append must not be acknowledged there: the broker
    exits without persisting it, and brokers started later resume the journal at the
    suspension offset, writing those offsets a second time."""
    import threading

    from broker.append_fsm import AppendFSM, Chunk
    from broker.fragment.persister import Persister

    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "faults/flush-queue"
    spec = journal_spec(journal)
    spec.fragment.stores.append("file:///fragments/")
    gate = threading.Event()
    asked = threading.Event()
    original = Persister._persist_blocking

    def slow_store(self: Persister, *args: object) -> pb.Fragment:
        asked.set()
        gate.wait(30)  # The store answers only once the test says so.
        return original(self, *args)  # type: ignore[arg-type]

    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        await append(stub(brokers[0]), journal, b"one;")
        await append(stub(brokers[0]), journal, b"two;")
        monkeypatch.setattr(Persister, "_persist_blocking", slow_store)
        service = brokers[0].broker.service
        fsm = AppendFSM(
            service.ctx,
            pb.AppendRequest(journal=journal, do_not_proxy=True),
            flush_and_suspend=True,
        )
        commit = iter([Chunk(pb.AppendRequest()), Chunk(None)])

        async def receive() -> Chunk:
            return next(commit)

        flushing = asyncio.create_task(fsm.run(receive))
        await until(asked.is_set, "the flush rolled the spool and waits for the store")
        assert not flushing.done()
        late = asyncio.create_task(
            append(stub(brokers[0]), journal, b"late;", check=False, timeout=20)
        )
        replica = service.resolver.replicas[journal]  # type: ignore[index]
        # Resolved (not suspended yet), it waits for the pipeline: an append read whole waits in
        # the replica's group commit.
        await until(lambda: len(replica.group_commit) >= 1, "the late append waits")
        gate.set()
        await flushing
        assert fsm.status == pb.SUSPENDED, (pb.Status.Name(fsm.status), fsm.error)
        async with brokers[0].client() as client:
            listing = await client.list(pb.LabelSelector())
        suspend = listing.journals[0].spec.suspend
        assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.PARTIAL, 8)
        try:
            response = await late
        except grpc.aio.AioRpcError as exc:
            # Refused: this broker is exiting; the client retries elsewhere or later.
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        else:
            assert response.status != pb.OK, (
                f"acknowledged at [{response.commit.begin}, {response.commit.end}) "
                f"after the journal was suspended at {suspend.offset} for the restart"
            )


async def test_an_exiting_broker_does_not_resume_a_journal_another_one_flushed(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
) -> None:
    """Also from `sigterm-all`: the primary flushed a journal and suspended it for the
    restart, then the primary moved to another exiting broker, which resumed the journal with
    the next append and exited without persisting it. An exiting broker must leave a
    suspended journal suspended (the client retries; a broker that stays resumes it)."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "faults/flush-moved"
    spec = journal_spec(journal)
    spec.fragment.stores.append("file:///fragments/")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        await append(stub(brokers[0]), journal, b"one;")
        await append(stub(brokers[0]), journal, b"two;")
        fsm = await brokers[0].broker.service._flush(  # type: ignore[union-attr]
            brokers[0].broker.service.resolver.replicas[journal]  # type: ignore[union-attr,index]
        )
        assert fsm.status == pb.SUSPENDED, (pb.Status.Name(fsm.status), fsm.error)
        brokers[1].broker.service.ctx.exiting = True  # type: ignore[union-attr]
        async with brokers[0].client() as client:
            spec = (await client.list(pb.LabelSelector())).journals[0].spec
        # The primary moves to broker-b, exiting too (a PARTIAL suspension keeps one replica).
        await set_journal(etcd, etcd_prefix, spec, [("local", IDS[1])])
        outcome: object
        try:
            outcome = await append(
                stub(brokers[1]), journal, b"late;", do_not_proxy=True, timeout=20, check=False
            )
        except grpc.aio.AioRpcError as exc:
            outcome = exc.code()
        async with brokers[0].client() as client:
            suspend = (await client.list(pb.LabelSelector())).journals[0].spec.suspend
        assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.PARTIAL, 8), suspend
        assert outcome == grpc.StatusCode.UNAVAILABLE, outcome


async def test_the_exit_flush_leaves_a_journal_without_stores_alone(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A journal with no fragment store cannot be flushed (its content lives as long as a
    replica does): the exit flush must not try again and again until its timeout (it did, for
    20 s, at every stop of a broker holding one), nor suspend it."""
    import logging

    journal = "faults/no-stores"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS[:1]) as brokers:
        spec = journal_spec(journal, replication=1)
        await set_journal(etcd, etcd_prefix, spec, [("local", IDS[0])])
        await append(stub(brokers[0]), journal, b"kept only here;")
        with caplog.at_level(logging.WARNING, logger="broker.service"):
            await brokers[0].broker.service.flush_for_exit(timeout=3)  # type: ignore[union-attr]
        async with brokers[0].client() as client:
            spec = (await client.list(pb.LabelSelector())).journals[0].spec
    assert spec.suspend.level == pb.JournalSpec.Suspend.NONE, spec.suspend
    warnings = [r.getMessage() for r in caplog.records]
    assert not any("flush" in w for w in warnings), warnings


async def marked_exiting(brokers: list[BrokerHarness]) -> list[Any]:
    """Each broker marked exiting in etcd, as `stop` begins its exit, once every one's keyspace
    sees all of them exiting (so that nobody is left to take their journals): their services."""
    services = []
    for harness in brokers:
        server = harness.broker
        assert server.service is not None
        services.append(server.service)
        await server.etcd.put(
            server.member_key.encode(),
            server.spec(exiting=True).SerializeToString(),
            lease=server.lease_id,
        )
    await until(
        lambda: all(any(s._all_exiting(r) for r in s.resolver.replicas.values()) for s in services),
        "each broker's keyspace has seen them exit",
        timeout=10,
    )
    return services


async def test_the_exit_flush_keeps_a_journal_an_operator_suspended_suspended(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
) -> None:
    """A journal suspended before the exit (`gazctl journals suspend`: PARTIAL at its end) is
    settled by the exit flush as it is: the flush waits for its content to be in the store and
    leaves the suspension alone. It resumed it (suspension NONE), so brokers started later met
    INDEX_HAS_GREATER_OFFSET on it, and their exit flush retried until they were killed."""
    journal = "faults/suspended-before"
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    spec = journal_spec(journal, replication=1)
    spec.fragment.stores.append("file:///fragments/")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS[:1], file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", IDS[0])])
        await append(stub(brokers[0]), journal, b"persisted before the exit;")
        # As `gazctl journals suspend --force` does it: answered SUSPENDED once suspended.
        with pytest.raises(AppendError) as suspended:
            await append(stub(brokers[0]), journal, b"", suspend=pb.AppendRequest.SUSPEND_NOW)
        assert suspended.value.status == pb.SUSPENDED

        async def suspension() -> pb.JournalSpec.Suspend:
            async with brokers[0].client() as client:
                listing = await client.list(pb.LabelSelector())
            return listing.journals[0].spec.suspend

        before = await suspension()
        assert (before.level, before.offset) == (pb.JournalSpec.Suspend.PARTIAL, 26)
        # The broker exits, as `stop` begins it: marked exiting, so that nobody is left to take
        # the journal over, and the exit flush settles it.
        (service,) = await marked_exiting(brokers)
        await service.flush_for_exit(timeout=10)
        assert journal in service.ctx.sealed  # Settled by the flush, not left alone.
        after = await suspension()
    assert (after.level, after.offset) == (before.level, before.offset)
    names = [
        p.name.split("-")
        for p in (root / "fragments" / journal).iterdir()
        if not p.name.startswith(".")
    ]
    assert [(int(n[0], 16), int(n[1], 16)) for n in names] == [(0, 26)]


# ---- the fault campaign's finding 2: a fragment rolled by a new primary's synchronization -----


async def test_a_replica_persists_at_once_the_fragment_a_new_primary_rolled(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
) -> None:
    """`sigkill`, seed 20261124: the primary died with its open fragment on the replicas; a
    new primary (with an empty spool) synchronized and rolled everyone past it. A replica
    completed it, but as a replica it waited out the persist interval before persisting it, and
    a second fault within that interval lost it. A fragment rolled by a synchronization (a new
    pipeline: the route changed) is persisted at once by the replicas holding it."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "faults/sync-roll"
    spec = journal_spec(journal, replication=2)
    spec.fragment.stores.append("file:///fragments/")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root), persist_interval=60.0
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", IDS[0]), ("local", IDS[1])])
        await append(stub(brokers[0]), journal, b"first;")
        await append(stub(brokers[0]), journal, b"second;")  # Rolls the first write's fragment.
        await append(stub(brokers[0]), journal, b"third;")  # [13, 19): open, not persisted.
        # The primary is gone; broker-c, with an empty spool, is the new primary.
        await set_journal(etcd, etcd_prefix, spec, [("local", IDS[2]), ("local", IDS[1])])
        response = await append(stub(brokers[2]), journal, b"fourth;", timeout=20)
        assert (response.commit.begin, response.commit.end) == (19, 26)

        def persisted() -> list[tuple[int, int]]:
            directory = root / "fragments" / journal
            files = directory.iterdir() if directory.exists() else iter(())
            # Fragments only: not the store's partial files, which are linked into place.
            names = [p.name.split("-") for p in files if FRAGMENT_NAME.match(p.name)]
            return sorted((int(n[0], 16), int(n[1], 16)) for n in names)

        await until(lambda: (6, 19) in persisted() or (13, 19) in persisted(), timeout=10)


# ---- the fault campaign's finding 4: a journal going on past a hole ---------------------------


async def test_the_primary_tells_the_operator_of_a_hole_in_its_journal(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`etcd-outage`: every replica was lost one at a time, and the journal went on past the
    offsets they held, with a hole nobody will fill: reads from before it stop there (as
    upstream's, until the fragment after it is old) and nothing said so. Here the hole is a
    fragment gone from the store. Once it has lasted HOLE_GRACE, the primary's pulse logs a
    warning naming the journal, the offsets and what to do; once, not at every pulse."""
    import logging

    from broker import service as service_module

    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "faults/hole"
    spec = journal_spec(journal, length=4)  # Appends roll: fragments are persisted.
    spec.fragment.stores.append("file:///fragments/")
    monkeypatch.setattr(service_module, "HOLE_GRACE", 0.0)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        for content in (b"one;", b"two;", b"six;", b"ten;"):
            await append(stub(brokers[0]), journal, content)
        directory = root / "fragments" / journal
        await until(lambda: len(list(directory.iterdir())) >= 2)  # [0, 4) and [4, 12).
        service = brokers[0].broker.service
        replica = service.resolver.replicas[journal]  # type: ignore[union-attr,index]
        assert replica.index.holes() == []

        def listed_and_refreshed(want: bool) -> bool:
            # The local copy goes once a listing covers it; then a listing misses it.
            replica.index.refresh_requested.set()
            local = [(f.begin, f.end) for f in replica.index.local_fragments()]
            every = [(f.begin, f.end) for f in replica.index.fragments()]
            return (4, 12) not in local and ((4, 12) in every) == want

        await until(lambda: listed_and_refreshed(True), timeout=30)
        for path in directory.iterdir():
            if path.name.startswith("0000000000000004-000000000000000c-"):
                path.unlink()  # Gone from the store (a too eager retention, say).
        await until(lambda: listed_and_refreshed(False), timeout=30)
        assert replica.index.holes() == [(4, 12)]
        with caplog.at_level(logging.WARNING, logger="broker.service"):
            await service.pulse(replica)  # type: ignore[union-attr]
            await service.pulse(replica)  # type: ignore[union-attr]
        warnings = [r.getMessage() for r in caplog.records if "hole" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert journal in warnings[0] and "[4, 12)" in warnings[0], warnings[0]


async def test_a_broker_with_nobody_to_drain_to_stops_without_a_drain_warning(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The last broker stopping (every other member exiting or gone) does not wait for a drain
    nobody can take, and does not warn that its journals were not drained: the exit flush is
    what settles them. (It warned at every `gazctl dev down`.)"""
    import logging

    journal = "faults/last-broker"
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS[:1], run_allocator=True
    ) as brokers:
        assert brokers[0].broker._allocator is not None
        await set_journal(
            etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])]
        )
        await append(stub(brokers[0]), journal, b"x")
        loop = asyncio.get_running_loop()
        began = loop.time()
        with caplog.at_level(logging.WARNING, logger="broker.server"):
            await brokers[0].broker.stop(grace=1)
        took = loop.time() - began
    warnings = [r.getMessage() for r in caplog.records if r.name == "broker.server"]
    assert not any("not drained" in w for w in warnings), warnings
    assert took < brokers[0].broker.config.drain_timeout, took


async def test_the_exit_flush_of_an_empty_journal_ends_on_every_broker(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
) -> None:
    """Every broker of a journal nobody ever wrote exits: its primary has nothing to flush
    (and suspends nothing), so its other replicas must not wait for a suspension that never
    comes. They did, until the flush's timeout, and `gazctl dev down` killed them."""
    journal = "faults/never-written"
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    spec = journal_spec(journal)
    spec.fragment.stores.append("file:///fragments/")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, IDS, file_root=str(root)
    ) as brokers:
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        await append(stub(brokers[0]), journal, b"")  # Routed and synchronized, still empty.
        services = await marked_exiting(brokers)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.gather(*(s.flush_for_exit(timeout=8) for s in services))
        took = loop.time() - began
        async with brokers[0].client() as client:
            listed = (await client.list(pb.LabelSelector())).journals[0].spec
    assert took < 4, f"the exit flush took {took:.1f}s"
    assert listed.suspend.level == pb.JournalSpec.Suspend.NONE  # Nothing was written.
