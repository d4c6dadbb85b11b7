"""The Shard service's keyspace RPCs (List, Apply, GetHints, Unassign) against a real etcd, with
the consumer keyspace mirrored and watched as a consumer process mirrors it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import aetcd
import pytest
from google.protobuf import duration_pb2

from allocator import keyspace as aks
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import ValidationError, quote
from consumer.keyspace import shard_keyspace
from consumer.protocol import cpb
from consumer.recoverylog.hints import encode_hints
from consumer.shard_api import (
    HintsError,
    JournalsUnavailable,
    NotAuthorized,
    ShardState,
    apply_shards,
    get_hints,
    list_shards,
    unassign_shards,
)
from plumbing import auth

PID = pb.ProcessSpec.ID(zone="local", suffix="consumer-a")


@pytest.fixture
async def state(etcd: aetcd.Client, etcd_prefix: str) -> AsyncIterator[ShardState]:
    root = etcd_prefix + "/consumers"
    ks = shard_keyspace(root, apply_delay=0.0)
    await ks.load(etcd)
    watch = asyncio.create_task(ks.watch(etcd))
    try:
        yield ShardState(etcd, ks, root, PID)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


def spec(shard_id: str, **fields: object) -> cpb.ShardSpec:
    out = cpb.ShardSpec(
        id=shard_id,
        sources=[cpb.ShardSpec.Source(journal=f"input/{shard_id}")],
        recovery_log_prefix="recovery/logs",
        hint_backups=2,
        max_txn_duration=duration_pb2.Duration(seconds=1),
    )
    for name, value in fields.items():
        if hasattr(value, "CopyFrom"):
            getattr(out, name).CopyFrom(value)
        else:
            setattr(out, name, value)
    return out


def rooted(state: ShardState, s: cpb.ShardSpec) -> cpb.ShardSpec:
    """`s` as stored: its empty hint prefix filled in with the consumer's hint root."""
    out = cpb.ShardSpec()
    out.CopyFrom(s)
    out.hint_prefix = out.hint_prefix or state.hint_root
    return out


def upsert(s: cpb.ShardSpec, revision: int = 0, **kw: object) -> cpb.ApplyRequest.Change:
    return cpb.ApplyRequest.Change(upsert=s, expect_mod_revision=revision, **kw)  # type: ignore[arg-type]


def hints_for(log: str) -> rpb.FSMHints:
    hints = rpb.FSMHints(log=log)
    hints.live_nodes.add(fnode=3).segments.add(
        author=0x1234, first_seq_no=3, first_offset=100, last_seq_no=9
    )
    return hints


async def test_apply_creates_and_list_shows_shards_by_selector(state: ShardState) -> None:
    hints = hints_for("recovery/logs/shard-a")
    shard_a = spec("shard-a", labels=labels.label_set(("app", "sum")))
    shard_b = spec("shard-b", labels=labels.label_set(("app", "count")))
    applied = await apply_shards(
        state,
        cpb.ApplyRequest(changes=[upsert(shard_a, primary_hints=hints), upsert(shard_b)]),
    )
    assert applied.status == cpb.OK and applied.header.etcd.revision > 0
    assert applied.header.process_id == PID

    listed = list_shards(state, cpb.ListRequest())  # Read-your-writes: no wait needed.
    assert [s.spec for s in listed.shards] == [rooted(state, shard_a), rooted(state, shard_b)]
    for shard in listed.shards:
        assert shard.mod_revision == shard.create_revision == applied.header.etcd.revision
        assert shard.route.primary == -1 and not shard.status
    by_id = cpb.ListRequest(selector=pb.LabelSelector(include=labels.label_set(("id", "shard-b"))))
    assert [s.spec.id for s in list_shards(state, by_id).shards] == ["shard-b"]
    by_label = cpb.ListRequest(
        selector=pb.LabelSelector(exclude=labels.label_set(("app", "count")))
    )
    assert [s.spec.id for s in list_shards(state, by_label).shards] == ["shard-a"]

    stored = await state.etcd.get(f"{state.hint_root}/shard-a.primary".encode())
    assert stored is not None and stored.value == encode_hints(hints)


async def test_apply_is_all_or_nothing_on_revisions(state: ShardState) -> None:
    first = await apply_shards(state, cpb.ApplyRequest(changes=[upsert(spec("shard-a"))]))
    revision = first.header.etcd.revision
    again = cpb.ApplyRequest(changes=[upsert(spec("shard-b")), upsert(spec("shard-a"))])
    failed = await apply_shards(state, again)  # shard-a exists: 0 no longer matches.
    assert failed.status == cpb.ETCD_TRANSACTION_FAILED
    assert [s.spec.id for s in list_shards(state, cpb.ListRequest()).shards] == ["shard-a"]

    updated = spec("shard-a", hot_standbys=2)
    ok = await apply_shards(state, cpb.ApplyRequest(changes=[upsert(updated, revision)]))
    assert ok.status == cpb.OK
    stale = cpb.ApplyRequest(
        changes=[cpb.ApplyRequest.Change(delete="shard-a", expect_mod_revision=revision)]
    )
    assert (await apply_shards(state, stale)).status == cpb.ETCD_TRANSACTION_FAILED
    forced = cpb.ApplyRequest(
        changes=[cpb.ApplyRequest.Change(delete="shard-a", expect_mod_revision=-1)]
    )
    assert (await apply_shards(state, forced)).status == cpb.OK
    assert list_shards(state, cpb.ListRequest()).shards == []


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (cpb.ApplyRequest.Change(), "changes[0]", "neither upsert nor delete"),
        (
            cpb.ApplyRequest.Change(upsert=spec("shard-a"), delete="shard-a"),
            "changes[0]",
            "both upsert and delete",
        ),
        (cpb.ApplyRequest.Change(delete="shard-a"), "changes[0].expect_mod_revision", "delete"),
        (
            cpb.ApplyRequest.Change(upsert=spec("shard-a", hint_prefix="relative")),
            "changes[0].upsert.hint_prefix",
            "absolute",
        ),
        (
            cpb.ApplyRequest.Change(upsert=spec("shard-a"), expect_mod_revision=-2),
            "changes[0].expect_mod_revision",
            "-2",
        ),
        (
            cpb.ApplyRequest.Change(
                delete="shard-a", expect_mod_revision=5, primary_hints=rpb.FSMHints()
            ),
            "changes[0].primary_hints",
            "only with an upsert",
        ),
        (
            cpb.ApplyRequest.Change(
                upsert=spec("shard-a"),
                primary_hints=rpb.FSMHints(
                    live_nodes=[rpb.FnodeSegments(segments=[rpb.Segment(first_seq_no=1)])]
                ),
            ),
            "changes[0].primary_hints.live_nodes[0].segments[0]",
            "author is zero",
        ),
    ],
)
async def test_a_malformed_apply_names_the_change_and_writes_nothing(
    state: ShardState, change: cpb.ApplyRequest.Change, field: str, words: str
) -> None:
    fine = upsert(spec("shard-z"))
    with pytest.raises(ValidationError) as caught:
        await apply_shards(state, cpb.ApplyRequest(changes=[change, fine]))
    assert caught.value.field == field, str(caught.value)
    assert words in str(caught.value)
    assert list_shards(state, cpb.ListRequest()).shards == []


async def test_a_shard_changed_twice_in_one_apply_is_refused(state: ShardState) -> None:
    twice = cpb.ApplyRequest(changes=[upsert(spec("shard-a")), upsert(spec("shard-a"))])
    with pytest.raises(ValidationError, match=r"also changed by changes\[0\]"):
        await apply_shards(state, twice)


async def put_assignment(
    state: ShardState, shard_id: str, suffix: str, slot: int, status: cpb.ReplicaStatus
) -> int:
    key = aks.assignment_key(state.root, shard_id, "local", suffix, slot)
    put = await state.etcd.put(key.encode(), status.SerializeToString())
    revision: int = put.header.revision
    return revision


async def put_member(state: ShardState, suffix: str, port: int) -> None:
    member = cpb.ConsumerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="local", suffix=suffix),
            endpoint=f"http://127.0.0.1:{port}",
        ),
        shard_limit=8,
    )
    await state.etcd.put(
        aks.member_key(state.root, "local", suffix).encode(), member.SerializeToString()
    )


FAILED = cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=["store: unreachable"])
PRIMARY = cpb.ReplicaStatus(code=cpb.ReplicaStatus.PRIMARY)
STANDBY = cpb.ReplicaStatus(code=cpb.ReplicaStatus.STANDBY)


async def test_list_gives_routes_with_endpoints_and_a_status_per_member(
    state: ShardState,
) -> None:
    await apply_shards(state, cpb.ApplyRequest(changes=[upsert(spec("shard-a", hot_standbys=1))]))
    await put_member(state, "consumer-a", 9001)
    await put_member(state, "consumer-b", 9002)
    await put_assignment(state, "shard-a", "consumer-b", 0, PRIMARY)
    revision = await put_assignment(state, "shard-a", "consumer-a", 1, STANDBY)
    await state.ks.wait_for_revision(revision, timeout=5)

    (shard,) = list_shards(state, cpb.ListRequest()).shards
    assert [m.suffix for m in shard.route.members] == ["consumer-a", "consumer-b"]
    assert shard.route.primary == 1
    assert list(shard.route.endpoints) == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [s.code for s in shard.status] == [cpb.ReplicaStatus.STANDBY, cpb.ReplicaStatus.PRIMARY]


async def test_get_hints_reads_primary_and_backups_checked(state: ShardState) -> None:
    shard_a = spec("shard-a")
    log = "recovery/logs/shard-a"
    await apply_shards(
        state, cpb.ApplyRequest(changes=[upsert(shard_a, primary_hints=hints_for(log))])
    )
    backup = hints_for(log)
    backup.live_nodes[0].segments[0].last_seq_no = 5
    # A backup stored as protobuf (older tooling), the other missing.
    await state.etcd.put(f"{state.hint_root}/shard-a.backup.0".encode(), backup.SerializeToString())
    got = await get_hints(state, cpb.GetHintsRequest(shard="shard-a"))
    assert got.status == cpb.OK
    assert got.primary_hints.hints == hints_for(log)
    assert [b.HasField("hints") for b in got.backup_hints] == [True, False]
    assert got.backup_hints[0].hints == backup

    missing = await get_hints(state, cpb.GetHintsRequest(shard="shard-x"))
    assert missing.status == cpb.SHARD_NOT_FOUND

    await state.etcd.put(
        f"{state.hint_root}/shard-a.backup.1".encode(), encode_hints(hints_for("a/b/c"))
    )
    with pytest.raises(HintsError, match="not the shard's 'recovery/logs/shard-a'"):
        await get_hints(state, cpb.GetHintsRequest(shard="shard-a"))
    await state.etcd.put(f"{state.hint_root}/shard-a.backup.1".encode(), b'{"log": 7}')
    with pytest.raises(HintsError, match=r"backup\.1: hints\.log: expected a JSON str"):
        await get_hints(state, cpb.GetHintsRequest(shard="shard-a"))


async def test_unassign_removes_failed_replicas_and_the_primary_unless_only_failed(
    state: ShardState,
) -> None:
    await apply_shards(
        state,
        cpb.ApplyRequest(changes=[upsert(spec("shard-a")), upsert(spec("shard-b"))]),
    )
    await put_assignment(state, "shard-a", "consumer-a", 0, PRIMARY)
    await put_assignment(state, "shard-a", "consumer-b", 1, FAILED)
    revision = await put_assignment(state, "shard-b", "consumer-b", 0, PRIMARY)
    await state.ks.wait_for_revision(revision, timeout=5)

    def assigned() -> list[str]:
        return [kv.key.rsplit("/", 1)[-1] for kv in state.ks.prefixed(state.root + aks.ASSIGNMENTS)]

    before = assigned()
    dry = await unassign_shards(
        state, cpb.UnassignRequest(shards=["shard-a", "shard-b"], dry_run=True)
    )
    assert list(dry.shards) == ["shard-a", "shard-b"] and assigned() == before

    only = await unassign_shards(
        state, cpb.UnassignRequest(shards=["shard-a", "shard-b"], only_failed=True)
    )
    assert only.status == cpb.OK and list(only.shards) == ["shard-a"]
    assert assigned() == ["shard-a#local#consumer-a#0", "shard-b#local#consumer-b#0"]

    every = await unassign_shards(state, cpb.UnassignRequest(shards=["shard-a"]))
    assert list(every.shards) == ["shard-a"]
    assert assigned() == ["shard-b#local#consumer-b#0"]
    with pytest.raises(ValidationError) as caught:
        await unassign_shards(state, cpb.UnassignRequest(shards=["shard-b", "no"]))
    assert caught.value.field == "shards[1]"


# ---- hint keys: the consumer's hint root, or unchanged (issue 37) ------------------------------


async def test_an_empty_hint_prefix_is_filled_in_and_the_callers_request_left_as_is(
    state: ShardState,
) -> None:
    shard_a = spec("shard-a")
    assert state.hint_root == state.root + "/hints" and not shard_a.hint_prefix
    request = cpb.ApplyRequest(changes=[upsert(shard_a, primary_hints=hints_for("recovery/logs/shard-a"))])  # fmt: skip
    before = request.SerializeToString()
    assert (await apply_shards(state, request)).status == cpb.OK
    assert request.SerializeToString() == before
    (listed,) = list_shards(state, cpb.ListRequest()).shards
    assert listed.spec.hint_prefix == state.hint_root
    assert await state.etcd.get(f"{state.hint_root}/shard-a.primary".encode()) is not None
    # Stored explicitly, it applies again as listed (as `gazctl shards list -o yaml` gives it).
    again = cpb.ApplyRequest(changes=[upsert(listed.spec, listed.mod_revision)])
    assert (await apply_shards(state, again)).status == cpb.OK


async def test_a_hint_prefix_is_the_hint_root_or_unchanged_from_the_spec_it_replaces(
    state: ShardState,
) -> None:
    """An upstream-era spec (its hints under a prefix its creator chose) stays re-applicable
    as it stands; no spec moves its hints elsewhere, and none is created with another prefix."""
    legacy = spec("shard-a", hint_prefix="/gazette-test-legacy-hints")
    put = await state.etcd.put(
        aks.item_key(state.root, "shard-a").encode(), legacy.SerializeToString()
    )
    await state.ks.wait_for_revision(put.header.revision, timeout=5)
    for revision in (put.header.revision, -1):
        replaced = await apply_shards(state, cpb.ApplyRequest(changes=[upsert(legacy, revision)]))
        assert replaced.status == cpb.OK
    (listed,) = list_shards(state, cpb.ListRequest()).shards
    assert listed.spec.hint_prefix == "/gazette-test-legacy-hints"

    moved = spec("shard-a", hint_prefix="/gazette-test-legacy-hints/elsewhere")
    created = spec("shard-b", hint_prefix="/gazette-test-legacy-hints")
    for change in (upsert(moved, -1), upsert(created, 0), upsert(created, -1)):
        with pytest.raises(ValidationError) as caught:
            await apply_shards(state, cpb.ApplyRequest(changes=[change]))
        assert caught.value.field == "changes[0].upsert.hint_prefix"
        assert str(caught.value) == (
            f"changes[0].upsert.hint_prefix: {quote(change.upsert.hint_prefix)} is not this "
            f"consumer's hint root: use {state.hint_root} (or leave it empty); another prefix "
            "is kept only unchanged from the spec it replaces"
        )
    assert [s.spec for s in list_shards(state, cpb.ListRequest()).shards] == [listed.spec]
    # Moving it to the hint root is allowed: the root is every shard's.
    assert (await apply_shards(state, cpb.ApplyRequest(changes=[upsert(spec("shard-a"), -1)]))).status == cpb.OK  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (
            upsert(spec("shard-a", hint_backups=17)),
            "changes[0].upsert.hint_backups",
            "17 is more than 16 (a shard keeps at most 16 backups of its hints)",
        ),
        (
            upsert(spec("shard-a", recovery_log_prefix=""), primary_hints=rpb.FSMHints()),
            "changes[0].primary_hints",
            "shard shard-a has no recovery log, so it keeps no hints (leave them out)",
        ),
        (
            upsert(spec("shard-a"), primary_hints=hints_for("recovery/logs/shard-b")),
            "changes[0].primary_hints.log",
            "names recovery/logs/shard-b, not the shard's recovery log recovery/logs/shard-a",
        ),
    ],
)
async def test_hint_backups_are_bounded_and_primary_hints_are_for_the_shards_own_log(
    state: ShardState, change: cpb.ApplyRequest.Change, field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        await apply_shards(state, cpb.ApplyRequest(changes=[change, upsert(spec("shard-z"))]))
    assert caught.value.field == field and str(caught.value) == f"{field}: {words}"
    assert list_shards(state, cpb.ListRequest()).shards == []
    assert await state.etcd.get(b"/shard-a.primary") is None


async def test_a_restricted_apply_that_cannot_look_journals_up_is_refused(
    state: ShardState,
) -> None:
    """Whose journals the sources and log are is the brokers' to say: a consumer that cannot
    ask them (no lookup here) refuses a restricted caller, and never accepts."""
    claims = auth.Claims(auth.ALL, pb.LabelSelector(include=labels.label_set(("team", "x"))))
    mine = spec("shard-a", labels=labels.label_set(("team", "x")))
    with pytest.raises(JournalsUnavailable):
        await apply_shards(state, cpb.ApplyRequest(changes=[upsert(mine)]), claims)
    assert list_shards(state, cpb.ListRequest()).shards == []


async def test_hint_keys_under_the_consumer_root_are_left_out_of_the_mirror_quietly(
    state: ShardState, caplog: pytest.LogCaptureFixture
) -> None:
    """The hint root is inside the consumer's keyspace, but not in its mirror: hints are read
    from etcd where needed, so they are neither held in every process's memory nor logged as
    undecodable, and a batch of hint writes changes nothing observers would wake for."""
    log = "recovery/logs/shard-a"
    applied = await apply_shards(
        state, cpb.ApplyRequest(changes=[upsert(spec("shard-a"), primary_hints=hints_for(log))])
    )
    await state.ks.wait_for_revision(applied.header.etcd.revision, timeout=5)
    key = f"{state.hint_root}/shard-a.primary"
    assert state.ks.get(key) is None and state.ks.prefixed(state.hint_root) == []
    assert state.ks.get(aks.item_key(state.root, "shard-a")) is not None
    assert (await state.etcd.get(key.encode())) is not None
    updates: list[object] = []
    state.ks.add_observer(updates.append)
    put = await state.etcd.put(key.encode(), b"{}")
    await state.ks.wait_for_revision(put.header.revision, timeout=5)
    assert [u.changes for u in updates] == [()]  # type: ignore[attr-defined]
    assert "failed to decode" not in caplog.text


async def test_get_hints_for_another_log_do_not_name_it_to_a_restricted_caller(
    state: ShardState,
) -> None:
    """Hints at a shard's key that are for another log (left there by whatever shard had its id
    before) are refused to every caller; only an unrestricted one is told which log they name,
    which may be one a restricted caller cannot see."""
    claims = auth.Claims(auth.ALL, pb.LabelSelector(include=labels.label_set(("team", "x"))))
    mine = spec("shard-a", labels=labels.label_set(("team", "x")))
    applied = await apply_shards(state, cpb.ApplyRequest(changes=[upsert(mine)]))
    await state.ks.wait_for_revision(applied.header.etcd.revision, timeout=5)
    key = f"{state.hint_root}/shard-a.backup.1"
    await state.etcd.put(key.encode(), encode_hints(hints_for("hidden/logs/shard-a")))
    with pytest.raises(HintsError) as caught:
        await get_hints(state, cpb.GetHintsRequest(shard="shard-a"), claims)
    assert str(caught.value) == f"hints at {key} are for another log"
    with pytest.raises(HintsError, match="for log 'hidden/logs/shard-a', not the shard's"):
        await get_hints(state, cpb.GetHintsRequest(shard="shard-a"))


async def test_a_restricted_caller_creates_many_shards_in_one_apply(state: ShardState) -> None:
    """Each shard a restricted caller creates has its hint keys compared absent in the
    transaction: two compares a shard (its primary's key and the range of its backups'), not
    one a key, so an Apply of 40 shards stays within etcd's 128 a transaction. (The brokers'
    answer is a fake peer here: tests/escape_shards.py asks real ones.)"""
    claims = auth.Claims(auth.ALL, pb.LabelSelector(include=labels.label_set(("team", "x"))))
    ids = [f"many-{i:02d}" for i in range(40)]

    async def lookup(names: Sequence[str]) -> dict[str, pb.JournalSpec]:
        return {n: pb.JournalSpec(name=n, labels=labels.label_set(("team", "x"))) for n in names}

    restricted = dataclasses.replace(state, journals=lookup)
    shards = [spec(i, labels=labels.label_set(("team", "x"))) for i in ids]
    applied = await apply_shards(
        restricted, cpb.ApplyRequest(changes=[upsert(s) for s in shards]), claims
    )
    assert applied.status == cpb.OK
    await state.ks.wait_for_revision(applied.header.etcd.revision, timeout=5)
    listed = list_shards(state, cpb.ListRequest())
    assert sorted(s.spec.id for s in listed.shards) == ids
    # A backup of one of them left in etcd still refuses its re-creation.
    delete = cpb.ApplyRequest.Change(delete=ids[0], expect_mod_revision=-1)
    await apply_shards(state, cpb.ApplyRequest(changes=[delete]))
    await state.etcd.put(f"{state.hint_root}/{ids[0]}.backup.15".encode(), b"{}")
    with pytest.raises(NotAuthorized):
        await apply_shards(restricted, cpb.ApplyRequest(changes=[upsert(shards[0])]), claims)
