"""Processes by pid: starting them detached with their logs, telling whether each still runs
what we started (running, paused or down), stopping them (SIGTERM, then SIGKILL), waiting until
each kind answers, and revoking the etcd leases of members that are gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import click

from broker.client import BrokerUnavailable, JournalsClient
from gazctl.dev.security import DevSecurity
from gazctl.dev.state import ClusterState, Proc
from plumbing.local_etcd import etcd_environment, wait_etcd_healthy

T = TypeVar("T")


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


def launch(proc: Proc) -> subprocess.Popen[bytes]:
    """Start `proc` from its recorded command (etcd without the clients' ETCD_* variables),
    appending to its log, and record its new pid."""
    if proc.role == "etcd":
        popen = spawn(proc.cmd, Path(proc.log), environment=etcd_environment())
    else:
        popen = spawn(proc.cmd, Path(proc.log), proc.env)
    proc.pid = popen.pid
    return popen


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
