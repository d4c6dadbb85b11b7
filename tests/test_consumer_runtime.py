"""Consumer processes (in-process here, with real brokers, etcd and gRPC): shards applied through
the Shard service are allocated with a hot standby, the primary runs transactions against a
JSON-file store, Stat waits for read-through offsets (proxied from any process), and a graceful
exit hands the shard to the standby with every sum still exact."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest
from google.protobuf import duration_pb2

from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from consumer.protocol import cpb
from consumer.runtime import Consumer, ConsumerConfig
from consumer.store import JSONFileStore
from consumer.transaction import Shard
from tests.helpers.consumers import (
    INPUT,
    RecordedSummer,
    StoredSummer,
    _consumed,
    _equals,
    committed_outputs,
    publish_inputs,
    shard_stub,
    statuses,
    write_head,
)
from tests.helpers.waiting import until


@contextlib.asynccontextmanager
async def consumers(
    etcd_server: EtcdServer, harness: BrokerHarness, root: str, store_root: Path, count: int
) -> AsyncIterator[list[Consumer]]:
    started: list[Consumer] = []
    try:
        for i in range(count):
            config = ConsumerConfig(
                id=f"consumer-{i}",
                broker_address=harness.endpoint,
                etcd_address=etcd_server.endpoint,
                etcd_prefix=root,
                etcd_lease=5.0,
                drain_timeout=15.0,
            )
            consumer = Consumer(config, StoredSummer(store_root))
            await consumer.start()
            started.append(consumer)
        yield started
    finally:
        # Together: each sees the others exiting, so none waits to hand its shards over.
        await asyncio.gather(*(c.stop() for c in started))
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


async def test_shards_run_with_a_standby_and_hand_off_on_exit(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    tmp_path: Path,
) -> None:
    broker, journals = sums_broker, sums_stub
    # Apart from the brokers' root, as upstream lays them out (a keyspace watches its root as a
    # string prefix: the brokers' must not extend to it).
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    async with consumers(etcd_server, broker, root, tmp_path, 3) as (first, second, third):
        shards, channel = shard_stub(second)
        spec = cpb.ShardSpec(
            id="summer-0",
            sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
            hot_standbys=1,
        )
        applied = await shards.Apply(
            cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)])
        )
        assert applied.status == cpb.OK

        async def primary_and_standby() -> bool:
            codes = [code for _, code in await statuses(shards)]
            return sorted(codes) == [cpb.ReplicaStatus.STANDBY, cpb.ReplicaStatus.PRIMARY]

        await until(primary_and_standby)

        expected = await publish_inputs(journals, 120, seed=7)
        head = await write_head(journals, INPUT)
        for consumer in (first, second):  # Stat through either: one proxies to the primary.
            s, ch = shard_stub(consumer)
            async with asyncio.timeout(30):
                stat = await s.Stat(cpb.StatRequest(shard="summer-0", read_through={INPUT: head}))
            await ch.close()
            assert stat.status == cpb.OK and stat.read_through[INPUT] >= head

        # Bad input is one clear line, and the process goes on.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await shards.Apply(
                cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(delete="summer-0")])
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expect_mod_revision" in (bad.value.details() or "")
        missing = await shards.Stat(cpb.StatRequest(shard="no-such-shard"))
        assert missing.status == cpb.SHARD_NOT_FOUND

        # The primary exits gracefully: the standby takes over, and the sums stay exact.
        # (A third process takes the place of the leaving one: the allocator never lets a shard
        # fall below its desired replicas to drain a member, as upstream's.)
        everyone = (first, second, third)
        primary = next(
            c for c in everyone if "summer-0" in c.replicas and c.replicas["summer-0"].slot == 0
        )
        survivor = next(c for c in everyone if c is not primary)
        # Inputs published just before the hand-off: Stat through the new primary, with the
        # offsets written, returns only once they are applied (read-your-writes across it).
        more = await publish_inputs(journals, 80, seed=8)
        head = await write_head(journals, INPUT)
        stopping = asyncio.get_running_loop().time()
        await primary.stop()
        assert primary.failure is None
        # Drained: its shard moved before it stopped, well within the drain timeout.
        assert asyncio.get_running_loop().time() - stopping < 10
        s, ch = shard_stub(survivor)
        async with asyncio.timeout(30):
            stat = await s.Stat(cpb.StatRequest(shard="summer-0", read_through={INPUT: head}))
        await ch.close()
        assert stat.status == cpb.OK and stat.read_through[INPUT] >= head
        assert stat.header.process_id.suffix != primary.config.id  # The new primary answered.
        document = json.loads((tmp_path / "summer-0" / "state.json").read_text())
        assert document["state"] == dict(expected + more)  # Every input once, none twice.
        await channel.close()

    store = JSONFileStore(tmp_path, "summer-0")
    await store.restore_checkpoint()
    total = dict(expected + more)
    assert store.state == total
    assert len(await committed_outputs(journals)) == 200


class MixedStores(StoredSummer):
    """A JSON-file store for most shards; for `sum-sql`, PostgreSQL at an address where
    nothing listens (an unreachable store)."""

    def __init__(self, root: Path, unreachable_dsn: str) -> None:
        super().__init__(root)
        self.unreachable_dsn = unreachable_dsn

    async def new_store(self, shard: Shard) -> Any:
        if shard.spec.id == "sum-sql":
            from consumer.sqlstore import SQLStore

            store = SQLStore(self.unreachable_dsn, shard.fqn)
            await store.pool()  # Connects: fails here.
            return store
        return await super().new_store(shard)


async def test_a_shard_whose_store_is_unreachable_fails_alone(
    etcd_server: EtcdServer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    tmp_path: Path,
) -> None:
    from broker.testing import free_port

    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        id="consumer-0",
        broker_address=sums_broker.endpoint,
        etcd_address=etcd_server.endpoint,
        etcd_prefix=root,
        etcd_lease=5.0,
    )
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    consumer = Consumer(config, MixedStores(tmp_path, dsn))
    await consumer.start()
    try:
        shards, channel = shard_stub(consumer)
        specs = [
            cpb.ShardSpec(
                id=shard_id,
                sources=[cpb.ShardSpec.Source(journal=INPUT)],
                max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
            )
            for shard_id in ("sum-json", "sum-sql")
        ]
        await shards.Apply(
            cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=s) for s in specs])
        )

        async def settled() -> bool:
            listed = await shards.List(cpb.ListRequest())
            codes = {s.spec.id: [st.code for st in s.status] for s in listed.shards}
            return codes == {
                "sum-json": [cpb.ReplicaStatus.PRIMARY],
                "sum-sql": [cpb.ReplicaStatus.FAILED],
            }

        await until(settled)
        listed = await shards.List(cpb.ListRequest())
        failed = next(s for s in listed.shards if s.spec.id == "sum-sql")
        error = failed.status[0].errors[0]
        assert "\n" not in error and ("Connect" in error or "refused" in error), error

        # The process goes on serving its other shard.
        expected = await publish_inputs(sums_stub, 30, seed=3)
        head = await write_head(sums_stub, INPUT)
        async with asyncio.timeout(30):
            stat = await shards.Stat(cpb.StatRequest(shard="sum-json", read_through={INPUT: head}))
        assert stat.status == cpb.OK
        document = json.loads((tmp_path / "sum-json" / "state.json").read_text())
        assert document["state"] == dict(expected)
        stopped = await shards.Stat(cpb.StatRequest(shard="sum-sql"))
        assert stopped.status == cpb.SHARD_STOPPED
        await channel.close()
    finally:
        await consumer.stop()
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


class RestoresSlowly(StoredSummer):
    """Its store's checkpoint restore (which fences out earlier instances) waits until let go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.restoring = asyncio.Event()
        self.let_go = asyncio.Event()

    async def new_store(self, shard: Shard) -> JSONFileStore:
        app = self

        class Slow(JSONFileStore):
            async def restore_checkpoint(self) -> Any:
                app.restoring.set()
                await app.let_go.wait()
                return await super().restore_checkpoint()

        return Slow(self.root, shard.spec.id)


async def test_primary_is_advertised_only_once_its_store_is_fenced_and_restored(
    etcd_server: EtcdServer, sums_broker: BrokerHarness, tmp_path: Path
) -> None:
    """Upstream advertises PRIMARY after the store is restored (and fenced): a reader of the
    route must not take a primary that cannot serve yet for one that can."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        id="consumer-0", broker_address=sums_broker.endpoint, etcd_address=etcd_server.endpoint,
        etcd_prefix=root, etcd_lease=5.0,
    )  # fmt: skip
    app = RestoresSlowly(tmp_path)
    consumer = Consumer(config, app)
    await consumer.start()
    try:
        shards, channel = shard_stub(consumer)
        spec = cpb.ShardSpec(
            id="sum-0", sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )  # fmt: skip
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))
        async with asyncio.timeout(30):
            await app.restoring.wait()
        # Nothing to wait for: the test holds that no PRIMARY status is written while the store
        # restores, so it gives one time to be written, were one coming.
        await asyncio.sleep(0.3)  # A hold (see above): no PRIMARY is written meanwhile.
        assert await statuses(shards) != [("consumer-0:primary", cpb.ReplicaStatus.PRIMARY)]
        app.let_go.set()
        await until(
            lambda: _equals(statuses(shards), [("consumer-0:primary", cpb.ReplicaStatus.PRIMARY)])
        )
        await channel.close()
    finally:
        await consumer.stop()
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


class FailingStore(StoredSummer):
    """Its store cannot be made: the shard's own error."""

    async def new_store(self, shard: Shard) -> JSONFileStore:
        raise OSError("the store's disk is gone")


@pytest.mark.parametrize("app_kind", ["healthy", "failing"])
async def test_a_brief_etcd_error_writing_a_status_is_retried(
    etcd_server: EtcdServer, sums_broker: BrokerHarness, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, app_kind: str,
) -> None:  # fmt: skip
    """etcd fails the first status write (as during a leader election). A healthy shard still
    becomes PRIMARY (it is not failed for etcd's error); a shard that fails for its own error
    still says so (FAILED, with its error), instead of a replica that ended silently while its
    assignment shows it starting."""
    import aetcd.exceptions

    from consumer import replicas as runtime  # Where the replicas call etcd.
    from plumbing import etcd as etcdx

    real_txn = etcdx.txn
    failures = {"left": 1}

    async def flaky_txn(*args: Any, **kwargs: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise aetcd.exceptions.ConnectionFailedError("etcd is electing a leader")
        return await real_txn(*args, **kwargs)

    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        id="consumer-0", broker_address=sums_broker.endpoint, etcd_address=etcd_server.endpoint,
        etcd_prefix=root, etcd_lease=5.0,
    )  # fmt: skip
    app = StoredSummer(tmp_path) if app_kind == "healthy" else FailingStore(tmp_path)
    consumer = Consumer(config, app)
    await consumer.start()
    try:
        shards, channel = shard_stub(consumer)

        class FlakyEtcd:  # The runtime's etcd calls only (not the allocator's, nor Apply's).
            txn = staticmethod(flaky_txn)

            def __getattr__(self, name: str) -> Any:
                return getattr(etcdx, name)

        monkeypatch.setattr(runtime, "etcdx", FlakyEtcd())
        spec = cpb.ShardSpec(
            id="sum-0", sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )  # fmt: skip
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))
        want = cpb.ReplicaStatus.PRIMARY if app_kind == "healthy" else cpb.ReplicaStatus.FAILED
        await until(lambda: _equals(statuses(shards), [("consumer-0:primary", want)]), timeout=20)
        assert failures["left"] == 0
        if app_kind == "failing":
            listed = await shards.List(cpb.ListRequest())
            assert "the store's disk is gone" in listed.shards[0].status[0].errors[0]
        await channel.close()
    finally:
        monkeypatch.undo()
        await consumer.stop()
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


def _last_seq(hints: Any) -> int:
    return max((s.last_seq_no for node in hints.live_nodes for s in node.segments), default=0)


async def test_backup_hints_are_those_reached_at_hand_off_and_rotate_only_once_restored(
    etcd_server: EtcdServer, sums_broker: BrokerHarness, sums_stub: pb_grpc.JournalStub
) -> None:
    """As upstream: a new primary stores into the first backup the hints of the state it
    reached at hand-off (not the older hints its playback started from), and only once its
    store opened and restored its checkpoint, so that a store that cannot open (a corrupt
    database) leaves every good hint where it was."""
    from broker.protocol import protocol_pb2 as pb
    from consumer.protocol import hint_backup_keys, hint_primary_key
    from consumer.recoverylog.hints import decode_hints
    from gazctl.shards import RECOVERY_LOG_CONTENT_TYPE
    from tests.helpers.consumers import spec as journal_spec
    from tests.helpers.journals import routed

    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    log_name = f"recovery/{root.rsplit('/', 1)[1]}/sum-r"
    async with sums_broker.client() as client:
        log_spec = journal_spec(log_name)
        log_spec.labels.Clear()
        log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
        await client.apply([pb.ApplyRequest.Change(upsert=log_spec)])
        await routed(client, log_name, 1)
    shard = cpb.ShardSpec(
        id="sum-r", sources=[cpb.ShardSpec.Source(journal=INPUT)],
        recovery_log_prefix=log_name.rsplit("/", 1)[0],
        hint_prefix=f"{root}/hints",  # The consumer's hint root.
        hint_backups=2, max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
    )  # fmt: skip
    keys = [hint_primary_key(shard), *hint_backup_keys(shard)]
    app = RecordedSummer()
    etcd = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)

    async def hints() -> list[bytes | None]:
        got = [await etcd.get(key.encode()) for key in keys]
        return [g.value if g is not None else None for g in got]

    async def serve(n: int, want: int) -> list[bytes | None]:
        """Consumer-n serves the shard until its status is `want`; the hints then."""
        config = ConsumerConfig(
            id=f"consumer-{n}", broker_address=sums_broker.endpoint,
            etcd_address=etcd_server.endpoint, etcd_prefix=root, etcd_lease=5.0,
        )  # fmt: skip
        consumer = Consumer(config, app)
        await consumer.start()
        try:
            shards, channel = shard_stub(consumer)
            if n == 0:
                await shards.Apply(
                    cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=shard)])
                )
            await until(lambda: _equals(statuses(shards), [(f"consumer-{n}:primary", want)]))
            if n == 0:  # Transactions recorded after the primary's first hints.
                await publish_inputs(sums_stub, 40, seed=7)
                await until(lambda: _consumed(app, 40))
            await channel.close()
            return await hints()
        finally:
            await consumer.stop()

    try:
        first = await serve(0, cpb.ReplicaStatus.PRIMARY)
        assert first[0] is not None and first[1] is not None and first[2] is None
        started_from = decode_hints(first[0])
        second = await serve(1, cpb.ReplicaStatus.PRIMARY)
        assert second[1] is not None and second[2] == first[1]  # The backups shifted down.
        reached = decode_hints(second[1])
        assert reached != started_from
        assert _last_seq(reached) > _last_seq(started_from)  # Covers what consumer-0 recorded.

        app.broken = True
        third = await serve(2, cpb.ReplicaStatus.FAILED)
        assert third == second  # Nothing rotated for a store that never opened.
    finally:
        await etcd.delete_prefix(root.encode())
        await etcd.delete_prefix(shard.hint_prefix.encode())
        await etcd.close()


async def test_a_stat_ends_when_its_token_expires(
    etcd_server: EtcdServer, sums_broker: BrokerHarness, tmp_path: Path
) -> None:
    """A consumer verifying tokens bounds each call by its token: a Stat waiting for offsets
    its shard has not read ends UNAUTHENTICATED at the token's exp plus the 5 s of leeway."""
    import base64
    import time

    import jwt

    from plumbing import auth

    key = b"a key for the consumer's own tokens, 32+ bytes"
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        id="consumer-auth",
        broker_address=sums_broker.endpoint,
        etcd_address=etcd_server.endpoint,
        etcd_prefix=root,
        etcd_lease=5.0,
        drain_timeout=5.0,
        auth_keys=base64.b64encode(key).decode(),
    )
    consumer = Consumer(config, StoredSummer(tmp_path))
    await consumer.start()
    signer = auth.KeyedAuth([key])

    def bearer(ttl: float) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {signer.sign(auth.ALL, None, ttl)}"),)

    shards, channel = shard_stub(consumer)
    try:
        full = bearer(600)
        spec = cpb.ShardSpec(
            id="summer-0",
            sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )
        change = cpb.ApplyRequest.Change(upsert=spec)
        applied = await shards.Apply(cpb.ApplyRequest(changes=[change]), metadata=full)
        assert applied.status == cpb.OK

        async def running() -> bool:
            stat = await shards.Stat(cpb.StatRequest(shard="summer-0"), metadata=full)
            return stat.status == cpb.OK  # type: ignore[no-any-return]

        await until(running)
        short = bearer(2)
        exp = jwt.decode(short[0][1].removeprefix("Bearer "), options={"verify_signature": False})["exp"]  # fmt: skip
        far = cpb.StatRequest(shard="summer-0", read_through={INPUT: 1 << 40})
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await shards.Stat(far, metadata=short, timeout=15)
        at = time.time()
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED, ended.value
        assert "expired" in (ended.value.details() or "")
        assert exp + auth.LEEWAY - 0.5 <= at <= exp + auth.LEEWAY + 2, at - exp
        # The shard serves on: the consumer only ended that call.
        assert (
            await shards.Stat(cpb.StatRequest(shard="summer-0"), metadata=full)
        ).status == cpb.OK
    finally:
        await channel.close()
        await consumer.stop()
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


async def test_a_primary_fetches_its_sources_specs_by_name(
    etcd_server: EtcdServer,
    sums_broker: BrokerHarness,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting a shard lists its sources' specs by name (as upstream's fetchJournalSpec), never
    every journal: with one List of all journals per shard, starting N shards of N journals
    was quadratic, and at 1,000 shards the brokers' answers outlived the 30 s deadline and
    shards FAILED (shard_scale, docs/benchmarks-history.md)."""
    from broker.client.journals import JournalsClient
    from broker.protocol import labels

    selectors: list[Any] = []
    original = JournalsClient.list

    async def recording(self: JournalsClient, selector: Any = None) -> Any:
        selectors.append(selector)
        return await original(self, selector)

    monkeypatch.setattr(JournalsClient, "list", recording)
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    async with consumers(etcd_server, sums_broker, root, tmp_path, 1) as (consumer,):
        shards, channel = shard_stub(consumer)
        spec = cpb.ShardSpec(
            id="summer-0",
            # The same journal twice (a suffix reads it again): its spec is fetched once.
            sources=[cpb.ShardSpec.Source(journal=INPUT), cpb.ShardSpec.Source(journal=f"{INPUT};again")],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )  # fmt: skip
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))

        async def primary() -> bool:
            return await statuses(shards) == [("consumer-0:primary", cpb.ReplicaStatus.PRIMARY)]

        await until(primary)
        await channel.close()
    assert [labels.format_selector(s) for s in selectors] == [f"name={INPUT}"]


async def test_a_primary_waits_through_brokers_that_do_not_answer_its_sources_specs(
    etcd_server: EtcdServer,
    sums_broker: BrokerHarness,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker too busy to answer in time (5,000 shards starting at once on a loaded machine:
    the List of their sources' specs past its 30 s deadline), or unreachable a moment, is no
    failure of the shard: it asks again, and is PRIMARY once answered, not FAILED until an
    operator unassigns it (shard_scale, docs/benchmarks-history.md)."""
    from broker.client.journals import BrokerUnavailable, JournalsClient

    refusals = 2
    original = JournalsClient.list

    async def busy(self: JournalsClient, selector: Any = None) -> Any:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise BrokerUnavailable(f"cannot reach broker at {self.address}: Deadline Exceeded")
        return await original(self, selector)

    monkeypatch.setattr(JournalsClient, "list", busy)
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    async with consumers(etcd_server, sums_broker, root, tmp_path, 1) as (consumer,):
        shards, channel = shard_stub(consumer)
        spec = cpb.ShardSpec(
            id="summer-0",
            sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))

        async def primary() -> bool:
            return await statuses(shards) == [("consumer-0:primary", cpb.ReplicaStatus.PRIMARY)]

        await until(primary)
        await channel.close()
    assert refusals == 0


async def test_no_replica_starts_once_a_stopping_process_closed_its_shards(
    etcd_server: EtcdServer, sums_broker: BrokerHarness, tmp_path: Path
) -> None:
    """A stopping process closes its shards before its other tasks; a shard assigned to it in
    between (every process of the application exiting at once, the allocator still placing)
    is not started, and the process does not fail on its way out (it did: `shards is closed:
    cannot start ...`, seen stopping 5,000 shards in shard_scale)."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    async with consumers(etcd_server, sums_broker, root, tmp_path, 1) as (consumer,):
        shards, channel = shard_stub(consumer)
        await consumer.shards.close()  # As Consumer.stop does, before its other tasks.

        spec = cpb.ShardSpec(
            id="summer-0",
            sources=[cpb.ShardSpec.Source(journal=INPUT)],
            max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
        )
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))

        async def assigned() -> bool:
            return await statuses(shards) == [("consumer-0:primary", cpb.ReplicaStatus.IDLE)]

        await until(assigned)

        def reconciled() -> bool:
            # The keyspace holds the assignment (its update set `changed`), and the reconcile
            # loop has taken that change (it clears `changed` as it reconciles).
            replicas = consumer.shard_replicas
            return "summer-0" in replicas._local_assignments() and not replicas.changed.is_set()

        await until(reconciled, "the reconcile loop has seen the assignment")
        await channel.close()
        assert consumer.failure is None and not consumer.done.is_set()
        assert consumer.replicas == {}
