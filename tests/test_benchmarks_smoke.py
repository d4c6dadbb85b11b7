"""Smoke test of `nox -s bench`'s runner, the bare-relay baselines, and each benchmark's quick
run: each runs briefly, reports the fields the others rely on, and stops every process it
started. Nothing here asserts on speed.

`nox -s tests` runs the runner's and the baselines' tests and failover's quick run (it kills a
broker and starts it again), as the representative of the rest, which are marked `bench`: `nox -s
bench -- --quick` runs every benchmark so, and `nox -s tests -- -m bench` runs these tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _cluster, _runner, failover, idle_tails
from benchmarks.__main__ import BENCHMARKS
from benchmarks.baselines import _procs
from benchmarks.baselines.relay import measure_relay_throughput
from benchmarks.baselines.unary_chain import measure_unary_chain

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip


def test_runner_writes_json_for_journal_specs_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = bench("--json", str(out), "--only", "journal_specs", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("journal_specs  "), proc.stdout
    results = json.loads(out.read_text())
    assert list(results) == ["journal_specs"]
    result = results["journal_specs"]
    assert result["unit"] == "specs/s"
    for key in ("value", "baseline", "ratio", "list", "list_baseline", "list_ratio"):
        assert isinstance(result[key], float) and result[key] > 0, key


def test_unknown_benchmark_is_one_line() -> None:
    proc = bench("--only", "journal_specs", "no_such_bench")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("unknown benchmark no_such_bench; known: journal_specs")


def test_missing_module_is_not_yet_available(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    registry = {"later": "benchmarks.no_such_module"}
    assert _runner.main(["--json", str(out)], registry) == 0
    assert (
        capsys.readouterr().out
        == "later  not yet available (no module benchmarks.no_such_module)\n"
    )
    assert json.loads(out.read_text()) == {}
    # Asked for by name, it is still one line, but the run did not do what was asked.
    assert _runner.main(["--only", "later"], registry) == 1


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Every server process the baselines start, to check each is stopped."""
    procs: list[subprocess.Popen[bytes]] = []
    spawn = _procs._spawn

    def recording(module: str, args: Any) -> subprocess.Popen[bytes]:
        procs.append(spawn(module, args))
        return procs[-1]

    monkeypatch.setattr(_procs, "_spawn", recording)
    return procs


def test_relay_baseline_runs(started: list[subprocess.Popen[bytes]]) -> None:
    result = measure_relay_throughput(duration_s=0.2, chunk_size=64 << 10, append_size=256 << 10)
    assert result["unit"] == "MB/s"
    assert result["value"] > 0 and result["appends"] > 0
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert len(started) == 3 and all(p.poll() is not None for p in started)


def test_unary_chain_baseline_runs(started: list[subprocess.Popen[bytes]]) -> None:
    result = measure_unary_chain(concurrency=4, payload=256, duration_s=0.2)
    assert result["unit"] == "calls/s"
    assert result["value"] > 0 and result["calls"] > 0
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert len(started) == 3 and all(p.poll() is not None for p in started)


@pytest.fixture
def brokers_started(monkeypatch: pytest.MonkeyPatch) -> list[_cluster.BrokerProcess]:
    """Every broker process failover and idle_tails start, to check each is stopped."""
    started: list[_cluster.BrokerProcess] = []
    start = _cluster.start_broker

    def recording(*args: Any, **kwargs: Any) -> _cluster.BrokerProcess:
        started.append(start(*args, **kwargs))
        return started[-1]

    for module in (failover, idle_tails):
        monkeypatch.setattr(module, "start_broker", recording)
    return started


@pytest.mark.slow
def test_failover_quick(brokers_started: list[_cluster.BrokerProcess]) -> None:
    assert BENCHMARKS["failover"] == "benchmarks.failover"
    result = _runner.check("failover", failover.run(quick=True))
    assert result["unit"] == "s" and result["kills"] == 1 and result["lease_ttl"] == 2
    # Kill -> lease expiry comes before kill -> acknowledgement; each later phase was seen.
    assert 0 < result["baseline"] <= result["value"] == result["max"]
    for phase in ("allocate", "sync", "client", "load_recovery"):
        assert result[phase] is not None and result[phase] >= 0, phase
    # Four brokers, and the killed one started again.
    assert len(brokers_started) == 5
    assert all(b.proc.poll() is not None for b in brokers_started)


@pytest.mark.bench
@pytest.mark.slow
def test_idle_tails_quick(brokers_started: list[_cluster.BrokerProcess]) -> None:
    assert BENCHMARKS["idle_tails"] == "benchmarks.idle_tails"
    result = _runner.check("idle_tails", idle_tails.run(quick=True))
    assert result["readers"] == 10 and result["window_s"] == 1.0
    for key in ("value", "baseline", "before", "before_baseline"):
        assert result[key] >= 0, key
    assert len(brokers_started) == 3
    assert all(b.proc.poll() is not None for b in brokers_started)


@pytest.mark.bench
@pytest.mark.slow
def test_consumer_throughput_quick() -> None:
    """The benchmark runs end to end: the shard's store counted every message (it asserts
    so), and both rates and their ratio are reported (never asserted: speed is nox -s bench's)."""
    from benchmarks import consumer_throughput

    assert BENCHMARKS["consumer_throughput"] == "benchmarks.consumer_throughput"
    result = _runner.check("consumer_throughput", consumer_throughput.run(quick=True))
    assert result["unit"] == "messages/s" and result["messages"] == 20_000
    assert result["value"] > 0 and result["baseline"] > 0 and result["ratio"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_publish_quick() -> None:
    """The benchmark runs end to end: the baseline re-encoded exactly the bytes published as
    lists (it asserts so), and both ways of publishing are reported beside the baseline."""
    from benchmarks import publish

    result = _runner.check("publish", publish.run(quick=True))
    assert result["unit"] == "messages/s" and result["messages"] % publish.BATCH == 0
    assert len(result["rounds"]) == 1
    assert result["value"] > 0 and result["baseline"] > 0 and result["one_at_a_time"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_append_small_quick() -> None:
    """The benchmark runs end to end (64 appenders in one message each, against the unary
    chain), one alternating pair reported with its own ratio."""
    from benchmarks import append_small

    result = _runner.check("append_small", append_small.run(quick=True))
    assert result["unit"] == "appends/s" and len(result["rounds"]) == 1
    ours, base = (float(v) for v in result["rounds"][0].split("/"))
    assert abs(result["pair_ratio"] - ours / base) < 0.01  # (the pair is listed to 4 digits)
    assert result["value"] > 0 and result["baseline"] > 0 and result["p99_ms"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_append_service_quick() -> None:
    """The benchmark runs end to end, its records and the same bytes appended raw reported
    side by side."""
    from benchmarks import append_service

    result = _runner.check("append_service", append_service.run(quick=True))
    assert result["unit"] == "records/s" and result["records"] % 256 == 0
    assert result["value"] > 0 and result["baseline"] > 0 and len(result["rounds"]) == 1


@pytest.mark.bench
@pytest.mark.slow
def test_shard_failover_quick() -> None:
    """One kill of the process hosting a shard's primary (stream-sum summers, lease 2 s): the
    shard comes back (Stat through the survivor reads past the kill) after the lease expired."""
    from benchmarks import shard_failover

    assert BENCHMARKS["shard_failover"] == "benchmarks.shard_failover"
    result = _runner.check("shard_failover", shard_failover.run(quick=True))
    assert result["unit"] == "s" and result["kills"] == 1 and result["lease_ttl"] == 2
    assert 0 < result["baseline"] <= result["value"] == result["max"]


@pytest.mark.bench
@pytest.mark.slow
def test_recovery_playback_quick() -> None:
    """A recorded log played to its head and read raw; both rates reported (never asserted)."""
    from benchmarks import recovery_playback

    assert BENCHMARKS["recovery_playback"] == "benchmarks.recovery_playback"
    result = _runner.check("recovery_playback", recovery_playback.run(quick=True))
    assert result["unit"] == "MB/s" and result["log_mb"] > 3 and result["live_files"] == 2
    assert result["value"] > 0 and result["baseline"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_sqlite_store_quick() -> None:
    from benchmarks import sqlite_store

    assert BENCHMARKS["sqlite_store"] == "benchmarks.sqlite_store"
    result = _runner.check("sqlite_store", sqlite_store.run(quick=True))
    assert result["unit"] == "txn/s" and result["transactions"] == 100
    assert result["value"] > 0 and result["baseline"] > 0 and result["log_kb_per_txn"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_standby_takeover_quick() -> None:
    """One kill each on the recorded SQLite store (its standby takes over) and on the JSON
    store, lease 2 s: both come back after the lease expired."""
    from benchmarks import standby_takeover

    assert BENCHMARKS["standby_takeover"] == "benchmarks.standby_takeover"
    result = _runner.check("standby_takeover", standby_takeover.run(quick=True))
    assert result["unit"] == "s" and result["kills"] == 1 and result["lease_ttl"] == 2
    assert 0 < result["baseline"] <= result["value"] and result["without_standby"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_location_takeover_quick() -> None:
    """One kill of the host running a location, lease 2 s: its standby writes an event after
    the dead host's lease expired."""
    from benchmarks import location_takeover

    assert BENCHMARKS["location_takeover"] == "benchmarks.location_takeover"
    result = _runner.check("location_takeover", location_takeover.run(quick=True))
    assert result["unit"] == "s" and result["kills"] == 1 and result["lease_ttl"] == 2
    assert 0 < result["baseline"] <= result["value"]


@pytest.mark.bench
@pytest.mark.slow
def test_replication_throughput_quick() -> None:
    from benchmarks import replication_throughput

    assert BENCHMARKS["replication_throughput"] == "benchmarks.replication_throughput"
    result = _runner.check("replication_throughput", replication_throughput.run(quick=True))
    assert result["unit"] == "events/s" and result["events"] == 5_000  # All replicated (checked).
    assert result["value"] > 0 and result["baseline"] > 0 and 150 < result["bytes_per_event"] < 300


@pytest.mark.bench
@pytest.mark.slow
def test_convergence_quick() -> None:
    """Each event reaches all four locations of the ring: stored three times (not at its
    emitter), the other connections' reads of it filtered by the causality filter."""
    from benchmarks import convergence

    assert BENCHMARKS["convergence"] == "benchmarks.convergence"
    result = _runner.check("convergence", convergence.run(quick=True))
    assert result["unit"] == "s" and result["events"] == 5
    assert result["stored_per_event"] == 3 and result["filtered_per_event"] >= 1


@pytest.mark.bench
@pytest.mark.slow
def test_auth_overhead_quick() -> None:
    """append_small with token verification on, beside it off: both runs append."""
    from benchmarks import auth_overhead

    assert BENCHMARKS["auth_overhead"] == "benchmarks.auth_overhead"
    assert BENCHMARKS["tls_cost"] == "benchmarks.tls_cost"
    result = _runner.check("auth_overhead", auth_overhead.run(quick=True))
    assert result["unit"] == "appends/s" and result["value"] > 0 and result["baseline"] > 0
    assert result["target"] == 0.9


@pytest.mark.bench
@pytest.mark.slow
def test_journal_scale_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 journals at replication 3 on three brokers: every figure reported, every broker
    stopped (figures are never asserted: they are nox -s bench's)."""
    from benchmarks import journal_scale

    started: list[_cluster.BrokerProcess] = []

    def recording(*args: Any, **kwargs: Any) -> _cluster.BrokerProcess:
        started.append(_cluster.start_broker(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(journal_scale, "start_broker", recording)
    assert BENCHMARKS["journal_scale"] == "benchmarks.journal_scale"
    result = _runner.check("journal_scale", journal_scale.run(quick=True))
    assert result["unit"] == "KiB/replica" and result["ratio"] == 1.0
    assert result["n200_replicas_per_broker"] == 200
    assert 0 < result["n200_placed_s"] <= result["n200_consistent_s"]
    for key in ("idle_rss_mib", "rss_mib", "cpu_short", "cpu_long", "list_ms"):
        assert result[f"n200_{key}"] >= 0, key
    assert len(started) == 3 and all(b.proc.poll() is not None for b in started)


@pytest.mark.bench
@pytest.mark.slow
def test_reader_fanout_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 and 10 tailing readers of one journal at replication 3: every record reached every
    reader once (the benchmark checks it), latencies and CPU reported, every broker stopped."""
    from benchmarks import reader_fanout

    started: list[_cluster.BrokerProcess] = []

    def recording(*args: Any, **kwargs: Any) -> _cluster.BrokerProcess:
        started.append(_cluster.start_broker(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(reader_fanout, "start_broker", recording)
    assert BENCHMARKS["reader_fanout"] == "benchmarks.reader_fanout"
    result = _runner.check("reader_fanout", reader_fanout.run(quick=True))
    assert result["unit"] == "ms p99" and result["readers"] == 10
    assert result["baseline_readers"] == 1 and result["ratio"] > 0
    for n in (1, 10):
        assert 0 < result[f"n{n}_p50_ms"] <= result[f"n{n}_p99_ms"] <= result[f"n{n}_max_ms"]
        assert result[f"n{n}_records"] > 0 and result[f"n{n}_client_processes"] == 1
        assert result[f"n{n}_broker_cpu"] >= 0
    assert len(started) == 3 and all(b.proc.poll() is not None for b in started)


@pytest.mark.bench
@pytest.mark.slow
def test_shard_scale_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """50 shards on three consumer processes: every shard PRIMARY, `gazctl shards list` run,
    every consumer and broker stopped (figures are never asserted: they are nox -s bench's)."""
    from benchmarks import shard_scale
    from consumer.testing.processes import ConsumerProcesses

    brokers: list[_cluster.BrokerProcess] = []
    groups: list[ConsumerProcesses] = []

    def recording(*args: Any, **kwargs: Any) -> _cluster.BrokerProcess:
        brokers.append(_cluster.start_broker(*args, **kwargs))
        return brokers[-1]

    class Recorded(ConsumerProcesses):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            groups.append(self)

    monkeypatch.setattr(shard_scale, "start_broker", recording)
    monkeypatch.setattr(shard_scale, "ConsumerProcesses", Recorded)
    assert BENCHMARKS["shard_scale"] == "benchmarks.shard_scale"
    result = _runner.check("shard_scale", shard_scale.run(quick=True))
    assert result["unit"] == "KiB/shard" and result["ratio"] == 1.0 and result["shards"] == 50
    assert 0 < result["n50_assigned_s"] <= result["n50_primary_s"]
    assert result["n50_shards_per_consumer"] >= 17  # 50 over three processes.
    for key in ("idle_rss_mib", "rss_mib", "cpu_idle", "list_s", "list_rpc_ms"):
        assert result[f"n50_{key}"] >= 0, key
    assert len(brokers) == 3 and all(b.proc.poll() is not None for b in brokers)
    assert len(groups) == 1 and len(groups[0].procs) == 3
    assert all(p.poll() is not None for p in groups[0].procs.values())
