"""tls_cost: the cost of TLS, as upstream's operators would run it (server and peer certificates,
client certificates required): `append_throughput` (3 brokers, replication 3, 1 MiB appends)
and `read_broker` (1 GiB of persisted fragments read through a broker), each with TLS on
beside the same run in plaintext in this run. The value is TLS append MB/s; `ratio` is the
lower of the two TLS/plaintext ratios (target 0.8), each reported with its figures."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import append_throughput, read_broker
from benchmarks._fragments import write_fragments


def run(quick: bool = False) -> dict[str, Any]:
    duration = 1.0 if quick else 5.0
    # Alternate the runs, so that a noisy neighbour weighs on both alike.
    plain_a = asyncio.run(append_throughput.measure(duration))
    tls_a = asyncio.run(append_throughput.measure(duration, tls=True))
    total = (64 if quick else 1024) << 20
    with tempfile.TemporaryDirectory(prefix="gazette-bench-tls-") as tmp:
        root = Path(tmp)
        write_fragments(root, read_broker.JOURNAL, total, 64 << 20)
        plain_r = asyncio.run(read_broker.measure(root, total, direct=False))
        tls_r = asyncio.run(read_broker.measure(root, total, direct=False, tls=True))
    append_ratio = tls_a["value"] / plain_a["value"]
    read_ratio = tls_r["value"] / plain_r["value"]
    return {
        "value": round(tls_a["value"], 1),
        "unit": "MB/s",
        "baseline": round(plain_a["value"], 1),
        "ratio": round(min(append_ratio, read_ratio), 2),
        "target": 0.8,
        "append_tls": round(tls_a["value"], 1),
        "append_plaintext": round(plain_a["value"], 1),
        "append_ratio": round(append_ratio, 2),
        "append_p50_ms_tls": round(tls_a["p50_ms"], 2),
        "append_p50_ms_plaintext": round(plain_a["p50_ms"], 2),
        "read_tls": round(tls_r["value"], 1),
        "read_plaintext": round(plain_r["value"], 1),
        "read_ratio": round(read_ratio, 2),
    }


if __name__ == "__main__":
    print(run())
