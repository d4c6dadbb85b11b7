"""Framings: how frames become bytes of a journal and back.

A journal's ``content-type`` label names its `Framing` (`framing_for`), which cuts a byte stream
into frames and wraps a message payload into one frame:

- `JSONLines` (``application/x-ndjson``): one JSON document per line;
- `FixedProtobuf` (``application/x-protobuf-fixed``): the magic word ``66 33 93 36``, a 4-byte
  little-endian length, then that many payload bytes (a protobuf message);
- `CSV` (``text/csv``): one RFC 4180 record per line (quoted fields may hold newlines).

What a frame's payload means is its message type's (`message.types`).

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

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol, TypeVar

from google.protobuf.message import Message as ProtoMessage

from broker.protocol.labels import (
    CONTENT_TYPE_CSV,
    CONTENT_TYPE_JSON_LINES,
    CONTENT_TYPE_PROTO_FIXED,
)

__all__ = [
    "CSV",
    "FIXED_FRAME_HEADER_LENGTH",
    "FIXED_FRAME_MAGIC",
    "FixedProtobuf",
    "Frame",
    "FrameError",
    "FrameReader",
    "Framing",
    "JSONLines",
    "Splitter",
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
