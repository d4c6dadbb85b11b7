"""read_direct: the journal of read_broker read by a client straight from the store through the
fragment URLs a broker returns, verifying each fragment's SHA-1, MB/s; baseline: one Python process
reading the same fragment files and SHA-1 hashing them. Full runs alternate three rounds of each
and report each side's median round (benchmarks/_rounds.py); `pair_ratio` is the median of the
rounds' own ratios (each pair measured back to back)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._fragments import write_fragments
from benchmarks._rounds import median_round
from benchmarks.baselines.file_stream import hash_files
from benchmarks.read_broker import JOURNAL, measure


def run(quick: bool = False) -> dict[str, Any]:
    total = (64 if quick else 1024) << 20
    pairs = 1 if quick else 3
    mine: list[dict[str, Any]] = []
    theirs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="gazette-bench-read-") as tmp:
        root = Path(tmp)
        directory = write_fragments(root, JOURNAL, total, 64 << 20)
        for _ in range(pairs):
            mine.append(asyncio.run(measure(root, total, direct=True)))
            theirs.append(hash_files(directory))
    ours, base = median_round(mine), median_round(theirs)
    pair_ratio = statistics.median(
        a["value"] / b["value"] for a, b in zip(mine, theirs, strict=True)
    )
    return {
        "value": round(ours["value"], 1),
        "unit": "MB/s",
        "baseline": round(base["value"], 1),
        "ratio": round(ours["value"] / base["value"], 2),
        "pair_ratio": round(pair_ratio, 2),
        "target": 0.85,
        "bytes": total,
        "rounds": [f"{a['value']:.4g}/{b['value']:.4g}" for a, b in zip(mine, theirs, strict=True)],
    }


if __name__ == "__main__":
    print(run())
