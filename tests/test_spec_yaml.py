"""Journal spec YAML: Go duration text, strict line-numbered decoding, inheritance and hoisting.

The hoist/flatten round trip is checked as a property over generated journal sets; upstream's
documented behaviours (the examples journalspace, tree extraction, quoting) are checked as tables.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError, validate_journal_spec
from spec import (
    JournalEntry,
    JournalNode,
    SpecError,
    decode_journals,
    decode_tree,
    encode_journals,
    encode_tree,
    flatten,
    hoist,
)
from spec.durations import (
    HOUR,
    MICROSECOND,
    MILLISECOND,
    MINUTE,
    SECOND,
    DurationError,
    duration_from_nanos,
    duration_from_seconds,
    format_duration,
    format_go_duration,
    nanos_from_duration,
    parse_duration,
    parse_go_duration,
    seconds_from_duration,
)
from tests.helpers.mutations import mutated_yaml

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def yaml_text(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def journal(name: str, **fields: object) -> pb.JournalSpec:
    return pb.JournalSpec(name=name, **fields)  # type: ignore[arg-type]


def labels(*pairs: tuple[str, str]) -> pb.LabelSet:
    return pb.LabelSet(labels=[pb.Label(name=n, value=v) for n, v in pairs])


# --- Durations -----------------------------------------------------------------------------------

# Duration.String() outputs from Go's own time package tests, plus values common in specs.
GO_DURATION_STRINGS = [
    (0, "0s"),
    (1, "1ns"),
    (1_100, "1.1µs"),
    (2_200 * MICROSECOND, "2.2ms"),
    (3_300 * MILLISECOND, "3.3s"),
    (4 * MINUTE + 5 * SECOND, "4m5s"),
    (4 * MINUTE + 5_001 * MILLISECOND, "4m5.001s"),
    (5 * HOUR + 6 * MINUTE + 7_001 * MILLISECOND, "5h6m7.001s"),
    (8 * MINUTE + 1, "8m0.000000001s"),
    (INT64_MAX, "2562047h47m16.854775807s"),
    (INT64_MIN, "-2562047h47m16.854775808s"),
    (90 * SECOND, "1m30s"),
    (HOUR, "1h0m0s"),
    (MINUTE, "1m0s"),
    (720 * HOUR, "720h0m0s"),
    (1_500 * MILLISECOND, "1.5s"),
    (MILLISECOND, "1ms"),
    (300 * MILLISECOND, "300ms"),
    (MICROSECOND, "1µs"),
    (-1_500 * MILLISECOND, "-1.5s"),
    (100 * MILLISECOND + 1, "100.000001ms"),
]


@pytest.mark.parametrize(("nanos", "text"), GO_DURATION_STRINGS)
def test_duration_formatting_matches_go(nanos: int, text: str) -> None:
    assert format_go_duration(nanos) == text
    assert parse_go_duration(text) == nanos
    assert format_duration(duration_from_nanos(nanos)) == text


# Inputs and results from Go's ParseDuration tests, including its float64 fraction behaviour.
GO_PARSE_CASES = [
    ("0", 0),
    ("-0", 0),
    ("+0", 0),
    ("5s", 5 * SECOND),
    ("+5s", 5 * SECOND),
    ("-5s", -5 * SECOND),
    ("5.s", 5 * SECOND),
    (".5s", 500 * MILLISECOND),
    ("1.004s", 1_004 * MILLISECOND),
    ("100.00100s", 100_001 * MILLISECOND),
    ("10ns", 10),
    ("11us", 11 * MICROSECOND),
    ("12µs", 12 * MICROSECOND),
    ("12μs", 12 * MICROSECOND),
    ("13ms", 13 * MILLISECOND),
    ("15m", 15 * MINUTE),
    ("16h", 16 * HOUR),
    ("3h30m", 3 * HOUR + 30 * MINUTE),
    ("10.5s4m", 4 * MINUTE + 10_500 * MILLISECOND),
    ("-2m3.4s", -(2 * MINUTE + 3_400 * MILLISECOND)),
    ("1h2m3s4ms5us6ns", HOUR + 2 * MINUTE + 3 * SECOND + 4 * MILLISECOND + 5 * MICROSECOND + 6),
    ("39h9m14.425s", 39 * HOUR + 9 * MINUTE + 14_425 * MILLISECOND),
    ("52763797000ns", 52_763_797_000),
    ("0.3333333333333333333h", 20 * MINUTE),
    ("9007199254740993ns", (1 << 53) + 1),
    ("9223372036854775807ns", INT64_MAX),
    ("9223372036854775.807us", INT64_MAX),
    ("9223372036s854ms775us807ns", INT64_MAX),
    ("-9223372036854775808ns", INT64_MIN),
    ("-2562047h47m16.854775808s", INT64_MIN),
    ("0.100000000000000000000h", 6 * MINUTE),
    ("0.830103483285477580700h", 49 * MINUTE + 48 * SECOND + 372_539_827),
]


@pytest.mark.parametrize(("text", "nanos"), GO_PARSE_CASES)
def test_duration_parsing_matches_go(text: str, nanos: int) -> None:
    assert parse_go_duration(text) == nanos


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected a number and a unit"),
        ("3", "missing unit"),
        ("-", "expected a number and a unit"),
        ("s", "expected a number"),
        (".", "needs digits"),
        ("-.", "needs digits"),
        (".s", "needs digits"),
        ("+.s", "needs digits"),
        ("1d", 'unknown unit "d"'),
        ("1h 2m", 'unknown unit "h "'),
        ("9223372036854775810ns", "out of range"),
        ("9223372036854775808ns", "out of range"),
        ("-9223372036854775809ns", "out of range"),
        ("9223372036854776us", "out of range"),
        ("3000000h", "out of range"),
        ("9223372036854775.808us", "out of range"),
        ("9223372036854ms775us808ns", "out of range"),
    ],
)
def test_duration_errors_name_the_text(text: str, reason: str) -> None:
    with pytest.raises(DurationError) as caught:
        parse_go_duration(text)
    message = str(caught.value)
    assert f'invalid duration "{text}"' in message
    assert reason in message
    assert "\n" not in message


def test_duration_proto_and_seconds_conversions() -> None:
    assert parse_duration("1m30s") == duration_from_nanos(90 * SECOND)
    negative = duration_from_nanos(-1_500 * MILLISECOND)
    assert (negative.seconds, negative.nanos) == (-1, -500_000_000)
    assert nanos_from_duration(negative) == -1_500 * MILLISECOND
    assert seconds_from_duration(negative) == -1.5
    assert duration_from_seconds(1.1) == duration_from_nanos(1_100 * MILLISECOND)
    assert duration_from_seconds(720 * 3600) == parse_duration("720h0m0s")


@settings(max_examples=200)
@given(st.integers(INT64_MIN, INT64_MAX))
def test_duration_text_round_trips(nanos: int) -> None:
    assert parse_go_duration(format_go_duration(nanos)) == nanos


# --- Decoding the reference example --------------------------------------------------------------

EXAMPLES_JOURNALSPACE = yaml_text(
    """
    name: examples/
    replication: 3
    labels:
      - name: example-journals
    fragment:
      length: 268435456 # 256MB.
      stores:
        - s3://examples/fragments/?profile=minio&endpoint=http%3A%2F%2Fminio%3A9000
      refresh_interval: 1m0s
      retention: 720h0m0s
      compression_codec: SNAPPY
      flush_interval: 10m0s
      path_postfix_template: date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}
    children:
      - name: examples/bike-share/
        labels:
          - name:  example-name
            value: bike-share
        children:
          - name: examples/bike-share/cycles/
            labels:
              - name:  app.gazette.dev/message-type
                value: bike_share.Cycle
              - name:  content-type
                value: application/x-ndjson
            children:
              - name: examples/bike-share/cycles/part-000
              - name: examples/bike-share/cycles/part-001
      - name: examples/foobar
      - name: examples/stream-sum/
        fragment:
          refresh_interval:  5s
        children:
          - name: examples/stream-sum/chunks
          - name: examples/stream-sum/sums
            revision: -1
    """
)


def example_fragment(refresh: str = "1m0s") -> pb.JournalSpec.Fragment:
    return pb.JournalSpec.Fragment(
        length=268435456,
        compression_codec=pb.SNAPPY,
        stores=["s3://examples/fragments/?profile=minio&endpoint=http%3A%2F%2Fminio%3A9000"],
        refresh_interval=parse_duration(refresh),
        retention=parse_duration("720h0m0s"),
        flush_interval=parse_duration("10m0s"),
        path_postfix_template='date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}',
    )


def test_examples_journalspace_leaves_inherit_from_every_ancestor() -> None:
    cycles = labels(
        ("app.gazette.dev/message-type", "bike_share.Cycle"),
        ("content-type", "application/x-ndjson"),
        ("example-journals", ""),
        ("example-name", "bike-share"),
    )
    expected = [
        JournalEntry(
            journal(
                "examples/bike-share/cycles/part-000",
                replication=3,
                labels=cycles,
                fragment=example_fragment(),
            )
        ),
        JournalEntry(
            journal(
                "examples/bike-share/cycles/part-001",
                replication=3,
                labels=cycles,
                fragment=example_fragment(),
            )
        ),
        JournalEntry(
            journal(
                "examples/foobar",
                replication=3,
                labels=labels(("example-journals", "")),
                fragment=example_fragment(),
            )
        ),
        JournalEntry(
            journal(
                "examples/stream-sum/chunks",
                replication=3,
                labels=labels(("example-journals", "")),
                fragment=example_fragment(refresh="5s"),
            )
        ),
        JournalEntry(
            journal(
                "examples/stream-sum/sums",
                replication=3,
                labels=labels(("example-journals", "")),
                fragment=example_fragment(refresh="5s"),
            ),
            revision=-1,
        ),
    ]
    assert decode_journals(EXAMPLES_JOURNALSPACE) == expected


def test_examples_journalspace_lists_back_equivalently() -> None:
    entries = decode_journals(EXAMPLES_JOURNALSPACE)
    listing = encode_journals(entries)
    assert decode_journals(listing) == entries
    tree = decode_tree(listing)
    # Everything the journals share is hoisted to the root, as `gazctl journals list` shows it.
    assert tree.name == "examples/"
    assert tree.spec.replication == 3
    assert [child.name for child in tree.children] == [
        "examples/bike-share/cycles/",
        "examples/foobar",
        "examples/stream-sum/",
    ]


# --- Upstream's listing format -------------------------------------------------------------------

LISTING = yaml_text(
    """
    name: logs/
    replication: 3
    labels:
    - name: team
      value: core
    fragment:
      length: 1048576
      compression_codec: GZIP
      stores:
      - gs://bucket-one/
      - s3://bucket-two/prefix/
      refresh_interval: 30s
      retention: 168h0m0s
      flush_interval: 1h0m0s
    flags: O_RDWR
    max_append_rate: 5000000
    children:
    - comment: retired
      delete: true
      name: logs/archive
    - name: logs/web/
      labels:
      - name: tier
        value: ""
      children:
      - name: logs/web/part-000
        revision: 17
      - name: logs/web/part-001
        suspend:
          level: PARTIAL
          offset: 4096
        revision: 18
    """
)


def test_listing_format_round_trips_byte_for_byte() -> None:
    tree = decode_tree(LISTING)
    assert encode_tree(tree) == LISTING
    assert encode_journals(flatten(tree)) == LISTING


def test_listing_flattens_to_explicit_specs() -> None:
    fragment = pb.JournalSpec.Fragment(
        length=1048576,
        compression_codec=pb.GZIP,
        stores=["gs://bucket-one/", "s3://bucket-two/prefix/"],
        refresh_interval=parse_duration("30s"),
        retention=parse_duration("168h"),
        flush_interval=parse_duration("1h"),
    )
    common = {"replication": 3, "fragment": fragment, "flags": pb.JournalSpec.O_RDWR}
    web = labels(("team", "core"), ("tier", ""))
    assert flatten(decode_tree(LISTING)) == [
        JournalEntry(
            journal(
                "logs/archive", labels=labels(("team", "core")), **common, max_append_rate=5000000
            ),
            delete=True,
            comment="retired",
        ),
        JournalEntry(
            journal("logs/web/part-000", labels=web, **common, max_append_rate=5000000),
            revision=17,
        ),
        JournalEntry(
            journal(
                "logs/web/part-001",
                labels=web,
                **common,
                max_append_rate=5000000,
                suspend=pb.JournalSpec.Suspend(level=pb.JournalSpec.Suspend.PARTIAL, offset=4096),
            ),
            revision=18,
        ),
    ]


def test_encoding_quotes_strings_that_would_read_as_other_types() -> None:
    entries = [
        JournalEntry(
            journal(
                f"q/{index}",
                labels=labels(("v", value)),
                fragment=pb.JournalSpec.Fragment(path_postfix_template="x: y"),
            ),
            comment="two\nlines",
        )
        for index, value in enumerate(["", "123", "true", "null", "y", "1.5", "~"])
    ]
    text = encode_journals(entries)
    for quoted in ['""', '"123"', '"true"', '"null"', '"y"', '"1.5"', '"~"']:
        assert f"value: {quoted}\n" in text
    assert "path_postfix_template: 'x: y'\n" in text
    assert "comment: |-\n" in text
    assert decode_journals(text) == entries


def test_unknown_flag_combinations_and_levels_are_written_as_numbers() -> None:
    spec = journal(
        "odd/one",
        flags=pb.JournalSpec.O_RDONLY | pb.JournalSpec.O_WRONLY,
        suspend=pb.JournalSpec.Suspend(level=pb.JournalSpec.Suspend.FULL),
    )
    text = encode_journals([JournalEntry(spec)])
    assert text == "name: odd/one\nflags: 3\nsuspend:\n  level: FULL\n"
    assert decode_journals(text) == [JournalEntry(spec)]
    assert decode_journals("name: odd/two\nflags: 4\nsuspend: {level: 1}\n")[0].spec == journal(
        "odd/two",
        flags=pb.JournalSpec.O_RDWR,
        suspend=pb.JournalSpec.Suspend(level=pb.JournalSpec.Suspend.PARTIAL),
    )


# --- Inheritance (upstream UnionJournalSpecs) and hoisting (Intersect / Subtract) ---------------


def test_children_override_per_label_name_and_per_field() -> None:
    text = yaml_text(
        """
        name: a/
        replication: 2
        flags: O_RDWR
        labels:
        - {name: env, value: prod}
        - {name: env, value: staging}
        - {name: team, value: core}
        delete: true
        children:
        - name: a/one
          replication: 3
          flags: O_RDONLY
          labels:
          - {name: env, value: dev}
        - name: a/two
          delete: false
        """
    )
    one, two = decode_journals(text)
    # A child's values for a label name replace all of the parent's values for that name.
    assert one.spec == journal(
        "a/one",
        replication=3,
        flags=pb.JournalSpec.O_RDONLY,
        labels=labels(("env", "dev"), ("team", "core")),
    )
    assert one.delete is True
    assert two.spec.replication == 2
    assert [(label.name, label.value) for label in two.spec.labels.labels] == [
        ("env", "prod"),
        ("env", "staging"),
        ("team", "core"),
    ]
    assert two.delete is False


def test_explicit_empty_stores_stop_inheritance() -> None:
    text = yaml_text(
        """
        name: a/
        fragment:
          stores: [s3://bucket/]
          length: 2048
        children:
        - name: a/b/
          fragment: {stores: []}
          children:
          - name: a/b/ephemeral
        - name: a/kept
        """
    )
    tree = decode_tree(text)
    assert tree.children[0].empty_stores
    ephemeral, kept = flatten(tree)
    assert list(ephemeral.spec.fragment.stores) == []
    assert ephemeral.spec.fragment.length == 2048
    assert list(kept.spec.fragment.stores) == ["s3://bucket/"]
    assert decode_tree(encode_tree(tree)) == tree


def test_tree_extraction_forms_directories_only_where_names_fork() -> None:
    names = [
        "root/aaa/000",
        "root/aaa/111/foo/i",
        "root/aaa/111/foo/j",
        "root/aaa/222",
        "root/bbb/333/a/x",
        "root/bbb/333/a/y",
        "root/bbb/333/z",
        "root/bbb/444",
    ]
    tree = hoist(JournalEntry(journal(name)) for name in reversed(names))

    def shape(node: JournalNode) -> object:
        return node.name if not node.children else {node.name: [shape(c) for c in node.children]}

    assert shape(tree) == {
        "root/": [
            {
                "root/aaa/": [
                    "root/aaa/000",
                    {"root/aaa/111/foo/": ["root/aaa/111/foo/i", "root/aaa/111/foo/j"]},
                    "root/aaa/222",
                ]
            },
            {
                "root/bbb/": [
                    {
                        "root/bbb/333/": [
                            {"root/bbb/333/a/": ["root/bbb/333/a/x", "root/bbb/333/a/y"]},
                            "root/bbb/333/z",
                        ]
                    },
                    "root/bbb/444",
                ]
            },
        ]
    }


def test_single_journal_is_its_own_root_and_unrelated_journals_share_an_unnamed_root() -> None:
    single = hoist([JournalEntry(journal("only/one", replication=1), revision=5)])
    assert not single.is_dir
    assert encode_tree(single) == "name: only/one\nreplication: 1\nrevision: 5\n"

    unrelated = hoist(
        [JournalEntry(journal("a/x", replication=2)), JournalEntry(journal("b/y", replication=2))]
    )
    assert unrelated.name == ""
    assert encode_tree(unrelated) == "replication: 2\nchildren:\n- name: a/x\n- name: b/y\n"
    assert len(flatten(decode_tree(encode_tree(unrelated)))) == 2


def test_hoisting_keeps_suspend_and_differing_label_groups_on_children() -> None:
    suspend = pb.JournalSpec.Suspend(level=pb.JournalSpec.Suspend.FULL, offset=7)
    tree = hoist(
        [
            JournalEntry(
                journal("n/aaa", replication=2, labels=labels(("x", "1")), suspend=suspend),
                delete=True,
            ),
            JournalEntry(
                journal(
                    "n/bbb", replication=2, labels=labels(("x", "1"), ("y", "2")), suspend=suspend
                ),
                delete=True,
            ),
            JournalEntry(
                journal("n/ccc", replication=2, labels=labels(("x", "1"), ("x", "9"))), delete=True
            ),
        ]
    )
    assert tree.spec == journal("n/", replication=2)
    assert tree.delete is True
    assert [child.spec for child in tree.children] == [
        journal("n/aaa", labels=labels(("x", "1")), suspend=suspend),
        journal("n/bbb", labels=labels(("x", "1"), ("y", "2")), suspend=suspend),
        journal("n/ccc", labels=labels(("x", "1"), ("x", "9"))),
    ]
    assert all(child.delete is None for child in tree.children)


def test_hoist_rejects_empty_and_duplicate_input() -> None:
    with pytest.raises(ValueError, match="no journals"):
        hoist([])
    with pytest.raises(ValueError, match="more than once"):
        hoist([JournalEntry(journal("a/b")), JournalEntry(journal("a/b"))])
    with pytest.raises(ValueError, match="must be non-empty and not end in '/'"):
        JournalEntry(journal("a/"))


def test_nodes_check_structure_when_built_in_code() -> None:
    with pytest.raises(SpecError, match="needs children"):
        JournalNode(journal("dir/"))
    with pytest.raises(SpecError, match="only allowed on directories"):
        JournalNode(journal("leaf"), children=(JournalNode(journal("leaf/x")),))
    with pytest.raises(SpecError, match='must start with "dir/"'):
        JournalNode(journal("dir/"), children=(JournalNode(journal("other")),))
    with pytest.raises(SpecError, match="out of order"):
        JournalNode(
            journal("d/"), children=(JournalNode(journal("d/b")), JournalNode(journal("d/a")))
        )


# --- Strict decoding errors name the line --------------------------------------------------------

ERROR_CASES = [
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/foo
          replicaton: 3
        """,
        4,
        'unknown key "replicaton" in journal "examples/foo"; did you mean "replication"?',
        id="unknown-key",
    ),
    pytest.param(
        """
        name: examples/
        fragment:
          length: 1024
          refresh_intreval: 1m
        children:
        - name: examples/foo
        """,
        4,
        'unknown key "refresh_intreval" under "fragment" in directory "examples/"',
        id="unknown-nested-key",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/foo
          replication: three
        """,
        4,
        '"replication" must be an integer (got "three") in journal "examples/foo"',
        id="wrong-type-int",
    ),
    pytest.param(
        """
        name: examples/foo
        replication: "3"
        """,
        2,
        '"replication" must be an integer (got "3")',
        id="quoted-int",
    ),
    pytest.param(
        """
        name: examples/foo
        labels: {name: a, value: b}
        """,
        2,
        '"labels" must be a list (got a mapping) in journal "examples/foo"',
        id="wrong-type-list",
    ),
    pytest.param(
        """
        name: examples/foo
        fragment:
          stores: s3://bucket/
        """,
        3,
        '"stores" must be a list (got "s3://bucket/")',
        id="stores-not-a-list",
    ),
    pytest.param(
        """
        name: examples/
        fragment:
          refresh_interval: 5x
        children:
        - name: examples/foo
        """,
        3,
        'bad "refresh_interval" in directory "examples/": invalid duration "5x": unknown unit "x"',
        id="bad-duration",
    ),
    pytest.param(
        """
        name: examples/foo
        fragment:
          retention: 60
        """,
        3,
        'invalid duration "60": missing unit',
        id="unitless-duration",
    ),
    pytest.param(
        """
        name: examples/foo
        fragment:
          compression_codec: LZ4
        """,
        3,
        '"compression_codec" must be one of INVALID, NONE, GZIP, ZSTANDARD, SNAPPY, '
        'GZIP_OFFLOAD_DECOMPRESSION (got "LZ4") in journal "examples/foo"',
        id="bad-codec",
    ),
    pytest.param(
        """
        name: examples/foo
        fragment:
          compression_codec: 2
        """,
        3,
        '"compression_codec" must be one of',
        id="numeric-codec",
    ),
    pytest.param(
        """
        name: examples/foo
        flags: O_RW
        """,
        2,
        '"flags" must be one of NOT_SPECIFIED, O_RDONLY, O_WRONLY, O_RDWR, or an integer (got "O_RW")',
        id="bad-flags",
    ),
    pytest.param(
        """
        name: examples/foo
        suspend:
          level: HALF
        """,
        3,
        '"level" must be one of NONE, PARTIAL, FULL, or an integer (got "HALF")',
        id="bad-level",
    ),
    pytest.param(
        """
        name: examples/foo
        replication: 3
        children:
        - name: examples/foo/bar
        """,
        3,
        'children are only allowed on directories, and journal "examples/foo" is not one',
        id="leaf-with-children",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/foo/
          replication: 3
        """,
        3,
        'directory "examples/foo/" needs children',
        id="directory-without-children",
    ),
    pytest.param(
        """
        name: examples/
        replication: 3
        """,
        1,
        'directory "examples/" needs children',
        id="root-directory-without-children",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/a
        - name: other/b
        """,
        4,
        'journal "other/b" is listed under directory "examples/", so its name must start with '
        '"examples/"',
        id="child-not-prefixed",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/b
        - name: examples/a
        """,
        4,
        'journal "examples/a" is out of order in directory "examples/"',
        id="children-unsorted",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/a
        - name: examples/a
        """,
        4,
        'journal "examples/a" is listed twice in directory "examples/"',
        id="children-duplicated",
    ),
    pytest.param(
        """
        name: examples/
        children:
        - name: examples/a
        - replication: 2
        """,
        4,
        'child has no "name" in directory "examples/"',
        id="child-without-name",
    ),
    pytest.param(
        """
        name: examples/
        revision: 12
        children:
        - name: examples/a
        """,
        2,
        '"revision" is only allowed on journals, not on directory "examples/"',
        id="revision-on-directory",
    ),
    pytest.param(
        """
        name: examples/
        suspend:
          level: FULL
        children:
        - name: examples/a
        """,
        2,
        '"suspend" is only allowed on journals, not on directory "examples/"',
        id="suspend-on-directory",
    ),
    pytest.param(
        """
        name: examples/a
        replication: 1
        replication: 2
        """,
        3,
        'duplicate key "replication" (first on line 2) in journal "examples/a"',
        id="duplicate-key",
    ),
    pytest.param(
        """
        name: examples/a
        delete: maybe
        """,
        2,
        '"delete" must be true or false (got "maybe")',
        id="bad-bool",
    ),
    pytest.param(
        """
        name: examples/a
        max_append_rate: 9223372036854775808
        """,
        2,
        '"max_append_rate" is out of range',
        id="int-out-of-range",
    ),
    pytest.param(
        """
        name: examples/
        children:
          - name: examples/a
           replication: 2
        """,
        4,
        "invalid YAML",
        id="yaml-syntax",
    ),
    pytest.param(
        """
        - name: examples/a
        """,
        1,
        "expected a journal or directory mapping (got a list) in the journal tree",
        id="not-a-mapping",
    ),
    pytest.param("", 1, "the document is empty", id="empty"),
    # Found by tests/test_spec_yaml.py's property: PyYAML's reader error spans two lines.
    pytest.param(
        "name: examples/a\nreplication: \x1f\n",
        2,
        "invalid YAML: unacceptable character #x001f: control characters are not allowed",
        id="control-character",
    ),
]


@pytest.mark.parametrize(("text", "line", "message"), ERROR_CASES)
def test_decoding_errors_name_the_line(text: str, line: int, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        decode_tree(yaml_text(text))
    assert caught.value.line == line
    assert str(caught.value).startswith(f"line {line}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


# --- Property: hoist, encode, decode and flatten give back the journals --------------------------

COMPONENTS = ["a", "b", "bb", "b-c", "x.y", "0"]
STRINGS = ["", "x", "123", "true", "null", "y", "a: b", "#c", " lead", "é", "two\nlines"]

names = st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=4).map("/".join)
durations = st.one_of(
    st.sampled_from([0, 0, SECOND, 90 * SECOND, HOUR, 720 * HOUR, 1_500, -SECOND]),
    st.integers(INT64_MIN, INT64_MAX),
)
label_sets = st.lists(
    st.tuples(st.sampled_from(["app", "env", "content-type"]), st.sampled_from(STRINGS)),
    max_size=3,
    unique=True,
).map(lambda pairs: labels(*sorted(pairs)))


@st.composite
def journal_specs(draw: st.DrawFn, name: str) -> pb.JournalSpec:
    spec = journal(
        name,
        replication=draw(st.sampled_from([0, 1, 3])),
        labels=draw(label_sets),
        flags=draw(st.sampled_from([0, 1, 2, 4, 6])),
        max_append_rate=draw(st.sampled_from([0, 1 << 20])),
    )
    fragment = spec.fragment
    fragment.length = draw(st.sampled_from([0, 1024, 1 << 30]))
    fragment.compression_codec = draw(st.sampled_from(list(pb.CompressionCodec.values())))  # type: ignore[assignment]
    fragment.stores.extend(
        draw(st.lists(st.sampled_from(["s3://a/", "gs://b/p/", "file:///x/"]), max_size=2))
    )
    for key in ("refresh_interval", "retention", "flush_interval"):
        getattr(fragment, key).CopyFrom(duration_from_nanos(draw(durations)))
    fragment.path_postfix_template = draw(
        st.sampled_from(["", 'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}', "0"])
    )
    if draw(st.booleans()):
        spec.suspend.level = draw(st.sampled_from([0, 1, 2]))  # type: ignore[assignment]
        spec.suspend.offset = draw(st.sampled_from([0, 1, 1 << 40]))
    return spec


@st.composite
def journal_sets(draw: st.DrawFn) -> list[JournalEntry]:
    chosen = draw(st.lists(names, min_size=1, max_size=10, unique=True))
    # Families of near-identical journals are what hoisting exists for, so reuse a few specs.
    templates = draw(st.lists(journal_specs(""), min_size=1, max_size=3))
    entries = []
    for name in chosen:
        spec = pb.JournalSpec()
        spec.CopyFrom(
            draw(st.sampled_from(templates)) if draw(st.booleans()) else draw(journal_specs(""))
        )
        spec.name = name
        entries.append(
            JournalEntry(
                spec,
                revision=draw(st.sampled_from([0, -1, 1, 123456])),
                delete=draw(st.booleans()),
                comment=draw(st.sampled_from(STRINGS)),
            )
        )
    return entries


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(journal_sets())
def test_hoisted_yaml_flattens_back_to_the_same_journals(entries: list[JournalEntry]) -> None:
    tree = hoist(entries)
    text = encode_tree(tree)
    decoded = decode_tree(text)
    assert decoded == tree
    assert flatten(decoded) == sorted(entries, key=lambda entry: entry.name)
    assert set(flatten(decoded)) == set(entries)


# --- Property: malformed specs fail in one line ---------------------------------------------------

EXAMPLES_YAML = (Path(__file__).parents[1] / "docs" / "examples" / "journals.yaml").read_text()


@settings(max_examples=300, deadline=None)
@given(st.one_of(mutated_yaml(EXAMPLES_YAML), st.text(max_size=200)))
def test_malformed_specs_fail_in_one_line(text: str) -> None:
    try:
        entries = flatten(decode_tree(text))
    except SpecError as err:
        assert "\n" not in str(err) and str(err).startswith("line "), str(err)
        return
    for entry in entries:  # What decodes is a spec a broker can be asked to apply.
        try:
            validate_journal_spec(entry.spec)
        except ValidationError as err:
            assert "\n" not in str(err)
