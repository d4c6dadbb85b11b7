"""The shardspace YAML of ``gazctl shards apply/list/edit`` (upstream ``shardspace``).

A document has ``common:``, a partial ShardSpec every shard inherits where its own field is
zero (pushed down), and ``shards:``, each a partial spec with an optional ``comment``,
``delete`` and ``revision``. ``hoist`` does the reverse for ``shards list -o yaml``: what every
shard shares goes to ``common`` and is removed from each. Reading is strict (unknown keys, wrong
types, a shard without an id or listed twice are errors naming their line); writing follows
upstream's key order and value formats (durations as Go text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import yaml

from consumer.protocol import (
    cpb,
    intersect_shard_specs,
    subtract_shard_specs,
    union_shard_specs,
)
from spec import _yaml
from spec._yaml import SpecError
from spec.durations import duration_from_nanos, format_go_duration, nanos_from_duration

__all__ = [
    "ShardEntry",
    "ShardSpace",
    "decode_shards",
    "decode_shardspace",
    "encode_shards",
    "encode_shardspace",
    "hoist_shards",
    "push_down",
]


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a shardspace: its (partial, or once pushed down, whole) spec, the etcd
    revision it was read at (0: create; -1: whatever is there), whether to delete it, a comment,
    and the line it began on (0 when not read from YAML)."""

    spec: cpb.ShardSpec
    revision: int = 0
    delete: bool | None = None
    comment: str = ""
    line: int = 0


@dataclass(frozen=True)
class ShardSpace:
    common: cpb.ShardSpec
    shards: tuple[ShardEntry, ...]


# Upstream's field order for a ShardSpec in YAML; a shard entry adds comment and delete before,
# revision after.
_SPEC_KEYS: Final = (
    "id",
    "sources",
    "recovery_log_prefix",
    "hint_prefix",
    "hint_backups",
    "max_txn_duration",
    "min_txn_duration",
    "disable",
    "hot_standbys",
    "labels",
    "disable_wait_for_ack",
    "ring_buffer_size",
    "read_channel_size",
)
_SHARD_KEYS: Final = ("comment", "delete", *_SPEC_KEYS, "revision")
_TOP_KEYS: Final = ("common", "shards")
_SOURCE_KEYS: Final = ("journal", "min_offset")
_LABEL_KEYS: Final = ("name", "value")
_STRINGS: Final = ("recovery_log_prefix", "hint_prefix")
_BOOLS: Final = ("disable", "disable_wait_for_ack")
_UINT32S: Final = ("hot_standbys", "ring_buffer_size", "read_channel_size")
_DURATIONS: Final = ("max_txn_duration", "min_txn_duration")


# ---- decoding ------------------------------------------------------------------------------


def decode_shardspace(text: str) -> ShardSpace:
    """The document as written: ``common`` and each shard's partial spec, not yet pushed down."""
    root = _yaml.compose(text)
    where = "the shardspace"
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(
            _yaml.line_of(root),
            f"expected a mapping with common: and shards: (got {_yaml.show(root)}) in {where}",
        )
    entries = _yaml.mapping_entries(root, where)
    _yaml.reject_unknown(entries, _TOP_KEYS, "", where)
    common = cpb.ShardSpec()
    if "common" in entries:
        fields = _yaml.mapping(entries["common"][1], "common", where)
        _yaml.reject_unknown(fields, _SPEC_KEYS, '"common"', where)
        if "id" in fields:
            raise SpecError(
                _yaml.line_of(fields["id"][0]),
                'common: may not have an "id" (each shard names its own)',
            )
        _decode_spec(fields, common, '"common"')
    shards: list[ShardEntry] = []
    first_line: dict[str, int] = {}
    items = _yaml.sequence(entries["shards"][1], "shards", where) if "shards" in entries else []
    for index, item in enumerate(items):
        entry = _decode_shard(item, index)
        previous = first_line.get(entry.spec.id)
        if previous is not None:
            raise SpecError(
                entry.line,
                f"shard {_yaml.quote(entry.spec.id)} is listed twice (first on line {previous})",
            )
        first_line[entry.spec.id] = entry.line
        shards.append(entry)
    return ShardSpace(common, tuple(_sorted(shards)))


def _sorted(shards: Iterable[ShardEntry]) -> list[ShardEntry]:
    return sorted(shards, key=lambda e: e.spec.id)


def _decode_shard(node: yaml.Node, index: int) -> ShardEntry:
    context = f"shards[{index}]"
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(
            _yaml.line_of(node), f"expected a shard mapping (got {_yaml.show(node)}) in {context}"
        )
    entries = _yaml.mapping_entries(node, context)
    if "id" not in entries:
        raise SpecError(_yaml.line_of(node), f'{context} has no "id"')
    shard_id = _yaml.string(entries["id"][1], "id", context, allow_null=False)
    where = f"shard {_yaml.quote(shard_id)}"
    _yaml.reject_unknown(entries, _SHARD_KEYS, "", where)
    spec = cpb.ShardSpec(id=shard_id)
    _decode_spec(entries, spec, where)
    revision = 0
    if "revision" in entries:
        revision = _yaml.integer(entries["revision"][1], "revision", _yaml.INT64, where)
    delete: bool | None = None
    if "delete" in entries and not _yaml.is_null(entries["delete"][1]):
        delete = _yaml.boolean(entries["delete"][1], "delete", where)
    comment = _yaml.string(entries["comment"][1], "comment", where) if "comment" in entries else ""
    return ShardEntry(spec, revision, delete, comment, _yaml.line_of(node))


def _decode_spec(entries: _yaml.Entries, spec: cpb.ShardSpec, where: str) -> None:
    if "sources" in entries:
        for item in _yaml.sequence(entries["sources"][1], "sources", where):
            if not isinstance(item, yaml.MappingNode):
                raise SpecError(
                    _yaml.line_of(item),
                    f'each of "sources" must be a mapping with a journal (got '
                    f"{_yaml.show(item)}) in {where}",
                )
            fields = _yaml.mapping_entries(item, where)
            _yaml.reject_unknown(fields, _SOURCE_KEYS, "a source", where)
            source = spec.sources.add()
            if "journal" in fields:
                source.journal = _yaml.string(fields["journal"][1], "journal", where)
            if "min_offset" in fields:
                source.min_offset = _yaml.integer(
                    fields["min_offset"][1], "min_offset", _yaml.INT64, where
                )
    for key in _STRINGS:
        if key in entries:
            setattr(spec, key, _yaml.string(entries[key][1], key, where))
    if "hint_backups" in entries:
        spec.hint_backups = _yaml.integer(
            entries["hint_backups"][1], "hint_backups", _yaml.INT32, where
        )
    for key in _DURATIONS:
        if key in entries:
            nanos = _yaml.duration(entries[key][1], key, where)
            if nanos:
                getattr(spec, key).CopyFrom(duration_from_nanos(nanos))
    for key in _BOOLS:
        if key in entries and not _yaml.is_null(entries[key][1]):
            setattr(spec, key, _yaml.boolean(entries[key][1], key, where))
    for key in _UINT32S:
        if key in entries:
            setattr(spec, key, _yaml.integer(entries[key][1], key, _yaml.UINT32, where))
    if "labels" in entries:
        for item in _yaml.sequence(entries["labels"][1], "labels", where):
            if not isinstance(item, yaml.MappingNode):
                raise SpecError(
                    _yaml.line_of(item),
                    f'each of "labels" must be a mapping with name and value (got '
                    f"{_yaml.show(item)}) in {where}",
                )
            fields = _yaml.mapping_entries(item, where)
            _yaml.reject_unknown(fields, _LABEL_KEYS, "a label", where)
            label = spec.labels.labels.add()
            if "name" in fields:
                label.name = _yaml.string(fields["name"][1], "name", where)
            if "value" in fields:
                label.value = _yaml.string(fields["value"][1], "value", where)


# ---- hoisting and pushing down ---------------------------------------------------------------


def push_down(space: ShardSpace) -> list[ShardEntry]:
    """Each shard's whole spec: its own fields, and ``common``'s where its own are zero."""
    return [
        ShardEntry(union_shard_specs(e.spec, space.common), e.revision, e.delete, e.comment, e.line)
        for e in space.shards
    ]


def hoist_shards(entries: Iterable[ShardEntry]) -> ShardSpace:
    """``common`` as what every shard shares, removed from each (upstream's Set.Hoist)."""
    shards = _sorted(entries)
    common = cpb.ShardSpec()
    for index, entry in enumerate(shards):
        if index == 0:
            common.CopyFrom(entry.spec)
            common.id = ""
        else:
            common = intersect_shard_specs(common, entry.spec)
    hoisted = tuple(
        ShardEntry(subtract_shard_specs(e.spec, common), e.revision, e.delete, e.comment, e.line)
        for e in shards
    )
    return ShardSpace(common, hoisted)


def decode_shards(text: str) -> list[ShardEntry]:
    """``push_down(decode_shardspace(text))``: the shard changes a YAML document describes."""
    return push_down(decode_shardspace(text))


# ---- encoding ----------------------------------------------------------------------------------


def encode_shardspace(space: ShardSpace) -> str:
    """The document in upstream's layout: ``common:`` (``{}`` when empty), then ``shards:``."""
    document: dict[str, object] = {
        "common": _spec_document(space.common),
        "shards": [_shard_document(e) for e in space.shards],
    }
    return _yaml.dump(document)


def encode_shards(entries: Iterable[ShardEntry]) -> str:
    """``encode_shardspace(hoist_shards(entries))``: what ``shards list -o yaml`` prints."""
    return encode_shardspace(hoist_shards(entries))


def _shard_document(entry: ShardEntry) -> dict[str, object]:
    out: dict[str, object] = {}
    if entry.comment:
        out["comment"] = entry.comment
    if entry.delete is not None:
        out["delete"] = entry.delete
    out.update(_spec_document(entry.spec))
    if entry.revision:
        out["revision"] = entry.revision
    return out


def _spec_document(spec: cpb.ShardSpec) -> dict[str, object]:
    out: dict[str, object] = {}
    values: Mapping[str, object] = {
        "id": spec.id,
        "sources": [_source_document(s) for s in spec.sources],
        "recovery_log_prefix": spec.recovery_log_prefix,
        "hint_prefix": spec.hint_prefix,
        "hint_backups": spec.hint_backups,
        "max_txn_duration": _duration_text(spec, "max_txn_duration"),
        "min_txn_duration": _duration_text(spec, "min_txn_duration"),
        "disable": spec.disable,
        "hot_standbys": spec.hot_standbys,
        "labels": [{"name": lb.name, "value": lb.value} for lb in spec.labels.labels],
        "disable_wait_for_ack": spec.disable_wait_for_ack,
        "ring_buffer_size": spec.ring_buffer_size,
        "read_channel_size": spec.read_channel_size,
    }
    for key in _SPEC_KEYS:
        value = values[key]
        if value:  # Upstream omits zero values.
            out[key] = value
    return out


def _source_document(source: cpb.ShardSpec.Source) -> dict[str, object]:
    out: dict[str, object] = {"journal": source.journal}
    if source.min_offset:
        out["min_offset"] = source.min_offset
    return out


def _duration_text(spec: cpb.ShardSpec, key: str) -> str:
    nanos = nanos_from_duration(getattr(spec, key))
    return format_go_duration(nanos) if nanos else ""
