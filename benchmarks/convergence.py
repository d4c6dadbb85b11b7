"""convergence: seconds for an event emitted at one location of a 4-location cyclic network
(A - B - C - D - A, bi-directional, every connection a running process) to be stored at every
location, and how many times it was read by a connection and filtered (already in the target's
causal past) rather than stored. Events are emitted one at a time, each once the previous one
converged. No baseline: the figure is the network's latency; the filtered count shows the
causality filter at work on the cycle (each event is stored 3 times and filtered the rest)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks._cluster import one_broker, placed_journals
from broker.client.append_service import AppendService
from replication.connection import SourceReader, run_connection
from replication.journal_log import JournalEventLog

LOCATIONS = ["A", "B", "C", "D"]
RING = [("A", "B"), ("B", "C"), ("C", "D"), ("D", "A")]


async def measure(events: int) -> dict[str, Any]:
    times: list[float] = []
    async with one_broker() as (client, _), AppendService(client.stub) as service:
        await placed_journals(
            client, [f"bench/convergence/{n}" for n in LOCATIONS], "application/x-ndjson"
        )
        stubs = lambda: client.stub  # noqa: E731
        logs = {
            n: JournalEventLog(n, f"bench/convergence/{n}", stubs, service, author=i + 1)
            for i, n in enumerate(LOCATIONS)
        }
        for log in logs.values():
            await log.open()
        stats: dict[str, int] = {}
        async with asyncio.TaskGroup() as tasks:
            running = [
                tasks.create_task(
                    run_connection(s, SourceReader(stubs, logs[s].journal), logs[t], stats=stats)
                )
                for a, b in RING
                for s, t in ((a, b), (b, a))
            ]
            for i in range(events):
                (event,) = await logs["A"].emit([{"i": i}])
                started = time.perf_counter()
                while not all(event.timestamp <= log.cvv for log in logs.values()):
                    await asyncio.sleep(0.001)
                times.append(time.perf_counter() - started)
            await asyncio.sleep(0.5)  # Let the last round of filtering finish.
            for task in running:
                task.cancel()
    return {"times": times, "stats": stats}


def run(quick: bool = False) -> dict[str, Any]:
    events = 5 if quick else 30
    r = asyncio.run(measure(events))
    times = sorted(r["times"])
    stats = r["stats"]
    return {
        "value": round(times[len(times) // 2], 3),
        "unit": "s",
        "max": round(times[-1], 3),
        "events": events,
        "stored_per_event": round(stats.get("written", 0) / events, 2),
        "filtered_per_event": round(stats.get("filtered", 0) / events, 2),
    }


if __name__ == "__main__":
    print(run())
