"""The Structured Streaming source's test drive: a broker with the topic's journals, a
history of committed, aborted and duplicated messages, and micro-batches planned and read as
Spark does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.reader import read
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from gazctl.spark.stream_plan import (
    StreamOptions,
)
from gazctl.spark.stream_source import GazetteStreamReader
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import Publisher, Reader, read_committed
from message.types import DictMessages
from tests.helpers.journals import routed, started_brokers
from tests.helpers.waiting import until

TOPIC = ["stream/part-000", "stream/part-001"]


def spec(name: str, store: str | None = None) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    if name.startswith("stream/"):
        out.labels.labels.add(name="topic", value="stream")
    out.fragment.length = 4096
    out.fragment.compression_codec = pb.GZIP
    out.fragment.refresh_interval.seconds = 1
    if store:
        out.fragment.stores.append(store)
    return out


@asynccontextmanager
async def broker_with(
    etcd_server: EtcdServer, prefix: str, root: Path, journals: list[str]
) -> AsyncIterator[tuple[str, pb_grpc.JournalStub]]:
    (root / "store").mkdir(parents=True, exist_ok=True)
    async with started_brokers(
        etcd_server.endpoint, prefix, ["bk-0"], run_allocator=True, file_root=str(root),
        persist_interval=0.2,
    ) as (broker,):  # fmt: skip
        async with broker.client() as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=spec(j, "file:///store/")) for j in journals]
            )
            for journal in journals:
                await routed(client, journal, 1)
        channel = dial(broker.endpoint)
        try:
            yield broker.endpoint, pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        finally:
            await channel.close(None)


async def write_history(stub: pb_grpc.JournalStub, rounds: int = 12) -> None:
    """Committed messages, a transaction larger than any small batch limit, an aborted one,
    messages without a UUID, and a retried append (the first partition's bytes again)."""
    partitions = [Partition(j, "application/x-ndjson") for j in TOPIC]
    mapping = modulo_mapping(lambda m: str(m["key"]).encode(), lambda: partitions)
    messages, framing = DictMessages(), JSONLines()
    async with AppendService(stub) as service:
        committed = Publisher(service, messages, framing)
        txn = Publisher(service, messages, framing)
        aborted = Publisher(service, messages, framing)
        for i in range(rounds):
            await committed.publish_committed(mapping, {"key": i, "kind": "committed"})
            await txn.publish_uncommitted(mapping, {"key": i, "kind": "txn"})
            if i < 5:
                await aborted.publish_uncommitted(mapping, {"key": i, "kind": "aborted"})
        await txn.commit()
        await aborted.abort()
        await service.flush()
    await append(stub, TOPIC[1], b'{"kind":"plain","key":1}\n{"kind":"plain","key":2}\n')
    copy = b"".join([c.content async for c in read(stub, TOPIC[0], 0)])
    await append(stub, TOPIC[0], copy)  # Every message of it twice: duplicates to drop.
    async with AppendService(stub) as service:
        late = Publisher(service, messages, framing)
        for i in range(6):
            await late.publish_uncommitted(mapping, {"key": i, "kind": "late"})
        await late.commit()


async def committed(stub: pb_grpc.JournalStub, journal: str) -> list[tuple[str, int, str]]:
    reader = Reader(DictMessages(), JSONLines())
    out = []
    async for env in read_committed(stub, journal, reader):
        if not env.is_ack:
            out.append((journal, env.begin, json.dumps(env.message, sort_keys=True)))
    return out


def run_batches(
    options: dict[str, str],
    *,
    restart_every: int = 0,
    limit: Any = None,
    start: Any = None,
    available_now: bool = False,
) -> tuple[list[list[tuple[str, int, str]]], dict[str, Any]]:
    """Micro-batches as Spark plans them, each offset through JSON (the offset log), with a new
    reader (a restarted query) every `restart_every` batches: the rows of each batch."""
    parsed = StreamOptions.parse(options)
    reader = GazetteStreamReader(parsed)
    if available_now:
        reader.prepareForTriggerAvailableNow()
    offset = start if start is not None else json.loads(json.dumps(reader.initialOffset()))
    limit = limit or reader.getDefaultReadLimit()
    batches = []
    while True:
        end = reader.latestOffset(offset, limit)
        if json.dumps(end) == json.dumps(offset):
            return batches, offset
        end = json.loads(json.dumps(end))
        rows = []
        partitions = reader.partitions(offset, end)
        assert set(reader._planned) == {p.journal for p in partitions}  # As latestOffset did.
        # A driver restarted after writing the offset plans the batch again: the same rows.
        again = GazetteStreamReader(parsed).partitions(offset, end)
        assert [plan_of(p) for p in again] == [plan_of(p) for p in partitions]
        for partition in partitions:
            for batch in reader.read(partition):
                for row in batch.to_pylist():
                    content = json.dumps(json.loads(row["content"]), sort_keys=True)
                    rows.append((row["journal"], row["offset"], content))
        batches.append(rows)
        offset = end
        if restart_every and len(batches) % restart_every == 0:
            reader = GazetteStreamReader(parsed)


def plan_of(partition: Any) -> tuple[Any, ...]:
    """A partition's range and plan, comparable with ==."""
    plan = partition.plan
    return (
        partition.journal, partition.begin, partition.end, plan.begins.tolist(),
        plan.ends.tolist(), plan.producers.tolist(), plan.ids, plan.clocks.tolist(),
        plan.flags.tolist(), plan.bad,
    )  # fmt: skip


def ordered(rows: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    return sorted(rows, key=lambda r: (r[0], r[1]))


def kinds_of(batches: list[list[tuple[str, int, str]]]) -> list[str]:
    return sorted(json.loads(c).get("kind", "(ack)") for b in batches for _, _, c in b)


async def persisted(stub: pb_grpc.JournalStub, journal: str, head: int) -> list[pb.Fragment]:
    """Suspend the journal (its spool persists) and wait until its listed fragments reach
    `head`, all of them in the store."""
    response = await append(stub, journal, b"", suspend=pb.AppendRequest.SUSPEND_NOW, check=False)
    assert response.status in (pb.OK, pb.SUSPENDED), response
    found: list[pb.Fragment] = []

    async def through() -> bool:
        nonlocal found
        listed = await stub.ListFragments(pb.FragmentsRequest(journal=journal))
        found = [f.spec for f in listed.fragments]
        return bool(found) and max(f.end for f in found) >= head and all(f.backing_store for f in found)  # fmt: skip

    await until(through, f"{journal} persisted through {head}", timeout=120, interval=0.1)
    return found


def sink_checkpoint(path: Path, batch: int) -> Path:
    """A query's checkpoint as Spark keeps it, as far as the sink reads it: its id, and its
    offset log through `batch`."""
    (path / "offsets").mkdir(parents=True, exist_ok=True)
    (path / "metadata").write_text('{"id":"5f0c7a52-query"}\n')
    (path / "offsets" / str(batch)).write_text("v1\n")
    return path
