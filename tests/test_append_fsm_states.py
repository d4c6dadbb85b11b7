"""The append FSM state by state, as upstream tests its own: a real broker (the primary, in
process, on a real etcd) and a scripted peer, a Replicate endpoint whose every answer the test
chooses. Each test steps the FSM one state at a time and checks where it goes, what the peer
received, and what the primary's spool and pipeline hold."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest
from aetcd import transactions

from allocator import keyspace as aks
from broker.append_fsm import AppendFSM, Chunk, State
from broker.protocol import protocol_pb2 as pb
from broker.service import JournalService
from broker.testing import BrokerHarness, EtcdServer
from plumbing import etcd as etcdx
from tests.helpers.journals import journal_spec, set_journal, started_brokers
from tests.helpers.waiting import until

PRIMARY = "broker-a"
PEER = "scripted"


class ScriptedPeer:
    """A Replicate endpoint: records every request; answers each acknowledged one with the
    next response the test queued (or ends the stream with an error for an exception)."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[pb.ReplicateRequest] = asyncio.Queue()
        self.answers: asyncio.Queue[pb.ReplicateResponse | grpc.StatusCode] = asyncio.Queue()
        self.server = grpc.aio.server()
        self.endpoint = ""

    async def start(self) -> str:
        handler = grpc.stream_stream_rpc_method_handler(
            self._replicate,
            request_deserializer=pb.ReplicateRequest.FromString,
            response_serializer=pb.ReplicateResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("protocol.Journal", {"Replicate": handler}),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    async def _replicate(
        self, requests: AsyncIterator[pb.ReplicateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReplicateResponse]:
        async for request in requests:
            self.received.put_nowait(request)
            if request.acknowledge:
                answer = await self.answers.get()
                if isinstance(answer, grpc.StatusCode):
                    await context.abort(answer, "scripted failure")
                yield answer

    async def next_request(self) -> pb.ReplicateRequest:
        async with asyncio.timeout(10):
            return await self.received.get()

    async def stop(self) -> None:
        await self.server.stop(0)


@pytest.fixture
async def cluster(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[BrokerHarness, ScriptedPeer]]:
    # The primary's pulse would race the test for the pipeline: its pulses do nothing here.
    async def no_pulse(self: JournalService, replica: object) -> None:
        pass

    monkeypatch.setattr(JournalService, "pulse", no_pulse)
    peer = ScriptedPeer()
    endpoint = await peer.start()
    lease = await etcd.lease(30)
    spec = pb.BrokerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="local", suffix=PEER), endpoint=endpoint
        ),
        journal_limit=100,
    )
    key = aks.member_key(etcd_prefix, "local", PEER).encode()
    await etcdx.txn(etcd, [], [transactions.Put(key, spec.SerializeToString(), lease=lease.id)])
    try:
        async with started_brokers(etcd_server.endpoint, etcd_prefix, [PRIMARY]) as brokers:
            yield brokers[0], peer
    finally:
        await peer.stop()
        with contextlib.suppress(Exception):  # (Gone with the test's prefix, perhaps.)
            await lease.revoke()


def fsm_for(h: BrokerHarness, journal: str, **fields: object) -> AppendFSM:
    return AppendFSM(h.broker.service.ctx, pb.AppendRequest(journal=journal, **fields))  # type: ignore[arg-type]


async def step(fsm: AppendFSM, chunk: Chunk | None = None) -> State:
    """Run the method of the FSM's current state once; the state it moved to."""
    if fsm.state == State.STREAM_CONTENT:
        assert chunk is not None
        await fsm.state_stream_content(chunk)
    else:
        method = getattr(fsm, f"state_{fsm.state.value}")
        await method()
    return fsm.state


async def placed(h: BrokerHarness, etcd: aetcd.Client, root: str, journal: str) -> None:
    """The journal on the primary and the scripted peer, once the primary sees it."""
    await set_journal(
        etcd, root, journal_spec(journal, replication=2), [("local", PRIMARY), ("local", PEER)]
    )
    await until(
        lambda: journal in (h.broker.service.resolver.replicas or {}),
        f"the primary resolves {journal}",
        timeout=10,
        interval=0.01,
    )


async def synchronized(fsm: AppendFSM, peer: ScriptedPeer) -> list[State]:
    """Step from RESOLVE through a first synchronization the peer agrees to."""
    states = [await step(fsm), await step(fsm), await step(fsm)]
    assert states == [State.ACQUIRE_PIPELINE, State.START_PIPELINE, State.SEND_PIPELINE_SYNC]
    assert await step(fsm) == State.RECV_PIPELINE_SYNC
    sync = await peer.next_request()
    assert sync.HasField("header") and sync.acknowledge
    assert sync.header.process_id.suffix == PEER  # Addressed to the peer.
    peer.answers.put_nowait(pb.ReplicateResponse(status=pb.OK))
    states.append(await step(fsm))
    return states


async def test_a_first_append_goes_through_every_state(
    cluster: tuple[BrokerHarness, ScriptedPeer], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    h, peer = cluster
    await placed(h, etcd, etcd_prefix, "fsm/first")
    fsm = fsm_for(h, "fsm/first")
    states = await synchronized(fsm, peer)
    assert states[-1] == State.UPDATE_ASSIGNMENTS
    # The route is written into the assignments, then resolved again at that revision.
    assert await step(fsm) == State.RESOLVE
    assert fsm.read_through_rev > 0
    assert await step(fsm) == State.START_PIPELINE  # Still owning the pipeline.
    assert await step(fsm) == State.UPDATE_ASSIGNMENTS  # Same route: kept, no new sync.
    assert await step(fsm) == State.AWAIT_DESIRED_REPLICAS
    assert await step(fsm) == State.VALIDATE_PRECONDITIONS
    assert await step(fsm) == State.STREAM_CONTENT

    assert await step(fsm, Chunk(pb.AppendRequest(content=b"hello"))) == State.STREAM_CONTENT
    content = await peer.next_request()
    assert (content.content, content.content_delta) == (b"hello", 0)
    assert await step(fsm, Chunk(pb.AppendRequest())) == State.STREAM_CONTENT  # The commit.
    assert await step(fsm, Chunk(None)) == State.READ_ACKNOWLEDGEMENTS
    proposal = await peer.next_request()
    assert (proposal.proposal.begin, proposal.proposal.end) == (0, 5) and proposal.acknowledge
    peer.answers.put_nowait(pb.ReplicateResponse(status=pb.OK))
    await fsm.state_read_acknowledgements()
    assert fsm.state == State.FINISHED
    assert fsm.client_fragment is not None and fsm.client_fragment.end == 5
    replica = h.broker.service.resolver.replicas["fsm/first"]  # type: ignore[index]
    pln = await replica.pipeline_queue.get()  # Returned for the next append.
    assert pln is not None and pln.spool.fragment.end == 5
    replica.pipeline_queue.put_nowait(pln)


async def test_a_peer_further_ahead_rolls_everyone_forward(
    cluster: tuple[BrokerHarness, ScriptedPeer], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    h, peer = cluster
    await placed(h, etcd, etcd_prefix, "fsm/ahead")
    fsm = fsm_for(h, "fsm/ahead")
    for _ in range(4):
        await step(fsm)
    await peer.next_request()
    ahead = pb.Fragment(journal="fsm/ahead", begin=40, end=100, compression_codec=pb.NONE)
    peer.answers.put_nowait(
        pb.ReplicateResponse(
            status=pb.PROPOSAL_MISMATCH,
            fragment=ahead,
            registers=pb.LabelSet(labels=[pb.Label(name="owner", value="x")]),
        )
    )
    assert await step(fsm) == State.SEND_PIPELINE_SYNC
    assert fsm.roll_to_offset == 100
    assert [(label.name, label.value) for label in fsm.registers.labels] == [("owner", "x")]
    assert await step(fsm) == State.RECV_PIPELINE_SYNC
    roll = await peer.next_request()
    assert (roll.proposal.begin, roll.proposal.end) == (100, 100)
    peer.answers.put_nowait(pb.ReplicateResponse(status=pb.OK))
    assert await step(fsm) == State.UPDATE_ASSIGNMENTS
    assert fsm.pln is not None and fsm.pln.spool.fragment.end == 100
    fsm.return_pipeline()


async def test_a_peer_on_a_newer_route_sends_the_fsm_to_resolve_again(
    cluster: tuple[BrokerHarness, ScriptedPeer], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    h, peer = cluster
    await placed(h, etcd, etcd_prefix, "fsm/route")
    fsm = fsm_for(h, "fsm/route")
    for _ in range(4):
        await step(fsm)
    sync = await peer.next_request()
    newer = pb.Header()
    newer.CopyFrom(sync.header)
    newer.etcd.revision += 5
    newer.route.primary = 1  # Another primary: the peer knows better.
    peer.answers.put_nowait(pb.ReplicateResponse(status=pb.WRONG_ROUTE, header=newer))
    assert await step(fsm) == State.RESOLVE
    assert fsm.read_through_rev == newer.etcd.revision
    assert fsm.pln is None  # The pipeline on the old route is being torn down.
    fsm.return_pipeline()


@pytest.mark.parametrize("answer", ["abort", "mismatch"])
async def test_a_failed_commit_is_an_error_and_the_pipeline_is_rebuilt(
    answer: str,
    cluster: tuple[BrokerHarness, ScriptedPeer],
    etcd: aetcd.Client,
    etcd_prefix: str,
) -> None:
    """The peer refuses the commit (a stream error, or a mismatching fragment): the append
    fails, and the next append builds and synchronizes a new pipeline."""
    h, peer = cluster
    journal = f"fsm/{answer}"
    await placed(h, etcd, etcd_prefix, journal)
    fsm = fsm_for(h, journal)
    await synchronized(fsm, peer)
    while fsm.state != State.STREAM_CONTENT:
        await step(fsm)
    await step(fsm, Chunk(pb.AppendRequest(content=b"x")))
    await step(fsm, Chunk(pb.AppendRequest()))
    await step(fsm, Chunk(None))
    await peer.next_request()
    await peer.next_request()
    if answer == "abort":
        peer.answers.put_nowait(grpc.StatusCode.UNAVAILABLE)
    else:
        other = pb.Fragment(journal=journal, begin=0, end=0, compression_codec=pb.NONE)
        peer.answers.put_nowait(pb.ReplicateResponse(status=pb.PROPOSAL_MISMATCH, fragment=other))
    await fsm.state_read_acknowledgements()
    assert fsm.state == State.ERROR and fsm.error is not None

    # The next append does not reuse the pipeline (even when its stream is still open, as
    # after a mismatch: the peer is out of step): it builds and synchronizes a new one.
    second = fsm_for(h, journal)
    await synchronized(second, peer)
    second.return_pipeline()


async def test_a_teardown_cancelled_behind_a_reader_fails_the_read_quietly(
    cluster: tuple[BrokerHarness, ScriptedPeer],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pipeline teardown waits its turn behind an append reading its acknowledgements, and
    is cancelled there (a broker stopping cancels its teardown tasks; a fenced replica's
    shutdown cancels its fence's teardown at once), which cancels the pipeline's streams under
    the reader. The append fails as any whose acknowledgements could not be read (ERROR, a
    pipeline error): no InvalidStateError from its turn's barrier, which the teardown's
    cancelled wait must not cancel, and no CancelledError out of a read the append's own task
    did not cancel."""
    h, peer = cluster
    journal = "fsm/teardown"
    await placed(h, etcd, etcd_prefix, journal)
    fsm = fsm_for(h, journal)
    await synchronized(fsm, peer)
    while fsm.state != State.STREAM_CONTENT:
        await step(fsm)
    await step(fsm, Chunk(pb.AppendRequest(content=b"x")))
    await step(fsm, Chunk(pb.AppendRequest()))
    await step(fsm, Chunk(None))
    await peer.next_request()
    await peer.next_request()  # The commit's proposal: its acknowledgement is held.
    pln = fsm.pln
    assert pln is not None
    reading = asyncio.ensure_future(fsm.state_read_acknowledgements())
    replica = h.broker.service.resolver.replicas[journal]  # type: ignore[index]
    async with asyncio.timeout(5):
        assert await replica.pipeline_queue.get() is pln  # Released to the next user.
    teardown = asyncio.ensure_future(pln.shutdown(expect_err=False))
    # A hold, the thing under test: the teardown waits for the reader's turn to end, so in
    # this while neither ends.
    await asyncio.sleep(0.2)  # The hold.
    assert not teardown.done() and not reading.done()
    teardown.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await teardown
    peer.answers.put_nowait(pb.ReplicateResponse(status=pb.OK))  # Too late: streams cancelled.
    async with asyncio.timeout(5):
        await reading
    assert fsm.state == State.ERROR and fsm.error is not None, fsm.state
    assert "InvalidStateError" not in caplog.text
    replica.pipeline_queue.put_nowait(None)


async def test_a_teardown_whose_half_close_fails_in_grpc_core_is_quiet(
    cluster: tuple[BrokerHarness, ScriptedPeer],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's `done_writing` lets a failure of its batch in core escape as ExecuteBatchError (a
    `write` turns the same into an AioRpcError): a peer's stream reset under a loaded loop. A
    pipeline teardown half-closing such a stream records it as that peer's send error, goes
    on to release the spool and end the other streams, and nothing fails with (or logs)
    ExecuteBatchError. (Injected here: the failure needs core to fail the half-close batch.)"""
    from grpc._cython import cygrpc

    from broker import pipeline

    # The scripted peer never saw the half-close, so it never ends its stream: the teardown
    # waits out its bound for the peer's EOF (10 s), shortened here.
    monkeypatch.setattr(pipeline, "SHUTDOWN_TIMEOUT", 0.5)
    h, peer = cluster
    journal = "fsm/halfclose"
    await placed(h, etcd, etcd_prefix, journal)
    fsm = fsm_for(h, journal)
    await synchronized(fsm, peer)
    pln = fsm.pln
    assert pln is not None
    [stream] = [s for s in pln.streams if s is not None]

    async def fails_in_core() -> None:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendCloseFromClientOperation,)')

    stream.done_writing = fails_in_core
    fsm.return_pipeline()
    replica = h.broker.service.resolver.replicas[journal]  # type: ignore[index]
    assert await replica.pipeline_queue.get() is pln
    async with asyncio.timeout(15):
        await pln.shutdown(expect_err=False)
    assert "execute_batch" in str(pln.send_err())  # Recorded, as any send failure.
    assert replica.spool_queue.qsize() == 1  # The spool was released.
    assert "ExecuteBatchError" not in caplog.text  # No task or append failed with it.
    replica.pipeline_queue.put_nowait(None)
