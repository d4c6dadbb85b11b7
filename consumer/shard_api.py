"""The Shard service's keyspace RPCs, as upstream answers them: List (from the keyspace mirror,
the meta-label `id` in selectors, each shard with its revisions, route, endpoints and one status
per route member), Apply (one etcd transaction, `expect_mod_revision` 0 for a create and -1 for
no check, primary hints written as upstream's JSON, read-your-writes), GetHints (primary and
backup hints read from etcd, each validated and naming the shard's recovery log) and Unassign
(FAILED assignments always, the primary too unless `only_failed`, `dry_run`).

Stat needs the running shards, and lives with the consumer runtime. Each function takes a
`ShardState` (what it reads and writes) and raises `ValidationError` for a malformed request,
which the servicer answers INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd import transactions

from broker.allocator import keyspace as aks
from broker.keyspace import KeySpace, KeyValue
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import (
    ValidationError,
    at_field,
    validate_label_selector,
    validate_shard_id,
)
from consumer.keyspace import replica_status
from consumer.protocol import (
    cpb,
    hint_backup_keys,
    hint_primary_key,
    recovery_log,
    validate_shard_spec,
)
from consumer.recoverylog.hints import decode_hints, encode_hints, validate_hints
from plumbing import auth
from plumbing import etcd as etcdx

__all__ = [
    "HintsError",
    "ShardState",
    "apply_shards",
    "get_hints",
    "in_route_order",
    "list_shards",
    "unassign_shards",
    "validate_apply_request",
    "validate_unassign_request",
]


class HintsError(Exception):
    """Stored hints that cannot be used (undecodable, invalid, or for another log)."""


@dataclass(frozen=True)
class ShardState:
    """What the keyspace RPCs use: etcd, the mirror of the consumer's keyspace under `root`,
    and this process's id for response headers."""

    etcd: aetcd.Client
    ks: KeySpace
    root: str
    process_id: pb.ProcessSpec.ID

    def unrouted_header(self) -> pb.Header:
        h = self.ks.header
        return pb.Header(
            process_id=self.process_id,
            route=pb.Route(primary=-1),
            etcd=pb.Header.Etcd(
                cluster_id=h.cluster_id,
                member_id=h.member_id,
                revision=self.ks.revision,
                raft_term=h.raft_term,
            ),
        )

    def member(self, zone: str, suffix: str) -> aks.Member | None:
        kv = self.ks.get(aks.member_key(self.root, zone, suffix))
        decoded = kv.decoded if kv is not None else None
        return decoded if isinstance(decoded, aks.Member) else None

    def spec_of(self, shard_id: str) -> tuple[cpb.ShardSpec, KeyValue] | None:
        kv = self.ks.get(aks.item_key(self.root, shard_id))
        item = kv.decoded if kv is not None else None
        if kv is None or not isinstance(item, aks.Item) or not isinstance(item.spec, cpb.ShardSpec):
            return None
        return item.spec, kv

    def specs(self) -> list[cpb.ShardSpec]:
        """Every shard's spec, in id order."""
        out = []
        for kv in self.ks.prefixed(self.root + aks.ITEMS):
            item = kv.decoded
            if isinstance(item, aks.Item) and isinstance(item.spec, cpb.ShardSpec):
                out.append(item.spec)
        return out

    def assignments_of(self, shard_id: str) -> list[KeyValue]:
        prefix = f"{self.root}{aks.ASSIGNMENTS}{shard_id}{aks.SEP}"
        return [kv for kv in self.ks.prefixed(prefix) if isinstance(kv.decoded, aks.Assignment)]


# ---- List --------------------------------------------------------------------------------------


class NotAuthorized(Exception):
    """A change to a shard the caller's claims do not select: answered UNAUTHENTICATED."""

    def __init__(self, shard_id: str) -> None:
        super().__init__(f"not authorized to {shard_id}")


def _authorize_id(claims: auth.Claims, shard_id: str) -> None:
    """Deletes and unassignments are authorized on the shard's `id` alone (as upstream)."""
    if not claims.sees_labels(labels.label_set((labels.META_ID, shard_id))):
        raise NotAuthorized(shard_id)


def list_shards(
    state: ShardState, request: cpb.ListRequest, claims: auth.Claims = auth.UNRESTRICTED
) -> cpb.ListResponse:
    """Every shard whose labels (and `id`) match the selector, in id order; shards the
    caller's claims do not select are left out."""
    validate_label_selector(request.selector, field="selector")
    response = cpb.ListResponse(status=cpb.OK, header=state.unrouted_header())
    for kv in state.ks.prefixed(state.root + aks.ITEMS):
        item = kv.decoded
        if not isinstance(item, aks.Item) or not isinstance(item.spec, cpb.ShardSpec):
            continue
        if not labels.matches(request.selector, labels.shard_meta_labels(item.spec)):
            continue
        if not auth.sees_shard(claims, item.spec):
            continue
        assignments = in_route_order(state.assignments_of(item.id))
        shard = response.shards.add(
            spec=item.spec, mod_revision=kv.mod_revision, create_revision=kv.create_revision
        )
        shard.route.CopyFrom(aks.build_route(assignments, state.member))
        shard.status.extend(replica_status(a.decoded) for a in assignments)
    return response


def in_route_order(assignments: Sequence[KeyValue]) -> list[KeyValue]:
    def key(kv: KeyValue) -> tuple[str, str]:
        a = kv.decoded
        assert isinstance(a, aks.Assignment)
        return a.member_zone, a.member_suffix

    return sorted(assignments, key=key)


# ---- Apply -------------------------------------------------------------------------------------


def validate_apply_request(request: cpb.ApplyRequest) -> None:
    """Upstream's rules for each change: exactly one of upsert and delete; an upsert's spec valid,
    its revision >= 0 or -1, its hints valid; a delete's id valid, its revision > 0 or -1, and no
    hints. A shard changed twice in one request is refused too (etcd would refuse the
    transaction)."""
    seen: dict[str, int] = {}
    for index, change in enumerate(request.changes):
        here = f"changes[{index}]"
        upsert = change.HasField("upsert")
        if upsert and change.delete:
            raise ValidationError(here, "", "both upsert and delete are set (expected exactly one)")
        if not upsert and not change.delete:
            raise ValidationError(here, "", "neither upsert nor delete is set (expected one)")
        revision = change.expect_mod_revision
        if upsert:
            validate_shard_spec(change.upsert, field=at_field(here, "upsert"))
            if revision < -1:
                raise ValidationError(
                    at_field(here, "expect_mod_revision"),
                    revision,
                    f"{revision} is invalid (expected >= 0, or -1 for no check)",
                )
            if change.HasField("primary_hints"):
                validate_hints(change.primary_hints, field=at_field(here, "primary_hints"))
            shard_id = change.upsert.id
        else:
            validate_shard_id(change.delete, field=at_field(here, "delete"))
            if revision <= 0 and revision != -1:
                raise ValidationError(
                    at_field(here, "expect_mod_revision"),
                    revision,
                    f"{revision} is invalid for a delete (expected the shard's revision, > 0, "
                    "or -1 for no check)",
                )
            if change.HasField("primary_hints"):
                raise ValidationError(
                    at_field(here, "primary_hints"), "", "hints go only with an upsert"
                )
            shard_id = change.delete
        if shard_id in seen:
            raise ValidationError(
                here, shard_id, f"shard {shard_id!r} is also changed by changes[{seen[shard_id]}]"
            )
        seen[shard_id] = index


async def apply_shards(
    state: ShardState, request: cpb.ApplyRequest, claims: auth.Claims = auth.UNRESTRICTED
) -> cpb.ApplyResponse:
    """All the changes in one etcd transaction, or none (ETCD_TRANSACTION_FAILED). Upserts
    are authorized on the shard's labels and `id`, deletes on its `id`, and both on the labels
    of the spec they replace: one change the caller may not make refuses them all
    (NotAuthorized), whatever its expected revision."""
    validate_apply_request(request)
    for change in request.changes:
        if change.HasField("upsert"):
            if not auth.sees_shard(claims, change.upsert):
                raise NotAuthorized(change.upsert.id)
        else:
            _authorize_id(claims, change.delete)
    keys: list[bytes] = []
    ids: list[str] = []
    ops: list[Any] = []
    for change in request.changes:
        shard_id = change.upsert.id if change.HasField("upsert") else change.delete
        key = aks.item_key(state.root, shard_id).encode()
        keys.append(key)
        ids.append(shard_id)
        if change.HasField("upsert"):
            ops.append(transactions.Put(key, change.upsert.SerializeToString()))
            if change.HasField("primary_hints"):
                hint_key = hint_primary_key(change.upsert)
                ops.append(transactions.Put(hint_key.encode(), encode_hints(change.primary_hints)))
        else:
            ops.append(transactions.Delete(key))

    def check_replaced(index: int, value: bytes) -> None:
        # A shard the caller cannot see is neither replaced nor deleted by it, and is refused as
        # any unauthorized change, before a revision check could reveal it.
        if not auth.sees_shard(claims, cpb.ShardSpec.FromString(value)):
            raise NotAuthorized(ids[index])

    expected = [change.expect_mod_revision for change in request.changes]
    check = None if claims.unrestricted else check_replaced
    result = await etcdx.txn_guarded(state.etcd, keys, expected, ops, check)
    response = cpb.ApplyResponse(status=cpb.OK, header=state.unrouted_header())
    if not result.succeeded:
        response.status = cpb.ETCD_TRANSACTION_FAILED
    elif ops:
        await state.ks.wait_for_revision(result.revision)  # Read-your-writes for List.
    response.header.etcd.revision = result.revision
    return response


# ---- GetHints ----------------------------------------------------------------------------------


async def get_hints(
    state: ShardState, request: cpb.GetHintsRequest, claims: auth.Claims = auth.UNRESTRICTED
) -> cpb.GetHintsResponse:
    """The shard's primary hints and its backups (a missing one is left empty)."""
    validate_shard_id(request.shard, field="shard")
    response = cpb.GetHintsResponse(status=cpb.OK, header=state.unrouted_header())
    found = state.spec_of(request.shard)
    if found is None or not auth.sees_shard(claims, found[0]):
        response.status = cpb.SHARD_NOT_FOUND
        return response
    spec, _ = found
    log = recovery_log(spec)
    keys = [hint_primary_key(spec), *hint_backup_keys(spec)]
    values = await etcdx.get_many(state.etcd, [key.encode() for key in keys])  # One revision.
    for index, (key, value) in enumerate(zip(keys, values, strict=True)):
        hints = _checked_hints(key, value, log)
        slot = response.primary_hints if index == 0 else response.backup_hints.add()
        if hints is not None:
            slot.hints.CopyFrom(hints)
    return response


def _checked_hints(key: str, raw: bytes | None, log: str) -> rpb.FSMHints | None:
    if raw is None:
        return None
    try:
        hints = decode_hints(raw)
        validate_hints(hints)
    except (ValueError, ValidationError) as exc:
        raise HintsError(f"hints at {key}: {exc}") from None
    if hints.log != log:
        raise HintsError(f"hints at {key} are for log {hints.log!r}, not the shard's {log!r}")
    return hints


# ---- Unassign ----------------------------------------------------------------------------------


def validate_unassign_request(request: cpb.UnassignRequest) -> None:
    for index, shard_id in enumerate(request.shards):
        validate_shard_id(shard_id, field=f"shards[{index}]")


async def unassign_shards(
    state: ShardState, request: cpb.UnassignRequest, claims: auth.Claims = auth.UNRESTRICTED
) -> cpb.UnassignResponse:
    """Remove the FAILED assignments of these shards, and their primaries unless `only_failed`
    (the allocator then assigns afresh); `dry_run` only says which shards would change. Each
    removal is conditioned on the assignment's revision, all in one transaction."""
    validate_unassign_request(request)
    for shard_id in request.shards:
        _authorize_id(claims, shard_id)
    response = cpb.UnassignResponse(status=cpb.OK)
    compare: list[Any] = []
    ops: list[Any] = []
    for shard_id in request.shards:
        for kv in state.assignments_of(shard_id):
            assignment = kv.decoded
            assert isinstance(assignment, aks.Assignment)
            failed = replica_status(assignment).code == cpb.ReplicaStatus.FAILED
            if not failed and (request.only_failed or assignment.slot != 0):
                continue
            compare.append(transactions.Mod(kv.key.encode()) == kv.mod_revision)
            ops.append(transactions.Delete(kv.key.encode()))
            if not response.shards or response.shards[-1] != shard_id:
                response.shards.append(shard_id)
    if request.dry_run or not ops:
        return response
    result = await etcdx.txn(state.etcd, compare, ops)
    if not result.succeeded:
        response.status = cpb.ETCD_TRANSACTION_FAILED
    else:
        await state.ks.wait_for_revision(result.revision)
    return response
