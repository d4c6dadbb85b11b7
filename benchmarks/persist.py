"""persist: MB/s of fragments persisted to a file:// store while one client appends at full speed
to a journal replicated on three broker processes (1 MiB appends, 16 MiB fragments). Timed from the
first append until every completed fragment is in the store; also reports the append rate of the
same run (persisting competes with appending for the same cores)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster import appenders, cluster
from benchmarks._fragments import STORE
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb

JOURNAL = "bench/persist"
APPEND = 1 << 20
FRAGMENT = 16 << 20


def spec(codec: pb.CompressionCodec) -> pb.JournalSpec:
    out = pb.JournalSpec(name=JOURNAL, replication=3)
    out.fragment.length = FRAGMENT
    out.fragment.compression_codec = codec
    out.fragment.stores.append(STORE)
    out.fragment.refresh_interval.seconds = 60
    return out


async def measure(root: Path, duration: float, codec: pb.CompressionCodec) -> dict[str, Any]:
    payload = bytes(range(256)) * (APPEND // 256)
    (root / "fragments").mkdir()
    async with cluster(JOURNAL, spec=spec(codec), file_root=root) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        start = time.perf_counter()
        latencies, elapsed = await appenders(
            stub, JOURNAL, payload, concurrency=1, duration=duration
        )
        appended = len(latencies) * APPEND
        # Every fragment before the spool's current one is complete, and is to be persisted.
        listing = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
        completed = max(f.spec.begin for f in listing.fragments)
        store = open_store(STORE, file_root=root)
        deadline = time.monotonic() + 120
        while True:
            listed = store.list_fragments(JOURNAL)
            through = max((f.end for f in listed), default=0)
            if through >= completed:
                break
            assert time.monotonic() < deadline, f"persisted through {through} of {completed}"
            await asyncio.sleep(0.02)
        persist_elapsed = time.perf_counter() - start
        persisted = sum(f.end - f.begin for f in listed)
    return {
        "value": persisted / persist_elapsed / 1e6,
        "append_mb_per_s": appended / elapsed / 1e6,
        "fragments": len(listed),
        "persisted_bytes": persisted,
    }


def run(quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gazette-bench-persist-") as tmp:
        result = asyncio.run(measure(Path(tmp), 2.0 if quick else 8.0, pb.NONE))
    return {
        "value": round(result["value"], 1),
        "unit": "MB/s",
        "append_mb_per_s": round(result["append_mb_per_s"], 1),
        "fragments": result["fragments"],
        "persisted_bytes": result["persisted_bytes"],
        "codec": "NONE",
    }


if __name__ == "__main__":
    print(run())
