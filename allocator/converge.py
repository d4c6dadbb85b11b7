"""One convergence round, planned without I/O: the etcd transactions that move the current
assignments of a State toward a desired assignment without breaking any constraint on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from allocator import keyspace as aks
from allocator.keyspace import Assignment
from allocator.state import State
from keyspace import KeyValue

# etcd's default --max-txn-ops, which bounds both comparisons and operations of a transaction.
MAX_TXN_OPS = 128


@dataclass(frozen=True, slots=True)
class Compare:
    """`key`'s mod (or create) revision must equal `revision`; 0 means the key is absent."""

    key: str
    target: Literal["mod", "create"]
    revision: int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int  # 0: no lease.


@dataclass(frozen=True, slots=True)
class Delete:
    key: str


Op = Put | Delete


@dataclass(frozen=True, slots=True)
class Txn:
    compares: tuple[Compare, ...]
    ops: tuple[Op, ...]


@dataclass
class Plan:
    """The transactions of a round, and what they do."""

    txns: list[Txn] = field(default_factory=list)
    added: int = 0
    removed: int = 0
    moved: int = 0  # Promotions and slot packing.
    deferred: int = 0  # Removals held back by consistency.
    orphans: int = 0  # Assignments of deleted items, removed.


def plan(state: State, desired: Sequence[Sequence[int]], *, max_ops: int = MAX_TXN_OPS) -> Plan:
    """The transactions bringing `state` one round closer to `desired` (member indexes of each
    item, as a Solution holds them). `state` must have a leader member.

    Per item, in one atomic group: add desired assignments (within each member's effective limit),
    remove undesired ones (never leaving fewer consistent replicas than desired), promote a primary
    if there is none (consistent replicas first, then the member with the least primary load), and,
    in a round with nothing else to do for the item, pack slots to 0..n-1. Assignments of items that
    no longer exist are deleted. Groups are batched into transactions of at most `max_ops`
    operations and comparisons, each also asserting that the leader's member key is unchanged.
    """
    if len(desired) != len(state.items):
        raise ValueError(f"desired has {len(desired)} items, the state {len(state.items)}")
    if state.leader < 0:
        raise ValueError("a state without members has no leader to converge for")
    if max_ops < 8:
        raise ValueError(f"max_ops must be >= 8 (got {max_ops})")
    leader = state.members[state.leader]
    builder = _Batches(Compare(leader.key, "mod", leader.mod_revision), max_ops)
    result = Plan()
    planner = _ItemPlanner(state, result, max_ops)
    # Orphans go first: removing them frees member capacity for the adds that follow.
    for group in state.orphans:
        for compares, ops in _orphan_groups(state, group, max_ops):
            result.orphans += len(ops)
            builder.add(compares, ops)
        for kv in group:
            planner.released(kv)
    for i, want in enumerate(desired):
        compares, ops = planner.item(i, want)
        if ops:
            builder.add(compares, ops)
    result.txns = builder.finish()
    return result


class _Batches:
    """Packs groups (which must each apply atomically) into as few transactions as fit."""

    def __init__(self, fixed: Compare, max_ops: int) -> None:
        self.fixed = fixed
        self.max_ops = max_ops
        self.txns: list[Txn] = []
        self.compares: dict[tuple[str, str], Compare] = {}
        self.ops: list[Op] = []

    def add(self, compares: Sequence[Compare], ops: Sequence[Op]) -> None:
        fresh = [c for c in compares if (c.key, c.target) not in self.compares]
        if self.ops and (
            len(self.compares) + len(fresh) + 1 > self.max_ops
            or len(self.ops) + len(ops) > self.max_ops
        ):
            self._flush()
            fresh = list(compares)
        for c in fresh:
            self.compares[(c.key, c.target)] = c
        self.ops.extend(ops)

    def _flush(self) -> None:
        self.txns.append(Txn((self.fixed, *self.compares.values()), tuple(self.ops)))
        self.compares = {}
        self.ops = []

    def finish(self) -> list[Txn]:
        if self.ops:
            self._flush()
        return self.txns


def _orphan_groups(
    state: State, group: Sequence[KeyValue], max_ops: int
) -> list[tuple[list[Compare], list[Op]]]:
    """Deletes of a deleted item's assignments, each chunk guarded by the item's absence (so a
    re-created item keeps them) and by each assignment being unchanged."""
    item_id = _assignment(group[0]).item_id
    absent = Compare(aks.item_key(state.root, item_id), "create", 0)
    chunk = max_ops - 2  # Room for the leader and absence comparisons.
    out: list[tuple[list[Compare], list[Op]]] = []
    for start in range(0, len(group), chunk):
        kvs = group[start : start + chunk]
        compares = [absent, *(Compare(kv.key, "mod", kv.mod_revision) for kv in kvs)]
        out.append((compares, [Delete(kv.key) for kv in kvs]))
    return out


class _ItemPlanner:
    def __init__(self, state: State, result: Plan, max_ops: int) -> None:
        self.state = state
        self.result = result
        self.total = list(state.total_count)
        self.primary = list(state.primary_count)
        self.limits = [state.effective_limit(m) for m in range(len(state.members))]
        # Leave room for the leader's comparison, the item's, and a promotion.
        self.budget = max_ops - 4

    def released(self, kv: KeyValue) -> None:
        """Account for the removal of assignment `kv`."""
        m = self.member_of(kv)
        if m >= 0:
            self.total[m] -= 1
            if _assignment(kv).slot == 0:
                self.primary[m] -= 1

    def member_of(self, kv: KeyValue) -> int:
        a = _assignment(kv)
        return self.state.member_index.get((a.member_zone, a.member_suffix), -1)

    def ratio(self, m: int, counts: Sequence[int]) -> float:
        """Load of member `m` relative to its effective limit; infinite if it cannot hold any
        (or is gone), so its assignments go first and it is promoted last."""
        if m < 0 or self.limits[m] <= 0:
            return float("inf")
        return counts[m] / self.limits[m]

    def item(self, i: int, want: Sequence[int]) -> tuple[list[Compare], list[Op]]:
        state = self.state
        current = state.assignments[i]
        if _settled(state, current, want):
            return [], []

        wanted_ids = {state.member_ids[m] for m in want}
        keep: list[KeyValue] = []
        unwanted: list[KeyValue] = []
        held: set[tuple[str, str]] = set()
        for kv in current:
            a = _assignment(kv)
            mid = (a.member_zone, a.member_suffix)
            if mid in wanted_ids and mid not in held:
                keep.append(kv)
            else:
                unwanted.append(kv)  # Undesired, or a second assignment of one member.
            held.add(mid)
        adds = [m for m in want if state.member_ids[m] not in held]

        # Consistency is asked only where a removal or promotion depends on it: for brokers it
        # rebuilds the journal's route per assignment.
        consistent: dict[str, bool] = {}
        if unwanted or (keep and all(_assignment(kv).slot for kv in keep)):
            item = state.item(i)
            for kv in current:
                live = self.member_of(kv) >= 0
                consistent[kv.key] = live and state.rules.is_consistent(item, kv, current)
        removes, deferred = self._constrain_removals(i, unwanted, consistent)
        self.result.deferred += len(deferred)
        adds = [m for m in adds if self.total[m] < self.limits[m]]
        room = self.budget - 2 * len(removes)
        adds = adds[: max(0, room // 2)]

        compares: list[Compare] = []
        ops: list[Op] = []
        for n, kv in enumerate(removes):
            if n == 0:
                # The item's replication must be what the removal was judged against.
                spec = state.items[i]
                compares.append(Compare(spec.key, "mod", spec.mod_revision))
            compares.append(Compare(kv.key, "mod", kv.mod_revision))
            ops.append(Delete(kv.key))
            self.released(kv)
        self.result.removed += len(removes)

        remaining = sorted(keep + deferred, key=lambda kv: _assignment(kv).slot)
        next_slot = 1 + max((_assignment(kv).slot for kv in current), default=-1)
        slots: dict[int, int] = {}
        if adds and not remaining:
            # No surviving replica to promote: the new member with the least primary load
            # starts as primary.
            first = min(adds, key=lambda m: (self.ratio(m, self.primary), m))
            slots[first] = 0
            next_slot = max(next_slot, 1)
        for m in adds:
            if m not in slots:
                slots[m], next_slot = next_slot, next_slot + 1
            member = state.members[m]
            compares.append(Compare(member.key, "mod", member.mod_revision))
            zone, suffix = state.member_ids[m]
            key = aks.assignment_key(state.root, state.item_ids[i], zone, suffix, slots[m])
            ops.append(Put(key, b"", member.lease))
            self.total[m] += 1
            if slots[m] == 0:
                self.primary[m] += 1
        self.result.added += len(adds)

        if remaining and _assignment(remaining[0]).slot != 0:
            # A replica about to be removed would only hand the primary on again.
            best = min(
                range(len(remaining)),
                key=lambda n: (
                    not consistent[remaining[n].key],
                    _member_id(remaining[n]) not in wanted_ids,
                    self.ratio(self.member_of(remaining[n]), self.primary),
                    n,
                ),
            )
            promoted = remaining.pop(best)
            remaining.insert(0, promoted)
            self._move(promoted, 0, compares, ops)
            m = self.member_of(promoted)
            if m >= 0:
                self.primary[m] += 1
        elif not adds and not removes:
            moves = 0
            for n, kv in enumerate(remaining):
                if n and _assignment(kv).slot != n and moves < self.budget // 2:
                    self._move(kv, n, compares, ops)
                    moves += 1
        return compares, ops

    def _constrain_removals(
        self, i: int, unwanted: list[KeyValue], consistent: dict[str, bool]
    ) -> tuple[list[KeyValue], list[KeyValue]]:
        """Split `unwanted` into removals allowed now and removals deferred.

        Removals go most loaded member first. While fewer than the desired replicas are
        consistent, nothing goes; a consistent replica goes only if more than the desired
        count stay consistent. An assignment of a member that no longer exists is not a live
        replica and always goes.
        """
        desired = self.state.replication[i]
        n = sum(consistent.values())
        ranked = sorted(unwanted, key=lambda kv: -self.ratio(self.member_of(kv), self.total))
        removes: list[KeyValue] = []
        deferred: list[KeyValue] = []
        cap = self.budget // 2
        for kv in ranked:
            if len(removes) >= cap:
                deferred.append(kv)
            elif self.member_of(kv) < 0:
                removes.append(kv)
            elif n < desired or (consistent[kv.key] and n == desired):
                deferred.append(kv)
            else:
                if consistent[kv.key]:
                    n -= 1
                removes.append(kv)
        return removes, deferred

    def _move(self, kv: KeyValue, slot: int, compares: list[Compare], ops: list[Op]) -> None:
        """Re-key an assignment to `slot`, keeping its value and lease."""
        a = _assignment(kv)
        key = aks.assignment_key(self.state.root, a.item_id, a.member_zone, a.member_suffix, slot)
        compares.append(Compare(kv.key, "mod", kv.mod_revision))
        ops.append(Delete(kv.key))
        ops.append(Put(key, kv.raw, kv.lease))
        self.result.moved += 1


def _settled(state: State, current: Sequence[KeyValue], want: Sequence[int]) -> bool:
    """Current assignments are exactly the desired members, in slots 0..n-1."""
    if len(current) != len(want):
        return False
    ids = state.member_ids
    slots = 0
    for kv, m in zip(current, want, strict=True):
        a = kv.decoded
        if not isinstance(a, Assignment) or (a.member_zone, a.member_suffix) != ids[m]:
            return False
        if a.slot >= len(want):
            return False
        slots |= 1 << a.slot
    return slots == (1 << len(want)) - 1


def _member_id(kv: KeyValue) -> tuple[str, str]:
    a = _assignment(kv)
    return a.member_zone, a.member_suffix


def _assignment(kv: KeyValue) -> Assignment:
    decoded = kv.decoded
    assert isinstance(decoded, Assignment)
    return decoded
