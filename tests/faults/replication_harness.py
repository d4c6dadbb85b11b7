"""The replication campaign's harness: a replication network of locations, each on a broker
cluster of its own, run by location hosts, under a recorded workload of emitters.

One etcd holds everything: each location's cluster (two `gazette serve` brokers under an etcd
prefix of their own; the location's journal has replication 2) and the replication registry
(`gazctl replication add` declares each location and its shard). Location hosts (`python -m
replication host`, two per location) form one pool: the hosts' allocator gives each location a
primary and a hot standby among all of them, so a host "of" location A may serve B; faults aim
at the host that serves a location when they strike, found through the registry.

Network: as root, every broker and every host runs in a network namespace of its own (a "node"),
joined by a veth pair to a bridge on a private 10.x.y.0/24 whose .1 is the harness (its emitters,
gazctl, the checker's reads) and .2 etcd; node k is .(10+k). A partition between two locations'
sides is a blackhole route in each node of one side to each address of the other (see
`tests/faults/network.py`, which does it for brokers). Without root, everything runs on
127.0.0.1 and partitions are unavailable. Every server binds only an address of the harness's.

Every process is started here and stopped by its pid in `close`, which also removes the
namespaces and the bridge, on failure as on success."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import find_etcd_binary
from plumbing import etcd as etcdx
from replication import commands, registry
from replication.rpc import LocationClient, LocationError, status_document
from replication.system import keyed_document
from replication.topology import command_key
from tests.faults.harness import HarnessError, _free_port, _stop, _wait_http, signal_slot
from tests.faults.network import PartitionsUnsupported, _ip, namespaces_unavailable
from tests.faults.replication_checker import FAIL, INFO, OK, Emit, ReplicationHistory
from tests.helpers.server_fork import ForkedPopen

PREFIX = "/gazette-faults-replication"
REGISTRY = f"{PREFIX}/registry"
ROOT = Path(__file__).parents[2]


# ---- nodes: where each process lives, and cutting the links between them ------------------------


class Nodes:
    """Addresses of named nodes; on loopback every node is 127.0.0.1 and nothing can be cut."""

    name = "loopback"
    partitions = False
    etcd_host = "127.0.0.1"

    def host(self, node: str) -> str:
        return "127.0.0.1"

    def command(self, node: str, argv: list[str]) -> list[str]:
        return argv

    def cut(self, a: list[str], b: list[str]) -> None:
        raise PartitionsUnsupported("loopback: no partitions (network namespaces need root)")

    def mend_all(self) -> None:
        pass

    def close(self) -> None:
        pass


class NodeNamespaces(Nodes):
    """A namespace per node, on a bridge (see the module)."""

    name = "namespaces"
    partitions = True

    def __init__(self, nodes: list[str], rng: random.Random) -> None:
        reason = namespaces_unavailable()
        if reason:
            raise PartitionsUnsupported(f"network namespaces unavailable: {reason}")
        self.tag = f"gzr{os.getpid() % 0xFFFF:04x}{rng.randrange(0x100):02x}"
        self.bridge = f"{self.tag}br"
        used = _ip("-4", "-o", "addr").stdout + _ip("-4", "route").stdout
        for _ in range(100):
            self.subnet = f"10.{rng.randrange(100, 250)}.{rng.randrange(256)}"
            if f"{self.subnet}." not in used:
                break
        else:
            raise HarnessError("no free 10.x.y.0/24 subnet for the replication harness")
        self.etcd_host = f"{self.subnet}.2"
        self.index = {node: k for k, node in enumerate(nodes)}
        self.namespaces: list[str] = []
        self._bridge_made = False
        self._cuts: set[tuple[str, str]] = set()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            for host in (1, 2):
                _ip("addr", "add", f"{self.subnet}.{host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in nodes:
                self._add(node)
        except BaseException:
            self.close()
            raise

    def _ns(self, node: str) -> str:
        return f"{self.tag}n{self.index[node]}"

    def _add(self, node: str) -> None:
        ns, veth = self._ns(node), f"{self.tag}v{self.index[node]}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self.host(node)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def host(self, node: str) -> str:
        return f"{self.subnet}.{10 + self.index[node]}"

    def command(self, node: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._ns(node), *argv]  # Execs: the pid is the child's.

    def cut(self, a: list[str], b: list[str]) -> None:
        """Drop every packet between each node of `a` and each node of `b`."""
        for x, y in [(x, y) for x in a for y in b] + [(y, x) for x in a for y in b]:
            key = (self._ns(x), self.host(y))
            if key not in self._cuts:
                _ip("-n", key[0], "route", "add", "blackhole", f"{key[1]}/32")
                self._cuts.add(key)

    def mend_all(self) -> None:
        for ns, address in list(self._cuts):
            _ip("-n", ns, "route", "del", "blackhole", f"{address}/32", check=False)
        self._cuts.clear()

    def close(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()
        self._cuts.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False


# ---- processes ------------------------------------------------------------------------------------


@dataclass
class Slot:
    """A broker or a location host: one process at a time, on its node."""

    node: str  # e.g. "A-b0" (broker 0 of A's cluster) or "A-h1" (host 1 "of" A).
    kind: str  # "broker" or "host"
    location: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    paused: bool = False

    @property
    def id(self) -> str:
        """The broker id (stable: a restart waits for its old lease) or the host's consumer id
        (new for each incarnation: a restarted host joins as a new member)."""
        return self.node if self.kind == "broker" else f"{self.node}-{self.incarnation}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class NetworkConfig:
    workdir: Path
    locations: tuple[str, ...] = ("A", "B", "C", "D")
    brokers: int = 2  # Per location's cluster; its journal's replication too.
    hosts: int = 2  # Per location (one pool).
    lease: float = 2.0
    namespaces: bool = False
    store: bool = False  # A file:// fragment store per cluster (else spools only).
    # Connections: (source, target, filter).
    connections: tuple[tuple[str, str, str], ...] = (
        ("A", "B", ""), ("B", "A", ""), ("B", "C", ""), ("C", "B", ""), ("C", "A", ""),
        ("A", "C", ""), ("C", "D", "kind=red"), ("D", "C", ""),
    )  # fmt: skip
    admits: tuple[tuple[str, tuple[str, ...]], ...] = (("D", ("red",)),)


@dataclass
class ReplicationNetwork:
    config: NetworkConfig
    history: ReplicationHistory
    rng: random.Random = field(default_factory=random.Random)
    nodes: Nodes = field(default_factory=Nodes)
    slots: list[Slot] = field(default_factory=list)
    etcd_proc: subprocess.Popen[bytes] | None = None
    etcd_port: int = 0
    brokers_of: dict[str, list[Slot]] = field(default_factory=dict)
    _etcd: Any = None
    _clients: dict[str, LocationClient] = field(default_factory=dict)

    @property
    def workdir(self) -> Path:
        return self.config.workdir

    @property
    def etcd_endpoint(self) -> str:
        return f"http://{self.nodes.etcd_host}:{self.etcd_port}"

    async def __aenter__(self) -> ReplicationNetwork:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        for location in cfg.locations:
            self.brokers_of[location] = [Slot(f"{location}-b{i}", "broker", location) for i in range(cfg.brokers)]  # fmt: skip
            self.slots += self.brokers_of[location]
        for location in cfg.locations:
            self.slots += [Slot(f"{location}-h{i}", "host", location) for i in range(cfg.hosts)]
        if cfg.namespaces:
            self.nodes = NodeNamespaces([s.node for s in self.slots], self.rng)
        self.etcd_port = _free_port(self.nodes.etcd_host)
        self._start_etcd()
        self._etcd = etcdx.connect(self.etcd_endpoint, timeout=10)
        for slot in self.slots:
            if slot.kind == "broker":
                slot.port = 8080 if cfg.namespaces else _free_port("127.0.0.1")
                (self.workdir / f"store-{slot.location}" / "fragments").mkdir(parents=True, exist_ok=True)  # fmt: skip
                self._spawn(slot)
        await asyncio.gather(*(self._broker_ready(s) for s in self.slots if s.kind == "broker"))
        for location in cfg.locations:
            store = ["--fragment-store", "file:///fragments/"] if cfg.store else []
            await self.gazctl(
                "add", location, "--broker.address", self.broker_address(location),
                "--journal-replication", str(cfg.brokers), *store,
            )  # fmt: skip
        for slot in self.slots:
            if slot.kind == "host":
                self._spawn(slot)
        await asyncio.gather(*(self._host_ready(s) for s in self.slots if s.kind == "host"))
        await self.wait_served(timeout=60)
        for source, target, filter_ in cfg.connections:
            # A location the allocator moves between joining hosts is waited for by gazctl.
            await self.gazctl("connect", source, target, *(["--filter", filter_] if filter_ else []))  # fmt: skip

    async def close(self) -> None:
        """Stop every process by its pid, remove the namespaces; on failure as on success."""
        errors: list[str] = []
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
        if self._etcd is not None:
            with contextlib.suppress(Exception):
                await self._etcd.close()
        for slot in self.slots:
            try:
                _stop(slot.proc, signal.SIGKILL)
            except Exception as exc:
                errors.append(f"{slot.node}: {exc}")
        try:
            _stop(self.etcd_proc)
        except Exception as exc:
            errors.append(f"etcd: {exc}")
        try:
            self.nodes.close()
        except Exception as exc:
            errors.append(f"network: {exc}")
        if errors:
            raise HarnessError("; ".join(errors))

    def _start_etcd(self) -> None:
        client = self.etcd_endpoint
        peer = f"http://127.0.0.1:{_free_port('127.0.0.1')}"
        cmd = [
            find_etcd_binary(), "--name", "replication", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"replication={peer}", "--initial-cluster-state", "new",
            "--log-level", "error",
        ]  # fmt: skip
        with (self.workdir / "logs" / "etcd.log").open("ab") as out:
            self.etcd_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait_http(self.etcd_proc, f"{client}/health", "etcd")

    def broker_address(self, location: str, index: int = 0) -> str:
        slot = self.brokers_of[location][index]
        return f"http://{self.nodes.host(slot.node)}:{slot.port}"

    def _spawn(self, slot: Slot) -> None:
        cfg = self.config
        slot.incarnation += 1
        host = self.nodes.host(slot.node)
        if slot.kind == "broker":
            argv = [
                sys.executable, "-m", "broker.main", "serve", "--broker.id", slot.id,
                "--broker.host", host, "--broker.listen-host", host, "--broker.port", str(slot.port),
                "--etcd.address", self.etcd_endpoint, "--etcd.prefix", f"{PREFIX}/{slot.location}",
                "--etcd.lease", f"{cfg.lease:g}s",
                "--broker.file-root", str(self.workdir / f"store-{slot.location}"),
                "--broker.drain-timeout", "2s", "--broker.persist-interval", "5s",
            ]  # fmt: skip
            env = dict(os.environ, TMPDIR=str(self._spool(slot)), PYTHONUNBUFFERED="1")
        else:
            argv = [
                sys.executable, "-m", "replication", "host", "--consumer.id", slot.id,
                "--consumer.host", host, "--consumer.port", "0",
                "--broker.address", self.broker_address(slot.location),
                "--etcd.address", self.etcd_endpoint, "--etcd.lease", f"{cfg.lease:g}s",
                "--replication.prefix", REGISTRY, "--replication.lease", f"{cfg.lease:g}s",
            ]  # fmt: skip
            env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self._log(slot).open("wb") as out:
            slot.proc = ForkedPopen(
                self.nodes.command(slot.node, argv), stdout=out, stderr=subprocess.STDOUT,
                env=env, cwd=ROOT,
            )  # fmt: skip
        slot.paused = False
        self.history.note(f"{slot.kind} {slot.id} started (pid {slot.proc.pid})")

    def _spool(self, slot: Slot) -> Path:
        path = self.workdir / f"spool-{slot.node}"
        path.mkdir(exist_ok=True)
        return path

    def _log(self, slot: Slot) -> Path:
        return self.workdir / "logs" / f"{slot.node}.{slot.incarnation}.log"

    async def _broker_ready(self, slot: Slot, timeout: float = 40) -> None:
        from broker.client.dialer import Dialer

        deadline = time.monotonic() + timeout
        async with contextlib.AsyncExitStack() as stack:
            dialer = Dialer()
            stack.push_async_callback(dialer.close)
            stub = dialer.journal_stub(f"http://{self.nodes.host(slot.node)}:{slot.port}")
            while True:
                assert slot.proc is not None
                if slot.proc.poll() is not None:
                    raise HarnessError(f"broker {slot.id} exited {slot.proc.returncode}: {self._log(slot).read_text()[-1500:]}")  # fmt: skip
                try:
                    async for _ in stub.List(pb.ListRequest(), timeout=1):
                        pass
                    return
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise HarnessError(f"broker {slot.id} not ready in {timeout}s") from None
                    await asyncio.sleep(0.1)

    async def _host_ready(self, slot: Slot, timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        needle = f"consumer local/{slot.id} serving at"
        while needle not in self._log(slot).read_text(errors="replace"):
            assert slot.proc is not None
            if slot.proc.poll() is not None:
                raise HarnessError(f"host {slot.id} exited {slot.proc.returncode}: {self._log(slot).read_text()[-1500:]}")  # fmt: skip
            if time.monotonic() > deadline:
                raise HarnessError(f"host {slot.id} not ready in {timeout}s")
            await asyncio.sleep(0.1)

    async def start_slot(self, slot: Slot) -> None:
        if slot.running():
            return
        self._spawn(slot)
        if slot.kind == "broker":
            await self._broker_ready(slot, timeout=max(40, 6 * self.config.lease))
        else:
            await self._host_ready(slot)

    def signal(self, slot: Slot, sig: signal.Signals) -> None:
        signal_slot(slot, sig, hold=False)

    async def ensure_running(self) -> list[str]:
        """Resume paused processes, start any that exited; the ones started."""
        for slot in self.slots:
            if slot.paused:
                self.signal(slot, signal.SIGCONT)
        dead = [s for s in self.slots if not s.running()]
        await asyncio.gather(*(self.start_slot(s) for s in dead))
        return [s.id for s in dead]

    # ---- the registry, gazctl ---------------------------------------------------------------------

    async def entries(self) -> dict[str, registry.LocationEntry]:
        return await registry.read_locations(self._etcd, REGISTRY)

    async def serving(self, location: str) -> Slot | None:
        """The host whose process serves `location` now (by the registry's pid)."""
        entry = (await self.entries()).get(location)
        if entry is None or not entry.endpoint:
            return None
        for slot in self.slots:
            if slot.kind == "host" and slot.proc is not None and slot.proc.pid == entry.pid:
                return slot
        return None

    async def wait_served(self, timeout: float, locations: list[str] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        wanted = locations or list(self.config.locations)
        while time.monotonic() < deadline:
            live = [await self.serving(n) for n in wanted]
            if all(s is not None and s.running() and not s.paused for s in live):
                return True
            await asyncio.sleep(0.3)
        return False

    async def gazctl(
        self, *args: str, check: bool = True, timeout: float = 120, kill_after: float | None = None
    ) -> tuple[int, str]:
        """`gazctl replication ARGS` as an operator runs it (a process; exit code and output).
        With `kill_after`, the process is SIGKILLed that many seconds in unless it ended (exit
        code -9 then): an operator's gazctl dying mid-command."""
        argv = [
            sys.executable, "-m", "gazctl.cli", "replication", *args,
            "--etcd.address", self.etcd_endpoint, "--replication.prefix", REGISTRY,
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT
        )
        if kill_after is not None:
            done, _ = await asyncio.wait([asyncio.ensure_future(proc.wait())], timeout=kill_after)
            if not done:
                proc.kill()
                await proc.wait()
                self.history.note(f"gazctl replication {' '.join(args)} SIGKILLed after {kill_after:.2f}s")  # fmt: skip
                return -9, ""
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise HarnessError(f"gazctl replication {' '.join(args)}: no answer in {timeout}s") from None  # fmt: skip
        text = out.decode(errors="replace")
        self.history.note(f"gazctl replication {' '.join(args)} -> {proc.returncode}: {text.strip()[-200:]}")  # fmt: skip
        if check and proc.returncode:
            raise HarnessError(f"gazctl replication {' '.join(args)} exited {proc.returncode}: {text[-800:]}")  # fmt: skip
        assert proc.returncode is not None
        return proc.returncode, text

    async def client(self, location: str, fresh: bool = False) -> LocationClient | None:
        """A client of the process that serves `location` (None: none is registered)."""
        client = self._clients.get(location)
        if client is not None and not fresh:
            return client
        entry = (await self.entries()).get(location)
        if entry is None or not entry.endpoint:
            return None
        if client is not None and client.endpoint == entry.endpoint:
            return client
        if client is not None:
            await client.close()
        client = self._clients[location] = LocationClient(location, entry.endpoint, timeout=5)
        return client

    async def delete_journal(self, location: str) -> None:
        """A disaster: the location's journal deleted while its process runs."""
        entry = (await self.entries())[location]
        async with JournalsClient(entry.broker) as client:
            await client.apply([pb.ApplyRequest.Change(delete=entry.journal, expect_mod_revision=-1)])  # fmt: skip

    # ---- after a run ----------------------------------------------------------------------------

    async def statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for location in self.config.locations:
            with contextlib.suppress(LocationError, AttributeError):
                client = await self.client(location, fresh=True)
                if client is not None:
                    out[location] = status_document(await client.status(timeout=5))
        return out

    async def wait_quiescent(self, timeout: float) -> bool:
        """Until every location serves, every connection replicates with no lag, has read
        through its source's last event as the source itself reports it, and no log grew
        between two looks (bounded). A connection's own lag is measured against the last
        sequence number it heard of: one whose source was just partitioned from it, its read
        hanging, reports "replicating" with lag 0 (seen in operator-commands, seed 8)."""
        deadline = time.monotonic() + timeout
        previous: dict[str, int] = {}
        while time.monotonic() < deadline:
            statuses = await self.statuses()
            seqs = {n: s["last_seq"] for n, s in statuses.items()}
            settled = len(statuses) == len(self.config.locations) and all(
                c["lag"] == 0
                and c["state"] == "replicating"
                and c["source"] in seqs
                and c["progress"] >= seqs[c["source"]]
                for s in statuses.values()
                for c in s["connections"]
            )
            if settled and seqs == previous:
                return True
            previous = seqs
            await asyncio.sleep(1.5)
        self.history.note("not quiescent within the bound")
        return False

    async def collect(self) -> None:
        """Every location's log (Read pages through its last committed event) and view."""
        for location in self.config.locations:
            for attempt in range(5):
                try:
                    events = await self.read_events(location, 0)
                    client = await self.client(location, fresh=True)
                    if client is None:
                        raise HarnessError(f"{location} is not served")
                    status = status_document(await client.status())
                except (LocationError, HarnessError) as exc:
                    self.history.note(f"collecting {location} failed ({exc}): again")
                    await asyncio.sleep(1.0 + attempt)
                    continue
                self.history.logs[location] = events
                self.history.views[location] = status["history"]
                break
        code, out = await self.gazctl("topology", "--check", check=False)
        self.history.topology_check = {"code": code, "out": out}
        history = await commands.read_history(self._etcd, REGISTRY)
        self.history.etcd_history = [
            keyed_document(command_key(op), c) for op, c in history.changes
        ]

    async def status_of(self, location: str) -> dict[str, Any] | None:
        """The location's Status as `status --format json` prints it (None: no process answers)."""
        with contextlib.suppress(LocationError, HarnessError, AttributeError):
            client = await self.client(location, fresh=True)
            if client is not None:
                return status_document(await client.status(timeout=5))
        return None

    async def read_events(self, location: str, after: int) -> list[dict[str, Any]]:
        """The location's stored events after sequence number `after`, through its last
        committed one (deleted ones are left out by the location)."""
        client = await self.client(location, fresh=True)
        if client is None:
            raise HarnessError(f"{location} is not served")
        events: list[dict[str, Any]] = []
        while True:
            reply = await client.read(after, 1000)
            for line in reply.records.decode().splitlines():
                record = json.loads(line)
                if record.get("kind") == "event":
                    events.append(record)
            if reply.through <= after or reply.through >= reply.last_seq:
                return events
            after = reply.through

    async def neighbours(self, location: str) -> list[str]:
        """The locations directly connected with `location` in etcd's topology now (the ones a
        deletion there is checked against)."""
        view = (await commands.read_history(self._etcd, REGISTRY)).view()
        return sorted({s if t == location else t for s, t in view.current if location in (s, t)} - {location})  # fmt: skip

    async def topology_head(self) -> int:
        """The op of the last topology change etcd recorded (0: none)."""
        history = await commands.read_history(self._etcd, REGISTRY)
        return history.changes[-1][0] if history.changes else 0


# ---- the workload -------------------------------------------------------------------------------


class Emitters:
    """An emitter per location: one event per Emit call, `{"kind": red|blue, "id": unique}`,
    recorded with Jepsen's outcomes (a refusal is `fail`: the rule refused before writing; a
    timeout or an unreachable process is `info`: it may or may not be stored). A failed call
    looks the location's endpoint up again."""

    def __init__(self, net: ReplicationNetwork, seed: int) -> None:
        self.net, self.history = net, net.history
        self.rng = random.Random(f"{seed}/emitters")
        self.tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self.counter = 0

    def start(self) -> None:
        for location in self.net.config.locations:
            rng = random.Random(self.rng.random())
            self.tasks.append(asyncio.create_task(self._run(location, rng), name=f"emitter {location}"))  # fmt: skip

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def emit_once(self, location: str, rng: random.Random, fresh: bool = False) -> Emit:
        self.counter += 1
        kind = rng.choice(["red", "blue"])
        op = Emit(location, f"{location}-{self.counter}-{rng.getrandbits(32):08x}", kind, self.history.now())  # fmt: skip
        self.history.emits.append(op)
        try:
            client = await self.net.client(location, fresh=fresh)
        except Exception as exc:
            op.outcome, op.error, op.completed = FAIL, f"lookup: {exc}", self.history.now()
            return op
        if client is None:
            op.outcome, op.error, op.completed = FAIL, "no process registered", self.history.now()
            return op
        try:
            ((emitter, time_),) = await client.emit({"kind": kind, "id": op.uid})
        except LocationError as exc:
            definite = exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)  # fmt: skip
            op.outcome = FAIL if definite else INFO
            op.error = f"{exc.code.name}: {exc.detail[:160]}"
        except Exception as exc:
            op.outcome, op.error = INFO, f"{type(exc).__name__}: {exc}"[:200]
        else:
            op.outcome, op.emitter, op.time = OK, emitter, time_
        op.completed = self.history.now()
        return op

    async def _run(self, location: str, rng: random.Random) -> None:
        fresh = False
        while not self._stop.is_set():
            op = await self.emit_once(location, rng, fresh)
            fresh = op.outcome != OK
            await asyncio.sleep(rng.uniform(0.1, 0.3) if op.outcome == OK else 0.3)

    async def probe(self, location: str, timeout: float) -> bool:
        """An emit after healing, retried until one is acknowledged or `timeout` passes."""
        rng = random.Random(f"probe/{location}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await self.emit_once(location, rng, fresh=True)).outcome == OK:
                return True
            await asyncio.sleep(0.5)
        return False
