"""The stream source's planning processes (`gazctl.spark.planners`): scans run there plan what
the driver's own process plans; a refusal there is the same one line here; a process that dies
mid-call is named and replaced; and none outlives its driver, however the driver ends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from gazctl.spark import planners
from gazctl.spark.journals import JobError
from gazctl.spark.planners import Scanners
from gazctl.spark.stream_plan import Planner, Position, Scan, ScanJob, StreamOptions
from tests.helpers.spark_stream import TOPIC, broker_with, write_history
from tests.helpers.waiting import until

pytestmark = pytest.mark.slow


def summary(scan: Scan) -> tuple[Any, ...]:
    """A scan as values, comparable with ==."""
    plan = scan.plan
    assert plan is not None
    return (
        scan.journal, scan.through, scan.final, scan.events, plan.begins.tolist(),
        plan.ends.tolist(), plan.producers.tolist(), plan.ids, plan.clocks.tolist(),
        plan.flags.tolist(), plan.bad,
    )  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = (
        Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else ""
    )
    return state not in ("Z", "")  # (A zombie has exited.)


async def gone(pids: list[int], seconds: float = 30.0) -> None:
    await until(lambda: not any(alive(p) for p in pids), f"planning processes {pids} gone", seconds, 0.05)  # fmt: skip


async def test_scans_in_planning_processes_plan_what_the_driver_plans(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Transactions, an aborted one, duplicates of a retried append, bad frames: each journal
    scanned in a planning process, limited and exact, gives the scan the driver's own process
    gives; a refusal raised there (content gone, failOnDataLoss) is the same JobError here; and
    `close` stops the processes, each waited for by its pid."""
    monkeypatch.setattr(planners, "PARALLEL_PLANNING_BYTES", 0)
    root = tmp_path / "root"
    async with broker_with(etcd_server, etcd_prefix, root, TOPIC) as (address, stub):
        await write_history(stub)
        from broker.client.appender import append

        await append(stub, TOPIC[1], b'{"not json\n{"kind":"after"}\n')
        base = {"selector": "topic=stream", "broker": address, "framing": "lines",
                "file_root": str(root), "planningProcesses": "2"}  # fmt: skip
        for more in ({}, {"maxMessagesPerTrigger": "5"}):
            options = StreamOptions.parse({**base, **more})
            one = StreamOptions.parse({**base, **more, "planningProcesses": "1"})
            here, apart = Scanners(Planner(one)), Scanners(Planner(options))
            try:
                async with JournalsClient(address) as client:
                    jobs = [ScanJob(j, "lines", Position(0, 1), 0, True) for j in TOPIC]
                    local = await here.run(client, jobs, 1 << 30)
                    # Ranges planned again (exact), to a frame boundary halfway.
                    exact = [
                        ScanJob(s.journal, "lines", Position(0, 1),
                                int(s.plan.ends[len(s.plan) // 2]), True, exact=True)
                        for s in local
                        if s.plan is not None
                    ]  # fmt: skip
                    for batch in (jobs, exact):
                        local = await here.run(client, batch, 1 << 30)
                        remote = await apart.run(client, batch, 1 << 30)
                        assert not here.pids() and len(apart.pids()) == 2
                        assert [summary(s) for s in remote] == [summary(s) for s in local]
                        assert all(s.plan is not None and len(s.plan) for s in remote)
            finally:
                pids = apart.pids()
                apart.close()
                here.close()
            assert pids and not any(alive(p) for p in pids)

        # A refusal in a planning process: the journal deleted, its planned range gone.
        options = StreamOptions.parse(base)
        scanners = Scanners(Planner(options))
        try:
            async with JournalsClient(address) as client:
                await client.apply(
                    [pb.ApplyRequest.Change(delete=TOPIC[0], expect_mod_revision=-1)]
                )
                jobs = [ScanJob(j, "lines", Position(0, 1), 100, True, exact=True) for j in TOPIC]
                with pytest.raises(JobError) as caught:
                    await scanners.run(client, jobs, 1 << 30)
            assert TOPIC[0] in str(caught.value) and "failOnDataLoss=false" in str(caught.value)
            assert "\n" not in str(caught.value)
        finally:
            scanners.close()


async def test_a_planning_process_that_dies_mid_call_is_named_and_replaced(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(planners, "PARALLEL_PLANNING_BYTES", 0)
    root = tmp_path / "root"
    async with broker_with(etcd_server, etcd_prefix, root, TOPIC) as (address, stub):
        await write_history(stub)
        options = StreamOptions.parse({"selector": "topic=stream", "broker": address,
                                       "framing": "lines", "file_root": str(root),
                                       "planningProcesses": "2"})  # fmt: skip
        scanners = Scanners(Planner(options))
        jobs = [ScanJob(j, "lines", Position(0, 1), 0, True) for j in TOPIC]
        try:
            async with JournalsClient(address) as client:
                first = await scanners.run(client, jobs, 1 << 30)
                killed = scanners.pids()
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
                await gone(killed)
                with pytest.raises(JobError) as caught:
                    await scanners.run(client, jobs, 1 << 30)
                assert "a planning process (pid" in str(caught.value)
                assert "exited while planning journal" in str(caught.value)
                assert not set(scanners.pids()) & set(killed)  # Dropped, not reused.
                again = await scanners.run(client, jobs, 1 << 30)  # New ones start.
                assert [summary(s) for s in again] == [summary(s) for s in first]
        finally:
            scanners.close()


DRIVER = """
import asyncio, json, sys
from broker.client.journals import JournalsClient
from gazctl.spark import planners
from gazctl.spark.planners import Scanners
from gazctl.spark.stream_plan import Planner, Position, ScanJob, StreamOptions

planners.PARALLEL_PLANNING_BYTES = 0
options = StreamOptions.parse(json.loads(sys.argv[1]))
scanners = Scanners(Planner(options))

async def main():
    async with JournalsClient(options.broker) as client:
        jobs = [ScanJob(j, "lines", Position(0, 1), 0, True) for j in json.loads(sys.argv[2])]
        await scanners.run(client, jobs, 1 << 30)
    print(json.dumps(scanners.pids()), flush=True)
    sys.stdin.read()  # Until killed.

asyncio.run(main())
"""


async def test_planning_processes_die_with_a_driver_that_is_killed(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    async with broker_with(etcd_server, etcd_prefix, root, TOPIC) as (address, stub):
        await write_history(stub)
        options = {"selector": "topic=stream", "broker": address, "framing": "lines",
                   "file_root": str(root), "planningProcesses": "2"}  # fmt: skip
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(options), json.dumps(TOPIC)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert driver.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(driver.stdout.readline), 60)
            pids = json.loads(line)
            assert len(pids) == 2 and all(alive(p) for p in pids)
            driver.kill()  # SIGKILL: no close(), no atexit.
            driver.wait()
            await gone(pids)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
            for pipe in (driver.stdin, driver.stdout):
                if pipe is not None:
                    pipe.close()
