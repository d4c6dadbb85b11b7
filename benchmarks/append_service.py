"""append_service: 1 KiB records through AppendService to a journal replicated on three broker
processes, records/s committed. Target >= 100,000/s. Reported beside append_throughput's bound:
records are batched into large appends, so the broker's MB/s caps records/s."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks._cluster import cluster
from broker.client.append_service import AppendService

RECORD = 1024
JOURNAL = "bench/service"


async def measure(duration: float) -> dict[str, Any]:
    record = b"r" * (RECORD - 1) + b"\n"
    async with cluster(JOURNAL) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        async with AppendService(stub) as service:
            written = 0
            start = time.perf_counter()
            stop = start + duration
            last = None
            while time.perf_counter() < stop:
                for _ in range(256):
                    last = await service.write(JOURNAL, record)
                written += 256
            assert last is not None
            await service.flush()
            elapsed = time.perf_counter() - start
            appends = service.appends
    return {"records": written, "seconds": elapsed, "appends": appends}


def run(quick: bool = False) -> dict[str, Any]:
    result = asyncio.run(measure(1.0 if quick else 5.0))
    rate = result["records"] / result["seconds"]
    return {
        "value": round(rate),
        "unit": "records/s",
        "target": 100_000,
        "mb_per_s": round(rate * RECORD / 1e6, 1),
        "records": result["records"],
        "appends": result["appends"],
        "records_per_append": round(result["records"] / max(result["appends"], 1)),
    }


if __name__ == "__main__":
    print(run())
