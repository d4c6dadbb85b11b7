"""An immutable snapshot of the allocator's keyspace: items, members and assignments at one
revision, with what every round derives from them (leader, per-member load, effective limits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from allocator import keyspace as aks
from allocator.keyspace import Assignment, Item, Member
from allocator.rules import Rules
from allocator.solver import Problem
from keyspace import KeySpace, KeyValue

MemberId = tuple[str, str]  # (zone, suffix)


@dataclass(frozen=True, eq=False)
class State:
    """Items, members and assignments under `root` at `revision`, pivoted on `local_key`.

    Items and members are in key order (members therefore in (zone, suffix) order), and each
    item's assignments in key order. Member indexes are positions in `members`.
    """

    root: str
    revision: int
    local_key: str
    rules: Rules
    items: tuple[KeyValue, ...]
    item_ids: tuple[str, ...]
    # Desired replication of each item, by `rules`.
    replication: tuple[int, ...]
    members: tuple[KeyValue, ...]
    member_ids: tuple[MemberId, ...]
    member_index: Mapping[MemberId, int]
    limits: tuple[int, ...]
    exiting: tuple[bool, ...]
    # Capacity taken from each exiting member so that the allocator drains it.
    shed: tuple[int, ...]
    # Assignments of each item.
    assignments: tuple[tuple[KeyValue, ...], ...]
    # Assignments whose item does not exist, grouped by item.
    orphans: tuple[tuple[KeyValue, ...], ...]
    # Assignments (all, and primaries) held by each member.
    total_count: tuple[int, ...]
    primary_count: tuple[int, ...]
    leader: int  # Index of the leading member, or -1 without members.
    local: int  # Index of the local member, or -1 if its key is absent.
    local_assignments: int  # Assignments naming the local member (orphans included).

    @classmethod
    def from_keyspace(cls, ks: KeySpace, root: str, local_key: str, rules: Rules) -> State:
        return cls.build(
            root,
            ks.revision,
            local_key,
            rules,
            items=ks.prefixed(root + aks.ITEMS),
            members=ks.prefixed(root + aks.MEMBERS),
            assignments=ks.prefixed(root + aks.ASSIGNMENTS),
        )

    @classmethod
    def build(
        cls,
        root: str,
        revision: int,
        local_key: str,
        rules: Rules,
        *,
        items: Sequence[KeyValue],
        members: Sequence[KeyValue],
        assignments: Sequence[KeyValue],
    ) -> State:
        """Derive a State from key-ordered KeyValues decoded by `aks.new_decoder`."""
        # A value that decoded as something else (a mistaken key under the prefix) is skipped.
        items = [kv for kv in items if isinstance(kv.decoded, Item)]
        members = [kv for kv in members if isinstance(kv.decoded, Member)]

        item_ids = tuple(_item(kv).id for kv in items)
        replication = tuple(max(0, rules.desired_replication(_item(kv))) for kv in items)
        member_ids = tuple((_member(kv).zone, _member(kv).suffix) for kv in members)
        member_index = {mid: m for m, mid in enumerate(member_ids)}
        limits = tuple(max(0, rules.member_limit(_member(kv))) for kv in members)
        exiting = tuple(rules.member_exiting(_member(kv)) for kv in members)

        local = member_index.get(_member_id_of_key(root, local_key), -1)
        if local >= 0 and members[local].key != local_key:
            local = -1

        by_item: dict[str, list[KeyValue]] = {}
        total = [0] * len(members)
        primary = [0] * len(members)
        local_assignments = 0
        local_id = member_ids[local] if local >= 0 else None
        for kv in assignments:
            a = kv.decoded
            if not isinstance(a, Assignment):
                continue
            group = by_item.get(a.item_id)
            if group is None:
                by_item[a.item_id] = [kv]
            else:
                group.append(kv)
            mid = (a.member_zone, a.member_suffix)
            m = member_index.get(mid, -1)
            if m >= 0:
                total[m] += 1
                if a.slot == 0:
                    primary[m] += 1
            if mid == local_id:
                local_assignments += 1

        per_item = tuple(tuple(by_item.pop(item_id, ())) for item_id in item_ids)
        orphans = tuple(tuple(group) for _, group in sorted(by_item.items()))

        leader = -1
        if members:
            leader = min(range(len(members)), key=lambda m: (members[m].create_revision, m))

        return cls(
            root=root,
            revision=revision,
            local_key=local_key,
            rules=rules,
            items=tuple(items),
            item_ids=item_ids,
            replication=replication,
            members=tuple(members),
            member_ids=member_ids,
            member_index=member_index,
            limits=limits,
            exiting=exiting,
            shed=_shed_capacity(members, limits, exiting, replication),
            assignments=per_item,
            orphans=orphans,
            total_count=tuple(total),
            primary_count=tuple(primary),
            leader=leader,
            local=local,
            local_assignments=local_assignments,
        )

    # ---- derived ------------------------------------------------------------------------

    def item(self, i: int) -> Item:
        return _item(self.items[i])

    def member(self, m: int) -> Member:
        return _member(self.members[m])

    def effective_limit(self, m: int) -> int:
        return self.limits[m] - self.shed[m]

    @property
    def is_leader(self) -> bool:
        return self.local >= 0 and self.local == self.leader

    @property
    def should_exit(self) -> bool:
        """The local member is exiting and holds no assignment: it may stop."""
        return self.local >= 0 and self.exiting[self.local] and self.local_assignments == 0

    @property
    def item_slots(self) -> int:
        return sum(self.replication)

    @property
    def member_slots(self) -> int:
        return sum(self.limits) - sum(self.shed)

    @cached_property
    def network_key(self) -> tuple[Any, ...]:
        """What a desired assignment depends on besides the current assignments: while it is
        unchanged, the last solution remains a valid target and is not re-solved."""
        return (
            self.item_ids,
            self.replication,
            self.member_ids,
            tuple(self.effective_limit(m) for m in range(len(self.members))),
        )

    def problem(self) -> Problem:
        """This state as a solver input."""
        index = self.member_index
        current: list[tuple[int, ...]] = []
        for group in self.assignments:
            ranked: list[tuple[int, int]] = []
            for kv in group:
                a = _assignment(kv)
                m = index.get((a.member_zone, a.member_suffix), -1)
                if m >= 0:
                    ranked.append((a.slot, m))
            ranked.sort()
            current.append(tuple(m for _, m in ranked))
        return Problem(
            replication=self.replication,
            zones=tuple(zone for zone, _ in self.member_ids),
            limits=tuple(self.effective_limit(m) for m in range(len(self.members))),
            current=current,
        )


def _item(kv: KeyValue) -> Item:
    decoded = kv.decoded
    assert isinstance(decoded, Item)
    return decoded


def _member(kv: KeyValue) -> Member:
    decoded = kv.decoded
    assert isinstance(decoded, Member)
    return decoded


def _assignment(kv: KeyValue) -> Assignment:
    decoded = kv.decoded
    assert isinstance(decoded, Assignment)
    return decoded


def _member_id_of_key(root: str, key: str) -> MemberId:
    zone, _, suffix = key[len(root) + len(aks.MEMBERS) :].partition(aks.SEP)
    return zone, suffix


def _shed_capacity(
    members: Sequence[KeyValue],
    limits: Sequence[int],
    exiting: Sequence[bool],
    replication: Sequence[int],
) -> tuple[int, ...]:
    """Capacity to take from exiting members, oldest first, so that they drain.

    Only capacity the cluster can spare is shed: never below the slots items need, and never
    from so many members that fewer remain than the largest replication factor (zones are not
    considered: replacements are expected to restore zone diversity as they join).
    """
    shed = [0] * len(members)
    excess = max(0, sum(limits) - sum(replication))
    keep = max(replication, default=0)
    max_shedding = max(0, len(members) - keep)
    leaving = sorted(
        (m for m in range(len(members)) if exiting[m]),
        key=lambda m: (members[m].create_revision, m),
    )
    for m in leaving[:max_shedding]:
        if excess == 0:
            break
        shed[m] = min(limits[m], excess)
        excess -= shed[m]
    return tuple(shed)
