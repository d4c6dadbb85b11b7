"""The fault harness: etcd, a fragment store and five `gazette serve` brokers, each a real
process on addresses the harness owns (`tests/faults/network.py`), and the faults it injects:
signals (SIGKILL, SIGSTOP/SIGCONT, SIGTERM), broker and etcd restarts, a full disk under one
broker's spool directory (a tmpfs of its own, as root), partitions (network namespaces), and a
store outage (the fake GCS server stopped, then started on its data directory).

Every process is started here and stopped by its pid in `close`, which also unmounts what was
mounted and removes the namespaces, on failure as on success. `collect` records, after a run,
what each journal reads back through a broker, what each replica holds, and every persisted
fragment read straight from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from broker.client import JournalsClient
from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.client.reader import write_head
from broker.fragment.content import open_in_store
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.testing import find_etcd_binary
from plumbing.local_etcd import free_port
from tests.faults.history import (
    OK,
    PROBE,
    RESET,
    AppendOp,
    Fault,
    History,
    Observation,
    ResetHead,
    SpoolsRenewed,
)
from tests.faults.network import Loopback, Namespaces, Network
from tests.helpers.server_fork import ForkedPopen

PREFIX = "/gazette-faults"
CONTENT_TYPE = "application/x-ndjson"


class HarnessError(RuntimeError):
    pass


def _free_port(host: str) -> int:
    """A port free on `host` now, for a server the harness starts (and restarts) there. On
    loopback, from below the kernel's ephemeral range (`plumbing.local_etcd.free_port`): one from
    that range was taken by another test's outgoing connection before a location cluster's
    broker bound it ("Address already in use", a suite run on six workers)."""
    import socket

    if host == "127.0.0.1":
        return free_port()
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _stop(
    proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 10
) -> None:
    """Stop `proc` by its pid: `sig` (after SIGCONT, in case it is paused), then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class BrokerSlot:
    index: int
    host: str
    port: int
    spool_root: Path  # The broker's TMPDIR: its spools live under it.
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    paused: bool = False
    held: bool = False  # Down on purpose (a fault holds it): the supervisor leaves it be.
    exited_at: float = -1.0  # When an incarnation was last seen gone (history time).
    exit_seen: int = 0  # The incarnation whose exit that was.
    exit_code: int | None = None  # And its status.
    started_at: float = -1.0  # When its current incarnation was started (history time).
    mounted: bool = False
    filler: Path | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return f"broker-{self.index}"

    scheme: str = "http"

    @property
    def address(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class ClusterConfig:
    workdir: Path
    brokers: int = 5
    lease: float = 2.0
    store: str = "file"  # or "gcs"
    spool_limit: int = 0  # Bytes of each broker's own tmpfs spool directory (0: none).
    namespaces: bool = False
    fragment_length: int = 16 << 10
    extra_flags: tuple[str, ...] = ()
    # The campaign with TLS (brokers and their clients; client certificates required) and
    # with authorization (every call's token verified; brokers sign their own).
    tls: bool = False
    auth: bool = False
    # Namespaces beyond the brokers' (indices from `brokers` on), for processes of the caller's
    # own (the consumer campaign's consumers), on the same bridge and cut the same way.
    extra_nodes: int = 0
    # Journals given a `max_append_rate` (bytes/s): their fragments are larger (`rate_fragment`
    # bytes), since their crowds append up to 64 KiB a record.
    append_rates: dict[str, int] = field(default_factory=dict)
    rate_fragment: int = 1 << 20


@dataclass
class Cluster:
    config: ClusterConfig
    history: History
    rng: random.Random = field(default_factory=random.Random)
    network: Network = field(default_factory=Loopback)
    brokers: list[BrokerSlot] = field(default_factory=list)
    etcd_proc: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0
    store_proc: subprocess.Popen[bytes] | None = None
    store_port: int = 0
    store_url: str = ""
    dialer: Dialer = field(default_factory=Dialer)
    _env: dict[str, str] = field(default_factory=dict)
    _saved_env: dict[str, str | None] = field(default_factory=dict)
    _supervisor: asyncio.Task[None] | None = None
    _renewed_at: float = -1e9
    _previous_credentials: object = None

    # ---- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> Cluster:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def workdir(self) -> Path:
        return self.config.workdir

    async def start(self) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        if self.config.namespaces:
            self.network = Namespaces(self.config.brokers + self.config.extra_nodes, self.rng)
        self.etcd_port = _free_port(self.network.etcd_host)
        self.start_etcd()
        await self._start_store()
        self._secure()
        for index in range(self.config.brokers):
            host = self.network.broker_host(index)
            port = 8080 if self.config.namespaces else _free_port(host)
            slot = BrokerSlot(index, host, port, self.workdir / f"spool-b{index}")
            slot.scheme = "https" if self.config.tls else "http"
            slot.spool_root.mkdir(exist_ok=True)
            self.brokers.append(slot)
            if self.config.spool_limit:
                self._mount(slot)
        for slot in self.brokers:
            self._spawn(slot)
        await asyncio.gather(*(self._ready(slot) for slot in self.brokers))
        self._supervisor = asyncio.create_task(self._supervise(), name="supervisor")

    async def close(self) -> None:
        """Stop everything this harness started (by pid), unmount, remove the network."""
        errors: list[str] = []
        if self._previous_credentials is not None:
            from plumbing import credentials

            assert isinstance(self._previous_credentials, credentials.Credentials)
            credentials.set_default("broker", self._previous_credentials)
            self._previous_credentials = None
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(BaseException):
                await self._supervisor
        for slot in self.brokers:
            try:
                _stop(slot.proc, signal.SIGKILL)
            except Exception as exc:
                errors.append(f"{slot.id}: {exc}")
        for proc in (self.store_proc, self.etcd_proc):
            try:
                _stop(proc)
            except Exception as exc:
                errors.append(str(exc))
        with contextlib.suppress(Exception):
            await self.dialer.close()
        for slot in self.brokers:
            if slot.mounted:
                result = subprocess.run(["umount", str(slot.spool_root)], capture_output=True)
                if result.returncode:
                    subprocess.run(["umount", "-l", str(slot.spool_root)], capture_output=True)
                slot.mounted = False
        try:
            self.network.close()
        except Exception as exc:
            errors.append(f"network: {exc}")
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()
        if errors:
            raise HarnessError("; ".join(errors))

    def _setenv(self, name: str, value: str) -> None:
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value
        self._env[name] = value

    # ---- etcd -------------------------------------------------------------------------------

    @property
    def etcd_endpoint(self) -> str:
        return f"http://{self.network.etcd_host}:{self.etcd_port}"

    def start_etcd(self) -> None:
        client = self.etcd_endpoint
        peer = f"http://127.0.0.1:{_free_port('127.0.0.1')}"
        cmd = [
            find_etcd_binary(),
            "--name", "faults",
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"faults={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "error",
        ]  # fmt: skip
        with (self.workdir / "logs" / "etcd.log").open("ab") as out:
            self.etcd_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait_http(self.etcd_proc, f"{client}/health", "etcd")

    def stop_etcd(self, sig: int = signal.SIGKILL) -> None:
        """Stop etcd (a crash by default: at once, as a machine failing)."""
        _stop(self.etcd_proc, sig)
        self.etcd_proc = None

    # ---- the fragment store -----------------------------------------------------------------

    async def _start_store(self) -> None:
        root = self.workdir / "store"
        (root / "fragments").mkdir(parents=True, exist_ok=True)
        if self.config.store == "file":
            self.store_url = "file:///fragments/"
            return
        self.store_port = _free_port(self.network.store_host)
        self.start_store()
        self._setenv("STORAGE_EMULATOR_HOST", self.store_endpoint)
        from google.auth.credentials import AnonymousCredentials

        from broker.fragment.stores.gcs import storage  # type: ignore[attr-defined]

        bucket = f"faults-{self.rng.getrandbits(32):08x}"
        credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
        client = storage.Client(project="test-project", credentials=credentials)
        try:
            await asyncio.to_thread(client.create_bucket, bucket)
        finally:
            client.close()
        self.store_url = f"gs://{bucket}/fragments/"

    @property
    def store_endpoint(self) -> str:
        return f"http://{self.network.store_host}:{self.store_port}"

    def start_store(self) -> None:
        from tests.helpers.store_servers import fake_gcs_binary

        endpoint = self.store_endpoint
        cmd = [
            str(fake_gcs_binary()),
            "-scheme", "http", "-backend", "filesystem",
            "-filesystem-root", str(self.workdir / "gcs"),
            "-host", self.network.store_host, "-port", str(self.store_port),
            "-external-url", endpoint, "-log-level", "warn",
        ]  # fmt: skip
        with (self.workdir / "logs" / "gcs.log").open("ab") as out:
            self.store_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait_http(self.store_proc, f"{endpoint}/storage/v1/b", "fake-gcs-server")

    def stop_store(self) -> None:
        _stop(self.store_proc)
        self.store_proc = None

    def _secure(self) -> None:
        """With `tls` or `auth`: certificates for every broker's address and a key; this
        process's clients (the workload, the checker's reads) present and sign with them."""
        if not (self.config.tls or self.config.auth):
            return
        from broker.testing.security import Security
        from plumbing import credentials

        hosts = ("localhost", "127.0.0.1", *{self.network.broker_host(i) for i in range(self.config.brokers)})  # fmt: skip
        # The key is not drawn from rng: a seed replays the same faults either way.
        security = Security.make(self.workdir, tls=self.config.tls, auth=self.config.auth, hosts=hosts)  # fmt: skip
        creds = security.credentials()
        self._previous_credentials = credentials.default("broker")
        credentials.set_default("broker", creds)
        self.dialer = Dialer(creds)
        self.config.extra_flags = (*self.config.extra_flags, *security.broker_flags())

    # ---- brokers ----------------------------------------------------------------------------

    def _spawn(self, slot: BrokerSlot) -> None:
        if slot.incarnation:
            self._seen_exit(slot)
            # Every broker went down within moments of the others: each other one is down,
            # or is a new incarnation started moments ago (lapsed leases, one after another).
            window = self.config.lease + 2
            now = self.history.now()
            together = all(
                s is slot or not s.running() or (s.incarnation > 1 and now - s.started_at < window)
                for s in self.brokers
            )
            if together and now - self._renewed_at > window:
                graceful = all(s.exit_code == 0 for s in self.brokers)
                self.spools_renewed(lossy=not graceful)
        slot.incarnation += 1
        slot.started_at = self.history.now()
        argv = [
            sys.executable, "-m", "broker.main", "serve",
            "--broker.id", slot.id,
            "--broker.host", slot.host, "--broker.listen-host", slot.host,
            "--broker.port", str(slot.port),
            "--etcd.address", self.etcd_endpoint, "--etcd.prefix", PREFIX,
            "--etcd.lease", f"{self.config.lease:g}s",
            "--broker.file-root", str(self.workdir / "store"),
            "--broker.drain-timeout", "2s",
            # Replicas persist what a killed primary left within the scenario, not a minute on.
            "--broker.persist-interval", "5s",
            *self.config.extra_flags,
        ]  # fmt: skip
        env = dict(os.environ, TMPDIR=str(slot.spool_root), PYTHONUNBUFFERED="1", **self._env)
        log = self.workdir / "logs" / f"{slot.id}.{slot.incarnation}.log"
        with log.open("wb") as out:
            slot.proc = ForkedPopen(
                self.network.command(slot.index, argv),
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2],
            )  # fmt: skip
        slot.paused = False
        self.history.note(
            f"{slot.id} started (incarnation {slot.incarnation}, pid {slot.proc.pid})"
        )

    async def _ready(self, slot: BrokerSlot, timeout: float = 60) -> None:
        """Wait until the broker answers List (it serves once its member key is written)."""
        deadline = time.monotonic() + timeout
        stub = self.dialer.journal_stub(slot.address)
        while True:
            assert slot.proc is not None
            if slot.proc.poll() is not None:
                log = self.workdir / "logs" / f"{slot.id}.{slot.incarnation}.log"
                raise HarnessError(
                    f"{slot.id} exited {slot.proc.returncode} while starting: "
                    f"{log.read_text()[-1500:]}"
                )
            try:
                async for _ in stub.List(pb.ListRequest(), timeout=1):
                    pass
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise HarnessError(f"{slot.id} did not become ready in {timeout}s") from None
                await asyncio.sleep(0.1)

    def _seen_exit(self, slot: BrokerSlot) -> None:
        gone = slot.proc is not None and slot.proc.poll() is not None
        if gone and slot.exit_seen != slot.incarnation:
            slot.exited_at, slot.exit_seen = self.history.now(), slot.incarnation
            assert slot.proc is not None
            slot.exit_code = slot.proc.returncode

    async def _start(self, slot: BrokerSlot) -> None:
        async with slot.lock:
            if slot.running():
                return
            if slot.proc is not None and not slot.held:
                self.history.note(f"{slot.id} had exited ({slot.proc.returncode}): restarting")
            slot.held = False
            self._spawn(slot)
            await self._ready(slot, timeout=max(60, 4 * self.config.lease))

    async def _supervise(self) -> None:
        """As a service manager would: restart a broker that exited when no fault holds it
        down (a lapsed lease, a crash), at once."""
        restarts: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(0.25)
                for slot in self.brokers:
                    task = restarts.get(slot.index)
                    if task is not None and task.done():
                        if not task.cancelled() and task.exception() is not None:
                            error = task.exception()
                            self.history.note(f"supervisor could not restart {slot.id}: {error}")
                        del restarts[slot.index]
                    if slot.held or slot.running() or slot.lock.locked():
                        continue
                    if slot.index not in restarts:
                        self._seen_exit(slot)
                        restarts[slot.index] = asyncio.create_task(self._start(slot))
        finally:
            for task in restarts.values():
                task.cancel()
            await asyncio.gather(*restarts.values(), return_exceptions=True)

    async def start_broker(self, index: int) -> None:
        await self._start(self.brokers[index])

    def hold(self, index: int) -> None:
        """Keep broker `index` down once it exits (a fault restarts it itself)."""
        self.brokers[index].held = True

    def signal(self, index: int, sig: signal.Signals) -> None:
        slot = self.brokers[index]
        if signal_slot(slot, sig) and sig == signal.SIGKILL:
            self._seen_exit(slot)

    async def wait_exit(self, index: int, timeout: float = 30) -> int | None:
        """Wait for broker `index` to exit (SIGKILL after `timeout`); its exit status."""
        proc = self.brokers[index].proc
        if proc is None:
            return None
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self.history.note(f"broker-{index} did not exit in {timeout}s: SIGKILL")
                _stop(proc, signal.SIGKILL)
                break
            await asyncio.sleep(0.05)
        self._seen_exit(self.brokers[index])
        return proc.returncode

    def addresses(self) -> list[str]:
        """Brokers running and not paused (clients pick among these)."""
        live = [s.address for s in self.brokers if s.running() and not s.paused]
        return live or [s.address for s in self.brokers]

    def any_address(self) -> str:
        return self.rng.choice(self.addresses())

    async def ensure_running(self, attempts: int = 4) -> list[str]:
        """Resume paused brokers and start any that exited (held ones too), waiting until
        every broker serves (also those the supervisor is restarting); the ids started."""
        for slot in self.brokers:
            if slot.paused:
                self.signal(slot.index, signal.SIGCONT)
        started: list[str] = []
        for attempt in range(attempts):
            dead = [slot for slot in self.brokers if not slot.running()]
            for slot in dead:
                self._seen_exit(slot)
                slot.held = False
            started += [slot.id for slot in dead]
            results = await asyncio.gather(
                *(self._start(slot) for slot in self.brokers), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                return started
            self.history.note(f"starting brokers failed (attempt {attempt + 1}): {errors[0]}")
            await asyncio.sleep(1.0)
        raise HarnessError(f"brokers did not all start in {attempts} attempts")

    def spools_renewed(self, lossy: bool = True) -> None:
        """Every broker is starting afresh, so every spool is new: registers may be empty from
        the journals' current ends on (at most the end of the last acknowledged append)."""
        at = self._renewed_at = self.history.now()
        for journal in self.history.raw_journals + self.history.message_journals:
            end = max(
                (
                    op.end
                    for op in self.history.appends
                    if op.journal == journal and op.outcome == OK
                ),
                default=0,
            )
            self.history.spools_renewed.append(SpoolsRenewed(journal, end, at, lossy))

    # ---- journals ---------------------------------------------------------------------------

    def spec(self, name: str, replication: int = 3) -> pb.JournalSpec:
        spec = pb.JournalSpec(name=name, replication=replication)
        spec.labels.labels.append(pb.Label(name="content-type", value=CONTENT_TYPE))
        spec.fragment.length = self.config.fragment_length
        if name in self.config.append_rates:
            spec.max_append_rate = self.config.append_rates[name]
            spec.fragment.length = self.config.rate_fragment
        spec.fragment.compression_codec = pb.GZIP
        spec.fragment.stores.append(self.store_url)
        spec.fragment.refresh_interval.seconds = 1
        return spec

    async def create_journals(self, names: list[str], timeout: float = 30) -> None:
        async with JournalsClient(self.brokers[0].address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=self.spec(n)) for n in names])
        deadline = time.monotonic() + timeout
        while True:
            routes = await self.routes()
            if all(
                len(routes[n].members) == 3 and routes[n].primary >= 0 for n in names if n in routes
            ) and all(n in routes for n in names):
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"journals not placed in {timeout}s: {routes}")
            await asyncio.sleep(0.1)

    async def routes(self) -> dict[str, pb.Route]:
        """Each journal's current route, as a live broker lists it."""
        for address in self.addresses():
            try:
                async with JournalsClient(address, timeout=3) as client:
                    snapshot = await client.list(pb.LabelSelector())
                return {j.spec.name: j.route for j in snapshot.journals}
            except Exception:
                continue
        return {}

    async def primary_of(self, journal: str) -> int | None:
        route = (await self.routes()).get(journal)
        if route is None or route.primary < 0:
            return None
        return int(route.members[route.primary].suffix.removeprefix("broker-"))

    async def replica_heads(self, journal: str) -> dict[str, int]:
        """The write head each current member of `journal`'s route reports, read without
        proxying (its own index); a member that does not answer is left out."""
        route = (await self.routes()).get(journal)
        if route is None:
            return {}
        heads: dict[str, int] = {}
        addresses = {slot.id: slot.address for slot in self.brokers}
        for member in route.members:
            endpoint = addresses.get(member.suffix)
            if endpoint is None:
                continue
            request = pb.ReadRequest(
                journal=journal, offset=-1, block=False, metadata_only=True, do_not_proxy=True
            )
            call = self.dialer.journal_stub(endpoint).Read(request, timeout=3)
            try:
                async for response in call:
                    if response.status in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE):
                        heads[member.suffix] = int(response.write_head)
                    break
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
        return heads

    async def wait_replicated(self, journals: list[str], timeout: float) -> bool:
        """Wait until every journal has three members, a primary, and only running brokers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            routes = await self.routes()
            running = {s.id for s in self.brokers if s.running() and not s.paused}
            if all(
                j in routes
                and len(routes[j].members) == 3
                and routes[j].primary >= 0
                and {m.suffix for m in routes[j].members} <= running
                for j in journals
            ):
                return True
            await asyncio.sleep(0.2)
        return False

    # ---- faults -------------------------------------------------------------------------------

    def fault(self, kind: str, target: str, detail: str = "") -> Fault:
        fault = Fault(kind, target, self.history.now(), detail=detail)
        self.history.faults.append(fault)
        self.history.note(f"fault {kind} {target} {detail}".rstrip())
        return fault

    def heal(self, fault: Fault) -> None:
        fault.end = self.history.now()
        self.history.note(f"healed {fault.kind} {fault.target}")

    def _mount(self, slot: BrokerSlot) -> None:
        size = self.config.spool_limit
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(slot.spool_root)],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode:
            raise HarnessError(f"mounting a tmpfs for {slot.id}: {result.stderr.strip()}")
        slot.mounted = True

    def fill_disk(self, index: int) -> int:
        """Fill broker `index`'s spool filesystem; the bytes written."""
        slot = self.brokers[index]
        if not slot.mounted:
            raise HarnessError(f"{slot.id} has no spool filesystem of its own")
        slot.filler = slot.spool_root / "filler"
        written = 0
        block = b"\0" * (64 << 10)
        with slot.filler.open("wb", buffering=0) as out:
            while True:
                try:
                    written += out.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            # The last bytes, one at a time down to nothing.
            with contextlib.suppress(OSError):
                while out.write(b"\0"):
                    written += 1
        return written

    def free_disk(self, index: int) -> None:
        slot = self.brokers[index]
        if slot.filler is not None:
            slot.filler.unlink(missing_ok=True)
            slot.filler = None

    def cut(self, a: int | str, b: int | str) -> None:
        self.network.cut(a, b)

    def mend(self, a: int | str, b: int | str) -> None:
        self.network.mend(a, b)

    async def heal_all(self) -> None:
        """Undo every fault still standing: mend links, free disks, start etcd and the store,
        resume and restart brokers."""
        if isinstance(self.network, Namespaces):
            self.network.mend_all()
        for slot in self.brokers:
            self.free_disk(slot.index)
        if self.etcd_proc is None or self.etcd_proc.poll() is not None:
            self.start_etcd()
        if self.config.store == "gcs" and (
            self.store_proc is None or self.store_proc.poll() is not None
        ):
            self.start_store()
        for fault in self.history.faults:
            if fault.end < 0:
                self.heal(fault)
        await self.ensure_running()

    # ---- appends the harness makes ------------------------------------------------------------

    async def probe(self, journal: str, reset_allowed: bool, timeout: float = 30) -> bool:
        """A zero-byte append to `journal` once the faults healed, retried until `timeout`.
        If every replica was lost (INDEX_HAS_GREATER_OFFSET) and the scenario allows it, reset
        the head as an operator would, then append again; if it does not, that refusal is the
        answer (it never clears by itself)."""
        deadline = time.monotonic() + timeout
        refusals = 0
        while time.monotonic() < deadline:
            op = AppendOp(journal, "probe", b"", PROBE, invoked=self.history.now())
            self.history.appends.append(op)
            stub = self.dialer.journal_stub(self.any_address())
            try:
                response = await append(stub, journal, b"", timeout=5)
            except AppendError as exc:
                op.outcome, op.error = "fail", pb.Status.Name(exc.status)
                if exc.status == pb.INDEX_HAS_GREATER_OFFSET:
                    if reset_allowed:
                        await self.reset_head(journal)
                    else:
                        refusals += 1
            except Exception as exc:
                op.outcome, op.error = "info", describe(exc)
            else:
                op.outcome, op.begin, op.end = OK, response.commit.begin, response.commit.end
                op.completed = self.history.now()
                return True
            op.completed = self.history.now()
            if refusals >= 3:
                break
            await asyncio.sleep(0.3)
        return False

    async def reset_head(self, journal: str) -> bool:
        """`gazctl journals reset-head`, as an operator runs it after every replica of the
        journal was lost: the head the brokers know (what the store lists) is checked against
        the store itself, then confirmed with a zero-byte append at it."""
        try:
            stub = self.dialer.journal_stub(self.any_address())
            head = await write_head(stub, journal)
            stored = await asyncio.to_thread(self.store_end, journal)
            if stored != head:
                self.history.note(
                    f"reset-head {journal}: head {head} but the store ends at {stored}"
                )
                return False
            op = AppendOp(journal, "operator", b"", RESET, invoked=self.history.now())
            self.history.appends.append(op)
            response = await append(
                stub, journal, b"", offset=head, suspend=pb.AppendRequest.SUSPEND_KEEP, timeout=5
            )
        except Exception as exc:
            self.history.note(f"reset-head {journal} failed: {describe(exc)}")
            return False
        op.outcome, op.begin, op.end = OK, response.commit.begin, response.commit.end
        op.completed = self.history.now()
        self.history.resets.append(ResetHead(journal, head, op.completed))
        self.history.note(f"reset-head {journal} at {head}")
        return True

    def store_end(self, journal: str) -> int:
        store = open_store(self.store_url, file_root=self.workdir / "store")
        return max((f.end for f in store.list_fragments(journal)), default=0)

    # ---- what the cluster holds after a run ----------------------------------------------------

    async def collect(self, journals: list[str]) -> None:
        at = self.history.now()

        async def one(journal: str) -> None:
            await self._collect_read(journal, at)
            for slot in self.brokers:
                if slot.running():
                    await self._collect_replica(slot, journal, at)
            for obs in await asyncio.to_thread(self._collect_store, journal, at):
                self.history.observations.append(obs)

        await asyncio.gather(*(one(journal) for journal in journals))

    async def _collect_read(self, journal: str, at: float, attempts: int = 8) -> None:
        """The journal read from 0 through a broker: its canonical content."""
        for attempt in range(attempts):
            observed: list[Observation] = []
            try:
                stub = self.dialer.journal_stub(self.any_address())
                request = pb.ReadRequest(journal=journal, offset=0, block=False)
                async with asyncio.timeout(60):  # The crowds' journal holds tens of MiB.
                    async for r in stub.Read(request):
                        if r.status == pb.OFFSET_NOT_YET_AVAILABLE:
                            break
                        if r.status != pb.OK:
                            raise HarnessError(pb.Status.Name(r.status))
                        if r.content:
                            _append_observation(observed, "read", journal, r.offset, r.content, at)
            except Exception as exc:
                self.history.note(f"final read of {journal} failed ({describe(exc)}): again")
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            self.history.observations.extend(observed)
            return
        raise HarnessError(f"{journal} could not be read after the run")

    async def _collect_replica(self, slot: BrokerSlot, journal: str, at: float) -> None:
        """What the replica holds locally: each fragment it lists, read without proxying
        (a read from 0 would stop at a hole, and the replica may hold content past it)."""
        stub = self.dialer.journal_stub(slot.address)
        observed: list[Observation] = []
        source = f"replica:{slot.id}"
        try:
            async with asyncio.timeout(40):
                fragments: list[pb.Fragment] = []
                token = 0
                while True:
                    listing = pb.FragmentsRequest(
                        journal=journal, do_not_proxy=True, next_page_token=token
                    )
                    response = await stub.ListFragments(listing)
                    if response.status != pb.OK:
                        return  # Not a replica of the journal.
                    fragments += [f.spec for f in response.fragments]
                    token = response.next_page_token
                    if not token:
                        break
                for fragment in fragments:
                    if fragment.end == fragment.begin:
                        continue
                    request = pb.ReadRequest(
                        journal=journal,
                        offset=fragment.begin,
                        end_offset=fragment.end,
                        do_not_proxy=True,
                    )
                    async for r in stub.Read(request):
                        if r.status != pb.OK:
                            break
                        if r.content:
                            _append_observation(observed, source, journal, r.offset, r.content, at)
        except Exception as exc:
            self.history.note(f"reading {journal} on {slot.id} failed: {describe(exc)}")
        finally:
            self.history.observations.extend(observed)

    def _collect_store(self, journal: str, at: float) -> list[Observation]:
        store = open_store(self.store_url, file_root=self.workdir / "store")
        out = []
        for fragment in store.list_fragments(journal):
            name = f"store:{fragment.begin:016x}-{fragment.end:016x}-{fragment.sum.part1:016x}"
            content = b"".join(open_in_store(store, fragment, fragment.begin))
            out.append(Observation(name, journal, fragment.begin, content, at))
        return out


def _append_observation(
    out: list[Observation], source: str, journal: str, offset: int, content: bytes, at: float
) -> None:
    """Record content, merged with the previous observation when it continues it."""
    if out and out[-1].offset + len(out[-1].content) == offset:
        out[-1].content += content
    else:
        out.append(Observation(source, journal, offset, bytes(content), at))


def signal_slot(slot: Any, sig: signal.Signals, *, hold: bool = True) -> bool:
    """Send `sig` to a harness slot's running process (a broker's, a consumer's, a location's)
    and track it: with `hold`, SIGKILL and SIGTERM keep it down (its supervisor leaves it);
    SIGSTOP and SIGCONT mark it paused and resumed; SIGKILL waits for the exit. Whether it was
    running."""
    if not slot.running():
        return False
    assert slot.proc is not None
    if hold and sig in (signal.SIGKILL, signal.SIGTERM):
        slot.held = True
    os.kill(slot.proc.pid, sig)
    if sig == signal.SIGSTOP:
        slot.paused = True
    elif sig == signal.SIGCONT:
        slot.paused = False
    elif sig == signal.SIGKILL:
        slot.proc.wait()
    return True


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, AppendError):
        return pb.Status.Name(exc.status)
    return f"{type(exc).__name__}: {exc}"


def _wait_http(proc: subprocess.Popen[bytes], url: str, what: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise HarnessError(f"{what} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                _stop(proc)
                raise HarnessError(f"{what} did not answer at {url}") from None
            time.sleep(0.05)
