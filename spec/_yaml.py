"""Strict, line-numbered reading and upstream-styled writing of spec YAML documents.

Readers take PyYAML composer nodes so every error can name its line; the dumper quotes and lays out
scalars the way upstream's Go YAML library does.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Final, cast

import yaml
from yaml.constructor import SafeConstructor

from broker.protocol import validate
from spec.durations import DurationError, parse_go_duration

__all__ = [
    "Entries",
    "SpecError",
    "boolean",
    "compose",
    "dump",
    "duration",
    "enumeration",
    "integer",
    "is_null",
    "line_of",
    "mapping",
    "mapping_entries",
    "quote",
    "reject_unknown",
    "sequence",
    "show",
    "string",
]

INT32: Final = (-(1 << 31), (1 << 31) - 1)
UINT32: Final = (0, (1 << 32) - 1)
INT64: Final = (-(1 << 63), (1 << 63) - 1)

_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SCALARS: Final = SafeConstructor()
_NULL: Final = "tag:yaml.org,2002:null"
_INT: Final = "tag:yaml.org,2002:int"
_BOOL: Final = "tag:yaml.org,2002:bool"
_STR: Final = "tag:yaml.org,2002:str"
_NO_WRAP: Final = 1 << 30

Entries = dict[str, tuple[yaml.Node, yaml.Node]]
"""A mapping's entries by key: (key node, value node), keeping both for their line numbers."""


class SpecError(ValueError):
    """A spec document that can't be used; ``line`` is 1-based, or 0 when there is no source."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


def compose(text: str) -> yaml.Node:
    """The single YAML document in ``text`` as composer nodes; syntax errors become SpecError."""
    try:
        document = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise SpecError(mark.line + 1 if mark else 1, f"invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        position = getattr(exc, "position", 0)
        # A ReaderError's text adds a second line with the stream's name and position.
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(text.count("\n", 0, position) + 1, f"invalid YAML: {problem}") from None
    if document is None:
        raise SpecError(1, "the document is empty")
    return document


def dump(document: object) -> str:
    """``document`` (dicts in key order, lists, scalars) as block YAML in upstream's style."""
    return yaml.dump(
        document,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=_NO_WRAP,
    )


def mapping(node: yaml.Node, key: str, where: str) -> Entries:
    """The entries of the mapping under ``key``; nothing (null) reads as an empty mapping."""
    if is_null(node):
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(
            line_of(node), f"{quote(key)} must be a mapping (got {show(node)}) in {where}"
        )
    return mapping_entries(node, where)


def mapping_entries(node: yaml.MappingNode, where: str) -> Entries:
    """Entries by key, refusing non-scalar and duplicate keys (as yaml.v2's strict mode does)."""
    entries: Entries = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise SpecError(
                line_of(key_node), f"expected a plain key (got {show(key_node)}) in {where}"
            )
        key = key_node.value
        if key in entries:
            first = line_of(entries[key][0])
            raise SpecError(
                line_of(key_node), f"duplicate key {quote(key)} (first on line {first}) in {where}"
            )
        entries[key] = (key_node, value_node)
    return entries


def reject_unknown(entries: Entries, allowed: Sequence[str], under: str, where: str) -> None:
    """Fail on the first key not in ``allowed``, suggesting the nearest allowed one."""
    for key, (key_node, _) in entries.items():
        if key in allowed:
            continue
        location = f" under {under}" if under else ""
        hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        suggestion = f"; did you mean {quote(hint[0])}?" if hint else ""
        raise SpecError(
            line_of(key_node), f"unknown key {quote(key)}{location} in {where}{suggestion}"
        )


def sequence(node: yaml.Node, key: str, where: str) -> list[yaml.Node]:
    """The items of the list under ``key``; nothing (null) reads as an empty list."""
    if is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        raise SpecError(line_of(node), f"{quote(key)} must be a list (got {show(node)}) in {where}")
    items: list[yaml.Node] = node.value
    return items


def string(node: yaml.Node, key: str, where: str, *, allow_null: bool = True) -> str:
    """A scalar's text; nothing (null) reads as "" unless ``allow_null`` is False."""
    # As upstream (yaml.v2), any scalar reads as its literal text: `value: 010` stays "010".
    if allow_null and is_null(node):
        return ""
    if not isinstance(node, yaml.ScalarNode) or is_null(node):
        raise SpecError(
            line_of(node), f"{quote(key)} must be a string (got {show(node)}) in {where}"
        )
    text: str = node.value
    return text


def integer(node: yaml.Node, key: str, bounds: tuple[int, int], where: str) -> int:
    """A YAML integer within ``bounds`` (quoted numbers and floats are refused); null is 0."""
    if is_null(node):
        return 0
    if not isinstance(node, yaml.ScalarNode) or node.tag != _INT:
        raise SpecError(
            line_of(node), f"{quote(key)} must be an integer (got {show(node)}) in {where}"
        )
    value = _SCALARS.construct_yaml_int(node)
    low, high = bounds
    if not low <= value <= high:
        raise SpecError(
            line_of(node),
            f"{quote(key)} is out of range (got {value}; allowed {low} to {high}) in {where}",
        )
    return value


def boolean(node: yaml.Node, key: str, where: str) -> bool:
    """A YAML boolean."""
    if not isinstance(node, yaml.ScalarNode) or node.tag != _BOOL:
        raise SpecError(
            line_of(node), f"{quote(key)} must be true or false (got {show(node)}) in {where}"
        )
    return _SCALARS.construct_yaml_bool(node)


def duration(node: yaml.Node, key: str, where: str) -> int:
    """Go duration text as nanoseconds; null is 0."""
    if is_null(node):
        return 0
    if not isinstance(node, yaml.ScalarNode):
        raise SpecError(
            line_of(node),
            f"{quote(key)} must be a duration like 1m30s (got {show(node)}) in {where}",
        )
    # A bare number is refused rather than read as nanoseconds, which is what upstream's YAML
    # library silently does with `refresh_interval: 60`.
    try:
        return parse_go_duration(node.value)
    except DurationError as exc:
        raise SpecError(line_of(node), f"bad {quote(key)} in {where}: {exc}") from None


def enumeration(
    node: yaml.Node,
    key: str,
    names: Mapping[str, int],
    int_bounds: tuple[int, int] | None,
    where: str,
) -> int:
    """An enum value by name, or (when ``int_bounds`` is given) by number; null is 0."""
    if is_null(node):
        return 0
    if isinstance(node, yaml.ScalarNode):
        if node.tag == _INT and int_bounds is not None:
            return integer(node, key, int_bounds, where)
        if node.value in names:
            return names[node.value]
    options = ", ".join(names) + (", or an integer" if int_bounds is not None else "")
    raise SpecError(
        line_of(node), f"{quote(key)} must be one of {options} (got {show(node)}) in {where}"
    )


def is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL


def line_of(node: yaml.Node) -> int:
    """1-based line where ``node`` starts (0 if unknown)."""
    mark = node.start_mark
    return mark.line + 1 if mark is not None else 0


def show(node: yaml.Node) -> str:
    """``node`` briefly, for an error message."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if is_null(node):
        return "nothing"
    text: str = node.value
    return quote(text if len(text) <= 60 else text[:57] + "...")


def quote(text: str) -> str:
    """Double-quoted like Go's %q, so names in messages read the same as upstream's."""
    return validate.quote(text)


_DUMPER_BASE: Final[type[yaml.SafeDumper]] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Dumper(_DUMPER_BASE):  # type: ignore[misc,valid-type]
    """PyYAML's layout already matches upstream's; only string quoting needs adjusting."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style: str | None = None
    if "\n" in text:
        style = "|"
    elif _misreads_as_non_string(dumper, text):
        # Upstream double-quotes strings that would otherwise read back as another type (`""`,
        # `"123"`, `"true"`); PyYAML would pick single quotes.
        style = '"'
    return dumper.represent_scalar(_STR, text, style=style)


def _misreads_as_non_string(dumper: yaml.SafeDumper, text: str) -> bool:
    # yaml.v2 also reads y/Y/n/N as booleans, so quote them for upstream's sake.
    if not text or text in ("y", "Y", "n", "N"):
        return True
    resolve = cast("Callable[..., str]", dumper.resolve)
    return resolve(yaml.ScalarNode, text, (True, False)) != _STR


_Dumper.add_representer(str, _represent_str)
