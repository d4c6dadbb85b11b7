"""The spark-stream fault scenario: exactly-once through Spark Structured Streaming, end to end.

A publisher writes transactions into a topic of three journals (committed ones, aborted ones,
single committed messages, and raw re-appends of recent bytes: duplicates) on a dev cluster of
three brokers, while `spark_stream_driver` runs two queries from that topic: into Parquet, and
into another topic by a key. Every batch's tasks fail once and are tried again. The driver is
SIGKILLed mid-batch twice (its process group: Python, JVM and workers) and started again from its
checkpoints; the primary broker of a source journal is SIGKILLed and started again. Then the
publisher stops and the driver drains with `--once`.

Checked: the Parquet table (the files Spark's `_spark_metadata` log names) holds exactly the
messages a read-committed reader of the topic gets, each once, none aborted; and a read-committed
reader of the output topic gets each of those messages once.

    python -m tests.faults.spark_stream [--runs 5] [--seed N] [--workdir DIR] [-v]

Its runs go through the campaigns' runner (`tests/faults/runner.py`): each in a fresh `run-N`
directory, a failing one (or one that raised) named with its files and the command replaying it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.client.reader import read_retrying
from broker.protocol import protocol_pb2 as pb
from gazctl.dev import ClusterState, is_running
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import Publisher, Reader, read_committed
from message.types import DictMessages
from tests.faults.runner import Runner, configure_logging, dump_tasks_on_sigusr1, pick_seed
from tests.helpers.waiting import until

SOURCES = [f"fs/part-{i:03d}" for i in range(3)]
TARGETS = [f"fsout/part-{i:03d}" for i in range(2)]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    seed: int
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    published: Counter[str] = field(default_factory=Counter)
    committed: int = 0
    batches: int = 0
    driver_kills: int = 0
    broker_kills: int = 0
    retried_tasks: int = 0
    seconds: float = 0.0

    def fail(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)

    def summary(self) -> str:
        head = "ok" if self.ok else "FAILED"
        return (
            f"spark-stream seed {self.seed}: {head} in {self.seconds:.0f}s; published "
            f"{dict(self.published)}; {self.committed} committed messages; {self.batches} "
            f"batches; driver SIGKILLed {self.driver_kills}x, a primary broker "
            f"{self.broker_kills}x; {self.retried_tasks} task attempts failed and retried"
            + "".join(f"\n  - {p}" for p in self.problems)
        )


def spec(name: str, topic: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=2)
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    out.labels.labels.add(name="topic", value=topic)
    out.fragment.length = 1 << 16
    out.fragment.compression_codec = pb.GZIP
    out.fragment.stores.append("file:///fs/")
    out.fragment.refresh_interval.seconds = 1
    return out


def gazctl(
    *args: str, env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gazctl.cli", *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


class Driver:
    """The fault driver's process group: started, SIGKILLed whole, or run to its end."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, once: bool = False) -> subprocess.Popen[bytes]:
        self.starts += 1
        log = open(self.work / f"driver-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.spark_stream_driver", "--work", str(self.work),
             *(["--once"] if once else [])],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        log.close()
        return self.proc

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # Python, its JVM, its workers.
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


def batches_of(checkpoint: Path, log: str) -> set[int]:
    folder = checkpoint / log
    if not folder.is_dir():
        return set()
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()}


def in_flight(work: Path) -> bool:
    """Whether a batch of either query is planned (in the offset log) and not committed."""
    for name in ("ckpt-parquet", "ckpt-topic"):
        checkpoint = work / name
        if batches_of(checkpoint, "offsets") - batches_of(checkpoint, "commits"):
            return True
    return False


async def publish(address: str, rng: random.Random, stop: asyncio.Event, outcome: Outcome) -> None:
    """Transactions into the topic until `stop`: committed, aborted, single committed messages,
    and re-appends of a journal's recent bytes (every message in them a duplicate)."""
    partitions = [Partition(j, "application/x-ndjson") for j in SOURCES]
    mapping = modulo_mapping(lambda m: str(m["key"]).encode(), lambda: partitions)
    n = 0
    async with JournalsClient(address) as client, AppendService(client.stub) as service:
        while not stop.is_set():
            action = rng.choices(["txn", "abort", "single", "again"], [5, 2, 2, 1])[0]
            publisher = Publisher(service, DictMessages(), JSONLines())
            if action in ("txn", "abort"):
                for _ in range(rng.randint(1, 12)):
                    n += 1
                    doc = {"key": rng.randrange(1000), "kind": action, "n": n}
                    await publisher.publish_uncommitted(mapping, doc)
                await (publisher.commit() if action == "txn" else publisher.abort())
            elif action == "single":
                n += 1
                await publisher.publish_committed(mapping, {"key": rng.randrange(1000), "kind": "single", "n": n})  # fmt: skip
            else:
                await service.flush()
                journal = rng.choice(SOURCES)
                chunks = read_retrying(lambda: client.stub, journal, 0, block=False)
                content = b"".join([c.content async for c in chunks])
                piece = content[max(0, len(content) - rng.randint(200, 3000)) :]
                piece = piece[piece.find(b"\n") + 1 :] if b"\n" in piece else b""
                if piece:  # Raw, through the service: it retries through broker failures.
                    await (await service.write(journal, piece))
            outcome.published[action] += 1
            await asyncio.sleep(rng.uniform(0.02, 0.2))
        await service.flush()


async def committed(address: str, journals: list[str]) -> list[tuple[str, int, dict[str, Any]]]:
    reader = Reader(DictMessages(), JSONLines())
    out = []
    async with JournalsClient(address) as client:
        for journal in journals:
            async for env in read_committed(client.stub, journal, reader):
                if not env.is_ack:
                    out.append((journal, env.begin, env.message))
    return out


def table_rows(table: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """The rows of the Parquet table as Spark defines it: the files its `_spark_metadata` log
    adds (files of killed batches that the log never named are not the table's)."""
    import pyarrow.parquet as pq

    files: set[str] = set()
    for entry in sorted((table / "_spark_metadata").iterdir()):
        if entry.name.startswith("."):
            continue
        for line in entry.read_text().splitlines()[1:]:
            found = json.loads(line)
            if found.get("action", "add") == "add":
                files.add(found["path"].removeprefix("file://"))
    rows = []
    for path in sorted(files):
        for row in pq.read_table(path).to_pylist():
            rows.append((row["journal"], row["offset"], json.loads(row["content"])))
    return rows


def body(doc: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in doc.items() if k != "_meta"}, sort_keys=True)


async def run_once(seed: int, work: Path) -> Outcome:
    outcome = Outcome(seed)
    started = time.monotonic()
    rng = random.Random(seed)
    cluster = work / "cluster"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = gazctl("dev", "up", "--brokers", "3", "--dir", str(cluster), env=env)
    if up.returncode != 0:
        outcome.fail(f"gazctl dev up: {up.stderr.strip()[-500:]}")
        return outcome
    for line in up.stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value.strip("'\"")
    address = env["BROKER_ADDRESS"]
    driver = Driver(work, env)
    stop = asyncio.Event()
    try:
        (Path(env["BROKER_FILE_ROOT"]) / "fs").mkdir(parents=True, exist_ok=True)
        async with JournalsClient(address) as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=spec(j, "fs")) for j in SOURCES]
                + [pb.ApplyRequest.Change(upsert=spec(j, "fsout")) for j in TARGETS]
            )
        publisher = asyncio.ensure_future(publish(address, rng, stop, outcome))
        try:
            driver.start()
            await until(lambda: batches_of(work / "ckpt-topic", "commits"), "a first batch", 180)
            for kill in range(2):
                # Mid-batch: planned, not committed; some way into it.
                await until(lambda: in_flight(work), "a batch in flight", 120)
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                driver.kill()
                outcome.driver_kills += 1
                if kill == 0:
                    await kill_a_primary(env, cluster, outcome)
                driver.start()
                before = len(batches_of(work / "ckpt-topic", "commits"))
                await until(
                    lambda b=before: len(batches_of(work / "ckpt-topic", "commits")) > b + 1,
                    "batches after a restart", 240,
                )  # fmt: skip
            up = gazctl("dev", "up", "--dir", str(cluster), env=env)  # The killed broker.
            if up.returncode != 0:
                outcome.fail(f"gazctl dev up (restart): {up.stderr.strip()[-500:]}")
        finally:
            stop.set()
            await publisher
        driver.kill()
        drain = driver.start(once=True)
        code = await asyncio.to_thread(drain.wait, 600)
        if code != 0:
            outcome.fail(
                f"the draining driver exited {code} (see {work}/driver-{driver.starts}.log)"
            )
            return outcome

        want = await committed(address, SOURCES)
        outcome.committed = len(want)
        got = await asyncio.to_thread(table_rows, work / "table")
        outcome.batches = len(batches_of(work / "ckpt-parquet", "commits"))
        outcome.retried_tasks = len(list((work / "markers").iterdir()))
        check_table(want, got, outcome)
        out = await committed(address, TARGETS)
        check_topic(want, out, outcome)
    finally:
        driver.kill()
        gazctl("dev", "down", "--dir", str(cluster), env=env)
        outcome.seconds = time.monotonic() - started
    return outcome


async def kill_a_primary(env: dict[str, str], cluster: Path, outcome: Outcome) -> None:
    """SIGKILL the broker that is primary of the first source journal."""
    async with JournalsClient(env["BROKER_ADDRESS"]) as client:
        listed = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=SOURCES[0])]))
        )
    route = listed.journals[0].route
    primary = route.endpoints[route.primary] if route.primary >= 0 else ""
    state = ClusterState.load(cluster)
    assert state is not None
    for broker in state.brokers:
        if broker.address == primary:
            killed = gazctl("dev", "kill", "--signal", "KILL", broker.role, "--dir", str(cluster), env=env)  # fmt: skip
            if killed.returncode != 0:
                outcome.fail(f"gazctl dev kill {broker.role}: {killed.stderr.strip()}")
                return
            await until(lambda b=broker: not is_running(b), f"{broker.role} to die", 30)
            outcome.broker_kills += 1
            return
    outcome.fail(f"no dev broker serves {primary!r}, the primary of {SOURCES[0]}")


def check_table(
    want: list[tuple[str, int, dict[str, Any]]],
    got: list[tuple[str, int, dict[str, Any]]],
    outcome: Outcome,
) -> None:
    expected = Counter((j, o, body(d)) for j, o, d in want)
    found = Counter((j, o, body(d)) for j, o, d in got)
    twice = [k for k, c in found.items() if c > 1]
    missing = list(expected - found)
    extra = [k for k in found if k not in expected]
    if twice:
        outcome.fail(f"parquet: {len(twice)} messages twice, e.g. {twice[0]}")
    if missing:
        outcome.fail(f"parquet: {len(missing)} committed messages missing, e.g. {missing[0]}")
    if extra:
        outcome.fail(f"parquet: {len(extra)} rows no reader commits, e.g. {extra[0]}")
    if any(d.get("kind") == "abort" for _, _, d in got):
        outcome.fail("parquet: a message of an aborted transaction")


def check_topic(
    want: list[tuple[str, int, dict[str, Any]]],
    out: list[tuple[str, int, dict[str, Any]]],
    outcome: Outcome,
) -> None:
    expected = Counter(body(d) for _, _, d in want)
    found = Counter(body(d) for _, _, d in out)
    if found != expected:
        twice = sum((found - expected).values())
        missing = sum((expected - found).values())
        outcome.fail(f"topic: {twice} messages more than committed, {missing} missing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.spark_stream")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, help="the first run's seed (then +1 each)")
    parser.add_argument("--workdir", type=Path, help="keep each run's files here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    return asyncio.run(runs(args.runs, pick_seed(args.seed), args.workdir))


async def runs(count: int, seed: int, workdir: Path | None) -> int:
    """`count` runs, the first under `seed`, each in `run-N` under `workdir` (which keeps every
    run's files) or a temporary directory (removed if every run passed); the exit status."""
    dump_tasks_on_sigusr1()
    # No history: a run's files are its evidence, all kept when it fails or `workdir` is given.
    runner = Runner(workdir, prefix="spark-stream-", keep=workdir is not None)
    passed = 0
    for run in range(count):

        async def attempt(work: Path, seed: int = seed + run) -> tuple[None, Outcome, float]:
            outcome = await run_once(seed, work)
            return None, outcome, outcome.seconds

        replay = f"python -m tests.faults.spark_stream --seed {seed + run}"
        result = await runner.attempt(
            f"run-{run}", replay, attempt, history=None, indent="", kept="files"
        )
        passed += result is not None and result[0].ok
    print(f"spark-stream: {passed} of {count} runs passed")
    return runner.finish("files")


if __name__ == "__main__":
    sys.exit(main())
