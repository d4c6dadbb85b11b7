"""`gazctl dev up|down|status|kill|restart`: a local cluster (etcd and N brokers) on loopback; with
`--consumers N --app NAME` also N consumer processes of an application, and with `--postgres` a
PostgreSQL server for SQL stores.

Processes run detached so `up` can return; their pids and addresses live in `<dir>/cluster.json`
and `down` stops exactly those pids (after checking each still runs what we started). The ports
stay in `<dir>/ports.json` after `down`: the next `up` listens on them again where still free,
so an exported BROKER_ADDRESS (every broker, comma-separated: a client reaches whichever is
alive) keeps working.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from allocator import keyspace as aks
from broker.client import BrokerUnavailable, JournalsClient
from broker.client.journals import ListSnapshot
from broker.resolver import desired_replication
from gazctl.render import console, err_console
from plumbing.local_etcd import (
    EtcdNotFound,
    etcd_command,
    etcd_environment,
    find_etcd_binary,
    free_port,
    wait_etcd_healthy,
)
from plumbing.tls import DevPKI, make_dev_pki, write_private

T = TypeVar("T")

STATE = "cluster.json"
PORTS = "ports.json"
ETCD_PREFIX = "/gazette/cluster"


@dataclass
class Proc:
    role: str
    pid: int
    address: str
    log: str
    marker: str  # a string the process's command line must contain for it to be ours
    # How `up` started it, so that `up` (for a process that died) and `restart` start it the
    # same way again: its command, what it adds to the environment (the cluster's TLS and key
    # come from <dir>), and the etcd key it holds under its lease (its member key, revoked
    # before it starts again, so the new process need not wait for the old lease to expire).
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    lease_key: str = ""


@dataclass(frozen=True)
class DevSecurity:
    """`up --tls`: a throwaway CA and certificates under <dir>/tls, every process serving TLS
    (client certificates required) and dialling its peers and etcd with them. `up --auth`: a
    random key in <dir>/auth-key that every process verifies tokens with, and clients sign with.
    Clients (gazctl, consumers, Spark, location processes) take them from the environment,
    under upstream's variable names."""

    pki: DevPKI | None = None
    auth_key: str = ""
    auth_key_file: Path | None = None  # <dir>/auth-key, which holds auth_key

    @staticmethod
    def make(root: Path, tls: bool, auth: bool) -> DevSecurity:
        pki = make_dev_pki(root / "tls") if tls else None
        key = ""
        if auth:
            path = root / "auth-key"
            if not path.exists():
                write_private(path, base64.b64encode(secrets.token_bytes(32)))
            key = path.read_text().strip()
            return DevSecurity(pki, key, path)
        return DevSecurity(pki, key)

    @property
    def scheme(self) -> str:
        return "https" if self.pki else "http"

    def server_flags(self, service: str) -> list[str]:
        return self.pki.server_flags(service) if self.pki is not None else []

    def location_flags(self) -> list[str]:
        """A location process's Location service: TLS and token checks as the brokers'."""
        flags: list[str] = []
        if self.pki is not None:
            p = self.pki
            flags += [
                "--replication.server-cert-file", str(p.server_cert),
                "--replication.server-cert-key-file", str(p.server_key),
                "--replication.server-ca-file", str(p.ca_cert),
            ]  # fmt: skip
        if self.auth_key:  # A file, not the key: a command line is anyone's to read (`ps`).
            flags += ["--replication.auth-keys-file", str(self.auth_key_file)]
        return flags

    def environment(self) -> dict[str, str]:
        """What a client of the cluster needs: BROKER_*, CONSUMER_* and ETCD_* files, and the
        key (a server takes $BROKER_AUTH_KEYS and $CONSUMER_AUTH_KEYS as its own)."""
        env: dict[str, str] = {}
        if self.pki is not None:
            for service in ("BROKER", "CONSUMER", "ETCD"):
                env[f"{service}_CERT_FILE"] = str(self.pki.client_cert)
                env[f"{service}_CERT_KEY_FILE"] = str(self.pki.client_key)
                env[f"{service}_TRUSTED_CA_FILE"] = str(self.pki.ca_cert)
        if self.auth_key:
            env["BROKER_AUTH_KEYS"] = env["CONSUMER_AUTH_KEYS"] = self.auth_key
        return env

    def apply(self) -> None:
        """Make this process, and every process it starts, a client of the cluster."""
        from plumbing import credentials

        os.environ.update(self.environment())
        credentials.reset_defaults()


@dataclass
class ClusterState:
    dir: str
    etcd: Proc
    brokers: list[Proc] = field(default_factory=list)
    postgres: Proc | None = None
    consumers: list[Proc] = field(default_factory=list)
    app: str = ""
    # Replication: each location's process, and the broker of its own cluster.
    locations: list[Proc] = field(default_factory=list)
    location_brokers: list[Proc] = field(default_factory=list)
    tls: bool = False
    auth: bool = False

    def all(self) -> list[Proc]:
        """Every process, in the order to stop them: consumers, locations, brokers,
        PostgreSQL, etcd."""
        return [
            *self.consumers,
            *self.locations,
            *self.location_brokers,
            *self.brokers,
            *([self.postgres] if self.postgres else []),
            self.etcd,
        ]

    def tiers(self) -> list[list[Proc]]:
        """`all` in the tiers `down` stops together: consumers and locations, then their
        brokers, then PostgreSQL, then etcd. Members of a tier stopped together each see the
        others exiting, so none waits out its drain timeout for a hand-off to a member that is
        leaving too; each broker still persists what its spools hold before it exits."""
        return [
            tier
            for tier in (
                [*self.consumers, *self.locations],
                [*self.location_brokers, *self.brokers],
                [self.postgres] if self.postgres else [],
                [self.etcd],
            )
            if tier
        ]

    def groups(self) -> list[tuple[str, list[Proc]]]:
        """The processes by kind, in the order to start them (each needs those before it)."""
        return [
            ("etcd", [self.etcd]),
            ("brokers", self.brokers),
            ("postgres", [self.postgres] if self.postgres else []),
            ("consumers", self.consumers),
            ("location brokers", self.location_brokers),
            ("locations", self.locations),
        ]

    def start_order(self) -> list[Proc]:
        return [proc for _, group in self.groups() for proc in group]

    def find(self, name: str) -> Proc:
        """The process `dev status` shows as `name`; else one line naming the valid ones."""
        for proc in self.all():
            if proc.role == name:
                return proc
        names = ", ".join(p.role for p in self.start_order())
        raise click.ClickException(f"no process {name!r} in the dev cluster in {self.dir}: "
                                   f"give one of {names}")  # fmt: skip

    def location_names(self) -> list[str]:
        return [p.role.removeprefix("location-") for p in self.locations]

    def save(self) -> None:
        Path(self.dir, STATE).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(directory: Path) -> ClusterState | None:
        path = directory / STATE
        if not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
            return ClusterState(
                dir=doc["dir"],
                etcd=Proc(**doc["etcd"]),
                brokers=[Proc(**b) for b in doc["brokers"]],
                postgres=Proc(**doc["postgres"]) if doc.get("postgres") else None,
                consumers=[Proc(**c) for c in doc.get("consumers", [])],
                app=str(doc.get("app", "")),
                locations=[Proc(**c) for c in doc.get("locations", [])],
                location_brokers=[Proc(**c) for c in doc.get("location_brokers", [])],
                tls=bool(doc.get("tls", False)),
                auth=bool(doc.get("auth", False)),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class Ports:
    """The ports a dev cluster listens on, kept from one `up` to the next."""

    etcd_client: int
    etcd_peer: int
    brokers: list[int]
    consumers: list[int] = field(default_factory=list)
    postgres: int = 0
    locations: dict[str, list[int]] = field(default_factory=dict)  # Name: [broker, service].

    def save(self, directory: Path) -> None:
        (directory / PORTS).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(directory: Path) -> Ports | None:
        try:
            doc = json.loads((directory / PORTS).read_text())
            ports = Ports(
                int(doc["etcd_client"]),
                int(doc["etcd_peer"]),
                [int(p) for p in doc["brokers"]],
                [int(p) for p in doc.get("consumers", [])],
                int(doc.get("postgres", 0)),
                {str(n): [int(p) for p in ps] for n, ps in doc.get("locations", {}).items()},
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ports


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as etcd and gRPC servers do,
    with SO_REUSEADDR: connections of an earlier run in TIME_WAIT do not hold it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def choose_ports(
    previous: Ports | None,
    brokers: int,
    consumers: int = 0,
    postgres: bool = False,
    locations: Sequence[str] = (),
) -> tuple[Ports, list[str]]:
    """The previous run's ports where still free, new ones where not (or for new processes);
    and a line for each process that moved."""
    old = previous or Ports(0, 0, [])
    reserved = {old.etcd_client, old.etcd_peer, *old.brokers, *old.consumers, old.postgres}
    reserved |= {p for ports in old.locations.values() for p in ports}
    moved: list[str] = []

    def pick(role: str, before: int, then: str = "") -> int:
        if before and port_is_free(before):
            return before
        port = free_port()
        while port in reserved:  # Another process's remembered port: keep it for that one.
            port = free_port()
        reserved.add(port)
        if before:
            moved.append(f"{role}: port {before} is taken by another process, so {role} "
                         f"listens on port {port}{then}")  # fmt: skip
        return port

    again = "; export BROKER_ADDRESS again (as printed below)"
    ports = Ports(
        pick("etcd", old.etcd_client),
        pick("etcd (peer)", old.etcd_peer),
        [
            pick(
                f"broker-{i}",
                old.brokers[i] if i < len(old.brokers) else 0,
                again,
            )
            for i in range(brokers)
        ],
        [
            pick(
                f"consumer-{i}",
                old.consumers[i] if i < len(old.consumers) else 0,
                "; export CONSUMER_ADDRESS again (as printed below)",
            )
            for i in range(consumers)
        ],
        pick("postgres", old.postgres, "; export POSTGRES_DSN again") if postgres else old.postgres,
        {
            name: [
                pick(f"location-{name}-broker", (old.locations.get(name) or [0, 0])[0]),
                pick(f"location-{name}", (old.locations.get(name) or [0, 0])[1]),
            ]
            for name in locations
        },
    )
    return ports, moved


def brokers_address(state: ClusterState) -> str:
    """Every broker's address, comma-separated: what clients and consumers dial, so that
    killing any one broker leaves them reaching the others."""
    return ",".join(b.address for b in state.brokers)


def print_exports(state: ClusterState) -> None:
    """The environment the other gazctl commands take (stdout's last lines: `eval` them);
    ETCD_ADDRESS is for consumer processes (`--etcd.address`)."""
    click.echo(f"export ETCD_ADDRESS={state.etcd.address}")
    security = DevSecurity.make(Path(state.dir), state.tls, state.auth)
    for name, value in security.environment().items():
        click.echo(f"export {name}={value}")
    # Every broker: a client reaches whichever is alive (plumbing.tls.dial_target).
    click.echo(f"export BROKER_ADDRESS={brokers_address(state)}")
    click.echo(f"export BROKER_FILE_ROOT={Path(state.dir) / 'fragments'}")
    if state.postgres is not None:
        click.echo(f"export POSTGRES_DSN={state.postgres.address}")
    if state.consumers:
        # Every consumer: a client reaches whichever is alive (plumbing.tls.dial_target).
        addresses = ",".join(c.address for c in state.consumers)
        click.echo(f"export CONSUMER_ADDRESS={addresses}")


def process_state(proc: Proc) -> str:
    """ "running"; "paused" (stopped by SIGSTOP, or SIGTSTP); or "down": exited, a zombie, or
    its pid now runs another command (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return "down"
    state = stat.rsplit(")", 1)[-1].split()[0]
    if state == "Z" or proc.marker not in cmdline:
        return "down"
    return "paused" if state in ("T", "t") else "running"


def is_running(proc: Proc) -> bool:
    """Alive (running or paused), and still running the command we started."""
    return process_state(proc) != "down"


# What a process does between SIGTERM and its exit, by its kind (`broker-0`: broker).
STOPPING = {
    "broker": "its journals drain to the other brokers, or --broker.drain-timeout passes",
    "consumer": "its shards finish their transactions and hand off, or its drain timeout passes",
    "location": "it hands its location off",
}


def stop_pids(procs: list[Proc], timeout: float = 10.0, *, say: bool = False) -> int:
    """`stop_pid` of several processes at once: each signalled, then all waited for together
    (up to `timeout`), then SIGKILL for any still running. Returns how many were running."""
    running = [proc for proc in procs if is_running(proc)]
    for proc in running:
        _signal_to_stop(proc, timeout, say)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_running(proc) for proc in running):
        time.sleep(0.05)
    for proc in running:
        if is_running(proc):
            _kill(proc, timeout, say)
    return len(running)


def _signal_to_stop(proc: Proc, timeout: float, say: bool) -> None:
    if say:
        kind = "broker" if proc.role.endswith("-broker") else proc.role.split("-")[0]
        doing = STOPPING.get(kind, "")
        click.echo(
            f"stopping {proc.role} (pid {proc.pid}): waiting up to {timeout:g}s for it to exit"
            + (f" ({doing})" if doing else ""),
            err=True,
        )
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT if proc.role == "postgres" else signal.SIGTERM)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)  # One paused by `dev kill --signal STOP` too.


def _kill(proc: Proc, timeout: float, say: bool) -> None:
    if say:
        click.echo(f"{proc.role} did not exit within {timeout:g}s: sending SIGKILL", err=True)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    while is_running(proc):
        time.sleep(0.05)


def stop_pid(proc: Proc, timeout: float = 10.0, *, say: bool = False) -> bool:
    """SIGTERM (PostgreSQL: SIGINT, its fast shutdown, which does not wait for clients), then
    SIGKILL after `timeout`. Returns whether the process was running. With `say`, tells on
    stderr what it waits for, and when it gives up waiting."""
    return stop_pids([proc], timeout, say=say) == 1


def spawn(
    cmd: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    *,
    environment: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a detached process logging to `log_path`, in this process's environment plus
    `env`, or in exactly `environment`."""
    if environment is None and env:
        environment = {**os.environ, **env}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,  # Outlives `gazctl dev up`, and ignores the terminal's ^C.
        )


def tail(path: str, lines: int = 5) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def wait_ready(
    procs: list[Proc], popens: list[subprocess.Popen[bytes]], timeout: float, *, consumers: bool
) -> None:
    """Until each process answers List (brokers' Journal, or consumers' Shard service), or one
    line saying which exited or is not ready, with its log's tail."""
    from consumer.client import ShardsClient

    async def answers(proc: Proc) -> bool:
        client: JournalsClient | ShardsClient = (
            ShardsClient(proc.address, timeout=2.0)
            if consumers
            else JournalsClient(proc.address, timeout=2.0)
        )
        try:
            await client.list()
            return True
        except BrokerUnavailable:  # ConsumerUnavailable is one.
            return False
        finally:
            await client.close()

    await wait_answering(procs, popens, timeout, answers)


async def wait_answering(
    procs: list[Proc],
    popens: list[subprocess.Popen[bytes]],
    timeout: float,
    answers: Callable[[Proc], Awaitable[bool]],
) -> None:
    """Until `answers` says each process does, or one line saying which exited or is not
    ready, with its log's tail."""
    deadline = time.monotonic() + timeout
    for proc, popen in zip(procs, popens, strict=True):
        while not await answers(proc):
            if popen.poll() is not None:
                raise click.ClickException(
                    f"{proc.role} exited with status {popen.returncode} during start-up; "
                    f"see {proc.log}:\n{tail(proc.log)}"
                )
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"{proc.role} at {proc.address} not ready after {timeout:.0f}s; see {proc.log}"
                )
            await asyncio.sleep(0.1)


async def revoke_stale_members(etcd_endpoint: str) -> None:
    """Brokers and consumers of an earlier run of this folder are all stopped, but etcd
    restored their leases with its data: revoke them, so new processes need not wait for them
    to expire."""
    from plumbing import etcd as etcdx

    client = etcdx.connect(etcd_endpoint)
    try:
        # Members of the brokers' and consumers' clusters, and location processes' endpoints.
        stale = [
            kv
            for kv in await client.get_prefix(b"/gazette/")
            if b"/members/" in kv.key or kv.key.startswith(b"/gazette/replication/endpoints/")
        ]
        for kv in stale:
            if kv.lease:
                with contextlib.suppress(Exception):
                    await client.revoke_lease(kv.lease)
    finally:
        await client.close()


def broker_command(
    i: int,
    port: int,
    etcd: str,
    file_root: Path,
    prefix: str = ETCD_PREFIX,
    name: str = "",
    security: DevSecurity = DevSecurity(),
) -> list[str]:
    return [
        sys.executable, "-m", "broker.main", "serve", *security.server_flags("broker"),
        "--broker.zone", "local",
        "--broker.id", name or f"broker-{i}",
        "--broker.host", "127.0.0.1",
        "--broker.port", str(port),
        "--broker.file-root", str(file_root),
        "--etcd.address", etcd,
        "--etcd.prefix", prefix,
        "--etcd.lease", "10s",
        "--broker.drain-timeout", "5s",
        # A dev cluster's stores are local directories: they take a fragment in milliseconds
        # or not at all (a directory gone), so `dev down` does not wait half a minute a broker
        # on one that does not.
        "--broker.exit-flush-timeout", "5s",
    ]  # fmt: skip


LOCATION_STORE = "file:///replication/"


def location_names(text: str) -> list[str]:
    """`--locations`: a count (3: A, B, C) or names separated by commas."""
    from replication.registry import check_name

    if text.isdigit():
        count = int(text)
        if not 1 <= count <= 26:
            raise click.BadParameter(f"{count}: give 1 to 26 locations", param_hint="--locations")
        return [chr(ord("A") + i) for i in range(count)]
    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        for name in names:
            check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--locations") from None
    if not names or len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r}: give distinct names, e.g. east,west", param_hint="--locations")  # fmt: skip
    return names


def start_locations(
    root: Path,
    names: Sequence[str],
    ports: Ports,
    etcd: str,
    state: ClusterState,
    timeout: float,
    security: DevSecurity = DevSecurity(),
) -> None:
    """Each location in a cluster of its own (one broker, under the etcd prefix
    /gazette/location-NAME), its log's journal there, and its process, registered under
    /gazette/replication; until each answers."""
    from replication.journals import apply_location_journals
    from replication.registry import DEFAULT_PREFIX, endpoint_key

    file_root = root / "fragments"
    (file_root / LOCATION_STORE.removeprefix("file:///")).mkdir(parents=True, exist_ok=True)
    popens = []
    for name in names:
        broker_port = ports.locations[name][0]
        log_path = root / f"location-{name}-broker.log"
        cmd = broker_command(0, broker_port, etcd, file_root, f"/gazette/location-{name}", f"location-{name}", security)  # fmt: skip
        popens.append(spawn(cmd, log_path))
        state.location_brokers.append(
            Proc(
                f"location-{name}-broker",
                popens[-1].pid,
                f"{security.scheme}://127.0.0.1:{broker_port}",
                str(log_path),
                f"--broker.port {broker_port}",
                cmd,
                lease_key=aks.member_key(f"/gazette/location-{name}", "local", f"location-{name}"),
            )
        )
        state.save()
    asyncio.run(wait_ready(state.location_brokers, popens, timeout, consumers=False))
    for name, broker in zip(names, state.location_brokers, strict=True):
        asyncio.run(apply_location_journals(broker.address, name, store=LOCATION_STORE))
    location_popens = []
    for name, broker in zip(names, state.location_brokers, strict=True):
        port = ports.locations[name][1]
        log_path = root / f"location-{name}.log"
        cmd = [
            sys.executable, "-m", "replication", "serve", "--location", name,
            "--broker.address", broker.address, "--etcd.address", etcd,
            "--replication.port", str(port), *security.location_flags(),
        ]  # fmt: skip
        location_popens.append(spawn(cmd, log_path))
        state.locations.append(
            Proc(
                f"location-{name}",
                location_popens[-1].pid,
                f"{security.scheme}://127.0.0.1:{port}",
                str(log_path),
                f"--location {name} ",
                cmd,
                lease_key=endpoint_key(DEFAULT_PREFIX, name).decode(),
            )
        )
        state.save()
    asyncio.run(wait_locations(state.locations, location_popens, timeout))


async def wait_locations(
    procs: list[Proc], popens: list[subprocess.Popen[bytes]], timeout: float
) -> None:
    from replication.rpc import LocationClient, LocationError

    async def answers(proc: Proc) -> bool:
        async with LocationClient(proc.role, proc.address, timeout=2.0) as client:
            try:
                await client.status()
                return True
            except LocationError:
                return False

    await wait_answering(procs, popens, timeout, answers)


# The examples `--app` takes by short name: their module, and the flags of their stores.
EXAMPLES = {
    "word-count": "consumer.examples.word_count",
    "stream-sum": "consumer.examples.stream_sum",
}


def app_name(app: str) -> str:
    """The application's name, which names its etcd prefix (/gazette/consumers/NAME)."""
    if app in EXAMPLES:
        return app
    return app.partition(":")[2].lower() or app


# The extra of gazette-py that brings each optional module an application or store imports.
EXTRAS = {
    "apsw": "sqlite",
    "asyncpg": "sql",
    "pyspark": "spark",
    "pyarrow": "spark",
    "pandas": "spark",
    "boto3": "s3",
    "google": "gcs",
}

# Run as the consumers will be (this interpreter, this folder on sys.path): import each module
# named, then check that the application's factory exists. Prints one line on failure.
_IMPORT_PROBE = """
import importlib, sys
module, attr, *others = sys.argv[1:]
for name in (module, *others):
    try:
        loaded = importlib.import_module(name)
    except ImportError as exc:
        print(f"{name}\t{exc.name or ''}\t{exc}")
        sys.exit(3)
    except Exception as exc:
        print(f"{name}\t\t{type(exc).__name__}: {exc}")
        sys.exit(3)
    if name == module and attr and not callable(getattr(loaded, attr, None)):
        print(f"{name}\t\thas no class or factory {attr}")
        sys.exit(3)
"""


def check_app(app: str, postgres: bool = False) -> None:
    """An --app that names an example, or module:Name, whose module (and, with --postgres, the
    SQL store's driver) imports as the consumers will import it; else one line naming the extra
    to install, before anything starts (a consumer that cannot import fails only after etcd and
    the brokers started)."""
    if app in EXAMPLES:
        module, name = EXAMPLES[app], ""
    else:
        module, _, name = app.partition(":")
        if not module or not name:
            raise click.BadParameter(
                f"{app!r} is neither an example ({', '.join(EXAMPLES)}) nor module:Name",
                param_hint="--app",
            )
    probe = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, module, name, *(["asyncpg"] if postgres else [])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode == 0:
        return
    failed, missing, reason = [*probe.stdout.strip().split("\t", 2), "", "", ""][:3]
    if not failed:  # The probe itself failed: say what it printed, on one line.
        reason = " ".join(probe.stderr.split()[-12:]) or f"exit status {probe.returncode}"
        failed = module
    if missing and (module == missing or module.startswith(f"{missing}.")):  # The app's own.
        raise click.BadParameter(f"{app!r}: no module {missing} to import", param_hint="--app")
    extra = EXTRAS.get(missing.partition(".")[0])
    advice = f": pip install 'gazette-py[{extra}]'" if extra else ""
    raise click.ClickException(
        f"--app {app}: the consumers cannot import {failed} ({reason}){advice}"
    )


def consumer_command(
    app: str,
    i: int,
    port: int,
    etcd: str,
    broker: str,
    stores: Path,
    postgres: str | None,
    security: DevSecurity = DevSecurity(),
) -> list[str]:
    if app in EXAMPLES:
        cmd = [sys.executable, "-m", EXAMPLES[app], "serve"]
        if app == "word-count":
            cmd += ["--wordcount.postgres", postgres] if postgres else []
            cmd += [] if postgres else ["--wordcount.store-root", str(stores)]
        else:
            cmd += ["--summer.store-root", str(stores)]
    else:
        cmd = [sys.executable, "-m", "consumer", "serve", "--app", app]
    return [
        *cmd,
        "--consumer.zone", "local",
        "--consumer.id", f"consumer-{i}",
        "--consumer.port", str(port),
        "--consumer.host", "127.0.0.1",
        "--broker.address", broker,
        "--etcd.address", etcd,
        "--etcd.prefix", f"/gazette/consumers/{app_name(app)}",
        "--etcd.lease", "10s",
        "--consumer.drain-timeout", "5s",
        *security.server_flags("consumer"),
    ]  # fmt: skip


def start_postgres(root: Path, port: int, state: ClusterState, timeout: float) -> str:
    """PostgreSQL in `root/postgres` on `port` (its cluster made on first use); its DSN."""
    from consumer import local_postgres

    pg_root = root / "postgres"
    if os.geteuid() == 0 and not pg_root.exists():
        # PostgreSQL runs as its own user, who may not reach this folder (under /root, say):
        # its data lives in /var/tmp, linked from here (and removed by `down --purge`).
        digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
        real = Path("/var/tmp") / f"gazette-dev-postgres-{digest}"
        real.mkdir(parents=True, exist_ok=True)
        pg_root.symlink_to(real)
    try:
        local_postgres.init_cluster(pg_root.resolve())
    except (local_postgres.PostgresNotFound, RuntimeError, OSError) as exc:
        raise click.ClickException(f"--postgres: {exc}") from None
    log_path = root / "postgres.log"
    pg_root = pg_root.resolve()
    cmd = local_postgres.postgres_command(pg_root, port)
    popen = spawn(cmd, log_path)
    dsn = local_postgres.postgres_dsn(port)
    state.postgres = Proc("postgres", popen.pid, dsn, str(log_path), str(pg_root / "data"), cmd)
    state.save()
    try:
        local_postgres.wait_postgres_ready(popen, pg_root, port, log_path, timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(f"PostgreSQL did not start: {exc}; see {log_path}") from None
    return dsn


STATE_STYLE = {
    "running": "[green]{}[/green]",
    "paused": "[yellow]{}[/yellow]",
    "down": "[red]{}[/red]",
}


def print_status(state: ClusterState, to: Console = console) -> None:
    """The processes' table (`up` puts it on stderr: its stdout is the exports alone)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("Process", "PID", "Address", "State", "Log"):
        table.add_column(column)
    for proc in state.all():
        alive = process_state(proc)
        table.add_row(
            proc.role, str(proc.pid), proc.address, STATE_STYLE[alive].format(alive), proc.log
        )
    to.print(table)


@click.group()
def dev() -> None:
    """A local development cluster: etcd, brokers, and consumers, on loopback; `kill` and
    `restart` one of them to try failover."""


dir_option = click.option(
    "--dir", "directory", default=".gazette-dev", show_default=True, type=click.Path(file_okay=False),
    help="Folder holding the cluster's state, logs, etcd data and file:// fragment store",
)  # fmt: skip


@dev.command("up")
@dir_option
@click.option(
    "--brokers", default=3, show_default=True, type=click.IntRange(1, 32), help="Number of brokers"
)
@click.option(
    "--consumers", default=None, type=click.IntRange(1, 32),
    help="Consumer processes of --app to start (default 2 with --app)",
)  # fmt: skip
@click.option(
    "--app", default=None,
    help="The consumers' application: an example (word-count, stream-sum) or module:Name",
)  # fmt: skip
@click.option(
    "--postgres", is_flag=True,
    help="Also run PostgreSQL (word-count keeps its counts there; others get POSTGRES_DSN)",
)  # fmt: skip
@click.option(
    "--locations", default=None,
    help="Also run a replication network's locations: a count (3: A, B, C) or names (east,west), each in a cluster of its own",
)  # fmt: skip
@click.option(
    "--tls", is_flag=True,
    help="Run every process on TLS, with a throwaway CA and certificates made in <dir>/tls (client certificates required)",
)  # fmt: skip
@click.option(
    "--auth", is_flag=True,
    help="Require authorization tokens, signed with a random key made in <dir>/auth-key",
)  # fmt: skip
@click.option(
    "--timeout",
    default=60.0,
    show_default=True,
    help="Seconds to wait for the cluster to become ready",
)
def up(
    directory: str,
    brokers: int,
    consumers: int | None,
    app: str | None,
    postgres: bool,
    locations: str | None,
    tls: bool,
    auth: bool,
    timeout: float,
) -> None:
    """Start etcd and brokers (and PostgreSQL, and consumer processes of an application), wait
    until all are ready, and print BROKER_ADDRESS, BROKER_FILE_ROOT (the file:// fragment
    stores' root), CONSUMER_ADDRESS and POSTGRES_DSN to export: stdout holds those exports
    alone (the processes' table goes to stderr), so `eval "$(gazctl dev up)"` sets them.

    On a cluster some of whose processes died (or were stopped by `dev kill`), start only
    those, on their ports, ids and folders, and leave the others running; a flag that differs
    from the running cluster's (--brokers 5 for a cluster of 3) is refused: `dev down` first.

    Consumers run with CONSUMER_STORE_ROOT (a folder for JSON-file stores) and POSTGRES_DSN in
    their environment, under the etcd prefix /gazette/consumers/NAME. `--app stream-sum` also
    runs the example's `setup` (its chunk and sum journals, and a shard per chunk journal) and
    waits until every shard has a primary. Started again on the same folder, the cluster keeps
    its data and its addresses (each port that is still free), so exported variables keep
    working.

    With --locations, each location runs in a broker cluster of its own with its process
    (`python -m replication serve`), registered under /gazette/replication: connect them with
    `gazctl replication connect`.

    With --tls, etcd, brokers and consumers serve TLS and require client certificates, all
    from a throwaway CA in <dir>/tls; with --auth they verify tokens signed with <dir>/auth-key.
    The printed exports (BROKER_CERT_FILE, BROKER_AUTH_KEYS, ...) make gazctl their client."""
    if consumers is not None and app is None:
        raise click.UsageError("--consumers needs --app: the application they run")
    if app is not None:
        check_app(app, postgres)
    names = location_names(locations) if locations else []
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    existing = ClusterState.load(root)
    if existing is not None and any(is_running(p) for p in existing.all()):
        requested = {
            "brokers": brokers, "consumers": consumers, "app": app, "postgres": postgres,
            "locations": names, "tls": tls, "auth": auth,
        }  # fmt: skip
        ctx = click.get_current_context()
        given = {
            k: v
            for k, v in requested.items()
            if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT
        }
        resume(existing, given, directory, timeout)
        return
    if existing is not None:
        # Stale state from a crash or a reboot: none of its processes runs.
        (root / STATE).unlink(missing_ok=True)
        click.echo(f"cleaned stale dev cluster state in {root}", err=True)
    consumers = consumers or (2 if app is not None else 0)
    state = start_cluster(root, brokers, consumers, app, postgres, names, tls, auth, timeout)
    print_status(state, err_console)
    print_exports(state)


def start_cluster(
    root: Path,
    brokers: int,
    consumers: int,
    app: str | None,
    postgres: bool,
    names: list[str],
    tls: bool,
    auth: bool,
    timeout: float,
) -> ClusterState:
    """A new cluster in `root`, every process ready; on failure, every process it started is
    stopped and no state is left."""
    try:
        etcd_binary = find_etcd_binary()
    except EtcdNotFound as exc:
        raise click.ClickException(str(exc)) from None
    ports, moved = choose_ports(Ports.load(root), brokers, consumers, postgres, names)
    for line in moved:
        click.echo(line, err=True)
    ports.save(root)
    security = DevSecurity.make(root, tls, auth)
    security.apply()
    etcd_log = root / "etcd.log"
    etcd_endpoint = f"{security.scheme}://127.0.0.1:{ports.etcd_client}"
    etcd_cmd = etcd_command(
        etcd_binary, root / "etcd-data", ports.etcd_client, ports.etcd_peer, security.pki
    )
    etcd = Proc("etcd", 0, etcd_endpoint, str(etcd_log), str(root / "etcd-data"), etcd_cmd)
    state = ClusterState(dir=str(root), etcd=etcd, tls=tls, auth=auth)
    try:
        etcd_popen = launch(etcd)
        state.save()
        wait_started(state, "etcd", [etcd], [etcd_popen], timeout)
        asyncio.run(revoke_stale_members(etcd_endpoint))
        file_root = root / "fragments"
        file_root.mkdir(exist_ok=True)
        popens = []
        for i, port in enumerate(ports.brokers):
            cmd = broker_command(i, port, etcd_endpoint, file_root, security=security)
            broker = Proc(
                f"broker-{i}",
                0,
                f"{security.scheme}://127.0.0.1:{port}",
                str(root / f"broker-{i}.log"),
                f"--broker.file-root {file_root}",
                cmd,
                lease_key=aks.member_key(ETCD_PREFIX, "local", f"broker-{i}"),
            )
            popens.append(launch(broker))
            state.brokers.append(broker)
            state.save()
        wait_started(state, "brokers", state.brokers, popens, timeout)
        dsn = start_postgres(root, ports.postgres, state, timeout) if postgres else None
        if app is not None:
            start_consumers(root, app, ports, dsn, state, timeout, security)
        if names:
            start_locations(root, names, ports, etcd_endpoint, state, timeout, security)
    except BaseException:
        for proc in state.all():
            stop_pid(proc)
        (root / STATE).unlink(missing_ok=True)
        raise
    return state


def start_consumers(
    root: Path,
    app: str,
    ports: Ports,
    dsn: str | None,
    state: ClusterState,
    timeout: float,
    security: DevSecurity,
) -> None:
    """The application's consumer processes, until each answers; for stream-sum, its setup."""
    stores = root / "stores"
    stores.mkdir(exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)  # Replicas' local directories (recovery logs).
    env = {
        "CONSUMER_STORE_ROOT": str(stores),
        "TMPDIR": str(root / "tmp"),
        **({"POSTGRES_DSN": dsn} if dsn else {}),
    }
    etcd = state.etcd.address
    prefix = f"/gazette/consumers/{app_name(app)}"
    state.app = app
    popens = []
    for i, port in enumerate(ports.consumers):
        cmd = consumer_command(app, i, port, etcd, brokers_address(state), stores, dsn, security)
        consumer = Proc(
            f"consumer-{i}",
            0,
            f"{security.scheme}://127.0.0.1:{port}",
            str(root / f"consumer-{i}.log"),
            f"--consumer.id consumer-{i} --consumer.port {port}",
            cmd,
            env,
            aks.member_key(prefix, "local", f"consumer-{i}"),
        )
        popens.append(launch(consumer))
        state.consumers.append(consumer)
        state.save()
    wait_started(state, "consumers", state.consumers, popens, timeout)
    if app == "stream-sum":
        setup_stream_sum(state, timeout)


def setup_stream_sum(state: ClusterState, timeout: float) -> None:
    """The example's own `setup` with its defaults, as a user runs it; then until every shard
    has a primary and every journal a primary broker, so the chunker can run at once."""
    cmd = [
        sys.executable, "-m", EXAMPLES["stream-sum"], "setup",
        "--broker.address", brokers_address(state),
        "--consumer.address", state.consumers[0].address,
        # Two replicas where there are two brokers: a broker killed to try failover loses
        # no chunks (with one, those not yet persisted are gone, and their sums never come).
        "--replication", str(min(2, len(state.brokers))),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"stream-sum setup did not finish in {timeout:g}s") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise click.ClickException(f"stream-sum setup failed: {lines[-1]}")
    asyncio.run(wait_journals_assigned(state, timeout))
    asyncio.run(wait_shards_primary(state, timeout))
    click.echo(
        "stream-sum: its journals and shards are set up; run "
        "`python -m consumer.examples.stream_sum chunker --broker.address $BROKER_ADDRESS`",
        err=True,
    )


async def wait_journals_assigned(state: ClusterState, timeout: float) -> None:
    """Until every journal of the cluster has as many replicas as the allocator gives it (its
    replication, or as many as there are brokers), a primary among them: then appends do not
    wait for assignment. A suspended journal is ready with fewer: PARTIAL, with its one replica
    (the exit flush of the last broker stopped gracefully leaves each journal so, until the
    next append resumes it); FULL, with none."""

    def waiting(listed: ListSnapshot) -> list[str]:
        pending = []
        for j in listed.journals:
            want = min(desired_replication(j.spec), len(state.brokers))
            if want and (j.route.primary < 0 or len(j.route.members) < want):
                pending.append(f"journal {j.spec.name}")
        return pending

    async with JournalsClient(state.brokers[0].address, timeout=5.0) as journals:
        await wait_until_none(lambda: journals.list(), waiting, timeout, state.brokers[0].log)


async def wait_shards_primary(state: ClusterState, timeout: float) -> None:
    """Until every shard of the application has a primary."""
    from consumer.client import ShardsClient
    from consumer.protocol import cpb

    def waiting(listed: cpb.ListResponse) -> list[str]:
        return [
            f"shard {s.spec.id}"
            for s in listed.shards
            if s.route.primary < 0 or s.status[s.route.primary].code != cpb.ReplicaStatus.PRIMARY
        ]

    async with ShardsClient(state.consumers[0].address, timeout=5.0) as shards:
        await wait_until_none(lambda: shards.list(), waiting, timeout, state.consumers[0].log)


async def wait_until_none(
    list_: Callable[[], Awaitable[T]], waiting: Callable[[T], list[str]], timeout: float, log: str
) -> None:
    """Until `waiting` finds nothing in what `list_` answers, or one line naming what waits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pending = waiting(await list_())
        except BrokerUnavailable as exc:  # ConsumerUnavailable is one.
            pending = [str(exc)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"{pending[0]} not ready after {timeout:g}s ({len(pending)} waiting); see {log}"
            )
        await asyncio.sleep(0.1)


def launch(proc: Proc) -> subprocess.Popen[bytes]:
    """Start `proc` from its recorded command (etcd without the clients' ETCD_* variables),
    appending to its log, and record its new pid."""
    if proc.role == "etcd":
        popen = spawn(proc.cmd, Path(proc.log), environment=etcd_environment())
    else:
        popen = spawn(proc.cmd, Path(proc.log), proc.env)
    proc.pid = popen.pid
    return popen


def wait_started(
    state: ClusterState,
    kind: str,
    procs: list[Proc],
    popens: list[subprocess.Popen[bytes]],
    timeout: float,
) -> None:
    """Until each of `procs`, of one kind of `ClusterState.groups`, is ready, or one line
    saying which is not."""
    security = DevSecurity.make(Path(state.dir), state.tls, state.auth)
    if kind == "etcd":
        log = state.etcd.log
        try:
            wait_etcd_healthy(state.etcd.address, timeout=timeout, proc=popens[0], tls=security.pki)
        except (RuntimeError, TimeoutError) as exc:
            raise click.ClickException(
                f"etcd did not start: {exc}; see {log}:\n{tail(log)}"
            ) from None
    elif kind == "postgres":
        from consumer import local_postgres

        pg, port = procs[0], urlsplit(procs[0].address).port or 0
        try:
            local_postgres.wait_postgres_ready(
                popens[0], Path(pg.marker).parent, port, Path(pg.log), timeout
            )
        except (RuntimeError, TimeoutError) as exc:
            raise click.ClickException(f"PostgreSQL did not start: {exc}; see {pg.log}") from None
    elif kind == "locations":
        asyncio.run(wait_locations(procs, popens, timeout))
    else:
        asyncio.run(wait_ready(procs, popens, timeout, consumers=kind == "consumers"))


async def revoke_leases(etcd_endpoint: str, keys: Sequence[str]) -> None:
    """Revoke the lease holding each of `keys` (each a member key of a process that is down),
    so that the process started in its place announces itself at once."""
    from plumbing import etcd as etcdx

    client = etcdx.connect(etcd_endpoint)
    try:
        for key in keys:
            for kv in await client.get_prefix(key.encode()):
                if kv.key == key.encode() and kv.lease:
                    with contextlib.suppress(Exception):  # Expired meanwhile.
                        await client.revoke_lease(kv.lease)
    finally:
        await client.close()


def start_again(state: ClusterState, procs: Sequence[Proc], timeout: float) -> None:
    """Start each of `procs` (all down) as `up` first did, on the same ports, ids and folders:
    kind by kind in start order, each kind ready before the next starts."""
    unrecorded = [p.role for p in state.all() if not p.cmd]
    if unrecorded:
        raise click.ClickException(
            f"the dev cluster in {state.dir} was started by an older gazctl, which did not "
            f"record how to start {unrecorded[0]}: `gazctl dev down` it and `up` again"
        )
    DevSecurity.make(Path(state.dir), state.tls, state.auth).apply()
    wanted = {id(p) for p in procs}
    for kind, group in state.groups():
        starting = [p for p in group if id(p) in wanted]
        if not starting:
            continue
        if kind != "etcd":
            if not is_running(state.etcd):
                raise click.ClickException(
                    "etcd is down: `gazctl dev up` starts it, and every other process that is down"
                )
            keys = [p.lease_key for p in starting if p.lease_key]
            asyncio.run(revoke_leases(state.etcd.address, keys))
        popens = [launch(p) for p in starting]
        state.save()
        wait_started(state, kind, starting, popens, timeout)
        if kind == "brokers":  # Ready once the journals have their replicas again.
            asyncio.run(wait_journals_assigned(state, timeout))


FLAGS = {"postgres", "tls", "auth"}


def as_flag(name: str, value: object) -> str:
    """How `up` would be given `value`: `--brokers 3`, `--tls`, `no --app`."""
    if name in FLAGS:
        return f"--{name}" if value else f"no --{name}"
    if value is None or value == []:
        return f"no --{name}"
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return f"--{name} {value}"


def resume(
    state: ClusterState, given: Mapping[str, object], directory: str, timeout: float
) -> None:
    """`up` on a cluster of which some processes run: the flags `given` must describe it;
    start those that are down, and leave the others running."""
    running = {
        "brokers": len(state.brokers),
        "consumers": len(state.consumers),
        "app": state.app or None,
        "postgres": state.postgres is not None,
        "locations": state.location_names(),
        "tls": state.tls,
        "auth": state.auth,
    }
    differ = [name for name, value in given.items() if running[name] != value]
    if differ:
        have = ", ".join(as_flag(n, running[n]) for n in differ)
        want = ", ".join(as_flag(n, given[n]) for n in differ)
        raise click.ClickException(
            f"the dev cluster in {state.dir} runs with {have}, not {want}: stop it first "
            f"(`gazctl dev down --dir {directory}`), or leave the flag out to keep it as it is"
        )
    down = [p for p in state.start_order() if not is_running(p)]
    if not down:
        DevSecurity.make(Path(state.dir), state.tls, state.auth).apply()
        click.echo(f"a dev cluster is already running in {state.dir}:", err=True)
        print_status(state, err_console)
        print_exports(state)
        return
    start_again(state, down, timeout)
    others = len(state.all()) - len(down)
    click.echo(
        f"started {', '.join(p.role for p in down)}; {others} other"
        f"{' was' if others == 1 else 's were'} running",
        err=True,
    )
    print_status(state, err_console)
    print_exports(state)


@dev.command("down")
@dir_option
@click.option("--purge", is_flag=True, help="Also delete the folder (etcd data, fragments, logs)")
def down(directory: str, purge: bool) -> None:
    """Stop the dev cluster's processes by pid."""
    root = Path(directory).resolve()
    state = ClusterState.load(root)
    if state is None:
        click.echo(f"no dev cluster in {root}", err=True)
    else:
        stopped = sum(stop_pids(tier, say=True) for tier in state.tiers())
        (root / STATE).unlink(missing_ok=True)
        click.echo(f"stopped {stopped} process(es) of the dev cluster in {root}", err=True)
    if purge and root.exists():
        if (root / "postgres").is_symlink():
            shutil.rmtree((root / "postgres").resolve(), ignore_errors=True)
        shutil.rmtree(root)


@dev.command("status")
@dir_option
def status(directory: str) -> None:
    """Show the dev cluster's processes, each running, paused (`dev kill --signal STOP`) or
    down; exits 1 if one is down (`gazctl dev up` starts those)."""
    state = load_state(directory)
    print_status(state)
    if not all(is_running(p) for p in state.all()):
        sys.exit(1)


def load_state(directory: str) -> ClusterState:
    root = Path(directory).resolve()
    state = ClusterState.load(root)
    if state is None:
        raise click.ClickException(f"no dev cluster in {root}: start one with `gazctl dev up`")
    return state


def signal_named(ctx: click.Context, param: click.Parameter, value: str) -> signal.Signals:
    """`--signal`: by name (KILL, SIGKILL, kill) or number (9)."""
    text = value.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise click.BadParameter(
            f"{value!r} is not a signal (e.g. KILL, TERM, STOP, CONT, INT, HUP)"
        ) from None


@dev.command("kill")
@dir_option
@click.option(
    "--signal", "sig", default="KILL", show_default=True, callback=signal_named,
    help="The signal to send: KILL, TERM, STOP (pause), CONT (resume), INT, HUP, or a number",
)  # fmt: skip
@click.argument("name")
def kill(directory: str, sig: signal.Signals, name: str) -> None:
    """Send a signal to one process of the dev cluster: NAME as `dev status` shows it
    (etcd, broker-0, consumer-1, postgres, location-east, location-east-broker). After KILL,
    returns once the process is gone. `gazctl dev up` starts again whatever is down."""
    state = load_state(directory)
    proc = state.find(name)
    if not is_running(proc):
        raise click.ClickException(
            f"{name} is already down (pid {proc.pid}): `gazctl dev up` starts it again"
        )
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        raise click.ClickException(f"{name} exited (pid {proc.pid}) before the signal") from None
    if sig == signal.SIGKILL:
        deadline = time.monotonic() + 10
        while is_running(proc) and time.monotonic() < deadline:
            time.sleep(0.02)
    click.echo(f"sent {sig.name} to {name} (pid {proc.pid})", err=True)


@dev.command("restart")
@dir_option
@click.option(
    "--timeout", default=60.0, show_default=True,
    help="Seconds to wait for it to stop (then SIGKILL), and then to become ready",
)  # fmt: skip
@click.argument("name")
def restart(directory: str, timeout: float, name: str) -> None:
    """Stop one process of the dev cluster (SIGTERM, then SIGKILL after --timeout), and start
    it again as `up` did: its ports, id and folders; returns once it is ready. NAME as `dev
    status` shows it."""
    state = load_state(directory)
    proc = state.find(name)
    before = proc.pid
    stop_pid(proc, timeout, say=True)
    start_again(state, [proc], timeout)
    click.echo(f"restarted {name}: pid {before} -> {proc.pid}", err=True)
