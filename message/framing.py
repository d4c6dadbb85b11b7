"""Framings and message types: how messages become bytes of a journal and back.

A journal's ``content-type`` label names its `Framing` (`framing_for`), which cuts a byte stream
into frames and wraps a message payload into one frame:

- `JSONLines` (``application/x-ndjson``): one JSON document per line;
- `FixedProtobuf` (``application/x-protobuf-fixed``): the magic word ``66 33 93 36``, a 4-byte
  little-endian length, then that many payload bytes (a protobuf message);
- `CSV` (``text/csv``): one RFC 4180 record per line (quoted fields may hold newlines).

A `MessageType` turns messages into payloads and back and gets/sets their UUIDs:
`DictMessages` and `DataclassMessages` (JSON), `ProtobufMessages`, `CSVMessages`. A type that
cannot carry a UUID returns None from ``get_uuid`` (and ignores ``set_uuid``); its messages get
at-least-once rather than exactly-once processing.

Reading: `FrameReader` is fed contiguous ``(offset, content)`` chunks, as a journal read yields
them, and returns whole frames with their exact journal offsets, keeping a partial trailing frame
until more content arrives. The frames it returns tile the stream: bytes that are not a valid frame
come back as *error frames* (``frame.error`` says why, ``frame.data`` holds the skipped bytes),
in stream order, and reading carries on after them. In particular the fixed framing, on a bad
magic word, reports the bytes up to the next magic word as one error frame and resumes framing
there, as upstream does; a frame cut short at the end (`FrameReader.finish`) or by a jump in
offsets is reported the same way. The framing trusts a valid header's length, as upstream does;
if that length is corrupt, the mis-sized frame usually fails to decode and the bytes after it
are reported as a desync. A consumer decides what to do with error frames: the read-uncommitted
reader logs them with their offsets and skips them (`decode_message` raises `FrameError`).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import io
import json
import re
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from broker.protocol.labels import (
    CONTENT_TYPE_CSV,
    CONTENT_TYPE_JSON_LINES,
    CONTENT_TYPE_PROTO_FIXED,
)
from message.uuid import TextParser, parse, parse_text

__all__ = [
    "CSV",
    "FIXED_FRAME_HEADER_LENGTH",
    "FIXED_FRAME_MAGIC",
    "CSVMessages",
    "DataclassMessages",
    "DictMessages",
    "FixedProtobuf",
    "Frame",
    "FrameError",
    "FrameReader",
    "Framing",
    "JSONLines",
    "MessageType",
    "ProtobufMessages",
    "Splitter",
    "decode_message",
    "encode_message",
    "framing_for",
    "known_content_types",
    "register_framing",
]

M = TypeVar("M")
P = TypeVar("P", bound=ProtoMessage)
D = TypeVar("D")

FIXED_FRAME_MAGIC = b"\x66\x33\x93\x36"
FIXED_FRAME_HEADER_LENGTH = 8
_MAX_FIXED_PAYLOAD = 0xFFFF_FFFF
_NEWLINE_BYTE = 0x0A
_DESYNC_REPORT_LIMIT = 1 << 20
"""Undelimited garbage is reported in pieces of about this size rather than buffered whole."""


class FrameError(ValueError):
    """A frame (or run of bytes) at a journal offset that could not be read as a message."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"frame at offset {offset}: {reason}")


class Frame(NamedTuple):
    """Bytes [offset, end) of a journal holding one whole frame, or, if `error` is set, bytes
    that could not be framed (`error` says why)."""

    offset: int
    end: int
    data: bytes
    error: str | None = None

    def check(self) -> None:
        """Raise `FrameError` if this is an error frame."""
        if self.error is not None:
            raise FrameError(self.offset, self.error)


class Splitter(Protocol):
    """Cuts frames from the front of a buffer; one instance per stream (it may keep state)."""

    def scan(self, data: bytes | bytearray, base: int, final: bool) -> tuple[list[Frame], int]:
        """Frames at the front of `data` (which begins on a frame boundary at journal offset
        `base`) and how many bytes they cover. With `final`, no content follows `data`: the
        remainder must be returned too, as error frames."""
        ...


class Framing(Protocol):
    """A way of laying messages out in a journal, chosen by the journal's content type."""

    content_type: str

    def marshal(self, payload: bytes, out: bytearray) -> None:
        """Append one frame holding `payload` to `out` (ValueError if it cannot be framed)."""
        ...

    def unmarshal(self, frame: Frame) -> bytes:
        """The payload of a frame (FrameError for an error frame)."""
        ...

    def splitter(self) -> Splitter:
        """A new splitter for one byte stream."""
        ...

    def frames(self, chunks: Iterable[tuple[int, bytes]]) -> Iterator[Frame]:
        """All frames of contiguous ``(offset, content)`` chunks, error frames included."""
        ...


class FrameReader:
    """Incremental framing of a journal's content, fed chunk by chunk.

    `feed` takes chunks in offset order. A chunk starting past the end of the previous one (the
    journal skipped a range, e.g. deleted fragments) first flushes the pending partial frame as
    an error frame and restarts framing at the new offset.
    """

    __slots__ = ("_buf", "_framing", "_offset", "_splitter")

    def __init__(self, framing: Framing, offset: int | None = None) -> None:
        self._framing = framing
        self._splitter = framing.splitter()
        self._buf = bytearray()
        self._offset = offset

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet returned in a frame."""
        return bytes(self._buf)

    @property
    def offset(self) -> int | None:
        """Journal offset of the first pending byte (None before the first chunk)."""
        return self._offset

    def _continue_at(self, offset: int) -> list[Frame]:
        """Check that a chunk at `offset` continues the content; after a jump forward, the
        pending partial frame as error frames (framing restarts at `offset`)."""
        if self._offset is None:
            self._offset = offset
        expected = self._offset + len(self._buf)
        if offset < expected:
            raise ValueError(
                f"chunk at offset {offset} overlaps content already read through {expected}: "
                "feed contiguous chunks in offset order"
            )
        if offset == expected:
            return []
        errors = [
            f._replace(error=f"{f.error}; content then jumps to offset {offset}") if f.error else f
            for f in self._flush()
        ]
        self._offset = offset
        return errors

    def feed(self, offset: int, content: bytes) -> list[Frame]:
        """Add a chunk starting at `offset`; return the frames it completes."""
        out = self._continue_at(offset)
        if not content:
            return out

        data: bytes | bytearray
        if self._buf:
            self._buf += content
            data = self._buf
        else:
            data = content
        base = self._offset
        assert base is not None  # (set by _continue_at)
        frames, used = self._splitter.scan(data, base, False)
        self._offset = base + used
        if data is self._buf:
            if used:
                del self._buf[:used]
        elif used < len(content):
            self._buf = bytearray(content[used:])
        if out:
            out.extend(frames)
            return out
        return frames

    def feed_lines(self, offset: int, content: bytes) -> tuple[list[Frame], int, list[bytes]]:
        """As `feed`, for newline-delimited framings only (JSON lines), without building a
        Frame per line: the error frames of a jump (as `feed`), the offset of the first line,
        and the complete lines without their newlines, each line's end one byte past it."""
        errors = self._continue_at(offset)
        base = self._offset
        assert base is not None  # (set by _continue_at)
        if self._buf:
            self._buf += content
            data = bytes(self._buf)
        else:
            data = content
        last = data.rfind(b"\n")
        if last < 0:
            if data is content:
                self._buf = bytearray(content)
            return errors, base, []
        lines = data[:last].split(b"\n")
        self._buf = bytearray(data[last + 1 :])
        self._offset = base + last + 1
        self._splitter = self._framing.splitter()  # (feed() may follow: it searches afresh.)
        return errors, base, lines

    def finish(self) -> list[Frame]:
        """No more content follows: return what is pending as error frames and reset.

        A lone trailing newline of a fixed-framed journal is not an error (upstream tolerates it).
        """
        frames = self._flush()
        self._offset = None
        return frames

    def _flush(self) -> list[Frame]:
        frames: list[Frame] = []
        if self._buf and self._offset is not None:
            frames, _ = self._splitter.scan(self._buf, self._offset, True)
            self._offset += len(self._buf)
        self._buf = bytearray()
        self._splitter = self._framing.splitter()
        return frames


def _frames(framing: Framing, chunks: Iterable[tuple[int, bytes]]) -> Iterator[Frame]:
    reader = FrameReader(framing)
    for offset, content in chunks:
        yield from reader.feed(offset, content)
    yield from reader.finish()


# --- JSON lines ---------------------------------------------------------------------------------


class _LineSplitter:
    __slots__ = ("_searched",)

    def __init__(self) -> None:
        self._searched = 0  # bytes at the front already known to hold no newline

    def scan(self, data: bytes | bytearray, base: int, final: bool) -> tuple[list[Frame], int]:
        frames: list[Frame] = []
        append = frames.append
        find = data.find
        start = 0
        nl = find(b"\n", self._searched)
        chunk = bytes(data) if type(data) is not bytes else data  # Slices of bytes are bytes.
        while nl >= 0:
            end = nl + 1
            # The hot loop of every JSON reader: tuple.__new__ skips NamedTuple's Python __new__.
            append(_new_tuple(Frame, (base + start, base + end, chunk[start:end], None)))
            start = end
            nl = find(b"\n", start)
        if final and start < len(data):
            frames.append(
                Frame(
                    base + start,
                    base + len(data),
                    bytes(data[start:]),
                    "truncated frame: content ends without a newline",
                )
            )
            start = len(data)
        self._searched = len(data) - start
        return frames, start


_new_tuple = tuple.__new__


class JSONLines:
    """One JSON document per line (``application/x-ndjson``)."""

    content_type: str = CONTENT_TYPE_JSON_LINES

    def marshal(self, payload: bytes, out: bytearray) -> None:
        if b"\n" in payload:
            raise ValueError("JSON payload contains a raw newline: encode documents on one line")
        out += payload
        out += b"\n"

    def unmarshal(self, frame: Frame) -> bytes:
        frame.check()
        return frame.data[:-1] if frame.data.endswith(b"\n") else frame.data

    def splitter(self) -> Splitter:
        return _LineSplitter()

    def frames(self, chunks: Iterable[tuple[int, bytes]]) -> Iterator[Frame]:
        return _frames(self, chunks)


# --- Fixed protobuf -----------------------------------------------------------------------------


class _FixedSplitter:
    __slots__ = ("_desync", "_max_size", "_search_from")

    def __init__(self, max_size: int) -> None:
        self._max_size = max_size
        self._desync: str | None = None  # why the bytes at the front are not a frame
        self._search_from = 0  # where to look for the next magic word while desynced

    def scan(self, data: bytes | bytearray, base: int, final: bool) -> tuple[list[Frame], int]:
        frames: list[Frame] = []
        n = len(data)
        start = 0
        while True:
            if self._desync is not None:
                found = data.find(FIXED_FRAME_MAGIC, self._search_from)
                if found < 0 and not final and n - start <= _DESYNC_REPORT_LIMIT:
                    # Keep the tail: it may be the start of a magic word split across chunks.
                    self._search_from = max(start + 1, n - len(FIXED_FRAME_MAGIC) + 1)
                    break
                stop = found if found >= 0 else n if final else n - len(FIXED_FRAME_MAGIC) + 1
                if stop > start:
                    frames.append(
                        Frame(base + start, base + stop, bytes(data[start:stop]), self._desync)
                    )
                    start = stop
                if found >= 0 or final:
                    self._desync = None
                else:
                    self._desync = "desynchronized: no magic word found"
                    self._search_from = start
                    break
            avail = n - start
            if avail == 0:
                break
            if avail == 1 and data[start] == _NEWLINE_BYTE:
                # A lone newline at the very end is tolerated, as upstream; wait to know.
                if final:
                    start = n
                break
            magic_len = min(avail, len(FIXED_FRAME_MAGIC))
            if data[start : start + magic_len] != FIXED_FRAME_MAGIC[:magic_len]:
                self._desync = "desynchronized: no magic word (66 33 93 36) where a frame begins"
                self._search_from = start + 1
                continue
            if avail < FIXED_FRAME_HEADER_LENGTH:
                if final:
                    frames.append(
                        Frame(
                            base + start,
                            base + n,
                            bytes(data[start:]),
                            f"truncated frame: {avail} of {FIXED_FRAME_HEADER_LENGTH} header bytes",
                        )
                    )
                    start = n
                break
            size = int.from_bytes(data[start + 4 : start + FIXED_FRAME_HEADER_LENGTH], "little")
            if size > self._max_size:
                self._desync = (
                    f"desynchronized: header declares {size} bytes, more than the "
                    f"{self._max_size} byte limit"
                )
                self._search_from = start + 1
                continue
            end = start + FIXED_FRAME_HEADER_LENGTH + size
            if end > n:
                if final:
                    frames.append(
                        Frame(
                            base + start,
                            base + n,
                            bytes(data[start:]),
                            f"truncated frame: {avail - FIXED_FRAME_HEADER_LENGTH} of {size} "
                            "payload bytes",
                        )
                    )
                    start = n
                break
            frames.append(Frame(base + start, base + end, bytes(data[start:end])))
            start = end
        if self._desync is not None:
            self._search_from -= start
        return frames, start


class FixedProtobuf:
    """Magic word, 4-byte little-endian length, payload (``application/x-protobuf-fixed``).

    `max_size` bounds the payload length a header may declare; a larger one is treated as
    corruption (a desync) rather than waited for.
    """

    content_type: str = CONTENT_TYPE_PROTO_FIXED

    def __init__(self, max_size: int = 1 << 30) -> None:
        if not 0 <= max_size <= _MAX_FIXED_PAYLOAD:
            raise ValueError(f"max_size {max_size} must be within [0, 2**32)")
        self.max_size = max_size

    def marshal(self, payload: bytes, out: bytearray) -> None:
        if len(payload) > self.max_size:
            raise ValueError(
                f"payload of {len(payload)} bytes exceeds the {self.max_size} byte frame limit"
            )
        out += FIXED_FRAME_MAGIC
        out += len(payload).to_bytes(4, "little")
        out += payload

    def unmarshal(self, frame: Frame) -> bytes:
        frame.check()
        return frame.data[FIXED_FRAME_HEADER_LENGTH:]

    def splitter(self) -> Splitter:
        return _FixedSplitter(self.max_size)

    def frames(self, chunks: Iterable[tuple[int, bytes]]) -> Iterator[Frame]:
        return _frames(self, chunks)


# --- CSV ----------------------------------------------------------------------------------------

# Scanner states: at the start of a field, inside an unquoted field, inside a quoted field, and
# just after a quote inside a quoted field (which either closes it or starts an escaped quote).
_FIELD_START, _UNQUOTED, _QUOTED, _QUOTE_SEEN = range(4)
_UNQUOTED_SPECIAL = re.compile(rb"[,\n]")
_COMMA, _NEWLINE, _QUOTE = 0x2C, 0x0A, 0x22


class _CSVSplitter:
    """Finds record ends: newlines outside quoted fields (RFC 4180).

    A quote is special only at the start of a field, as in Python's csv module; a stray quote
    inside an unquoted field is data, so it cannot swallow the lines that follow.
    """

    __slots__ = ("_pos", "_state")

    def __init__(self) -> None:
        self._pos = 0
        self._state = _FIELD_START

    def scan(self, data: bytes | bytearray, base: int, final: bool) -> tuple[list[Frame], int]:
        frames: list[Frame] = []
        n = len(data)
        start, pos, state = 0, self._pos, self._state
        while pos < n:
            if state == _FIELD_START:
                c = data[pos]
                pos += 1
                if c == _QUOTE:
                    state = _QUOTED
                elif c == _NEWLINE:
                    frames.append(Frame(base + start, base + pos, bytes(data[start:pos])))
                    start = pos
                elif c != _COMMA:
                    state = _UNQUOTED
            elif state == _UNQUOTED:
                m = _UNQUOTED_SPECIAL.search(data, pos)
                if m is None:
                    pos = n
                    break
                pos = m.end()
                if data[pos - 1] == _NEWLINE:
                    frames.append(Frame(base + start, base + pos, bytes(data[start:pos])))
                    start = pos
                state = _FIELD_START
            elif state == _QUOTED:
                q = data.find(b'"', pos)
                if q < 0:
                    pos = n
                    break
                pos = q + 1
                state = _QUOTE_SEEN
            else:  # _QUOTE_SEEN
                c = data[pos]
                if c == _QUOTE:
                    pos += 1
                    state = _QUOTED
                else:
                    # A closing quote: what follows is a delimiter or (leniently) more data.
                    state = _UNQUOTED
        if final and start < n:
            frames.append(
                Frame(
                    base + start,
                    base + n,
                    bytes(data[start:]),
                    "truncated frame: content ends inside a quoted field"
                    if state == _QUOTED
                    else "truncated frame: content ends without a newline",
                )
            )
            start, pos, state = n, n, _FIELD_START
        self._pos, self._state = pos - start, state
        return frames, start


class CSV:
    """One RFC 4180 record per line (``text/csv``)."""

    content_type: str = CONTENT_TYPE_CSV

    def marshal(self, payload: bytes, out: bytearray) -> None:
        line = payload + b"\n"
        frames, _ = _CSVSplitter().scan(line, 0, True)
        if len(frames) != 1 or frames[0].error is not None:
            raise ValueError(
                f"CSV payload {payload[:60]!r} is not exactly one record: "
                "quote fields holding commas, quotes or newlines"
            )
        out += line

    def unmarshal(self, frame: Frame) -> bytes:
        frame.check()
        return frame.data[:-1] if frame.data.endswith(b"\n") else frame.data

    def splitter(self) -> Splitter:
        return _CSVSplitter()

    def frames(self, chunks: Iterable[tuple[int, bytes]]) -> Iterator[Frame]:
        return _frames(self, chunks)


# --- Registry -----------------------------------------------------------------------------------

_REGISTRY: dict[str, Framing] = {}


def register_framing(framing: Framing) -> None:
    """Make `framing` the one `framing_for` returns for its content type."""
    _REGISTRY[framing.content_type] = framing


def known_content_types() -> list[str]:
    """Content types with a registered framing, sorted."""
    return sorted(_REGISTRY)


def framing_for(content_type: str) -> Framing:
    """The framing of a journal's ``content-type`` label value."""
    try:
        return _REGISTRY[content_type]
    except KeyError:
        raise ValueError(
            f"unknown content-type {content_type!r}: known framings are "
            + ", ".join(known_content_types())
        ) from None


register_framing(JSONLines())
register_framing(FixedProtobuf())
register_framing(CSV())


# --- Message types ------------------------------------------------------------------------------


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
