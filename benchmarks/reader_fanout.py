"""reader_fanout: delivery latency of one journal's appends to 1, 10, 100 and 1,000 concurrent
tailing readers, and what serving them costs the broker.

Three `gazette serve` processes, one journal at replication 3. A steady appender (this process)
appends RATE small records a second to the primary, each a line `PHASE SEQ SENT_NS` carrying
its send time (`time.monotonic_ns()`, one clock for every process of the machine). The readers
are blocking reads from the write head (`broker.client.reader.read(..., block=True)`, what
`gazctl journals read --block` runs) through the primary, in client processes of at most
READERS_PER_PROCESS readers each (`benchmarks/_fanout_readers.py`: one asyncio loop and one gRPC
channel a process), and each records, for every record appended in the measure window, its
delivery latency: the time it arrived at that reader minus its send time.

Per reader count, on the same cluster (`n0_*` first: the appender alone, no readers): `p50_ms`,
`p99_ms` and `max_ms` of every delivery of the window (readers x records); `broker_cpu`, CPU
seconds per second of the primary (it serves every read and the appends) over the window, and
`busiest_broker_cpu` (the busiest of the three); `client_cpu_max`, the busiest client process's
(near 1.0: the client, not the broker, is the bottleneck); `append_p50_ms`, the appends' own
latency (acknowledged at replication 3); `records`, the records appended in the window, each
checked delivered to every reader exactly once; `load`, the load average when measured.

value = p99 delivery latency at the largest count that completed, baseline = p99 at 1 reader,
ratio = baseline / value (1: fan-out costs nothing in the tail; 0.1: the tail is ten times
longer). `--quick`: 1 and 10 readers, 3 s windows. `READER_FANOUT_COUNTS=1,100` picks others.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks._cluster import (
    BrokerProcess,
    percentile,
    placed,
    start_broker,
    stop_brokers,
    wait_ready,
)
from benchmarks._proc import cpu_seconds
from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from plumbing.processes import stop_processes

JOURNAL = "bench/fanout"
BROKERS = 3
COUNTS = (1, 10, 100, 1_000)
QUICK_COUNTS = (1, 10)
RATE = 20.0  # Records a second.
WINDOW = 20.0  # Seconds of appends measured per count.
QUICK_WINDOW = 3.0
WARM = 2.0  # Seconds of appends once every reader is blocked at the head, before the window.
READERS_PER_PROCESS = 250
MAX_IN_FLIGHT = 100
READY_TIMEOUT = 120.0


def _spec() -> pb.JournalSpec:
    spec = pb.JournalSpec(name=JOURNAL, replication=3)
    spec.fragment.length = 1 << 30  # No rolls mid-run.
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


def _record(phase: str, seq: int) -> bytes:
    return f"{phase} {seq} {time.monotonic_ns()}\n".encode()


async def _writable(stub: pb_grpc.JournalStub) -> int:
    """The write head, once the pipeline takes an append (it may still be synchronizing)."""
    async with asyncio.timeout(30):
        while True:
            try:
                return int((await append(stub, JOURNAL, b"")).commit.end)
            except AppendError:
                await asyncio.sleep(0.05)


class Appender:
    """Appends records at RATE a second on a fixed schedule, open loop: each append is sent when
    due, whether or not earlier ones were acknowledged (at most MAX_IN_FLIGHT at once), as a
    producer with its own pace would."""

    def __init__(self, stub: pb_grpc.JournalStub) -> None:
        self.stub = stub
        self.seq = 0
        self.latencies: list[float] = []
        self.stalls = 0  # Times MAX_IN_FLIGHT appends were outstanding when one was due.

    async def one(self, phase: str) -> None:
        self.seq += 1
        started = time.perf_counter()
        await append(self.stub, JOURNAL, _record(phase, self.seq))
        if phase == "m":
            self.latencies.append(time.perf_counter() - started)

    async def steady(self, phase: str, seconds: float | None, until: Any = None) -> int:
        """Append `phase` records for `seconds` (or until `until()` is true); how many."""
        period = 1 / RATE
        start = time.monotonic()
        in_flight: set[asyncio.Task[None]] = set()
        count = 0
        try:
            while True:
                due = start + count * period
                if seconds is not None and due - start >= seconds:
                    break
                if until is not None and until():
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if len(in_flight) >= MAX_IN_FLIGHT:
                    self.stalls += 1
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.ensure_future(self.one(phase))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                count += 1
            await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
        return count


def _ready(out: Path) -> bool:
    return out.exists() and "ready" in out.read_text()


async def measure_count(
    readers: int,
    window: float,
    appender: Appender,
    address: str,
    brokers: list[BrokerProcess],
    primary: BrokerProcess,
    tmp: Path,
) -> dict[str, Any]:
    head = await _writable(appender.stub)
    procs: list[subprocess.Popen[bytes]] = []
    outs: list[Path] = []
    logs: list[Path] = []
    try:
        for i, at in enumerate(range(0, readers, READERS_PER_PROCESS)):
            n = min(READERS_PER_PROCESS, readers - at)
            out, log = tmp / f"readers-{readers}-{i}.json", tmp / f"readers-{readers}-{i}.log"
            outs.append(out)
            logs.append(log)
            with open(log, "wb") as stdout:
                command = [sys.executable, "-m", "benchmarks._fanout_readers"]
                command += [address, JOURNAL, str(head), str(n), str(out)]
                procs.append(subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT))

        def all_ready() -> bool:
            for proc, log in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"a reader process exited {proc.returncode} before it was ready: "
                        + log.read_text(errors="replace")[-2000:]
                    )
            return all(_ready(log) for log in logs)

        # Warm-up records until every reader has one (each is then blocked at the head).
        started = time.monotonic()
        await appender.steady("w", None, until=lambda: all_ready() or _late(started))
        if not all_ready():
            raise TimeoutError(f"{readers} readers not all reading after {READY_TIMEOUT:.0f} s")
        ready_s = time.monotonic() - started
        await appender.steady("w", WARM)

        pids = [b.proc.pid for b in brokers]
        clients = [p.pid for p in procs]
        load = os.getloadavg()[0]
        cpu_before = [cpu_seconds(p) for p in pids + clients]
        t0 = time.monotonic()
        appender.latencies, appender.stalls = [], 0
        records = await appender.steady("m", window)
        elapsed = time.monotonic() - t0
        cpu_after = [cpu_seconds(p) for p in pids + clients]
        cpu = [(a - b) / elapsed for a, b in zip(cpu_after, cpu_before, strict=True)]
        await appender.one("e")

        deadline = time.monotonic() + 60 + readers * 0.05
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        codes = stop_processes(procs)
    latencies: list[float] = []
    measured: list[int] = []
    errors: list[str] = []
    for out, log, code in zip(outs, logs, codes, strict=True):
        if not out.exists():
            errors.append(f"exit {code}: {log.read_text(errors='replace')[-1000:]}")
            continue
        result = json.loads(out.read_text())
        latencies += result["latencies_us"]
        measured += result["measured"]
        errors += result["errors"]
    if errors:
        raise RuntimeError(f"{readers} readers: {errors[:3]}")
    wrong = [m for m in measured if m != records]
    if len(measured) != readers or wrong:
        raise RuntimeError(
            f"{readers} readers: {len(wrong)} did not read each of the {records} records once "
            f"(read {sorted(set(wrong))[:5]})"
        )
    latencies.sort()
    appends = sorted(appender.latencies)
    by_broker = cpu[: len(pids)]
    return {
        "p50_ms": percentile(latencies, 0.50) / 1000,
        "p99_ms": percentile(latencies, 0.99) / 1000,
        "max_ms": latencies[-1] / 1000,
        "broker_cpu": by_broker[brokers.index(primary)],
        "busiest_broker_cpu": max(by_broker),
        "client_cpu_max": max(cpu[len(pids) :]),
        "client_processes": len(procs),
        "append_p50_ms": percentile(appends, 0.5) * 1000,
        "append_p99_ms": percentile(appends, 0.99) * 1000,
        "append_stalls": appender.stalls,
        "records": records,
        "rate": records / elapsed,
        "ready_s": ready_s,
        "load": load,
    }


def _late(started: float) -> bool:
    return time.monotonic() - started > READY_TIMEOUT


async def measure(counts: tuple[int, ...], window: float, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    brokers: list[BrokerProcess] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-fanout-") as tmp:
        root = Path(tmp)
        dialer = Dialer()
        try:
            for i in range(BROKERS):
                brokers.append(start_broker(etcd, f"broker-{i}", root / f"broker-{i}.log"))
            await wait_ready(brokers)
            route = await placed(brokers[0].address, _spec())
            primary = next(b for b in brokers if b.address == route.endpoints[route.primary])
            appender = Appender(dialer.journal_stub(primary.address))
            await _writable(appender.stub)

            # The appender alone: what the appends cost the brokers.
            pids = [b.proc.pid for b in brokers]
            await appender.steady("w", WARM)
            before = [cpu_seconds(p) for p in pids]
            t0 = time.monotonic()
            appender.latencies = []
            await appender.steady("m", window)
            elapsed = time.monotonic() - t0
            cpu = [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before, strict=True)]
            out["n0_broker_cpu"] = cpu[brokers.index(primary)]
            out["n0_busiest_broker_cpu"] = max(cpu)
            out["n0_append_p50_ms"] = percentile(sorted(appender.latencies), 0.5) * 1000
            out["n0_load"] = os.getloadavg()[0]

            for n in counts:
                try:
                    figures = await measure_count(
                        n, window, appender, primary.address, brokers, primary, root
                    )
                except Exception as exc:
                    if quick:
                        raise
                    traceback.print_exc()
                    # A count the cluster (or the client) cannot take is a figure too.
                    out[f"n{n}_error"] = f"{type(exc).__name__}: {exc}"
                    continue
                for key, value in figures.items():
                    out[f"n{n}_{key}"] = value
        finally:
            await dialer.close()
            stop_brokers(brokers)
    return out


def counts(quick: bool) -> tuple[int, ...]:
    if quick:
        return QUICK_COUNTS
    env = os.environ.get("READER_FANOUT_COUNTS")
    return tuple(int(s) for s in env.split(",")) if env else COUNTS


def run(quick: bool = False) -> dict[str, Any]:
    sizes = counts(quick)
    figures = asyncio.run(measure(sizes, QUICK_WINDOW if quick else WINDOW, quick))
    done = [n for n in sizes if f"n{n}_p99_ms" in figures]
    if not done:
        raise RuntimeError(f"no reader count completed: {figures}")
    value = figures[f"n{max(done)}_p99_ms"]
    baseline = figures[f"n{min(done)}_p99_ms"]
    return {
        "value": value,
        "unit": "ms p99",
        "baseline": baseline,
        "ratio": baseline / value if value else None,
        "readers": max(done),
        "baseline_readers": min(done),
        "rate": RATE,
        "window_s": QUICK_WINDOW if quick else WINDOW,
        **figures,
    }


if __name__ == "__main__":
    print(run())
