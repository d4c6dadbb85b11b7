"""Validation of protocol messages with upstream Gazette's rules and bounds.

Each validator raises ValidationError naming the offending field by its dotted path and the bad value.
"""

from __future__ import annotations

import functools
import json
import re
import string
import unicodedata
from typing import NamedTuple

from google.protobuf import duration_pb2

from broker.protocol import protocol_pb2
from broker.protocol.labels import (
    CONTENT_TYPE,
    MESSAGE_SUBTYPE,
    MESSAGE_TYPE,
    META_NAME,
    META_PREFIX,
    SINGLE_VALUE_LABELS,
)

__all__ = [
    "MAX_BROKER_JOURNAL_LIMIT",
    "MAX_FRAGMENT_LENGTH",
    "MAX_JOURNAL_NAME_LEN",
    "MAX_LABEL_NAME_LEN",
    "MAX_LABEL_VALUE_LEN",
    "MAX_PROCESS_SUFFIX_LEN",
    "MAX_REFRESH_INTERVAL_NS",
    "MAX_REPLICATION",
    "MAX_SHARD_ID_LEN",
    "MAX_ZONE_LEN",
    "MIN_FLUSH_INTERVAL_NS",
    "MIN_FRAGMENT_LENGTH",
    "MIN_JOURNAL_NAME_LEN",
    "MIN_LABEL_NAME_LEN",
    "MIN_PROCESS_SUFFIX_LEN",
    "MIN_REFRESH_INTERVAL_NS",
    "MIN_SHARD_ID_LEN",
    "MIN_ZONE_LEN",
    "PATH_SYMBOLS",
    "TOKEN_SYMBOLS",
    "ValidationError",
    "at_field",
    "clean_path",
    "duration_ns",
    "format_duration",
    "show",
    "validate_apply_request",
    "validate_broker_spec",
    "validate_endpoint",
    "validate_fragment_spec",
    "validate_fragment_store",
    "validate_header",
    "validate_journal_labels",
    "validate_journal_name",
    "validate_journal_spec",
    "validate_label",
    "validate_label_selector",
    "validate_label_set",
    "validate_list_request",
    "validate_path_component",
    "validate_process_id",
    "validate_process_spec",
    "validate_route",
    "validate_shard_id",
    "validate_single_value_labels",
    "validate_token",
]

# Symbols allowed in tokens besides Unicode letters and numbers. Every rune at or below '#' stays
# out, as '#' separates the parts of allocator keys in etcd.
TOKEN_SYMBOLS = "-_+/."
# Path-like strings (journal names, label values) also allow '=' and '%'.
PATH_SYMBOLS = TOKEN_SYMBOLS + "=%"

# Lengths count UTF-8 bytes, as upstream's do.
MIN_JOURNAL_NAME_LEN, MAX_JOURNAL_NAME_LEN = 4, 512
MIN_LABEL_NAME_LEN, MAX_LABEL_NAME_LEN = 2, 64
MAX_LABEL_VALUE_LEN = 1024
MIN_ZONE_LEN, MAX_ZONE_LEN = 1, 32
MIN_PROCESS_SUFFIX_LEN, MAX_PROCESS_SUFFIX_LEN = 4, 128
MIN_SHARD_ID_LEN, MAX_SHARD_ID_LEN = 4, 512

MAX_REPLICATION = 5
MIN_FRAGMENT_LENGTH, MAX_FRAGMENT_LENGTH = 1 << 10, 1 << 34
_SECOND_NS = 1_000_000_000
MIN_REFRESH_INTERVAL_NS, MAX_REFRESH_INTERVAL_NS = _SECOND_NS, 24 * 3600 * _SECOND_NS
MIN_FLUSH_INTERVAL_NS = 60 * _SECOND_NS
MAX_BROKER_JOURNAL_LIMIT = 1 << 17

_FRAGMENT_STORE_SCHEMES = ("s3", "gs", "azure", "azure-ad", "file")
_JOURNAL_FLAGS = frozenset(protocol_pb2.JournalSpec.Flag.values())
_SUSPEND_LEVELS = frozenset(protocol_pb2.JournalSpec.Suspend.Level.values())
_CODEC_NAMES = {value: name for name, value in protocol_pb2.CompressionCodec.items()}


class ValidationError(ValueError):
    """A value broke a protocol rule. `field` is its dotted path, e.g. `changes[3].upsert.name`."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(field, value, problem)
        self.field = field
        self.value = value
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}" if self.field else self.problem


# --- Rendering ----------------------------------------------------------------------------------


def _at(field: str, child: str) -> str:
    if not field:
        return child
    return field + child if child.startswith("[") else f"{field}.{child}"


def quote(text: str) -> str:
    """`text` double-quoted for a message, as Go's %q: escapes for what JSON escapes, and for
    every other character that is not printable (NEL, the Unicode line and paragraph separators
    and format characters, lone surrogates), so that the message stays one readable line."""
    quoted = json.dumps(text, ensure_ascii=False)
    if quoted.isprintable():
        return quoted
    return "".join(
        c if c.isprintable() else (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
        for c in quoted
    )


def _show(value: str) -> str:
    # Long values are cut so that the error stays one readable line.
    if len(value) > 80:
        return quote(value[:60])[:-1] + f'…" ({len(value)} characters)'
    return quote(value)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def _decimal(value: int, unit: int) -> str:
    whole, part = divmod(value, unit)
    if not part:
        return str(whole)
    digits = str(part).rjust(len(str(unit)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


def _duration(ns: int) -> str:
    """Render nanoseconds the way Go prints a time.Duration (`1m0s`, `500ms`), as specs are written."""
    if ns == 0:
        return "0s"
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_decimal(ns, 1_000)}µs"
    if ns < _SECOND_NS:
        return f"{sign}{_decimal(ns, 1_000_000)}ms"
    hours, ns = divmod(ns, 3600 * _SECOND_NS)
    minutes, ns = divmod(ns, 60 * _SECOND_NS)
    seconds = _decimal(ns, _SECOND_NS) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


def _nanos(duration: duration_pb2.Duration) -> int:
    return int(duration.seconds) * _SECOND_NS + int(duration.nanos)


# Public names of the renderers, for the specs of other packages (consumer shards).
format_duration = _duration
duration_ns = _nanos
at_field = _at
show = _show


# --- Tokens and paths ---------------------------------------------------------------------------


def _describe_symbols(symbols: str) -> str:
    return f"letters, digits and {symbols}"


@functools.cache
def _ascii_token(symbols: str) -> re.Pattern[str]:
    return re.compile(f"[A-Za-z0-9{re.escape(symbols)}]*")


def validate_token(
    value: str, *, field: str, min_len: int, max_len: int, symbols: str = TOKEN_SYMBOLS
) -> None:
    """`value` has min_len..max_len UTF-8 bytes, all Unicode letters, numbers or `symbols`."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size < min_len or size > max_len:
        which = "short" if size < min_len else "long"
        unit = "byte" if size == 1 else "bytes"
        wanted = f"at most {max_len}" if min_len == 0 else f"{min_len} to {max_len}"
        raise ValidationError(
            field, value, f"{_show(value)} is too {which} ({size} {unit}; expected {wanted} bytes)"
        )
    if value.isascii() and _ascii_token(symbols).fullmatch(value):
        return  # The common case, without a per-character Unicode category lookup.
    for index, char in enumerate(value):
        if unicodedata.category(char)[0] in "LN" or char in symbols:
            continue
        raise ValidationError(
            field,
            value,
            f"{_show(value)} has the character {_show(char)} at index {index}, which is not "
            f"allowed (expected {_describe_symbols(symbols)})",
        )


def clean_path(path: str) -> str:
    """The shortest equivalent of a slash-separated path, by the rules of Go's path.Clean."""
    if path == "":
        return "."
    rooted = path.startswith("/")
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not rooted:
                parts.append("..")  # A relative path may climb above its start; a rooted one not.
            continue
        parts.append(part)
    joined = "/".join(parts)
    if rooted:
        return "/" + joined
    return joined or "."


def validate_path_component(value: str, *, field: str, min_len: int, max_len: int) -> None:
    """A token over PATH_SYMBOLS which is also a clean path and not rooted."""
    validate_token(value, field=field, min_len=min_len, max_len=max_len, symbols=PATH_SYMBOLS)
    if value and clean_path(value) != value:
        raise ValidationError(
            field,
            value,
            f"{_show(value)} is not a clean path (it cleans to {_show(clean_path(value))})",
        )
    if value.startswith("/"):
        raise ValidationError(field, value, f"{_show(value)} must not begin with '/'")


def validate_journal_name(name: str, *, field: str = "journal", allow_meta: bool = False) -> None:
    """A journal name: 4..512 bytes of path alphabet, clean and relative, without a trailing '/'.

    Upstream lets a journal named in Read, Append, Apply deletes and shard sources carry a
    `;meta` segment (itself a clean path of 1..512 bytes); specifications may not (allow_meta=False).
    """
    base, sep, meta = name.partition(";")
    validate_path_component(
        base, field=field, min_len=MIN_JOURNAL_NAME_LEN, max_len=MAX_JOURNAL_NAME_LEN
    )
    if not sep:
        return
    if not allow_meta:
        raise ValidationError(
            field,
            name,
            f"{_show(name)} has a metadata segment {_show(sep + meta)}, which is not allowed here",
        )
    try:
        validate_path_component(meta, field=field, min_len=1, max_len=MAX_JOURNAL_NAME_LEN)
    except ValidationError as err:
        raise ValidationError(
            field, name, f"metadata segment of {_show(name)}: {err.problem}"
        ) from None


def validate_shard_id(shard_id: str, *, field: str = "id") -> None:
    """A shard ID: 4..512 bytes of letters, digits and -_+/."""
    validate_token(shard_id, field=field, min_len=MIN_SHARD_ID_LEN, max_len=MAX_SHARD_ID_LEN)


# --- Labels -------------------------------------------------------------------------------------


def validate_label(
    label: protocol_pb2.Label, *, field: str = "label", allow_prefix: bool = False
) -> None:
    """Name 2..64 bytes of token alphabet; value 0..1024 bytes of path alphabet.

    The prefix flag is meaningful only within a LabelSelector (allow_prefix=True).
    """
    validate_token(
        label.name,
        field=_at(field, "name"),
        min_len=MIN_LABEL_NAME_LEN,
        max_len=MAX_LABEL_NAME_LEN,
    )
    validate_token(
        label.value,
        field=_at(field, "value"),
        min_len=0,
        max_len=MAX_LABEL_VALUE_LEN,
        symbols=PATH_SYMBOLS,
    )
    if label.prefix and not allow_prefix:
        raise ValidationError(
            _at(field, "prefix"),
            label.prefix,
            f"label {_show(label.name)} is a prefix match, which only a label selector may use",
        )


def validate_label_set(
    labels: protocol_pb2.LabelSet, *, field: str = "labels", allow_prefix: bool = False
) -> None:
    """Every label is valid; labels are unique and sorted on (name, value); a name does not have
    both the empty value and other values."""
    items = labels.labels
    for index, label in enumerate(items):
        here = _at(field, f"[{index}]")
        validate_label(label, field=here, allow_prefix=allow_prefix)
        if index == 0:
            continue
        prev = items[index - 1]
        if prev.name > label.name:
            raise ValidationError(
                _at(here, "name"),
                label.name,
                f"labels are not sorted: {_show(label.name)} follows {_show(prev.name)}",
            )
        if prev.name == label.name and prev.value >= label.value:
            raise ValidationError(
                _at(here, "value"),
                label.value,
                f"labels are not unique and sorted: {_show(label.name)} value "
                f"{_show(label.value)} follows {_show(prev.value)}",
            )
        if prev.name == label.name and prev.value == "":
            raise ValidationError(
                _at(here, "value"),
                label.value,
                f"label {_show(label.name)} has both the empty value and the value "
                f"{_show(label.value)}",
            )


def validate_single_value_labels(labels: protocol_pb2.LabelSet, *, field: str = "labels") -> None:
    """Well-known single-valued labels (content-type, message-type, ...) have one value at most."""
    items = labels.labels
    for index in range(1, len(items)):
        label = items[index]
        if label.name == items[index - 1].name and label.name in SINGLE_VALUE_LABELS:
            raise ValidationError(
                _at(field, f"[{index}].value"),
                label.value,
                f"label {_show(label.name)} may have only one value, but also has "
                f"{_show(label.value)}",
            )


_MIME_TSPECIALS = frozenset('()<>@,;:\\"/[]?=')


def _mime_token_length(text: str) -> int:
    for index, char in enumerate(text):
        if not (0x20 < ord(char) < 0x7F) or char in _MIME_TSPECIALS:
            return index
    return len(text)


def _media_type_problem(value: str) -> str | None:
    """Why `value` is not a media type as Go's mime.ParseMediaType reads one, or None."""
    media = value.partition(";")[0].strip(string.whitespace).lower()
    kind = _mime_token_length(media)
    if kind == 0:
        return "no media type"
    rest = media[kind:]
    if not rest:
        return None  # A bare type without subtype parses.
    if not rest.startswith("/"):
        return "expected '/' after the type"
    subtype = _mime_token_length(rest[1:])
    if subtype == 0:
        return "expected a subtype after '/'"
    if rest[1 + subtype :]:
        return "unexpected content after the subtype"
    return None


def validate_journal_labels(labels: protocol_pb2.LabelSet, *, field: str = "labels") -> None:
    """The labels of a JournalSpec: a valid set without the meta-labels `name` and `prefix`,
    whose content-type is a MIME type, whose message-type comes with a content-type, and whose
    message-subtype comes with a message-type."""
    # Many journals share one label set (a topic's partitions): remember the ones found valid.
    key = tuple((label.name, label.value, label.prefix) for label in labels.labels)
    if key in _VALID_JOURNAL_LABELS:
        return
    _validate_journal_labels(labels, field)
    if len(_VALID_JOURNAL_LABELS) > 4096:
        _VALID_JOURNAL_LABELS.clear()
    _VALID_JOURNAL_LABELS.add(key)


_VALID_JOURNAL_LABELS: set[tuple[tuple[str, str, bool], ...]] = set()


def _validate_journal_labels(labels: protocol_pb2.LabelSet, field: str) -> None:
    validate_label_set(labels, field=field)
    items = labels.labels
    for reserved in (META_NAME, META_PREFIX):
        for index, label in enumerate(items):
            if label.name == reserved:
                raise ValidationError(
                    _at(field, f"[{index}].name"),
                    label.name,
                    f"{_show(reserved)} is a meta-label and may not be among a journal's labels",
                )
    validate_single_value_labels(labels, field=field)

    first: dict[str, int] = {}
    for index, label in enumerate(items):
        first.setdefault(label.name, index)
    if CONTENT_TYPE in first:
        index = first[CONTENT_TYPE]
        value = items[index].value
        problem = _media_type_problem(value)
        if problem is not None:
            raise ValidationError(
                _at(field, f"[{index}].value"),
                value,
                f"{_show(value)} is not a valid {CONTENT_TYPE} ({problem})",
            )
    if MESSAGE_TYPE in first:
        if CONTENT_TYPE not in first:
            index = first[MESSAGE_TYPE]
            raise ValidationError(
                _at(field, f"[{index}].name"),
                MESSAGE_TYPE,
                f"label {_show(MESSAGE_TYPE)} requires a {_show(CONTENT_TYPE)} label",
            )
    elif MESSAGE_SUBTYPE in first:
        index = first[MESSAGE_SUBTYPE]
        raise ValidationError(
            _at(field, f"[{index}].name"),
            MESSAGE_SUBTYPE,
            f"label {_show(MESSAGE_SUBTYPE)} requires a {_show(MESSAGE_TYPE)} label",
        )


def validate_label_selector(sel: protocol_pb2.LabelSelector, *, field: str = "") -> None:
    """Both sides are valid label sets, in which prefix matches are allowed."""
    validate_label_set(sel.include, field=_at(field, "include"), allow_prefix=True)
    validate_label_set(sel.exclude, field=_at(field, "exclude"), allow_prefix=True)


# --- URLs ---------------------------------------------------------------------------------------


class _Url(NamedTuple):
    scheme: str
    host: str
    path: str  # Percent-decoded, as Go's url.URL.Path.


_HEX = frozenset(string.hexdigits)
# ASCII a host may contain besides letters and digits (Go's net/url, host mode).
_HOST_SYMBOLS = frozenset("-._~!$&'()*+,;=:[]<>\"%")


def _unescape(text: str, what: str) -> str:
    out = bytearray()
    index = 0
    while index < len(text):
        char = text[index]
        if char == "%":
            code = text[index + 1 : index + 3]
            if len(code) != 2 or not set(code) <= _HEX:
                raise ValueError(f"invalid escape {_show(text[index : index + 3])} in its {what}")
            out.append(int(code, 16))
            index += 3
        else:
            out += char.encode("utf-8", "surrogatepass")
            index += 1
    return out.decode("utf-8", "replace")


def _parse_url(text: str) -> _Url:
    """Split `text` as Go's url.Parse does, raising ValueError where it would fail."""
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        raise ValueError("it contains a control character")

    scheme, rest = "", text
    for index, char in enumerate(text):
        if char.isascii() and char.isalpha():
            continue
        if char.isascii() and (char.isdigit() or char in "+-."):
            if index == 0:
                break
            continue
        if char == ":":
            if index == 0:
                raise ValueError("it is missing a scheme before ':'")
            scheme, rest = text[:index].lower(), text[index + 1 :]
        break

    rest, _, fragment = rest.partition("#")
    _unescape(fragment, "fragment")
    rest = rest.partition("?")[0]

    if not rest.startswith("/"):
        if scheme:
            return _Url(scheme, "", "")  # Opaque, as in `mailto:x`: no host and no path.
        if ":" in rest.partition("/")[0]:
            raise ValueError("its first path segment contains ':'")

    host = ""
    if rest.startswith("//") and (scheme or not rest.startswith("///")):
        authority, slash, path = rest[2:].partition("/")
        rest = slash + path
        host = authority.rpartition("@")[2]
        for char in host:
            if char.isascii() and not char.isalnum() and char not in _HOST_SYMBOLS:
                raise ValueError(f"its host has the invalid character {_show(char)}")
        _unescape(host, "host")
        if not host.startswith("["):
            _, colon, port = host.rpartition(":")
            if colon and port and not (port.isascii() and port.isdigit()):
                raise ValueError(f"its port {_show(port)} is not a number")
    return _Url(scheme, host, _unescape(rest, "path"))


# Stores already found valid: a cluster has few distinct stores but many journals naming them.
_VALID_STORES: set[str] = set()


def validate_fragment_store(store: str, *, field: str = "store") -> None:
    """An absolute URL of scheme s3, gs, azure, azure-ad or file, whose path ends in '/'.

    s3, gs and azure name a bucket (or container) as host; azure-ad names a tenant as host and
    the storage account and container as the first two path segments; file has no host.
    """
    if store in _VALID_STORES:
        return
    _validate_fragment_store(store, field)
    if len(_VALID_STORES) > 4096:
        _VALID_STORES.clear()
    _VALID_STORES.add(store)


def _validate_fragment_store(store: str, field: str) -> None:

    def fail(reason: str) -> ValidationError:
        return ValidationError(
            field, store, f"{_show(store)} is not a valid fragment store: {reason}"
        )

    try:
        url = _parse_url(store)
    except ValueError as err:
        raise fail(str(err)) from None
    if not url.scheme:
        raise fail("it is not an absolute URL")
    if url.scheme not in _FRAGMENT_STORE_SCHEMES:
        raise fail(f"scheme {_show(url.scheme)} is not one of {', '.join(_FRAGMENT_STORE_SCHEMES)}")
    if url.scheme in ("s3", "gs", "azure") and not url.host:
        raise fail("it names no bucket")
    if url.scheme == "azure-ad":
        segments = url.path[1:].split("/")
        if not url.host:
            raise fail("it names no tenant ID")
        if not segments[0]:
            raise fail("it names no storage account")
        if len(segments) < 2 or not segments[1]:
            raise fail("it names no storage container")
    if url.scheme == "file" and url.host:
        raise fail("a file:// store cannot have a host")
    if not url.path.endswith("/"):
        raise fail(f"its path {_show(url.path)} does not end in '/'")


def validate_endpoint(endpoint: str, *, field: str = "endpoint") -> None:
    """An absolute URL with a host, such as `http://host:8080` or `unix://host/path/to/socket`."""

    def fail(reason: str) -> ValidationError:
        return ValidationError(
            field, endpoint, f"{_show(endpoint)} is not a valid endpoint: {reason}"
        )

    try:
        url = _parse_url(endpoint)
    except ValueError as err:
        raise fail(str(err)) from None
    if not url.scheme:
        raise fail("it is not an absolute URL")
    if not url.host:
        raise fail("it has no host")


# --- Journal specifications ---------------------------------------------------------------------


def _template_problem(template: str) -> str | None:
    # Only an unclosed action is detected: evaluating the Go template (as upstream does, against
    # a zero-valued spool and spec) needs a Go template engine. A valid template always closes
    # each "{{" with a later "}}", so this never rejects one.
    at = 0
    while (opened := template.find("{{", at)) != -1:
        closed = template.find("}}", opened + 2)
        if closed == -1:
            return f'the action opened at index {opened} is never closed with "}}}}"'
        at = closed + 2
    return None


def validate_fragment_spec(
    fragment: protocol_pb2.JournalSpec.Fragment, *, field: str = "fragment"
) -> None:
    """Length 1 KiB..16 GiB; a valid codec; valid stores; refresh 1s..24h; flush 0 or >= 1m."""
    length = fragment.length
    if length < MIN_FRAGMENT_LENGTH:
        raise ValidationError(
            _at(field, "length"),
            length,
            f"{length} is below the minimum {MIN_FRAGMENT_LENGTH} ({_size(MIN_FRAGMENT_LENGTH)})",
        )
    if length > MAX_FRAGMENT_LENGTH:
        raise ValidationError(
            _at(field, "length"),
            length,
            f"{length} is above the maximum {MAX_FRAGMENT_LENGTH} ({_size(MAX_FRAGMENT_LENGTH)})",
        )

    codec = int(fragment.compression_codec)
    if codec not in _CODEC_NAMES or codec == protocol_pb2.INVALID:
        allowed = ", ".join(name for value, name in _CODEC_NAMES.items() if value)
        raise ValidationError(
            _at(field, "compression_codec"),
            codec,
            f"{_CODEC_NAMES.get(codec, str(codec))} is not a valid compression codec "
            f"(expected one of {allowed})",
        )

    for index, store in enumerate(fragment.stores):
        here = _at(field, f"stores[{index}]")
        validate_fragment_store(store, field=here)
        # Readers of GZIP_OFFLOAD_DECOMPRESSION fragments fetch them by signed URL and rely on
        # the store to decompress, which a file:// store cannot do.
        if (
            index == 0
            and codec == protocol_pb2.GZIP_OFFLOAD_DECOMPRESSION
            and _parse_url(store).scheme == "file"
        ):
            raise ValidationError(
                here,
                store,
                f"{_show(store)} is a file:// store, which GZIP_OFFLOAD_DECOMPRESSION cannot use "
                "as its first store",
            )

    refresh = _nanos(fragment.refresh_interval)
    if not MIN_REFRESH_INTERVAL_NS <= refresh <= MAX_REFRESH_INTERVAL_NS:
        which, bound = (
            ("below the minimum", MIN_REFRESH_INTERVAL_NS)
            if refresh < MIN_REFRESH_INTERVAL_NS
            else ("above the maximum", MAX_REFRESH_INTERVAL_NS)
        )
        raise ValidationError(
            _at(field, "refresh_interval"),
            refresh,
            f"{_duration(refresh)} is {which} {_duration(bound)}",
        )

    flush = _nanos(fragment.flush_interval)
    if flush != 0 and flush < MIN_FLUSH_INTERVAL_NS:
        raise ValidationError(
            _at(field, "flush_interval"),
            flush,
            f"{_duration(flush)} is below the minimum {_duration(MIN_FLUSH_INTERVAL_NS)} "
            "(or 0s, to not flush on a schedule)",
        )

    template = fragment.path_postfix_template
    problem = _template_problem(template)
    if problem is not None:
        raise ValidationError(
            _at(field, "path_postfix_template"),
            template,
            f"{_show(template)} is not a valid template: {problem}",
        )
    # Retention needs no check: every value is allowed, and <= 0 means forever.


def validate_journal_spec(spec: protocol_pb2.JournalSpec, *, field: str = "") -> None:
    """A JournalSpec as upstream's JournalSpec.Validate, checked in the same order."""
    validate_journal_name(spec.name, field=_at(field, "name"))
    if not 1 <= spec.replication <= MAX_REPLICATION:
        raise ValidationError(
            _at(field, "replication"),
            spec.replication,
            f"{spec.replication} is outside the allowed range 1 to {MAX_REPLICATION}",
        )
    validate_journal_labels(spec.labels, field=_at(field, "labels"))
    validate_fragment_spec(spec.fragment, field=_at(field, "fragment"))
    if spec.flags not in _JOURNAL_FLAGS:
        allowed = ", ".join(
            f"{name} ({value})" for name, value in protocol_pb2.JournalSpec.Flag.items()
        )
        raise ValidationError(
            _at(field, "flags"),
            spec.flags,
            f"{spec.flags} is not a permitted flag combination (expected one of {allowed})",
        )
    if spec.max_append_rate < 0:
        raise ValidationError(
            _at(field, "max_append_rate"),
            spec.max_append_rate,
            f"{spec.max_append_rate} is negative (expected bytes per second, or 0 for no limit)",
        )
    level = int(spec.suspend.level)
    if level not in _SUSPEND_LEVELS:
        raise ValidationError(
            _at(field, "suspend.level"),
            level,
            f"{level} is not a suspension level (expected NONE, PARTIAL or FULL)",
        )
    if spec.suspend.offset < 0:
        raise ValidationError(
            _at(field, "suspend.offset"),
            spec.suspend.offset,
            f"{spec.suspend.offset} is negative (expected an offset >= 0)",
        )


# --- Processes, routes and headers --------------------------------------------------------------


def validate_process_id(process_id: protocol_pb2.ProcessSpec.ID, *, field: str = "id") -> None:
    """Zone of 1..32 and suffix of 4..128 bytes, both of letters, digits and -_+/."""
    validate_token(
        process_id.zone, field=_at(field, "zone"), min_len=MIN_ZONE_LEN, max_len=MAX_ZONE_LEN
    )
    validate_token(
        process_id.suffix,
        field=_at(field, "suffix"),
        min_len=MIN_PROCESS_SUFFIX_LEN,
        max_len=MAX_PROCESS_SUFFIX_LEN,
    )


def validate_process_spec(spec: protocol_pb2.ProcessSpec, *, field: str = "") -> None:
    """A valid process ID and endpoint."""
    validate_process_id(spec.id, field=_at(field, "id"))
    validate_endpoint(spec.endpoint, field=_at(field, "endpoint"))


def validate_broker_spec(spec: protocol_pb2.BrokerSpec, *, field: str = "") -> None:
    """A valid process spec and a journal limit of at most 131072."""
    validate_process_spec(spec.process_spec, field=_at(field, "process_spec"))
    if spec.journal_limit > MAX_BROKER_JOURNAL_LIMIT:
        raise ValidationError(
            _at(field, "journal_limit"),
            spec.journal_limit,
            f"{spec.journal_limit} is above the maximum {MAX_BROKER_JOURNAL_LIMIT}",
        )


def _show_id(process_id: protocol_pb2.ProcessSpec.ID) -> str:
    return f"{process_id.zone}#{process_id.suffix}"


def validate_route(route: protocol_pb2.Route, *, field: str = "") -> None:
    """Members valid, unique and sorted on (zone, suffix); primary -1 or a member index; endpoints
    either absent or one per member, each empty or valid."""
    members = route.members
    for index, member in enumerate(members):
        here = _at(field, f"members[{index}]")
        validate_process_id(member, field=here)
        if index and (members[index - 1].zone, members[index - 1].suffix) >= (
            member.zone,
            member.suffix,
        ):
            raise ValidationError(
                here,
                _show_id(member),
                f"members are not unique and sorted: {_show(_show_id(member))} follows "
                f"{_show(_show_id(members[index - 1]))}",
            )
    if not -1 <= route.primary < len(members):
        raise ValidationError(
            _at(field, "primary"),
            route.primary,
            f"{route.primary} is not -1 or the index of one of the {len(members)} members",
        )
    if route.endpoints and len(route.endpoints) != len(members):
        raise ValidationError(
            _at(field, "endpoints"),
            list(route.endpoints),
            f"there are {len(route.endpoints)} endpoints for {len(members)} members "
            "(expected none, or one per member)",
        )
    for index, endpoint in enumerate(route.endpoints):
        if endpoint:
            validate_endpoint(endpoint, field=_at(field, f"endpoints[{index}]"))


def validate_header(header: protocol_pb2.Header, *, field: str = "") -> None:
    """Process ID valid if set, route valid, and every etcd field set (revision positive)."""
    if header.process_id.zone or header.process_id.suffix:
        validate_process_id(header.process_id, field=_at(field, "process_id"))
    validate_route(header.route, field=_at(field, "route"))
    etcd = header.etcd
    for name in ("cluster_id", "member_id"):
        if getattr(etcd, name) == 0:
            raise ValidationError(
                _at(field, f"etcd.{name}"), 0, "0 is not valid (expected non-zero)"
            )
    if etcd.revision <= 0:
        raise ValidationError(
            _at(field, "etcd.revision"), etcd.revision, f"{etcd.revision} is not positive"
        )
    if etcd.raft_term == 0:
        raise ValidationError(_at(field, "etcd.raft_term"), 0, "0 is not valid (expected non-zero)")


# --- Requests -----------------------------------------------------------------------------------


def validate_list_request(req: protocol_pb2.ListRequest, *, field: str = "") -> None:
    """A valid selector whose `prefix` meta-label values each end in '/'.

    As upstream, `watch_resume` is not validated: only its etcd revision is used.
    """
    here = _at(field, "selector")
    validate_label_selector(req.selector, field=here)
    for side, labels in (("include", req.selector.include), ("exclude", req.selector.exclude)):
        for index, label in enumerate(labels.labels):
            if label.name == META_PREFIX and not label.value.endswith("/"):
                raise ValidationError(
                    _at(here, f"{side}[{index}].value"),
                    label.value,
                    f"{_show(label.value)} is not a valid {META_PREFIX} (it must end in '/')",
                )


def validate_apply_request(req: protocol_pb2.ApplyRequest, *, field: str = "") -> None:
    """Each change has exactly one of upsert and delete, and a usable expect_mod_revision:
    an upsert expects >= 0 (0 creates) or -1 (no check); a delete expects > 0 or -1. No journal
    is changed twice: the request is one etcd transaction, which cannot hold two operations on
    one key."""
    changed: dict[str, int] = {}  # Journal name -> index of the change naming it.
    for index, change in enumerate(req.changes):
        here = _at(field, f"changes[{index}]")
        revision = change.expect_mod_revision
        if change.HasField("upsert"):
            if change.delete:
                raise ValidationError(
                    here, change.delete, "both upsert and delete are set (expected exactly one)"
                )
            validate_journal_spec(change.upsert, field=_at(here, "upsert"))
            if revision < -1:
                raise ValidationError(
                    _at(here, "expect_mod_revision"),
                    revision,
                    f"{revision} is invalid for an upsert (expected >= 0, or -1 to skip the check)",
                )
        elif change.delete:
            # Upstream validates a deleted name as a Journal, which permits a ';meta' segment.
            validate_journal_name(change.delete, field=_at(here, "delete"), allow_meta=True)
            if revision <= 0 and revision != -1:
                raise ValidationError(
                    _at(here, "expect_mod_revision"),
                    revision,
                    f"{revision} is invalid for a delete (expected > 0, or -1 to skip the check)",
                )
        else:
            raise ValidationError(
                here, None, "neither upsert nor delete is set (expected exactly one)"
            )
        name, name_field = (
            (change.upsert.name, _at(here, "upsert.name"))
            if change.HasField("upsert")
            else (change.delete, _at(here, "delete"))
        )
        if name in changed:
            raise ValidationError(
                name_field,
                name,
                f"{_show(name)} is also changed by changes[{changed[name]}] (expected each "
                "journal at most once)",
            )
        changed[name] = index


def validate_append_request(req: protocol_pb2.AppendRequest, *, field: str = "") -> None:
    """The first message of an Append: a journal (a `;meta` suffix allowed), a non-negative
    offset, valid register selector and label sets, and a known suspend mode. Content, if
    any, is the whole append (this project's one-message form: upstream refuses content here,
    and its clients send it in the messages that follow)."""
    if req.HasField("header"):
        validate_header(req.header, field=_at(field, "header"))
    validate_journal_name(req.journal, field=_at(field, "journal"), allow_meta=True)
    if req.offset < 0:
        raise ValidationError(_at(field, "offset"), req.offset, f"{req.offset} is negative")
    if req.HasField("check_registers"):
        validate_label_selector(req.check_registers, field=_at(field, "check_registers"))
    for name in ("union_registers", "subtract_registers"):
        if req.HasField(name):
            validate_label_set(getattr(req, name), field=_at(field, name))
    if req.suspend not in protocol_pb2.AppendRequest.Suspend.values():
        raise ValidationError(
            _at(field, "suspend"), req.suspend, f"{req.suspend} is not a suspend mode"
        )


def validate_read_request(req: protocol_pb2.ReadRequest, *, field: str = "") -> None:
    """A journal (a `;meta` suffix allowed), an offset >= -1, and an end_offset that is zero
    (unbounded) or not before the offset."""
    if req.HasField("header"):
        validate_header(req.header, field=_at(field, "header"))
    validate_journal_name(req.journal, field=_at(field, "journal"), allow_meta=True)
    if req.offset < -1:
        raise ValidationError(_at(field, "offset"), req.offset, f"{req.offset} is below -1")
    if req.end_offset < 0 or (req.end_offset and req.offset >= 0 and req.end_offset < req.offset):
        raise ValidationError(
            _at(field, "end_offset"),
            req.end_offset,
            f"{req.end_offset} is before the offset {req.offset}",
        )
