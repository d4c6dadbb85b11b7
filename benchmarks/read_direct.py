"""read_direct: the journal of read_broker read by a client straight from the store through the
fragment URLs a broker returns, verifying each fragment's SHA-1, MB/s; baseline: one Python process
reading the same fragment files and SHA-1 hashing them."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._fragments import write_fragments
from benchmarks.baselines.file_stream import hash_files
from benchmarks.read_broker import JOURNAL, measure


def run(quick: bool = False) -> dict[str, Any]:
    total = (64 if quick else 1024) << 20
    with tempfile.TemporaryDirectory(prefix="gazette-bench-read-") as tmp:
        root = Path(tmp)
        directory = write_fragments(root, JOURNAL, total, 64 << 20)
        ours = asyncio.run(measure(root, total, direct=True))
        base = hash_files(directory)
    return {
        "value": round(ours["value"], 1),
        "unit": "MB/s",
        "baseline": round(base["value"], 1),
        "ratio": round(ours["value"] / base["value"], 2),
        "target": 0.8,
        "bytes": total,
    }


if __name__ == "__main__":
    print(run())
