"""The shard keyspace in etcd, laid out as upstream's (the allocator's layout, with consumer
values): `{root}/items/{shard id}` a ShardSpec, `{root}/members/{zone}#{suffix}` a ConsumerSpec
under the process's lease, `{root}/assign/{shard id}#{zone}#{suffix}#{slot}` a ReplicaStatus
(IDLE is empty bytes; slot 0 is the primary), and `{root}/hints/...` the shards' hints (not
mirrored: they are read from etcd where needed). Values are validated as they are decoded, and a
spec whose own id (or process id) differs from its key's is refused, as upstream's decoder does:
the key is the source of truth, and the two must never diverge.

`consumer_rules` are the allocator's rules for shards: desired replication from hot standbys,
and a replica is consistent once it is STANDBY or PRIMARY.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from allocator import Rules
from allocator import keyspace as aks
from allocator.keyspace import Assignment, Item, Member
from broker.protocol.validate import ValidationError
from consumer.protocol import (
    DEFAULT_MAX_HOT_STANDBYS,
    cpb,
    desired_replication,
    hint_root,
    validate_consumer_spec,
    validate_replica_status,
    validate_shard_spec,
)
from keyspace import KeySpace, KeyValue

__all__ = [
    "consumer_decoder",
    "consumer_rules",
    "replica_status",
    "shard_is_consistent",
    "shard_keyspace",
]


def shard_keyspace(root: str, *, apply_delay: float = 0.03) -> KeySpace:
    """The mirror of the shard layout under `root`, without the shards' hints (read from etcd
    where needed: every shard writes them every few minutes, and in the mirror they would be
    held in memory and wake reconciliation each time). Its prefix ends in '/', so another
    application whose prefix extends this one's stays out."""
    return KeySpace(
        root + "/",
        consumer_decoder(root),
        apply_delay=apply_delay,
        unmirrored=hint_root(root) + "/",
    )


def consumer_decoder(root: str) -> Callable[[str, bytes], object]:
    """A keyspace value decoder for the shard layout under `root` (see the module's doc)."""
    inner = aks.new_decoder(root, cpb.ShardSpec, cpb.ConsumerSpec, cpb.ReplicaStatus)

    def decode(key: str, raw: bytes) -> object:
        decoded = inner(key, raw)
        if isinstance(decoded, Item):
            spec = decoded.spec
            assert isinstance(spec, cpb.ShardSpec)
            validate_shard_spec(spec)
            if spec.id != decoded.id:
                raise ValidationError(
                    "id", spec.id, f"ShardSpec id {spec.id!r} differs from its key's {decoded.id!r}"
                )
        elif isinstance(decoded, Member):
            spec = decoded.spec
            assert isinstance(spec, cpb.ConsumerSpec)
            validate_consumer_spec(spec)
            pid = spec.process_spec.id
            if (pid.zone, pid.suffix) != (decoded.zone, decoded.suffix):
                raise ValidationError(
                    "process_spec.id",
                    f"{pid.zone}#{pid.suffix}",
                    f"ConsumerSpec id {pid.zone}#{pid.suffix} differs from its key's "
                    f"{decoded.zone}#{decoded.suffix}",
                )
        elif isinstance(decoded, Assignment):
            status = decoded.value if decoded.value is not None else cpb.ReplicaStatus()
            assert isinstance(status, cpb.ReplicaStatus)
            validate_replica_status(status)
            decoded = Assignment(
                decoded.item_id, decoded.member_zone, decoded.member_suffix, decoded.slot, status
            )
        return decoded

    return decode


def replica_status(assignment: object) -> cpb.ReplicaStatus:
    """The status an assignment holds (IDLE for an empty or undecodable one)."""
    if isinstance(assignment, Assignment) and isinstance(assignment.value, cpb.ReplicaStatus):
        return assignment.value
    return cpb.ReplicaStatus()


def shard_is_consistent(item: Item, assignment: KeyValue, assignments: Sequence[KeyValue]) -> bool:
    """Whether this replica could take over: STANDBY or PRIMARY. A FAILED one counts only when
    the primary failed too (swapping one failed replica for another does no harm, and it lets a
    failed primary be moved or exit). IDLE and BACKFILL are still starting or replaying."""
    code = replica_status(assignment.decoded).code
    if code in (cpb.ReplicaStatus.STANDBY, cpb.ReplicaStatus.PRIMARY):
        return True
    if code != cpb.ReplicaStatus.FAILED:
        return False
    return any(
        isinstance(a, Assignment)
        and a.slot == 0
        and replica_status(a).code == cpb.ReplicaStatus.FAILED
        for a in (kv.decoded for kv in assignments)
    )


def consumer_rules(max_hot_standbys: int = DEFAULT_MAX_HOT_STANDBYS) -> Rules:
    """The allocator's rules for consumers allocating shards."""
    if max_hot_standbys < 0:
        raise ValueError(f"max_hot_standbys must be >= 0 (got {max_hot_standbys})")

    def wanted(item: Item) -> int:
        spec = item.spec
        if not isinstance(spec, cpb.ShardSpec):
            raise TypeError(f"item {item.id} holds a {type(spec).__name__}, not a ShardSpec")
        return desired_replication(spec, max_hot_standbys)

    def member_limit(member: Member) -> int:
        spec = member.spec
        return spec.shard_limit if isinstance(spec, cpb.ConsumerSpec) else 0

    def member_exiting(member: Member) -> bool:
        spec = member.spec
        return isinstance(spec, cpb.ConsumerSpec) and spec.exiting

    return Rules(wanted, shard_is_consistent, member_limit, member_exiting)
