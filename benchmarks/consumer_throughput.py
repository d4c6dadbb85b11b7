"""consumer_throughput: messages/s through one shard end to end, exactly once: a source journal
of 200-byte JSON messages written in transactions of 100, read by the shard's transaction loop
(read-uncommitted, sequenced), each message counted per key in a JSON-file store and published
again (uncommitted) to an output journal, whose ACKs commit after the store's commit.

Baseline in the same run: the read-committed iterator over the same journal feeding a Publisher
that writes the same messages to another output journal in one process (no store, no
checkpoint, one commit at the end). Target: ratio >= 0.9. A full run alternates three rounds of
each over the same source and reports medians, the median of the rounds' own ratios and every
pair; `--quick` runs one pair of 20,000 messages."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from typing import Any

from benchmarks._cluster import _journal, cluster, placed
from benchmarks._messages import MESSAGE_SIZE, transactions
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.protocol import protocol_pb2 as pb
from consumer.protocol import cpb
from consumer.store import JSONFileStore
from consumer.transaction import Shard, Source, run_shard
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Envelope
from message.types import DictMessages

SOURCE, OUTPUT, BASELINE_OUTPUT = "bench/source", "bench/output", "bench/baseline-output"
APPEND_CHUNK = 16 << 20


def _spec(name: str) -> pb.JournalSpec:
    spec = _journal(name)
    spec.replication = 1
    spec.labels.labels.add(name="content-type", value="application/x-ndjson")
    return spec


class Counter:
    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        key = envelope.message["key"]
        store.state[key] = store.state.get(key, 0) + 1
        await publisher.publish_uncommitted(_to_output, envelope.message)

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None


def _to_output(_message: Any) -> Partition:
    return Partition(OUTPUT, "application/x-ndjson")


def _to_baseline(_message: Any) -> Partition:
    return Partition(BASELINE_OUTPUT, "application/x-ndjson")


async def _baseline(stub: Any, end: int, count: int) -> float:
    """Read committed, publish each message again, commit once: seconds."""
    start = time.perf_counter()
    delivered = 0
    async with AppendService(stub) as service:
        publisher = Publisher(service, DictMessages(), JSONLines())
        reader = Reader(DictMessages(), JSONLines())
        async for envelope in read_committed(stub, SOURCE, reader, end_offset=end):
            if envelope.is_ack:
                continue
            await publisher.publish_uncommitted(_to_baseline, envelope.message)
            delivered += 1
        await publisher.commit()
    seconds = time.perf_counter() - start
    assert delivered == count, f"baseline delivered {delivered} of {count}"
    return seconds


async def _shard(stub: Any, end: int, count: int) -> float:
    """One shard from a new store, exactly once, through its store and checkpoints: seconds
    until its progress covers the source."""
    with tempfile.TemporaryDirectory(prefix="gazette-bench-store-") as root:
        store = JSONFileStore(root, "bench-shard")
        async with AppendService(stub) as service:
            spec = cpb.ShardSpec(id="bench-shard", sources=[cpb.ShardSpec.Source(journal=SOURCE)])
            spec.max_txn_duration.FromMilliseconds(1000)
            shard = Shard(spec, service, Publisher(service, DictMessages(), JSONLines()))
            source = Source(SOURCE, DictMessages(), JSONLines())
            start = time.perf_counter()
            task = asyncio.create_task(run_shard(shard, Counter(), store, [source], lambda: stub))
            try:
                await shard.progress.wait_for({SOURCE: end})
                seconds = time.perf_counter() - start
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        check = JSONFileStore(root, "bench-shard")
        await check.restore_checkpoint()
        counted = sum(check.state.values())
        assert counted == count, f"the store counted {counted} of {count}"
    return seconds


async def measure(count: int, pairs: int = 1) -> dict[str, Any]:
    """`pairs` rounds of each over the same source, alternating (baseline first)."""
    data, _acks = transactions(count, 100)
    async with cluster(SOURCE, brokers=1, spec=_spec(SOURCE)) as (addresses, dialer):
        for name in (OUTPUT, BASELINE_OUTPUT):
            await placed(addresses[0], _spec(name))
        stub = dialer.journal_stub(addresses[0])
        for at in range(0, len(data), APPEND_CHUNK):
            await append(stub, SOURCE, data[at : at + APPEND_CHUNK])
        end = len(data)
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(pairs):
            theirs.append(await _baseline(stub, end, count))
            ours.append(await _shard(stub, end, count))
    return {"seconds": ours, "baseline_seconds": theirs}


def run(quick: bool = False) -> dict[str, Any]:
    count, pairs = (20_000, 1) if quick else (200_000, 3)
    result = asyncio.run(measure(count, pairs))
    rates = [count / s for s in result["seconds"]]
    baselines = [count / s for s in result["baseline_seconds"]]
    rate, baseline = statistics.median(rates), statistics.median(baselines)
    return {
        "value": round(rate),
        "unit": "messages/s",
        "baseline": round(baseline),
        "ratio": round(rate / baseline, 2),
        "pair_ratio": round(
            statistics.median(a / b for a, b in zip(rates, baselines, strict=True)), 2
        ),
        "rounds": [f"{a:.4g}/{b:.4g}" for a, b in zip(rates, baselines, strict=True)],
        "target_ratio": 0.9,
        "met": rate / baseline >= 0.9,
        "messages": count,
        "message_bytes": MESSAGE_SIZE,
        "transaction_size": 100,
    }


if __name__ == "__main__":
    print(run())
