"""The consumer tests' shared parts. A pytest plugin (registered in conftest): one in-process
broker with an input and an output journal of JSON lines, and a Journal stub to it. Then the
applications they run (`Summer` and its stored and recorded kinds, `WordTotals`), inputs
published to them, their committed outputs checked, and shards' statuses read. Consumer
processes (`ConsumerProcesses`) and the rest come from the test kit, `consumer.testing`."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.client.append_service import AppendService
from broker.client.journals import dial
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from consumer.protocol import cpb
from consumer.runtime import Consumer
from consumer.store import JSONFileStore
from consumer.testing import ConsumerProcesses as ConsumerProcesses
from consumer.testing import create_journals, journal_spec
from consumer.transaction import Shard
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Envelope, Sequencer
from message.types import DictMessages
from tests.helpers.journals import started_brokers

INPUT, OUTPUT = "sums/input", "sums/output"


def spec(name: str) -> pb.JournalSpec:
    """A journal of JSON lines, one replica."""
    return journal_spec(name)


@pytest.fixture
async def sums_broker(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-txn"], run_allocator=True
    ) as (harness,):
        await create_journals(harness.endpoint, [spec(INPUT), spec(OUTPUT)])
        yield harness


@pytest.fixture
async def sums_stub(sums_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(sums_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()


KEYS = [f"key-{i}" for i in range(5)]


class Summer:
    """Adds each input's `n` to its key's sum, and publishes the new sum (uncommitted)."""

    def __init__(self) -> None:
        self.consumed = 0

    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        key, n = envelope.message["key"], envelope.message["n"]
        store.state[key] = store.state.get(key, 0) + n
        self.consumed += 1
        await publisher.publish_uncommitted(
            lambda _m: Partition(OUTPUT, "application/x-ndjson"),
            {"key": key, "sum": store.state[key]},
        )

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None


class Expected(Counter[str]):
    """The expected sums, and per key the running sums in input order (what the outputs must
    be, read committed)."""

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, list[int]] = {}

    def add(self, key: str, n: int) -> None:
        self[key] += n
        self.running.setdefault(key, []).append(self[key])


async def publish_inputs(stub: pb_grpc.JournalStub, count: int, seed: int) -> Expected:
    """`count` committed inputs in transactions of random sizes, and an aborted transaction
    between them; returns the expected sums."""
    rng = random.Random(seed)
    expected = Expected()
    to_input = lambda _m: Partition(INPUT, "application/x-ndjson")  # noqa: E731
    async with AppendService(stub) as service:
        publisher = Publisher(service, DictMessages(), JSONLines())
        sent = 0
        while sent < count:
            size = min(count - sent, rng.randint(1, 7))
            for _ in range(size):
                key, n = rng.choice(KEYS), rng.randint(1, 100)
                expected.add(key, n)
                await publisher.publish_uncommitted(to_input, {"key": key, "n": n})
            await publisher.commit()
            sent += size
            if rng.random() < 0.2:
                for _ in range(3):
                    await publisher.publish_uncommitted(to_input, {"key": KEYS[0], "n": 10_000})
                await publisher.abort()
        await service.flush()
    return expected


async def write_head(stub: pb_grpc.JournalStub, journal: str) -> int:
    from broker.client.reader import write_head as head

    return await head(stub, journal)


async def committed_outputs(stub: pb_grpc.JournalStub) -> list[tuple[str, int]]:
    reader = Reader(DictMessages(), JSONLines())
    out = []
    async for envelope in read_committed(stub, OUTPUT, reader, Sequencer()):
        if not envelope.is_ack:
            out.append((envelope.message["key"], envelope.message["sum"]))
    return out


def check_outputs(outputs: list[tuple[str, int]], expected: Expected) -> None:
    """Per key, the published sums read committed are the running sums of its inputs, each
    once and in order: no output of a rolled-back or repeated transaction, and none lost."""
    by_key: dict[str, list[int]] = {}
    for key, total in outputs:
        by_key.setdefault(key, []).append(total)
    for key in KEYS:
        assert by_key.get(key, []) == expected.running.get(key, []), key


class StoredSummer(Summer):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    async def new_store(self, shard: Shard) -> JSONFileStore:
        return JSONFileStore(self.root, shard.spec.id)


def shard_stub(consumer: Consumer) -> Any:
    channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
    return cpb_grpc.ShardStub(channel), channel  # type: ignore[no-untyped-call]


async def statuses(shards: Any) -> list[tuple[str, int]]:
    listed = await shards.List(cpb.ListRequest())
    out = []
    for shard in listed.shards:
        for member, status in zip(shard.route.members, shard.status, strict=True):
            slot = "primary" if shard.route.members[shard.route.primary] == member else "standby"
            out.append((f"{member.suffix}:{slot}", status.code))
    return sorted(out)


async def _equals(got: Any, expected: Any) -> bool:
    return bool(await got == expected)


class RecordedSummer(Summer):
    """Sums in a SQLite store recorded into the shard's recovery log. `broken`: its store fails
    to open, as a corrupt database does."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    async def new_store(self, shard: Shard) -> Any:
        from consumer.store_sqlite import SQLiteStore

        if self.broken:
            raise RuntimeError("database disk image is malformed")
        return SQLiteStore(shard.recorder)

    async def consume_message(
        self, shard: Shard, store: Any, envelope: Any, publisher: Any
    ) -> None:
        key, n = envelope.message["key"], envelope.message["n"]

        def add(db: Any) -> None:
            db.execute("CREATE TABLE IF NOT EXISTS sums (key TEXT PRIMARY KEY, total INTEGER)")
            db.execute(
                "INSERT INTO sums VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET total = total + ?",
                (key, n, n),
            )

        await store.run(add)
        self.consumed += 1


async def _consumed(app: Summer, count: int) -> bool:
    return app.consumed >= count


def primaries(summers: ConsumerProcesses, alive: list[str]) -> set[str]:
    """The processes hosting a shard's primary, as a live summer lists them."""
    return summers.primaries()


class WordTotals:
    """Counts words in a JSON-file store per shard, and publishes each word's new total to the
    journal named by the shard's `totals` label, in the shard's transaction: the application of
    docs/applications.md, whose worked example (tests/test_application_guide.py, quoted whole)
    defines its own; tests that need an application to run a consumer take this one."""

    def __init__(self, store_root: str | None = None) -> None:
        # As a process (`python -m consumer serve --app ...`), from its environment.
        self.store_root = store_root or os.environ["CONSUMER_STORE_ROOT"]

    async def new_store(self, shard: Shard) -> JSONFileStore:
        return JSONFileStore(self.store_root, shard.spec.id)

    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        word = envelope.message["word"]
        store.state[word] = store.state.get(word, 0) + 1
        totals = next(x.value for x in shard.spec.labels.labels if x.name == "totals")
        await publisher.publish_uncommitted(
            lambda _m: Partition(totals, "application/x-ndjson"),
            {"word": word, "total": store.state[word]},
        )

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None


def standbys_tail(group: ConsumerProcesses, shards: int) -> bool:
    """Whether each of the `shards` shards has a hot standby tailing its recovery log (a replica
    whose status is STANDBY, which a standby reports once it tails), as the first running process
    that answers lists them."""
    for consumer_id in group.running():
        target = f"127.0.0.1:{group.ports[consumer_id]}"
        try:
            with (
                grpc.secure_channel(target, group.tls)
                if group.tls
                else grpc.insecure_channel(target)
            ) as channel:
                stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
                listed = stub.List(cpb.ListRequest(), timeout=2, metadata=group.metadata)
        except grpc.RpcError:
            continue
        return len(listed.shards) == shards and all(
            any(s.code == cpb.ReplicaStatus.STANDBY for s in shard.status)
            for shard in listed.shards
        )
    return False
