"""stream-sum with real processes: a broker (`gazette serve`), three summer processes
(`python -m consumer.examples.stream_sum serve`), shards created by the example's `setup`, and the
chunker, which exits 0 only if every stream's sum arrives exactly right. Summers are SIGKILLed
again and again mid-transaction (and started again); every sum must still be exact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.testing import EtcdServer, free_port, stop_process
from consumer.protocol import cpb
from tests.conftest import BrokerProcess

EXAMPLE = [sys.executable, "-m", "consumer.examples.stream_sum"]


class Summers:
    """Summer processes by id, each started (again) on its own port, and stopped by pid."""

    def __init__(
        self, etcd: EtcdServer, broker: BrokerProcess, root: str, stores: Path, logs: Path
    ) -> None:
        self.etcd, self.broker, self.root, self.stores, self.logs = etcd, broker, root, stores, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, summer_id: str, *, wait: bool = True) -> None:
        port = self.ports.setdefault(summer_id, free_port())
        with (self.logs / f"{summer_id}.log").open("ab") as out:
            self.procs[summer_id] = subprocess.Popen(
                [
                    *EXAMPLE, "serve", "--consumer.id", summer_id, "--consumer.port", str(port),
                    "--consumer.drain-timeout", "5s", "--broker.address", self.broker.address,
                    "--etcd.address", self.etcd.endpoint, "--etcd.prefix", self.root,
                    "--etcd.lease", "2s", "--summer.store-root", str(self.stores),
                ],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if wait:
            self.wait_ready(summer_id)

    def address(self, summer_id: str) -> str:
        return f"http://127.0.0.1:{self.ports[summer_id]}"

    def wait_ready(self, summer_id: str) -> None:
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(f"127.0.0.1:{self.ports[summer_id]}") as channel:
            stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
            while True:
                proc = self.procs[summer_id]
                if proc.poll() is not None:
                    log = (self.logs / f"{summer_id}.log").read_text()
                    raise RuntimeError(f"{summer_id} exited {proc.returncode}: {log[-2000:]}")
                try:
                    stub.List(cpb.ListRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    assert time.monotonic() < deadline, f"{summer_id} did not become ready"
                    time.sleep(0.05)

    def kill(self, summer_id: str) -> None:
        os.kill(self.procs[summer_id].pid, signal.SIGKILL)
        self.procs[summer_id].wait()

    def stop_all(self) -> list[int]:
        return [stop_process(proc) for proc in self.procs.values()]


@pytest.fixture
def summers(
    etcd_server: EtcdServer, broker_process: BrokerProcess, tmp_path: Path
) -> Iterator[Summers]:
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    (tmp_path / "stores").mkdir()
    group = Summers(etcd_server, broker_process, root, tmp_path / "stores", tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXAMPLE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_every_sum_is_exact_while_summers_are_killed(
    summers: Summers, broker_process: BrokerProcess
) -> None:
    ids = ["summer-0", "summer-1", "summer-2"]
    for summer_id in ids:
        summers.start(summer_id)
    setup = run(
        "setup", "--partitions", "2",
        "--broker.address", broker_process.address, "--consumer.address", summers.address(ids[0]),
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr

    chunker = subprocess.Popen(
        [
            *EXAMPLE, "chunker", "--streams", "400", "--chunks", "40", "--pace", "0.05", "--seed", "11",
            "--timeout", "120", "--broker.address", broker_process.address,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rng = random.Random(12)
    kills = 0
    try:
        deadline = time.monotonic() + 150
        while chunker.poll() is None and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 1.0))
            victim = rng.choice(ids)
            if kills < 8 and summers.procs[victim].poll() is None:
                summers.kill(victim)  # Mid-transaction, mid-commit: wherever it is.
                kills += 1
                # Same id: it waits for its old lease to expire before it takes shards again.
                summers.start(victim, wait=False)
        out, err = chunker.communicate(timeout=150)
    finally:
        if chunker.poll() is None:
            stop_process(chunker)  # type: ignore[arg-type]
    assert chunker.returncode == 0, err
    assert kills >= 3, f"the chunker finished before the summers were killed enough: {out}"
    assert "400 sums of 40 chunks, all exact" in out
    for summer_id in ids:  # No summer saw a chunk out of sequence (a shard would fail).
        log = (summers.logs / f"{summer_id}.log").read_text()
        assert "OutOfSequence" not in log, log[-2000:]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--consumer.id", "ab"], '--consumer.id: "ab" is too short'),
        (["--etcd.address", "https://etcd:2379"], "--etcd.address 'https://etcd:2379': https://"),
        (["--broker.address", "https://b:1"], "--broker.address 'https://b:1': https://"),
        (["--etcd.prefix", "relative"], "--etcd.prefix 'relative': must start with '/'"),
        (["--etcd.lease", "0s"], "--etcd.lease: 0s is below 1s"),
        (["--consumer.watch-delay", "soon"], '--consumer.watch-delay: invalid duration "soon"'),
        (["--etcd.address", "http://127.0.0.1:1"], "stream-sum: cannot start: UNAVAILABLE"),
    ],
)
def test_a_consumer_given_bad_flags_says_so_in_one_line(
    args: list[str], words: str, tmp_path: Path
) -> None:
    r = run(
        "serve", "--consumer.id", "summer-x", "--consumer.port", "0",
        "--summer.store-root", str(tmp_path), *args, timeout=30,
    )  # fmt: skip
    assert r.returncode == 1, r
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr
