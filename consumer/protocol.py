"""The consumer protocol: upstream's `consumer` messages (ShardSpec, ConsumerSpec, ReplicaStatus,
Checkpoint, the Shard service), generated from `broker/protocol/consumer.proto`, and the rules
about them that upstream keeps beside its messages: validation, a shard's desired replication, its
recovery log, hint root and hint keys, how replica statuses reduce, and the union, intersection and
subtraction of specs that shardspace YAML hoists and pushes down with.

Validation errors are `broker.protocol.validate.ValidationError`s naming the field's path
(`shards[2].sources[0].journal`), as for journals.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.protocol import consumer_pb2 as cpb
from broker.protocol import labels as broker_labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import (
    ValidationError,
    at_field,
    clean_path,
    duration_ns,
    format_duration,
    show,
    validate_journal_name,
    validate_label_set,
    validate_process_spec,
    validate_shard_id,
    validate_single_value_labels,
)

__all__ = [
    "DEFAULT_MAX_HOT_STANDBYS",
    "ERROR_TEXT_LIMIT",
    "ID_LABEL",
    "MAX_HINT_BACKUPS",
    "cpb",
    "desired_replication",
    "hint_backup_keys",
    "hint_primary_key",
    "hint_root",
    "intersect_shard_specs",
    "recovery_log",
    "reduce_status",
    "subtract_shard_specs",
    "truncate_error",
    "union_shard_specs",
    "validate_consumer_spec",
    "validate_replica_status",
    "validate_shard_spec",
]

# Upstream's --consumer.max-hot-standbys default.
DEFAULT_MAX_HOT_STANDBYS = 3
# A replica's error is cut at this many characters (upstream counts runes), then marked.
ERROR_TEXT_LIMIT = 2048
_TRUNCATED = " ...[truncated]"
# The meta-label every shard carries for selectors (`gazctl shards list -l id=...`), added by
# broker.protocol.labels.shard_meta_labels; a spec may not carry it itself.
ID_LABEL = broker_labels.META_ID

# A shard keeps at most this many backups of its hints: each is an etcd key read at every
# recovery and written at every hand-off, so an unbounded count is work (and keys) on demand.
MAX_HINT_BACKUPS = 16

_CODES = frozenset(cpb.ReplicaStatus.Code.values())


# ---- names derived from a spec -----------------------------------------------------------------


def recovery_log(spec: cpb.ShardSpec) -> str:
    """The journal the shard's recovery log is recorded to, or "" when it has none."""
    if not spec.recovery_log_prefix:
        return ""
    return f"{spec.recovery_log_prefix}/{spec.id}"


def hint_root(consumer_root: str) -> str:
    """The hint prefix of every shard of the consumers under the etcd prefix `consumer_root`:
    the application's own subtree, so that one shard's hint keys are never another's (ids may
    hold '/': prefix /h/a with id b would be prefix /h with id a/b) nor anything else's."""
    return f"{consumer_root}/hints"


def hint_primary_key(spec: cpb.ShardSpec) -> str:
    """The etcd key of the hints its primary records."""
    return f"{spec.hint_prefix}/{spec.id}.primary"


def hint_backup_keys(spec: cpb.ShardSpec) -> list[str]:
    """The etcd keys of its verified hints, kept for disaster recovery (newest first)."""
    return [f"{spec.hint_prefix}/{spec.id}.backup.{i}" for i in range(max(0, spec.hint_backups))]


def desired_replication(spec: cpb.ShardSpec, max_hot_standbys: int) -> int:
    """Replicas the shard wants: none when disabled, else a primary and its hot standbys (at
    most `max_hot_standbys`)."""
    if spec.disable:
        return 0
    return 1 + min(spec.hot_standbys, max(0, max_hot_standbys))


# ---- validation --------------------------------------------------------------------------------


def _is_absolute_clean_path(path: str) -> bool:
    return path.startswith("/") and clean_path(path) == path


def validate_shard_spec(
    spec: cpb.ShardSpec, *, field: str = "", hint_prefix_optional: bool = False
) -> None:
    """Upstream's rules for a ShardSpec, in upstream's order; the first broken one raises.
    `hint_prefix_optional`: a spec to be applied, whose empty hint prefix Apply fills in with
    the consumer's hint root (a stored spec always names its own)."""
    validate_shard_id(spec.id, field=at_field(field, "id"))
    if spec.recovery_log_prefix:
        try:
            validate_journal_name(recovery_log(spec), field=at_field(field, "recovery_log_prefix"))
        except ValidationError as err:
            raise ValidationError(
                err.field, spec.recovery_log_prefix, f"recovery log {err.problem}"
            ) from None
    elif spec.hint_prefix:
        raise ValidationError(
            at_field(field, "hint_prefix"),
            spec.hint_prefix,
            f"{show(spec.hint_prefix)} is set, but recovery_log_prefix is empty "
            "(hints are kept only for shards with a recovery log)",
        )
    filled_in = hint_prefix_optional and not spec.hint_prefix
    if spec.recovery_log_prefix and not filled_in and not _is_absolute_clean_path(spec.hint_prefix):
        raise ValidationError(
            at_field(field, "hint_prefix"),
            spec.hint_prefix,
            f"{show(spec.hint_prefix)} is not an absolute, clean path "
            "(a shard with a recovery log needs one: leave it empty for the consumer's own, "
            "<its etcd prefix>/hints)",
        )
    if spec.hint_backups < 0:
        raise ValidationError(
            at_field(field, "hint_backups"),
            spec.hint_backups,
            f"{spec.hint_backups} is negative (expected >= 0)",
        )
    min_txn = duration_ns(spec.min_txn_duration)
    if min_txn < 0:
        raise ValidationError(
            at_field(field, "min_txn_duration"),
            min_txn,
            f"{format_duration(min_txn)} is negative (expected >= 0)",
        )
    max_txn = duration_ns(spec.max_txn_duration)
    if max_txn <= 0:
        raise ValidationError(
            at_field(field, "max_txn_duration"),
            max_txn,
            f"{format_duration(max_txn)} is not positive (expected > 0, such as 1s)",
        )
    labels_field = at_field(field, "labels")
    validate_label_set(spec.labels, field=labels_field)
    validate_single_value_labels(spec.labels, field=labels_field)
    if any(label.name == ID_LABEL for label in spec.labels.labels):
        raise ValidationError(
            labels_field,
            ID_LABEL,
            f'labels cannot include the label "{ID_LABEL}" (it is the shard\'s own id)',
        )
    previous = ""
    for index, source in enumerate(spec.sources):
        here = at_field(field, f"sources[{index}]")
        validate_journal_name(source.journal, field=at_field(here, "journal"), allow_meta=True)
        if source.min_offset < 0:
            raise ValidationError(
                at_field(here, "min_offset"),
                source.min_offset,
                f"{source.min_offset} is negative (expected >= 0)",
            )
        if index and source.journal <= previous:
            raise ValidationError(
                at_field(here, "journal"),
                source.journal,
                f"sources are not unique and sorted on journal: {show(source.journal)} follows "
                f"{show(previous)}",
            )
        previous = source.journal


def validate_consumer_spec(spec: cpb.ConsumerSpec, *, field: str = "") -> None:
    """A consumer process's spec: a valid process id and endpoint (any shard limit)."""
    validate_process_spec(spec.process_spec, field=at_field(field, "process_spec"))


def validate_replica_status(status: cpb.ReplicaStatus, *, field: str = "") -> None:
    """A known code, and errors exactly when the code is FAILED."""
    if status.code not in _CODES:
        raise ValidationError(
            at_field(field, "code"), status.code, f"{status.code} is not a ReplicaStatus code"
        )
    if status.code == cpb.ReplicaStatus.FAILED and not status.errors:
        raise ValidationError(
            at_field(field, "errors"), "", "a FAILED status must say why (errors is empty)"
        )
    if status.code != cpb.ReplicaStatus.FAILED and status.errors:
        raise ValidationError(
            at_field(field, "code"),
            status.code,
            f"{cpb.ReplicaStatus.Code.Name(status.code)} with errors (expected FAILED)",
        )


# ---- statuses ----------------------------------------------------------------------------------


def truncate_error(text: str) -> str:
    """A replica's error as its status carries it: at most ERROR_TEXT_LIMIT characters."""
    if len(text) <= ERROR_TEXT_LIMIT:
        return text
    return text[:ERROR_TEXT_LIMIT] + _TRUNCATED


def reduce_status(statuses: Iterable[cpb.ReplicaStatus]) -> cpb.ReplicaStatus:
    """A shard's status from its replicas': the largest code, and every error in order."""
    out = cpb.ReplicaStatus()
    for status in statuses:
        out.code = max(out.code, status.code)
        out.errors.extend(status.errors)
    return out


# ---- union, intersection, subtraction (shardspace YAML) --------------------------------------

# Scalar fields compared and combined one by one; `sources` and `labels` are handled apart.
_SCALARS = (
    "recovery_log_prefix",
    "hint_prefix",
    "hint_backups",
    "disable",
    "hot_standbys",
    "disable_wait_for_ack",
    "ring_buffer_size",
    "read_channel_size",
)
_DURATIONS = ("max_txn_duration", "min_txn_duration")


def _sources(spec: cpb.ShardSpec) -> list[tuple[str, int]]:
    return [(s.journal, s.min_offset) for s in spec.sources]


def _copy(spec: cpb.ShardSpec) -> cpb.ShardSpec:
    out = cpb.ShardSpec()
    out.CopyFrom(spec)
    return out


def _set_labels(spec: cpb.ShardSpec, labels: pb.LabelSet) -> None:
    # An empty set is left absent, so that specs compare equal however they were built.
    if labels.labels:
        spec.labels.CopyFrom(labels)
    else:
        spec.ClearField("labels")


def union_shard_specs(a: cpb.ShardSpec, b: cpb.ShardSpec) -> cpb.ShardSpec:
    """`a` with each of its zero-valued fields taken from `b` (labels: the union, `a`'s value
    where both name a single-valued label). The id is `a`'s."""
    out = _copy(a)
    if not out.sources:
        out.sources.extend(b.sources)
    for name in _SCALARS:
        if not getattr(out, name):
            setattr(out, name, getattr(b, name))
    for name in _DURATIONS:
        if duration_ns(getattr(out, name)) == 0 and duration_ns(getattr(b, name)) != 0:
            getattr(out, name).CopyFrom(getattr(b, name))
    _set_labels(out, broker_labels.union(a.labels, b.labels))
    return out


def intersect_shard_specs(a: cpb.ShardSpec, b: cpb.ShardSpec) -> cpb.ShardSpec:
    """A spec holding each field value `a` and `b` share (zero elsewhere); `a`'s id."""
    out = _copy(a)
    if _sources(a) != _sources(b):
        del out.sources[:]
    for name in _SCALARS:
        if getattr(a, name) != getattr(b, name):
            out.ClearField(name)
    for name in _DURATIONS:
        if duration_ns(getattr(a, name)) != duration_ns(getattr(b, name)):
            out.ClearField(name)
    _set_labels(out, broker_labels.intersect(a.labels, b.labels))
    return out


def subtract_shard_specs(a: cpb.ShardSpec, b: cpb.ShardSpec) -> cpb.ShardSpec:
    """`a` with each field that `b` matches zeroed (labels: those `b` holds removed)."""
    out = _copy(a)
    if _sources(a) == _sources(b):
        del out.sources[:]
    for name in _SCALARS:
        if getattr(a, name) == getattr(b, name):
            out.ClearField(name)
    for name in _DURATIONS:
        if duration_ns(getattr(a, name)) == duration_ns(getattr(b, name)):
            out.ClearField(name)
    _set_labels(out, broker_labels.subtract(a.labels, b.labels))
    return out
