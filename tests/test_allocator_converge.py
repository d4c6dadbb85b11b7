"""Convergence planning, pure: the etcd operations a round issues from a synthetic state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import keyspace as aks
from allocator.converge import Compare, Delete, Put, Txn, plan
from allocator.rules import Rules
from allocator.solver import solve
from allocator.state import State
from broker.keyspace import broker_decoder, broker_rules
from broker.protocol import protocol_pb2 as pb
from keyspace import KeyValue

ROOT = "/root"


@dataclass
class Asn:
    item: str
    zone: str
    suffix: str
    slot: int
    # Route members as (zone, suffix) and primary index; None writes an empty value.
    route: tuple[list[tuple[str, str]], int] | None = None
    lease: int = 0


def route_value(members: list[tuple[str, str]], primary: int) -> bytes:
    route = pb.Route(primary=primary)
    for zone, suffix in members:
        route.members.add(zone=zone, suffix=suffix)
    return route.SerializeToString()


def build(
    items: dict[str, int],
    members: Sequence[tuple[str, str, int]],
    assignments: Sequence[Asn] = (),
    *,
    exiting: Sequence[str] = (),
    rules: Rules | None = None,
    local: str | None = None,
) -> State:
    """A State of `items` (name -> replication), `members` ((zone, suffix, limit), the first
    the oldest) and `assignments`. Member n holds lease 100+n; revisions are distinct."""
    decode = broker_decoder(ROOT)
    revision = 0

    def kv(key: str, raw: bytes, lease: int = 0) -> KeyValue:
        nonlocal revision
        revision += 1
        return KeyValue(key, raw, decode(key, raw), revision, revision, 1, lease)

    member_kvs = []
    for n, (zone, suffix, limit) in enumerate(members):
        spec = pb.BrokerSpec(journal_limit=limit, exiting=suffix in exiting)
        spec.process_spec.id.zone, spec.process_spec.id.suffix = zone, suffix
        member_kvs.append(kv(aks.member_key(ROOT, zone, suffix), spec.SerializeToString(), 100 + n))
    item_kvs = [
        kv(aks.item_key(ROOT, name), pb.JournalSpec(name=name, replication=r).SerializeToString())
        for name, r in items.items()
    ]
    asn_kvs = []
    for a in assignments:
        raw = route_value(*a.route) if a.route is not None else b""
        key = aks.assignment_key(ROOT, a.item, a.zone, a.suffix, a.slot)
        asn_kvs.append(kv(key, raw, a.lease))
    first = members[0]
    return State.build(
        ROOT,
        revision,
        local or aks.member_key(ROOT, first[0], first[1]),
        rules or broker_rules(),
        items=sorted(item_kvs, key=lambda k: k.key),
        members=sorted(member_kvs, key=lambda k: k.key),
        assignments=sorted(asn_kvs, key=lambda k: k.key),
    )


def desired_of(state: State, wanted: dict[str, list[str]]) -> list[list[int]]:
    """Desired members (by suffix) of each item, as member indexes."""
    index = {suffix: m for m, (_, suffix) in enumerate(state.member_ids)}
    return [sorted(index[s] for s in wanted.get(item_id, [])) for item_id in state.item_ids]


def ops_of(txns: Sequence[Txn]) -> list[str]:
    out = []
    for txn in txns:
        for op in txn.ops:
            if isinstance(op, Put):
                out.append(f"put {op.key.removeprefix(ROOT + '/assign/')}")
            else:
                out.append(f"del {op.key.removeprefix(ROOT + '/assign/')}")
    return out


def check_txns(state: State, txns: Sequence[Txn], max_ops: int = 128) -> None:
    leader = state.members[state.leader]
    for txn in txns:
        assert txn.compares[0] == Compare(leader.key, "mod", leader.mod_revision)
        assert len(txn.compares) <= max_ops and len(txn.ops) <= max_ops
        keys = [op.key for op in txn.ops]
        assert len(keys) == len(set(keys)), "etcd refuses a key twice in one transaction"


def test_initial_assignments_are_empty_puts_under_the_member_lease() -> None:
    state = build({"j1": 2, "j2": 1}, [("a", "A", 10), ("b", "B", 10)])
    result = plan(state, desired_of(state, {"j1": ["A", "B"], "j2": ["B"]}))
    check_txns(state, result.txns)
    assert len(result.txns) == 1
    puts = [op for op in result.txns[0].ops if isinstance(op, Put)]
    assert {(p.key.removeprefix(ROOT + "/assign/"), p.value, p.lease) for p in puts} == {
        ("j1#a#A#0", b"", 100),
        ("j1#b#B#1", b"", 101),
        ("j2#b#B#0", b"", 101),
    }
    # Each add asserts its member is unchanged (its limit could have dropped).
    assert Compare(state.members[1].key, "mod", state.members[1].mod_revision) in (
        result.txns[0].compares
    )


def test_new_primaries_go_to_the_member_with_fewest() -> None:
    state = build(
        {"j1": 2, "j2": 2},
        [("a", "A", 10), ("b", "B", 10)],
        [Asn("j1", "a", "A", 0, (([("a", "A"), ("b", "B")], 0))), Asn("j1", "b", "B", 1)],
    )
    result = plan(state, desired_of(state, {"j1": ["A", "B"], "j2": ["A", "B"]}))
    assert ops_of(result.txns) == ["put j2#a#A#1", "put j2#b#B#0"]


def test_batches_respect_the_operation_limit_and_keep_items_whole() -> None:
    members = [(f"z{m % 3}", f"m{m:02d}", 1000) for m in range(30)]
    state = build({f"j{i:04d}": 3 for i in range(500)}, members)
    solution = solve(state.problem())
    for max_ops in (128, 16):
        result = plan(state, solution.assignments, max_ops=max_ops)
        check_txns(state, result.txns, max_ops)
        assert result.added == 1500
        seen: set[str] = set()
        for txn in result.txns:
            items = {op.key.split("/")[-1].split("#")[0] for op in txn.ops}
            assert not items & seen, "an item's operations span transactions"
            seen |= items


def test_no_removal_while_the_journal_is_inconsistent() -> None:
    # j1 moves from A to B. A's replica has not synchronized (empty value): B is added, A stays.
    state = build({"j1": 1}, [("a", "A", 10), ("a", "B", 10)], [Asn("j1", "a", "A", 0)])
    result = plan(state, desired_of(state, {"j1": ["B"]}))
    assert ops_of(result.txns) == ["put j1#a#B#1"]
    assert result.deferred == 1


def test_removal_once_consistent_with_promotion_in_the_same_transaction() -> None:
    both = ([("a", "A"), ("a", "B")], 0)
    state = build(
        {"j1": 1},
        [("a", "A", 10), ("a", "B", 10)],
        [Asn("j1", "a", "A", 0, both), Asn("j1", "a", "B", 1, both)],
    )
    result = plan(state, desired_of(state, {"j1": ["B"]}))
    assert len(result.txns) == 1
    assert ops_of(result.txns) == ["del j1#a#A#0", "del j1#a#B#1", "put j1#a#B#0"]
    move = result.txns[0].ops[2]
    assert isinstance(move, Put) and move.value == route_value(*both), "the value moves along"
    # The removal asserts the item (its replication) and the assignment are unchanged.
    item = state.items[0]
    assert Compare(item.key, "mod", item.mod_revision) in result.txns[0].compares


def test_a_consistent_replica_is_kept_while_it_is_needed() -> None:
    # Replication 2 on A and B, consistent; the desired set is B and C: C is added, A stays
    # until C has synchronized (n == r leaves no room to remove a consistent replica).
    ab = ([("a", "A"), ("b", "B")], 0)
    state = build(
        {"j1": 2},
        [("a", "A", 10), ("b", "B", 10), ("c", "C", 10)],
        [Asn("j1", "a", "A", 0, ab), Asn("j1", "b", "B", 1, ab)],
    )
    result = plan(state, desired_of(state, {"j1": ["B", "C"]}))
    assert ops_of(result.txns) == ["put j1#c#C#2"]


def test_lowering_replication_removes_the_surplus_at_once() -> None:
    abc = ([("a", "A"), ("b", "B"), ("c", "C")], 0)
    state = build(
        {"j1": 1},
        [("a", "A", 10), ("b", "B", 10), ("c", "C", 10)],
        [Asn("j1", z, s, n, abc) for n, (z, s) in enumerate([("a", "A"), ("b", "B"), ("c", "C")])],
    )
    result = plan(state, desired_of(state, {"j1": ["A"]}))
    assert sorted(ops_of(result.txns)) == ["del j1#b#B#1", "del j1#c#C#2"]


def test_assignments_of_a_vanished_member_go_without_waiting() -> None:
    # Z's member key is gone but its assignment lingers (say, written without a lease). It is
    # no live replica: it goes though the journal is not consistent, and A is promoted.
    state = build({"j1": 1}, [("a", "A", 10)], [Asn("j1", "a", "A", 1), Asn("j1", "z", "Z", 0)])
    result = plan(state, desired_of(state, {"j1": ["A"]}))
    assert ops_of(result.txns) == ["del j1#z#Z#0", "del j1#a#A#1", "put j1#a#A#0"]


def test_orphaned_assignments_are_deleted_if_the_item_is_still_absent() -> None:
    state = build(
        {"j1": 1},
        [("a", "A", 10)],
        [Asn("j1", "a", "A", 0), Asn("gone", "a", "A", 0), Asn("gone", "b", "B", 1)],
    )
    result = plan(state, desired_of(state, {"j1": ["A"]}))
    check_txns(state, result.txns)
    assert ops_of(result.txns) == ["del gone#a#A#0", "del gone#b#B#1"]
    assert Compare(aks.item_key(ROOT, "gone"), "create", 0) in result.txns[0].compares
    assert result.orphans == 2


def test_removing_orphans_frees_capacity_for_adds() -> None:
    state = build({"j1": 1}, [("a", "A", 1)], [Asn("gone", "a", "A", 0)])
    result = plan(state, desired_of(state, {"j1": ["A"]}))
    assert ops_of(result.txns) == ["del gone#a#A#0", "put j1#a#A#0"]


def test_slots_are_packed_when_nothing_else_is_pending() -> None:
    abc = ([("a", "A"), ("b", "B"), ("c", "C")], 0)
    state = build(
        {"j1": 3},
        [("a", "A", 10), ("b", "B", 10), ("c", "C", 10)],
        [Asn("j1", "a", "A", 0, abc), Asn("j1", "b", "B", 4, abc), Asn("j1", "c", "C", 7, abc)],
    )
    result = plan(state, desired_of(state, {"j1": ["A", "B", "C"]}))
    assert ops_of(result.txns) == ["del j1#b#B#4", "put j1#b#B#1", "del j1#c#C#7", "put j1#c#C#2"]
    settled = build(
        {"j1": 3},
        [("a", "A", 10), ("b", "B", 10), ("c", "C", 10)],
        [Asn("j1", "a", "A", 0, abc), Asn("j1", "b", "B", 1, abc), Asn("j1", "c", "C", 2, abc)],
    )
    assert plan(settled, desired_of(settled, {"j1": ["A", "B", "C"]})).txns == []


def test_adds_stop_at_the_member_limit() -> None:
    state = build({"j1": 1, "j2": 1, "j3": 1}, [("a", "A", 2)])
    result = plan(state, desired_of(state, {"j1": ["A"], "j2": ["A"], "j3": ["A"]}))
    assert ops_of(result.txns) == ["put j1#a#A#0", "put j2#a#A#0"]


def test_promotion_prefers_a_consistent_replica_then_the_least_primary_load() -> None:
    # Rules where each assignment is consistent on its own (as consumer shards are): a value
    # means "synchronized". The primary is gone; B is synchronized, C is not: B is promoted
    # although C has no primaries.
    def per_assignment(item: aks.Item, kv: KeyValue, all_: Sequence[KeyValue]) -> bool:
        return bool(kv.raw)

    base = broker_rules()
    rules = Rules(base.desired_replication, per_assignment, base.member_limit, base.member_exiting)
    synced = ([("b", "B")], 0)
    members = [("a", "A", 10), ("b", "B", 10), ("c", "C", 10)]
    state = build(
        {"j1": 2, "j2": 1},
        members,
        [Asn("j1", "b", "B", 1, synced), Asn("j1", "c", "C", 2), Asn("j2", "b", "B", 0, synced)],
        rules=rules,
    )
    result = plan(state, desired_of(state, {"j1": ["B", "C"], "j2": ["B"]}))
    assert ops_of(result.txns) == ["del j1#b#B#1", "put j1#b#B#0"]

    # Neither synchronized: the member with the lower primary load (C) is promoted.
    state = build(
        {"j1": 2, "j2": 1},
        members,
        [Asn("j1", "b", "B", 1), Asn("j1", "c", "C", 2), Asn("j2", "b", "B", 0, synced)],
        rules=rules,
    )
    result = plan(state, desired_of(state, {"j1": ["B", "C"], "j2": ["B"]}))
    assert ops_of(result.txns) == ["del j1#c#C#2", "put j1#c#C#0"]


def test_exiting_member_sheds_capacity_oldest_first() -> None:
    members = [("a", "A", 10), ("a", "B", 10), ("a", "C", 10), ("a", "D", 10)]
    state = build({"j1": 3, "j2": 3}, members, exiting=["A", "B"])
    # Six slots are needed of 40 and three members must remain: only one may shed, the oldest.
    assert state.shed == (10, 0, 0, 0)
    assert state.member_slots == 30
    state = build({"j1": 2, "j2": 2}, members, exiting=["A", "B"])
    assert state.shed == (10, 10, 0, 0)


def test_leader_is_the_oldest_member() -> None:
    state = build({}, [("b", "B", 1), ("a", "A", 1)], local=aks.member_key(ROOT, "b", "B"))
    # Members sort as (a, A), (b, B); B was created first.
    assert state.member_ids[state.leader] == ("b", "B")
    assert state.is_leader


def test_plan_rejects_a_mismatched_desired() -> None:
    state = build({"j1": 1}, [("a", "A", 1)])
    with pytest.raises(ValueError, match="desired has 0 items"):
        plan(state, [])
    assert isinstance(Delete("k"), Delete)


# ---- rounds to a fixed point, simulated ---------------------------------------------------------


class Store:
    """An in-memory etcd for the simulation: key -> (raw value, lease, create and mod revision)."""

    def __init__(self, state: State) -> None:
        self.revision = state.revision
        self.kvs: dict[str, KeyValue] = {}
        for kv in (*state.items, *state.members, *(kv for g in state.assignments for kv in g)):
            self.kvs[kv.key] = kv
        for group in state.orphans:
            for kv in group:
                self.kvs[kv.key] = kv
        self.decode = broker_decoder(ROOT)

    def state(self) -> State:
        def under(prefix: str) -> list[KeyValue]:
            return sorted(
                (kv for k, kv in self.kvs.items() if k.startswith(prefix)), key=lambda kv: kv.key
            )

        members = under(ROOT + aks.MEMBERS)
        return State.build(
            ROOT, self.revision, members[0].key if members else "", broker_rules(),
            items=under(ROOT + aks.ITEMS), members=members, assignments=under(ROOT + aks.ASSIGNMENTS),
        )  # fmt: skip

    def apply(self, txn: Txn) -> None:
        for c in txn.compares:
            kv = self.kvs.get(c.key)
            got = (
                0 if kv is None else (kv.mod_revision if c.target == "mod" else kv.create_revision)
            )
            assert got == c.revision, f"comparison failed: {c}"
        self.revision += 1
        for op in txn.ops:
            if isinstance(op, Delete):
                assert op.key in self.kvs, f"deleting absent {op.key}"
                del self.kvs[op.key]
        for op in txn.ops:
            if isinstance(op, Put):
                assert op.key not in self.kvs, f"overwriting {op.key}"
                decoded = self.decode(op.key, op.value)
                self.kvs[op.key] = KeyValue(
                    op.key, op.value, decoded, self.revision, self.revision, 1, op.lease
                )

    def pulse(self) -> int:
        """Write every journal's route into its assignments; how many changed."""
        groups: dict[str, list[KeyValue]] = {}
        for key, kv in sorted(self.kvs.items()):
            if key.startswith(ROOT + aks.ASSIGNMENTS):
                assert isinstance(kv.decoded, aks.Assignment)
                groups.setdefault(kv.decoded.item_id, []).append(kv)
        changed = 0
        for group in groups.values():
            raw = aks.build_route(group, lambda zone, suffix: None).SerializeToString()
            for kv in group:
                if kv.raw != raw:
                    self.revision += 1
                    self.kvs[kv.key] = KeyValue(
                        kv.key, raw, self.decode(kv.key, raw), kv.create_revision,
                        self.revision, kv.version + 1, kv.lease,
                    )  # fmt: skip
                    changed += 1
        return changed


def consistent_members(state: State, i: int) -> set[tuple[str, str]]:
    group = state.assignments[i]
    item = state.item(i)
    return {
        (kv.decoded.member_zone, kv.decoded.member_suffix)
        for kv in group
        if isinstance(kv.decoded, aks.Assignment)
        and kv.decoded.member_zone != "gone"
        and state.rules.is_consistent(item, kv, group)
    }


@st.composite
def clusters(draw: st.DrawFn) -> State:
    n_members = draw(st.integers(1, 5))
    members = [
        (draw(st.sampled_from(["a", "b", "c"])), f"m{m}", draw(st.integers(0, 4)))
        for m in range(n_members)
    ]
    items = {f"j{i}": draw(st.integers(0, 3)) for i in range(draw(st.integers(0, 6)))}
    suffixes = [s for _, s, _ in members] + ["x"]  # "x" is a member that no longer exists.
    zone_of = {s: z for z, s, _ in members} | {"x": "gone"}
    assignments = []
    for item in [*items, "deleted"]:
        chosen = draw(st.lists(st.sampled_from(suffixes), unique=True, max_size=3))
        synced = draw(st.booleans())
        route = ([(zone_of[s], s) for s in sorted(chosen, key=lambda s: (zone_of[s], s))], 0)
        for slot, s in enumerate(chosen):
            assignments.append(Asn(item, zone_of[s], s, slot, route if synced else None))
    exiting = draw(st.lists(st.sampled_from(suffixes[:-1]), unique=True, max_size=2))
    return build(items, members, assignments, exiting=exiting)


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_rounds_reach_the_desired_assignment_safely(state: State) -> None:
    """Rounds of plan -> apply, with a pulse whenever the leader idles, end at the desired
    assignment, and no round removes a consistent replica an item still needs."""
    desired = solve(state.problem()).assignments
    store = Store(state)
    for _ in range(50):
        state = store.state()
        result = plan(state, desired)
        if not result.txns:
            if store.pulse() == 0:
                break
            continue
        for txn in result.txns:
            store.apply(txn)
        after = store.state()
        for i in range(len(state.items)):
            before = consistent_members(state, i)
            kept = {
                (kv.decoded.member_zone, kv.decoded.member_suffix)
                for kv in after.assignments[i]
                if isinstance(kv.decoded, aks.Assignment)
            }
            assert len(before & kept) >= min(len(before), state.replication[i]), state.item_ids[i]
    else:
        raise AssertionError("no fixed point after 50 rounds")
    final = store.state()
    assert final.orphans == ()
    for i, want in enumerate(desired):
        group = final.assignments[i]
        held = {final.member_index.get(_member(kv), -1) for kv in group}
        for m in want:
            # Reached, unless the member is full of replicas that may not go yet.
            assert m in held or final.total_count[m] >= final.effective_limit(m)
        if held - set(want):
            # A replica stays beyond the desired set only while every replica is needed: after
            # the last pulse all are consistent, so there are no more than desired.
            assert len(group) <= final.replication[i], final.item_ids[i]
        slots = sorted(kv.decoded.slot for kv in group if isinstance(kv.decoded, aks.Assignment))
        assert slots == list(range(len(group)))


def _member(kv: KeyValue) -> tuple[str, str]:
    assert isinstance(kv.decoded, aks.Assignment)
    return kv.decoded.member_zone, kv.decoded.member_suffix
