"""Fault campaign finding 5: proxied appends while the primary ends the call early or goes away.

A broker that is not a journal's primary forwards the whole append stream to the primary. When
the primary answers before the stream's end (a failed precondition: it reads no more), or dies,
the client must get a clean answer it can act on: the primary's own status, or UNAVAILABLE for
a primary it cannot reach. Before the fix the proxying broker wrote on into the finished call,
logged `InvalidStateError: RPC already finished` and answered UNKNOWN, and AppendService gave
up on codes it would have retried as UNAVAILABLE."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import grpc
import pytest

from broker.append_api import relayed_code
from broker.client import routes
from broker.client.append_service import AppendService, Span
from broker.client.appender import append
from broker.client.routes import CORE_SEND_FAILURE, append_routed, is_transient, transient_reason
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import append_streams, journal_spec, set_journal, started_brokers
from tests.helpers.waiting import until

IDS = ["broker-p", "broker-q"]


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as harnesses:
        yield harnesses


def stub(h: BrokerHarness):  # type: ignore[no-untyped-def]
    return h.broker.service.dialer.journal_stub(h.endpoint)


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info is not None]


async def slow_content(chunks: int) -> AsyncIterator[bytes]:
    for _ in range(chunks):
        await asyncio.sleep(0.02)  # The primary answers while these are still on their way.
        yield b"z" * (64 << 10)


async def test_a_proxied_append_the_primary_refuses_early_gets_the_primarys_status(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The primary refuses the append at its preconditions (REGISTER_MISMATCH) and ends the call
    while the client still streams content through the proxying broker: the client gets
    REGISTER_MISMATCH, and nothing is appended."""
    journal = "faults/proxied"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    first = await append(
        stub(brokers[0]),
        journal,
        b"mine;",
        union_registers=pb.LabelSet(labels=[pb.Label(name="owner", value="a")]),
    )
    check = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="owner", value="b")]))
    with caplog.at_level(logging.WARNING):
        response = await append(
            stub(brokers[1]), journal, slow_content(40), check_registers=check, check=False
        )
        await asyncio.sleep(0.2)  # A hold: a traceback logged after the answer shows meanwhile.
    assert response.status == pb.REGISTER_MISMATCH, response
    assert tracebacks(caplog) == []
    head = await append(stub(brokers[0]), journal, b"")
    assert head.commit.end == first.commit.end  # The refused content went nowhere.


async def test_a_proxied_append_to_a_primary_that_dies_mid_stream_is_unavailable(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The primary's server stops while the proxying broker streams to it: the client gets
    UNAVAILABLE (which every client retries), never UNKNOWN or INTERNAL."""
    journal = "faults/orphaned"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    await append(stub(brokers[0]), journal, b"first;")
    streams = append_streams(monkeypatch)  # The proxying broker's, then the primary's.

    async def kill_soon() -> None:
        await until(
            lambda: len(streams) >= 2 and streams[1].bytes_received > 0,
            "the primary reads the proxied content",
        )
        server = brokers[0].broker.server
        assert server is not None
        await server.stop(grace=0)

    with caplog.at_level(logging.WARNING):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(kill_soon())
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await append(stub(brokers[1]), journal, slow_content(100))
        await asyncio.sleep(0.2)  # A hold: a traceback logged after the answer shows meanwhile.
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert tracebacks(caplog) == []


class Retries(logging.Handler):
    """The retries AppendService logs ("append to ... failed (retrying in ...)"), and an event
    set at the first, to await rather than sleep for."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        self.first = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "failed (retrying in" in message:
            self.reasons.append(message)
            self.first.set()  # The service logs from its sender, on the loop.


async def test_append_service_retries_a_proxied_append_through_a_primary_change(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """AppendService sends through the broker that is not primary while the primary is gone:
    the proxy answers UNAVAILABLE, which the service retries (its own retry, not the test's)
    until the journal moves to the proxying broker; then the batch lands, once, and the next
    one after it, each record where its span says."""
    journal = "faults/moving"
    members = [("local", IDS[0]), ("local", IDS[1])]
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), members[:1])
    await append(stub(brokers[0]), journal, b"")
    server = brokers[0].broker.server
    assert server is not None
    await server.stop(grace=0)  # Before the first write: its first attempt cannot land.

    retries = Retries()
    service_log = logging.getLogger("broker.client.append_service")
    service_log.addHandler(retries)
    try:
        with caplog.at_level(logging.WARNING, logger=service_log.name):
            async with AppendService(lambda name: stub(brokers[1]), max_retry_delay=0.2) as service:
                spans = [service.write_nowait(journal, b"%03d;" % i) for i in range(20)]
                # The first batch's first attempt fails: it waits to retry (or, without the
                # retry, it has failed, and the test with it at once).
                retried = asyncio.ensure_future(retries.first.wait())
                first = asyncio.ensure_future(asyncio.gather(*spans))
                await asyncio.wait(
                    [retried, first], timeout=30, return_when=asyncio.FIRST_COMPLETED
                )
                retried.cancel()
                assert retries.reasons and not first.done(), first
                # Queued behind the batch being retried: the next batch.
                spans += [service.write_nowait(journal, b"%03d;" % i) for i in range(20, 40)]
                await set_journal(
                    etcd, etcd_prefix, journal_spec(journal, replication=1), members[1:]
                )
                async with asyncio.timeout(30):
                    written = [await span for span in spans]
                assert service.appends == 2  # Two batches, each committed once.
    finally:
        service_log.removeHandler(retries)
    assert retries.reasons[0].startswith(f"append to {journal} failed"), retries.reasons
    assert "UNAVAILABLE" in retries.reasons[0], retries.reasons
    assert tracebacks(caplog) == []

    records = [b"%03d;" % i for i in range(40)]
    begin = written[0].begin
    assert written == [Span(journal, begin + 4 * i, begin + 4 * i + 4) for i in range(40)]
    content = bytearray()
    async for r in stub(brokers[1]).Read(pb.ReadRequest(journal=journal, offset=0, block=False)):
        if r.status != pb.OK:
            break
        content += r.content
    assert bytes(content) == b"".join(records)  # Every record once, in order, nothing else.
    assert [bytes(content[s.begin : s.end]) for s in written] == records


async def test_a_proxied_append_that_never_reached_the_primary_is_sent_again(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy could not reach the primary: the append cannot have landed, though the client
    had sent its commit, and the proxy says so (its trailer): the library's appender sends it
    again once the journal moves. An append that failed after its commit was sent, with no such
    word, may have landed: it is not sent again."""
    journal = "faults/unreached"
    members = [("local", IDS[0]), ("local", IDS[1])]
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), members[:1])
    await append(stub(brokers[0]), journal, b"")
    server = brokers[0].broker.server
    assert server is not None
    await server.stop(grace=0)  # The primary is unreachable; broker-q proxies to it.

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await append(stub(brokers[1]), journal, b"one;")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.commit_sent  # type: ignore[attr-defined]
    assert transient_reason(failed.value) == "UNAVAILABLE"  # The proxy's word: not appended.

    attempts: list[BaseException | None] = []
    real = routes.append

    async def recorded(*args: Any, **kwargs: Any) -> pb.AppendResponse:
        try:
            response = await real(*args, **kwargs)
        except BaseException as exc:
            attempts.append(exc)
            raise
        attempts.append(None)
        return response

    monkeypatch.setattr(routes, "append", recorded)

    async def move_soon() -> None:
        # Once append_routed's first attempt failed (so it is sent again after the move).
        await until(lambda: attempts, "append_routed's first attempt ended")
        await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), members[1:])

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(move_soon())
        response = await append_routed(stub(brokers[1]), journal, b"two;", wait=30)
    assert response.commit.end - response.commit.begin == 4
    assert attempts[0] is not None and attempts[-1] is None  # Refused, then sent again.

    unknown = rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    unknown.commit_sent = True  # type: ignore[attr-defined]
    assert transient_reason(unknown) is None  # The primary died with the commit: unknown.
    unknown.commit_sent = False  # type: ignore[attr-defined]
    assert transient_reason(unknown) == "UNAVAILABLE"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details", "transient", "relayed"),
    [
        (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", True, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.INTERNAL, CORE_SEND_FAILURE, True, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.CANCELLED, "Locally cancelled", False, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.INTERNAL, "a bug at the peer", False, grpc.StatusCode.INTERNAL),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad name", False, grpc.StatusCode.INVALID_ARGUMENT),
        (grpc.StatusCode.UNKNOWN, "Unexpected error", False, grpc.StatusCode.UNKNOWN),
    ],
)
def test_which_failures_clients_retry_and_proxies_answer_unavailable(
    code: grpc.StatusCode, details: str, transient: bool, relayed: grpc.StatusCode
) -> None:
    """A send that failed in gRPC's own client (the peer had reset the stream) carried no
    answer: clients retry it (for an append, its commit was never sent), and a proxy answers it
    UNAVAILABLE; a peer's own INTERNAL or UNKNOWN is relayed as it is, and not retried."""
    exc = rpc_error(code, details)
    assert is_transient(exc) is transient
    assert relayed_code(exc) == relayed


SUSPEND_ROUNDS = 30


async def test_suspends_forced_through_a_broker_that_is_not_primary_get_the_primarys_answer(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """`gazctl journals suspend --force` through a broker that is not the journal's primary,
    many times: the primary answers the zero-byte suspend at its first message, while the proxy
    may still be forwarding the commit chunk the client sent right behind it. Every suspend gets
    the primary's answer (SUSPENDED: the journal is suspended), never the proxy's failed late
    write (it was "INTERNAL: Internal error from Core" 3 times in 9 through gazctl, though every
    suspension was applied)."""
    journal = "faults/suspended"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    outcomes: list[str] = []
    for _ in range(SUSPEND_ROUNDS):
        await append(stub(brokers[0]), journal, b"resumes;")  # Any append resumes it.
        try:
            response = await append(
                stub(brokers[1]), journal, b"", suspend=pb.AppendRequest.SUSPEND_NOW, check=False
            )
            outcomes.append(pb.Status.Name(response.status))
        except grpc.aio.AioRpcError as exc:
            outcomes.append(f"{exc.code().name}: {exc.details()}")
    assert outcomes == ["SUSPENDED"] * SUSPEND_ROUNDS


MISMATCH_ROUNDS = 30


async def test_proxied_appends_with_wrong_registers_all_get_register_mismatch(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """Appends whose check_registers do not match, through a broker that is not primary, with
    their content sent at once: the primary refuses each at its first message while the proxy
    still forwards the content behind it. Every one gets REGISTER_MISMATCH (the primary's
    answer), never UNAVAILABLE from a late write that failed, and nothing is appended."""
    journal = "faults/mismatched"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    first = await append(
        stub(brokers[0]),
        journal,
        b"mine;",
        union_registers=pb.LabelSet(labels=[pb.Label(name="owner", value="a")]),
    )
    check = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="owner", value="b")]))
    outcomes: list[str] = []
    for _ in range(MISMATCH_ROUNDS):
        try:
            response = await append(
                stub(brokers[1]), journal, b"z" * (256 << 10), chunk_size=16 << 10,
                check_registers=check, check=False,
            )  # fmt: skip
            outcomes.append(pb.Status.Name(response.status))
        except grpc.aio.AioRpcError as exc:
            outcomes.append(f"{exc.code().name}: {exc.details()}")
    assert outcomes == ["REGISTER_MISMATCH"] * MISMATCH_ROUNDS
    head = await append(stub(brokers[0]), journal, b"")
    assert head.commit.end == first.commit.end  # The refused content went nowhere.
