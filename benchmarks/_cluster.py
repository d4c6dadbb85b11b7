"""A benchmark cluster: etcd and three `gazette serve` processes on loopback, and one journal
at replication 3 placed by the allocator. Every process is stopped by its pid on exit."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from broker.client import BrokerUnavailable, JournalsClient
from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, free_port

PREFIX = "/bench"


def _journal(name: str) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=3)
    spec.fragment.length = 1 << 30  # No rolls mid-run: we measure the append path.
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


@contextlib.asynccontextmanager
async def cluster(
    journal: str,
    brokers: int = 3,
    *,
    spec: pb.JournalSpec | None = None,
    file_root: Path | None = None,
    writable: bool = True,
) -> AsyncIterator[tuple[list[str], Dialer]]:
    """Yields the brokers' addresses (primary of `journal` first) and a dialer. `spec` replaces
    the default spec of `journal`; `file_root` roots the brokers' file:// stores. Unless
    `writable` is false (a journal of existing fragments, to be read), it waits until an
    append succeeds."""
    spec = spec if spec is not None else _journal(journal)
    procs: list[subprocess.Popen[bytes]] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        addresses = []
        try:
            for i in range(brokers):
                port = free_port()
                command = [
                    sys.executable, "-m", "broker.main", "serve",
                    "--broker.id", f"broker-{i}", "--broker.host", "127.0.0.1",
                    "--broker.port", str(port), "--etcd.address", etcd.endpoint,
                    "--etcd.prefix", PREFIX, "--log.level", "warn",
                    "--broker.drain-timeout", "1s",
                ]  # fmt: skip
                if file_root is not None:
                    command += ["--broker.file-root", str(file_root)]
                with open(Path(tmp) / f"broker-{i}.log", "wb") as log:
                    procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
                addresses.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 30
            for address in addresses:
                async with JournalsClient(address, timeout=1) as client:
                    while True:
                        try:
                            await client.list()
                            break
                        except BrokerUnavailable:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.1)
            async with JournalsClient(addresses[0]) as client:
                await client.apply([pb.ApplyRequest.Change(upsert=spec)])
                while True:
                    snapshot = await client.list(
                        pb.LabelSelector(
                            include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)])
                        )
                    )
                    route = snapshot.journals[0].route
                    if len(route.members) == spec.replication and route.primary != -1:
                        break
                    await asyncio.sleep(0.05)
            primary = route.endpoints[route.primary]
            ordered = [primary, *(a for a in addresses if a != primary)]
            dialer = Dialer()
            try:
                # Until the first append succeeds, the pipeline is still synchronizing.
                while writable:
                    try:
                        await append(dialer.journal_stub(primary), journal, b"")
                        break
                    except AppendError:
                        await asyncio.sleep(0.05)
                yield ordered, dialer
            finally:
                await dialer.close()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def appenders(
    stub: object, journal: str, payload: bytes, *, concurrency: int, duration: float
) -> tuple[list[float], float]:
    """`concurrency` appenders appending `payload` until `duration` passes: each append's
    latency (sorted), and the elapsed time."""
    latencies: list[float] = []
    stop = time.perf_counter() + duration

    async def one() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await append(stub, journal, payload)  # type: ignore[arg-type]
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return latencies, elapsed


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]
