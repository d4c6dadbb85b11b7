"""Path postfix templates: where under a journal's directory a fragment is persisted.

A JournalSpec's `fragment.path_postfix_template` is a Go text/template, which upstream evaluates
with `.Spool` (the fragment, `.Spool.FirstAppendTime`, `.Spool.Registers`) and `.JournalSpec`, most
often to partition fragments Hive-style by creation time:

    date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}/hour={{ .Spool.FirstAppendTime.Format "15" }}

This module implements the part of that language such templates use: literal text, field
references of the spool and spec, the time's Format (Go reference-time layouts) and simple
accessors, `{{- -}}` whitespace trimming and `{{/* comments */}}`. Anything else is refused when
the template is compiled (as a spec is applied), not when a fragment is persisted.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import (
    MAX_JOURNAL_NAME_LEN,
    PATH_SYMBOLS,
    ValidationError,
    validate_path_component,
)

__all__ = [
    "GO_ZERO_TIME",
    "PostfixTemplate",
    "TemplateError",
    "compile_template",
    "format_go_time",
    "validate_template",
]


class TemplateError(ValueError):
    """A path postfix template is not supported, or rendered something that is not a path."""


# Go's zero time.Time, which upstream's spool holds before its first append.
GO_ZERO_TIME = datetime(1, 1, 1, tzinfo=UTC)
_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class _Scope:
    spec: pb.JournalSpec
    fragment: pb.Fragment
    time: datetime  # In UTC.


_Render = Callable[[_Scope], str]


@dataclass(frozen=True, slots=True)
class PostfixTemplate:
    """A compiled path postfix template."""

    source: str
    _parts: tuple[str | _Render, ...]

    def render(
        self,
        *,
        spec: pb.JournalSpec,
        fragment: pb.Fragment,
        first_append_time: datetime | None,
        registers: pb.LabelSet | None = None,
    ) -> str:
        """The postfix for `fragment` of the journal of `spec`: a clean relative path, or "".

        `first_append_time` is the spool's first append (timezone-aware; rendered in UTC), or
        None for Go's zero time. `registers` are accepted as upstream's spool carries them, but
        no supported form reads them. Raises TemplateError if the result is not a valid postfix.
        """
        del registers
        if first_append_time is None:
            when = GO_ZERO_TIME
        elif first_append_time.tzinfo is None:
            raise ValueError(
                f"first_append_time {first_append_time.isoformat()} has no timezone; "
                "pass an aware datetime (the spool's are UTC)"
            )
        else:
            when = first_append_time.astimezone(UTC)

        scope = _Scope(spec, fragment, when)
        postfix = "".join(part if isinstance(part, str) else part(scope) for part in self._parts)
        _check_postfix(self.source, postfix)
        return postfix


def compile_template(template: str) -> PostfixTemplate:
    """Compile `template`, raising TemplateError naming the first unsupported part.

    Also refused: text or layouts which always put a character into the path that a fragment
    path cannot hold (such as a space or ':'), as fragments persisted there could not be listed,
    and text which makes every postfix an unclean path (a leading or trailing '/', '//', a '.'
    or '..' segment), under which no fragment could be persisted at all.
    """
    parts = tuple(_Parser(template).parse())
    # Each action renders something (fields and times are never empty): 'x' stands for it.
    skeleton = "".join(part if isinstance(part, str) else "x" for part in parts)
    problem = _postfix_problem(skeleton)
    if problem is not None:
        raise TemplateError(
            f"path postfix template {_show(template)}: every postfix it renders is like "
            f"{skeleton!r} ('x' for each action), which {problem}"
        )
    return PostfixTemplate(template, parts)


def validate_template(template: str) -> None:
    """Raise TemplateError if `template` is not a template that compile_template accepts."""
    compile_template(template)


# --- Parsing ---------------------------------------------------------------------------------------

# Go's text/template treats exactly these as spaces around trim markers and between tokens.
_SPACES = " \t\r\n"
_FIELD_CHAIN = re.compile(r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_KEYWORDS = frozenset(
    [
        "if",
        "else",
        "end",
        "range",
        "with",
        "define",
        "template",
        "block",
        "break",
        "continue",
        "nil",
        "true",
        "false",
    ]
)


def _show(template: str) -> str:
    # One line, however long or multi-line the template.
    text = repr(template)
    return text if len(text) <= 100 else text[:80] + f"...' ({len(template)} characters)"


class _Parser:
    def __init__(self, template: str) -> None:
        self.template = template
        self.pos = 0
        self.parts: list[str | _Render] = []
        self.trim_next_text = False

    def fail(self, problem: str) -> TemplateError:
        return TemplateError(f"path postfix template {_show(self.template)}: {problem}")

    def parse(self) -> list[str | _Render]:
        src = self.template
        while self.pos < len(src):
            opened = src.find("{{", self.pos)
            text = src[self.pos : len(src) if opened == -1 else opened]
            if self.trim_next_text:
                text = text.lstrip(_SPACES)
                self.trim_next_text = False
            self.pos = len(src) if opened == -1 else opened + 2
            if opened != -1 and _has_left_trim(src, self.pos):
                text = text.rstrip(_SPACES)
                self.pos += 2
            self.add_text(text)
            if opened != -1:
                self.action(opened)
        return self.parts

    def add_text(self, text: str) -> None:
        if not text:
            return
        bad = _first_non_path_char(text)
        if bad is not None:
            raise self.fail(
                f"the text {text!r} holds {bad!r}, which a fragment path cannot hold "
                f"(allowed: letters, digits and {PATH_SYMBOLS})"
            )
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += text
        else:
            self.parts.append(text)

    def action(self, opened: int) -> None:
        """Parse one action, from just past its "{{" (and left trim marker)."""
        src = self.template
        if src.startswith("/*", self.pos):
            closed = src.find("*/", self.pos + 2)
            if closed == -1:
                raise self.fail(f"the comment at index {opened} is never closed with '*/'")
            self.pos = closed + 2
            if not self.at_right_delim():
                raise self.fail(
                    f"the comment at index {opened} must end with '*/}}}}' (or '*/ -}}}}')"
                )
            return

        tokens: list[tuple[str, str]] = []  # (kind, value): kind is "bare" or "string".
        while not self.at_right_delim():
            if self.pos >= len(src):
                raise self.fail(f'the action at index {opened} is never closed with "}}}}"')
            if src[self.pos] in _SPACES:
                self.pos += 1
            else:
                tokens.append(self.token())

        source = src[opened : self.pos]
        self.parts.append(_compile_action(tokens, source, self.fail))

    def at_right_delim(self) -> bool:
        """If at "}}" or a right trim marker " -}}", step past it and say so."""
        src = self.template
        if src.startswith("}}", self.pos):
            self.pos += 2
            return True
        if (
            self.pos + 1 < len(src)
            and src[self.pos] in _SPACES
            and src.startswith("-}}", self.pos + 1)
        ):
            self.pos += 4
            self.trim_next_text = True
            return True
        return False

    def token(self) -> tuple[str, str]:
        src = self.template
        start = self.pos
        quote = src[start]
        if quote in '"`':
            end = start + 1
            while end < len(src) and src[end] != quote:
                if quote == '"' and src[end] == "\\":
                    end += 1
                elif quote == '"' and src[end] == "\n":
                    break
                end += 1
            if end >= len(src) or src[end] != quote:
                raise self.fail(f"the string starting at index {start} is never closed")
            self.pos = end + 1
            literal = src[start + 1 : end]
            return "string", literal if quote == "`" else self.unquote(literal)
        end = start
        while end < len(src) and src[end] not in _SPACES and not src.startswith("}}", end):
            end += 1
        self.pos = end
        return "bare", src[start:end]

    def unquote(self, body: str) -> str:
        try:
            return _unquote_go(body)
        except ValueError as err:
            raise self.fail(f'the string "{body}" {err}') from None


def _has_left_trim(src: str, pos: int) -> bool:
    # "{{- " trims; "{{-3}}" would be a number, which is not a trim marker.
    return src.startswith("-", pos) and pos + 1 < len(src) and src[pos + 1] in _SPACES


_GO_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPE = re.compile(
    r'\\(?:(?P<char>[abfnrtv\\"])|(?P<oct>[0-7]{3})|x(?P<x>[0-9A-Fa-f]{2})'
    r"|u(?P<u>[0-9A-Fa-f]{4})|U(?P<U>[0-9A-Fa-f]{8}))"
)


def _unquote_go(body: str) -> str:
    """Decode the body of a Go interpreted string literal (its backslash escapes)."""
    out: list[str] = []
    at = 0
    while (slash := body.find("\\", at)) != -1:
        out.append(body[at:slash])
        match = _ESCAPE.match(body, slash)
        if match is None:
            raise ValueError(f"has an unknown or malformed escape {body[slash : slash + 4]}")
        at = match.end()
        if match["char"] is not None:
            out.append(_GO_ESCAPES.get(match["char"], match["char"]))
            continue
        code = int(match["oct"], 8) if match["oct"] is not None else int(match[0][2:], 16)
        # Go's \x and octal escapes are bytes: only ASCII ones mean the same character here.
        if (match["u"] is None and match["U"] is None and code > 0x7F) or not (
            code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF
        ):
            raise ValueError(f"has the escape {match[0]}, which is not a supported character")
        out.append(chr(code))
    out.append(body[at:])
    return "".join(out)


def _first_non_path_char(text: str) -> str | None:
    for char in text:
        if char in PATH_SYMBOLS or unicodedata.category(char)[0] in "LN":
            continue
        return char
    return None


# --- Actions -------------------------------------------------------------------------------------


def _int_field(getter: Callable[[_Scope], int]) -> _Render:
    return lambda scope: str(getter(scope))


def _codec(value: int) -> str:
    # Go prints an enum by its name, or its number when it has none.
    try:
        return pb.CompressionCodec.Name(value)
    except ValueError:
        return str(value)


# Fields which upstream's spool and spec have, print as path-friendly text, and which upstream's
# spec validation (against a zero-valued spool and spec) accepts.
_FIELDS: dict[tuple[str, ...], _Render] = {
    ("Spool", "Journal"): lambda s: s.fragment.journal,
    ("Spool", "Begin"): _int_field(lambda s: s.fragment.begin),
    ("Spool", "End"): _int_field(lambda s: s.fragment.end),
    ("Spool", "ModTime"): _int_field(lambda s: s.fragment.mod_time),
    ("Spool", "CompressionCodec"): lambda s: _codec(s.fragment.compression_codec),
    ("JournalSpec", "Name"): lambda s: s.spec.name,
    ("JournalSpec", "Replication"): _int_field(lambda s: s.spec.replication),
    ("JournalSpec", "MaxAppendRate"): _int_field(lambda s: s.spec.max_append_rate),
    ("JournalSpec", "Fragment", "Length"): _int_field(lambda s: s.spec.fragment.length),
    ("JournalSpec", "Fragment", "CompressionCodec"): lambda s: _codec(
        s.spec.fragment.compression_codec
    ),
}
# The spec is embedded in upstream's template data, so its fields are also reachable directly.
_FIELDS.update(
    {(name,): _FIELDS[("JournalSpec", name)] for name in ("Name", "Replication", "MaxAppendRate")}
)

_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

# time.Time methods without arguments, each printing as Go prints its result.
_TIME_METHODS: dict[str, Callable[[datetime], str]] = {
    "Year": lambda t: str(t.year),
    "Month": lambda t: _MONTHS[t.month - 1],
    "Day": lambda t: str(t.day),
    "Hour": lambda t: str(t.hour),
    "Minute": lambda t: str(t.minute),
    "Second": lambda t: str(t.second),
    "Nanosecond": lambda t: str(t.microsecond * 1000),
    "YearDay": lambda t: str(t.timetuple().tm_yday),
    "Weekday": lambda t: _WEEKDAYS[t.weekday()],
    "Unix": lambda t: str((t - _UNIX_EPOCH) // timedelta(seconds=1)),
}

_TIME = ".Spool.FirstAppendTime"


def _supported() -> str:
    fields = ", ".join("." + ".".join(path) for path in _FIELDS if len(path) > 1)
    return f'{fields}, {_TIME}.Format "LAYOUT", {_TIME}.<{"|".join(_TIME_METHODS)}>'


def _compile_action(
    tokens: list[tuple[str, str]], source: str, fail: Callable[[str], TemplateError]
) -> _Render:
    if not tokens:
        raise fail(f"the action {source!r} is empty")
    (kind, head), args = tokens[0], tokens[1:]
    if any(k == "bare" and v.startswith(("|", "(", ")")) for k, v in tokens[1:]):
        raise fail(f"in {source!r}, pipelines and parentheses are not supported")
    if kind != "bare" or not _FIELD_CHAIN.fullmatch(head):
        raise fail(
            f"in {source!r}, {_describe(kind, head)} is not supported: an action may only "
            f'reference a field, such as .JournalSpec.Name or {_TIME}.Format "2006-01-02"'
        )
    for arg_kind, arg in args:
        if arg_kind != "string":
            raise fail(f"in {source!r}, the argument {_describe(arg_kind, arg)} is not supported")

    path = tuple(head[1:].split("."))
    if path[:2] == ("Spool", "FirstAppendTime"):
        return _compile_time(path[2:], [arg for _, arg in args], source, fail)
    render = _FIELDS.get(path)
    if render is None:
        raise fail(f"in {source!r}, the field {head} is not supported (supported: {_supported()})")
    if args:
        raise fail(f"in {source!r}, {head} is a field and takes no arguments")
    return render


def _compile_time(
    methods: tuple[str, ...], args: list[str], source: str, fail: Callable[[str], TemplateError]
) -> _Render:
    if not methods:
        raise fail(
            f"in {source!r}, {_TIME} alone prints with spaces and ':', which a path cannot "
            f'hold; use {_TIME}.Format "LAYOUT" (e.g. "2006-01-02")'
        )
    if len(methods) > 1:
        raise fail(f"in {source!r}, {_TIME}.{'.'.join(methods)} is not supported")
    method = methods[0]
    if method == "Format":
        if len(args) != 1:
            raise fail(f'in {source!r}, Format takes one layout string, e.g. "2006-01-02"')
        layout = _compile_layout(args[0])
        problem = _layout_problem(layout)
        if problem is not None:
            raise fail(f"in {source!r}, the layout {args[0]!r} {problem}")
        return lambda scope: _format(scope.time, layout)
    accessor = _TIME_METHODS.get(method)
    if accessor is None:
        raise fail(
            f"in {source!r}, the method {_TIME}.{method} is not supported (supported: Format, "
            f"{', '.join(_TIME_METHODS)})"
        )
    if args:
        raise fail(f"in {source!r}, {_TIME}.{method} takes no arguments")
    return lambda scope: accessor(scope.time)


def _describe(kind: str, token: str) -> str:
    if kind == "string":
        return f"the string constant {token!r}"
    if token in _KEYWORDS:
        return f"the control keyword {token!r}"
    if token.startswith("$"):
        return f"the variable {token!r}"
    if token in ("|", "(", ")") or token.startswith(("(", "|")):
        return f"the pipeline or group {token!r}"
    if token == ".":
        return "the data itself '.'"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token):
        return f"the function {token!r}"
    return f"{token!r}"


# --- Go time layouts -------------------------------------------------------------------------------

# Layout elements: what Go's time package recognises in a layout. An element's tuple is
# (name, argument): the argument is the digit count and separator of fractional seconds.
_Element = tuple[str, int, str]
_Chunk = str | _Element

# Longest match first where one element's text begins another's.
_PREFIXED: list[tuple[str, str]] = [
    ("January", "long_month"),
    ("Monday", "long_weekday"),
    ("MST", "tz_name"),
    ("2006", "long_year"),
    ("002", "zero_yearday"),
    ("__2", "under_yearday"),
    ("_2", "under_day"),
    ("01", "zero_month"),
    ("02", "zero_day"),
    ("03", "zero_hour12"),
    ("04", "zero_minute"),
    ("05", "zero_second"),
    ("06", "year"),
    ("15", "hour"),
    ("1", "num_month"),
    ("2", "day"),
    ("3", "hour12"),
    ("4", "minute"),
    ("5", "second"),
    ("PM", "PM"),
    ("pm", "pm"),
    ("-070000", "num_seconds_tz"),
    ("-07:00:00", "num_colon_seconds_tz"),
    ("-0700", "num_tz"),
    ("-07:00", "num_colon_tz"),
    ("-07", "num_short_tz"),
    ("Z070000", "iso_seconds_tz"),
    ("Z07:00:00", "iso_colon_seconds_tz"),
    ("Z0700", "iso_tz"),
    ("Z07:00", "iso_colon_tz"),
    ("Z07", "iso_short_tz"),
]


def _compile_layout(layout: str) -> list[_Chunk]:
    """Split a Go layout into literal text and elements, recognising what Go's does."""
    chunks: list[_Chunk] = []
    literal: list[str] = []
    i = 0
    while i < len(layout):
        element, width = _element_at(layout, i)
        if element is None:
            literal.append(layout[i])
            i += 1
            continue
        if literal:
            chunks.append("".join(literal))
            literal = []
        chunks.append(element)
        i += width
    if literal:
        chunks.append("".join(literal))
    return chunks


def _element_at(layout: str, i: int) -> tuple[_Element | None, int]:
    rest = layout[i:]
    # "Jan" and "Mon" are elements only when no lower-case letter follows ("Janet" is text).
    for short, name in (("Jan", "month"), ("Mon", "weekday")):
        if rest.startswith(short) and not (rest.startswith("January") or rest.startswith("Monday")):
            if len(rest) > 3 and "a" <= rest[3] <= "z":
                return None, 1
            return (name, 0, ""), 3
    if rest.startswith("_2006"):
        return None, 1  # A literal "_" before the year (Go's special case).
    if rest[0] in ".," and len(rest) > 1 and rest[1] in "09":
        digit = rest[1]
        j = 1
        while j < len(rest) and rest[j] == digit:
            j += 1
        if j == len(rest) or not "0" <= rest[j] <= "9":
            name = "frac0" if digit == "0" else "frac9"
            return (name, min(j - 1, 9), rest[0]), j
        return None, 1
    for text, name in _PREFIXED:
        if rest.startswith(text):
            return (name, 0, ""), len(text)
    return None, 1


def _layout_problem(layout: list[_Chunk]) -> str | None:
    """Why a compiled layout cannot always render a valid fragment path, if it cannot."""
    for chunk in layout:
        if isinstance(chunk, str):
            bad = _first_non_path_char(chunk)
            if bad is not None:
                return f"writes {bad!r}, which a fragment path cannot hold"
            continue
        name, _, separator = chunk
        if name in ("under_day", "under_yearday"):
            return "pads with spaces (_2, __2), which a fragment path cannot hold; use 02 or 002"
        if name in ("num_colon_tz", "num_colon_seconds_tz"):
            return "writes the zone offset with ':', which a fragment path cannot hold"
        if separator == ",":
            return "separates fractional seconds with ',', which a fragment path cannot hold"
    return None


def _format(t: datetime, layout: list[_Chunk]) -> str:
    """`t` (in UTC) formatted as Go's time.Format would with `layout`."""
    out: list[str] = []
    for chunk in layout:
        if isinstance(chunk, str):
            out.append(chunk)
        else:
            out.append(_format_element(t, *chunk))
    return "".join(out)


def format_go_time(t: datetime, layout: str) -> str:
    """Format a UTC datetime by a Go reference-time layout, e.g. "2006-01-02T15:04:05Z07:00"."""
    return _format(t.astimezone(UTC), _compile_layout(layout))


def _hour12(t: datetime) -> int:
    return t.hour % 12 or 12


# Each layout element but the fractional seconds, formatted from a UTC time.
_ELEMENTS: dict[str, Callable[[datetime], str]] = {
    "long_year": lambda t: f"{t.year:04d}",
    "year": lambda t: f"{t.year % 100:02d}",
    "month": lambda t: _MONTHS[t.month - 1][:3],
    "long_month": lambda t: _MONTHS[t.month - 1],
    "num_month": lambda t: str(t.month),
    "zero_month": lambda t: f"{t.month:02d}",
    "weekday": lambda t: _WEEKDAYS[t.weekday()][:3],
    "long_weekday": lambda t: _WEEKDAYS[t.weekday()],
    "day": lambda t: str(t.day),
    "under_day": lambda t: f"{t.day:2d}",
    "zero_day": lambda t: f"{t.day:02d}",
    "under_yearday": lambda t: f"{t.timetuple().tm_yday:3d}",
    "zero_yearday": lambda t: f"{t.timetuple().tm_yday:03d}",
    "hour": lambda t: f"{t.hour:02d}",
    "hour12": lambda t: str(_hour12(t)),
    "zero_hour12": lambda t: f"{_hour12(t):02d}",
    "minute": lambda t: str(t.minute),
    "zero_minute": lambda t: f"{t.minute:02d}",
    "second": lambda t: str(t.second),
    "zero_second": lambda t: f"{t.second:02d}",
    "PM": lambda t: "PM" if t.hour >= 12 else "AM",
    "pm": lambda t: "pm" if t.hour >= 12 else "am",
    "tz_name": lambda t: "UTC",
    # Times here are UTC: ISO 8601 forms print "Z", numeric forms a zero offset.
    **dict.fromkeys(
        ("iso_tz", "iso_colon_tz", "iso_short_tz", "iso_seconds_tz", "iso_colon_seconds_tz"),
        lambda t: "Z",
    ),
    "num_tz": lambda t: "+0000",
    "num_colon_tz": lambda t: "+00:00",
    "num_short_tz": lambda t: "+00",
    "num_seconds_tz": lambda t: "+000000",
    "num_colon_seconds_tz": lambda t: "+00:00:00",
}


def _format_element(t: datetime, name: str, digits: int, separator: str) -> str:
    if name in ("frac0", "frac9"):
        nanos = f"{t.microsecond * 1000:09d}"[:digits]
        if name == "frac9":
            nanos = nanos.rstrip("0")
        return separator + nanos if nanos else ""
    element = _ELEMENTS.get(name)
    if element is None:
        raise AssertionError(f"unknown layout element {name}")
    return element(t)


# --- Rendered postfixes ----------------------------------------------------------------------------


def _postfix_problem(postfix: str) -> str | None:
    try:
        validate_path_component(
            postfix, field="path_postfix", min_len=0, max_len=MAX_JOURNAL_NAME_LEN
        )
    except ValidationError as err:
        return f"is not a valid path postfix: {err.problem}"
    if any(segment in (".", "..") for segment in postfix.split("/")):
        return "must not hold '.' or '..' segments"
    return None


def _check_postfix(template: str, postfix: str) -> None:
    problem = _postfix_problem(postfix)
    if problem is not None:
        raise TemplateError(
            f"path postfix template {_show(template)} rendered {postfix!r}, which {problem}"
        )
