"""append_small: 256-byte appends from 64 concurrent appenders to a journal replicated on three
broker processes, appends/s with p50/p99 latency; baseline: the same chain of plain unary RPCs
(client -> relay -> two sinks) at the same concurrency. Full runs alternate three rounds of each
and report each side's median round (benchmarks/_rounds.py)."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from benchmarks._cluster import appenders, cluster, percentile
from benchmarks._rounds import alternating
from benchmarks.baselines.unary_chain import unary_chain

CONCURRENCY = 64
PAYLOAD = 256
JOURNAL = "bench/small"


async def measure(duration: float, *, auth: bool = False) -> dict[str, Any]:
    payload = b"x" * (PAYLOAD - 1) + b"\n"
    async with cluster(JOURNAL, auth=auth) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        latencies, elapsed = await appenders(
            stub, JOURNAL, payload, concurrency=CONCURRENCY, duration=duration
        )
    return {
        "value": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


def run(quick: bool = False) -> dict[str, Any]:
    duration, pairs = (1.0, 1) if quick else (5.0, 3)
    ours, base, pair_ratio, rounds = alternating(
        lambda: asyncio.run(measure(duration)),
        lambda: asyncio.run(unary_chain(CONCURRENCY, PAYLOAD, duration)),
        pairs,
    )
    return {
        "value": round(ours["value"], 1),
        "unit": "appends/s",
        "baseline": round(base["value"], 1),
        "ratio": round(ours["value"] / base["value"], 2),
        "target": 1.0,  # Issue 26: the unary chain passed.
        "pair_ratio": pair_ratio,
        "p50_ms": round(ours["p50_ms"], 2),
        "p99_ms": round(ours["p99_ms"], 2),
        "baseline_p50_ms": round(base["p50_ms"], 2),
        "baseline_p99_ms": round(base["p99_ms"], 2),
        "concurrency": CONCURRENCY,
        "rounds": rounds,
    }


if __name__ == "__main__":
    print(run())
