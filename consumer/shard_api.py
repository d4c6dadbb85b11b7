"""The Shard service's keyspace RPCs, as upstream answers them: List (from the keyspace mirror,
the meta-label `id` in selectors, each shard with its revisions, route, endpoints and one status
per route member), Apply (one etcd transaction, `expect_mod_revision` 0 for a create and -1 for
no check, primary hints written as upstream's JSON, read-your-writes), GetHints (primary and
backup hints read from etcd, each validated and naming the shard's recovery log) and Unassign
(FAILED assignments always, the primary too unless `only_failed`, `dry_run`).

Stat needs the running shards, and lives with the consumer runtime. Each function takes a
`ShardState` (what it reads and writes) and raises `ValidationError` for a malformed request,
which the servicer answers INVALID_ARGUMENT.

Stricter than upstream, for every caller: an upserted shard's hints live under the consumer's
hint root (`<etcd prefix>/hints`, filled in when `hint_prefix` is empty), or where the spec it
replaces already kept them; at most MAX_HINT_BACKUPS backups; `primary_hints` only for a shard
with a recovery log, and for that log. For a restricted caller, the shard's recovery log, its
sources and the logs its `primary_hints` name must be journals its claims select, as the
brokers list them to the consumer (an absent one is refused as a hidden one).

A Shard delete leaves the shard's hints in etcd (as upstream: re-applying the deleted shard
recovers its state from them). So a restricted caller may not CREATE a shard while any of its hint
keys (the primary's and MAX_HINT_BACKUPS backups', whatever the new spec's `hint_backups`) exists:
the transaction that creates it compares each key absent, and the create is refused as any
unauthorized change ("not authorized to <id>"). The consequence: a tenant cannot re-create its own
deleted shard over its old hints; an operator (an unrestricted caller, not checked) can, or can
delete the hints first. GetHints names the log of hints for another log only to an unrestricted
caller. A shard without a recovery log keeps no hints: GetHints reads none for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc
from aetcd import transactions

from allocator import keyspace as aks
from broker.client.journals import BrokerUnavailable, JournalsClient
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import (
    ValidationError,
    at_field,
    show,
    validate_label_selector,
    validate_shard_id,
)
from consumer.keyspace import replica_status
from consumer.protocol import (
    MAX_HINT_BACKUPS,
    cpb,
    hint_backup_keys,
    hint_primary_key,
    hint_root,
    recovery_log,
    validate_shard_spec,
)
from consumer.recoverylog.hints import decode_hints, encode_hints, validate_hints
from keyspace import KeySpace, KeyValue
from plumbing import auth
from plumbing import etcd as etcdx
from plumbing.credentials import Credentials

__all__ = [
    "HintsError",
    "JournalLookup",
    "JournalNotAuthorized",
    "JournalsUnavailable",
    "NotAuthorized",
    "ShardState",
    "apply_shards",
    "broker_journals",
    "get_hints",
    "in_route_order",
    "list_shards",
    "unassign_shards",
    "validate_apply_request",
    "validate_unassign_request",
]


class HintsError(Exception):
    """Stored hints that cannot be used (undecodable, invalid, or for another log)."""


class JournalsUnavailable(Exception):
    """The brokers could not say which journals exist: answered UNAVAILABLE (an Apply that
    needs to know is refused, never accepted)."""


# The specs of the named journals that exist, as the brokers list them to this consumer (with
# its own credentials); raises JournalsUnavailable when they cannot be asked.
JournalLookup = Callable[[Sequence[str]], Awaitable[dict[str, pb.JournalSpec]]]

# How long an Apply waits for the brokers to list the journals it names.
LOOKUP_TIMEOUT = 10.0


def broker_journals(address: str, credentials: Credentials | None = None) -> JournalLookup:
    """A JournalLookup through the broker at `address`: a List of each name (the brokers answer
    one name from their index)."""

    async def lookup(names: Sequence[str]) -> dict[str, pb.JournalSpec]:
        found: dict[str, pb.JournalSpec] = {}
        try:
            async with JournalsClient(
                address, timeout=LOOKUP_TIMEOUT, credentials=credentials
            ) as client:
                for name in names:
                    selector = labels.selector(labels.label_set((labels.META_NAME, name)))
                    snapshot = await client.list(selector)
                    found.update((j.spec.name, j.spec) for j in snapshot.journals)
        except (BrokerUnavailable, grpc.aio.AioRpcError, RuntimeError, ValueError) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            first = (detail or type(exc).__name__).splitlines()[0]
            raise JournalsUnavailable(
                f"cannot ask the brokers which journals this shard names ({first}): try again"
            ) from None
        return {name: found[name] for name in names if name in found}

    return lookup


@dataclass(frozen=True)
class ShardState:
    """What the keyspace RPCs use: etcd, the mirror of the consumer's keyspace under `root`,
    this process's id for response headers, and how to look journals up at the brokers
    (needed to apply shards for a restricted caller; without it such an Apply is refused
    UNAVAILABLE)."""

    etcd: aetcd.Client
    ks: KeySpace
    root: str
    process_id: pb.ProcessSpec.ID
    journals: JournalLookup | None = None

    @property
    def hint_root(self) -> str:
        return hint_root(self.root)

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


class JournalNotAuthorized(NotAuthorized):
    """A shard naming a journal its restricted caller's claims do not select, or one that does
    not exist: the same refusal for both, so that it reveals nothing."""

    def __init__(self, shard_id: str, journal: str) -> None:
        Exception.__init__(
            self,
            f"shard {shard_id}: journal {journal} is not one this token may read; create it "
            "first, labelled so the token selects it",
        )


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
    transaction). Ours too: an upsert's `hint_prefix` may be left empty (Apply fills it in),
    it keeps at most MAX_HINT_BACKUPS backups, and its `primary_hints` need a recovery log and
    must be for it (they are written to the shard's hint key, and name the log it plays)."""
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
            spec = change.upsert
            validate_shard_spec(spec, field=at_field(here, "upsert"), hint_prefix_optional=True)
            if spec.hint_backups > MAX_HINT_BACKUPS:
                raise ValidationError(
                    at_field(here, "upsert.hint_backups"),
                    spec.hint_backups,
                    f"{spec.hint_backups} is more than {MAX_HINT_BACKUPS} (a shard keeps at most "
                    f"{MAX_HINT_BACKUPS} backups of its hints)",
                )
            if revision < -1:
                raise ValidationError(
                    at_field(here, "expect_mod_revision"),
                    revision,
                    f"{revision} is invalid (expected >= 0, or -1 for no check)",
                )
            if change.HasField("primary_hints"):
                _validate_primary_hints(change.primary_hints, spec, at_field(here, "primary_hints"))
            shard_id = spec.id
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


def _validate_primary_hints(hints: rpb.FSMHints, spec: cpb.ShardSpec, field: str) -> None:
    log = recovery_log(spec)
    if not log:
        # Without a recovery log a shard has no hint prefix: its hint key would be `/<id>.primary`,
        # wherever in etcd the id spells.
        raise ValidationError(
            field, "", f"shard {spec.id} has no recovery log, so it keeps no hints (leave them out)"
        )
    validate_hints(hints, field=field)
    if hints.log != log:
        raise ValidationError(
            at_field(field, "log"),
            hints.log,
            f"names {hints.log or show(hints.log)}, not the shard's recovery log {log}",
        )


def _with_hint_root(request: cpb.ApplyRequest, root: str) -> cpb.ApplyRequest:
    """`request` with each upsert that has a recovery log and no hint prefix given the hint
    root (a copy: the caller's request is left as it is). Stored specs name it explicitly, so
    that they read the same to upstream's tools."""
    if not any(
        c.HasField("upsert") and c.upsert.recovery_log_prefix and not c.upsert.hint_prefix
        for c in request.changes
    ):
        return request
    out = cpb.ApplyRequest()
    out.CopyFrom(request)
    for change in out.changes:
        spec = change.upsert
        if change.HasField("upsert") and spec.recovery_log_prefix and not spec.hint_prefix:
            spec.hint_prefix = root
    return out


def _named_journals(change: cpb.ApplyRequest.Change) -> list[str]:
    """The journals an upsert makes its shard read or write with the consumer's credentials:
    its recovery log, its sources (without a `;meta` suffix), and the logs its hints name."""
    spec = change.upsert
    names = [source.journal.partition(";")[0] for source in spec.sources]
    if spec.recovery_log_prefix:
        names.append(recovery_log(spec))
    if change.HasField("primary_hints"):
        names.extend(
            segment.log
            for node in change.primary_hints.live_nodes
            for segment in node.segments
            if segment.log
        )
    return list(dict.fromkeys(names))


async def _authorize_journals(
    state: ShardState, request: cpb.ApplyRequest, claims: auth.Claims
) -> None:
    """Every journal the upserts name exists and is selected by the caller's claims, as the
    brokers list it to this consumer. An absent journal is refused as a hidden one."""
    wanted = [
        (change.upsert.id, name)
        for change in request.changes
        if change.HasField("upsert")
        for name in _named_journals(change)
    ]
    if not wanted:
        return
    if state.journals is None:
        raise JournalsUnavailable("this consumer cannot ask the brokers which journals exist")
    found = await state.journals(list(dict.fromkeys(name for _, name in wanted)))
    for shard_id, name in wanted:
        journal = found.get(name)
        if journal is None or not claims.sees_journal(journal):
            raise JournalNotAuthorized(shard_id, name)


def _check_hint_prefixes(
    state: ShardState, request: cpb.ApplyRequest, claims: auth.Claims, expected: list[int]
) -> dict[int, str]:
    """Each upsert keeps its hints under the hint root, or unchanged where the spec it replaces
    kept them (chosen by whoever created it). Returns those kept so, by change index, with
    `expected` pinned to the replaced spec's revision where the request did not name one: the
    transaction then replaces only the spec that was checked."""
    root = state.hint_root
    kept: dict[int, str] = {}
    for index, change in enumerate(request.changes):
        if not change.HasField("upsert"):
            continue
        spec = change.upsert
        stored = state.spec_of(spec.id)
        if stored is not None and not auth.sees_shard(claims, stored[0]):
            # Refused as any unauthorized change, before the hint rule could tell it apart.
            raise NotAuthorized(spec.id)
        if not spec.hint_prefix or spec.hint_prefix == root:
            continue
        revision = change.expect_mod_revision
        if stored is None or stored[0].hint_prefix != spec.hint_prefix or revision == 0:
            raise _not_the_hint_root(index, spec.hint_prefix, root)
        kept[index] = spec.hint_prefix
        if revision == -1:
            # A replacement with no revision check would create the shard anew if it were
            # deleted meanwhile (etcd has no "exists" compare): pinned to the spec checked, it
            # fails as a conflict instead (also when the mirror lags, which is rare).
            expected[index] = stored[1].mod_revision
    return kept


def _not_the_hint_root(index: int, prefix: str, root: str) -> ValidationError:
    return ValidationError(
        f"changes[{index}].upsert.hint_prefix",
        prefix,
        f"{show(prefix)} is not this consumer's hint root: use {root} (or leave it empty); "
        "another prefix is kept only unchanged from the spec it replaces",
    )


async def apply_shards(
    state: ShardState, request: cpb.ApplyRequest, claims: auth.Claims = auth.UNRESTRICTED
) -> cpb.ApplyResponse:
    """All the changes in one etcd transaction, or none (ETCD_TRANSACTION_FAILED). Upserts
    are authorized on the shard's labels and `id`, deletes on its `id`, and both on the labels
    of the spec they replace: one change the caller may not make refuses them all
    (NotAuthorized), whatever its expected revision. Hint prefixes are checked for every
    caller, and the journals the upserts name for a restricted one (see the module's doc)."""
    request = _with_hint_root(request, state.hint_root)
    validate_apply_request(request)
    for change in request.changes:
        if change.HasField("upsert"):
            if not auth.sees_shard(claims, change.upsert):
                raise NotAuthorized(change.upsert.id)
        else:
            _authorize_id(claims, change.delete)
    expected = [change.expect_mod_revision for change in request.changes]
    kept = _check_hint_prefixes(state, request, claims, expected)
    if not claims.unrestricted:
        await _authorize_journals(state, request, claims)
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
        replaced = cpb.ShardSpec.FromString(value)
        # A shard the caller cannot see is neither replaced nor deleted by it, and is refused as
        # any unauthorized change, before a revision check could reveal it.
        if not auth.sees_shard(claims, replaced):
            raise NotAuthorized(ids[index])
        if index in kept and replaced.hint_prefix != kept[index]:
            raise _not_the_hint_root(index, kept[index], state.hint_root)

    check = None if claims.unrestricted and not kept else check_replaced
    await etcdx.wait_until_ready(state.etcd)
    if claims.unrestricted:
        result = await etcdx.txn_guarded(state.etcd, keys, expected, ops, check)
    else:
        creatable = {
            index: hint_keys
            for index, change in enumerate(request.changes)
            if change.HasField("upsert")
            and expected[index] in (0, -1)
            and (hint_keys := _hint_keys(change.upsert)) is not None
        }
        result = await _txn_creating(state, keys, ids, expected, ops, check_replaced, creatable)
    response = cpb.ApplyResponse(status=cpb.OK, header=state.unrouted_header())
    if not result.succeeded:
        response.status = cpb.ETCD_TRANSACTION_FAILED
    elif ops:
        await state.ks.wait_for_revision(result.revision)  # Read-your-writes for List.
    response.header.etcd.revision = result.revision
    return response


@dataclass(frozen=True)
class _HintKeys:
    """The keys any shard of one id and hint prefix may have hints at: its primary's, and its
    backups' (`<prefix>/<id>.backup.N`, N < MAX_HINT_BACKUPS), read and compared as one range
    of every key starting `<prefix>/<id>.backup.`, not one a key (etcd takes 128 operations in
    a transaction)."""

    primary: bytes
    backups: frozenset[bytes]

    @property
    def backup_range(self) -> tuple[bytes, bytes]:
        start = next(iter(self.backups)).rpartition(b".")[0] + b"."
        return start, start[:-1] + b"/"  # '/' follows '.': past every key that starts so.

    def compares(self) -> list[Any]:
        """That none of them exists. The range also holds the keys of an id extending this
        one's with `.backup.` (`ID.backup.x`): where such a shard has hints, the transaction
        fails and is read again (ETCD_TRANSACTION_FAILED in the end), telling no more than a
        revision conflict; the refusal itself is decided on these keys exactly."""
        start, end = self.backup_range
        return [
            transactions.Version(self.primary) == 0,
            transactions.Version(start, range_end=end) == 0,
        ]


def _hint_keys(spec: cpb.ShardSpec) -> _HintKeys | None:
    """The hint keys of `spec`'s id and prefix, whatever its `hint_backups`; None without a
    recovery log (such a shard keeps no hints: its keys would be `/<id>.primary`, anywhere in
    etcd, and checking them would probe those)."""
    if not recovery_log(spec):
        return None
    widest = cpb.ShardSpec()
    widest.CopyFrom(spec)
    widest.hint_backups = MAX_HINT_BACKUPS
    return _HintKeys(
        hint_primary_key(widest).encode(),
        frozenset(key.encode() for key in hint_backup_keys(widest)),
    )


async def _txn_creating(
    state: ShardState,
    keys: Sequence[bytes],
    ids: Sequence[str],
    expected: Sequence[int],
    ops: Sequence[Any],
    check: Callable[[int, bytes], None],
    creatable: dict[int, _HintKeys],
) -> etcdx.TxnResult:
    """`etcdx.txn_guarded` for a restricted caller: also, each change in `creatable` that would
    create its shard (its key absent where read) is refused NotAuthorized if any of its hint
    keys exists, and the transaction compares them absent (so hints written meanwhile, e.g. by a
    stopping primary of a deleted shard, fail it and are read again)."""
    if not creatable:
        return await etcdx.txn_guarded(state.etcd, keys, expected, ops, check)
    order = sorted(creatable)
    primaries = [creatable[index].primary for index in order]
    ranges = [creatable[index].backup_range for index in order]
    result = etcdx.TxnResult(False, 0, 0, 0, 0)
    for _ in range(etcdx.GUARDED_ATTEMPTS):
        read, held, revision = await etcdx.get_current_and_ranges(
            state.etcd, [*keys, *primaries], ranges
        )
        current, primary_now = read[: len(keys)], read[len(keys) :]
        for index, now in enumerate(current):
            if now.value is not None:
                check(index, now.value)
        if any(e not in (-1, now.mod_revision) for e, now in zip(expected, current, strict=True)):
            # A revision conflict first: only a change that would create is checked for hints.
            return etcdx.TxnResult(False, revision, 0, 0, 0)
        compare = [
            transactions.Mod(key) == now.mod_revision
            for key, now in zip(keys, current, strict=True)
        ]
        for at, index in enumerate(order):
            if current[index].value is not None:
                continue  # A replacement keeps the shard's hints (they are its own).
            hint_keys = creatable[index]
            if primary_now[at].value is not None or hint_keys.backups.intersection(held[at]):
                # Refused as any unauthorized change: it tells nothing of whose hints they are.
                raise NotAuthorized(ids[index])
            compare.extend(hint_keys.compares())
        result = await etcdx.txn(state.etcd, compare, ops)
        if result.succeeded:
            return result
    return result


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
    if log:
        values = await etcdx.get_many(state.etcd, [key.encode() for key in keys])  # One revision.
    else:
        # No recovery log, no hints: its keys would be `/<id>.primary`, anywhere in etcd.
        values = [None] * len(keys)
    for index, (key, value) in enumerate(zip(keys, values, strict=True)):
        hints = _checked_hints(key, value, log, claims.unrestricted)
        slot = response.primary_hints if index == 0 else response.backup_hints.add()
        if hints is not None:
            slot.hints.CopyFrom(hints)
    return response


def _checked_hints(key: str, raw: bytes | None, log: str, precise: bool) -> rpb.FSMHints | None:
    """The hints stored at `key`, if any, checked to be for `log`; `precise`: the refusal may
    name the log they are for (an unrestricted caller's; another's may be hidden from it)."""
    if raw is None:
        return None
    try:
        hints = decode_hints(raw)
        validate_hints(hints)
    except (ValueError, ValidationError) as exc:
        raise HintsError(f"hints at {key}: {exc}") from None
    if hints.log != log:
        if not precise:
            raise HintsError(f"hints at {key} are for another log")
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
