"""Shardspace YAML (upstream's `consumer/shardspace`): `common:` pushed down into `shards:`,
hoisted back for `gazctl shards list -o yaml`, upstream's own fixture byte for byte, and strict
reading with one line-numbered error per problem."""

from __future__ import annotations

import pytest
from google.protobuf import duration_pb2

from broker.protocol import labels
from consumer.protocol import cpb, validate_shard_spec
from spec import SpecError
from spec.shards import (
    ShardEntry,
    decode_shards,
    decode_shardspace,
    encode_shards,
    hoist_shards,
)

# Upstream's round-trip fixture (consumer/shardspace), as its tests write it.
UPSTREAM_FIXTURE = """\
common:
  recovery_log_prefix: recovery/logs
  hint_prefix: /hints
  hint_backups: 2
  max_txn_duration: 1s
  min_txn_duration: 1ms
  hot_standbys: 1
  labels:
  - name: name-1
    value: val-1
  disable_wait_for_ack: true
shards:
- comment: This is a comment
  delete: true
  id: shard-A
  sources:
  - journal: journal/A
  labels:
  - name: name-2
    value: val-2
  revision: 123
- id: shard-B
  sources:
  - journal: journal/B
  disable: true
  labels:
  - name: name-3
    value: val-3
  revision: 456
"""


def test_upstreams_fixture_pushes_down_into_whole_specs() -> None:
    shard_a, shard_b = decode_shards(UPSTREAM_FIXTURE)
    assert (shard_a.comment, shard_a.delete, shard_a.revision) == ("This is a comment", True, 123)
    assert (shard_b.delete, shard_b.revision, shard_b.line) == (None, 456, 22)
    a = shard_a.spec
    assert a.id == "shard-A" and [s.journal for s in a.sources] == ["journal/A"]
    assert (a.recovery_log_prefix, a.hint_prefix, a.hint_backups) == ("recovery/logs", "/hints", 2)
    assert a.max_txn_duration == duration_pb2.Duration(seconds=1)
    assert a.min_txn_duration == duration_pb2.Duration(nanos=1_000_000)
    assert a.hot_standbys == 1 and a.disable_wait_for_ack and not a.disable
    assert a.labels == labels.label_set(("name-1", "val-1"), ("name-2", "val-2"))
    assert shard_b.spec.disable
    for entry in (shard_a, shard_b):
        validate_shard_spec(entry.spec)  # Pushed down, each is whole.


def test_upstreams_fixture_round_trips_byte_for_byte() -> None:
    assert encode_shards(decode_shards(UPSTREAM_FIXTURE)) == UPSTREAM_FIXTURE


def test_shards_hoist_sorted_and_what_they_share_only() -> None:
    def spec(shard_id: str, standbys: int) -> ShardEntry:
        return ShardEntry(
            cpb.ShardSpec(
                id=shard_id,
                sources=[cpb.ShardSpec.Source(journal=f"in/{shard_id}")],
                max_txn_duration=duration_pb2.Duration(seconds=2),
                hot_standbys=standbys,
            ),
            revision=7,
        )

    space = hoist_shards([spec("shard-2", 1), spec("shard-1", 0)])
    assert [e.spec.id for e in space.shards] == ["shard-1", "shard-2"]
    assert space.common == cpb.ShardSpec(max_txn_duration=duration_pb2.Duration(seconds=2))
    assert space.shards[1].spec.hot_standbys == 1 and space.shards[0].spec.hot_standbys == 0
    text = encode_shards([spec("shard-2", 1), spec("shard-1", 0)])
    assert text.startswith("common:\n  max_txn_duration: 2s\nshards:\n- id: shard-1\n")
    decoded = decode_shards(text)
    assert [(e.spec, e.revision) for e in decoded] == [
        (spec("shard-1", 0).spec, 7),
        (spec("shard-2", 1).spec, 7),
    ]


def test_an_empty_common_is_written_as_an_empty_mapping() -> None:
    text = encode_shards([ShardEntry(cpb.ShardSpec(id="only"))])
    assert text == "common: {}\nshards:\n- id: only\n"
    assert [e.spec.id for e in decode_shards(text)] == ["only"]


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("shards:\n- id: shard-A\n  hot_standby: 1\n", 3, 'did you mean "hot_standbys"'),
        ("common:\n  id: x\nshards: []\n", 2, 'may not have an "id"'),
        ("shards:\n- sources: []\n", 2, 'has no "id"'),
        ("shards:\n- id: a-1\n- id: b-2\n- id: a-1\n", 4, "listed twice (first on line 2)"),
        ("shards:\n- id: a-1\n  hot_standbys: -1\n", 3, "out of range"),
        ("shards:\n- id: a-1\n  max_txn_duration: 60\n", 3, '"max_txn_duration"'),
        ("shards:\n- id: a-1\n  disable: maybe\n", 3, "true or false"),
        ("shards:\n- id: a-1\n  sources:\n  - journal: j/1\n    offset: 3\n", 5, '"min_offset"'),
        ("shards:\n- id: a-1\n  labels:\n  - name: aa\n    prefix: true\n", 5, "unknown key"),
        ("shards: {}\n", 1, "must be a list"),
        ("- id: a-1\n", 1, "expected a mapping"),
        ("shards:\n- id: a-1\n  revision: [1]\n", 3, "must be an integer"),
        ("shards:\n  - id: [a\n", 3, "invalid YAML"),
    ],
)
def test_bad_shardspace_yaml_is_one_line_naming_where(text: str, line: int, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        decode_shardspace(text)
    message = str(caught.value)
    assert caught.value.line == line, message
    assert words in message, message
    assert "\n" not in message
