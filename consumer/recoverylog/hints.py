"""FSMHints as upstream stores them in etcd: Go's `encoding/json` of the message (snake_case keys
in field order, int64 and fixed32 as JSON numbers, zero scalars left out, `live_nodes`,
`segments` and `properties` always present and `null` when empty). A stored value that does not
begin with `{` is read as protobuf, as upstream reads it.
"""

from __future__ import annotations

import json
from typing import Any

from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import ValidationError, at_field, quote, validate_journal_name
from consumer.recoverylog.fsm import recorded_path_problem

__all__ = [
    "decode_hints",
    "encode_hints",
    "pick_first_hints",
    "recorded_path_problem",
    "validate_hints",
]

_SEGMENT_FIELDS = (
    "author",
    "first_seq_no",
    "first_offset",
    "first_checksum",
    "last_seq_no",
    "last_offset",
    "log",
)
_UINT32_MAX = (1 << 32) - 1
_INT64 = (-(1 << 63), (1 << 63) - 1)


def encode_hints(hints: rpb.FSMHints) -> bytes:
    """The JSON upstream writes for `hints` (byte for byte: no spaces, Go's field order)."""
    document: dict[str, Any] = {}
    if hints.log:
        document["log"] = hints.log
    document["live_nodes"] = [_fnode_document(n) for n in hints.live_nodes] or None
    document["properties"] = [_property_document(p) for p in hints.properties] or None
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    return text.translate(_GO_ESCAPES).encode()


# Go's json.Marshal escapes these in strings (HTML-safe output, and the JavaScript line
# separators); they occur nowhere else in the document, so translating the whole text is exact.
_GO_ESCAPES = {ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"}


def _fnode_document(node: rpb.FnodeSegments) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if node.fnode:
        out["fnode"] = node.fnode
    out["segments"] = [_segment_document(s) for s in node.segments] or None
    return out


def _segment_document(segment: rpb.Segment) -> dict[str, Any]:
    return {name: getattr(segment, name) for name in _SEGMENT_FIELDS if getattr(segment, name)}


def _property_document(prop: rpb.Property) -> dict[str, Any]:
    return {name: getattr(prop, name) for name in ("path", "content") if getattr(prop, name)}


def decode_hints(raw: bytes) -> rpb.FSMHints:
    """Hints from a stored value: JSON when it begins with `{`, else protobuf. A value that is
    neither raises ValueError naming what is wrong."""
    if not raw.lstrip().startswith(b"{"):
        try:
            return rpb.FSMHints.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError, among others
            raise ValueError(f"hints are neither JSON nor protobuf: {exc}") from None
    try:
        document = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"hints are not valid JSON: {exc}") from None
    out = rpb.FSMHints()
    _expect(document, dict, "hints")
    out.log = _text(document, "log", "hints")
    for i, node in enumerate(_items(document, "live_nodes", "hints")):
        where = f"live_nodes[{i}]"
        _expect(node, dict, where)
        fnode = out.live_nodes.add(fnode=_number(node, "fnode", where, _INT64))
        for j, segment in enumerate(_items(node, "segments", where)):
            here = f"{where}.segments[{j}]"
            _expect(segment, dict, here)
            fnode.segments.add(
                author=_number(segment, "author", here, (0, _UINT32_MAX)),
                first_seq_no=_number(segment, "first_seq_no", here, _INT64),
                first_offset=_number(segment, "first_offset", here, _INT64),
                first_checksum=_number(segment, "first_checksum", here, (0, _UINT32_MAX)),
                last_seq_no=_number(segment, "last_seq_no", here, _INT64),
                last_offset=_number(segment, "last_offset", here, _INT64),
                log=_text(segment, "log", here),
            )
    for i, prop in enumerate(_items(document, "properties", "hints")):
        where = f"properties[{i}]"
        _expect(prop, dict, where)
        out.properties.add(path=_text(prop, "path", where), content=_text(prop, "content", where))
    return out


def _expect(value: object, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise ValueError(f"{where}: expected a JSON {kind.__name__}, got {type(value).__name__}")


def _items(document: dict[str, Any], key: str, where: str) -> list[Any]:
    value = document.get(key)
    if value is None:
        return []
    _expect(value, list, f"{where}.{key}")
    items: list[Any] = value
    return items


def _text(document: dict[str, Any], key: str, where: str) -> str:
    value = document.get(key, "")
    _expect(value, str, f"{where}.{key}")
    text: str = value
    return text


def _number(document: dict[str, Any], key: str, where: str, bounds: tuple[int, int]) -> int:
    value = document.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key}: expected an integer, got {json.dumps(value)}")
    if not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{where}.{key}: {value} is out of range")
    return value


def validate_hints(hints: rpb.FSMHints, *, field: str = "hints") -> None:
    """Upstream's rules: every segment has an author, a positive first sequence number, offsets
    and sequence numbers in order, and a valid log (its own, or else the hints' log, which it
    must not repeat); and, stricter than upstream, every property's path is one a recorder
    writes, rooted at the shard's directory and never leaving it (`recorded_path_problem`)."""
    for i, prop in enumerate(hints.properties):
        problem = recorded_path_problem(prop.path)
        if problem:
            raise ValidationError(
                at_field(field, f"properties[{i}].path"), prop.path, f"{quote(prop.path)} {problem}"
            )
    for i, node in enumerate(hints.live_nodes):
        for j, segment in enumerate(node.segments):
            here = at_field(field, f"live_nodes[{i}].segments[{j}]")
            if segment.log and segment.log == hints.log:
                raise ValidationError(
                    at_field(here, "log"), segment.log, "repeats the hints' own log (leave it out)"
                )
            problem = _segment_problem(segment)
            if problem:
                raise ValidationError(here, "", problem)
            validate_journal_name(segment.log or hints.log, field=at_field(here, "log"))


def _segment_problem(s: rpb.Segment) -> str:
    if s.author == 0:
        return "author is zero"
    if s.first_seq_no <= 0:
        return f"first_seq_no {s.first_seq_no} is not positive"
    if s.first_offset < 0:
        return f"first_offset {s.first_offset} is negative"
    if s.last_seq_no < s.first_seq_no:
        return f"last_seq_no {s.last_seq_no} is below first_seq_no {s.first_seq_no}"
    if s.last_offset != 0 and s.last_offset <= s.first_offset:
        return f"last_offset {s.last_offset} is not past first_offset {s.first_offset}"
    return ""


def pick_first_hints(response: Any, log: str) -> rpb.FSMHints:
    """The hints to recover from, of a GetHintsResponse: the primary's if set, else the first
    backup set, else none (the log is played from its start), as upstream picks them."""
    if response.primary_hints.HasField("hints"):
        hints: rpb.FSMHints = response.primary_hints.hints
        return hints
    for backup in response.backup_hints:
        if backup.HasField("hints"):
            found: rpb.FSMHints = backup.hints
            return found
    return rpb.FSMHints(log=log)
