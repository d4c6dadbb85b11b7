"""Escape attempts through the fields of a Shard Apply that name resources: `hint_prefix` (with the
shard's `id`, the etcd keys its hints are written to), `hint_backups` (how many such keys),
`recovery_log_prefix` (the journal the shard fences and replays), `sources[].journal` (journals
the shard reads with the consumer's credentials) and `primary_hints` (written to the hint key, and
naming the logs a primary plays). Made by a `team=x` token with every capability against a real
consumer over real brokers and etcd. Each generated attempt is refused, and the victim's keys are
read back from etcd unchanged; the refusals of a hidden and of an absent journal are the same.
Collected through tests/test_tenant_escape.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from allocator import keyspace as aks
from broker.protocol import consumer_pb2 as cpb
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness
from consumer.recoverylog.hints import decode_hints, encode_hints
from consumer.testing import ConsumerGroup, shard_spec
from plumbing import auth
from plumbing.credentials import Credentials
from tests.helpers.consumers import WordTotals
from tests.helpers.tenancy import KEYS, SIGNER, admin, md, spec, team

__all__ = [
    "shards_world",
    "test_a_hidden_or_absent_recovery_log_or_source_is_refused_identically",
    "test_a_hint_prefix_outside_the_consumers_hint_root_is_refused_and_writes_nothing",
    "test_a_huge_hint_backups_is_refused_in_one_line",
    "test_a_shard_without_a_recovery_log_probes_no_key_its_id_spells",
    "test_an_operator_recreates_a_deleted_shard_over_its_hints_and_a_tenant_after_they_go",
    "test_an_unreachable_broker_refuses_a_restricted_apply_unavailable",
    "test_hints_a_deleted_shard_left_behind_are_not_read_by_whoever_recreates_its_id",
    "test_hints_a_deleted_shard_left_behind_do_not_reveal_its_log_to_whoever_recreates_its_id",
    "test_hints_without_a_recovery_log_cannot_name_a_key_outside_the_hint_root",
    "test_primary_hints_cannot_name_a_hidden_log",
    "test_the_tenants_own_shard_with_the_hint_root_and_its_own_journals_is_applied",
]

LOGS_X, LOGS_Y = "esc-x/logs", "esc-y/logs"
INPUT_X, INPUT_Y = "esc-x/input", "esc-y/input"
VICTIM = "team-y/shard1"  # Upstream-era: its hints under a prefix of its creator's choosing.
VICTIM_ROOTED = "y-rooted"  # Its hints under the consumer's hint root.
OWN = "x-own"  # The attacker's existing shard, with the hint root.


@dataclass
class ShardsWorld:
    shards: cpb_grpc.ShardStub
    journals: pb_grpc.JournalStub
    etcd: aetcd.Client
    root: str  # The consumer's etcd prefix.
    brokers: str  # The brokers' etcd prefix.
    legacy: str  # The victim's upstream-era hint prefix (outside every keyspace).
    victim_keys: dict[str, bytes]  # Every victim hint key and its value as planted.
    etcd_server: Any
    tmp_path: Path

    @property
    def hint_root(self) -> str:
        return self.root + "/hints"


def victim_hints(log: str) -> rpb.FSMHints:
    hints = rpb.FSMHints(log=log)
    hints.live_nodes.add(fnode=1).segments.add(
        author=0x5EC, first_seq_no=1, first_offset=0, last_seq_no=4
    )
    hints.properties.add(path="/victim", content="the victim's own property")
    return hints


def planted(log: str) -> rpb.FSMHints:
    hints = rpb.FSMHints(log=log)
    hints.live_nodes.add(fnode=1).segments.add(
        author=0xBAD, first_seq_no=1, first_offset=0, last_seq_no=1
    )
    hints.properties.add(path="/planted", content="planted by team x")
    return hints


def log_journal(name: str, owner: str) -> pb.JournalSpec:
    out = spec(name, owner)
    out.labels.labels.insert(0, pb.Label(name="content-type", value="application/x-gazette-recoverylog"))  # fmt: skip
    return out


def apply(*changes: cpb.ApplyRequest.Change) -> cpb.ApplyRequest:
    return cpb.ApplyRequest(changes=list(changes))


def x_token() -> tuple[tuple[str, str], ...]:
    return md(auth.ALL, team("x"))


@pytest.fixture
async def shards_world(etcd_server: Any, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[ShardsWorld]:  # fmt: skip
    unique = uuid.uuid4().hex[:12]
    root = f"/gazette-test-shards/{unique}"
    legacy = f"/gazette-test-legacy-hints/{unique}"
    async with (
        BrokerHarness(etcd_server.endpoint, etcd_prefix, auth_keys=KEYS) as harness,
        aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as etcd,
    ):
        channel = grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://"))
        journals = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        changes = [
            pb.ApplyRequest.Change(upsert=spec(INPUT_X, "x")),
            pb.ApplyRequest.Change(upsert=spec(INPUT_Y, "y")),
            pb.ApplyRequest.Change(upsert=log_journal(f"{LOGS_X}/{OWN}", "x")),
            pb.ApplyRequest.Change(upsert=log_journal(f"{LOGS_X}/x-new", "x")),
            pb.ApplyRequest.Change(upsert=log_journal(f"{LOGS_Y}/{VICTIM}", "y")),
            pb.ApplyRequest.Change(upsert=log_journal(f"{LOGS_Y}/{VICTIM_ROOTED}", "y")),
            pb.ApplyRequest.Change(upsert=log_journal(f"{LOGS_Y}/{OWN}", "y")),
        ]
        await journals.Apply(pb.ApplyRequest(changes=changes), metadata=admin())
        credentials = Credentials(auth=auth.authorizer_of(KEYS))  # The consumer's own, to brokers.
        try:
            async with ConsumerGroup(
                etcd_server, harness.endpoint, root, auth_keys=KEYS, broker_credentials=credentials
            ) as group:
                consumer = await group.start(WordTotals(str(tmp_path)), run_allocator=False)
                shard_channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
                shards = cpb_grpc.ShardStub(shard_channel)  # type: ignore[no-untyped-call]
                # The victims, created by the operator: disabled (nothing runs in these tests).
                victim = shard_spec(VICTIM, [INPUT_Y], labels=[("team", "y")])
                victim.recovery_log_prefix, victim.hint_prefix, victim.hint_backups = LOGS_Y, legacy, 1  # fmt: skip
                victim.disable = True
                rooted = shard_spec(VICTIM_ROOTED, [INPUT_Y], labels=[("team", "y")])
                rooted.recovery_log_prefix, rooted.hint_prefix, rooted.hint_backups = LOGS_Y, root + "/hints", 1  # fmt: skip
                rooted.disable = True
                own = shard_spec(OWN, [INPUT_X], labels=[("team", "x")])
                own.recovery_log_prefix, own.hint_prefix, own.disable = (
                    LOGS_X,
                    root + "/hints",
                    True,
                )
                answer = await shards.Apply(
                    apply(
                        cpb.ApplyRequest.Change(
                            upsert=rooted, primary_hints=victim_hints(f"{LOGS_Y}/{VICTIM_ROOTED}")
                        ),
                        cpb.ApplyRequest.Change(upsert=own),
                    ),
                    metadata=admin(),
                )
                assert answer.status == cpb.OK
                # The upstream-era victim, as an older version (or an operator at etcd) left it:
                # no Apply creates a spec with its hints elsewhere than the hint root now.
                await etcd.put(f"{legacy}/{VICTIM}.primary".encode(), encode_hints(victim_hints(f"{LOGS_Y}/{VICTIM}")))  # fmt: skip
                put = await etcd.put(aks.item_key(root, VICTIM).encode(), victim.SerializeToString())  # fmt: skip
                await consumer.ks.wait_for_revision(put.header.revision, timeout=10)
                victim_keys = {
                    f"{legacy}/{VICTIM}.primary": encode_hints(victim_hints(f"{LOGS_Y}/{VICTIM}")),
                    f"{root}/hints/{VICTIM_ROOTED}.primary": encode_hints(
                        victim_hints(f"{LOGS_Y}/{VICTIM_ROOTED}")
                    ),
                }
                for key, value in victim_keys.items():  # Planted as the test expects.
                    assert await value_at(etcd, key) == value
                try:
                    yield ShardsWorld(
                        shards, journals, etcd, root, etcd_prefix, legacy, victim_keys,
                        etcd_server, tmp_path,
                    )  # fmt: skip
                finally:
                    await shard_channel.close(None)
        finally:
            await etcd.delete_prefix(legacy.encode())
            await channel.close(None)


async def value_at(etcd: aetcd.Client, key: str) -> bytes | None:
    got = await etcd.get(key.encode())
    return None if got is None else bytes(got.value)


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def unchanged(world: ShardsWorld, *created: str, deleted: tuple[str, ...] = ()) -> None:
    """The victims' hint keys hold what was planted; nothing was written for the attacker
    outside the hint root, and its own shard is as it was (`deleted`: victims the operator
    deleted)."""
    for key, value in world.victim_keys.items():
        assert await value_at(world.etcd, key) == value, key
    listed = await world.shards.List(cpb.ListRequest(), metadata=admin())
    by_id = {s.spec.id: s.spec for s in listed.shards}
    assert set(by_id) == {VICTIM, VICTIM_ROOTED, OWN, *created} - set(deleted), sorted(by_id)
    assert by_id[OWN].hint_prefix == world.hint_root
    # Nothing planted in the brokers' keyspace or the consumer's.
    own = tuple(f"{world.hint_root}/{shard_id}.".encode() for shard_id in created)
    for prefix in (world.brokers, world.root):
        for kv in await world.etcd.get_prefix(prefix.encode()):
            if not kv.key.startswith(own):  # The hints of the shards the caller created.
                assert b"planted by team x" not in kv.value, kv.key


# (hint_prefix, shard id) whose keys would land on another tenant's hints, in the brokers'
# keyspace, in the consumer's own items/assign/members subtrees, or anywhere but the consumer's
# hint root; and spellings of the root itself. {root} is the consumer's etcd prefix, {hints} its
# hint root, {brokers} the brokers' prefix, {legacy} the victim's upstream-era hint prefix.
HINT_PREFIX_ATTEMPTS = [
    # Another tenant's hint keys, by prefix and by an id with a '/'.
    ("{legacy}/team-y", "shard1"),
    ("{legacy}", "team-y/shard1"),
    ("{hints}/y", "-rooted"),
    ("{root}", "hints/y-rooted"),
    ("{hints}/team-y", "shard1"),
    # The brokers' keyspace.
    ("{brokers}/items", "esc-x/evil"),
    ("{brokers}/members", "zone-evil"),
    ("{brokers}/assign", "esc-x/input"),
    ("{brokers}", "items/esc-x/evil"),
    # The consumer's own keyspace, outside its hint root.
    ("{root}/items", "x-item"),
    ("{root}/assign", "x-assign"),
    ("{root}/members", "x-member"),
    ("{root}", "x-root"),
    # Spellings of the hint root, and places beside it.
    ("{hints}/", "x-new"),
    ("{hints}/.", "x-new"),
    ("{hints}/x/..", "x-new"),
    ("{root}//hints", "x-new"),
    ("{root}/./hints", "x-new"),
    ("{root}/hints/../items", "x-new"),
    ("{hints}/sub", "x-new"),
    ("{hints}2", "x-new"),
    ("{root}/hint", "x-new"),
    ("{upper}", "x-new"),
    ("/", "x-new"),
    ("/gazette/hints", "x-new"),
]


@pytest.mark.parametrize(("template", "attempt_id"), HINT_PREFIX_ATTEMPTS)
@pytest.mark.parametrize("revision", ["create", "any", "own"])
async def test_a_hint_prefix_outside_the_consumers_hint_root_is_refused_and_writes_nothing(
    shards_world: ShardsWorld, template: str, attempt_id: str, revision: str
) -> None:
    world = shards_world
    prefix = template.format(
        root=world.root, hints=world.hint_root, brokers=world.brokers, legacy=world.legacy,
        upper=world.hint_root.upper(),
    )  # fmt: skip
    shard_id = OWN if revision == "own" else attempt_id  # "own": moving its own shard's keys.
    upsert = shard_spec(shard_id, [INPUT_X], labels=[("team", "x")])
    upsert.recovery_log_prefix, upsert.hint_prefix, upsert.disable = LOGS_X, prefix, True
    expect = {"create": 0, "any": -1, "own": -1}[revision]
    change = cpb.ApplyRequest.Change(
        upsert=upsert, expect_mod_revision=expect, primary_hints=planted(f"{LOGS_X}/{shard_id}")
    )
    error = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
    details = error.details() or ""
    assert "\n" not in details
    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
        # Only an id naming a hidden shard is refused so, as any unauthorized change.
        assert details == f"not authorized to {shard_id}"
    else:
        # A malformed field, as any caller's: one line naming it, whatever others hold there.
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert details.startswith(("changes[0].upsert.hint_prefix: ", "changes[0].upsert.id: ")), details  # fmt: skip
        if "hint root" in details:
            assert world.hint_root in details
    for hidden in (VICTIM_ROOTED, world.legacy, LOGS_Y):  # Named only if the caller named it.
        assert hidden not in details or hidden in prefix + shard_id, details
    await unchanged(world)
    assert await value_at(world.etcd, f"{prefix}/{shard_id}.primary") in (
        None,
        *world.victim_keys.values(),
    )


async def test_hints_without_a_recovery_log_cannot_name_a_key_outside_the_hint_root(
    shards_world: ShardsWorld,
) -> None:
    """A shard without a recovery log has no hint prefix, so hints applied with it would go to
    `/<id>.primary`: an id spelling the brokers' keyspace put a key there."""
    world = shards_world
    for shard_id in (
        world.brokers.removeprefix("/") + "/items/esc-x/evil",
        world.root.removeprefix("/") + "/items/x-evil",
        world.legacy.removeprefix("/") + "/team-y/shard1",
    ):
        upsert = shard_spec(shard_id, [INPUT_X], labels=[("team", "x")])
        upsert.disable = True
        change = cpb.ApplyRequest.Change(upsert=upsert, primary_hints=planted(""))
        error = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert (error.details() or "").startswith("changes[0].primary_hints: "), error.details()
        at = await value_at(world.etcd, f"/{shard_id}.primary")
        assert at is None or at in world.victim_keys.values()  # The victim's, as planted.
    await unchanged(world)


@pytest.mark.parametrize("backups", [17, 1 << 20, (1 << 31) - 1])
async def test_a_huge_hint_backups_is_refused_in_one_line(
    shards_world: ShardsWorld, backups: int
) -> None:
    world = shards_world
    upsert = shard_spec("x-backups", [INPUT_X], labels=[("team", "x")])
    upsert.recovery_log_prefix, upsert.hint_backups, upsert.disable = LOGS_X, backups, True
    error = await refusal(world.shards.Apply(apply(cpb.ApplyRequest.Change(upsert=upsert)), metadata=x_token()))  # fmt: skip
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"changes[0].upsert.hint_backups: {backups} is more than 16 (a shard keeps at most 16 "
        "backups of its hints)"
    )
    await unchanged(world)


async def _refused_then_hidden(
    world: ShardsWorld, upsert: cpb.ShardSpec, journal: str
) -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
    """The Apply's refusal while `journal` does not exist, then once the operator created it
    for team y."""
    change = cpb.ApplyRequest.Change(upsert=upsert)
    absent = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
    created = spec(journal, "y")
    await world.journals.Apply(
        pb.ApplyRequest(changes=[pb.ApplyRequest.Change(upsert=created)]), metadata=admin()
    )
    hidden = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
    return absent, hidden


@pytest.mark.parametrize("field", ["recovery_log_prefix", "sources", "sources;meta"])
async def test_a_hidden_or_absent_recovery_log_or_source_is_refused_identically(
    shards_world: ShardsWorld, field: str
) -> None:
    world = shards_world
    upsert = shard_spec("x-new", [INPUT_X], labels=[("team", "x")])
    upsert.disable = True
    if field == "recovery_log_prefix":
        prefix = f"esc-y/later-logs-{uuid.uuid4().hex[:6]}"
        upsert.recovery_log_prefix = prefix
        journal = f"{prefix}/x-new"
    else:
        journal = f"esc-y/later-{uuid.uuid4().hex[:6]}"
        named = journal + (";meta" if field.endswith(";meta") else "")
        upsert.sources.add(journal=named)
        upsert.sources.sort(key=lambda s: s.journal)
    absent, hidden = await _refused_then_hidden(world, upsert, journal)
    for error in (absent, hidden):
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        assert error.details() == (
            f"shard x-new: journal {journal} is not one this token may read; create it first, "
            "labelled so the token selects it"
        )
    listed = await world.shards.List(cpb.ListRequest(), metadata=admin())
    assert "x-new" not in [s.spec.id for s in listed.shards]
    # An existing hidden log, named by the attacker's own shard: the same refusal, its own
    # shard unchanged (no fence of the victim's log, no replay of its state).
    own = shard_spec(OWN, [INPUT_X], labels=[("team", "x")])
    own.recovery_log_prefix, own.disable = LOGS_Y, True
    if field != "recovery_log_prefix":
        own.recovery_log_prefix = LOGS_X
        own.sources.add(journal=INPUT_Y + (";meta" if field.endswith(";meta") else ""))
        own.sources.sort(key=lambda s: s.journal)
    error = await refusal(world.shards.Apply(apply(cpb.ApplyRequest.Change(upsert=own, expect_mod_revision=-1)), metadata=x_token()))  # fmt: skip
    named = f"{LOGS_Y}/{OWN}" if field == "recovery_log_prefix" else INPUT_Y
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == (
        f"shard {OWN}: journal {named} is not one this token may read; create it first, "
        "labelled so the token selects it"
    )
    await unchanged(world)


@pytest.mark.parametrize("where", ["hints.log", "segment.log"])
async def test_primary_hints_cannot_name_a_hidden_log(shards_world: ShardsWorld, where: str) -> None:  # fmt: skip
    """Hints name the logs a primary plays: one naming the victim's log would replay its state
    with the consumer's credentials."""
    world = shards_world
    upsert = shard_spec("x-new", [INPUT_X], labels=[("team", "x")])
    upsert.recovery_log_prefix, upsert.disable = LOGS_X, True
    hints = planted(f"{LOGS_X}/x-new")
    if where == "hints.log":
        hints.log = f"{LOGS_Y}/{VICTIM}"
    else:
        hints.live_nodes[0].segments[0].log = f"{LOGS_Y}/{VICTIM}"
    change = cpb.ApplyRequest.Change(upsert=upsert, primary_hints=hints)
    error = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
    if where == "hints.log":
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details() == (
            f"changes[0].primary_hints.log: names {LOGS_Y}/{VICTIM}, not the shard's recovery "
            f"log {LOGS_X}/x-new"
        )
    else:
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        assert error.details() == (
            f"shard x-new: journal {LOGS_Y}/{VICTIM} is not one this token may read; create it "
            "first, labelled so the token selects it"
        )
    assert await value_at(world.etcd, f"{world.hint_root}/x-new.primary") is None
    await unchanged(world)


async def test_the_tenants_own_shard_with_the_hint_root_and_its_own_journals_is_applied(
    shards_world: ShardsWorld,
) -> None:
    world = shards_world
    x = x_token()
    hints = planted(f"{LOGS_X}/x-new")
    # An empty hint prefix is filled in with the hint root; the root itself is taken as is.
    for prefix in ("", world.hint_root):
        upsert = shard_spec("x-new", [INPUT_X + ";meta"], labels=[("team", "x")])
        upsert.recovery_log_prefix, upsert.hint_prefix, upsert.disable = LOGS_X, prefix, True
        upsert.hint_backups = 16
        change = cpb.ApplyRequest.Change(upsert=upsert, expect_mod_revision=-1, primary_hints=hints)  # fmt: skip
        assert (await world.shards.Apply(apply(change), metadata=x)).status == cpb.OK
        listed = await world.shards.List(cpb.ListRequest(), metadata=x)
        by_id = {s.spec.id: s for s in listed.shards}
        assert set(by_id) == {OWN, "x-new"}  # The victims stay hidden.
        assert by_id["x-new"].spec.hint_prefix == world.hint_root
    stored = await world.etcd.get(f"{world.hint_root}/x-new.primary".encode())
    assert decode_hints(stored.value) == hints
    got = await world.shards.GetHints(cpb.GetHintsRequest(shard="x-new"), metadata=x)
    assert got.primary_hints.hints == hints and len(got.backup_hints) == 16
    # Its own existing shard re-applied as it stands (read back from List, as gazctl does).
    own = by_id[OWN]
    change = cpb.ApplyRequest.Change(upsert=own.spec, expect_mod_revision=own.mod_revision)
    assert (await world.shards.Apply(apply(change), metadata=x)).status == cpb.OK
    await unchanged(world, "x-new")
    # The victim's upstream-era spec stays re-applicable by the operator, as it stands.
    everything = await world.shards.List(cpb.ListRequest(), metadata=admin())
    victim = next(s for s in everything.shards if s.spec.id == VICTIM)
    assert victim.spec.hint_prefix == world.legacy
    change = cpb.ApplyRequest.Change(upsert=victim.spec, expect_mod_revision=victim.mod_revision)
    assert (await world.shards.Apply(apply(change), metadata=admin())).status == cpb.OK


async def test_an_unreachable_broker_refuses_a_restricted_apply_unavailable(
    etcd_server: Any, tmp_path: Path
) -> None:
    """Whether a journal is the caller's is the brokers' to say: when they cannot be asked, the
    Apply is refused UNAVAILABLE, never accepted."""
    root = f"/gazette-test-shards/{uuid.uuid4().hex[:12]}"
    async with ConsumerGroup(etcd_server, "http://127.0.0.1:1", root, auth_keys=KEYS) as group:
        consumer = await group.start(WordTotals(str(tmp_path)), run_allocator=False)
        channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
        shards = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
        try:
            upsert = shard_spec("x-new", [INPUT_X], labels=[("team", "x")])
            upsert.disable = True
            change = cpb.ApplyRequest.Change(upsert=upsert)
            error = await refusal(shards.Apply(apply(change), metadata=x_token()))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert "\n" not in (error.details() or "")
            listed = await shards.List(cpb.ListRequest(), metadata=admin())
            assert list(listed.shards) == []
            # The operator is not checked (upstream applies shards before their journals).
            answer = await shards.Apply(apply(change), metadata=admin())
            assert answer.status == cpb.OK
        finally:
            await channel.close(None)


_ = SIGNER  # Re-exported helpers are imported from tests.test_tenancy as the brief asks.


# --- Hints a deleted shard left behind ------------------------------------------------------------
# A Shard delete leaves the shard's hint keys in etcd (as upstream: re-applying the shard recovers
# its state from them). A restricted caller creating a shard of that id would read them, or learn
# the log they name: the create is refused as any unauthorized change while any is there.

LEFTOVER_KEYS = ["primary", "backup.0", "backup.15"]


async def _delete_victim_rooted(world: ShardsWorld, leftover: str) -> str:
    """The operator deletes y-rooted; its hints stay, at the `leftover` key (the primary key is
    planted at setup; a backup is planted here in its place). Returns the log they name."""
    log = f"{LOGS_Y}/{VICTIM_ROOTED}"
    await world.shards.Apply(
        apply(cpb.ApplyRequest.Change(delete=VICTIM_ROOTED, expect_mod_revision=-1)),
        metadata=admin(),
    )
    if leftover != "primary":
        await world.etcd.delete(f"{world.hint_root}/{VICTIM_ROOTED}.primary".encode())
        key = f"{world.hint_root}/{VICTIM_ROOTED}.{leftover}"
        await world.etcd.put(key.encode(), encode_hints(victim_hints(log)))
        world.victim_keys = {key: encode_hints(victim_hints(log))}
    for key, value in world.victim_keys.items():
        assert await value_at(world.etcd, key) == value, key
    return log


async def _refused_as_unauthorized(world: ShardsWorld, change: cpb.ApplyRequest.Change) -> None:
    error = await refusal(world.shards.Apply(apply(change), metadata=x_token()))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    assert error.details() == f"not authorized to {VICTIM_ROOTED}", error.details()
    # Not created: no GetHints, nothing listed, the hints as they were.
    got = await world.shards.GetHints(cpb.GetHintsRequest(shard=VICTIM_ROOTED), metadata=x_token())  # fmt: skip
    assert got.status == cpb.SHARD_NOT_FOUND and not got.HasField("primary_hints"), got
    listed = await world.shards.List(cpb.ListRequest(), metadata=admin())
    assert VICTIM_ROOTED not in {s.spec.id for s in listed.shards}
    for key, value in world.victim_keys.items():
        assert await value_at(world.etcd, key) == value, key


@pytest.mark.parametrize("leftover", LEFTOVER_KEYS)
@pytest.mark.parametrize("backups", [0, 1, 16])
@pytest.mark.parametrize("revision", [0, -1])
async def test_hints_a_deleted_shard_left_behind_are_not_read_by_whoever_recreates_its_id(
    shards_world: ShardsWorld, leftover: str, backups: int, revision: int
) -> None:
    """Team x re-creates the deleted y-rooted's recovery log as its own journal and a shard of
    that id naming it (whatever its hint_backups, with or without a revision check, with or
    without hints of its own): refused "not authorized to y-rooted", nothing created, and y's
    hints are neither read nor overwritten."""
    world = shards_world
    log = await _delete_victim_rooted(world, leftover)
    change = pb.ApplyRequest.Change(delete=log, expect_mod_revision=-1)
    await world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    change = pb.ApplyRequest.Change(upsert=log_journal(log, "x"), expect_mod_revision=0)
    await world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=x_token())
    mine = shard_spec(VICTIM_ROOTED, [INPUT_X], labels=[("team", "x")])
    mine.recovery_log_prefix, mine.disable, mine.hint_backups = LOGS_Y, True, backups
    await _refused_as_unauthorized(
        world, cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=revision)
    )
    # Nor with hints of its own, which would overwrite y's primary key.
    change = cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=revision, primary_hints=planted(log))  # fmt: skip
    await _refused_as_unauthorized(world, change)
    # Nor alongside a change x may make: nothing of the request is applied.
    own = shard_spec("x-new", [INPUT_X], labels=[("team", "x")])
    own.recovery_log_prefix, own.disable = LOGS_X, True
    both = apply(cpb.ApplyRequest.Change(upsert=own), cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=revision))  # fmt: skip
    error = await refusal(world.shards.Apply(both, metadata=x_token()))
    assert error.details() == f"not authorized to {VICTIM_ROOTED}", error.details()
    await unchanged(world, deleted=(VICTIM_ROOTED,))


@pytest.mark.parametrize("leftover", LEFTOVER_KEYS)
async def test_hints_a_deleted_shard_left_behind_do_not_reveal_its_log_to_whoever_recreates_its_id(
    shards_world: ShardsWorld, leftover: str
) -> None:
    """y keeps its recovery log; x creates a shard of the deleted id naming a log of its own:
    refused as any unauthorized change (so GetHints never gets to name y's hidden log)."""
    world = shards_world
    await _delete_victim_rooted(world, leftover)
    own_log = f"esc-x/other/{VICTIM_ROOTED}"
    change = pb.ApplyRequest.Change(upsert=log_journal(own_log, "x"), expect_mod_revision=0)
    await world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=x_token())
    mine = shard_spec(VICTIM_ROOTED, [INPUT_X], labels=[("team", "x")])
    mine.recovery_log_prefix, mine.disable = "esc-x/other", True
    await _refused_as_unauthorized(world, cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=0))  # fmt: skip
    # The refusal is the one an existing hidden shard gets: it tells neither apart.
    hidden = shard_spec(VICTIM, [INPUT_X], labels=[("team", "x")])
    hidden.recovery_log_prefix, hidden.disable = "esc-x/other", True
    error = await refusal(world.shards.Apply(apply(cpb.ApplyRequest.Change(upsert=hidden)), metadata=x_token()))  # fmt: skip
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, f"not authorized to {VICTIM}")  # fmt: skip
    await unchanged(world, deleted=(VICTIM_ROOTED,))


async def test_an_operator_recreates_a_deleted_shard_over_its_hints_and_a_tenant_after_they_go(
    shards_world: ShardsWorld,
) -> None:
    """Unrestricted callers are not checked: the operator re-creates y-rooted and it recovers
    from the hints it left. Once the operator deletes the shard and its hints, the id is free
    for a tenant to create."""
    world = shards_world
    log = await _delete_victim_rooted(world, "primary")
    rooted = shard_spec(VICTIM_ROOTED, [INPUT_Y], labels=[("team", "y")])
    rooted.recovery_log_prefix, rooted.disable, rooted.hint_backups = LOGS_Y, True, 1
    change = cpb.ApplyRequest.Change(upsert=rooted, expect_mod_revision=0)
    assert (await world.shards.Apply(apply(change), metadata=admin())).status == cpb.OK
    got = await world.shards.GetHints(cpb.GetHintsRequest(shard=VICTIM_ROOTED), metadata=admin())
    assert got.primary_hints.hints == victim_hints(log)
    # Deleted again, with its hints and its log: now team x may take the id.
    change = cpb.ApplyRequest.Change(delete=VICTIM_ROOTED, expect_mod_revision=-1)
    await world.shards.Apply(apply(change), metadata=admin())
    await world.etcd.delete_prefix(f"{world.hint_root}/{VICTIM_ROOTED}.".encode())
    change = pb.ApplyRequest.Change(delete=log, expect_mod_revision=-1)
    await world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    change = pb.ApplyRequest.Change(upsert=log_journal(log, "x"), expect_mod_revision=0)
    await world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=x_token())
    mine = shard_spec(VICTIM_ROOTED, [INPUT_X], labels=[("team", "x")])
    mine.recovery_log_prefix, mine.disable = LOGS_Y, True
    change = cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=0)
    assert (await world.shards.Apply(apply(change), metadata=x_token())).status == cpb.OK
    got = await world.shards.GetHints(cpb.GetHintsRequest(shard=VICTIM_ROOTED), metadata=x_token())  # fmt: skip
    assert got.status == cpb.OK and not got.primary_hints.HasField("hints"), got


@pytest.mark.parametrize("spelled", ["victim's key", "absent key"])
async def test_a_shard_without_a_recovery_log_probes_no_key_its_id_spells(
    shards_world: ShardsWorld, spelled: str
) -> None:
    """A shard without a recovery log keeps no hints: its hint keys would be `/<id>.primary`
    and so on, anywhere in etcd. Creating one whose id spells the victim's upstream-era hint
    key (or an absent key) is answered alike, and its GetHints reads nothing there."""
    world = shards_world
    shard_id = world.legacy.removeprefix("/") + (
        "/team-y/shard1" if spelled == "victim's key" else "/team-y/nothing"
    )
    upsert = shard_spec(shard_id, [INPUT_X], labels=[("team", "x")])
    upsert.disable = True
    change = cpb.ApplyRequest.Change(upsert=upsert, expect_mod_revision=0)
    assert (await world.shards.Apply(apply(change), metadata=x_token())).status == cpb.OK
    got = await world.shards.GetHints(cpb.GetHintsRequest(shard=shard_id), metadata=x_token())
    assert got.status == cpb.OK and not got.primary_hints.HasField("hints"), got
    assert all(not b.HasField("hints") for b in got.backup_hints), got
    await unchanged(world, shard_id)
