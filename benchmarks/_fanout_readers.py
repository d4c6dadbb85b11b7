"""A reader_fanout client process: `python -m benchmarks._fanout_readers ADDRESS JOURNAL OFFSET
READERS OUT` runs READERS blocking reads of JOURNAL from OFFSET through the broker at ADDRESS,
all on one asyncio loop and one gRPC channel (as one Python client would), and writes what they
saw to OUT (JSON) once each has read the end record.

Records are lines `PHASE SEQ SENT_NS`, SENT_NS the appender's `time.monotonic_ns()` when it
sent the append (CLOCK_MONOTONIC: one clock for every process of the machine). Each reader keeps
the delivery latency (its own monotonic time when the content arrived, minus SENT_NS) of each
`m` (measure) record; `w` (warm-up) records only count towards readiness, and `e` ends it.
The process prints `ready` once every reader has received a record (each is then blocked at the
write head), and exits 0 once every reader has read `e`, or 1 with the errors of the readers
that failed (in OUT too)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from broker.client.dialer import Dialer
from broker.client.reader import read

# A reader that has not read the end record by then has failed (seconds after it started).
DEADLINE = 3600.0


class Tail:
    __slots__ = ("latencies_us", "measured", "partial", "ready")

    def __init__(self) -> None:
        self.latencies_us: list[int] = []
        self.measured = 0
        self.partial = b""
        self.ready = False


async def _tail(stub: Any, journal: str, offset: int, tail: Tail) -> None:
    # Its call ends with the channel, closed once every reader is done.
    async for chunk in read(stub, journal, offset, block=True):
        received = time.monotonic_ns()
        tail.ready = True
        data = tail.partial + chunk.content
        lines = data.split(b"\n")
        tail.partial = lines.pop()
        for line in lines:
            phase, _seq, sent = line.split(b" ")
            if phase == b"m":
                tail.latencies_us.append((received - int(sent)) // 1000)
                tail.measured += 1
            elif phase == b"e":
                return


async def _say_ready(tails: list[Tail]) -> None:
    while not all(t.ready for t in tails):
        await asyncio.sleep(0.05)
    print("ready", flush=True)


async def main(address: str, journal: str, offset: int, readers: int, out: str) -> int:
    dialer = Dialer()
    stub = dialer.journal_stub(address)
    tails = [Tail() for _ in range(readers)]
    tasks = [asyncio.ensure_future(_tail(stub, journal, offset, t)) for t in tails]
    announce = asyncio.ensure_future(_say_ready(tails))
    errors: list[str] = []
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=DEADLINE, return_when=asyncio.FIRST_EXCEPTION
        )
        errors += [repr(t.exception()) for t in done if t.exception() is not None]
        if pending and not errors:
            errors.append(f"not every reader read the end record within {DEADLINE:.0f} s")
    finally:
        for task in [*tasks, announce]:
            task.cancel()
        await asyncio.gather(*tasks, announce, return_exceptions=True)
        await dialer.close()
    latencies = [x for t in tails for x in t.latencies_us]
    result = {
        "latencies_us": latencies,
        "measured": [t.measured for t in tails],
        "errors": errors,
    }
    with open(out, "w") as f:
        json.dump(result, f)
    return 1 if errors else 0


if __name__ == "__main__":
    address, journal, offset, readers, out = sys.argv[1:6]
    sys.exit(asyncio.run(main(address, journal, int(offset), int(readers), out)))
