"""Go ``time.Duration`` text (``1m30s``, ``720h0m0s``, ``1.5s``, ``300ms``) for spec YAML.

Parsing follows Go's ``time.ParseDuration`` and formatting reproduces ``Duration.String()`` byte for
byte, so YAML written here reads the same in upstream gazctl and vice versa.
"""

from __future__ import annotations

from google.protobuf import duration_pb2

__all__ = [
    "HOUR",
    "MICROSECOND",
    "MILLISECOND",
    "MINUTE",
    "NANOSECOND",
    "SECOND",
    "DurationError",
    "duration_from_nanos",
    "duration_from_seconds",
    "format_duration",
    "format_go_duration",
    "nanos_from_duration",
    "parse_duration",
    "parse_go_duration",
    "seconds_from_duration",
]

NANOSECOND = 1
MICROSECOND = 1_000 * NANOSECOND
MILLISECOND = 1_000 * MICROSECOND
SECOND = 1_000 * MILLISECOND
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

# Go accepts both the micro sign (U+00B5) and the Greek mu (U+03BC) for microseconds.
_UNITS: dict[str, int] = {
    "ns": NANOSECOND,
    "us": MICROSECOND,
    "\u00b5s": MICROSECOND,
    "\u03bcs": MICROSECOND,
    "ms": MILLISECOND,
    "s": SECOND,
    "m": MINUTE,
    "h": HOUR,
}
_UNIT_NAMES = "ns, us, µs, ms, s, m, h"

# Go accumulates in a uint64 and allows magnitudes up to 1<<63 so that the most negative int64
# parses; anything beyond that range is an overflow.
_MAGNITUDE_LIMIT = 1 << 63
_INT64_MAX = (1 << 63) - 1
_DIGITS = "0123456789"


class DurationError(ValueError):
    """A duration string Go's ``time.ParseDuration`` would also reject."""


def parse_go_duration(text: str) -> int:
    """Parse Go duration text into integer nanoseconds (``"1m30s"`` -> 90_000_000_000)."""
    rest = text
    negative = False
    if rest[:1] in ("-", "+"):
        negative = rest[0] == "-"
        rest = rest[1:]
    # A bare zero is the only unit-less value Go accepts.
    if rest == "0":
        return 0
    if not rest:
        raise DurationError(
            f"invalid duration {_quote(text)}: expected a number and a unit, like 1m30s"
        )

    total = 0
    while rest:
        if rest[0] != "." and rest[0] not in _DIGITS:
            raise DurationError(
                f"invalid duration {_quote(text)}: expected a number at {_quote(rest)}"
            )
        whole_text, rest = _take_digits(rest)
        whole = _whole_number(whole_text, text)
        fraction, scale, fraction_text = 0, 1.0, ""
        if rest.startswith("."):
            fraction_text, rest = _take_digits(rest[1:])
            fraction, scale = _leading_fraction(fraction_text)
        if not whole_text and not fraction_text:
            raise DurationError(f"invalid duration {_quote(text)}: a '.' needs digits beside it")

        unit_end = 0
        while unit_end < len(rest) and rest[unit_end] != "." and rest[unit_end] not in _DIGITS:
            unit_end += 1
        unit_text, rest = rest[:unit_end], rest[unit_end:]
        if not unit_text:
            raise DurationError(
                f"invalid duration {_quote(text)}: missing unit (one of {_UNIT_NAMES}), like 1m30s"
            )
        unit = _UNITS.get(unit_text)
        if unit is None:
            raise DurationError(
                f"invalid duration {_quote(text)}: unknown unit {_quote(unit_text)} (use one of {_UNIT_NAMES})"
            )

        if whole > _MAGNITUDE_LIMIT // unit:
            raise _overflow(text)
        value = whole * unit
        if fraction:
            # Go scales the fraction in float64 and truncates; doing the same keeps sub-nanosecond
            # rounding identical to upstream for inputs like "1.0000000001s".
            value += int(float(fraction) * (float(unit) / scale))
            if value > _MAGNITUDE_LIMIT:
                raise _overflow(text)
        total += value
        if total > _MAGNITUDE_LIMIT:
            raise _overflow(text)

    if negative:
        return -total
    if total > _INT64_MAX:
        raise _overflow(text)
    return total


def format_go_duration(nanos: int) -> str:
    """Format integer nanoseconds exactly as Go's ``time.Duration.String()`` does."""
    if nanos == 0:
        return "0s"
    sign = "-" if nanos < 0 else ""
    magnitude = abs(nanos)
    if magnitude < MICROSECOND:
        return f"{sign}{magnitude}ns"
    if magnitude < MILLISECOND:
        return f"{sign}{_with_fraction(magnitude, MICROSECOND, 3)}\u00b5s"
    if magnitude < SECOND:
        return f"{sign}{_with_fraction(magnitude, MILLISECOND, 6)}ms"

    hours, remainder = divmod(magnitude, HOUR)
    minutes, remainder = divmod(remainder, MINUTE)
    seconds = _with_fraction(remainder, SECOND, 9)
    # Go never rolls hours into days, and once a larger unit appears every smaller one is written.
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{sign}{minutes}m{seconds}s"
    return f"{sign}{seconds}s"


def nanos_from_duration(duration: duration_pb2.Duration) -> int:
    """Total nanoseconds of a ``google.protobuf.Duration``."""
    return duration.seconds * SECOND + duration.nanos


def duration_from_nanos(nanos: int) -> duration_pb2.Duration:
    """A normalized ``google.protobuf.Duration`` (seconds and nanos share a sign)."""
    seconds, remainder = divmod(abs(nanos), SECOND)
    if nanos < 0:
        return duration_pb2.Duration(seconds=-seconds, nanos=-remainder)
    return duration_pb2.Duration(seconds=seconds, nanos=remainder)


def seconds_from_duration(duration: duration_pb2.Duration) -> float:
    """A ``google.protobuf.Duration`` as float seconds."""
    return duration.seconds + duration.nanos / SECOND


def duration_from_seconds(seconds: float) -> duration_pb2.Duration:
    """Float seconds as a ``google.protobuf.Duration``, rounded to the nearest nanosecond."""
    return duration_from_nanos(round(seconds * SECOND))


def parse_duration(text: str) -> duration_pb2.Duration:
    """Parse Go duration text into a ``google.protobuf.Duration``."""
    return duration_from_nanos(parse_go_duration(text))


def format_duration(duration: duration_pb2.Duration) -> str:
    """Format a ``google.protobuf.Duration`` as Go duration text."""
    return format_go_duration(nanos_from_duration(duration))


def _take_digits(text: str) -> tuple[str, str]:
    end = 0
    while end < len(text) and text[end] in _DIGITS:
        end += 1
    return text[:end], text[end:]


def _whole_number(digits: str, text: str) -> int:
    value = int(digits) if digits else 0
    if value > _MAGNITUDE_LIMIT:
        raise _overflow(text)
    return value


def _leading_fraction(digits: str) -> tuple[int, float]:
    # Go stops accumulating fraction digits once another would overflow an int64, silently
    # dropping the rest; the float scale grows only with digits actually kept.
    value, scale = 0, 1.0
    for digit in digits:
        if value > _INT64_MAX // 10:
            break
        candidate = value * 10 + int(digit)
        if candidate > _MAGNITUDE_LIMIT:
            break
        value = candidate
        scale *= 10
    return value, scale


def _with_fraction(value: int, unit: int, width: int) -> str:
    whole, fraction = divmod(value, unit)
    if not fraction:
        return str(whole)
    return f"{whole}.{fraction:0{width}d}".rstrip("0")


def _quote(text: str) -> str:
    from broker.protocol.validate import quote  # Deferred: spec's lowest module stays light.

    return quote(text)


def _overflow(text: str) -> DurationError:
    return DurationError(
        f"invalid duration {_quote(text)}: out of range (Go durations stop at ~292 years)"
    )
