"""Location processes (`python -m replication serve`) for tests: started on a real broker process
and etcd, each stopped by its pid; `gazctl replication` run against their registry (a refused
command's one line). Then what the tests read of them (events' ids, their causal order, a
location's log lost on purpose) and an in-process location server (`serving`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer, stop_process
from gazctl.replication import Network
from replication.journals import apply_location_journals
from replication.process import LocationConfig, LocationProcess
from replication.rpc import (
    LocationClient,
    status_document,
)
from replication.vclock import VectorClock
from tests.conftest import BrokerProcess, Result, run_cli, start_broker_process
from tests.helpers.journals import routed
from tests.helpers.server_fork import ForkedPopen
from tests.helpers.waiting import until, until_blocking

T = TypeVar("T")


class LocationProcesses:
    """Location processes by name, stopped by pid; `gazctl` runs against their registry."""

    def __init__(self, etcd: EtcdServer, prefix: str, logs: Path) -> None:
        self.etcd, self.prefix, self.logs = etcd, prefix, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.brokers: dict[str, str] = {}

    def start(
        self, name: str, broker: str, *, wait: bool = True, batch: int = 1000, key: str = ""
    ) -> None:
        """Start location `name`'s process, known here as `key` (default: the name)."""
        key = key or name
        self.brokers[key] = broker
        log = self.logs / f"{key}.log"
        before = log.read_text().count("serving at") if log.exists() else 0
        with log.open("ab") as out:
            self.procs[key] = ForkedPopen(
                [
                    sys.executable, "-m", "replication", "serve", "--location", name,
                    "--broker.address", broker, "--etcd.address", self.etcd.endpoint,
                    "--replication.prefix", self.prefix, "--etcd.lease", "2s",
                    "--replication.batch", str(batch),
                ],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if wait:
            self.wait_ready(key, before)

    def start_host(self, key: str, broker: str, *, lease: str = "2s") -> None:
        """Start a location host (`python -m replication host`), known here as `key`: it runs
        the locations `gazctl replication add` declared, and standbys of them."""
        log = self.logs / f"{key}.log"
        with log.open("ab") as out:
            self.procs[key] = ForkedPopen(
                [
                    sys.executable, "-m", "replication", "host", "--consumer.id", key,
                    "--consumer.port", "0", "--broker.address", broker,
                    "--etcd.address", self.etcd.endpoint, "--etcd.lease", lease,
                    "--replication.prefix", self.prefix, "--replication.lease", "2s",
                ],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def serving() -> bool:
            proc = self.procs[key]
            if proc.poll() is not None:
                raise RuntimeError(f"host {key} exited {proc.returncode}: {self.log(key)[-2000:]}")  # fmt: skip
            return f"consumer local/{key} serving at" in self.log(key)

        until_blocking(serving, f"host {key} started", 30, 0.05)

    def served_by(self, name: str) -> int:
        """The pid of the process that serves location `name` now (0: none)."""

        async def go() -> int:
            network = Network({"replication_prefix": self.prefix, "etcd_address": self.etcd.endpoint})  # fmt: skip
            async with network:
                return (await network.entries(name))[0].pid

        return asyncio.run(go())

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def endpoint(self, key: str) -> str:
        """The endpoint the process last announced."""
        return self.log(key).rsplit("serving at ", 1)[1].split()[0]

    def wait_ready(self, name: str, before: int = 0) -> None:
        """Until the process announces it serves (a start after `before` announcements)."""

        def announced() -> bool:
            if self.log(name).count("serving at") > before:
                return True
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"location {name} exited {proc.returncode}: {self.log(name)[-2000:]}")  # fmt: skip
            return False

        until_blocking(announced, f"location {name} ready", interval=0.05)

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def stop(self, name: str) -> int:
        return stop_process(self.procs[name])

    def stop_all(self) -> list[int]:
        return [stop_process(p) for p in self.procs.values()]

    def gazctl(self, *args: str) -> Result:
        return run_cli(
            "gazctl", "replication", *args,
            "--etcd.address", self.etcd.endpoint, "--replication.prefix", self.prefix,
        )  # fmt: skip

    def ok(self, *args: str) -> str:
        result = self.gazctl(*args)
        assert result.code == 0, (args, result.err)
        return result.out

    def ask(self, name: str, call: Callable[[LocationClient], Awaitable[T]]) -> T:
        """`call` made with the client of location `name`, found through the registry, in this
        process, as `gazctl replication` makes it (polls use this: a gazctl process per poll
        costs half a second of CPU, which a parallel suite pays many times over)."""

        async def go() -> T:
            network = Network({"replication_prefix": self.prefix, "etcd_address": self.etcd.endpoint})  # fmt: skip
            async with network:
                return await network.ask(name, call)

        return asyncio.run(go())

    def status(self, name: str) -> dict[str, Any]:
        """`gazctl replication status NAME --format json`'s document, read in this process."""
        return status_document(self.ask(name, lambda c: c.status()))

    def events(self, name: str) -> list[dict[str, Any]]:
        """`gazctl replication events NAME`'s lines, read in this process."""
        reply = self.ask(name, lambda c: c.read(0, 1000))
        return [json.loads(line) for line in reply.records.decode().splitlines()]


@pytest.fixture
def location_broker(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[BrokerProcess]:

    broker = start_broker_process(
        etcd_server, f"/gazette-test/{uuid.uuid4().hex[:12]}", tmp_path / "broker.log"
    )
    try:
        yield broker
    finally:
        stop_process(broker.proc)


@pytest.fixture
def locations(etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path) -> Iterator[LocationProcesses]:  # fmt: skip
    processes = LocationProcesses(etcd_server, etcd_prefix + "/replication", tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


def ids(events: list[dict[str, Any]], *, system: bool = False) -> list[tuple[str, int]]:
    """The ids (emitter, its own time) of the events, application events only by default."""
    return [
        (e["emitter"], e["ts"][e["emitter"]])
        for e in events
        if system or "system" not in e["payload"]
    ]


def assert_causal_order(events: list[dict[str, Any]]) -> None:
    """No event is stored before one in its causal past, and none twice."""
    clocks = [VectorClock.from_json(e["ts"]) for e in events]
    for (i, x), (j, y) in itertools.combinations(enumerate(clocks), 2):
        assert not y < x, (events[i], events[j])
    assert len(set(ids(events, system=True))) == len(events)


def refused(locations: LocationProcesses, *args: str) -> str:
    """The one line of a refused command (exit 1, no traceback)."""
    result = locations.gazctl(*args)
    assert result.code == 1, (args, result.out, result.err)
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    return lines[0]


async def _lose_log(broker: BrokerProcess, name: str) -> None:
    """A disaster: the location's journal is deleted, with all its content, and made anew."""
    from broker.client import JournalsClient
    from broker.protocol import protocol_pb2 as pb

    stopping = f"stopping local replica of replication/{name}"
    before = broker.log.read_text(errors="replace").count(stopping)
    async with JournalsClient(broker.address) as client:
        await client.apply([pb.ApplyRequest.Change(delete=f"replication/{name}", expect_mod_revision=-1)])  # fmt: skip
    # The replica goes, and its spool with it, before the journal is made anew.
    await until(
        lambda: broker.log.read_text(errors="replace").count(stopping) > before,
        f"the broker stopped its replica of replication/{name}",
    )
    await apply_location_journals(broker.address, name)


def _all_events(locations: LocationProcesses, name: str) -> list[dict[str, Any]]:
    """Every event of a location's log, read page by page."""
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        reply = locations.ask(name, lambda c, a=after: c.read(a, 1000))  # type: ignore[misc]
        out += [json.loads(line) for line in reply.records.decode().splitlines()]
        if reply.through <= after or reply.through >= reply.last_seq:
            return out
        after = reply.through


async def logs(broker: BrokerHarness, *names: str) -> dict[str, str]:
    journals = {n: f"replication/test/{n}" for n in names}
    async with broker.client() as client:
        specs = []
        for journal in journals.values():
            spec = pb.JournalSpec(name=journal, replication=1)
            spec.fragment.length = 1 << 20
            spec.fragment.compression_codec = pb.NONE
            spec.fragment.refresh_interval.seconds = 60
            spec.labels.labels.add(name="content-type", value="application/x-ndjson")
            specs.append(spec)
        await client.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
        for journal in journals.values():
            await routed(client, journal, 1)
    return journals


@contextlib.asynccontextmanager
async def serving(config: LocationConfig) -> AsyncIterator[LocationProcess]:
    server = LocationProcess(config)
    stop, ready = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        task = tasks.create_task(server.run(stop, ready))
        waiting = asyncio.ensure_future(ready.wait())
        await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        try:
            yield server
        finally:
            stop.set()
