"""The brokers' keyspace: journals (JournalSpec items), brokers (BrokerSpec members) and their
assignments (Route values) in the allocator's layout, as upstream's `broker.NewKeySpace`; and
the rules the allocator reads them by (a journal's desired replication and consistency, a
broker's journal limit). Consumers have theirs in `consumer.keyspace`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from allocator import keyspace as aks
from allocator.keyspace import Item, Member
from allocator.rules import Rules
from broker.fragment.stores.paths import canonical_spec_stores
from broker.protocol import protocol_pb2 as pb
from keyspace import KeySpace, KeyValue

# Upstream's default --broker.max-replication.
DEFAULT_MAX_REPLICATION = 9


def broker_keyspace(root: str, *, apply_delay: float = 0.03) -> KeySpace:
    """The brokers' mirror of the journal layout under `root`, without the path lock keys
    (bumped at Applies; nothing reads them from the mirror, and the decoder knows no layout for
    them)."""
    return KeySpace(
        root, broker_decoder(root), apply_delay=apply_delay, unmirrored=root + aks.PATHS
    )


def broker_decoder(root: str) -> Callable[[str, bytes], object]:
    decode = aks.new_decoder(root, pb.JournalSpec, pb.BrokerSpec, pb.Route)

    def canonical(key: str, raw: bytes) -> object:
        # Specs that reached etcd other than through our Apply (older brokers, hand-written)
        # may spell a store many ways: brokers use its one canonical spelling.
        out = decode(key, raw)
        if isinstance(out, aks.Item) and isinstance(out.spec, pb.JournalSpec):
            canonical_spec_stores(out.spec)
        return out

    return canonical


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
