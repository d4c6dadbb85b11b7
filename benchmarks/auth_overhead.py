"""auth_overhead: `append_small` (256-byte appends from 64 concurrent appenders, replication 3)
with token verification on (brokers given --broker.auth-keys; the client signs its tokens, the
brokers verify each call's and sign their own to replicate), beside the same run with it off,
in this run. Target ratio 0.9."""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks import append_small


def run(quick: bool = False) -> dict[str, Any]:
    duration = 1.0 if quick else 5.0
    off = asyncio.run(append_small.measure(duration))
    on = asyncio.run(append_small.measure(duration, auth=True))
    return {
        "value": round(on["value"], 1),
        "unit": "appends/s",
        "baseline": round(off["value"], 1),
        "ratio": round(on["value"] / off["value"], 2),
        "target": 0.9,
        "p50_ms": round(on["p50_ms"], 2),
        "p99_ms": round(on["p99_ms"], 2),
        "baseline_p50_ms": round(off["p50_ms"], 2),
        "baseline_p99_ms": round(off["p99_ms"], 2),
    }


if __name__ == "__main__":
    print(run())
