"""location_takeover: SIGKILL the location host running a location's primary; seconds until the
location's hot standby, promoted on another host, has written its first event (an Emit through
the registry's new endpoint is acknowledged). Baseline in the same run: kill -> the dead host's
lease expiry (its member key deleted), the floor no take-over can beat.

One `gazette serve`, two location hosts (`python -m replication host`, `--etcd.lease`), one
location added with `gazctl replication add` (a hot standby). Before each kill the location's
log grows by `events` events, so the take-over shows what the standby's fold saves: its primary
folds only what was appended since the standby last folded. Each round kills the current
primary's host and starts it again after."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aetcd

from benchmarks._cluster import start_broker, stop_brokers, wait_ready
from benchmarks.shard_failover import _expired, summary
from broker.testing import EtcdServer, stop_process
from replication import registry
from replication.host import add_location, hosts_prefix
from replication.journals import location_journal_spec
from replication.rpc import LocationClient, LocationError

PREFIX = "/bench/replication"
LOCATION = "A"


def _start_host(host_id: str, etcd: EtcdServer, broker: str, lease: int, root: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    with open(root / f"{host_id}.log", "ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "replication", "host", "--consumer.id", host_id,
                "--consumer.port", "0", "--broker.address", broker,
                "--etcd.address", etcd.endpoint, "--etcd.lease", f"{lease}s",
                "--replication.prefix", PREFIX, "--replication.lease", f"{lease}s",
                "--log.level", "warn",
            ],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


async def _served(etcd: aetcd.Client, not_pid: int = 0, timeout: float = 120) -> registry.LocationEntry:  # fmt: skip
    """The location's entry once a process other than `not_pid` serves it."""
    deadline = time.monotonic() + timeout
    while True:
        entry = (await registry.lookup(etcd, PREFIX, LOCATION))[0]
        if entry.endpoint and entry.pid not in (0, not_pid):
            return entry
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process serves {LOCATION}")
        await asyncio.sleep(0.01)


async def _emit_through(etcd: aetcd.Client, victim: int) -> None:
    """Until an Emit at the location is acknowledged by a process other than `victim`."""
    while True:
        entry = await _served(etcd, victim)
        try:
            async with LocationClient(LOCATION, entry.endpoint, timeout=5) as client:
                await client.emit({"after": "kill"})
            return
        except LocationError:
            await asyncio.sleep(0.01)  # Its server is up, its writer not yet: ask again.


async def measure(kills: int, lease: int, events: int) -> dict[str, Any]:
    times: list[float] = []
    expiries: list[float] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        root = Path(tmp)
        broker = start_broker(etcd, "broker-0", root / "broker.log")
        hosts: dict[str, subprocess.Popen[bytes]] = {}
        client = aetcd.Client(host=etcd.host, port=etcd.client_port)
        try:
            await wait_ready([broker])
            await client.connect()
            spec = location_journal_spec(LOCATION)
            from broker.client import JournalsClient
            from broker.protocol import protocol_pb2 as pb

            async with JournalsClient(broker.address) as journals:
                await journals.apply([pb.ApplyRequest.Change(upsert=spec)])
            await add_location(client, PREFIX, LOCATION, broker.address, spec, standbys=1)
            for i in range(2):
                hosts[f"host-{i}"] = _start_host(f"host-{i}", etcd, broker.address, lease, root)
            for round_ in range(kills):
                entry = await _served(client)
                async with LocationClient(LOCATION, entry.endpoint) as location:
                    for start in range(0, events, 500):
                        await location.emit(*({"round": round_, "i": i} for i in range(start, min(events, start + 500))))  # fmt: skip
                await asyncio.sleep(1.0)  # The standby folds what was appended (every 0.25 s).
                victim = next(h for h, p in hosts.items() if p.pid == entry.pid)
                member = f"{hosts_prefix(PREFIX)}/members/local#{victim}".encode()
                killed = time.monotonic()
                os.kill(hosts[victim].pid, signal.SIGKILL)
                hosts[victim].wait()
                expiry = asyncio.ensure_future(_expired(client, member))
                await _emit_through(client, entry.pid)
                times.append(time.monotonic() - killed)
                expiries.append(await expiry - killed)
                hosts[victim] = _start_host(victim, etcd, broker.address, lease, root)
                await asyncio.sleep(lease)  # It comes back as the standby.
            cold, folded_bytes = await _cold_fold(broker.address)
        finally:
            await client.close()
            for proc in hosts.values():
                stop_process(proc)
            stop_brokers([broker])
    return {"times": times, "expiries": expiries, "cold_fold": [cold], "log_bytes": [folded_bytes]}


async def _cold_fold(broker: str) -> tuple[float, int]:
    """Seconds to fold the whole log from its beginning: what a take-over without a hot standby
    would pay before its first event (the standby's primary folds only the last moment's)."""
    from broker.client import JournalsClient
    from replication.journal_log import JournalEventLog
    from replication.journals import location_journal

    async with JournalsClient(broker) as journals:
        log = JournalEventLog(LOCATION, location_journal(LOCATION), lambda: journals.stub, None, 0)
        started = time.monotonic()
        await log.fold()
        return time.monotonic() - started, log.folded_to


def run(quick: bool = False, kills: int | None = None, lease: int = 5, events: int | None = None) -> dict[str, Any]:  # fmt: skip
    kills = kills if kills is not None else (1 if quick else 3)
    lease = 2 if quick else lease
    events = events if events is not None else (200 if quick else 20_000)
    measured = asyncio.run(measure(kills, lease, events))
    result = summary(measured, lease, kills)
    return result | {
        "events_before_each_kill": events,
        "cold_fold_s": round(measured["cold_fold"][0], 2),
        "log_mb": round(measured["log_bytes"][0] / 1e6, 1),
    }


if __name__ == "__main__":
    print(run())
