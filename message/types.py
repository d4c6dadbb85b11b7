"""Message types: how a message becomes the payload of a frame and back, and where its UUID is.

A `MessageType` turns messages into payloads and back and gets/sets their UUIDs:
`DictMessages` and `DataclassMessages` (JSON), `ProtobufMessages`, `CSVMessages`. A type that
cannot carry a UUID returns None from ``get_uuid`` (and ignores ``set_uuid``); its messages get
at-least-once rather than exactly-once processing. `encode_message` and `decode_message` put a
message into a frame of a `Framing` (`message.framing`) and take it out.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import json
import typing
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from message.framing import Frame, FrameError, Framing
from message.uuid import TextParser, parse, parse_text

__all__ = [
    "CSVMessages",
    "DataclassMessages",
    "DictMessages",
    "MessageType",
    "ProtobufMessages",
    "decode_message",
    "encode_message",
    "uuid_fields_of",
]

M = TypeVar("M")
P = TypeVar("P", bound=ProtoMessage)
D = TypeVar("D")


class MessageType(Protocol[M]):
    """How messages of one type are encoded to frame payloads and carry their UUIDs.

    A type that cannot carry a UUID returns None from `get_uuid` and ignores `set_uuid`: its
    messages are processed at least once rather than exactly once.
    """

    def get_uuid(self, msg: M) -> uuid.UUID | None:
        """The UUID set on `msg`, or None if it has none (or cannot carry one)."""
        ...

    def set_uuid(self, msg: M, u: uuid.UUID) -> None:
        """Set the UUID of `msg` in place."""
        ...

    def new_acknowledgement(self, journal: str) -> M:
        """A new message to carry an ACK_TXN to `journal`."""
        ...

    def encode(self, msg: M) -> bytes:
        """The frame payload of `msg`."""
        ...

    def decode(self, data: bytes) -> M:
        """The message of a frame payload (ValueError if it is not one)."""
        ...


UUIDFields = tuple[bytes, int, int]
"""(producer, clock, flags) of a message UUID."""


def uuid_fields_of(messages: MessageType[M]) -> Callable[[M], UUIDFields | None]:
    """The function a reader uses for a message's UUID fields: the type's own ``uuid_fields``
    if it has one (a faster path, skipping `uuid.UUID`), else `get_uuid` then `parse`.
    Either raises ValueError for a UUID that is not a message UUID."""
    fast = getattr(messages, "uuid_fields", None)
    if fast is not None:
        return typing.cast(Callable[[M], UUIDFields | None], fast)
    get_uuid = messages.get_uuid

    def fields(msg: M) -> UUIDFields | None:
        u = get_uuid(msg)
        if u is None:
            return None
        producer, clock, flags = parse(u)
        return producer, clock, int(flags)

    return fields


def encode_message(framing: Framing, messages: MessageType[M], msg: M, out: bytearray) -> None:
    """Encode `msg` and append it to `out` as one frame."""
    framing.marshal(messages.encode(msg), out)


def decode_message(framing: Framing, messages: MessageType[M], frame: Frame) -> M:
    """The message of a frame; FrameError (with the frame's offset) if it cannot be read."""
    payload = framing.unmarshal(frame)
    try:
        return messages.decode(payload)
    except ValueError as exc:
        raise FrameError(frame.offset, f"cannot decode message: {exc}") from exc


def _parse_uuid_text(text: str, where: str) -> uuid.UUID | None:
    """A UUID in any of the spellings `uuid.UUID` takes (hyphens or none, braces, a urn: prefix),
    its digits hex only: `uuid.UUID` alone, through int(), would also take a 0x, underscores
    and spaces."""
    if not text:
        return None
    digits = text.replace("urn:", "").replace("uuid:", "").strip("{}").replace("-", "")
    try:
        if len(digits) != 32 or digits.strip("0123456789abcdefABCDEF"):
            raise ValueError
        u = uuid.UUID(text)
    except ValueError:
        raise ValueError(f"{where} holds {text[:60]!r}, which is not a UUID") from None
    return None if u.int == 0 else u


def _json_default(obj: object) -> object:
    if isinstance(obj, uuid.UUID):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


# Compact, like Go's encoding/json; one encoder, as json.dumps builds one per call given options.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_json_default)
# msgspec is the fast path both ways (about 3x the json module); what it refuses (integers past 64
# bits, numbers beyond a double) goes through the json module, which also words the errors.
_FAST_ENCODER = msgspec.json.Encoder()
_FAST_ENCODE = _FAST_ENCODER.encode
_FAST_ENCODE_LINES = _FAST_ENCODER.encode_lines
_FAST_DECODE = msgspec.json.Decoder().decode
_FAST_ERRORS = (msgspec.MsgspecError, TypeError, OverflowError)
_MISSING = object()


def _json_dumps(obj: object) -> bytes:
    try:
        return _FAST_ENCODE(obj)
    except _FAST_ERRORS:
        return _JSON_ENCODER.encode(obj).encode()


def _json_loads(data: bytes) -> Any:
    try:
        return _FAST_DECODE(data)
    except _FAST_ERRORS:
        pass
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None


class DictMessages:
    """JSON documents as dicts, the UUID stored as a string at `uuid_path` (default
    ``_meta.uuid``, the convention of Estuary Flow).

    Acknowledgements are ``ack_template`` (deep-copied) if given; otherwise a document holding
    only the parents of `uuid_path`, the innermost with ``"ack": true`` (so by default
    ``{"_meta": {"ack": true, "uuid": ...}}``), or ``{}`` for a top-level path.
    """

    def __init__(
        self,
        uuid_path: Sequence[str] = ("_meta", "uuid"),
        ack_template: dict[str, Any] | None = None,
    ) -> None:
        if not uuid_path:
            raise ValueError("uuid_path must name at least one key")
        self.uuid_path = tuple(uuid_path)
        self._where = ".".join(self.uuid_path)
        self._ack_template = ack_template
        self._parse_text = TextParser().fields  # decode_frame's, with its memo of producers.

    def get_uuid(self, msg: dict[str, Any]) -> uuid.UUID | None:
        node: Any = msg
        for key in self.uuid_path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        if node is None:
            return None
        if isinstance(node, uuid.UUID):
            return node if node.int else None
        if not isinstance(node, str):
            raise ValueError(f"{self._where} holds a {type(node).__name__}, not a UUID string")
        return _parse_uuid_text(node, self._where)

    def decode_frame(self, data: bytes) -> tuple[dict[str, Any], UUIDFields | None]:
        """The document of a JSON-lines frame (its newline is JSON whitespace) and its UUID
        fields: the reader's fused fast path, equal to `decode` then `uuid_fields`."""
        try:
            doc = _FAST_DECODE(data)
        except _FAST_ERRORS:
            doc = self.decode(data)
            return doc, self.uuid_fields(doc)
        if type(doc) is not dict:
            doc = self.decode(data)  # Raises, worded.
        node: Any = doc
        try:
            for key in self.uuid_path:
                node = node[key]
        except (KeyError, TypeError, IndexError):
            return doc, self.uuid_fields(doc)
        if type(node) is str and len(node) == 36:
            try:
                return doc, self._parse_text(node)
            except ValueError:
                pass  # uuid_fields words the error, or takes another spelling.
        return doc, self.uuid_fields(doc)

    def uuid_fields(self, msg: dict[str, Any]) -> UUIDFields | None:
        """(producer, clock, flags) of the message's UUID, or None: the reader's fast path."""
        node: Any = msg
        try:
            for key in self.uuid_path:
                node = node[key]
        except (KeyError, TypeError, IndexError):
            node = None
        if isinstance(node, str) and len(node) == 36:
            try:
                return parse_text(node)
            except ValueError:
                pass
        u = self.get_uuid(msg)  # Other spellings, and the errors worded.
        if u is None:
            return None
        producer, clock, flags = parse(u)
        return producer, clock, int(flags)

    def set_uuid(self, msg: dict[str, Any], u: uuid.UUID) -> None:
        self.set_uuid_text(msg, str(u))

    def set_uuid_text(self, msg: dict[str, Any], text: str) -> None:
        """Set the UUID, given as its canonical text (the publisher's fast path)."""
        node = msg
        for key in self.uuid_path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"cannot set {self._where}: {key!r} holds a {type(child).__name__}, not an object"
                )
            node = child
        node[self.uuid_path[-1]] = text

    def set_uuid_texts(self, msgs: Sequence[dict[str, Any]], texts: Sequence[str]) -> None:
        """`set_uuid_text` of each message and its text, in one call (the publisher's path for
        lists). A message that cannot carry a UUID is left as it is, as the publisher does."""
        set_one = self.set_uuid_text
        skipped = (TypeError, ValueError, AttributeError)
        if len(self.uuid_path) == 2:
            outer, inner = self.uuid_path
            missing = _MISSING
            for msg, text in zip(msgs, texts, strict=True):
                if type(msg) is dict:
                    node = msg.get(outer, missing)
                    if node is missing:
                        msg[outer] = {inner: text}  # What set_uuid_text's setdefault makes.
                        continue
                    if type(node) is dict:
                        node[inner] = text
                        continue
                with contextlib.suppress(*skipped):
                    set_one(msg, text)  # Worded, or skipped as `_stamp` skips it.
            return
        for msg, text in zip(msgs, texts, strict=True):
            with contextlib.suppress(*skipped):
                set_one(msg, text)

    def encode_lines(self, msgs: Sequence[dict[str, Any]]) -> bytes:
        """The messages as JSON lines, each newline-terminated: `JSONLines` framing of each
        `encode`, in one call."""
        try:
            return _FAST_ENCODE_LINES(msgs)
        except _FAST_ERRORS:
            out = bytearray()
            for msg in msgs:
                out += _json_dumps(msg)
                out += b"\n"
            return bytes(out)

    def new_acknowledgement(self, journal: str) -> dict[str, Any]:
        if self._ack_template is not None:
            return copy.deepcopy(self._ack_template)
        doc: dict[str, Any] = {}
        node = doc
        for key in self.uuid_path[:-1]:
            node[key] = {}
            node = node[key]
        if node is not doc:
            node["ack"] = True
        return doc

    def encode(self, msg: dict[str, Any]) -> bytes:
        return _json_dumps(msg)

    def decode(self, data: bytes) -> dict[str, Any]:
        doc = _json_loads(data)
        if not isinstance(doc, dict):
            raise ValueError(f"JSON document is a {type(doc).__name__}, not an object")
        return doc


class DataclassMessages(Generic[D]):
    """Dataclass instances as flat JSON objects (one key per field; nested dataclasses are not
    rebuilt on decode, and unknown keys are ignored as Go's encoding/json does).

    The UUID lives in field `uuid_field`, typed ``str`` or ``uuid.UUID`` (optionally ``| None``);
    ``uuid_field=None`` opts the type out of exactly-once. Acknowledgements are
    ``ack_factory(journal)``, by default ``cls()`` (which needs defaults for every field).
    """

    def __init__(
        self,
        cls: type[D],
        uuid_field: str | None = "uuid",
        ack_factory: Callable[[str], D] | None = None,
    ) -> None:
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{cls.__name__} is not a dataclass")
        self.cls = cls
        self.uuid_field = uuid_field
        self._fields = [f.name for f in dataclasses.fields(cls)]
        self._ack_factory = ack_factory
        self._as_str = False
        if uuid_field is not None:
            if uuid_field not in self._fields:
                raise ValueError(f"{cls.__name__} has no field {uuid_field!r} for the UUID")
            params = getattr(cls, "__dataclass_params__", None)
            if params is not None and params.frozen:
                raise ValueError(
                    f"{cls.__name__} is frozen, so its UUID cannot be set: unfreeze it or pass "
                    "uuid_field=None (at-least-once)"
                )
            self._as_str = _is_str_annotation(cls, uuid_field)

    def get_uuid(self, msg: D) -> uuid.UUID | None:
        if self.uuid_field is None:
            return None
        value = getattr(msg, self.uuid_field)
        if value is None or isinstance(value, uuid.UUID):
            return value if value is None or value.int else None
        if isinstance(value, str):
            return _parse_uuid_text(value, f"{self.cls.__name__}.{self.uuid_field}")
        raise ValueError(
            f"{self.cls.__name__}.{self.uuid_field} holds a {type(value).__name__}, not a UUID"
        )

    def set_uuid(self, msg: D, u: uuid.UUID) -> None:
        if self.uuid_field is not None:
            setattr(msg, self.uuid_field, str(u) if self._as_str else u)

    def new_acknowledgement(self, journal: str) -> D:
        if self._ack_factory is not None:
            return self._ack_factory(journal)
        try:
            return self.cls()
        except TypeError:
            raise ValueError(
                f"{self.cls.__name__}() needs arguments: give every field a default or pass "
                "ack_factory"
            ) from None

    def encode(self, msg: D) -> bytes:
        return _json_dumps({name: getattr(msg, name) for name in self._fields})

    def decode(self, data: bytes) -> D:
        doc = _json_loads(data)
        if not isinstance(doc, dict):
            raise ValueError(f"JSON document is a {type(doc).__name__}, not an object")
        kwargs = {k: v for k, v in doc.items() if k in self._fields}
        if self.uuid_field is not None and not self._as_str:
            text = kwargs.get(self.uuid_field)
            if isinstance(text, str):
                kwargs[self.uuid_field] = _parse_uuid_text(text, self.uuid_field)
        try:
            return self.cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"cannot build {self.cls.__name__}: {exc}") from None


def _is_str_annotation(cls: type, name: str) -> bool:
    try:
        hint = typing.get_type_hints(cls)[name]
    except NameError:  # annotations naming locals that are out of scope: read the text
        text = next(f.type for f in dataclasses.fields(cls) if f.name == name)
        return isinstance(text, str) and text.replace(" ", "") in (
            "str",
            "str|None",
            "None|str",
            "Optional[str]",
        )
    return hint is str or str in typing.get_args(hint)


class ProtobufMessages(Generic[P]):
    """Protobuf messages of class `cls`, the UUID in field `uuid_field`.

    A ``bytes`` field holds the 16 raw UUID bytes (as upstream's example messages do); a
    ``string`` field holds its text form. ``uuid_field=None`` opts out of exactly-once.
    Acknowledgements are empty messages (``cls()``) carrying only their UUID.
    """

    def __init__(self, cls: type[P], uuid_field: str | None = "uuid") -> None:
        self.cls = cls
        self.uuid_field = uuid_field
        self._as_bytes = False
        if uuid_field is not None:
            field = cls.DESCRIPTOR.fields_by_name.get(uuid_field)
            if field is None:
                raise ValueError(f"{cls.DESCRIPTOR.full_name} has no field {uuid_field!r}")
            if field.type == FieldDescriptor.TYPE_BYTES:
                self._as_bytes = True
            elif field.type != FieldDescriptor.TYPE_STRING:
                raise ValueError(
                    f"{cls.DESCRIPTOR.full_name}.{uuid_field} must be a bytes or string field"
                )

    def get_uuid(self, msg: P) -> uuid.UUID | None:
        if self.uuid_field is None:
            return None
        value = getattr(msg, self.uuid_field)
        where = f"{self.cls.DESCRIPTOR.full_name}.{self.uuid_field}"
        if self._as_bytes:
            if not value:
                return None
            if len(value) != 16:
                raise ValueError(f"{where} holds {len(value)} bytes: a UUID is 16")
            u = uuid.UUID(bytes=bytes(value))
            return u if u.int else None
        return _parse_uuid_text(value, where)

    def set_uuid(self, msg: P, u: uuid.UUID) -> None:
        if self.uuid_field is not None:
            setattr(msg, self.uuid_field, u.bytes if self._as_bytes else str(u))

    def new_acknowledgement(self, journal: str) -> P:
        return self.cls()

    def encode(self, msg: P) -> bytes:
        return msg.SerializeToString()

    def decode(self, data: bytes) -> P:
        try:
            return self.cls.FromString(data)
        except DecodeError as exc:
            raise ValueError(f"invalid {self.cls.DESCRIPTOR.full_name}: {exc}") from None


def _go_is_space(c: str) -> bool:
    # Go's unicode.IsSpace: a fixed Latin-1 set, else the Unicode White_Space property.
    return c in "\t\n\v\f\r \x85\xa0" if ord(c) <= 0xFF else c.isspace()


def _csv_field(field: str) -> str:
    # Quote as Go's encoding/csv does, so records match upstream's byte for byte.
    if field == "":
        return field
    if field == "\\." or any(c in field for c in ',"\r\n') or _go_is_space(field[0]):
        return '"' + field.replace('"', '""') + '"'
    return field


class CSVMessages:
    """CSV records as lists of strings, the UUID in column `uuid_column` (default the first).

    Acknowledgements are records of `width` empty fields (enough to hold the UUID if no width is
    given); pass the topic's width when readers expect a fixed number of fields.
    """

    def __init__(self, uuid_column: int | None = 0, width: int | None = None) -> None:
        if uuid_column is not None and uuid_column < 0:
            raise ValueError(f"uuid_column {uuid_column} must be >= 0")
        self.uuid_column = uuid_column
        self.width = width

    def get_uuid(self, msg: list[str]) -> uuid.UUID | None:
        if self.uuid_column is None or self.uuid_column >= len(msg):
            return None
        return _parse_uuid_text(msg[self.uuid_column], f"CSV column {self.uuid_column}")

    def set_uuid(self, msg: list[str], u: uuid.UUID) -> None:
        if self.uuid_column is None:
            return
        if self.uuid_column >= len(msg):
            msg.extend([""] * (self.uuid_column + 1 - len(msg)))
        msg[self.uuid_column] = str(u)

    def new_acknowledgement(self, journal: str) -> list[str]:
        need = 1 if self.uuid_column is None else self.uuid_column + 1
        return [""] * max(self.width or 0, need)

    def encode(self, msg: list[str]) -> bytes:
        if not msg:
            raise ValueError("a CSV record needs at least one field")
        if len(msg) == 1 and msg[0] == "":
            return b'""'  # else it would be a blank line
        return ",".join(_csv_field(f) for f in msg).encode()

    def decode(self, data: bytes) -> list[str]:
        text = data.decode()
        try:
            rows = list(csv.reader(io.StringIO(text, newline="")))
        except csv.Error as exc:
            raise ValueError(f"invalid CSV: {exc}") from None
        if len(rows) != 1 or not rows[0]:
            raise ValueError(f"CSV payload {data[:60]!r} is not exactly one record")
        return rows[0]
