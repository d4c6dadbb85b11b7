"""auth_overhead: `append_small` (256-byte appends from 64 concurrent appenders, replication 3)
with token verification on (brokers given --broker.auth-keys; the client signs its tokens, the
brokers verify each call's and sign their own to replicate), beside the same run with it off,
in this run. Target ratio 0.9.

The machine is shared and noisy, so the two are measured in alternating rounds (off, on, off,
on, ...: three pairs, one with --quick) and each side reported by its median round: a burst of
load then lands on either side alike."""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks import append_small
from benchmarks._rounds import alternating


def run(quick: bool = False) -> dict[str, Any]:
    duration, pairs = (1.0, 1) if quick else (5.0, 3)
    on, off, pair_ratio, rounds = alternating(
        lambda: asyncio.run(append_small.measure(duration, auth=True)),
        lambda: asyncio.run(append_small.measure(duration)),
        pairs,
    )
    return {
        "value": round(on["value"], 1),
        "unit": "appends/s",
        "baseline": round(off["value"], 1),
        "ratio": round(on["value"] / off["value"], 2),
        "target": 0.9,
        "pair_ratio": pair_ratio,
        "p50_ms": round(on["p50_ms"], 2),
        "p99_ms": round(on["p99_ms"], 2),
        "baseline_p50_ms": round(off["p50_ms"], 2),
        "baseline_p99_ms": round(off["p99_ms"], 2),
        "rounds": rounds,
    }


if __name__ == "__main__":
    print(run())
