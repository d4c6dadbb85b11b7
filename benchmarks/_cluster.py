"""A benchmark cluster: etcd and three `gazette serve` processes on loopback, and one journal
at replication 3 placed by the allocator. Every process is stopped by its pid on exit.

`start_broker`, `wait_ready`, `placed`, `listed` and `stop_brokers` are the same steps on their
own, for benchmarks that kill, restart or watch brokers (failover, idle_tails)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from broker.client import BrokerUnavailable, JournalsClient
from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, free_port
from broker.testing.security import Security
from plumbing import credentials

PREFIX = "/bench"


def _journal(name: str) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=3)
    spec.fragment.length = 1 << 30  # No rolls mid-run: we measure the append path.
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


@dataclass
class BrokerProcess:
    """A `gazette serve` child process on 127.0.0.1."""

    id: str
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_broker(
    etcd: EtcdServer,
    broker_id: str,
    log: Path,
    *,
    file_root: Path | None = None,
    lease: str | None = None,
    log_level: str = "warn",
    security: Security | None = None,
    extra: Sequence[str] = (),
) -> BrokerProcess:
    """Start `gazette serve` as `broker_id` on a free port, its output in `log`. It is not
    ready yet: see `wait_ready`. `lease` is `--etcd.lease` (default: the broker's); `extra`
    are more flags, as an operator would add them (`--broker.limit 20000`)."""
    port = free_port()
    command = [
        sys.executable, "-m", "broker.main", "serve",
        "--broker.id", broker_id, "--broker.host", "127.0.0.1",
        "--broker.port", str(port), "--etcd.address", etcd.endpoint,
        "--etcd.prefix", PREFIX, "--log.level", log_level,
        "--broker.drain-timeout", "1s",
    ]  # fmt: skip
    if file_root is not None:
        command += ["--broker.file-root", str(file_root)]
    if lease is not None:
        command += ["--etcd.lease", lease]
    scheme = "http"
    if security is not None:
        command += security.broker_flags()
        scheme = "https" if security.pki else "http"
    command += list(extra)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    return BrokerProcess(broker_id, f"{scheme}://127.0.0.1:{port}", proc, log)


async def wait_ready(brokers: Sequence[BrokerProcess], timeout: float = 30) -> None:
    """Until every broker answers List (its gRPC server starts once it announced itself)."""
    deadline = time.monotonic() + timeout
    for broker in brokers:
        async with JournalsClient(broker.address, timeout=1) as client:
            while True:
                if broker.proc.poll() is not None:
                    tail = broker.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"{broker.id} exited {broker.proc.returncode} while starting:\n{tail}"
                    )
                try:
                    await client.list()
                    break
                except BrokerUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)


def stop_brokers(brokers: Sequence[BrokerProcess]) -> None:
    """SIGTERM every broker still running, then SIGKILL any left after 10 s (by pid)."""
    for broker in brokers:
        if broker.proc.poll() is None:
            broker.proc.terminate()
    for broker in brokers:
        try:
            broker.proc.wait(10)
        except subprocess.TimeoutExpired:
            broker.proc.kill()
            broker.proc.wait()


async def listed(address: str, journal: str) -> pb.ListResponse.Journal:
    """The journal as the broker at `address` lists it: spec, mod revision, route."""
    async with JournalsClient(address) as client:
        snapshot = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))
        )
    return snapshot.journals[0]


async def placed(address: str, spec: pb.JournalSpec, *, update: bool = False) -> pb.Route:
    """Apply `spec` through `address` (with `update`, over the journal's current spec) and wait
    until the allocator has placed its replicas (a primary among them); its route."""
    change = pb.ApplyRequest.Change(upsert=spec)
    if update:
        change.expect_mod_revision = (await listed(address, spec.name)).mod_revision
    async with JournalsClient(address) as client:
        await client.apply([change])
    while True:
        route = (await listed(address, spec.name)).route
        if len(route.members) == spec.replication and route.primary != -1:
            return route
        await asyncio.sleep(0.05)


def advertised(values: Sequence[bytes]) -> pb.Route | None:
    """The route every one of a journal's assignment values (etcd) advertises, if they agree:
    the primary synchronized its pipeline on that route and wrote it (consistency)."""
    if not values or not all(values):
        return None
    routes = [pb.Route.FromString(v) for v in values]
    first = routes[0]
    if any(r.members != first.members or r.primary != first.primary for r in routes):
        return None
    return first if len(first.members) == len(values) else None


@contextlib.asynccontextmanager
async def cluster(
    journal: str,
    brokers: int = 3,
    *,
    spec: pb.JournalSpec | None = None,
    file_root: Path | None = None,
    writable: bool = True,
    tls: bool = False,
    auth: bool = False,
) -> AsyncIterator[tuple[list[str], Dialer]]:
    """Yields the brokers' addresses (primary of `journal` first) and a dialer. `spec` replaces
    the default spec of `journal`; `file_root` roots the brokers' file:// stores. Unless
    `writable` is false (a journal of existing fragments, to be read), it waits until an
    append succeeds. `tls` and `auth` run the brokers on TLS and with token verification
    (the dialer, and this process's clients, then present a certificate and sign tokens)."""
    spec = spec if spec is not None else _journal(journal)
    procs: list[BrokerProcess] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        security = Security.make(Path(tmp), tls=tls, auth=auth)
        previous = credentials.default("broker")
        credentials.set_default("broker", security.credentials())
        try:
            for i in range(brokers):
                log = Path(tmp) / f"broker-{i}.log"
                procs.append(
                    start_broker(etcd, f"broker-{i}", log, file_root=file_root, security=security)
                )
            await wait_ready(procs)
            addresses = [p.address for p in procs]
            route = await placed(addresses[0], spec)
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
            credentials.set_default("broker", previous)
            stop_brokers(procs)


@contextlib.asynccontextmanager
async def one_broker() -> AsyncIterator[tuple[JournalsClient, Path]]:
    """One broker on an etcd of its own, in a temporary directory: a client of it, and the
    directory (stopped and removed after)."""
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        root = Path(tmp)
        broker = start_broker(etcd, "broker-0", root / "broker.log")
        try:
            await wait_ready([broker])
            async with JournalsClient(broker.address) as client:
                yield client, root
        finally:
            stop_brokers([broker])


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


async def placed_journals(client: JournalsClient, names: Sequence[str], content_type: str) -> None:
    """Create journals (64 MiB fragments, uncompressed, of `content_type`) and wait until each
    is placed (its write head answers)."""
    from broker.client.reader import write_head

    specs = []
    for name in names:
        spec = pb.JournalSpec(name=name, replication=1)
        spec.fragment.length = 64 << 20
        spec.fragment.compression_codec = pb.NONE
        spec.fragment.refresh_interval.seconds = 60
        spec.labels.labels.add(name="content-type", value=content_type)
        specs.append(spec)
    await client.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
    for name in names:
        for _ in range(200):
            try:
                await write_head(client.stub, name)
                break
            except Exception:
                await asyncio.sleep(0.05)
        else:
            raise TimeoutError(f"{name} was not placed")


async def recovery_log(client: JournalsClient, name: str) -> None:
    """A recovery-log journal, placed."""
    await placed_journals(client, [name], "application/x-gazette-recoverylog")
