"""Local event logs on real journals: a location's single fenced writer (a second writer takes
the log over and the first can write nothing more), events replicated between locations with
their progress in the same append (a writer that takes over resumes from the log, and nothing is
stored twice), storage order a linear extension of causality."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from broker.client.append_service import AppendService
from broker.client.appender import AppendError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from replication.journal_log import JournalEventLog, read_events, replicate_journals
from tests.helpers.locations import logs
from tests.helpers.waiting import until


async def test_replication_between_journal_logs(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    stub = recovery_stub
    journals = await logs(recovery_broker, "A", "B", "C")
    async with AppendService(stub) as service:
        writers = {
            n: JournalEventLog(n, j, lambda: stub, service, author=i + 1)
            for i, (n, j) in enumerate(journals.items())
        }
        for w in writers.values():
            await w.open()
        a, b, c = writers["A"], writers["B"], writers["C"]
        await a.emit([{"n": i} for i in range(5)])
        assert [s.event.id for s in await replicate_journals("A", journals["A"], b)] == [
            ("A", i) for i in range(1, 6)
        ]
        await b.emit([{"reply": True}])  # Causally after A's five.
        await replicate_journals("B", journals["B"], c)
        await replicate_journals("A", journals["A"], c)  # All in C's causal past by now.
        stored_c, cvv_c = await read_events(lambda: stub, journals["C"])
        assert [s.event.id for s in stored_c] == [*(("A", i) for i in range(1, 6)), ("B", 1)]
        assert [s.seq for s in stored_c] == list(range(1, 7)) and cvv_c == c.cvv
        for x, y in itertools.combinations(stored_c, 2):
            assert not y.event.timestamp < x.event.timestamp

        # B's writer is replaced (a restart): the new one rebuilds B's state from the log,
        # and the old one is fenced out.
        b2 = JournalEventLog("B", journals["B"], lambda: stub, service, author=99)
        await b2.open()
        assert (b2.cvv, b2.next_seq, b2.progress, b2.local_time) == (b.cvv, 7, {"A": 5}, 1)
        with pytest.raises(AppendError) as fenced:
            await b.emit([{"zombie": True}])
        assert fenced.value.status == pb.REGISTER_MISMATCH
        # A retry of a round already done stores nothing twice.
        assert await replicate_journals("A", journals["A"], b2) == []
        await a.emit([{"n": 5}])
        assert [s.event.id for s in await replicate_journals("A", journals["A"], b2)] == [("A", 6)]
        stored_b, _ = await read_events(lambda: stub, journals["B"])
        assert len({s.event.id for s in stored_b}) == len(stored_b) == 7


async def test_connections_run_until_the_network_converges(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    """Bi-directional connections A <-> B <-> C as running processes (tasks here): events
    emitted anywhere, while they run, reach every location once, in causal order; a filtered
    terminal connection C -> D carries only what its filter passes."""
    import asyncio

    from replication.connection import SourceReader, run_connection

    stub = recovery_stub
    journals = await logs(recovery_broker, "A2", "B2", "C2", "D2")
    async with AppendService(stub) as service:
        writers = {
            n: JournalEventLog(n, j, lambda: stub, service, author=10 + i)
            for i, (n, j) in enumerate(journals.items())
        }
        for w in writers.values():
            await w.open()
        links = [("A2", "B2"), ("B2", "A2"), ("B2", "C2"), ("C2", "B2")]
        only_red = lambda e: e.payload.get("colour") == "red"  # noqa: E731
        async with asyncio.TaskGroup() as tasks:
            running = [
                tasks.create_task(
                    run_connection(s, SourceReader(lambda: stub, journals[s]), writers[t])
                )
                for s, t in links
            ]
            running.append(
                tasks.create_task(
                    run_connection(
                        "C2", SourceReader(lambda: stub, journals["C2"]), writers["D2"], only_red
                    )
                )
            )
            emitted = []
            for i in range(6):
                at = "A2" if i % 2 else "C2"
                colour = "red" if i % 3 == 0 else "blue"
                emitted += await writers[at].emit([{"i": i, "colour": colour}])
            want = {e.id for e in emitted}
            red = {e.id for e in emitted if e.payload["colour"] == "red"}

            async def replicated() -> bool:
                for n in ("A2", "B2", "C2"):
                    if not want <= set(await stored_ids(stub, journals[n])):
                        return False
                return set(await stored_ids(stub, journals["D2"])) == red

            await until(replicated, "A2, B2, C2 hold every event, D2 the red", 30, 0.05)
            for task in running:
                task.cancel()
        for n in ("A2", "B2", "C2", "D2"):
            stored, _ = await read_events(lambda: stub, journals[n])
            ids = [s.event.id for s in stored]
            assert len(set(ids)) == len(ids), n
            for x, y in itertools.combinations(stored, 2):
                assert not y.event.timestamp < x.event.timestamp, n


async def stored_ids(stub: pb_grpc.JournalStub, journal: str) -> list[tuple[str, int]]:
    stored, _ = await read_events(lambda: stub, journal)
    return [s.event.id for s in stored]


async def test_deletion_on_journals_follows_the_dvv_rules(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    """Deletion is recorded with the DVV it leaves, only once every neighbour holds what it
    deletes; readers skip deleted events; a new connection waits for DVV <= CVV-target; a
    writer that takes over knows the deletion."""
    from replication.model import check_may_start
    from replication.topology import RuleViolation

    stub = recovery_stub
    journals = await logs(recovery_broker, "A3", "B3", "C3", "D3")
    async with AppendService(stub) as service:
        w = {
            n: JournalEventLog(n, j, lambda: stub, service, author=20 + i)
            for i, (n, j) in enumerate(journals.items())
        }
        for log in w.values():
            await log.open()
        a, b, c, d = w["A3"], w["B3"], w["C3"], w["D3"]
        await a.emit([{"i": i} for i in range(3)])
        with pytest.raises(RuleViolation, match="A3 may not delete through 2: its DVV would be"):
            await a.delete(2, neighbours=[b])  # B holds none of them yet.
        assert a.dvv == type(a.dvv)() and a.deleted_through == 0  # Nothing recorded.
        await replicate_journals("A3", journals["A3"], b)
        dvv = await a.delete(2, neighbours=[b])
        assert dvv == {"A3": 2} and a.deleted_through == 2
        remaining, _ = await read_events(lambda: stub, journals["A3"])
        assert [s.event.id for s in remaining] == [("A3", 3)]

        with pytest.raises(RuleViolation, match="replication A3 -> C3 may not start yet"):
            check_may_start(a, c)
        await replicate_journals("B3", journals["B3"], c)  # C gets A's events from B first.
        check_may_start(a, c)
        assert await replicate_journals("A3", journals["A3"], c) == []  # Event 3: C has it.
        stored_c, _ = await read_events(lambda: stub, journals["C3"])
        assert [s.event.id for s in stored_c] == [("A3", 1), ("A3", 2), ("A3", 3)]

        with pytest.raises(RuleViolation, match="not <= CVV-D3"):
            await a.delete(3, neighbours=[b, d])
        a2 = JournalEventLog("A3", journals["A3"], lambda: stub, service, author=99)
        await a2.open()
        assert (a2.dvv, a2.deleted_through) == (dvv, 2)


async def test_disaster_recovery_on_journals_in_rounds(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    """A location loses its whole log: metadata recovery sets its clock to the most its
    neighbours saw of it and resets their progress for it; event recovery goes in rounds, from
    C first (B deleted events A lacks: DVV-B is not <= CVV-A until C's round), then B; its next
    event never reuses a time, and replicates on as new."""
    from replication.journal_log import recover_location

    stub = recovery_stub
    journals = await logs(recovery_broker, "A4", "B4", "C4", "A4-after-disaster")
    async with AppendService(stub) as service:
        a = JournalEventLog("A4", journals["A4"], lambda: stub, service, author=31)
        b = JournalEventLog("B4", journals["B4"], lambda: stub, service, author=32)
        c = JournalEventLog("C4", journals["C4"], lambda: stub, service, author=33)
        for log in (a, b, c):
            await log.open()
        lost = await a.emit([{"i": i} for i in range(3)])
        await replicate_journals("A4", journals["A4"], b)
        await replicate_journals("A4", journals["A4"], c)
        await b.delete(1, neighbours=[a, c])

        # The disaster: A's log is gone; A starts again on an empty journal.
        a2 = JournalEventLog("A4", journals["A4-after-disaster"], lambda: stub, service, author=34)
        await a2.open()
        used = await recover_location(a2, 0, [(b, journals["B4"], True), (c, journals["C4"], True)])
        assert used == ["C4", "B4"]
        recovered, _ = await read_events(lambda: stub, journals["A4-after-disaster"])
        assert [s.event for s in recovered] == lost
        assert a2.local_time == 3 and b.progress["A4"] == 0 == c.progress["A4"]
        (fresh,) = await a2.emit([{"after": True}])
        assert fresh.id == ("A4", 4)
        assert [s.event.id for s in await replicate_journals(
            "A4", journals["A4-after-disaster"], b
        )] == [("A4", 4)]  # fmt: skip


async def test_a_write_held_by_back_pressure_is_not_overtaken(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    # The service has too much pending (its room closed) when A emits: that emit must wait for
    # room before it takes its sequence number and moves the CVV on, or an emit that comes in
    # just as room opens overtakes it: sequence numbers out of order in the journal, and an
    # event stored before one of its causes.
    stub = recovery_stub
    journals = await logs(recovery_broker, "A")
    async with AppendService(stub) as service:
        a = JournalEventLog("A", journals["A"], lambda: stub, service, author=1)
        await a.open()
        await a.emit([{"n": 0}])
        room = service._journals[journals["A"]].room
        room.clear()  # Back-pressure: too much pending.
        first = asyncio.ensure_future(a.emit([{"n": 1}]))
        await asyncio.sleep(0)  # It waits for room.
        second = asyncio.ensure_future(a.emit([{"n": 2}]))  # Runs as room opens.
        room.set()
        await asyncio.gather(first, second)
        stored, _ = await read_events(lambda: stub, journals["A"])
    assert [s.seq for s in stored] == [1, 2, 3]
    for x, y in itertools.combinations(stored, 2):
        assert not y.event.timestamp < x.event.timestamp, (x, y)


async def test_an_append_stored_twice_is_read_and_replicated_once(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub
) -> None:
    """An append whose first attempt committed although its writer saw it fail (a replica
    killed as the commit was acknowledged) and which its writer then retried is in the journal
    twice, the same sequence numbers each time (found by the location-broker-kill fault
    scenario). Readers and replication take each event once: a log's sequence numbers only
    grow, so a record at or below the last one read is such a repeat."""
    from broker.client.appender import append
    from replication.journal_log import SourceReader, select_lines, split_records

    stub = recovery_stub
    journals = await logs(recovery_broker, "A", "B")
    async with AppendService(stub) as service:
        a = JournalEventLog("A", journals["A"], lambda: stub, service, author=1)
        b = JournalEventLog("B", journals["B"], lambda: stub, service, author=2)
        await a.open()
        await b.open()
        await a.emit([{"n": 1}, {"n": 2}])
        reader = SourceReader(lambda: stub, journals["A"])
        await reader.catch_up()
        region = await reader.region_after(0)
        assert region is not None
        await append(stub, journals["A"], region[0])  # The same records again, as a retry.
        await a.emit([{"n": 3}])
        reader = SourceReader(lambda: stub, journals["A"])
        await reader.catch_up()
        assert reader.last_seq == 3 and reader.seqs_between(0, 3) == [1, 2, 3]
        batch = await select_lines("A", reader, 0, {})
        assert batch is not None
        assert [raw.seq for _, _, raw in split_records(batch.data)[0]] == [1, 2, 3]
        assert [s.event.payload for s in await reader.events_after(0)] == [
            {"n": i} for i in (1, 2, 3)
        ]
        await replicate_journals("A", journals["A"], b)
        stored, _ = await read_events(lambda: stub, journals["B"])
        assert [s.event.id for s in stored] == [("A", 1), ("A", 2), ("A", 3)]
