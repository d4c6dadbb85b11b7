"""A randomized run of the replication rules on real journals (a broker, each location's log a
journal with its fenced writer): emits, connects (with filters), disconnects, partitions,
crashes of a location's process (its writer reopened by another author, the old one fenced),
deletions and disasters (a location's log lost and recovered), in an order drawn from a seed,
then healing. The in-memory model's state machine explores far more histories
(`test_replication_model`); this one checks that the journal-backed logs keep the same promises.

Invariants, after every step: each log's storage order is a linear extension of causality; no
event is stored twice at a location; no two events in the logs share an id (emitter, time) with
different payloads (a recovered clock never runs in the past of what survives anywhere); no
filter is ever accepted on a cycle of the projected history (but redundant ones between
unfiltered groups, whose rounds hold an event back until the target's group has its causal
past). After healing: every event of a connection's source that passes its filter is in the
target's causal past (unless the start rule holds the connection back), and
locations joined both ways by unfiltered connections have the same CVV."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from broker.client.append_service import AppendService
from broker.client.appender import AppendError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from replication.filters import parse_filter
from replication.journal_log import (
    JournalEventLog,
    LineBatch,
    SourceReader,
    read_events,
    recover_location,
    replicate_round,
)
from replication.system import passes, system_payload
from replication.topology import Connected, Disconnected, RuleViolation, Topology
from tests.helpers.locations import logs

NAMES = ["A", "B", "C", "D"]
FILTERS = ["", "", "", "colour=red", "colour in (red, green)", "!colour"]


class Network:
    """The locations' writers, the connections' readers, and the ground-truth topology."""

    def __init__(self, rng: random.Random, stub: pb_grpc.JournalStub, service: AppendService,
                 journals: dict[str, str], spare: list[str], tag: str) -> None:  # fmt: skip
        self.rng, self.stub, self.service, self.tag = rng, stub, service, tag
        self.journals = dict(journals)  # Location name -> its journal now.
        self.spare = spare  # Fresh journals for logs lost in disasters.
        self.writers: dict[str, JournalEventLog] = {}
        self.readers: dict[tuple[str, str], SourceReader] = {}
        self.view = Topology()
        self.partitioned: set[frozenset[str]] = set()
        self.authors = itertools.count(1)
        self.events_seen: set[tuple[str, int]] = set()  # Every event id ever stored.
        self.refused_filters = 0
        self.deletions = 0

    def loc(self, name: str) -> str:
        return f"{name}{self.tag}"

    async def open(self, name: str) -> JournalEventLog:
        writer = JournalEventLog(self.loc(name), self.journals[name], lambda: self.stub,
                                 self.service, author=next(self.authors))  # fmt: skip
        await writer.open()
        self.writers[name] = writer
        return writer

    def stubs(self) -> Any:
        return lambda: self.stub

    def reader(self, source: str, target: str) -> SourceReader:
        key = (source, target)
        if key not in self.readers or self.readers[key].journal != self.journals[source]:
            self.readers[key] = SourceReader(self.stubs(), self.journals[source])
        return self.readers[key]

    # ---- steps ------------------------------------------------------------------------------

    async def emit(self) -> None:
        name = self.rng.choice(NAMES)
        colour = self.rng.choice(["red", "green", "blue", None])
        payload = {"colour": colour} if colour else {"plain": True}
        await self.writers[name].emit([payload])

    async def connect(self) -> None:
        source, target = self.rng.sample(NAMES, 2)
        if (self.loc(source), self.loc(target)) in self.view.current:
            return
        filter_text = self.rng.choice(FILTERS)
        try:
            self.view.check_connect(self.loc(source), self.loc(target), filter_text)
        except RuleViolation:
            self.refused_filters += bool(filter_text)
            return
        change = Connected(self.loc(source), self.loc(target), filter_text)
        self.view.apply(change)
        for at in (target, source):  # Recorded at both ends, as `gazctl replication` does.
            await self.writers[at].emit([system_payload(change)])

    async def disconnect(self) -> None:
        if not self.view.current:
            return
        source, target = self.rng.choice(sorted(self.view.current))
        change = Disconnected(source, target)
        self.view.apply(change)
        for at in (target, source):
            await self.writers[at.removesuffix(self.tag)].emit([system_payload(change)])

    def blocked(self, source: str, target: str) -> bool:
        """The start rule: a connection whose target has not read what the source deleted
        waits until DVV-source <= CVV-target."""
        s, t = self.writers[source], self.writers[target]
        behind = t.progress.get(s.location, 0) < s.deleted_through
        return behind and not s.dvv <= t.cvv

    async def round(self, source: str | None = None, target: str | None = None) -> int:
        if source is None or target is None:
            if not self.view.current:
                return 0
            s_loc, t_loc = self.rng.choice(sorted(self.view.current))
            source, target = s_loc.removesuffix(self.tag), t_loc.removesuffix(self.tag)
        if frozenset((source, target)) in self.partitioned or self.blocked(source, target):
            return 0
        filter_text = self.view.current[(self.loc(source), self.loc(target))]
        reader = self.reader(source, target)
        await reader.catch_up()
        group = self.view.guard_for(self.loc(source), self.loc(target))
        staged = await replicate_round(
            self.loc(source), reader, self.writers[target], passes(parse_filter(filter_text)),
            limit=self.rng.choice([1, 3, 1000]), group=group,
        )  # fmt: skip
        return staged[0] if staged else 0

    async def crash(self) -> None:
        """A location's process dies; another takes its log's writer over (fencing the old)."""
        name = self.rng.choice(NAMES)
        old = self.writers[name]
        new = await self.open(name)
        assert (new.cvv, new.next_seq) == (old.cvv, old.next_seq)
        with pytest.raises(AppendError) as fenced:
            await old.emit([{"zombie": True}])
        assert fenced.value.status == pb.REGISTER_MISMATCH
        self.readers = {k: v for k, v in self.readers.items() if name not in k}

    def partition(self) -> None:
        pair = frozenset(self.rng.sample(NAMES, 2))
        self.partitioned ^= {pair}

    def neighbours(self, name: str) -> list[str]:
        loc = self.loc(name)
        linked = {t if s == loc else s for s, t in self.view.current if loc in (s, t)}
        return sorted(n.removesuffix(self.tag) for n in linked)

    async def delete(self) -> None:
        name = self.rng.choice(NAMES)
        writer = self.writers[name]
        last = writer.next_seq - 1
        if last <= writer.deleted_through:
            return
        through = self.rng.randint(writer.deleted_through + 1, last)
        neighbours = [self.writers[n] for n in self.neighbours(name)]
        try:
            dvv = await writer.delete(through, neighbours)
        except RuleViolation:
            return
        self.deletions += 1
        assert all(dvv <= n.cvv for n in neighbours)

    async def disaster(self) -> None:
        """A location loses its whole log: it starts again on a fresh journal and recovers,
        events only over connections unfiltered both ways (others resume at their head)."""
        if not self.spare:
            return
        name = self.rng.choice(NAMES)
        self.journals[name] = self.spare.pop()
        lost = await self.open(name)
        loc = self.loc(name)
        neighbours = []
        for other in self.neighbours(name):
            w = self.writers[other]
            inbound = self.view.current.get((w.location, loc))
            outbound = self.view.current.get((loc, w.location))
            both_unfiltered = inbound == "" and outbound == ""
            neighbours.append((w, self.journals[other], both_unfiltered))
        others = [self.writers[n] for n in NAMES if n != name]
        await recover_location(lost, 0, neighbours, others)
        for w, journal, unfiltered in neighbours:
            if not unfiltered and (w.location, loc) in self.view.current:
                reader = SourceReader(self.stubs(), journal)
                await reader.catch_up()
                await lost.write_lines(LineBatch(w.location, b"", reader.last_seq, reader.cvv))
        self.readers = {k: v for k, v in self.readers.items() if name not in k}

    # ---- invariants -------------------------------------------------------------------------

    async def check(self) -> None:
        payloads: dict[tuple[str, int], Any] = {}  # Each id in the logs now: its payload.
        for name in NAMES:
            stored, _ = await read_events(self.stubs(), self.journals[name], 0, 1 << 30)
            ids = [s.event.id for s in stored]
            assert len(set(ids)) == len(ids), f"{name} stores an event twice"
            for x, y in itertools.combinations(stored, 2):
                assert not y.event.timestamp < x.event.timestamp, f"{name}: {y} before {x}"
            for s in stored:
                seen = payloads.setdefault(s.event.id, dict(s.event.payload))
                assert seen == dict(s.event.payload), f"two events are {s.event.id}"
        self.events_seen |= set(payloads)
        self.view.validate()  # No filter inside an unfiltered cycle, groups a tree, alike.

    async def heal(self) -> None:
        self.partitioned.clear()
        for _ in range(200):
            moved = 0
            for s_loc, t_loc in sorted(self.view.current):
                moved += await self.round(
                    s_loc.removesuffix(self.tag), t_loc.removesuffix(self.tag)
                )
            if not moved and all(self.caught_up(*c) for c in self.view.current):
                return
        raise AssertionError("the network did not quiesce")

    def caught_up(self, s_loc: str, t_loc: str) -> bool:
        source, target = s_loc.removesuffix(self.tag), t_loc.removesuffix(self.tag)
        reader = self.reader(source, target)
        return self.blocked(source, target) or (
            self.writers[target].progress.get(s_loc, 0) >= reader.last_seq
        )

    async def check_healed(self) -> None:
        for (s_loc, t_loc), filter_text in sorted(self.view.current.items()):
            source, target = s_loc.removesuffix(self.tag), t_loc.removesuffix(self.tag)
            if self.blocked(source, target):
                continue
            keep = passes(parse_filter(filter_text))
            stored, _ = await read_events(self.stubs(), self.journals[source], 0, 1 << 30)
            t_cvv = self.writers[target].cvv
            for s in stored:
                if keep is None or keep(s.event):
                    assert s.event.timestamp <= t_cvv, f"{s.event.id} never reached {target}"
        unfiltered = {(s, t) for (s, t), f in self.view.current.items() if not f}
        for s_loc, t_loc in unfiltered:
            source, target = s_loc.removesuffix(self.tag), t_loc.removesuffix(self.tag)
            if (t_loc, s_loc) in unfiltered and not (
                self.blocked(source, target) or self.blocked(target, source)
            ):
                a, b = self.writers[source], self.writers[target]
                assert a.cvv == b.cvv, (s_loc, t_loc, a.cvv, b.cvv)


@pytest.mark.parametrize("seed", [11, 23, 37, 41, 59])
async def test_random_histories_on_journals_keep_the_rules(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, seed: int
) -> None:
    rng = random.Random(seed)
    tag = f"-{seed}"
    journals = await logs(recovery_broker, *(f"{n}{tag}" for n in NAMES),
                          *(f"spare{i}{tag}" for i in range(3)))  # fmt: skip
    own = {n: journals[f"{n}{tag}"] for n in NAMES}
    spare = [journals[f"spare{i}{tag}"] for i in range(3)]
    async with AppendService(recovery_stub) as service:
        net = Network(rng, recovery_stub, service, own, spare, tag)
        for name in NAMES:
            await net.open(name)
        steps = [
            (net.emit, 30), (net.round, 35), (net.connect, 10), (net.disconnect, 3),
            (net.crash, 4), (net.delete, 5), (net.disaster, 2),
        ]  # fmt: skip
        actions = [a for a, _ in steps]
        weights = [w for _, w in steps]
        for _ in range(200):
            if rng.random() < 0.05:
                net.partition()
                continue
            await rng.choices(actions, weights)[0]()
            await net.check()
        await net.heal()
        await net.check()
        await net.check_healed()
        assert net.events_seen  # Something happened.
