"""Escape attempts through recovery-log playback (issue 37, defect 1), over the wire: a tenant's
token (`team=x`, every capability) on a real broker and a real consumer, both verifying tokens,
tries to make the consumer write a file outside the shard's directory, with content it chooses
(a `.pth` file in a world-writable directory: code execution where the keys live). It may write
its own journals and shards, so it controls its shard's recovery log and hints: escaping paths
in Shard Apply's `primary_hints` are refused at once; escaping paths in hints planted in etcd (a
compromised path) or recorded in its own log fail its shard, FAILED with one line naming the
path, and nothing appears outside. A legitimate recorded store of the same tenant still plays
back on another consumer.

Collected through tests/test_tenant_escape.py; run alone with
`python -m pytest tests/escape_playback.py -p no:xdist -q`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest

from broker.client.appender import append
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.labels import CONTENT_TYPE_RECOVERY_LOG
from broker.protocol.validate import quote
from broker.testing import BrokerHarness, EtcdServer
from consumer.protocol import cpb, hint_primary_key
from consumer.recoverylog.hints import encode_hints
from consumer.testing import ConsumerGroup, journal_spec
from consumer.transaction import Shard
from plumbing import auth
from plumbing.credentials import Credentials
from tests.helpers.recoverylog import LogWriter, create, framed, link, write
from tests.helpers.tenancy import KEY, KEYS, admin, md, team

__all__ = [
    "RecordedApp",
    "playback_cluster",
    "test_escape_a_legitimate_recorded_store_still_plays_back_on_another_consumer",
    "test_escape_escaping_hints_planted_in_etcd_fail_the_shard_and_write_nothing",
    "test_escape_escaping_ops_in_its_own_recovery_log_fail_the_shard_and_write_nothing",
    "test_escape_json_store_files_are_private_to_the_consumers_user",
    "test_escape_shard_apply_refuses_escaping_primary_hints",
]

# Paths that would land in the world-writable directory ("{world}": its absolute path without
# the leading slash), or are not paths a recorder writes.
SPELLINGS = [
    pytest.param("/" + "../" * 12 + "{world}/evil.pth", id="dotdot-chain"),
    pytest.param("/site/../../../world/evil.pth", id="segment-then-climb"),
    pytest.param("//{world}/evil.pth", id="absolute"),
    pytest.param("/evil.pth\x00/../../../world/evil.pth", id="nul"),
]
PAYLOAD = "import os; os.system('touch /tmp/pwned')\n"


class RecordedApp:
    """A SQLite store recorded into the shard's recovery log; no messages to consume."""

    async def new_store(self, shard: Shard) -> Any:
        from consumer.store_sqlite import SQLiteStore

        return SQLiteStore(shard.recorder)

    async def consume_message(self, shard: Shard, store: Any, envelope: Any, publisher: Any) -> None:  # fmt: skip
        key = envelope.message["key"]

        def put(db: Any) -> None:
            db.execute("CREATE TABLE IF NOT EXISTS kept (k TEXT PRIMARY KEY, v TEXT)")
            db.execute("INSERT OR REPLACE INTO kept VALUES (?, ?)", (key, "v"))

        await store.run(put)

    async def finalize_txn(self, shard: Shard, store: Any, publisher: Any) -> None:
        return None


@dataclass
class Cluster:
    """A broker and a consumer group verifying tokens signed with KEY; the attacker's token;
    the world-writable directory the attacker aims at."""

    broker: BrokerHarness
    journals: pb_grpc.JournalStub
    group: ConsumerGroup
    shards: Callable[[], Any]
    etcd: aetcd.Client
    root: str
    world: Path
    x: tuple[tuple[str, str], ...]

    def path(self, spelling: str) -> str:
        return spelling.replace("{world}", str(self.world).lstrip("/"))

    def log_prefix(self) -> str:
        return "team-x/logs"

    def shard(self, shard_id: str) -> cpb.ShardSpec:
        spec = cpb.ShardSpec(
            id=shard_id,
            sources=[cpb.ShardSpec.Source(journal="team-x/input")],
            recovery_log_prefix=self.log_prefix(),
            hint_prefix=f"{self.root}/hints",
        )
        spec.max_txn_duration.FromNanoseconds(200_000_000)
        spec.labels.labels.add(name="team", value="x")
        return spec

    async def new_log(self, shard_id: str) -> str:
        """The shard's recovery log, created by the attacker (its own journal)."""
        name = f"{self.log_prefix()}/{shard_id}"
        log = journal_spec(name, content_type=CONTENT_TYPE_RECOVERY_LOG, labels=[("team", "x")])
        change = pb.ApplyRequest.Change(upsert=log, expect_mod_revision=0)
        assert (await self.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=self.x)).status == pb.OK  # fmt: skip
        await self.routed(name)
        return name

    async def routed(self, name: str) -> None:
        """Until the broker took the journal on (appends to it are then served)."""
        sel = pb.LabelSelector()
        sel.include.labels.add(name="name", value=name)
        async with asyncio.timeout(30):
            while True:
                async for listed in self.journals.List(
                    pb.ListRequest(selector=sel), metadata=self.x
                ):
                    if any(j.route.primary == 0 for j in listed.journals):
                        return
                await asyncio.sleep(0.05)

    async def status_of(self, shard_id: str, member: str = "") -> cpb.ReplicaStatus | None:
        """The status of the shard's primary (at `member`, if given), None if it has none."""
        sel = pb.LabelSelector()
        sel.include.labels.add(name="id", value=shard_id)
        listed = await self.shards().List(cpb.ListRequest(selector=sel), metadata=self.x)
        if not listed.shards or not listed.shards[0].status:
            return None
        shard = listed.shards[0]
        if shard.route.primary < 0:
            return None
        if member and shard.route.members[shard.route.primary].suffix != member:
            return None
        status: cpb.ReplicaStatus = shard.status[shard.route.primary]
        return status

    async def until_status(self, shard_id: str, code: int, member: str = "") -> None:
        """Until the shard's primary (at `member`, if given) has status `code`; AssertionError
        with its errors if it FAILED instead."""
        async with asyncio.timeout(60):
            while True:
                status = await self.status_of(shard_id, member)
                if status is not None and status.code == code:
                    return
                if status is not None and status.code == cpb.ReplicaStatus.FAILED:
                    raise AssertionError(f"{shard_id} FAILED: {list(status.errors)}")
                await asyncio.sleep(0.05)

    def nothing_outside(self) -> None:
        assert list(self.world.iterdir()) == [], list(self.world.iterdir())


@pytest.fixture
async def playback_cluster(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)  # As /tmp or a site-packages writable by the consumer's user.
    root = f"/gazette-test-escape-playback/{uuid.uuid4().hex[:12]}"
    etcd = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, auth_keys=KEYS) as broker:
        channel = grpc.aio.insecure_channel(broker.endpoint.removeprefix("http://"))
        journals = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        x = md(auth.ALL, team("x"))
        source = journal_spec("team-x/input", labels=[("team", "x")])
        change = pb.ApplyRequest.Change(upsert=source, expect_mod_revision=0)
        assert (await journals.Apply(pb.ApplyRequest(changes=[change]), metadata=x)).status == pb.OK  # fmt: skip
        async with ConsumerGroup(
            etcd_server,
            broker.endpoint,
            root,
            auth_keys=KEYS,
            broker_credentials=Credentials(auth=auth.KeyedAuth([KEY])),
        ) as group:
            await group.start(RecordedApp(), local_dir=str(tmp_path / "consumer-0"))
            peers: dict[str, grpc.aio.Channel] = {}

            def shards() -> Any:
                """A Shard stub to a running consumer of the group."""
                address = group.address
                if address not in peers:
                    peers[address] = grpc.aio.insecure_channel(address.removeprefix("http://"))
                return cpb_grpc.ShardStub(peers[address])  # type: ignore[no-untyped-call]

            try:
                yield Cluster(broker, journals, group, shards, etcd, root, world, x)
            finally:
                for peer in peers.values():
                    await peer.close(None)
        await channel.close(None)
    await etcd.delete_prefix(root.encode())
    await etcd.close()


async def _apply(cluster: Cluster, change: cpb.ApplyRequest.Change) -> cpb.ApplyResponse:
    """Shard Apply of one change, as the attacker."""
    request = cpb.ApplyRequest(changes=[change])
    response: cpb.ApplyResponse = await cluster.shards().Apply(request, metadata=cluster.x)
    return response


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_escape_shard_apply_refuses_escaping_primary_hints(
    playback_cluster: Cluster, spelling: str
) -> None:
    """The attacker's own shard, with primary hints whose property climbs out: refused at once,
    naming the field and the path; no shard, no hints, nothing written."""
    cluster = playback_cluster
    path = cluster.path(spelling)
    log = await cluster.new_log("s-apply")
    hints = rpb.FSMHints(log=log)
    hints.properties.add(path="/IDENTITY", content="fine")
    hints.properties.add(path=path, content=PAYLOAD)
    spec = cluster.shard("s-apply")
    change = cpb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0, primary_hints=hints)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _apply(cluster, change)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    details = refused.value.details() or ""
    assert details.startswith("changes[0].primary_hints.properties[1].path: "), details
    assert quote(path) in details and "\n" not in details, details
    assert (await cluster.shards().List(cpb.ListRequest(), metadata=admin())).shards == []
    assert await cluster.etcd.get(hint_primary_key(spec).encode()) is None
    cluster.nothing_outside()
    # The same shard with clean hints is accepted: only the escaping property was refused.
    del hints.properties[1]
    change.primary_hints.CopyFrom(hints)
    assert (await _apply(cluster, change)).status == cpb.OK


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_escape_escaping_hints_planted_in_etcd_fail_the_shard_and_write_nothing(
    playback_cluster: Cluster, spelling: str
) -> None:
    """Hints written straight into etcd (past Shard Apply: whoever can write etcd, or hints of
    an older version) with a property that climbs out: the shard is FAILED with one line
    naming the path, and the file does not exist. The consumer goes on serving."""
    cluster = playback_cluster
    path = cluster.path(spelling)
    log = await cluster.new_log("s-etcd")
    spec = cluster.shard("s-etcd")
    hints = rpb.FSMHints(log=log, properties=[rpb.Property(path=path, content=PAYLOAD)])
    # Created disabled, then its hints replaced in etcd, then enabled: a tenant creates no shard
    # over hints already there (a deleted shard's), but a running shard's can be rewritten.
    spec.disable = True
    created = cpb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)
    assert (await _apply(cluster, created)).status == cpb.OK
    await cluster.etcd.put(hint_primary_key(spec).encode(), encode_hints(hints))
    spec.disable = False
    enabled = cpb.ApplyRequest.Change(upsert=spec, expect_mod_revision=-1)
    assert (await _apply(cluster, enabled)).status == cpb.OK
    status = await _failed(cluster, "s-etcd")
    assert quote(path) in status.errors[0], status.errors
    cluster.nothing_outside()
    await _others_still_served(cluster)


@pytest.mark.parametrize("kind", ["create", "link", "property"])
@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_escape_escaping_ops_in_its_own_recovery_log_fail_the_shard_and_write_nothing(
    playback_cluster: Cluster, spelling: str, kind: str
) -> None:
    """The attacker appends to its own recovery log (it may: the journal is its own) ops whose
    paths climb out: a file created there, a second link of a file, a property. Its shard,
    played from the log's start, is FAILED with one line naming the path; nothing outside."""
    cluster = playback_cluster
    path = cluster.path(spelling)
    shard_id = f"s-log-{kind}"
    log = await cluster.new_log(shard_id)
    w = LogWriter()
    data = PAYLOAD.encode()
    if kind == "create":
        w.op(7, **create(path))
        w.op(7, **write(1, 0, len(data)))
    elif kind == "link":
        w.op(7, **create("/site.pth"))
        w.op(7, **write(1, 0, len(data)))
        w.op(7, **link(1, path))
    else:
        w.op(7, property=rpb.Property(path=path, content=PAYLOAD))
    await append(cluster.journals, log, framed(w.ops, {2: data}), metadata=cluster.x)
    cluster.nothing_outside()
    change = cpb.ApplyRequest.Change(upsert=cluster.shard(shard_id), expect_mod_revision=0)
    assert (await _apply(cluster, change)).status == cpb.OK
    status = await _failed(cluster, shard_id)
    assert quote(path) in status.errors[0], status.errors
    cluster.nothing_outside()
    await _others_still_served(cluster)


async def _failed(cluster: Cluster, shard_id: str) -> cpb.ReplicaStatus:
    """The shard's status once FAILED (one error, one line); AssertionError if it is ever
    PRIMARY (the escape played out)."""
    async with asyncio.timeout(60):
        while True:
            status = await cluster.status_of(shard_id)
            if status is not None and status.code == cpb.ReplicaStatus.PRIMARY:
                raise AssertionError(f"{shard_id} became PRIMARY: {list(cluster.world.iterdir())}")  # fmt: skip
            if status is not None and status.code == cpb.ReplicaStatus.FAILED:
                assert len(status.errors) == 1 and "\n" not in status.errors[0], status.errors
                return status
            await asyncio.sleep(0.05)


async def _others_still_served(cluster: Cluster) -> None:
    """A clean shard of the same tenant, on the same consumer, becomes PRIMARY."""
    await cluster.new_log("s-clean")
    change = cpb.ApplyRequest.Change(upsert=cluster.shard("s-clean"), expect_mod_revision=0)
    assert (await _apply(cluster, change)).status == cpb.OK
    await cluster.until_status("s-clean", cpb.ReplicaStatus.PRIMARY)


async def test_escape_a_legitimate_recorded_store_still_plays_back_on_another_consumer(
    playback_cluster: Cluster, tmp_path: Path
) -> None:
    """The tenant's shard with a SQLite store records into its log; handed to another
    consumer, it is played back there (paths confined, the store's files all inside) and is
    PRIMARY again with its rows."""
    cluster = playback_cluster
    await cluster.new_log("s-kept")
    change = cpb.ApplyRequest.Change(upsert=cluster.shard("s-kept"), expect_mod_revision=0)
    assert (await _apply(cluster, change)).status == cpb.OK
    await cluster.until_status("s-kept", cpb.ReplicaStatus.PRIMARY)
    lines = b"".join(b'{"key": "k%d"}\n' % i for i in range(5))
    await cluster.routed("team-x/input")
    end = (await append(cluster.journals, "team-x/input", lines, metadata=cluster.x)).commit.end
    through = cpb.StatRequest(shard="s-kept", read_through={"team-x/input": end})
    assert (await cluster.shards().Stat(through, metadata=cluster.x, timeout=60)).status == cpb.OK
    first = cluster.group.consumers[0]
    second = await cluster.group.start(RecordedApp(), local_dir=str(tmp_path / "consumer-1"))
    await cluster.group.stop(first)  # Hands the shard to the second, which plays the log.
    await cluster.until_status("s-kept", cpb.ReplicaStatus.PRIMARY, second.config.id)
    from consumer.store_sqlite import SQLiteStore

    store = second.replicas["s-kept"].store
    assert isinstance(store, SQLiteStore)

    def rows(db: Any) -> list[str]:
        return [row[0] for row in db.execute("SELECT k FROM kept ORDER BY k")]

    assert await store.run(rows) == [f"k{i}" for i in range(5)]
    assert (tmp_path / "consumer-1" / "s-kept").is_dir()
    cluster.nothing_outside()


async def test_escape_json_store_files_are_private_to_the_consumers_user(tmp_path: Path) -> None:
    """A shard's JSON store (its state: a tenant's data) is written 0600, as fragments are, not
    0644 for any local user to read: the state file (written to a temporary file renamed over
    it: the same inode, so the same mode) and its lock; whatever the umask leaves."""
    import os
    import stat

    from consumer.store import JSONFileStore

    previous = os.umask(0o022)  # The common default, which left them 0644.
    try:
        store = JSONFileStore(tmp_path, "team-x/shard", initial={"secret": 1})
        await store.restore_checkpoint()
        store.state["secret"] = 2
        await store.commit(cpb.Checkpoint())
    finally:
        os.umask(previous)
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in store.directory.iterdir()}
    assert files == {"state.json": 0o600, ".lock": 0o600}, {k: oct(v) for k, v in files.items()}
