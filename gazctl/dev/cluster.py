"""Starting a dev cluster: etcd, the brokers, PostgreSQL, the consumers (stream-sum's setup)
and the locations, each kind ready before the next; on failure every process started is
stopped. And starting again, as `up` first did, processes of a cluster that are down."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from allocator import keyspace as aks
from broker.client import JournalsClient
from broker.client.journals import ListSnapshot
from broker.resolver import desired_replication
from gazctl.dev.ports import Ports, choose_ports
from gazctl.dev.processes import (
    ETCD_PREFIX,
    EXAMPLES,
    LOCATION_STORE,
    app_name,
    broker_command,
    consumer_command,
)
from gazctl.dev.security import DevSecurity
from gazctl.dev.state import STATE, ClusterState, Proc, brokers_address
from gazctl.dev.supervisor import (
    is_running,
    launch,
    revoke_leases,
    revoke_stale_members,
    spawn,
    stop_pid,
    wait_locations,
    wait_ready,
    wait_started,
    wait_until_none,
)
from plumbing.local_etcd import EtcdNotFound, etcd_command, find_etcd_binary


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
