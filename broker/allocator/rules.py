"""What the allocator needs to know about the specs it allocates: an item's desired replication,
whether an item's replicas are consistent, a member's item limit and whether it is exiting.

Brokers read JournalSpec / BrokerSpec / Route (`broker_rules`); consumers will supply their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.allocator import keyspace as aks
from broker.allocator.keyspace import Item, Member
from broker.keyspace import KeyValue
from broker.protocol import protocol_pb2 as pb

# Upstream's default --broker.max-replication.
DEFAULT_MAX_REPLICATION = 9

# (item, one of its assignments, all of its assignments) -> is that assignment consistent?
IsConsistent = Callable[[Item, KeyValue, Sequence[KeyValue]], bool]


@dataclass(frozen=True)
class Rules:
    """The spec-reading functions the allocator is parameterized by."""

    desired_replication: Callable[[Item], int]
    is_consistent: IsConsistent
    member_limit: Callable[[Member], int]
    member_exiting: Callable[[Member], bool]


def journal_desired_replication(spec: pb.JournalSpec, max_replication: int) -> int:
    """Replicas a journal wants: its replication, capped; a suspended journal wants fewer (one
    read-only replica when PARTIAL, none when FULL)."""
    level = spec.suspend.level
    if level == pb.JournalSpec.Suspend.FULL:
        replication = 0
    elif level == pb.JournalSpec.Suspend.PARTIAL:
        replication = 1
    else:
        replication = spec.replication
    return max(0, min(replication, max_replication))


def journal_is_consistent(
    item: Item, assignment: KeyValue, assignments: Sequence[KeyValue]
) -> bool:
    """True when every assignment of the journal advertises the Route its assignment set implies
    (members in (zone, suffix) order, and the slot-0 primary): the replicas have synchronized on
    that route. Endpoints are not compared: they change with restarts, not with membership.

    The journal is consistent as a whole, so the answer is the same for each of its assignments.
    """
    implied = aks.build_route(assignments, lambda _zone, _suffix: None)
    return aks.route_matches_assignments(implied, assignments)


def broker_rules(max_replication: int = DEFAULT_MAX_REPLICATION) -> Rules:
    """Rules for brokers allocating journals."""
    if max_replication < 0:
        raise ValueError(f"max_replication must be >= 0 (got {max_replication})")

    def desired_replication(item: Item) -> int:
        spec = item.spec
        if not isinstance(spec, pb.JournalSpec):
            raise TypeError(f"item {item.id} holds a {type(spec).__name__}, not a JournalSpec")
        return journal_desired_replication(spec, max_replication)

    def member_limit(member: Member) -> int:
        spec = member.spec
        return spec.journal_limit if isinstance(spec, pb.BrokerSpec) else 0

    def member_exiting(member: Member) -> bool:
        spec = member.spec
        return isinstance(spec, pb.BrokerSpec) and spec.exiting

    return Rules(desired_replication, journal_is_consistent, member_limit, member_exiting)
