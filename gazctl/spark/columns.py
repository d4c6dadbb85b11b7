"""Messages as columns, all at once: their UUIDs decoded from JSON lines and parsed (msgspec,
numpy), formatted back into text, their JSON fields and UUID times as columns of their own (Arrow);
and the framing a journal's content-type names. Shared by the batch and stream sources, and free
of PySpark, so that the stream source's planning runs without it."""

from __future__ import annotations

import functools
import json
from typing import Any

from broker.protocol import protocol_pb2 as pb
from gazctl.spark.journals import JobError
from message.framing import CSV, FixedProtobuf, Framing, JSONLines, framing_for

BATCH_ROWS = 8192


def framing_of_journal(spec: pb.JournalSpec) -> str:
    content_type = next(
        (label.value for label in spec.labels.labels if label.name == "content-type"), ""
    )
    try:
        framing = framing_for(content_type)
    except ValueError:
        raise JobError(
            f"journal {spec.name} has content-type {content_type or '(none)'!r}, which names no "
            "framing: give the framing (lines, csv or fixed) explicitly"
        ) from None
    return {JSONLines: "lines", CSV: "csv", FixedProtobuf: "fixed"}[type(framing)]


JSON_TYPES = {"STRING": "string", "LONG": "int64", "BIGINT": "int64", "INT": "int32",
              "DOUBLE": "float64", "BOOLEAN": "bool"}  # fmt: skip


MESSAGE_NAMES = frozenset(
    ["journal", "offset", "end", "producer", "clock", "flags", "uuid", "content", "timestamp"]
)


def json_fields(ddl: str | None) -> list[tuple[str, str]]:
    """Option json_schema (`user STRING, qty LONG`): top-level fields of JSON messages to
    parse into columns of their own, beside the message's; problems as one JobError line."""
    if not ddl:
        return []
    out: list[tuple[str, str]] = []
    for part in ddl.split(","):
        words = part.split()
        if len(words) != 2 or words[1].upper() not in JSON_TYPES:
            raise JobError(
                f"option json_schema: {part.strip()!r} is not `NAME TYPE` with TYPE one of "
                f"{', '.join(JSON_TYPES)}"
            )
        name, kind = words[0], words[1].upper()
        if name in MESSAGE_NAMES or name in {n for n, _ in out}:
            raise JobError(f"option json_schema: column {name} is already a column of the rows")
        out.append((name, kind))
    return out


def _json_value(value: Any, kind: str) -> Any:
    """A JSON value as a column of `kind`, or None where it is not one."""
    if value is None:
        return None
    if kind == "STRING":
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if kind == "BOOLEAN":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if kind == "DOUBLE":
        return float(value) if isinstance(value, int | float) else None
    return value if isinstance(value, int) and -(1 << 63) <= value < 1 << 63 else None


def with_json_columns(batch: Any, fields: list[tuple[str, str]]) -> Any:
    """A message batch with a column per `json_fields` field, parsed from its content."""
    if not fields:
        return batch
    import msgspec
    import pyarrow as pa

    columns: list[list[Any]] = [[] for _ in fields]
    for content in batch.column("content").to_pylist():
        try:
            doc = msgspec.json.decode(content) if content is not None else None
        except msgspec.DecodeError:
            doc = None
        for values, (name, kind) in zip(columns, fields, strict=True):
            found = doc.get(name) if isinstance(doc, dict) else None
            values.append(_json_value(found, kind))
    arrays = [
        pa.array(values, getattr(pa, JSON_TYPES[kind])())
        for values, (_, kind) in zip(columns, fields, strict=True)
    ]
    return pa.RecordBatch.from_arrays(
        [*batch.columns, *arrays], names=[*batch.schema.names, *(n for n, _ in fields)]
    )


def with_timestamp(batch: Any) -> Any:
    """A message batch with its `timestamp` column: the UUID Clock's time (null without one)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from message.uuid import GREGORIAN_OFFSET

    clocks = batch.column("clock")
    ticks = pc.subtract(pc.shift_right(clocks, 4), GREGORIAN_OFFSET)  # 100 ns since 1970.
    micros = pc.divide(ticks, 10).cast(pa.timestamp("us", tz="UTC"))
    stamps = pc.if_else(pc.equal(clocks, 0), pa.scalar(None, micros.type), micros)
    return pa.RecordBatch.from_arrays(
        [*batch.columns, stamps], names=[*batch.schema.names, "timestamp"]
    )


def uuid_decoder(uuid_path: str) -> Any:
    """A msgspec decoder of one JSON document into a struct holding only the UUID at
    `uuid_path` (every other field skipped, in C): the fast path of JSON lines. The structs
    are not tracked by the garbage collector (they hold no cycles), which halves their cost."""
    import msgspec

    path = uuid_path.split(".")
    inner: Any = msgspec.defstruct(
        "Leaf", [("value", str | None, None)], rename={"value": path[-1]}, gc=False
    )
    for i, key in enumerate(reversed(path[:-1])):
        inner = msgspec.defstruct(
            f"Node{i}", [("child", inner | None, None)], rename={"child": key}, gc=False
        )
    return msgspec.json.Decoder(inner)


def uuid_docs(decoder: Any, lines: list[bytes]) -> list[Any] | None:
    """The UUID documents (`uuid_decoder`) of complete JSON lines, each line decoded on its
    own, in C; None when a line is not exactly one JSON document of UTF-8 text (decoded
    together, a line of two and one over two lines could make up each other's count and shift
    later lines' UUIDs), or nests too deep: the caller then frames them one at a time, which
    says what is wrong."""
    import msgspec

    if not all(map(bytes.isascii, lines)):  # The fields skipped are not checked: check here.
        try:
            for line in lines:
                line.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        return list(map(decoder.decode, lines))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def uuid_texts_of(docs: list[Any], depth: int) -> list[Any]:
    """Each UUID document's text (None where it has none), `depth` structs down."""
    try:
        return list(map(_uuid_getter(depth), docs))
    except AttributeError:  # A struct on the path is missing (None): one at a time.
        return [uuid_text_of(doc, depth) for doc in docs]


@functools.cache
def _uuid_getter(depth: int) -> Any:
    import operator

    return operator.attrgetter(".".join(["child"] * depth + ["value"]))


def uuid_text_of(doc: Any, depth: int) -> Any:
    for _ in range(depth):
        doc = doc.child
        if doc is None:
            return None
    return doc.value


_HEXITS = [i for i in range(36) if i not in (8, 13, 18, 23)]


@functools.cache
def _hex_values() -> Any:
    import numpy as np

    out = np.full(256, 255, np.uint8)  # Each byte's hex digit value, 255 if it is not one.
    for value, char in enumerate("0123456789abcdef"):
        out[ord(char)] = out[ord(char.upper())] = value
    return out


def uuid_columns(texts: list[str]) -> tuple[Any, Any, Any] | None:
    """Each canonical message UUID text's node (the ProducerID, as an integer), Clock and
    flags, as numpy arrays computed all at once: what `parse_text` gives one at a time. None if
    any text is not one (the caller then takes the one-at-a-time path, which says why)."""
    import numpy as np

    n = len(texts)
    if not n:
        return None
    try:
        if (np.fromiter(map(len, texts), np.int64, n) != 36).any():
            return None  # (Joined, they must each be 36 characters, or they would shift.)
        joined = "".join(texts).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return None  # A text missing, or not ASCII (a UUID's text is).
    chars = np.frombuffer(joined, np.uint8).reshape(n, 36)
    digits = _hex_values()[chars[:, _HEXITS]]
    if (digits > 15).any() or (chars[:, [8, 13, 18, 23]] != ord("-")).any():
        return None
    if (digits[:, 12] != 1).any() or ((digits[:, 16] >> 2) != 0b10).any():
        return None  # Not version 1 with the RFC 4122 variant.
    # The UUID's 16 bytes, then its two halves as big-endian integers.
    octets = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])
    high = octets[:, :8].copy().view(">u8").ravel().astype(np.uint64)
    low = octets[:, 8:].copy().view(">u8").ravel().astype(np.uint64)
    u = np.uint64
    time_low, time_mid, time_hi = high >> u(32), (high >> u(16)) & u(0xFFFF), high & u(0x0FFF)
    sequence = low >> u(48)
    clocks = (
        (time_low << u(4))
        | (time_mid << u(36))
        | (time_hi << u(52))
        | ((sequence >> u(10)) & u(0xF))
    )
    flags = (sequence & u(0x3FF)).astype(np.int32)
    return low & u(0xFFFF_FFFF_FFFF), clocks.view(np.int64), flags


def uuid_texts(producers: bytes, clocks: Any, flags: Any) -> tuple[Any, Any]:
    """The canonical UUID texts and 12-digit hex ProducerIDs of messages given as their
    producers' 6-byte ids end to end, their Clocks and flags (numpy arrays), all at once: what
    `text_of` formats one at a time. Both as numpy byte strings (S36, S12)."""
    import numpy as np

    n = len(clocks)
    clock = np.asarray(clocks, dtype=np.int64).view(np.uint64)
    flag = np.asarray(flags, dtype=np.uint64)
    node = np.zeros((n, 8), np.uint8)
    node[:, 2:] = np.frombuffer(producers, np.uint8).reshape(n, 6)
    nodes = node.view(">u8").ravel().astype(np.uint64)
    u = np.uint64
    high = (
        (((clock >> u(4)) & u(0xFFFF_FFFF)) << u(32))
        | (((clock >> u(36)) & u(0xFFFF)) << u(16))
        | ((clock >> u(52)) & u(0x0FFF))
        | u(0x1000)
    )
    sequence = ((clock << u(10)) & u(0x3C00)) | flag | u(0x8000)
    low = (sequence << u(48)) | nodes
    # The UUID's 16 bytes, each as its two hex digits (a table of 256 pairs), dashes between.
    octets = np.stack([high, low], axis=1).astype(">u8").view(np.uint8).reshape(n, 16)
    digits = _hex_pairs()[octets].view(np.uint8).reshape(n, 32)
    text = np.full((n, 36), ord("-"), np.uint8)
    for (a, b), (c, d) in _TEXT_SPANS:
        text[:, a:b] = digits[:, c:d]
    return text.view("S36").ravel(), np.ascontiguousarray(text[:, 24:]).view("S12").ravel()


# Where a UUID's 32 hex digits go in its 36 characters.
_TEXT_SPANS = (((0, 8), (0, 8)), ((9, 13), (8, 12)), ((14, 18), (12, 16)), ((19, 23), (16, 20)),
               ((24, 36), (20, 32)))  # fmt: skip


@functools.cache
def _hex_pairs() -> Any:
    """Each byte's two lowercase hex digits, as the two bytes of a uint16."""
    import numpy as np

    return np.frombuffer(b"".join(b"%02x" % i for i in range(256)), np.uint16)


def hex_ids(nodes: Any) -> Any:
    """ProducerIDs (integers, as `uuid_columns` gives them) as 12-digit hex, an object array."""
    import numpy as np

    unique, index = np.unique(nodes, return_inverse=True)
    return np.array([f"{int(node):012x}" for node in unique], dtype=object)[index]


def framing_of_kind(kind: str) -> Framing:
    framings: dict[str, type[Framing]] = {"lines": JSONLines, "csv": CSV, "fixed": FixedProtobuf}
    return framings[kind]()
