"""Issue 38, item 5: replicas that start while their etcd is SIGKILLed and started again.

A real etcd SIGKILLed refuses connections at once, and aetcd raises at once (it does not wait as
Go's clientv3 does). A replica with a recovery log (a new primary, or a standby) reads its
shard's hints from etcd as it starts: that read, as every other etcd call on the way to PRIMARY
or STANDBY, must wait out etcd's restart, not fail the shard (a FAILED shard stays so until an
operator unassigns it).

The consumers here use an etcd of the test's own, which it kills by pid and starts again on the
same data directory and port; the brokers use the session's etcd. The kill is timed by a hook
around the runtime's hints read: the hook kills etcd as the replica starts that read, and the
real read then meets the dead etcd (the hook changes no behaviour: it only picks the moment)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aetcd
import pytest
from google.protobuf import duration_pb2

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from consumer import replicas as runtime  # Where the replicas read their hints.
from consumer.protocol import cpb
from consumer.runtime import Consumer, ConsumerConfig
from tests.helpers.consumers import INPUT, RecordedSummer, publish_inputs, shard_stub, write_head
from tests.helpers.waiting import until

SHARD = "sum-r"


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own (its own data directory and ports), which it kills and
    starts again; stopped by its pid at the end."""
    with EtcdServer() as server:
        yield server


def kill_etcd(server: EtcdServer) -> None:
    """SIGKILL etcd by its pid, as a machine failing: its data directory and port stay."""
    proc, server.proc = server.proc, None
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


class KillAtHintsRead:
    """Kills `server` as the runtime's next hints read (`fetch_hints`) starts, and starts it
    again (same data directory, same port) `down` seconds later in a task it owns. The read
    itself is the real one, against the dead etcd."""

    def __init__(self, server: EtcdServer, down: float = 1.5) -> None:
        self.server = server
        self.down = down
        self.armed = False
        self.killed = asyncio.Event()
        self.restarted = asyncio.Event()
        self.restart: asyncio.Task[None] | None = None
        self.real = runtime.fetch_hints

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            kill_etcd(self.server)
            self.killed.set()
            self.restart = asyncio.create_task(self._start_again())
        return await self.real(*args, **kwargs)

    async def _start_again(self) -> None:
        await asyncio.sleep(self.down)  # The outage's length: etcd stays down this long.
        await asyncio.to_thread(self.server.start)
        self.restarted.set()

    async def close(self) -> None:
        if self.restart is not None:
            await self.restart


@pytest.fixture
async def recovery_log(sums_broker: BrokerHarness) -> AsyncIterator[str]:
    """A recovery log journal for the shard, on the brokers."""
    from gazctl.shards import RECOVERY_LOG_CONTENT_TYPE
    from tests.helpers.consumers import spec as journal_spec
    from tests.helpers.journals import routed

    name = f"recovery/{uuid.uuid4().hex[:12]}/{SHARD}"
    async with sums_broker.client() as client:
        log_spec = journal_spec(name)
        log_spec.labels.Clear()
        log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
        await client.apply([pb.ApplyRequest.Change(upsert=log_spec)])
        await routed(client, name, 1)
    yield name


def shard_spec(root: str, log_name: str, standbys: int) -> cpb.ShardSpec:
    return cpb.ShardSpec(
        id=SHARD, sources=[cpb.ShardSpec.Source(journal=INPUT)],
        recovery_log_prefix=log_name.rsplit("/", 1)[0], hint_prefix=f"{root}/hints",
        hint_backups=2, hot_standbys=standbys,
        max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
    )  # fmt: skip


def consumer_of(n: int, etcd: EtcdServer, broker: BrokerHarness, root: str) -> Consumer:
    config = ConsumerConfig(
        id=f"consumer-{n}", broker_address=broker.endpoint, etcd_address=etcd.endpoint,
        etcd_prefix=root, etcd_lease=10.0, drain_timeout=30.0,
    )  # fmt: skip
    return Consumer(config, RecordedSummer())


async def settled(shards: Any, who: str) -> int:
    """The status code of `who` ("consumer-N:primary" or "consumer-N:standby"), once it is
    settled in that role: PRIMARY (a primary) or STANDBY (a standby), or FAILED (-1 until
    then)."""
    listed = await shards.List(cpb.ListRequest())
    for shard in listed.shards:
        route = shard.route
        for index, (member, status) in enumerate(zip(route.members, shard.status, strict=True)):
            role = "primary" if index == route.primary else "standby"
            # A primary just promoted still says STANDBY until its hand-off completes.
            ends = (cpb.ReplicaStatus.PRIMARY if role == "primary" else cpb.ReplicaStatus.STANDBY, cpb.ReplicaStatus.FAILED)  # fmt: skip
            if f"{member.suffix}:{role}" == who and status.code in ends:
                return int(status.code)
    return -1


async def wait_settled(shards: Any, who: str, timeout: float = 60.0) -> int:
    code = -1

    async def done() -> bool:
        nonlocal code
        code = await settled(shards, who)
        return code != -1

    await until(done, f"{who} settled", timeout=timeout)
    return code


async def errors_of(shards: Any) -> list[str]:
    listed = await shards.List(cpb.ListRequest())
    return [e for s in listed.shards for status in s.status for e in status.errors]


async def sums_in_store(consumer: Consumer) -> dict[str, int]:
    """The sums the shard's primary holds in its SQLite store (committed: its inputs are read
    through)."""
    replica = consumer.replicas[SHARD]
    assert replica.store is not None

    def read(db: Any) -> dict[str, int]:
        return {key: total for key, total in db.execute("SELECT key, total FROM sums")}

    return await replica.store.run(read)  # type: ignore[no-any-return,attr-defined]


async def read_through(consumer: Consumer, stub: pb_grpc.JournalStub) -> None:
    head = await write_head(stub, INPUT)
    shards, channel = shard_stub(consumer)
    try:
        async with asyncio.timeout(60):
            stat = await shards.Stat(cpb.StatRequest(shard=SHARD, read_through={INPUT: head}))
        assert stat.status == cpb.OK
    finally:
        await channel.close()


def code_name(code: int) -> str:
    return cpb.ReplicaStatus.Code.Name(code) if code >= 0 else "none"


async def test_a_new_primary_whose_hints_read_meets_a_killed_etcd_ends_primary(
    own_etcd: EtcdServer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    recovery_log: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shard with a recovery log starts as primary; etcd is SIGKILLed as it reads its hints,
    and started again 1.5 s later. The shard ends PRIMARY (not FAILED), and its sums are exact."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    hook = KillAtHintsRead(own_etcd)
    monkeypatch.setattr(runtime, "fetch_hints", hook)
    expected = await publish_inputs(sums_stub, 40, seed=3)
    consumer = consumer_of(0, own_etcd, sums_broker, root)
    await consumer.start()
    try:
        shards, channel = shard_stub(consumer)
        hook.armed = True
        spec = shard_spec(root, recovery_log, standbys=0)
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))
        async with asyncio.timeout(30):
            await hook.killed.wait()
        code = await wait_settled(shards, "consumer-0:primary")
        assert code == cpb.ReplicaStatus.PRIMARY, (code_name(code), await errors_of(shards))
        assert hook.restarted.is_set()
        more = await publish_inputs(sums_stub, 30, seed=4)
        await read_through(consumer, sums_stub)
        assert await sums_in_store(consumer) == dict(expected + more)
        assert consumer.failure is None
        await channel.close()
    finally:
        await hook.close()
        await consumer.stop()
        async with aetcd.Client(host=own_etcd.host, port=own_etcd.client_port) as client:
            await client.delete_prefix(root.encode())


async def test_a_new_standby_whose_hints_read_meets_a_killed_etcd_ends_standby_and_takes_over(
    own_etcd: EtcdServer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    recovery_log: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A primary runs; a second process joins and is assigned the hot standby, and etcd is
    SIGKILLed as that standby reads its hints (started again 1.5 s later). The standby ends
    STANDBY (not FAILED); promoted when the primary exits, it takes over, and the sums of every
    input, from before and after, are exact."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    hook = KillAtHintsRead(own_etcd)
    monkeypatch.setattr(runtime, "fetch_hints", hook)
    first = consumer_of(0, own_etcd, sums_broker, root)
    second = consumer_of(1, own_etcd, sums_broker, root)
    await first.start()
    started = [first]
    try:
        shards, channel = shard_stub(first)
        spec = shard_spec(root, recovery_log, standbys=1)
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))
        code = await wait_settled(shards, "consumer-0:primary")
        assert code == cpb.ReplicaStatus.PRIMARY, (code_name(code), await errors_of(shards))
        expected = await publish_inputs(sums_stub, 40, seed=5)
        await read_through(first, sums_stub)

        hook.armed = True
        await second.start()
        started.append(second)
        async with asyncio.timeout(30):
            await hook.killed.wait()
        code = await wait_settled(shards, "consumer-1:standby")
        assert code == cpb.ReplicaStatus.STANDBY, (code_name(code), await errors_of(shards))
        assert hook.restarted.is_set()

        # The primary exits (a third process joins, to keep the shard's two replicas): its
        # standby is promoted and takes over the log it tails.
        third = consumer_of(2, own_etcd, sums_broker, root)
        await third.start()
        started.append(third)
        await first.stop()
        started.remove(first)
        assert first.failure is None
        shards, channel = shard_stub(second)
        code = await wait_settled(shards, "consumer-1:primary")
        assert code == cpb.ReplicaStatus.PRIMARY, (code_name(code), await errors_of(shards))
        more = await publish_inputs(sums_stub, 30, seed=6)
        await read_through(second, sums_stub)
        assert await sums_in_store(second) == dict(expected + more)
        assert second.failure is None
        await channel.close()
    finally:
        await hook.close()
        await asyncio.gather(*(c.stop() for c in started))
        async with aetcd.Client(host=own_etcd.host, port=own_etcd.client_port) as client:
            await client.delete_prefix(root.encode())


async def test_a_consumer_started_while_etcd_is_killed_waits_for_it_and_serves(
    own_etcd: EtcdServer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    recovery_log: str,
) -> None:
    """A consumer process whose start meets etcd killed (refusing connections) waits for etcd to
    serve again (as upstream's clientv3 waits), rather than exiting: a shard it is then
    assigned ends PRIMARY with exact sums."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    kill_etcd(own_etcd)
    consumer = consumer_of(0, own_etcd, sums_broker, root)
    refused = asyncio.Event()
    loop = asyncio.get_running_loop()

    class Refused(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "etcd unavailable" in record.getMessage():
                loop.call_soon_threadsafe(refused.set)

    handler = Refused()
    logging.getLogger("plumbing.membership").addHandler(handler)
    starting = asyncio.create_task(consumer.start())
    try:
        # The start meets the refusal and says it waits: it has not failed.
        async with asyncio.timeout(30):
            await refused.wait()
        assert not starting.done(), starting.exception()
        await asyncio.to_thread(own_etcd.start)
        async with asyncio.timeout(30):
            await starting
        shards, channel = shard_stub(consumer)
        spec = shard_spec(root, recovery_log, standbys=0)
        await shards.Apply(cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=spec)]))
        code = await wait_settled(shards, "consumer-0:primary")
        assert code == cpb.ReplicaStatus.PRIMARY, (code_name(code), await errors_of(shards))
        expected = await publish_inputs(sums_stub, 30, seed=9)
        await read_through(consumer, sums_stub)
        assert await sums_in_store(consumer) == dict(expected)
        await channel.close()
    finally:
        logging.getLogger("plumbing.membership").removeHandler(handler)
        if not starting.done():
            starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await consumer.stop()
        if own_etcd.proc is None:
            await asyncio.to_thread(own_etcd.start)
        async with aetcd.Client(host=own_etcd.host, port=own_etcd.client_port) as client:
            await client.delete_prefix(root.encode())
