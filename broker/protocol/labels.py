"""Label sets and label selectors over the generated `protocol` messages, with upstream semantics.

Sets are kept sorted on (name, value); selectors parse from and format to upstream's text grammar.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import groupby

from broker.protocol import consumer_pb2, protocol_pb2

__all__ = [
    "CONTENT_TYPE",
    "CONTENT_TYPE_CSV",
    "CONTENT_TYPE_JSON_LINES",
    "CONTENT_TYPE_PROTO_FIXED",
    "CONTENT_TYPE_RECOVERY_LOG",
    "INSTANCE",
    "MANAGED_BY",
    "MESSAGE_SUBTYPE",
    "MESSAGE_TYPE",
    "META_ID",
    "META_NAME",
    "META_PREFIX",
    "PREFIX_SUFFIX",
    "REGION",
    "SINGLE_VALUE_LABELS",
    "TAG",
    "SelectorError",
    "add_value",
    "format_selector",
    "intersect",
    "journal_meta_labels",
    "label_set",
    "matches",
    "normalize",
    "parse_selector",
    "remove",
    "rewrite_prefix_meta_label",
    "selector",
    "set_value",
    "shard_meta_labels",
    "subtract",
    "union",
    "value_of",
    "values_of",
]

# Well-known label names and values (upstream package `labels`).
CONTENT_TYPE = "content-type"
CONTENT_TYPE_CSV = "text/csv"
CONTENT_TYPE_JSON_LINES = "application/x-ndjson"
CONTENT_TYPE_PROTO_FIXED = "application/x-protobuf-fixed"
CONTENT_TYPE_RECOVERY_LOG = "application/x-gazette-recoverylog"
MESSAGE_TYPE = "app.gazette.dev/message-type"
MESSAGE_SUBTYPE = "app.gazette.dev/message-subtype"
TAG = "app.gazette.dev/tag"
MANAGED_BY = "app.gazette.dev/managed-by"
INSTANCE = "app.gazette.dev/instance"
REGION = "app.gazette.dev/region"

# Labels which a specification may give at most one value.
SINGLE_VALUE_LABELS = frozenset(
    {CONTENT_TYPE, INSTANCE, MANAGED_BY, MESSAGE_SUBTYPE, MESSAGE_TYPE, REGION}
)

# Meta-labels: selectors may name them, specifications may not carry them.
META_NAME = "name"
META_PREFIX = "prefix"
META_ID = "id"

# A label name written with this suffix (in selector text, or passed to add_value / set_value /
# label_set) denotes a prefix match of the value rather than equality.
PREFIX_SUFFIX = ":prefix"

Label = protocol_pb2.Label
LabelSet = protocol_pb2.LabelSet
LabelSelector = protocol_pb2.LabelSelector


# --- Label sets ---------------------------------------------------------------------------------


def _key(label: Label) -> tuple[str, str, bool]:
    return (label.name, label.value, label.prefix)


def _split_prefix(name: str) -> tuple[str, bool]:
    if name.endswith(PREFIX_SUFFIX):
        return name[: -len(PREFIX_SUFFIX)], True
    return name, False


def _replace(labels: LabelSet, items: Iterable[Label]) -> None:
    # Copy first: `items` may be views of `labels.labels` itself.
    fresh = [Label(name=item.name, value=item.value, prefix=item.prefix) for item in items]
    del labels.labels[:]
    labels.labels.extend(fresh)


def normalize(labels: LabelSet | Iterable[Label]) -> LabelSet:
    """Return a new LabelSet of the labels sorted on (name, value) with exact duplicates removed."""
    items = labels.labels if isinstance(labels, LabelSet) else labels
    unique = {_key(label): None for label in items}
    return LabelSet(labels=[Label(name=n, value=v, prefix=p) for n, v, p in sorted(unique)])


def label_set(*pairs: tuple[str, str]) -> LabelSet:
    """Build a normalized LabelSet from (name, value) pairs.

    A name ending in ":prefix" makes a prefix-match label, which is meaningful only in selectors.
    The result is not validated: see `validate.validate_label_set`.
    """
    return normalize(_label(name, value) for name, value in pairs)


def _label(name: str, value: str) -> Label:
    bare, prefix = _split_prefix(name)
    return Label(name=bare, value=value, prefix=prefix)


def selector(include: LabelSet | None = None, exclude: LabelSet | None = None) -> LabelSelector:
    """Build a LabelSelector, leaving empty sides unset so equal selectors compare equal."""
    return LabelSelector(
        include=LabelSet(labels=include.labels) if include is not None and include.labels else None,
        exclude=LabelSet(labels=exclude.labels) if exclude is not None and exclude.labels else None,
    )


def values_of(labels: LabelSet, name: str) -> list[str]:
    """All values of label `name`, in set order (empty if absent)."""
    return [label.value for label in labels.labels if label.name == name]


def value_of(labels: LabelSet, name: str) -> str:
    """The first value of label `name`, or "" if absent (as upstream: absent and empty look alike)."""
    for label in labels.labels:
        if label.name == name:
            return label.value
    return ""


def add_value(labels: LabelSet, name: str, value: str) -> None:
    """Add label `name`=`value` in sorted position, keeping other values of `name`; no-op if present."""
    new = _label(name, value)
    items = list(labels.labels)
    if any(_key(item) == _key(new) for item in items):
        return
    # Position by (name, value) only, as upstream does: a prefix and an exact label of equal name
    # and value may then both be present, which validation reports.
    at = next(
        (i for i, item in enumerate(items) if (item.name, item.value) >= (new.name, value)),
        len(items),
    )
    items.insert(at, new)
    _replace(labels, items)


def set_value(labels: LabelSet, name: str, value: str) -> None:
    """Make `value` the only value of label `name`."""
    bare, _ = _split_prefix(name)
    remove(labels, bare)
    add_value(labels, name, value)


def remove(labels: LabelSet, name: str) -> None:
    """Remove every value of label `name`."""
    _replace(labels, [label for label in labels.labels if label.name != name])


def _by_name(labels: Iterable[Label]) -> dict[str, list[Label]]:
    grouped: dict[str, list[Label]] = {}
    for label in labels:
        grouped.setdefault(label.name, []).append(label)
    return grouped


def _same_values(lhs: Sequence[Label], rhs: Sequence[Label]) -> bool:
    # Upstream compares values only; a prefix flag never occurs in a specification's labels.
    return [label.value for label in lhs] == [label.value for label in rhs]


def union(lhs: LabelSet, rhs: LabelSet) -> LabelSet:
    """Labels of either set; for a name present in both, only the values of `lhs` are kept."""
    left, right = _by_name(lhs.labels), _by_name(rhs.labels)
    merged = [label for name in left for label in left[name]]
    merged += [label for name in right if name not in left for label in right[name]]
    return normalize(merged)


def intersect(lhs: LabelSet, rhs: LabelSet) -> LabelSet:
    """Labels whose name has exactly the same values in both sets."""
    left, right = _by_name(lhs.labels), _by_name(rhs.labels)
    kept = [
        label
        for name, values in left.items()
        if name in right and _same_values(values, right[name])
        for label in values
    ]
    return normalize(kept)


def subtract(lhs: LabelSet, rhs: LabelSet) -> LabelSet:
    """Labels of `lhs` whose name does not have exactly the same values in `rhs`."""
    left, right = _by_name(lhs.labels), _by_name(rhs.labels)
    kept = [
        label
        for name, values in left.items()
        if name not in right or not _same_values(values, right[name])
        for label in values
    ]
    return normalize(kept)


# --- Meta-labels ---------------------------------------------------------------------------------


def journal_meta_labels(spec: protocol_pb2.JournalSpec) -> LabelSet:
    """The labels a journal is matched on: its own labels plus the meta-label `name`."""
    return union(label_set((META_NAME, spec.name)), spec.labels)


def shard_meta_labels(spec: consumer_pb2.ShardSpec) -> LabelSet:
    """The labels a shard is matched on: its own labels plus the meta-label `id`."""
    return union(label_set((META_ID, spec.id)), spec.labels)


def rewrite_prefix_meta_label(sel: LabelSelector) -> LabelSelector:
    """Rewrite each `prefix=X` of a journal selector as `name:prefix=X`.

    Journals carry no `prefix` label: upstream implements the historical `prefix` meta-label
    this way, as a prefix match on the journal name, before matching.
    """
    sides: list[LabelSet] = []
    for side in (sel.include, sel.exclude):
        out = LabelSet(labels=side.labels)
        for value in values_of(side, META_PREFIX):
            add_value(out, META_NAME + PREFIX_SUFFIX, value)
        remove(out, META_PREFIX)
        sides.append(out)
    return selector(*sides)


# --- Matching ------------------------------------------------------------------------------------


def _value_matches(want: Label, have: str) -> bool:
    if want.value == "":
        return True  # An empty selector value asks only that the label exist.
    if want.prefix:
        return have.startswith(want.value)
    return have == want.value


def matches(sel: LabelSelector, labels: LabelSet) -> bool:
    """Whether `labels` satisfies `sel`.

    Every name of `sel.include` must be present with a value matched by at least one of the
    selector's values for that name; no label may be matched by any entry of `sel.exclude`.
    """
    have: dict[str, list[str]] = {}
    for label in labels.labels:
        have.setdefault(label.name, []).append(label.value)

    for name, wants in _by_name(sel.exclude.labels).items():
        if any(_value_matches(w, v) for w in wants for v in have.get(name, ())):
            return False
    for name, wants in _by_name(sel.include.labels).items():
        if not any(_value_matches(w, v) for w in wants for v in have.get(name, ())):
            return False
    return True


class JournalMatcher:
    """A selector compiled once for matching many journals, as List does: it consults the
    `name` meta-label directly instead of building each journal's meta-label set."""

    def __init__(self, sel: LabelSelector) -> None:
        self.everything = not sel.include.labels and not sel.exclude.labels
        self.include = _by_name(sel.include.labels)
        self.exclude = _by_name(sel.exclude.labels)

    def matches(self, spec: protocol_pb2.JournalSpec) -> bool:
        if self.everything:
            return True
        have: dict[str, list[str]] = {META_NAME: [spec.name]}
        for label in spec.labels.labels:
            if label.name != META_NAME:  # The meta-label wins, as in journal_meta_labels().
                have.setdefault(label.name, []).append(label.value)
        for name, wants in self.exclude.items():
            if any(_value_matches(w, v) for w in wants for v in have.get(name, ())):
                return False
        for name, wants in self.include.items():
            if not any(_value_matches(w, v) for w in wants for v in have.get(name, ())):
                return False
        return True


# --- Selector text -------------------------------------------------------------------------------


class SelectorError(ValueError):
    """A label selector could not be parsed, or parsed to an invalid selector."""

    def __init__(self, text: str, position: int, problem: str) -> None:
        super().__init__(text, position, problem)
        self.text = text
        self.position = position
        self.problem = problem

    def __str__(self) -> str:
        return f"label selector {_quote(self.text)}, position {self.position}: {self.problem}"


def _quote(text: str) -> str:
    # Deferred, as _check_parsed's import.
    from broker.protocol.validate import quote

    return quote(text)


# The grammar mirrors upstream's regular expressions exactly, including its tolerance of at most
# one space around each token. In `re`, \w is exactly Unicode letters, numbers and '_', which is
# upstream's \pL\pN plus a symbol it allows anyway. `\Z` (not `$`) so a trailing newline is text.
_TOKEN = r" ?([\w\-+/.]{2,}(?::prefix)?)"
_VALUE = r" ?([\w\-+/.=%]*)"
_END = r" ?(?:,|\Z)"
_SET = r" ?\(([^)]+)\)"

_EQUAL = re.compile(_TOKEN + r" ?=?=" + _VALUE + _END)
_NOT_EQUAL = re.compile(_TOKEN + r" ?!=" + _VALUE + _END)
_IN = re.compile(_TOKEN + r" in" + _SET + _END)
_NOT_IN = re.compile(_TOKEN + r" not ?in" + _SET + _END)
_EXISTS = re.compile(_TOKEN + _END)
_NOT_EXISTS = re.compile(r" ?!" + _TOKEN + _END)
_SET_VALUE = re.compile(_VALUE + _END)


def parse_selector(text: str) -> LabelSelector:
    """Parse selector text such as `app=web, tier in (a,b), !deprecated, name:prefix=logs/`.

    Terms are comma-separated: `foo=bar` (or `==`), `foo!=bar`, `foo` (exists), `!foo` (absent),
    `foo in (a,b)`, `foo notin (a,b)` (or `not in`). A name suffixed `:prefix` matches values
    by prefix. Raises SelectorError for text that does not parse, or parses to an invalid selector.
    """
    include: list[Label] = []
    exclude: list[Label] = []
    origin: dict[tuple[bool, str, str, bool], int] = {}  # Where each label was first written.

    def add(into_exclude: bool, name: str, value: str, at: int) -> None:
        label = _label(name, value)
        (exclude if into_exclude else include).append(label)
        origin.setdefault((into_exclude, *_key(label)), at)

    pos = 0
    while pos < len(text):
        rest = text[pos:]
        if m := _EQUAL.match(rest):
            add(False, m[1], m[2], pos)
        elif m := _NOT_EQUAL.match(rest):
            add(True, m[1], m[2], pos)
        elif (m := _IN.match(rest)) or (m := _NOT_IN.match(rest)):
            is_exclude = m.re is _NOT_IN
            for value in _parse_set(text, pos + m.start(2), m[2], rest):
                add(is_exclude, m[1], value, pos)
        elif m := _EXISTS.match(rest):
            add(False, m[1], "", pos)
        elif m := _NOT_EXISTS.match(rest):
            add(True, m[1], "", pos)
        else:
            raise SelectorError(
                text, pos, f"could not match {_quote(rest)} to a label selector expression"
            )
        pos += m.end()

    out = selector(normalize(include), normalize(exclude))
    _check_parsed(text, out, origin)
    return out


def _parse_set(text: str, base: int, inner: str, term: str) -> Iterator[str]:
    at = 0
    while at < len(inner):
        m = _SET_VALUE.match(inner, at)
        if m is None:
            raise SelectorError(
                text,
                base + at,
                f"could not match {_quote(inner[at:])} to a set value (in {_quote(term)})",
            )
        yield m[1]
        at = m.end()


def _check_parsed(
    text: str, sel: LabelSelector, origin: dict[tuple[bool, str, str, bool], int]
) -> None:
    # Deferred: the validators import this module's well-known label names.
    from broker.protocol.validate import ValidationError, validate_label_selector

    try:
        validate_label_selector(sel, field="")
    except ValidationError as err:
        found = re.match(r"(include|exclude)\[(\d+)\]", err.field)
        position = 0
        if found is not None:
            side = sel.exclude if found[1] == "exclude" else sel.include
            bad = side.labels[int(found[2])]
            position = origin.get((found[1] == "exclude", bad.name, bad.value, bad.prefix), 0)
        raise SelectorError(text, position, str(err)) from err


def _display_name(label: Label) -> str:
    return label.name + PREFIX_SUFFIX if label.prefix else label.name


def _format_side(labels: Iterable[Label], exclude: bool) -> list[str]:
    terms: list[str] = []
    ordered = sorted(labels, key=lambda label: (_display_name(label), label.value))
    for name, group in groupby(ordered, key=_display_name):
        values = [label.value for label in group]
        if len(values) == 1 and values[0] == "":
            terms.append(("!" if exclude else "") + name)
        elif len(values) == 1 and (exclude or not values[0].startswith("=")):
            terms.append(name + ("!=" if exclude else "=") + values[0])
        else:
            # Also for one included value starting with '=': upstream prints `name==value`, which
            # parses back as `name` = `value`, losing that '='.
            keyword = " notin (" if exclude else " in ("
            terms.append(name + keyword + ",".join(values) + ")")
    return terms


def format_selector(sel: LabelSelector) -> str:
    """The canonical text of `sel` (upstream's LabelSelector.String), which parse_selector reads back.

    Names are sorted, a name with several values prints as `name in (a,b)` / `name notin (a,b)`,
    and included terms precede excluded ones.
    """
    return ",".join(
        _format_side(sel.include.labels, False) + _format_side(sel.exclude.labels, True)
    )
