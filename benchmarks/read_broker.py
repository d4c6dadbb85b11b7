"""read_broker: a journal of persisted fragments (1 GiB in 64 MiB NONE fragments, in a file://
store) read through a broker, MB/s; baseline: a bare grpc.aio server process reading the same
fragment files and streaming them to this process in messages of the broker's read chunk size.

The value is what our Reader does by default: it checks each fragment's SHA-1 as it arrives.
`unverified` is the same read without that check (the broker's path alone, as the baseline,
which hashes nothing). Full runs alternate three rounds of each (verified, baseline,
unverified, ...) and report each one's median round (benchmarks/_rounds.py), every round listed
as `rounds=[verified/baseline/unverified, ...]`; `pair_ratio` is the median of the rounds' own
verified/baseline ratios (each pair measured back to back, under the same load)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster import cluster
from benchmarks._fragments import read_spec, write_fragments
from benchmarks._rounds import median_round
from benchmarks.baselines.file_stream import stream_files
from broker.client.reader import read
from broker.read_api import CHUNK

JOURNAL = "bench/read"


async def measure(
    root: Path, total: int, direct: bool, verify: bool = True, *, tls: bool = False
) -> dict[str, Any]:
    async with cluster(
        JOURNAL, brokers=1, spec=read_spec(JOURNAL), file_root=root, writable=False, tls=tls
    ) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        # Wait for the broker's first listing of the store.
        deadline = time.monotonic() + 30
        while True:
            got = 0
            async for chunk in read(stub, JOURNAL, total - 1, direct=direct, file_root=root):
                got += len(chunk.content)
            if got == 1:
                break
            assert time.monotonic() < deadline, "the broker never listed the fragments"
            await asyncio.sleep(0.1)
        read_bytes = 0
        start = time.perf_counter()
        async for chunk in read(stub, JOURNAL, 0, direct=direct, file_root=root, verify=verify):
            read_bytes += len(chunk.content)
        elapsed = time.perf_counter() - start
    assert read_bytes == total, f"read {read_bytes} of {total} bytes"
    return {"value": total / elapsed / 1e6, "seconds": elapsed}


def run(quick: bool = False) -> dict[str, Any]:
    total = (64 if quick else 1024) << 20
    pairs = 1 if quick else 3
    verified: list[dict[str, Any]] = []
    unverified: list[dict[str, Any]] = []
    bases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gazette-bench-read-") as tmp:
        root = Path(tmp)
        directory = write_fragments(root, JOURNAL, total, 64 << 20)
        for _ in range(pairs):
            verified.append(asyncio.run(measure(root, total, direct=False)))
            bases.append(asyncio.run(stream_files(directory, CHUNK)))
            unverified.append(asyncio.run(measure(root, total, direct=False, verify=False)))
    ours, base, plain = median_round(verified), median_round(bases), median_round(unverified)
    rounds = [
        f"{v['value']:.4g}/{b['value']:.4g}/{u['value']:.4g}"
        for v, b, u in zip(verified, bases, unverified, strict=True)
    ]
    pair_ratio = statistics.median(
        v["value"] / b["value"] for v, b in zip(verified, bases, strict=True)
    )
    return {
        "value": round(ours["value"], 1),
        "unit": "MB/s",
        "baseline": round(base["value"], 1),
        "ratio": round(ours["value"] / base["value"], 2),
        "pair_ratio": round(pair_ratio, 2),
        "target": 0.6,
        "unverified": round(plain["value"], 1),
        "unverified_ratio": round(plain["value"] / base["value"], 2),
        "bytes": total,
        "chunk_size": CHUNK,
        "rounds": rounds,
    }


if __name__ == "__main__":
    print(run())
