"""append_throughput: 3 brokers (separate processes), replication 3, one journal, 1 MiB appends
streamed in 128 KiB chunks to the primary, in MB/s; baseline: the bare relay chain (client ->
relay -> two sinks, each hashing and writing) with the same chunk and append sizes. Full runs
alternate three rounds of each and report each side's median round (benchmarks/_rounds.py)."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from benchmarks._cluster import appenders, cluster, percentile
from benchmarks._rounds import alternating
from benchmarks.baselines.relay import relay_throughput
from broker.client.appender import CHUNK

APPEND = 1 << 20
JOURNAL = "bench/throughput"


async def measure(duration: float, concurrency: int = 1, *, tls: bool = False) -> dict[str, Any]:
    payload = bytes(range(256)) * (APPEND // 256)
    async with cluster(JOURNAL, tls=tls) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        latencies, elapsed = await appenders(
            stub, JOURNAL, payload, concurrency=concurrency, duration=duration
        )
    return {
        "value": len(latencies) * APPEND / elapsed / 1e6,
        "appends": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


def run(quick: bool = False) -> dict[str, Any]:
    duration, pairs = (1.0, 1) if quick else (5.0, 3)
    ours, base, pair_ratio, rounds = alternating(
        lambda: asyncio.run(measure(duration)),
        lambda: asyncio.run(relay_throughput(duration, chunk_size=CHUNK, append_size=APPEND)),
        pairs,
    )
    return {
        "value": round(ours["value"], 1),
        "unit": "MB/s",
        "baseline": round(base["value"], 1),
        "ratio": round(ours["value"] / base["value"], 2),
        "target": 0.7,  # Issue 26.
        "pair_ratio": pair_ratio,
        "appends": ours["appends"],
        "p50_ms": round(ours["p50_ms"], 2),
        "p99_ms": round(ours["p99_ms"], 2),
        "chunk_size": CHUNK,
        "append_size": APPEND,
        "rounds": rounds,
    }


if __name__ == "__main__":
    print(run())
