"""replication_throughput: events/s over one replication connection A -> B (200-byte events):
A's log on a journal, B's writer storing what passes B's causality filter with the progress in
the same append, one batch of up to 1,000 events per round. Baseline in the same run: a raw read
of A's log plus appending the same bytes to another journal, in batches of the same size, no
decoding (target ratio >= 0.5).

One `gazette serve`; A's events are emitted (1,000 per append) before either is timed."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from benchmarks._cluster import one_broker, placed_journals
from broker.client.append_service import AppendService
from broker.client.reader import read, write_head
from replication.connection import SourceReader, run_connection
from replication.journal_log import JournalEventLog

JOURNALS = ["bench/replication/A", "bench/replication/B", "bench/replication/raw"]


async def measure(events: int) -> dict[str, Any]:
    async with one_broker() as (client, _), AppendService(client.stub) as service:
        await placed_journals(client, JOURNALS, "application/x-ndjson")
        stubs = lambda: client.stub  # noqa: E731
        a = JournalEventLog("A", JOURNALS[0], stubs, service, author=1)
        b = JournalEventLog("B", JOURNALS[1], stubs, service, author=2)
        await a.open()
        await b.open()
        filler = os.urandom(60).hex()  # ~200 bytes an event, with its metadata.
        for start in range(0, events, 1000):
            await a.emit([{"i": i, "v": filler} for i in range(start, start + 1000)])
        size = await write_head(client.stub, JOURNALS[0])

        started = time.perf_counter()
        written = await run_connection(
            "A", SourceReader(stubs, JOURNALS[0]), b, through=a.next_seq - 1
        )
        replicated = time.perf_counter() - started
        if written != events:
            raise RuntimeError(f"replicated {written} of {events} events")

        started = time.perf_counter()
        batch, pending = bytearray(), 0
        async for chunk in read(client.stub, JOURNALS[0], 0):
            batch += chunk.content
            pending += chunk.content.count(b"\n")
            if pending >= 1000:
                await service.append(JOURNALS[2], bytes(batch))
                batch, pending = bytearray(), 0
        if batch:
            await service.append(JOURNALS[2], bytes(batch))
        raw = time.perf_counter() - started
    return {"replicated_s": replicated, "raw_s": raw, "bytes": size}


def run(quick: bool = False) -> dict[str, Any]:
    events = 5_000 if quick else 50_000
    r = asyncio.run(measure(events))
    value, baseline = events / r["replicated_s"], events / r["raw_s"]
    return {
        "value": round(value),
        "unit": "events/s",
        "baseline": round(baseline),
        "ratio": round(value / baseline, 2),
        "events": events,
        "bytes_per_event": round(r["bytes"] / events),
    }


if __name__ == "__main__":
    print(run())
