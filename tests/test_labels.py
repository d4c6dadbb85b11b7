"""Label sets and selectors: upstream's parse, format and match examples, plus property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import consumer_pb2, protocol_pb2
from broker.protocol.labels import (
    SelectorError,
    add_value,
    format_selector,
    intersect,
    journal_meta_labels,
    label_set,
    matches,
    normalize,
    parse_selector,
    remove,
    rewrite_prefix_meta_label,
    selector,
    set_value,
    shard_meta_labels,
    subtract,
    union,
    value_of,
    values_of,
)
from broker.protocol.validate import quote, validate_label_selector

Triple = tuple[str, str, bool]


def triples(labels: protocol_pb2.LabelSet) -> list[Triple]:
    return [(label.name, label.value, label.prefix) for label in labels.labels]


def pairs(labels: protocol_pb2.LabelSet) -> list[tuple[str, str]]:
    return [(label.name, label.value) for label in labels.labels]


# --- Label sets -----------------------------------------------------------------------------------


def test_add_set_and_remove_keep_the_set_sorted_and_unique() -> None:
    labels = protocol_pb2.LabelSet()
    for name, value in [
        ("bb", "3"),
        ("aa", "0"),
        ("bb", "1"),
        ("aa", "2"),
        ("bb", "3"),
        ("bb", "4"),
    ]:
        add_value(labels, name, value)
    assert pairs(labels) == [("aa", "0"), ("aa", "2"), ("bb", "1"), ("bb", "3"), ("bb", "4")]

    set_value(labels, "bb:prefix", "5")
    set_value(labels, "cc", "6")
    set_value(labels, "00", "6")
    assert triples(labels) == [
        ("00", "6", False),
        ("aa", "0", False),
        ("aa", "2", False),
        ("bb", "5", True),
        ("cc", "6", False),
    ]
    set_value(labels, "aa", "8")
    remove(labels, "bb")
    remove(labels, "bb")  # Absent: no-op.
    remove(labels, "zz")
    assert pairs(labels) == [("00", "6"), ("aa", "8"), ("cc", "6")]


def test_values_of_and_value_of() -> None:
    labels = label_set(("aaa", "333"), ("aaa", "222"), ("ccc", ""), ("DDDD", "111"))
    assert values_of(labels, "aaa") == ["222", "333"]
    assert value_of(labels, "aaa") == "222"
    assert values_of(labels, "ccc") == [""]
    assert values_of(labels, "bbb") == []
    assert value_of(labels, "bbb") == ""
    assert value_of(labels, "DDDD") == "111"


def test_union_prefers_lhs_values() -> None:
    lhs = label_set(("bbb", "val-1"), ("bbb", "val-2"), ("ccc", "val-3"))
    rhs = label_set(("aaa", "val-4"), ("aaa", "val-5"), ("bbb", "val-6"), ("ddd", "val-7"))
    assert pairs(union(lhs, rhs)) == [
        ("aaa", "val-4"),
        ("aaa", "val-5"),
        ("bbb", "val-1"),
        ("bbb", "val-2"),
        ("ccc", "val-3"),
        ("ddd", "val-7"),
    ]


INTERSECT_LHS = label_set(
    ("aaa", "val"),
    ("bbb", "val-1"),
    ("ccc", "val-1"),
    ("ccc", "val-2"),
    ("ddd", "val-1"),
    ("ddd", "val-2"),
    ("eee", "val"),
    ("ggg", "val"),
)
INTERSECT_RHS = label_set(
    ("aaa", "val"),
    ("bbb", "val-2"),
    ("ccc", "val-1"),
    ("ddd", "val-1"),
    ("ddd", "val-2"),
    ("fff", "val"),
    ("ggg", "val"),
)


def test_intersect_keeps_names_with_identical_values() -> None:
    assert pairs(intersect(INTERSECT_LHS, INTERSECT_RHS)) == [
        ("aaa", "val"),
        ("ddd", "val-1"),
        ("ddd", "val-2"),
        ("ggg", "val"),
    ]


def test_subtract_drops_names_with_identical_values() -> None:
    assert pairs(subtract(INTERSECT_LHS, INTERSECT_RHS)) == [
        ("bbb", "val-1"),
        ("ccc", "val-1"),
        ("ccc", "val-2"),
        ("eee", "val"),
    ]


names = st.text(alphabet="abz-_./+é1", min_size=2, max_size=6)
values = st.text(alphabet="abz/=%.-é1", max_size=5)
non_empty_values = values.filter(bool)
plain_labels = st.lists(st.tuples(st.sampled_from(["aa", "bb", "cc", "dd"]), values), max_size=8)


@settings(max_examples=100)
@given(plain_labels, plain_labels)
def test_union_subtract_and_intersect_agree(
    a: list[tuple[str, str]], b: list[tuple[str, str]]
) -> None:
    lhs, rhs = label_set(*a), label_set(*b)
    lhs_names = {name for name, _ in a}
    assert pairs(union(lhs, rhs)) == sorted(
        set(a) | {(name, value) for name, value in b if name not in lhs_names}
    )
    # Every name of lhs is either shared identically with rhs or not: the two results partition it.
    assert triples(union(subtract(lhs, rhs), intersect(lhs, rhs))) == triples(lhs)
    assert not set(pairs(subtract(lhs, rhs))) & set(pairs(intersect(lhs, rhs)))


@settings(max_examples=100)
@given(plain_labels)
def test_normalize_sorts_dedups_and_is_idempotent(a: list[tuple[str, str]]) -> None:
    once = normalize(protocol_pb2.Label(name=n, value=v) for n, v in a)
    assert pairs(once) == sorted(set(a))
    assert triples(normalize(once)) == triples(once)
    assert triples(label_set(*a)) == triples(once)


# --- Meta-labels ----------------------------------------------------------------------------------


def test_journal_meta_labels_add_the_name() -> None:
    spec = protocol_pb2.JournalSpec(name="path/to/my/journal", labels=label_set(("hello", "world")))
    assert pairs(journal_meta_labels(spec)) == [("hello", "world"), ("name", "path/to/my/journal")]


def test_shard_meta_labels_add_the_id() -> None:
    spec = consumer_pb2.ShardSpec(id="shard-000", labels=label_set(("app", "x"), ("zone", "a")))
    assert pairs(shard_meta_labels(spec)) == [("app", "x"), ("id", "shard-000"), ("zone", "a")]


def test_prefix_meta_label_becomes_a_name_prefix_match() -> None:
    sel = rewrite_prefix_meta_label(parse_selector("prefix=logs/, app=web, prefix!=logs/old/"))
    assert format_selector(sel) == "app=web,name:prefix=logs/,name:prefix!=logs/old/"

    def labels_of(name: str) -> protocol_pb2.LabelSet:
        return journal_meta_labels(
            protocol_pb2.JournalSpec(name=name, labels=label_set(("app", "web")))
        )

    assert matches(sel, labels_of("logs/a/part-000"))
    assert not matches(sel, labels_of("logs/old/part-000"))
    assert not matches(sel, labels_of("logsx/part-000"))
    assert format_selector(rewrite_prefix_meta_label(parse_selector("app=web"))) == "app=web"


# --- Parsing and formatting -----------------------------------------------------------------------

PARSE_CASES: list[tuple[str, list[Triple], list[Triple]]] = [
    ("foo = bar", [("foo", "bar", False)], []),
    ("foo:prefix =bar", [("foo", "bar", True)], []),
    ("foo != bar", [], [("foo", "bar", False)]),
    ("foo ", [("foo", "", False)], []),
    (" !foo", [], [("foo", "", False)]),
    (
        " foo in (bing, baz,bar)",
        [("foo", "bar", False), ("foo", "baz", False), ("foo", "bing", False)],
        [],
    ),
    (" foo not in ( pear, apple )", [], [("foo", "apple", False), ("foo", "pear", False)]),
    (
        "foo==bar, baz !=bing ,apple:prefix in (fruit, banana)",
        [("apple", "banana", True), ("apple", "fruit", True), ("foo", "bar", False)],
        [("baz", "bing", False)],
    ),
    (
        "!foo,baz,bing:prefix not in (thing-one, thing-2),!bar,",
        [("baz", "", False)],
        [
            ("bar", "", False),
            ("bing", "thing-2", True),
            ("bing", "thing-one", True),
            ("foo", "", False),
        ],
    ),
    # Label values may include '='.
    (
        "foo = ba=ar, baz=bi=ngo,exc!=who=ops",
        [("baz", "bi=ngo", False), ("foo", "ba=ar", False)],
        [("exc", "who=ops", False)],
    ),
    (
        "foo in (bi=ng,ba=ar), exc notin (who=ops,oth=er)",
        [("foo", "ba=ar", False), ("foo", "bi=ng", False)],
        [("exc", "oth=er", False), ("exc", "who=ops", False)],
    ),
    ("", [], []),
    ("foo=bar,foo=bar", [("foo", "bar", False)], []),  # Repeats collapse.
    ("foo=", [("foo", "", False)], []),  # An empty value is the existence test.
    (
        "topic in (topic/one, topic/two), name:prefix=a/b/",
        [
            ("name", "a/b/", True),
            ("topic", "topic/one", False),
            ("topic", "topic/two", False),
        ],
        [],
    ),
    ("ünï=cødé", [("ünï", "cødé", False)], []),
]


@pytest.mark.parametrize(("text", "include", "exclude"), PARSE_CASES)
def test_parse_upstream_examples(text: str, include: list[Triple], exclude: list[Triple]) -> None:
    sel = parse_selector(text)
    assert triples(sel.include) == include
    assert triples(sel.exclude) == exclude
    assert parse_selector(format_selector(sel)) == sel


FORMAT_CASES = [
    ("foo = bar", "foo=bar"),
    (" foo in (bing, baz,bar)", "foo in (bar,baz,bing)"),
    (" foo not in ( pear, apple )", "foo notin (apple,pear)"),
    (
        "foo==bar, baz !=bing ,apple:prefix in (fruit, banana)",
        "apple:prefix in (banana,fruit),foo=bar,baz!=bing",
    ),
    (
        "!foo,baz,bing:prefix not in (thing-one, thing-2),!bar,",
        "baz,!bar,bing:prefix notin (thing-2,thing-one),!foo",
    ),
    ("foo:prefix=a/, foo=b", "foo=b,foo:prefix=a/"),  # ':' sorts after '-' and letters.
    ("foo-x, foo:prefix", "foo-x,foo:prefix"),
    ("!a1", "!a1"),
    ("", ""),
]


@pytest.mark.parametrize(("text", "canonical"), FORMAT_CASES)
def test_format_is_upstreams_canonical_string(text: str, canonical: str) -> None:
    assert format_selector(parse_selector(text)) == canonical


def test_format_keeps_an_included_value_starting_with_equals_readable() -> None:
    # Upstream would print `foo==x`, which parses back as foo=x.
    assert parse_selector("foo==x") == parse_selector("foo=x")
    sel = selector(include=label_set(("foo", "=x")))
    assert format_selector(sel) == "foo in (=x)"
    assert parse_selector(format_selector(sel)) == sel
    excluded = selector(exclude=label_set(("foo", "=x")))
    assert format_selector(excluded) == "foo!==x"
    assert parse_selector("foo!==x") == excluded


ERROR_CASES = [
    ("apple,banana err in (bar)", 6, 'could not match "banana err in (bar)"'),
    ("apple,banana in (bar,err baz)", 21, 'could not match "err baz" to a set value'),
    ("ban=ana in (bar)", 0, 'could not match "ban=ana in (bar)"'),
    ("foo, foo in (bar)", 4, 'label "foo" has both the empty value and the value "bar"'),
    ("a", 0, 'could not match "a"'),  # Names have two characters at least.
    ("foo  = bar", 0, 'could not match "foo  = bar"'),  # One space at most.
    ("foo\tbar", 0, "could not match"),
    ("foo=bar\n", 0, 'could not match "foo=bar\\n"'),
    ("ok, foo=b|r", 3, 'could not match " foo=b|r"'),
    ("foo:prefixx=a", 0, "could not match"),
    ("foo:prefix=a,foo=a", 0, 'labels are not unique and sorted: "foo" value "a" follows "a"'),
    ("x" * 65, 0, "is too long (65 bytes; expected 2 to 64 bytes)"),
    ("foo in (a,,b)", 0, 'label "foo" has both the empty value and the value "a"'),
    # Found by tests/test_fuzz.py (gazctl journals list -l): NEL, which ends a line for
    # str.splitlines (and some terminals), was quoted as it is.
    ("\x85", 0, 'could not match "\\u0085"'),
    ("app=\u2028", 0, 'could not match "app=\\u2028"'),
]


SELECTOR_PARTS = [*"abfo:xyz-_./=!(), \t", " in ", " notin ", ":prefix", "é", "\x85", "\u2028"]


@pytest.mark.parametrize(("text", "position", "message"), ERROR_CASES)
def test_parse_errors_quote_the_text_and_position(text: str, position: int, message: str) -> None:
    with pytest.raises(SelectorError) as info:
        parse_selector(text)
    err = info.value
    assert err.position == position
    assert message in str(err)
    assert quote(text) in str(err)
    assert isinstance(err, ValueError)
    assert len(str(err).splitlines()) == 1


@settings(max_examples=300)
@given(st.one_of(st.text(), st.lists(st.sampled_from(SELECTOR_PARTS)).map("".join)))
def test_any_text_parses_to_a_valid_selector_or_fails_in_one_line(text: str) -> None:
    try:
        sel = parse_selector(text)
    except SelectorError as err:
        assert len(str(err).splitlines()) == 1, str(err)
        return
    assert parse_selector(format_selector(sel)) == sel


# --- Matching -------------------------------------------------------------------------------------

UPSTREAM_SELECTOR = selector(
    include=label_set(
        ("inc-1:prefix", "a-val/"), ("inc-2", ""), ("inc-3", "val-1"), ("inc-3", "val-2")
    ),
    exclude=label_set(("exc-1", ""), ("exc-2", "val-3"), ("exc-2", "val-4")),
)

MATCH_CASES: list[tuple[list[tuple[str, str]], bool]] = [
    ([], False),
    ([("foo", "bar"), ("inc-1", "a-val/a/1"), ("inc-2", "any"), ("inc-3", "val-1")], True),
    ([("foo", "bar"), ("inc-1", "a-val/b/2"), ("inc-2", "foo"), ("inc-3", "val-1")], True),
    ([("foo", "bar"), ("inc-1", "a-val/c/3"), ("inc-2", "any"), ("inc-3", "val-2")], True),
    ([("foo", "bar"), ("inc-1", "bad-val/4"), ("inc-2", "any"), ("inc-3", "val-1")], False),
    ([("foo", "bar"), ("inc-1", "a-val/5"), ("inc-3", "val-1")], False),
    ([("foo", "bar"), ("inc-1", "a-val/6"), ("inc-2", "any"), ("inc-3", "val-other")], False),
    ([("exc-1", "any"), ("inc-1", "a-val/a/7"), ("inc-2", "any"), ("inc-3", "val-1")], False),
    ([("exc-2", "val-4"), ("inc-1", "a-val/8"), ("inc-2", "any"), ("inc-3", "val-1")], False),
    ([("exc-2", "val-ok"), ("inc-1", "a-val/9/9"), ("inc-2", "any"), ("inc-3", "val-1")], True),
]


@pytest.mark.parametrize(("labels", "expect"), MATCH_CASES)
def test_upstream_matching_examples(labels: list[tuple[str, str]], expect: bool) -> None:
    assert matches(UPSTREAM_SELECTOR, label_set(*labels)) is expect


def test_exclude_only_selector() -> None:
    sel = selector(exclude=UPSTREAM_SELECTOR.exclude)
    assert matches(sel, label_set())
    assert matches(sel, label_set(("foo", "bar")))
    assert matches(sel, label_set(("exc-2", "val-ok")))
    assert not matches(sel, label_set(("exc-2", "val-3")))
    assert not matches(sel, label_set(("exc-1", "any")))


def naive_matches(sel: protocol_pb2.LabelSelector, labels: protocol_pb2.LabelSet) -> bool:
    """The documented semantics, written as plainly as possible."""

    def hit(want: protocol_pb2.Label) -> bool:
        for have in labels.labels:
            if have.name != want.name:
                continue
            if want.value == "":
                return True
            if want.prefix and have.value.startswith(want.value):
                return True
            if not want.prefix and have.value == want.value:
                return True
        return False

    for want in sel.exclude.labels:
        if hit(want):
            return False
    for name in {want.name for want in sel.include.labels}:
        if not any(hit(want) for want in sel.include.labels if want.name == name):
            return False
    return True


@st.composite
def selector_sides(
    draw: st.DrawFn, name_strategy: st.SearchStrategy[str], value_strategy: st.SearchStrategy[str]
) -> protocol_pb2.LabelSet:
    """A valid selector side: per name, the existence test or distinct values, each of which is
    an exact or a prefix match."""
    out = protocol_pb2.LabelSet()
    for name in draw(st.lists(name_strategy, max_size=4, unique=True)):
        if draw(st.integers(0, 3)) == 0:
            add_value(out, name + draw(st.sampled_from(["", ":prefix"])), "")
            continue
        for value in draw(st.lists(value_strategy, min_size=1, max_size=3, unique=True)):
            add_value(out, name + draw(st.sampled_from(["", ":prefix"])), value)
    return out


@st.composite
def selectors(
    draw: st.DrawFn,
    name_strategy: st.SearchStrategy[str] = names,
    value_strategy: st.SearchStrategy[str] = non_empty_values,
) -> protocol_pb2.LabelSelector:
    include = draw(selector_sides(name_strategy, value_strategy))
    sel = selector(include, draw(selector_sides(name_strategy, value_strategy)))
    validate_label_selector(sel)
    return sel


@settings(max_examples=200)
@given(selectors())
def test_format_then_parse_round_trips(sel: protocol_pb2.LabelSelector) -> None:
    text = format_selector(sel)
    assert parse_selector(text) == sel
    assert format_selector(parse_selector(text)) == text


small_names = st.sampled_from(["aa", "bb", "cc"])
small_values = st.sampled_from(["x", "x/", "x/y", "xy", "y"])


@settings(max_examples=250)
@given(
    selectors(small_names, small_values),
    st.lists(
        st.tuples(small_names, st.sampled_from(["", "x", "x/", "x/y", "xy", "y"])), max_size=6
    ),
)
def test_matching_agrees_with_naive_reference(
    sel: protocol_pb2.LabelSelector, labels: list[tuple[str, str]]
) -> None:
    ls = label_set(*labels)
    assert matches(sel, ls) is naive_matches(sel, ls)
