"""The consumer protocol's rules (upstream's shard_spec_extensions and key_space): ShardSpec
validation, desired replication, recovery-log and hint names, replica statuses, the spec algebra
shardspace YAML relies on, and the shard keyspace decoded from a real etcd."""

from __future__ import annotations

import logging

import aetcd
import pytest
from google.protobuf import duration_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import keyspace as aks
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError
from consumer.keyspace import consumer_decoder, consumer_rules, shard_is_consistent
from consumer.protocol import (
    cpb,
    desired_replication,
    hint_backup_keys,
    hint_primary_key,
    intersect_shard_specs,
    recovery_log,
    reduce_status,
    subtract_shard_specs,
    truncate_error,
    union_shard_specs,
    validate_consumer_spec,
    validate_replica_status,
    validate_shard_spec,
)
from keyspace import KeySpace, KeyValue

SECOND = duration_pb2.Duration(seconds=1)


def shard(**fields: object) -> cpb.ShardSpec:
    spec = cpb.ShardSpec(
        id="shard-A",
        sources=[cpb.ShardSpec.Source(journal="journal/A")],
        recovery_log_prefix="recovery/logs",
        hint_prefix="/hints",
        hint_backups=2,
        max_txn_duration=SECOND,
        min_txn_duration=duration_pb2.Duration(nanos=1_000_000),
        hot_standbys=1,
        labels=labels.label_set(("name-1", "val-1")),
    )
    for name, value in fields.items():
        if isinstance(value, list):
            spec.ClearField(name)
            getattr(spec, name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(spec, name).CopyFrom(value)
        else:
            setattr(spec, name, value)
    return spec


def refused(spec: cpb.ShardSpec, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as caught:
        validate_shard_spec(spec, field="shards[0]")
    assert caught.value.field == field, str(caught.value)
    assert words in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


# ---- ShardSpec -----------------------------------------------------------------------------------


def test_a_well_formed_shard_spec_is_valid() -> None:
    validate_shard_spec(shard())
    validate_shard_spec(shard(recovery_log_prefix="", hint_prefix=""))  # No recovery log at all.
    validate_shard_spec(shard(sources=[]))  # Sources are optional (a shard may only produce).
    with_meta = cpb.ShardSpec.Source(journal="journal/A;derived/x")
    validate_shard_spec(shard(sources=[with_meta]))  # Sources may name a ;meta segment.


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"id": "abc"}, "shards[0].id", "too short"),
        ({"id": "a b c d"}, "shards[0].id", "not allowed"),
        ({"recovery_log_prefix": "logs/"}, "shards[0].recovery_log_prefix", "recovery log"),
        ({"recovery_log_prefix": "", "hint_prefix": "/h"}, "shards[0].hint_prefix", "empty"),
        ({"hint_prefix": "hints"}, "shards[0].hint_prefix", "absolute, clean"),
        ({"hint_prefix": "/hints/../x"}, "shards[0].hint_prefix", "absolute, clean"),
        ({"hint_prefix": "/hints/"}, "shards[0].hint_prefix", "absolute, clean"),
        ({"hint_backups": -1}, "shards[0].hint_backups", "negative"),
        (
            {"min_txn_duration": duration_pb2.Duration(seconds=-1)},
            "shards[0].min_txn_duration",
            "-1s is negative",
        ),
        ({"max_txn_duration": duration_pb2.Duration()}, "shards[0].max_txn_duration", "0s"),
        (
            {"labels": pb.LabelSet(labels=[pb.Label(name="bb", value="1"), pb.Label(name="aa")])},
            "shards[0].labels[1].name",
            "not sorted",
        ),
        (
            {"labels": labels.label_set(("content-type", "a/b"), ("content-type", "c/d"))},
            "shards[0].labels[1].value",
            "only one value",
        ),
        ({"labels": labels.label_set(("id", "x"))}, "shards[0].labels", '"id"'),
        (
            {"sources": [cpb.ShardSpec.Source(journal="/rooted/journal")]},
            "shards[0].sources[0].journal",
            "'/'",
        ),
        (
            {"sources": [cpb.ShardSpec.Source(journal="journal/A", min_offset=-1)]},
            "shards[0].sources[0].min_offset",
            "negative",
        ),
        (
            {"sources": [cpb.ShardSpec.Source(journal=j) for j in ("journal/B", "journal/A")]},
            "shards[0].sources[1].journal",
            "unique and sorted",
        ),
        (
            {"sources": [cpb.ShardSpec.Source(journal=j) for j in ("journal/A", "journal/A")]},
            "shards[0].sources[1].journal",
            "unique and sorted",
        ),
    ],
)
def test_each_rule_of_a_shard_spec_names_its_field(
    fields: dict[str, object], field: str, words: str
) -> None:
    refused(shard(**fields), field, words)


def test_names_derived_from_a_shard_spec() -> None:
    spec = shard(hint_backups=3)
    assert recovery_log(spec) == "recovery/logs/shard-A"
    assert recovery_log(shard(recovery_log_prefix="")) == ""
    assert hint_primary_key(spec) == "/hints/shard-A.primary"
    assert hint_backup_keys(spec) == [f"/hints/shard-A.backup.{i}" for i in range(3)]
    assert hint_backup_keys(shard(hint_backups=0)) == []


@pytest.mark.parametrize(
    ("disable", "standbys", "cap", "want"),
    [(False, 0, 3, 1), (False, 1, 3, 2), (False, 7, 3, 4), (True, 2, 3, 0), (False, 2, 0, 1)],
)
def test_desired_replication_is_a_primary_and_capped_standbys(
    disable: bool, standbys: int, cap: int, want: int
) -> None:
    assert desired_replication(shard(disable=disable, hot_standbys=standbys), cap) == want


def test_a_consumer_spec_needs_a_valid_process() -> None:
    good = cpb.ConsumerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="local", suffix="consumer-0"), endpoint="http://127.0.0.1:1"
        ),
        shard_limit=32,
    )
    validate_consumer_spec(good)
    bad = cpb.ConsumerSpec()
    bad.CopyFrom(good)
    bad.process_spec.id.suffix = "c0"
    with pytest.raises(ValidationError) as caught:
        validate_consumer_spec(bad)
    assert caught.value.field == "process_spec.id.suffix"


# ---- statuses --------------------------------------------------------------------------------------


def test_replica_statuses_fail_exactly_with_errors() -> None:
    validate_replica_status(cpb.ReplicaStatus())
    validate_replica_status(cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=["boom"]))
    for bad, field in [
        (cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED), "errors"),
        (cpb.ReplicaStatus(code=cpb.ReplicaStatus.PRIMARY, errors=["boom"]), "code"),
        (cpb.ReplicaStatus(code=250), "code"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValidationError) as caught:
            validate_replica_status(bad)
        assert caught.value.field == field


def test_statuses_reduce_to_the_largest_code_with_every_error() -> None:
    statuses = [
        cpb.ReplicaStatus(code=cpb.ReplicaStatus.STANDBY),
        cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=["one"]),
        cpb.ReplicaStatus(code=cpb.ReplicaStatus.PRIMARY),
        cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=["two", "three"]),
    ]
    reduced = reduce_status(statuses)
    assert reduced.code == cpb.ReplicaStatus.FAILED
    assert list(reduced.errors) == ["one", "two", "three"]
    assert reduce_status([]).code == cpb.ReplicaStatus.IDLE
    assert reduce_status(statuses[:1] + statuses[2:3]).code == cpb.ReplicaStatus.PRIMARY


def test_a_long_error_is_cut_and_marked() -> None:
    assert truncate_error("short") == "short"
    exact = "é" * 2048  # Characters, not bytes.
    assert truncate_error(exact) == exact
    cut = truncate_error("x" * 5000)
    assert cut == "x" * 2048 + " ...[truncated]"


# ---- the spec algebra --------------------------------------------------------------------------


def test_upstreams_fixture_hoists_and_pushes_down() -> None:
    """The two shards of upstream's shardspace fixture: their common part is what both hold,
    and pushing it back down restores each."""
    common_part = {
        "recovery_log_prefix": "recovery/logs",
        "hint_prefix": "/hints",
        "hint_backups": 2,
        "max_txn_duration": SECOND,
        "min_txn_duration": duration_pb2.Duration(nanos=1_000_000),
        "hot_standbys": 1,
        "disable_wait_for_ack": True,
    }
    a = shard(
        **common_part,
        sources=[cpb.ShardSpec.Source(journal="journal/A")],
        labels=labels.label_set(("name-1", "val-1"), ("name-2", "val-2")),
    )
    b = shard(
        **common_part,
        id="shard-B",
        sources=[cpb.ShardSpec.Source(journal="journal/B")],
        disable=True,
        labels=labels.label_set(("name-1", "val-1"), ("name-3", "val-3")),
    )
    common = intersect_shard_specs(a, b)
    assert not common.sources and not common.disable
    assert common.recovery_log_prefix == "recovery/logs" and common.hint_backups == 2
    assert common.labels == labels.label_set(("name-1", "val-1"))
    rest_a = subtract_shard_specs(a, common)
    assert rest_a.labels == labels.label_set(("name-2", "val-2"))
    assert not rest_a.recovery_log_prefix and not rest_a.HasField("max_txn_duration")
    assert union_shard_specs(rest_a, common) == a
    assert union_shard_specs(subtract_shard_specs(b, common), common) == b


def normalized(spec: cpb.ShardSpec) -> cpb.ShardSpec:
    """`spec` without empty messages set (a zero duration, no labels), which read as absent."""
    for name in ("max_txn_duration", "min_txn_duration", "labels"):
        if spec.HasField(name) and not getattr(spec, name).ListFields():
            spec.ClearField(name)
    return spec


_SPEC_FIELDS = st.fixed_dictionaries(
    {
        "sources": st.lists(
            st.sampled_from(["journal/A", "journal/B", "journal/C"]), unique=True
        ).map(lambda js: [cpb.ShardSpec.Source(journal=j) for j in sorted(js)]),
        "recovery_log_prefix": st.sampled_from(["", "logs/a", "logs/b"]),
        "hint_backups": st.integers(0, 2),
        "max_txn_duration": st.sampled_from([0, 1, 2]).map(
            lambda s: duration_pb2.Duration(seconds=s)
        ),
        "disable": st.booleans(),
        "hot_standbys": st.integers(0, 2),
        "labels": st.lists(
            st.tuples(st.sampled_from(["aa", "bb", "cc"]), st.sampled_from(["1", "2"])),
            unique_by=lambda t: t[0],
        ).map(lambda pairs: labels.label_set(*pairs)),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_SPEC_FIELDS, min_size=1, max_size=4))
def test_hoisting_then_pushing_down_restores_every_spec(many: list[dict[str, object]]) -> None:
    specs = [normalized(shard(id=f"shard-{i:02d}", **fields)) for i, fields in enumerate(many)]
    common = specs[0]
    for spec in specs[1:]:
        common = intersect_shard_specs(common, spec)
    for spec in specs:
        rest = subtract_shard_specs(spec, common)
        restored = union_shard_specs(rest, common)
        # A boolean (or zero) field both hold as false cannot be told apart from absent, so
        # equality is the round trip's whole promise.
        assert restored == spec, (spec, common, rest)


# ---- the shard keyspace ------------------------------------------------------------------------


def kv(key: str, decoded: object) -> KeyValue:
    return KeyValue(
        key=key, raw=b"", decoded=decoded, create_revision=1, mod_revision=1, version=1, lease=0
    )


def assignment(slot: int, code: int, member: str) -> KeyValue:
    status = cpb.ReplicaStatus(code=code)  # type: ignore[arg-type]
    if code == cpb.ReplicaStatus.FAILED:
        status.errors.append("failed")
    return kv(f"a{slot}", aks.Assignment("shard-A", "local", member, slot, status))


@pytest.mark.parametrize(
    ("codes", "consistent"),
    [
        ((cpb.ReplicaStatus.PRIMARY, cpb.ReplicaStatus.STANDBY), [True, True]),
        ((cpb.ReplicaStatus.PRIMARY, cpb.ReplicaStatus.BACKFILL), [True, False]),
        ((cpb.ReplicaStatus.IDLE, cpb.ReplicaStatus.STANDBY), [False, True]),
        ((cpb.ReplicaStatus.PRIMARY, cpb.ReplicaStatus.FAILED), [True, False]),
        ((cpb.ReplicaStatus.FAILED, cpb.ReplicaStatus.FAILED), [True, True]),
        ((cpb.ReplicaStatus.FAILED, cpb.ReplicaStatus.BACKFILL), [True, False]),
    ],
)
def test_a_replica_is_consistent_once_it_could_take_over(
    codes: tuple[int, int], consistent: list[bool]
) -> None:
    every = [assignment(slot, code, f"member-{slot}") for slot, code in enumerate(codes)]
    item = aks.Item("shard-A", shard())
    assert [shard_is_consistent(item, a, every) for a in every] == consistent


def test_consumer_rules_read_shard_and_consumer_specs() -> None:
    rules = consumer_rules(max_hot_standbys=1)
    assert rules.desired_replication(aks.Item("shard-A", shard(hot_standbys=5))) == 2
    member = aks.Member("local", "consumer-0", cpb.ConsumerSpec(shard_limit=7, exiting=True))
    assert rules.member_limit(member) == 7 and rules.member_exiting(member)
    with pytest.raises(TypeError):
        rules.desired_replication(aks.Item("j", pb.JournalSpec(name="j")))
    with pytest.raises(ValueError):
        consumer_rules(max_hot_standbys=-1)


async def test_the_shard_keyspace_decodes_from_etcd(
    etcd: aetcd.Client, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Upstream's layout in a real etcd: the spec, the member, an IDLE assignment (empty bytes)
    and a FAILED one decode; a spec whose id differs from its key, one that breaks a rule, and a
    member under another's key are refused (logged, left out), as upstream's decoder does."""
    root = etcd_prefix + "/consumers"
    consumer = cpb.ConsumerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="local", suffix="consumer-0"),
            endpoint="http://127.0.0.1:8081",
        ),
        shard_limit=32,
    )
    failed = cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=["store: gone"])
    writes: list[tuple[str, bytes]] = [
        (aks.item_key(root, "shard-A"), shard().SerializeToString()),
        (aks.item_key(root, "shard-X"), shard().SerializeToString()),  # id differs from key
        (aks.item_key(root, "shard-Y"), shard(id="shard-Y", hint_prefix="rel").SerializeToString()),
        (aks.member_key(root, "local", "consumer-0"), consumer.SerializeToString()),
        (aks.member_key(root, "local", "consumer-9"), consumer.SerializeToString()),
        (aks.assignment_key(root, "shard-A", "local", "consumer-0", 0), b""),
        (aks.assignment_key(root, "shard-A", "local", "consumer-1", 1), failed.SerializeToString()),
    ]
    for key, value in writes:
        await etcd.put(key.encode(), value)
    ks = KeySpace(root, consumer_decoder(root))
    with caplog.at_level(logging.WARNING):
        await ks.load(etcd)

    item = ks.get(aks.item_key(root, "shard-A"))
    assert item is not None and isinstance(item.decoded, aks.Item)
    assert item.decoded.spec == shard()
    for refused_key in ("items/shard-X", "items/shard-Y", "members/local#consumer-9"):
        got = ks.get(f"{root}/{refused_key}")
        assert got is None or got.decoded is None, refused_key
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "shard-X" in logged and "shard-Y" in logged and "consumer-9" in logged

    assigned = [a.decoded for a in ks.prefixed(root + aks.ASSIGNMENTS)]
    assert all(isinstance(a, aks.Assignment) for a in assigned)
    codes = [a.value.code for a in assigned]  # type: ignore[union-attr]
    assert codes == [cpb.ReplicaStatus.IDLE, cpb.ReplicaStatus.FAILED]

    # Routes of shards carry the consumers' endpoints.
    def member(zone: str, suffix: str) -> aks.Member | None:
        found = ks.get(aks.member_key(root, zone, suffix))
        decoded = found.decoded if found is not None else None
        return decoded if isinstance(decoded, aks.Member) else None

    route = aks.build_route(ks.prefixed(root + aks.ASSIGNMENTS + "shard-A#"), member)
    assert route.primary == 0
    assert list(route.endpoints) == ["http://127.0.0.1:8081", ""]
