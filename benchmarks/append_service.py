"""append_service: 1 KiB records through AppendService to a journal replicated on three broker
processes, records/s committed. Target >= 150,000/s (issue 26).

Baseline in the same run, on the same cluster: as many bytes appended as one raw stream in
1 MiB chunks (`append`), the cluster's bound for them, as records/s of the same size. A full run
alternates three rounds of each and reports medians, the median of the rounds' own ratios and
every pair; `--quick` runs one pair."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from benchmarks._cluster import cluster
from benchmarks._rounds import median_round, paired
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.protocol import protocol_pb2_grpc as pb_grpc

RECORD = 1024
JOURNAL = "bench/service"
RAW_CHUNK = 1 << 20


async def _service(service: AppendService, duration: float) -> dict[str, Any]:
    record = b"r" * (RECORD - 1) + b"\n"
    written = 0
    os.sync()  # Each timed phase starts without the one before's writeback to pay.
    start = time.perf_counter()
    stop = start + duration
    while time.perf_counter() < stop:
        for _ in range(256):
            await service.write(JOURNAL, record)
        written += 256
    await service.flush()
    seconds = time.perf_counter() - start
    return {"value": written / seconds, "records": written}


async def _raw(stub: pb_grpc.JournalStub, records: int) -> dict[str, Any]:
    data = (b"r" * (RECORD - 1) + b"\n") * records
    os.sync()
    start = time.perf_counter()
    await append(
        stub,
        JOURNAL,
        (data[at : at + RAW_CHUNK] for at in range(0, len(data), RAW_CHUNK)),
        chunk_size=RAW_CHUNK,
    )
    return {"value": records / (time.perf_counter() - start)}


async def measure(duration: float, pairs: int) -> dict[str, Any]:
    async with cluster(JOURNAL) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        async with AppendService(stub) as service:
            for _ in range(pairs):
                ours.append(await _service(service, duration))
                theirs.append(await _raw(stub, ours[-1]["records"]))
            appends = service.appends
    return {"ours": ours, "theirs": theirs, "appends": appends}


def run(quick: bool = False) -> dict[str, Any]:
    duration, pairs = (1.0, 1) if quick else (4.0, 3)
    result = asyncio.run(measure(duration, pairs))
    ours, theirs = result["ours"], result["theirs"]
    mine, base = median_round(ours), median_round(theirs)
    pair_ratio, rounds = paired(ours, theirs)
    records = sum(r["records"] for r in ours)
    return {
        "value": round(mine["value"]),
        "unit": "records/s",
        "baseline": round(base["value"]),
        "ratio": round(mine["value"] / base["value"], 2),
        "pair_ratio": pair_ratio,
        "rounds": rounds,
        "target": 150_000,
        "mb_per_s": round(mine["value"] * RECORD / 1e6, 1),
        "raw_mb_per_s": round(base["value"] * RECORD / 1e6, 1),
        "records": records,
        "appends": result["appends"],
        "records_per_append": round(records / max(result["appends"], 1)),
    }


if __name__ == "__main__":
    print(run())
