"""The hierarchical journal YAML of ``gazctl journals apply/list/edit`` (upstream ``journalspace``).

Directories (names ending in ``/``) carry partial specs that their children inherit; ``flatten``
turns a tree into concrete journals and ``hoist`` turns journals back into a compact tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, cast

import yaml
from google.protobuf import text_format

from broker.protocol import protocol_pb2 as pb
from spec import _yaml
from spec._yaml import SpecError
from spec.durations import duration_from_nanos, format_go_duration, nanos_from_duration

__all__ = [
    "JournalEntry",
    "JournalNode",
    "SpecError",
    "decode_journals",
    "decode_tree",
    "encode_journals",
    "encode_tree",
    "flatten",
    "hoist",
]


@dataclass(frozen=True, repr=False)
class JournalNode:
    """One node of a journal tree: a directory (name ends in ``/``, or is empty) or a journal.

    ``spec`` is partial: zero-valued fields are inherited from the nearest ancestor that sets them.
    ``delete`` is tri-state as upstream: None inherits, True/False override. ``empty_stores`` records
    an explicit ``stores: []``, which (as upstream) stops the parent's stores being inherited.
    ``line`` is where the node's name appears in decoded YAML (0 if built in code).
    The spec is copied and normalized on construction; treat it as read-only afterwards.
    """

    spec: pb.JournalSpec
    children: tuple[JournalNode, ...] = ()
    revision: int = 0
    delete: bool | None = None
    comment: str = ""
    empty_stores: bool = False
    line: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _normalized(self.spec))
        object.__setattr__(self, "children", tuple(self.children))
        _check_node(self)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_dir(self) -> bool:
        return _is_dir(self.spec.name)

    def __hash__(self) -> int:
        return hash(
            (
                _spec_key(self.spec),
                self.children,
                self.revision,
                self.delete,
                self.comment,
                self.empty_stores,
            )
        )

    def __repr__(self) -> str:
        extras = f", {len(self.children)} children" if self.children else ""
        if self.revision:
            extras += f", revision={self.revision}"
        if self.delete is not None:
            extras += f", delete={self.delete}"
        return f"JournalNode({_spec_text(self.spec)}{extras})"


@dataclass(frozen=True, repr=False)
class JournalEntry:
    """One concrete journal change, as a flattened tree yields it (and ``hoist`` consumes it).

    ``revision`` is the expected Etcd mod revision: 0 creates, -1 skips the check. The spec is copied
    and normalized on construction; treat it as read-only afterwards.
    """

    spec: pb.JournalSpec
    revision: int = 0
    delete: bool = False
    comment: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _normalized(self.spec))
        if _is_dir(self.spec.name):
            raise ValueError(
                f"journal name {_yaml.quote(self.spec.name)} must be non-empty and not end in '/'"
            )

    @property
    def name(self) -> str:
        return self.spec.name

    def __hash__(self) -> int:
        return hash((_spec_key(self.spec), self.revision, self.delete, self.comment))

    def __repr__(self) -> str:
        extras = f", revision={self.revision}" if self.revision else ""
        extras += ", delete=True" if self.delete else ""
        extras += f", comment={self.comment!r}" if self.comment else ""
        return f"JournalEntry({_spec_text(self.spec)}{extras})"


def decode_tree(text: str) -> JournalNode:
    """Decode journal tree YAML strictly: unknown keys, wrong types and bad values are errors."""
    return _decode_node(_yaml.compose(text), parent=None)


def encode_tree(tree: JournalNode) -> str:
    """Encode a journal tree as YAML in upstream gazctl's layout, key order and value formats."""
    return _yaml.dump(_node_document(tree))


def flatten(tree: JournalNode) -> list[JournalEntry]:
    """The journals of a tree, in tree order, each with everything it inherits made explicit."""
    entries: list[JournalEntry] = []
    _flatten_into(tree, _Inherited(pb.JournalSpec(), None, None), entries)
    return entries


def hoist(entries: Iterable[JournalEntry]) -> JournalNode:
    """Build the tree ``gazctl journals list`` prints: directories at shared name prefixes, holding
    every field their children all share.

    As upstream, a directory appears only where names actually fork (``a/b/c/x`` and ``a/b/c/y``
    give one directory ``a/b/c/``, not ``a/``, ``a/b/`` and ``a/b/c/``), and a single journal is its
    own root. ``suspend`` is never hoisted: it belongs to each journal.
    """
    drafts = sorted((_Draft.of(entry) for entry in entries), key=lambda d: d.spec.name)
    if not drafts:
        raise ValueError("no journals to build a tree from")
    for before, after in itertools.pairwise(drafts):
        if before.spec.name == after.spec.name:
            raise ValueError(f"journal {_yaml.quote(after.spec.name)} is listed more than once")
    root = _group(drafts)
    root.hoist()
    return root.freeze()


def decode_journals(text: str) -> list[JournalEntry]:
    """``flatten(decode_tree(text))``: the journal changes a YAML document describes."""
    return flatten(decode_tree(text))


def encode_journals(entries: Iterable[JournalEntry]) -> str:
    """``encode_tree(hoist(entries))``: journals as the hoisted YAML ``journals list`` prints."""
    return encode_tree(hoist(entries))


# --- Field algebra: upstream's Union / Intersect / Subtract of JournalSpecs. ---------------------

_DURATIONS: Final = ("refresh_interval", "retention", "flush_interval")


class _Field(NamedTuple):
    """A JournalSpec field that inherits and hoists as one value, zero meaning unset."""

    key: str
    in_fragment: bool

    def get(self, spec: pb.JournalSpec) -> int | str:
        owner = spec.fragment if self.in_fragment else spec
        if self.key in _DURATIONS:
            return nanos_from_duration(getattr(owner, self.key))
        value: int | str = getattr(owner, self.key)
        return value

    def put(self, spec: pb.JournalSpec, value: int | str) -> None:
        owner = spec.fragment if self.in_fragment else spec
        if self.key not in _DURATIONS:
            setattr(owner, self.key, value)
        elif value:
            assert isinstance(value, int)
            getattr(owner, self.key).CopyFrom(duration_from_nanos(value))
        else:
            owner.ClearField(self.key)

    def clear(self, spec: pb.JournalSpec) -> None:
        self.put(spec, "" if self.key == "path_postfix_template" else 0)


# Labels and stores are merged separately (per label name, and as a whole list); suspend is
# deliberately absent because upstream neither inherits nor hoists it.
_FIELDS: Final = (
    _Field("replication", False),
    _Field("length", True),
    _Field("compression_codec", True),
    _Field("refresh_interval", True),
    _Field("retention", True),
    _Field("flush_interval", True),
    _Field("path_postfix_template", True),
    _Field("flags", False),
    _Field("max_append_rate", False),
)


def _union(child: pb.JournalSpec, parent: pb.JournalSpec) -> pb.JournalSpec:
    """``child`` with each unset field taken from ``parent`` (stores and suspend excepted)."""
    out = _copy(child)
    for spec_field in _FIELDS:
        if not spec_field.get(out):
            spec_field.put(out, spec_field.get(parent))
    # Per label name, a child that sets any value replaces all of the parent's values.
    merged = _label_groups(parent.labels.labels) | _label_groups(child.labels.labels)
    _set_labels(out, [label for group in merged.values() for label in group])
    return out


def _intersect(a: pb.JournalSpec, b: pb.JournalSpec) -> pb.JournalSpec:
    """The fields (and whole label groups) on which ``a`` and ``b`` agree."""
    out = _copy(a)
    for spec_field in _FIELDS:
        if spec_field.get(a) != spec_field.get(b):
            spec_field.clear(out)
    groups_b = _label_groups(b.labels.labels)
    _set_labels(
        out,
        [
            label
            for name, group in _label_groups(a.labels.labels).items()
            if _values(group) == _values(groups_b.get(name, ()))
            for label in group
        ],
    )
    if list(a.fragment.stores) != list(b.fragment.stores):
        del out.fragment.stores[:]
    out.ClearField("suspend")
    return out


def _subtract(a: pb.JournalSpec, b: pb.JournalSpec) -> pb.JournalSpec:
    """``a`` without the fields (and whole label groups) that ``b`` already provides."""
    out = _copy(a)
    for spec_field in _FIELDS:
        if spec_field.get(a) == spec_field.get(b):
            spec_field.clear(out)
    groups_b = _label_groups(b.labels.labels)
    _set_labels(
        out,
        [
            label
            for name, group in _label_groups(a.labels.labels).items()
            if _values(group) != _values(groups_b.get(name, ()))
            for label in group
        ],
    )
    if list(a.fragment.stores) == list(b.fragment.stores):
        del out.fragment.stores[:]
    return out


def _label_groups(labels: Iterable[pb.Label]) -> dict[str, list[pb.Label]]:
    groups: dict[str, list[pb.Label]] = {}
    for label in labels:
        groups.setdefault(label.name, []).append(label)
    return groups


def _values(group: Sequence[pb.Label]) -> list[str]:
    return [label.value for label in group]


def _set_labels(spec: pb.JournalSpec, labels: Iterable[pb.Label]) -> None:
    ordered = [_copy_label(label) for label in sorted(labels, key=_label_order)]
    del spec.labels.labels[:]
    spec.labels.labels.extend(ordered)


def _label_order(label: pb.Label) -> tuple[str, str]:
    return (label.name, label.value)


def _copy_label(label: pb.Label) -> pb.Label:
    return pb.Label(name=label.name, value=label.value, prefix=label.prefix)


def _copy(spec: pb.JournalSpec) -> pb.JournalSpec:
    out = pb.JournalSpec()
    out.CopyFrom(spec)
    return out


def _normalized(spec: pb.JournalSpec) -> pb.JournalSpec:
    """A copy in one canonical form, so equal specs compare and hash equal.

    Upstream holds fragment and durations by value, so "present but zero" is no distinct state
    there, and an all-zero suspend means the same as none. Labels are sorted because upstream's
    merges assume (name, value) order.
    """
    if not isinstance(spec, pb.JournalSpec):
        raise TypeError(f"expected a protocol.JournalSpec, not {type(spec).__name__}")
    out = _copy(spec)
    _set_labels(out, out.labels.labels)
    if not out.labels.labels:
        out.ClearField("labels")
    for key in _DURATIONS:
        if out.fragment.HasField(key) and not nanos_from_duration(getattr(out.fragment, key)):
            out.fragment.ClearField(key)
    if out.HasField("fragment") and not out.fragment.ListFields():
        out.ClearField("fragment")
    if out.HasField("suspend") and not out.suspend.ListFields():
        out.ClearField("suspend")
    return out


def _spec_key(spec: pb.JournalSpec) -> bytes:
    return spec.SerializeToString(deterministic=True)


def _spec_text(spec: pb.JournalSpec) -> str:
    return text_format.MessageToString(spec, as_one_line=True)


def _is_dir(name: str) -> bool:
    return not name or name.endswith("/")


# --- Structure rules (upstream Node.Validate), shared by decoding and construction. -------------


def _where(name: str) -> str:
    if not name:
        return "the root directory"
    return f"{'directory' if _is_dir(name) else 'journal'} {_yaml.quote(name)}"


def _check_node(node: JournalNode) -> None:
    where = _where(node.name)
    if node.empty_stores and node.spec.fragment.stores:
        raise SpecError(node.line, f"empty_stores is set but stores are given in {where}")
    if not node.is_dir:
        if node.children:
            raise SpecError(node.line, _LEAF_CHILDREN.format(where=where))
        return
    if node.revision:
        raise SpecError(node.line, _DIR_REVISION.format(where=where))
    if node.spec.HasField("suspend"):
        raise SpecError(node.line, _DIR_SUSPEND.format(where=where))
    if not node.children:
        raise SpecError(node.line, _DIR_CHILDLESS.format(where=where))
    _check_children(node.name, node.children)


def _check_children(parent: str, children: Sequence[JournalNode]) -> None:
    for index, child in enumerate(children):
        if not child.name.startswith(parent) or child.name == parent:
            raise SpecError(
                child.line,
                f"{_where(child.name)} is listed under {_where(parent)}, "
                f"so its name must start with {_yaml.quote(parent)} and extend it",
            )
        if index and children[index - 1].name >= child.name:
            previous = children[index - 1]
            problem = "is listed twice" if previous.name == child.name else "is out of order"
            raise SpecError(
                child.line,
                f"{_where(child.name)} {problem} in {_where(parent)}: "
                f"children must be sorted by name, and {_yaml.quote(previous.name)} comes first",
            )


_LEAF_CHILDREN: Final = (
    "children are only allowed on directories, and {where} is not one "
    '(a directory\'s name ends in "/")'
)
_DIR_REVISION: Final = '"revision" is only allowed on journals, not on {where}'
_DIR_SUSPEND: Final = '"suspend" is only allowed on journals, not on {where}'
_DIR_CHILDLESS: Final = (
    '{where} needs children (a name ending in "/" is a directory; drop the "/" for a journal)'
)


# --- Flatten and hoist. --------------------------------------------------------------------------


class _Inherited(NamedTuple):
    spec: pb.JournalSpec
    stores: tuple[str, ...] | None  # None: no ancestor set stores; (): an explicit `stores: []`.
    delete: bool | None


def _flatten_into(node: JournalNode, inherited: _Inherited, out: list[JournalEntry]) -> None:
    spec = _union(node.spec, inherited.spec)
    own_stores = tuple(node.spec.fragment.stores) or (() if node.empty_stores else None)
    stores = own_stores if own_stores is not None else inherited.stores
    delete = node.delete if node.delete is not None else inherited.delete
    if not node.is_dir:
        del spec.fragment.stores[:]
        spec.fragment.stores.extend(stores or ())
        out.append(JournalEntry(spec, node.revision, bool(delete), node.comment))
        return
    for child in node.children:
        _flatten_into(child, _Inherited(spec, stores, delete), out)


@dataclass
class _Draft:
    """A mutable tree node while ``hoist`` builds and then compacts the tree."""

    spec: pb.JournalSpec
    delete: bool | None = None
    revision: int = 0
    comment: str = ""
    children: list[_Draft] = field(default_factory=list)

    @classmethod
    def of(cls, entry: JournalEntry) -> _Draft:
        # A listing's `delete: false` is the default, so it stays implicit rather than hoisting.
        return cls(_copy(entry.spec), True if entry.delete else None, entry.revision, entry.comment)

    def hoist(self) -> None:
        if not self.children:
            return
        for child in self.children:
            child.hoist()
        common = _copy(self.children[0].spec)
        delete = self.children[0].delete
        for child in self.children[1:]:
            common = _intersect(common, child.spec)
            if child.delete != delete:
                delete = None
        common.name = self.spec.name
        self.spec, self.delete = common, delete
        for child in self.children:
            child.spec = _subtract(child.spec, common)
            if delete is not None:
                child.delete = None

    def freeze(self) -> JournalNode:
        return JournalNode(
            self.spec,
            tuple(child.freeze() for child in self.children),
            self.revision,
            self.delete,
            self.comment,
        )


def _group(drafts: list[_Draft]) -> _Draft:
    """Nest name-sorted journals under directories at each prefix where their names fork."""
    if len(drafts) == 1:
        return drafts[0]
    prefix = _directory_prefix(drafts[0].spec.name, drafts[-1].spec.name)
    children: list[_Draft] = []
    run: list[_Draft] = []
    run_key: str | None = None
    for draft in drafts:
        rest = draft.spec.name[len(prefix) :]
        slash = rest.find("/")
        key = rest[: slash + 1] if slash >= 0 else None
        if run and (key is None or key != run_key):
            children.append(_group(run))
            run = []
        run.append(draft)
        run_key = key
    children.append(_group(run))
    return _Draft(pb.JournalSpec(name=prefix), children=children)


def _directory_prefix(first: str, last: str) -> str:
    """The longest common prefix of a sorted run of names, cut back to a whole ``/`` component."""
    common = 0
    while common < min(len(first), len(last)) and first[common] == last[common]:
        common += 1
    return first[: first.rfind("/", 0, common) + 1]


# --- Decoding. -----------------------------------------------------------------------------------


_NODE_KEYS: Final = (
    "comment",
    "delete",
    "name",
    "replication",
    "labels",
    "fragment",
    "flags",
    "max_append_rate",
    "suspend",
    "revision",
    "children",
)
_FRAGMENT_KEYS: Final = (
    "length",
    "compression_codec",
    "stores",
    "refresh_interval",
    "retention",
    "flush_interval",
    "path_postfix_template",
)
_LABEL_KEYS: Final = ("name", "value", "prefix")
_SUSPEND_KEYS: Final = ("level", "offset")


_CODECS: Final[Mapping[str, int]] = dict(pb.CompressionCodec.items())
_FLAGS: Final[Mapping[str, int]] = dict(pb.JournalSpec.Flag.items())
_LEVELS: Final[Mapping[str, int]] = dict(pb.JournalSpec.Suspend.Level.items())


def _decode_node(node: yaml.Node, parent: str | None) -> JournalNode:
    context = "the journal tree" if parent is None else f"a child of {_where(parent)}"
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(
            _yaml.line_of(node),
            f"expected a journal or directory mapping (got {_yaml.show(node)}) in {context}",
        )
    name_value = next(
        (v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "name"), None
    )
    name = _yaml.string(name_value, "name", context) if name_value is not None else ""
    line = _yaml.line_of(name_value) if name_value is not None else _yaml.line_of(node)
    if parent is not None and not name:
        raise SpecError(line, f'child has no "name" in {_where(parent)}')
    where = _where(name)
    entries = _yaml.mapping_entries(node, where)
    _yaml.reject_unknown(entries, _NODE_KEYS, "", where)

    spec = pb.JournalSpec(name=name)
    empty_stores = False
    if "replication" in entries:
        spec.replication = _yaml.integer(
            entries["replication"][1], "replication", _yaml.INT32, where
        )
    if "labels" in entries:
        spec.labels.labels.extend(_decode_labels(entries["labels"][1], where))
    if "fragment" in entries:
        empty_stores = _decode_fragment(entries["fragment"][1], spec.fragment, where)
    if "flags" in entries:
        spec.flags = _yaml.enumeration(entries["flags"][1], "flags", _FLAGS, _yaml.UINT32, where)
    if "max_append_rate" in entries:
        value = entries["max_append_rate"][1]
        spec.max_append_rate = _yaml.integer(value, "max_append_rate", _yaml.INT64, where)
    if "suspend" in entries:
        _decode_suspend(entries["suspend"][1], spec.suspend, where)

    revision = 0
    if "revision" in entries:
        revision = _yaml.integer(entries["revision"][1], "revision", _yaml.INT64, where)
    delete: bool | None = None
    if "delete" in entries and not _yaml.is_null(entries["delete"][1]):
        delete = _yaml.boolean(entries["delete"][1], "delete", where)
    comment = _yaml.string(entries["comment"][1], "comment", where) if "comment" in entries else ""
    child_nodes = (
        _yaml.sequence(entries["children"][1], "children", where) if "children" in entries else []
    )

    # The same rules JournalNode enforces, checked here first to point at the offending key.
    if _is_dir(name):
        if revision:
            raise SpecError(
                _yaml.line_of(entries["revision"][0]), _DIR_REVISION.format(where=where)
            )
        if spec.suspend.ListFields():
            raise SpecError(_yaml.line_of(entries["suspend"][0]), _DIR_SUSPEND.format(where=where))
        if not child_nodes:
            raise SpecError(line, _DIR_CHILDLESS.format(where=where))
    elif child_nodes:
        raise SpecError(_yaml.line_of(entries["children"][0]), _LEAF_CHILDREN.format(where=where))

    children = tuple(_decode_node(child, parent=name) for child in child_nodes)
    _check_children(name, children)
    return JournalNode(spec, children, revision, delete, comment, empty_stores, line)


def _decode_labels(node: yaml.Node, where: str) -> list[pb.Label]:
    labels = []
    for item in _yaml.sequence(node, "labels", where):
        if not isinstance(item, yaml.MappingNode):
            raise SpecError(
                _yaml.line_of(item),
                f'each of "labels" must be a mapping with name and value (got {_yaml.show(item)}) '
                f"in {where}",
            )
        entries = _yaml.mapping_entries(item, where)
        _yaml.reject_unknown(entries, _LABEL_KEYS, "a label", where)
        label = pb.Label()
        if "name" in entries:
            label.name = _yaml.string(entries["name"][1], "name", where)
        if "value" in entries:
            label.value = _yaml.string(entries["value"][1], "value", where)
        if "prefix" in entries:
            label.prefix = _yaml.boolean(entries["prefix"][1], "prefix", where)
        labels.append(label)
    return labels


def _decode_fragment(node: yaml.Node, fragment: pb.JournalSpec.Fragment, where: str) -> bool:
    """Fill ``fragment``; returns whether ``stores`` was given as an explicit empty list."""
    entries = _yaml.mapping(node, "fragment", where)
    _yaml.reject_unknown(entries, _FRAGMENT_KEYS, '"fragment"', where)
    empty_stores = False
    if "length" in entries:
        fragment.length = _yaml.integer(entries["length"][1], "length", _yaml.INT64, where)
    if "compression_codec" in entries:
        value = entries["compression_codec"][1]
        # Upstream reads codecs by name only, unlike flags and suspend levels.
        codec = _yaml.enumeration(value, "compression_codec", _CODECS, None, where)
        fragment.compression_codec = cast("pb.CompressionCodec", codec)
    if "stores" in entries:
        value = entries["stores"][1]
        if not _yaml.is_null(value):
            stores = [
                _yaml.string(item, "stores", where, allow_null=False)
                for item in _yaml.sequence(value, "stores", where)
            ]
            fragment.stores.extend(stores)
            empty_stores = not stores
    for key in _DURATIONS:
        if key in entries:
            nanos = _yaml.duration(entries[key][1], key, where)
            if nanos:
                getattr(fragment, key).CopyFrom(duration_from_nanos(nanos))
    if "path_postfix_template" in entries:
        value = entries["path_postfix_template"][1]
        fragment.path_postfix_template = _yaml.string(value, "path_postfix_template", where)
    return empty_stores


def _decode_suspend(node: yaml.Node, suspend: pb.JournalSpec.Suspend, where: str) -> None:
    entries = _yaml.mapping(node, "suspend", where)
    _yaml.reject_unknown(entries, _SUSPEND_KEYS, '"suspend"', where)
    if "level" in entries:
        level = _yaml.enumeration(entries["level"][1], "level", _LEVELS, _yaml.INT32, where)
        suspend.level = cast("pb.JournalSpec.Suspend.Level", level)
    if "offset" in entries:
        suspend.offset = _yaml.integer(entries["offset"][1], "offset", _yaml.INT64, where)


# --- Encoding. -----------------------------------------------------------------------------------

_CODEC_NAMES: Final[Mapping[int, str]] = {v: k for k, v in _CODECS.items()}
_FLAG_NAMES: Final[Mapping[int, str]] = {v: k for k, v in _FLAGS.items()}
_LEVEL_NAMES: Final[Mapping[int, str]] = {v: k for k, v in _LEVELS.items()}


def _node_document(node: JournalNode) -> dict[str, object]:
    # Key order follows upstream's Node struct: comment, delete, the inline spec, revision, children.
    out: dict[str, object] = {}
    if node.comment:
        out["comment"] = node.comment
    if node.delete is not None:
        out["delete"] = node.delete
    out.update(_spec_document(node.spec, node.empty_stores))
    if node.revision:
        out["revision"] = node.revision
    if node.children:
        out["children"] = [_node_document(child) for child in node.children]
    return out


def _spec_document(spec: pb.JournalSpec, empty_stores: bool) -> dict[str, object]:
    out: dict[str, object] = {}
    if spec.name:
        out["name"] = spec.name
    if spec.replication:
        out["replication"] = spec.replication
    if spec.labels.labels:
        out["labels"] = [_label_document(label) for label in spec.labels.labels]
    fragment: dict[str, object] = {}
    frag = spec.fragment
    if frag.length:
        fragment["length"] = frag.length
    if frag.compression_codec:
        fragment["compression_codec"] = _named(frag.compression_codec, _CODEC_NAMES)
    if frag.stores or empty_stores:
        fragment["stores"] = list(frag.stores)
    for key in _DURATIONS:
        nanos = nanos_from_duration(getattr(frag, key))
        if nanos:
            fragment[key] = format_go_duration(nanos)
    if frag.path_postfix_template:
        fragment["path_postfix_template"] = frag.path_postfix_template
    if fragment:
        out["fragment"] = fragment
    if spec.flags:
        out["flags"] = _named(spec.flags, _FLAG_NAMES)
    if spec.max_append_rate:
        out["max_append_rate"] = spec.max_append_rate
    if spec.HasField("suspend"):
        suspend: dict[str, object] = {}
        if spec.suspend.level:
            suspend["level"] = _named(spec.suspend.level, _LEVEL_NAMES)
        if spec.suspend.offset:
            suspend["offset"] = spec.suspend.offset
        out["suspend"] = suspend
    return out


def _label_document(label: pb.Label) -> dict[str, object]:
    # Upstream always writes both name and value (even `value: ""`), and prefix only when set.
    out: dict[str, object] = {"name": label.name, "value": label.value}
    if label.prefix:
        out["prefix"] = True
    return out


def _named(value: int, names: Mapping[int, str]) -> int | str:
    return names.get(value, value)
