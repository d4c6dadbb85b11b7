"""AppendService against real in-process brokers: batching, order, spans, back-pressure,
retries while a journal is not yet placed, and failures that are not retried."""

from __future__ import annotations

import asyncio
import gc
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import grpc
import pytest

from broker.client import append_service
from broker.client.append_service import AppendService, DependencyFailed, Span
from broker.client.appender import AppendError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec, read_all, set_journal, started_brokers
from tests.helpers.loop import StallProbe
from tests.helpers.waiting import until

IDS = ["broker-a", "broker-b"]


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as hs:
        yield hs


def stub(h: BrokerHarness):  # type: ignore[no-untyped-def]
    return h.broker.service.dialer.journal_stub(h.endpoint)


async def test_records_batch_in_order_with_exact_spans(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    for name in ("svc/a", "svc/b"):
        await set_journal(
            etcd, etcd_prefix, journal_spec(name, replication=2), [("local", i) for i in IDS]
        )
    records = {
        name: [f"{name}:{i:04d}\n".encode() for i in range(500)] for name in ("svc/a", "svc/b")
    }
    async with AppendService(stub(brokers[1]), max_batch=2048) as service:
        futures = {name: [await service.write(name, r) for r in rs] for name, rs in records.items()}
        spans = {name: await asyncio.gather(*fs) for name, fs in futures.items()}
    for name, rs in records.items():
        content = await read_all(brokers[0], name)
        assert content == b"".join(rs)  # Order preserved, each record once.
        offsets = [(s.begin, s.end) for s in spans[name]]
        assert offsets == sorted(offsets)
        for record, span in zip(rs, spans[name], strict=True):
            assert span.journal == name and content[span.begin : span.end] == record
    # Batched: far fewer appends than the 1,000 records.
    assert 2 <= service.appends < 100


async def test_back_pressure_bounds_pending_bytes(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/bp", replication=2), [("local", i) for i in IDS]
    )
    async with AppendService(stub(brokers[0]), max_batch=1000, max_pending=4000) as service:
        highest = 0
        futures = []
        for _ in range(100):
            futures.append(await service.write("svc/bp", b"x" * 500))
            highest = max(highest, service._journals["svc/bp"].pending)
        await asyncio.gather(*futures)
    assert highest <= 4000 + 500


async def test_retries_until_the_journal_is_placed_and_fails_on_permanent_errors(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Replication 2, but only one broker assigned: INSUFFICIENT_JOURNAL_BROKERS is retried.
    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/later", replication=2), [("local", "broker-a")]
    )
    async with AppendService(stub(brokers[0]), max_retry_delay=0.1) as service:
        future = await service.write("svc/later", b"eventually\n")
        await until(
            lambda: caplog.text.count("append to svc/later failed (retrying") >= 2,
            "the unplaced journal's append refused twice, and retried",
        )
        assert not future.done()
        await set_journal(
            etcd, etcd_prefix, journal_spec("svc/later", replication=2), [("local", i) for i in IDS]
        )
        span = await asyncio.wait_for(future, 10)
        assert span == Span("svc/later", 0, 11)

        missing = await service.write("svc/absent", b"x")
        with pytest.raises(AppendError) as info:
            await missing
        assert info.value.status == pb.JOURNAL_NOT_FOUND


async def test_a_write_after_a_dependency_holds_the_journal_until_it_completes(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """An ACK intent queued as its transaction starts to commit: written before it lands
    first; written after it waits behind it; nothing of it is appended until the commit is
    done, and a commit that fails fails it, while the journal goes on. `pending_except` gives
    the batches to wait for, but those of the journals it is told to leave out."""
    name = "svc/ordered"
    await set_journal(
        etcd, etcd_prefix, journal_spec(name, replication=2), [("local", i) for i in IDS]
    )
    loop = asyncio.get_running_loop()
    async with AppendService(stub(brokers[0])) as service:
        before = await service.write(name, b"before;")
        commit: asyncio.Future[None] = loop.create_future()
        ack = service.write_after(name, b"ack;", commit)
        after = await service.write(name, b"after;")
        assert len(service.pending_except()) == 3 and service.pending_except(name) == []
        await before
        await asyncio.sleep(0.2)  # A hold: nothing behind the uncommitted dependency lands.
        assert not ack.done() and not after.done()
        assert await read_all(brokers[0], name) == b"before;"
        commit.set_result(None)
        assert (await ack).begin == len(b"before;") and (await after).begin == len(b"before;ack;")

        failed: asyncio.Future[None] = loop.create_future()
        lost = service.write_after(name, b"never;", failed)
        later = await service.write(name, b"later;")
        failed.set_exception(RuntimeError("the store refused the commit"))
        with pytest.raises(DependencyFailed, match="failed: the store refused the commit"):
            await lost
        await later
    assert await read_all(brokers[0], name) == b"before;ack;after;later;"


async def test_register_checks_and_barriers_go_in_order_and_a_mismatch_is_not_retried(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """A write with registers is an append of its own, in order: a union takes the journal,
    a check that holds commits, one that does not fails with REGISTER_MISMATCH at once (not
    retried), and what waits on it fails too; barriers resolve at the write head once
    everything before them committed, and change registers without content."""
    from broker.client.append_service import Registers

    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/reg", replication=2), [("local", i) for i in IDS]
    )

    def owner(name: str) -> pb.LabelSet:
        return pb.LabelSet(labels=[pb.Label(name="owner", value=name)])

    def owned_by(name: str) -> pb.LabelSelector:
        return pb.LabelSelector(include=owner(name))

    async with AppendService(stub(brokers[0]), max_retry_delay=0.05) as service:
        first = await service.write("svc/reg", b"one\n")
        taken = await service.write("svc/reg", b"two\n", Registers(union=owner("a")))
        more = await service.write("svc/reg", b"three\n")
        checked = await service.write("svc/reg", b"four\n", Registers(check=owned_by("a")))
        barrier = service.barrier("svc/reg")
        spans = [await f for f in (first, taken, more, checked)]
        assert [(s.begin, s.end) for s in spans] == [(0, 4), (4, 8), (8, 14), (14, 19)]
        assert await barrier == Span("svc/reg", 19, 19)

        appends_before = service.appends
        refused = await service.write("svc/reg", b"five\n", Registers(check=owned_by("b")))
        dependent = service.write_after("svc/reg", b"six\n", refused)
        with pytest.raises(AppendError) as caught:
            await refused
        assert caught.value.status == pb.REGISTER_MISMATCH
        with pytest.raises(DependencyFailed):
            await dependent
        assert service.appends == appends_before  # Nothing more committed: not retried.

        # A barrier checks registers without content; it cannot change them (brokers refuse
        # register changes without content, as upstream's).
        held = service.barrier("svc/reg", registers=Registers(check=owned_by("a")))
        assert await held == Span("svc/reg", 19, 19)
        with pytest.raises(AppendError) as caught:
            await service.barrier("svc/reg", registers=Registers(check=owned_by("b")))
        assert caught.value.status == pb.REGISTER_MISMATCH
        with pytest.raises(ValueError, match="cannot change registers"):
            service.barrier("svc/reg", registers=Registers(union=owner("b")))
        moved = await service.write(
            "svc/reg", b"seven\n", Registers(union=owner("b"), subtract=owner("a"))
        )
        assert await moved == Span("svc/reg", 19, 25)
        journal = service._journals["svc/reg"]
        await until(
            lambda: journal.sending is None and journal.pending == 0,
            "nothing in flight: the next writes make one batch",
        )
        appends_before = service.appends
        checked_b = Registers(check=owned_by("b"))
        last = [await service.write("svc/reg", b"eight\n", checked_b) for _ in range(3)]
        assert [await f for f in last] == [
            Span("svc/reg", 25, 31), Span("svc/reg", 31, 37), Span("svc/reg", 37, 43)
        ]  # fmt: skip
        # Writes with equal registers share appends (the first may go alone, ahead of the rest).
        assert service.appends - appends_before <= 2
    assert await read_all(brokers[1], "svc/reg") == (
        b"one\ntwo\nthree\nfour\nseven\n" + b"eight\n" * 3
    )


async def test_a_writer_cancelled_while_it_waits_leaves_the_batch_to_the_others(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    # Two records in one batch; the task waiting for the first is cancelled before the batch
    # commits. The batch is not the cancelled task's alone: it still commits, and the second
    # record's writer learns where its record landed (not CancelledError for a record that
    # was appended, which a retry would store twice).
    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/cancel", replication=2), [("local", i) for i in IDS]
    )
    async with AppendService(stub(brokers[0])) as service:
        first = await service.write("svc/cancel", b"one\n")
        second = await service.write("svc/cancel", b"two\n")
        assert first.batch is second.batch
        waiter = asyncio.ensure_future(first)
        await asyncio.sleep(0)  # It waits on the batch now.
        assert not first.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        span = await second
        assert not first.batch.cancelled()
        assert (await first).end == span.begin
    assert await read_all(brokers[0], "svc/cancel") == b"one\ntwo\n"


class _SlowDisk:
    """The `tempfile` module as AppendService sees it, on a disk that takes 10 ms a write
    (one under writeback pressure): time spent writing on the loop shows as a stall."""

    class File:
        def __init__(self, **kwargs: Any) -> None:
            self.file = tempfile.TemporaryFile(**kwargs)  # noqa: SIM115 (closed as AppendService's)

        def write(self, data: bytes) -> int:
            time.sleep(0.01)
            return int(self.file.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

    TemporaryFile = File


async def test_records_are_written_to_the_batch_file_off_the_event_loop(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch's temporary file is written on a worker thread: 32 MiB of records written to a
    slow disk do not stall the loop (other journals' sends, lease keep-alives), and they are
    appended whole and in order, the small ones between them included."""
    monkeypatch.setattr(append_service, "tempfile", _SlowDisk)
    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/large", replication=2), [("local", i) for i in IDS]
    )
    large = [bytes([65 + i]) * (1 << 20) for i in range(32)]
    async with AppendService(stub(brokers[0]), max_pending=256 << 20) as service:
        futures = []
        async with StallProbe() as probe:
            for i, record in enumerate(large):
                futures.append(await service.write("svc/large", record))
                futures.append(await service.write("svc/large", b"small %d\n" % i))
        spans = await asyncio.gather(*futures)
    expected = b"".join(r + b"small %d\n" % i for i, r in enumerate(large))
    assert await read_all(brokers[1], "svc/large") == expected
    assert [s.end for s in spans[:-1]] == [s.begin for s in spans[1:]]
    assert probe.worst < 0.05, f"the loop stalled {probe.worst * 1000:.0f} ms"


async def test_a_client_closed_with_batches_in_flight_settles_them_all_unlogged(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The channel under an AppendService closes while a batch streams (its call ends
    cancelled on this side), with another batch queued behind it, and then the service
    closes: every batch ends, failed or cancelled (none waits for good), and none is logged as
    "Future exception was never retrieved" once collected, though nobody awaited them."""
    spec = journal_spec("svc/closed", replication=2)
    spec.max_append_rate = 200  # Bytes a second: a batch of 4 KiB streams for seconds.
    await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
    channel = grpc.aio.insecure_channel(brokers[0].endpoint.removeprefix("http://"))
    service = AppendService(pb_grpc.JournalStub(channel), max_batch=4096)  # type: ignore[no-untyped-call]
    in_flight = await service.write("svc/closed", b"x" * 4096)
    queued = [await service.write("svc/closed", b"y" * 100) for _ in range(3)]
    journal = service._journals["svc/closed"]
    # Its content is on its way to the primary, held by the rate: the primary's append holds
    # the journal's pipeline.
    replica = brokers[0].broker.service.resolver.replicas["svc/closed"]  # type: ignore[index]
    await until(
        lambda j=journal: j.sending is not None and replica.pipeline_queue.empty(),
        "the batch streams to the primary",
    )
    assert journal.sending is not None and not in_flight.done()
    await channel.close(None)
    await asyncio.wait_for(service.close(), 10)
    batches = [in_flight.batch, *(p.batch for p in queued)]
    assert all(b.done() for b in batches), f"a batch left unsettled by close: {batches}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await in_flight
    assert info.value.code() == grpc.StatusCode.CANCELLED
    del in_flight, queued, batches, journal, service
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_batches_that_fail_or_are_cancelled_after_their_writers_gave_up_log_nothing(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fault campaign's publishers: a writer waits for its record with a timeout and gives
    up (the batch goes on, shielded), then the batch fails once its retries run out, with
    nobody awaiting it; another service is closed within a timeout that cancels its close with
    a batch still retrying. Neither batch waits for good, and neither is logged as "Future
    exception was never retrieved" once collected."""
    # Replication 2, one broker assigned: INSUFFICIENT_JOURNAL_BROKERS, retried.
    await set_journal(
        etcd, etcd_prefix, journal_spec("svc/gaveup", replication=2), [("local", "broker-a")]
    )
    async with AppendService(stub(brokers[0]), max_retry_delay=0.05, max_wait=0.5) as service:
        pending = await service.write("svc/gaveup", b"never\n")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pending, 0.1)  # The writer gives up; the batch goes on.
        batch = pending.batch
        del pending
    assert batch.done() and not batch.cancelled()  # Failed once max_wait ran out.
    del batch
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text

    service = AppendService(stub(brokers[0]), max_retry_delay=0.05)
    refused = caplog.text.count("append to svc/gaveup failed (retrying")
    retrying = await service.write("svc/gaveup", b"never either\n")
    await until(
        lambda: caplog.text.count("append to svc/gaveup failed (retrying") > refused,
        "the second service's batch refused, and retrying",
    )
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(service.close(), 0.2)  # As the campaign's clients close.
    assert retrying.batch.cancelled()  # Cancelled with its sender: nobody waits for good.
    del retrying, service
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_a_writer_that_never_waits_lets_the_sender_send_meanwhile(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """A publisher writing faster than appends commit, with room to spare, never has to wait:
    `write` still gives the loop a turn every YIELD_EVERY bytes, so the journal's sender starts
    its appends while the writes go on (not only once room runs out), and a write cancelled at
    that turn has queued nothing."""
    name = "svc/busy"
    await set_journal(
        etcd, etcd_prefix, journal_spec(name, replication=2), [("local", i) for i in IDS]
    )
    record = b"r" * 4096
    async with AppendService(stub(brokers[0]), max_pending=256 << 20) as service:
        journal = service._journal(name)
        futures = []
        sending_seen = 0
        for _ in range(2048):  # 8 MiB, written without anything else awaited.
            futures.append(await service.write(name, record))
            sending_seen += journal.sending is not None
        assert sending_seen > 0, "the sender never ran while the writer wrote"
        # A write that yields and is cancelled there queues nothing.
        await asyncio.gather(*futures)
        service._unyielded = append_service.YIELD_EVERY
        pending, count = journal.pending, journal.open.count
        task = asyncio.ensure_future(service.write(name, b"never"))
        await asyncio.sleep(0)  # The write runs to its turn for the loop.
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (journal.pending, journal.open.count) == (pending, count)
        last = await service.write(name, b"end")
        await last
    content = await read_all(brokers[1], name)
    assert content == record * 2048 + b"end"


@pytest.mark.parametrize("max_memory", [0, 64 << 20])
async def test_batches_past_a_mebibyte_stay_in_memory_while_the_budget_lasts(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str, max_memory: int
) -> None:
    """A batch keeps its first SPILL_AT bytes in memory, and more while the service's
    `max_memory` lasts (no file round trip); with no budget it spills past SPILL_AT. Either way
    the records are appended whole and in order, and a sent batch gives its memory back."""
    name = "svc/memory"
    await set_journal(
        etcd, etcd_prefix, journal_spec(name, replication=2), [("local", i) for i in IDS]
    )
    records = [bytes([65 + i % 26]) * 1000 + b"\n" for i in range(3000)]  # About 3 MiB.
    async with AppendService(
        stub(brokers[0]), max_batch=16 << 20, max_memory=max_memory
    ) as service:
        batch = service._journal(name).open
        # Written in one step (no turn for the loop): all in the one open batch.
        futures = [service.write_nowait(name, r) for r in records]
        assert batch.count == len(records)
        if max_memory:
            assert batch.spilled == 0 and batch.held == batch.size
            assert service.disk.memory_left == max_memory - (batch.size - append_service.SPILL_AT)
        else:
            assert batch.spilled > 0 and batch.held < append_service.SPILL_AT
            assert service.disk.memory_left == 0
        spans = await asyncio.gather(*futures)
        assert service.disk.memory_left == max_memory
    assert await read_all(brokers[1], name) == b"".join(records)
    assert [s.end for s in spans[:-1]] == [s.begin for s in spans[1:]]
