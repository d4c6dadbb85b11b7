"""The test kit (consumer.testing) as an application's test suite meets it: its plugin loads by
its entry point in a fresh pytest (strict asyncio mode, none of this suite's conftest), its
fixtures work there and stop every process they started; and its helpers fail with what went
wrong rather than hanging."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from broker.testing import BrokerHarness
from consumer.testing import (
    ConsumerGroup,
    apply_shards,
    create_journals,
    journal_spec,
    publish,
    read_committed_messages,
    shard_spec,
)
from consumer.transaction import Shard

ROOT = Path(__file__).resolve().parents[1]

# An application's test module, as its author writes it: no conftest, no settings.
APPLICATION_TESTS = """
import asyncio
import os
import uuid

import pytest

from consumer.testing import apply_shards, create_journals, journal_spec, publish, shard_spec
from consumer.testing import read_committed_messages
from tests.test_application_guide import WordTotals

PIDS = os.environ["PIDS_FILE"]


def record(*pids):
    with open(PIDS, "a") as out:
        out.writelines(f"{pid}\\n" for pid in pids)


@pytest.mark.asyncio
async def test_in_process(gazette_etcd, gazette_broker, gazette_consumers, tmp_path):
    record(gazette_etcd.proc.pid)
    consumer = await gazette_consumers.start(WordTotals(str(tmp_path)))
    await create_journals(gazette_broker.endpoint, [journal_spec("app/words"), journal_spec("app/totals")])
    spec = shard_spec("app-words", ["app/words"], labels=[("totals", "app/totals")])
    await apply_shards(consumer.endpoint, [spec])
    await publish(gazette_broker.endpoint, "app/words", [{"word": "a"}, {"word": "a"}])
    totals = await read_committed_messages(gazette_broker.endpoint, "app/totals", count=2)
    assert [t["total"] for t in totals] == [1, 2]


def test_as_processes(gazette_broker_process, gazette_consumer_processes, tmp_path):
    group = gazette_consumer_processes(
        app="tests.test_application_guide:WordTotals", env={"CONSUMER_STORE_ROOT": str(tmp_path)}
    )
    group.start("app-consumer")
    record(gazette_broker_process.proc.pid, group.procs["app-consumer"].pid)
    name, broker = f"app-{uuid.uuid4().hex[:6]}", gazette_broker_process.address
    asyncio.run(create_journals(broker, [journal_spec(f"{name}/words"), journal_spec(f"{name}/totals")]))
    spec = shard_spec(f"{name}-words", [f"{name}/words"], labels=[("totals", f"{name}/totals")])
    asyncio.run(apply_shards(group.address("app-consumer"), [spec]))
    asyncio.run(publish(broker, f"{name}/words", [{"word": "b"}] * 3, transaction=True))
    totals = asyncio.run(read_committed_messages(broker, f"{name}/totals", count=3))
    assert [t["total"] for t in totals] == [1, 2, 3]
"""


def test_the_plugin_is_installed_by_its_entry_point() -> None:
    entry = {e.name: e.value for e in importlib.metadata.entry_points(group="pytest11")}
    assert entry.get("gazette") == "consumer.testing.plugin"


def test_an_applications_suite_runs_on_the_fixtures_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_app.py").write_text(textwrap.dedent(APPLICATION_TESTS))
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIDS_FILE": str(pids)}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(suite), str(suite / "test_app.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert "2 passed" in ran.stdout
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 3  # etcd, the broker process, the consumer process.
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"left running: {alive}"


class FailsToOpenItsStore:
    async def new_store(self, shard: Shard) -> Any:
        raise ValueError(f"no store for {shard.spec.id}: the database is gone")

    async def consume_message(self, *args: Any) -> None:
        raise AssertionError("never called")

    async def finalize_txn(self, *args: Any) -> None:
        raise AssertionError("never called")


async def test_the_helpers_fail_with_what_went_wrong(
    gazette_broker: BrokerHarness, gazette_consumers: ConsumerGroup
) -> None:
    address = gazette_broker.endpoint
    # Two replicas wanted, one broker: the journal is named, not waited for forever.
    with pytest.raises(TimeoutError, match=r"'kit/replicated'"):
        await create_journals(address, [journal_spec("kit/replicated", replication=2)], timeout=1)

    await create_journals(address, [journal_spec("kit/input")])
    await publish(address, "kit/input", [{"n": 1}, {"n": 2}])
    assert await read_committed_messages(address, "kit/input") == [{"n": 1}, {"n": 2}]
    with pytest.raises(TimeoutError, match=r"kit/input: 2 committed message\(s\) after 1s"):
        await read_committed_messages(address, "kit/input", count=3, timeout=1)

    consumer = await gazette_consumers.start(FailsToOpenItsStore())
    with pytest.raises(RuntimeError, match=r"shard kit-failing FAILED: .*the database is gone"):
        await apply_shards(consumer.endpoint, [shard_spec("kit-failing", ["kit/input"])])
