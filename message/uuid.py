"""Message UUIDs: RFC 4122 version 1 UUIDs laid out exactly as upstream Gazette lays them out.

A message UUID packs three things (all big-endian, `message/uuid.go` upstream):

- bytes 0-8: a `Clock`, the 60-bit v1 timestamp (100 ns ticks since 1582-10-15) in the usual
  time_low / time_mid / time_hi fields, with the version nibble (1) in the top of byte 6;
- bytes 8-10: the RFC 4122 variant (bits 15-14 = ``10``), then the clock's 4-bit sequence
  counter (bits 13-10), then 10 bits of `Flags` (bits 9-0);
- bytes 10-16: the 6-byte `ProducerID` (the v1 "node"), random per publisher with the
  multicast bit set so it can never be mistaken for a MAC address.

A Clock value is a plain int: ``ticks << 4 | counter``. Clocks of one producer only ever grow,
so a reader de-duplicates by keeping the largest clock seen per producer.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from enum import IntFlag

__all__ = [
    "GREGORIAN_OFFSET",
    "MAX_CLOCK",
    "MAX_FLAGS",
    "PRODUCER_ID_LENGTH",
    "TICK",
    "Clock",
    "Flags",
    "TextFormatter",
    "TextParser",
    "build",
    "clock_of",
    "flags_of",
    "from_time",
    "from_unix_ns",
    "is_message_uuid",
    "new_producer_id",
    "parse",
    "parse_text",
    "producer_of",
    "text_of",
    "to_time",
    "to_unix_ns",
]


class Flags(IntFlag):
    """Transaction semantics carried in the 10 low bits of a message UUID's clock sequence."""

    OUTSIDE_TXN = 0x0
    """Not part of a transaction: process immediately."""
    CONTINUE_TXN = 0x1
    """Begins or continues a transaction: process only once an ACK_TXN with a larger clock is read."""
    ACK_TXN = 0x2
    """Commits this producer's pending CONTINUE_TXN messages having smaller clocks; pending
    messages with larger clocks than the ACK are rolled back."""


MAX_FLAGS = 0x3FF
PRODUCER_ID_LENGTH = 6
MAX_CLOCK = (1 << 64) - 1
"""Clocks are 64-bit: 60 bits of timestamp, 4 bits of sequence counter."""
GREGORIAN_OFFSET = 122_192_928_000_000_000
"""100 ns ticks from 1582-10-15 (the RFC 4122 epoch) to 1970-01-01 (the Unix epoch)."""
TICK = 160
"""What `Clock.tick` adds: one microsecond (10 ticks of 100 ns, shifted past the 4 counter bits).

Upstream ticked by 1 (the sequence counter) until 2025-09-14 (commit 5af7417, "change
Clock.Tick() to increment by 1 microsecond"); we follow current upstream. Either way clocks of a
producer strictly increase, which is all readers rely on."""

_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_VERSION_1 = 0x1000
_VARIANT_RFC4122 = 0x8000
_FLAGS_BY_VALUE = tuple(Flags(i) for i in range(MAX_FLAGS + 1))


def new_producer_id() -> bytes:
    """A random 6-byte ProducerID with the multicast bit (bit 0 of byte 0) set, as upstream."""
    raw = bytearray(os.urandom(PRODUCER_ID_LENGTH))
    raw[0] |= 0x01
    return bytes(raw)


def _trunc_div(n: int, d: int) -> int:
    """Integer division rounding toward zero, as Go's `/` on integers."""
    return n // d if n >= 0 else -(-n // d)


def from_unix_ns(unix_ns: int) -> int:
    """The Clock (counter 0) of a time given as nanoseconds since the Unix epoch."""
    ticks = _trunc_div(unix_ns, 100) + GREGORIAN_OFFSET
    if not 0 <= ticks < 1 << 60:
        raise ValueError(
            f"time {unix_ns} ns since the Unix epoch is outside the UUID clock range "
            "(1582-10-15 to year 5236)"
        )
    return ticks << 4


def _unix_ns(t: datetime | float) -> int:
    if isinstance(t, datetime):
        if t.tzinfo is None:
            raise ValueError(f"datetime {t.isoformat()} is naive: pass a timezone-aware datetime")
        delta = t - _UNIX_EPOCH
        return ((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds) * 1000
    if not math.isfinite(t):
        raise ValueError(f"time {t} is not a finite number of Unix seconds")
    seconds = int(t // 1)
    # The fractional part is exact in floating point; scaling it alone keeps nanosecond detail.
    return seconds * 1_000_000_000 + round((t - seconds) * 1_000_000_000)


def from_time(t: datetime | float) -> int:
    """The Clock (counter 0) of a timezone-aware datetime or of Unix seconds (float)."""
    return from_unix_ns(_unix_ns(t))


def to_unix_ns(clock: int) -> int:
    """Nanoseconds since the Unix epoch of a Clock (exact to its 100 ns resolution)."""
    return ((clock >> 4) - GREGORIAN_OFFSET) * 100


def to_time(clock: int) -> datetime:
    """The UTC datetime of a Clock (datetime resolution: the 100 ns digit is truncated)."""
    return _UNIX_EPOCH + timedelta(microseconds=to_unix_ns(clock) // 1000)


class Clock:
    """A producer's monotonic clock (safe for use from several threads).

    `tick` advances it by `TICK` and returns the new value (one per generated UUID); `update`
    moves it forward to a wall-clock observation and never backward, so when UUIDs are generated
    faster than one per microsecond the clock runs ahead of wall time until time catches up.
    """

    __slots__ = ("_lock", "_value")

    def __init__(self, value: int = 0) -> None:
        _check_clock(value)
        self._value = value
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """The current Clock value."""
        return self._value

    def update(self, t: datetime | float | None = None) -> None:
        """Move forward to time `t` (aware datetime or Unix seconds; default now), never back.

        Moving forward resets the sequence counter to 0.
        """
        self.update_ns(_unix_ns(t) if t is not None else time.time_ns())

    def update_ns(self, unix_ns: int) -> None:
        """As `update`, with nanoseconds since the Unix epoch (full 100 ns precision)."""
        nxt = from_unix_ns(unix_ns)
        with self._lock:
            if nxt > self._value:
                self._value = nxt

    def advance(self) -> int:
        """`update()` to now then `tick()`, under one lock: a publisher's clock per message."""
        now = (time.time_ns() // 100 + GREGORIAN_OFFSET) << 4
        with self._lock:
            value = self._value
            if now > value:
                value = now
            self._value = value = value + TICK
            return value

    def advance_many(self, count: int) -> int:
        """`advance` `count` times under one lock: returns the first of the `count` values,
        which are `TICK` apart (a publisher's clocks for a list of messages)."""
        now = (time.time_ns() // 100 + GREGORIAN_OFFSET) << 4
        with self._lock:
            value = self._value
            if now > value:
                value = now
            self._value = value + count * TICK
            return value + TICK

    def tick(self) -> int:
        """Advance by one microsecond (`TICK`) and return the new value."""
        with self._lock:
            self._value += TICK
            return self._value

    def __repr__(self) -> str:
        return f"Clock({self._value})"


def _check_clock(clock: int) -> None:
    if not 0 <= clock <= MAX_CLOCK:
        raise ValueError(f"clock {clock} is out of range: it must be within [0, 2**64)")


def build(producer: bytes, clock: int, flags: int) -> uuid.UUID:
    """The v1 message UUID of a 6-byte producer, a Clock and Flags (at most 0x3ff)."""
    if not isinstance(producer, bytes | bytearray) or len(producer) != PRODUCER_ID_LENGTH:
        raise ValueError(f"producer {producer!r} must be {PRODUCER_ID_LENGTH} bytes")
    if not 0 <= flags <= MAX_FLAGS:
        raise ValueError(
            f"flags {flags:#x} are out of range: only the 10 low bits (0x3ff) are usable"
        )
    _check_clock(clock)
    value = (
        ((clock >> 4) & 0xFFFF_FFFF) << 96  # time_low
        | ((clock >> 36) & 0xFFFF) << 80  # time_mid
        | (((clock >> 52) & 0x0FFF) | _VERSION_1) << 64  # time_hi and version
        | (((clock << 10) & 0x3C00) | flags | _VARIANT_RFC4122) << 48  # counter, flags, variant
        | int.from_bytes(producer, "big")
    )
    return _uuid_of_int(value)


def text_of(producer_hex: str, clock: int, flags: int) -> str:
    """The canonical text of `build(bytes.fromhex(producer_hex), clock, flags)`, formatted
    directly: the publish path's hot spot. The caller vouches for its arguments (a producer's
    own 12-digit hex ProducerID, a clock within range and flags within 0x3ff)."""
    return "%08x-%04x-%04x-%04x-%s" % (  # noqa: UP031 (%-formatting is the fastest here)
        (clock >> 4) & 0xFFFF_FFFF,
        (clock >> 36) & 0xFFFF,
        ((clock >> 52) & 0x0FFF) | _VERSION_1,
        ((clock << 10) & 0x3C00) | flags | _VARIANT_RFC4122,
        producer_hex,
    )


class TextFormatter:
    """`text_of` for one producer, faster: only the first 8 hex digits (the clock's low 32
    bits of 100 ns ticks) change from one message to the next; the rest is formatted again only
    when the clock's high bits, counter or the flags change (every seven minutes or so)."""

    __slots__ = ("_key", "_producer_hex", "_rest")

    def __init__(self, producer: bytes) -> None:
        if len(producer) != PRODUCER_ID_LENGTH:
            raise ValueError(f"producer {producer!r} must be {PRODUCER_ID_LENGTH} bytes")
        self._producer_hex = producer.hex()
        self._key = -1
        self._rest = ""

    def text(self, clock: int, flags: int) -> str:
        key = (clock >> 36) << 14 | (clock & 0xF) << 10 | flags
        if key != self._key:
            self._rest = text_of(self._producer_hex, clock, flags)[8:]
            self._key = key
        return "%08x" % ((clock >> 4) & 0xFFFF_FFFF) + self._rest

    def texts(self, first: int, count: int, flags: int) -> list[str]:
        """The texts of `count` clocks `TICK` apart from `first` (`advance_many`'s), as `text`
        gives each."""
        out: list[str] = []
        clock = first
        end = first + count * TICK
        step = TICK >> 4  # What the first eight hex digits (the clock's bits 4 to 35) gain a tick.
        while clock < end:
            # The tail changes only where the clock's bits above those digits do: within a run
            # that does not cross such a change, the digits grow by `step`, without wrapping.
            self.text(clock, flags)
            stop = min(end, ((clock >> 36) + 1) << 36)
            n = -(-(stop - clock) // TICK)
            low = (clock >> 4) & 0xFFFF_FFFF
            # One %-format of the whole run, split at its newlines: half the cost of a format
            # and a concatenation per text.
            lines = (("%08x" + self._rest + "\n") * n) % tuple(range(low, low + n * step, step))
            out += lines.split("\n")
            out.pop()  # After the last newline.
            clock += n * TICK
        return out


def _uuid_of_int(value: int) -> uuid.UUID:
    # uuid.UUID(int=...) re-validates what is valid by construction, and costs more than the
    # packing itself on the publish path; set its two slots as its own __init__ does.
    u = _object_new(uuid.UUID)
    _object_setattr(u, "int", value)
    _object_setattr(u, "is_safe", uuid.SafeUUID.unknown)
    return u


_object_new = object.__new__
_object_setattr = object.__setattr__


def is_message_uuid(u: uuid.UUID) -> bool:
    """Whether `u` is a version 1, RFC 4122 variant UUID (so has a producer, clock and flags)."""
    n = u.int
    return (n >> 76) & 0xF == 1 and (n >> 62) & 0x3 == 0b10


def _require(u: uuid.UUID) -> int:
    if not is_message_uuid(u):
        raise ValueError(
            f"UUID {u} is not a message UUID: it must be version 1 with the RFC 4122 variant"
        )
    return u.int


def _clock(n: int) -> int:
    return (
        ((n >> 96) & 0xFFFF_FFFF) << 4
        | ((n >> 80) & 0xFFFF) << 36
        | ((n >> 64) & 0x0FFF) << 52  # the version nibble is not part of the clock
        | (n >> 58) & 0xF
    )


def producer_of(u: uuid.UUID) -> bytes:
    """The 6-byte ProducerID of a message UUID."""
    return (_require(u) & 0xFFFF_FFFF_FFFF).to_bytes(PRODUCER_ID_LENGTH, "big")


def clock_of(u: uuid.UUID) -> int:
    """The Clock (timestamp and sequence counter) of a message UUID."""
    return _clock(_require(u))


def flags_of(u: uuid.UUID) -> Flags:
    """The Flags of a message UUID."""
    return _FLAGS_BY_VALUE[(_require(u) >> 48) & MAX_FLAGS]


def parse(u: uuid.UUID) -> tuple[bytes, int, Flags]:
    """(producer, clock, flags) of a message UUID, checking it once."""
    n = _require(u)
    return (
        (n & 0xFFFF_FFFF_FFFF).to_bytes(PRODUCER_ID_LENGTH, "big"),
        _clock(n),
        _FLAGS_BY_VALUE[(n >> 48) & MAX_FLAGS],
    )


def parse_text(text: str) -> tuple[bytes, int, int]:
    """(producer, clock, flags as an int) of a message UUID in its canonical 36-character
    text form, without building a `uuid.UUID` (the read path's hot spot). Raises ValueError for
    text that is not a message UUID."""
    if len(text) != 36 or not text[8] == text[13] == text[18] == text[23] == "-":
        raise ValueError(f"{text[:60]!r} is not a UUID in its 36-character hyphenated form")
    hexits = text.replace("-", "")
    # int() alone would also take spaces, underscores, signs, a 0x and non-ASCII digits.
    if len(hexits) != 32 or hexits.strip(_HEX_DIGITS):
        raise ValueError(f"{text!r} is not a UUID: it holds non-hex characters")
    try:
        n = int(hexits, 16)
    except ValueError:
        raise ValueError(f"{text!r} is not a UUID: it holds non-hex characters") from None
    if n & _VERSION_VARIANT_MASK != _VERSION_VARIANT:
        raise ValueError(
            f"UUID {text} is not a message UUID: it must be version 1 with the RFC 4122 variant"
        )
    return (
        (n & 0xFFFF_FFFF_FFFF).to_bytes(PRODUCER_ID_LENGTH, "big"),
        ((n >> 96) & 0xFFFF_FFFF) << 4
        | ((n >> 80) & 0xFFFF) << 36
        | ((n >> 64) & 0x0FFF) << 52
        | (n >> 58) & 0xF,
        (n >> 48) & MAX_FLAGS,
    )


class TextParser:
    """`parse_text` for a stream of messages, faster: consecutive messages of a producer differ
    only in the first 8 hex digits of their UUID text (the low 32 bits of 100 ns ticks, about
    7 minutes), so the rest is parsed once per producer and remembered."""

    __slots__ = ("_tails",)

    def __init__(self) -> None:
        self._tails: dict[str, tuple[bytes, int, int]] = {}  # producer, clock rest, flags

    def fields(self, text: str) -> tuple[bytes, int, int]:
        """As `parse_text` (ValueError for what is not a canonical message UUID)."""
        known = self._tails.get(text[8:])
        if known is not None:
            head = text[:8]
            # The tail was checked when remembered; int() alone would take signs, spaces, 0x.
            if len(head) == 8 and not head.strip(_HEX_DIGITS):
                producer, rest, flags = known
                return producer, int(head, 16) << 4 | rest, flags
        producer, clock, flags = parse_text(text)
        if len(self._tails) < _MAX_TAILS:
            self._tails[text[8:]] = (producer, clock & _CLOCK_REST, flags)
        return producer, clock, flags


_MAX_TAILS = 4096
_HEX_DIGITS = "0123456789abcdefABCDEF"
_CLOCK_REST = ~(0xFFFF_FFFF << 4)  # A Clock without its low 32 bits of ticks.
_VERSION_VARIANT_MASK = 0xF << 76 | 0x3 << 62
_VERSION_VARIANT = 0x1 << 76 | 0b10 << 62
