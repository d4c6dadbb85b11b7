"""stream-sum with real processes: a broker (`gazette serve`), three summer processes
(`python -m consumer.examples.stream_sum serve`), shards created by the example's `setup`, and the
chunker, which exits 0 only if every stream's sum arrives exactly right. Summers are SIGKILLed
again and again mid-transaction (and started again); every sum must still be exact."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.testing import stop_process
from consumer.testing import ConsumerProcesses, ConsumerProcessesFactory
from tests.conftest import BrokerProcess
from tests.helpers.consumers import primaries, standbys_tail
from tests.helpers.waiting import until_blocking

EXAMPLE = [sys.executable, "-m", "consumer.examples.stream_sum"]


@pytest.fixture
def summers(
    gazette_consumer_processes: ConsumerProcessesFactory, tmp_path: Path
) -> ConsumerProcesses:
    """Summer processes (the test kit's, stopped by pid as the test ends), dialling the
    module's broker process, their sums in JSON files under the test's folder."""
    (tmp_path / "stores").mkdir()
    return gazette_consumer_processes(
        command=EXAMPLE, args=["--summer.store-root", str(tmp_path / "stores")]
    )


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXAMPLE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_every_sum_is_exact_while_summers_are_killed(
    summers: ConsumerProcesses, broker_process: BrokerProcess
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
            time.sleep(rng.uniform(0.3, 1.0))  # The kills' pace, the test's own workload.
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
        (["--etcd.address", "ftp://etcd:2379"], "--etcd.address 'ftp://etcd:2379': expected"),
        (["--broker.address", "ftp://b:1"], "--broker.address 'ftp://b:1': expected"),
        (
            ["--broker.cert-file", "/no/such.crt", "--broker.cert-key-file", "/no/such.key"],
            "--broker.cert-file '/no/such.crt'",
        ),
        (
            ["--consumer.server-cert-file", "/no/such.crt"],
            "--consumer.server-cert-file is given without --consumer.server-cert-key-file",
        ),
        (["--consumer.auth-keys", "%%%"], "--consumer.auth-keys: the key at index 0 is not base64"),
        (["--etcd.prefix", "relative"], "--etcd.prefix 'relative': must start with '/'"),
        (["--etcd.lease", "0s"], "--etcd.lease: 0s is below 1s"),
        (["--consumer.watch-delay", "soon"], '--consumer.watch-delay: invalid duration "soon"'),
        # A consumer waits for an unreachable etcd for two leases and 2 s, as a restart of etcd
        # would need (issue 38), then says so: a short lease keeps the wait short.
        (
            ["--etcd.address", "http://127.0.0.1:1", "--etcd.lease", "2s"],
            "stream-sum: cannot start: UNAVAILABLE",
        ),
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
    # An unreachable etcd is waited for, with one progress line first.
    waited = [line for line in lines if "etcd unavailable" in line and "waiting for it" in line]
    assert len(waited) <= 1, r.stderr
    lines = [line for line in lines if line not in waited]
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_sums_on_recorded_sqlite_are_exact_while_primaries_are_killed(
    summers: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    """Shards on the SQLite store, recorded into recovery logs, each with a hot standby that
    tails its log: the primaries' processes are SIGKILLed again and again, the standbys take
    over without replaying the log, and every sum is exact."""
    ids = ["sql-summer-0", "sql-summer-1", "sql-summer-2"]
    for summer_id in ids:
        summers.start(summer_id)
    setup = run(
        "setup", "--partitions", "2", "--store", "sqlite",
        "--broker.address", broker_process.address, "--consumer.address", summers.address(ids[0]),
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr

    chunker = subprocess.Popen(
        [
            *EXAMPLE, "chunker", "--streams", "200", "--chunks", "30", "--pace", "0.7",
            "--seed", "21", "--timeout", "150", "--broker.address", broker_process.address,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rng = random.Random(22)
    kills = 0
    try:
        deadline = time.monotonic() + 180
        # The standbys catch up with their logs first.
        until_blocking(lambda: standbys_tail(summers, 2), "every shard's standby tails its log", 60)
        while chunker.poll() is None and time.monotonic() < deadline:
            # The kills' pace, the test's own: each past the lease (2 s) of the last, by when a
            # standby is tailing again.
            time.sleep(rng.uniform(2.5, 4.0))  # The kills' pace.
            alive = [i for i in ids if summers.procs[i].poll() is None]
            victims = sorted(primaries(summers, alive))
            if kills < 5 and victims:
                victim = rng.choice(victims)
                summers.kill(victim)
                kills += 1
                summers.start(victim, wait=False)
        out, err = chunker.communicate(timeout=180)
    finally:
        if chunker.poll() is None:
            stop_process(chunker)  # type: ignore[arg-type]
    logs = "".join((summers.logs / f"{i}.log").read_text() for i in ids)
    assert chunker.returncode == 0, err + logs[-3000:]
    assert kills >= 3, f"the chunker finished before the primaries were killed enough: {out}"
    assert "200 sums of 30 chunks, all exact" in out
    assert "OutOfSequence" not in logs
    # Take-overs by standbys that tailed the log, not replays from scratch.
    assert logs.count("its standby takes over the log it tails") >= 2, logs[-3000:]


def test_the_chunkers_schedule_completes_streams_all_through_the_run() -> None:
    """A few streams in progress at once: the first completes early, and every quarter of the
    run completes some, so that a fault early in a run meets streams that end."""
    from consumer.examples.stream_sum import chunk_schedule

    schedule = chunk_schedule(random.Random(5), "run", streams=20, chunks=10, concurrent=4)
    assert len(schedule) == 200
    ends = [i for i, (_stream, _seq, _value, last) in enumerate(schedule) if last]
    assert len(ends) == 20 and ends[0] < 50
    assert all(any(q * 50 <= i < (q + 1) * 50 for i in ends) for q in range(4)), ends
    seqs: dict[str, int] = {}
    for stream, seq, _value, _last in schedule:  # Each stream's chunks in order, once each.
        assert seq == seqs.get(stream, 0) + 1
        seqs[stream] = seq


def test_setup_names_journals_and_shards_under_its_prefix() -> None:
    """Two runs share a cluster under two prefixes: nothing of one is named as the other's,
    and a shard's label names the sums journal its summer publishes to."""
    from broker.protocol import labels
    from consumer.examples.stream_sum import SUMS_LABEL, shard_id, shard_spec

    assert shard_id(0) == "stream-sum-000"  # The default prefix keeps its names.
    a = shard_spec(1, "runs/a", standbys=2, store="postgres")
    b = shard_spec(1, "runs/b", standbys=0, store="sqlite")
    assert (a.id, b.id) == ("runs-a-001", "runs-b-001")
    assert [s.journal for s in a.sources] == ["runs/a/chunks/part-001"]
    assert labels.value_of(a.labels, SUMS_LABEL) == "runs/a/sums"
    assert labels.value_of(b.labels, SUMS_LABEL) == "runs/b/sums"
    assert (a.hot_standbys, b.hot_standbys) == (2, 0)
    assert labels.value_of(a.labels, "store") == "postgres" and not a.recovery_log_prefix
    assert labels.value_of(b.labels, "store") == "sqlite"
    assert b.recovery_log_prefix == "runs/b/recovery"


@pytest.mark.slow
def test_two_runs_under_two_prefixes_share_a_cluster(
    summers: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    """Two setups, under two prefixes, on one broker and one set of summers: each run's
    chunker reads back exactly its own streams' sums from its own sums journal (the summers
    publish where each shard's label says)."""
    ids = ["summer-a", "summer-b"]
    for summer_id in ids:
        summers.start(summer_id)
    for prefix in ("runs/a", "runs/b"):
        setup = run(
            "setup", "--partitions", "2", "--prefix", prefix, "--standbys", "0",
            "--broker.address", broker_process.address, "--consumer.address", summers.address(ids[0]),
        )  # fmt: skip
        assert setup.returncode == 0, setup.stderr
    chunkers = []
    for seed, prefix in ((31, "runs/a"), (32, "runs/b")):
        argv = [
            *EXAMPLE, "chunker", "--streams", "30", "--chunks", "6", "--seed", str(seed),
            "--prefix", prefix, "--timeout", "60", "--broker.address", broker_process.address,
        ]  # fmt: skip
        chunkers.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        results = [chunker.communicate(timeout=90) for chunker in chunkers]
    finally:
        for chunker in chunkers:
            if chunker.poll() is None:
                stop_process(chunker)  # type: ignore[arg-type]
    for chunker, (out, err) in zip(chunkers, results, strict=True):
        assert chunker.returncode == 0, err
        assert "30 sums of 6 chunks, all exact" in out
