"""The seed's system model in memory: each anomaly of its appendix happens when its rule is left
out, and is prevented with it (filtered cycle; cyclic deletion; disaster recovery over filtered
connections; location addition with deletion); fail-over by the cached CVV; redundant filtered
connections; and a hypothesis state machine of emits, replication rounds and crashes between a
batch's write and its progress, checking that every log is a linear extension of causality, holds
no event twice, and that an unfiltered network converges."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replication.model import (
    Event,
    LocationModel,
    check_fail_over,
    check_may_start,
    check_recover_from,
    join_for_new_events,
    read_batch,
    recover_metadata,
    replicate,
    write_batch,
)
from replication.topology import Connected, RuleViolation, Topology


def ids(location: LocationModel) -> list[tuple[str, int]]:
    return [s.event.id for s in location.log]


def only(*names: str):  # type: ignore[no-untyped-def]
    return lambda e: e.payload.get("name") in names


def net(*names: str) -> dict[str, LocationModel]:
    return {n: LocationModel(n) for n in names}


def test_filtered_cycle_anomaly_and_its_rule() -> None:
    loc = net("A", "B", "C")
    a, b, c = loc["A"], loc["B"], loc["C"]
    for name in ("e1", "e2", "e3"):
        a.emit({"name": name})
    # Without the rule: A -> C filtered to e3, C -> B, then A -> B.
    replicate(a, c, only("e3"))
    replicate(c, b)
    replicate(a, b)
    assert [e.payload["name"] for e in (s.event for s in b.log)] == ["e3"]  # e1, e2 never.
    # With it: the filter on A -> C (a connection of the cycle ABC) is refused.
    topology = Topology.of(
        [Connected(x, y) for x, y in itertools.permutations("ABC", 2) if (x, y) != ("A", "C")]
    )
    with pytest.raises(RuleViolation, match="no filter on A -> C: it lies on the cycle"):
        topology.check_connect("A", "C", filter="name=e3")


def test_cyclic_deletion_anomaly_and_its_rule() -> None:
    loc = net("A", "B", "C")
    a, b, c = loc["A"], loc["B"], loc["C"]
    for name in ("e1", "e2", "e3"):
        c.emit({"name": name})
    replicate(c, b)
    # Without the rule (no neighbours checked): B deletes e1, e2; B -> A; then C -> A.
    b2 = LocationModel("B", list(b.log), b.cvv, b.dvv, b.next_seq)
    b2.delete(2, neighbours=[])
    replicate(b2, a)
    replicate(c, a)
    assert [s.event.payload["name"] for s in a.log] == ["e3"]  # e1 and e2 lost for A.
    # With it: B may not delete while A (directly connected) lacks them.
    a_fresh = LocationModel("A")
    with pytest.raises(RuleViolation, match=r"B may not delete through 2: its DVV would be"):
        b.delete(2, neighbours=[a_fresh, c])
    replicate(b, a_fresh)
    assert b.delete(2, neighbours=[a_fresh, c]) <= a_fresh.cvv


def test_disaster_recovery_over_filtered_connections_anomaly_and_its_rule() -> None:
    loc = net("A", "B", "C")
    a, b, c = loc["A"], loc["B"], loc["C"]
    for name in ("e1", "e2", "e3"):
        a.emit({"name": name})
    replicate(a, b, only("e1", "e2"))
    replicate(a, c, only("e3"))
    recover_metadata(a, survivors=0, neighbours=[b, c])  # A lost every event.
    assert a.log == [] and a.local_time == 3  # Its clock does not run from the past.
    replicate(c, a)  # Recovered from C first ...
    replicate(b, a)  # ... then B: e1, e2 are in A's causal past.
    assert [s.event.payload["name"] for s in a.log] == ["e3"]
    # With the rule: A has two connections, so recovery over filtered ones is refused.
    topology = Topology.of(
        [Connected("A", "B", "name in (e1,e2)"), Connected("B", "A"),
         Connected("A", "C", "name=e3"), Connected("C", "A")]
    )  # fmt: skip
    assert len({y for x, y in topology.current if x == "A"}) == 2  # Not terminal.
    # And recovery from an unfiltered neighbour goes in rounds by the DVV rule.
    d = LocationModel("D")
    replicate(b, d)
    b.delete(1, neighbours=[d])
    fresh = LocationModel("A2")
    with pytest.raises(RuleViolation, match="A2 may not recover from B yet"):
        check_recover_from(fresh, b)
    replicate(d, fresh)
    check_recover_from(fresh, b)


def test_location_addition_with_deletion_anomaly_and_its_rule() -> None:
    loc = net("A", "B", "C", "D")
    a, b, c, d = loc["A"], loc["B"], loc["C"], loc["D"]
    for name in ("e1", "e2", "e3"):
        a.emit({"name": name})
    replicate(a, b)
    a.delete(2, neighbours=[b])  # Allowed: B, A's only neighbour, has e1 and e2.
    # Without the rule: D joins A and C; e3 goes A -> D -> C; then B -> C.
    replicate(a, d)
    replicate(d, c)
    replicate(b, c)
    assert [s.event.payload["name"] for s in c.log] == ["e3"]
    # With it: A -> D may not start before D has what A deleted; C -> D and D -> A may.
    c2, d2 = LocationModel("C"), LocationModel("D")
    with pytest.raises(RuleViolation, match="replication A -> D may not start yet"):
        check_may_start(a, d2)
    replicate(b, c2)
    check_may_start(c2, d2)
    replicate(c2, d2)
    check_may_start(a, d2)  # Now D holds e1 and e2.
    replicate(a, d2)
    assert sorted(s.event.payload["name"] for s in d2.log) == ["e1", "e2", "e3"]
    # A location that wants only new events starts from its neighbours' DVVs.
    e = LocationModel("E")
    join_for_new_events(e, [a])
    check_may_start(a, e)


def test_fail_over_waits_for_the_cached_cvv() -> None:
    loc = net("A", "B", "D")
    a, b, d = loc["A"], loc["B"], loc["D"]
    a.emit({"name": "x"})
    replicate(a, d, only("x"))  # D caches CVV-A with the batch.
    with pytest.raises(RuleViolation, match="D may not fail over from A to B yet"):
        check_fail_over(d, "A", b)
    replicate(a, b)
    check_fail_over(d, "A", b)


def test_redundant_filtered_connection_writes_only_within_the_cycle_cvv() -> None:
    loc = net("A", "B", "C", "D")
    a, b, d = loc["A"], loc["B"], loc["D"]
    first = a.emit({"name": "a1"})
    replicate(a, d)
    d.emit({"name": "d1"})  # Causally after a1.
    # D -> B (redundant with D -> A): d1's ABC part says a1 first; B has not got it: retried.
    written = replicate(d, b, cycle=["A", "B", "C"])
    assert written == [] and b.progress.get("D", 0) == 0  # Progress stops before it.
    replicate(a, b)
    assert [s.event for s in b.log] == [first]
    written = replicate(d, b, cycle=["A", "B", "C"])
    assert [s.event.payload["name"] for s in written] == ["d1"]


def test_redundant_connections_lose_an_event_without_the_group_rule() -> None:
    """D -> A and E -> B (E and D one unfiltered group) carry D's event d1 into ABC. d1 follows
    a1 (A's event, which reached D). Written at B before a1 arrives there, d1 puts a1 in B's
    causal past: a1 is then dropped by B's causality filter, for good. The group rule holds d1
    back until B has a1."""
    abc = ["A", "B", "C"]
    for rule_on in (False, True):
        loc = net("A", "B", "C", "D", "E")
        a, b, d, e = loc["A"], loc["B"], loc["D"], loc["E"]
        a1 = a.emit({"name": "a1"})
        replicate(a, d)  # A -> D (filtered into DEF; a1 passes).
        d1 = d.emit({"name": "d1"})
        replicate(d, e)  # Inside the group DE.
        replicate(e, b, only("d1"), cycle=abc if rule_on else ())  # E -> B, redundant with D -> A.
        replicate(a, b)  # Inside ABC, a1 comes to B.
        replicate(e, b, only("d1"), cycle=abc if rule_on else ())
        stored = [s.event for s in b.log]
        if rule_on:
            assert stored == [a1, d1]
        else:
            assert stored == [d1] and a1.timestamp <= b.cvv  # a1 is lost at B.


def test_an_unfiltered_connection_from_outside_a_group_loses_an_event_without_the_guard() -> None:
    """The seed's first anomaly routed through D: A -> D and B -> D filtered (A's e2 passes, its
    cause e1 does not), D -> A and D -> B unfiltered. e2 written at B before e1 arrives there puts e1 in B's causal
    past, and B drops it for good. The group write guard, on every connection into ABC from
    outside it (filtered or not), holds e2 back until B has e1."""
    view = Topology.of(
        [*(Connected(x, y) for x, y in itertools.permutations("ABC", 2)),
         Connected("A", "D", "name=e2"), Connected("B", "D", "name=e2"),
         Connected("D", "A"), Connected("D", "B")]
    )  # fmt: skip
    view.validate()  # The rules accept it: D is a group of its own, joined by filtered links.
    for guard_on in (False, True):
        loc = net("A", "B", "C", "D")
        a, b, d = loc["A"], loc["B"], loc["D"]
        e1, e2 = a.emit({"name": "e1"}), a.emit({"name": "e2"})
        replicate(a, d, only("e2"))
        guard = sorted(view.guard_for("D", "B")) if guard_on else ()
        replicate(d, b, cycle=guard)
        replicate(a, b)
        replicate(d, b, cycle=guard)
        stored = [s.event for s in b.log]
        if guard_on:
            assert stored == [e1, e2]
        else:
            assert stored == [e2] and e1.timestamp <= b.cvv  # e1 is lost at B.


@pytest.mark.parametrize("seed", range(20))
def test_two_data_centres_partitioned_keep_working_and_converge(seed: int) -> None:
    """The seed's example: the cycle ABC (application 1: A and C in data centre 1, B in 2) and
    DEF (application 2: D and F in 1, E in 2), joined by D - A and E - B with one filter each
    way. Partitioned, each data centre keeps replicating within itself; healed, every location
    holds what its filters let through, each log a linear extension of causality."""
    import random

    rng = random.Random(seed)
    view = Topology()
    unfiltered = [(x, y) for g in ("ABC", "DEF") for x, y in itertools.permutations(g, 2)]
    filtered = {("D", "A"): "to-abc", ("E", "B"): "to-abc", ("A", "D"): "to-def", ("B", "E"): "to-def"}  # fmt: skip
    for source, target in unfiltered:
        view.apply(Connected(source, target))
    for (source, target), f in filtered.items():
        view.check_connect(source, target, f)
        view.apply(Connected(source, target, f))
    loc = net(*"ABCDEF")
    centre = {"A": 1, "C": 1, "D": 1, "F": 1, "B": 2, "E": 2}
    connections = [(s, t, None) for s, t in unfiltered] + [
        (s, t, (lambda e, f=f: e.payload.get("to") == f)) for (s, t), f in filtered.items()
    ]

    def run(partitioned: bool) -> None:
        for source, target, keep in connections:
            if partitioned and centre[source] != centre[target]:
                continue
            group = sorted(view.guard_for(source, target))
            replicate(loc[source], loc[target], keep, cycle=group, limit=rng.randrange(1, 4))

    for step in range(60):
        where = rng.choice("ABCDEF")
        loc[where].emit({"to": rng.choice(["to-abc", "to-def", "local"]), "step": step})
        run(partitioned=step < 40)
    for _ in range(20):
        run(partitioned=False)
    emitted = {s.event.id: s.event for x in loc.values() for s in x.log if s.event.emitter == x.name}  # fmt: skip
    for name, location in loc.items():
        seen = [s.event for s in location.log]
        assert len({e.id for e in seen}) == len(seen)
        for i, j in itertools.combinations(range(len(seen)), 2):
            assert not seen[j].timestamp < seen[i].timestamp
        group = "ABC" if name in "ABC" else "DEF"
        want = {
            i for i, e in emitted.items()
            if e.emitter in group or e.payload["to"] == f"to-{group.lower()}"
        }  # fmt: skip
        assert {e.id for e in seen} >= want, name


class Network(RuleBasedStateMachine):
    """Unfiltered connections between three locations; replication rounds and emits in any
    order; a crash after a batch's write, before its progress, replays it."""

    def __init__(self) -> None:
        super().__init__()
        self.locations = net("A", "B", "C")
        self.emitted: set[tuple[str, int]] = set()

    @rule(where=st.sampled_from("ABC"))
    def emit(self, where: str) -> None:
        self.emitted.add(self.locations[where].emit({"n": len(self.emitted)}).id)

    @rule(source=st.sampled_from("ABC"), to=st.sampled_from("ABC"), limit=st.integers(1, 5))
    def replicate(self, source: str, to: str, limit: int) -> None:
        if source != to:
            replicate(self.locations[source], self.locations[to], limit=limit)

    @rule(source=st.sampled_from("ABC"), to=st.sampled_from("ABC"))
    def crash_before_progress(self, source: str, to: str) -> None:
        if source == to:
            return
        s, t = self.locations[source], self.locations[to]
        batch = read_batch(s, t)
        before = dict(t.progress)
        t.write([x.event for x in batch.events])  # Written; the progress is lost with the crash.
        t.progress = before
        write_batch(t, read_batch(s, t))  # The retry: duplicates dropped by the causality filter.

    @invariant()
    def logs_are_linear_extensions_without_duplicates(self) -> None:
        for location in self.locations.values():
            seen = [s.event for s in location.log]
            assert len({e.id for e in seen}) == len(seen)
            for i, j in itertools.combinations(range(len(seen)), 2):
                assert not seen[j].timestamp < seen[i].timestamp, (location.name, i, j)

    @precondition(lambda self: len(self.emitted) > 0)
    @rule()
    def heal_and_converge(self) -> None:
        for _ in range(3):
            for s, t in itertools.permutations("ABC", 2):
                replicate(self.locations[s], self.locations[t])
        for location in self.locations.values():
            assert set(ids(location)) == self.emitted, location.name


TestNetwork = Network.TestCase
TestNetwork.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_events_are_identified_by_emitter_and_time() -> None:
    a = LocationModel("A")
    e = a.emit()
    assert isinstance(e, Event) and e.id == ("A", 1) and a.local_time == 1
