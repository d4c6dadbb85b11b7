"""The fault campaigns' runner, with fake scenarios and no cluster: every campaign (brokers,
replication, consumers) makes a scenario's directory afresh, keeps only the history of a passing
scenario (a symlink in its directory removed, never followed), keeps everything a failing one
left and names the command that replays it, and exits 1 on a violation or a run that failed; the
spark-stream runs likewise. `python -m tests.faults` is driven through its `main`, with each
campaign's scenario run replaced by a fake that writes into its directory."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.faults.__main__ as faults
from tests.faults import spark_stream
from tests.faults.checker import Report
from tests.faults.consumer_checker import ConsumerHistory
from tests.faults.consumer_checker import Report as ConsumerReport
from tests.faults.consumer_checker import Violation as ConsumerViolation
from tests.faults.history import History
from tests.faults.replication_checker import ReplicationHistory
from tests.faults.replication_checker import Report as ReplicationReport
from tests.faults.scenarios import ScenarioSkipped

# (campaign, a scenario of it, the name its run has in tests.faults.__main__, its history file)
CAMPAIGNS = [
    pytest.param("brokers", "sigkill", "run_scenario", "history.json.gz", id="brokers"),
    pytest.param(
        "replication", "location-kill", "run_replication_scenario", "history.json",
        id="replication",
    ),
    pytest.param(
        "consumers", "consumer-sigkill", "run_consumer_scenario", "history.json", id="consumers"
    ),
]  # fmt: skip


def outcome(campaign: str, name: str, seed: int, ok: bool) -> tuple[Any, Any]:
    """A history and a report of `campaign`'s own types: passing, or with one violation."""
    if campaign == "brokers":
        report = Report(name, seed, cycles=2)
        if not ok:
            report.add("lost", "faults/raw/0", "an acknowledged record is missing")
        return History(scenario=name, seed=seed), report
    if campaign == "replication":
        replication = ReplicationReport(name, seed, cycles=2)
        if not ok:
            replication.add("missing", "A", "an acknowledged emit is missing")
        return ReplicationHistory(name, seed, locations=["A"]), replication
    consumers = ConsumerReport(name, seed, "sqlite", cycles=2)
    if not ok:
        consumers.violations.append(ConsumerViolation("wrong-sum", "a wrong sum"))
    return ConsumerHistory(scenario=name, seed=seed, store="sqlite"), consumers


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """`main` configures logging (the `message` logger muted): put it back."""
    logger = logging.getLogger("message")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory out of every work directory, holding a file no cleanup may remove."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "precious").write_text("keep me")
    return path


def fake_run(
    campaign: str, outside: Path, *, ok: bool = True, raises: BaseException | None = None
) -> Any:
    """A scenario run that leaves what the harnesses leave (logs, a store, a consumer's TMPDIR
    as a symlink: here to `outside`, and to a directory beside it) and returns `campaign`'s
    history and report."""

    async def run(scenario: Any, seed: int, workdir: Path, **_: Any) -> tuple[Any, Any, float]:
        assert list(workdir.iterdir()) == [], "a scenario's directory starts empty"
        (workdir / "logs").mkdir()
        (workdir / "logs" / "broker-0.log").write_text("log\n")
        (workdir / "real-tmp-c0").mkdir()
        (workdir / "real-tmp-c0" / "replica.db").write_text("db")
        (workdir / "tmp-c0").symlink_to(workdir / "real-tmp-c0", target_is_directory=True)
        (workdir / "tmp-c1").symlink_to(outside, target_is_directory=True)
        (workdir / "a-file-link").symlink_to(outside / "precious")
        (workdir / "etcd.log").write_text("etcd\n")
        if raises is not None:
            raise raises
        history, report = outcome(campaign, scenario.name, seed, ok)
        return history, report, 1.0

    return run


def run_main(monkeypatch: pytest.MonkeyPatch, attribute: str, run: Any, *argv: str) -> int:
    monkeypatch.setattr(faults, attribute, run)
    return faults.main(list(argv))


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_a_passing_scenario_keeps_its_history_alone_and_no_symlink_is_followed(
    campaign: str,
    name: str,
    attribute: str,
    history: str,
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = tmp_path / "work"
    code = run_main(
        monkeypatch, attribute, fake_run(campaign, outside),
        "--scenario", name, "--seed", "7", "--workdir", str(work), "--loopback",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert (outside / "precious").read_text() == "keep me"
    assert sorted(os.listdir(work / name)) == [history], "the cleanup left more than the history"
    assert f"{name} (seed 7): " in out and f"histories under {work}" in out


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_a_scenario_directory_that_is_a_symlink_is_replaced_not_followed(
    campaign: str,
    name: str,
    attribute: str,
    history: str,
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A `--workdir` reused, where the scenario's directory is a symlink out of it: the
    symlink goes (what it points to stays) and the scenario runs in a directory of its own."""
    work = tmp_path / "work"
    work.mkdir()
    (work / name).symlink_to(outside, target_is_directory=True)
    code = run_main(
        monkeypatch, attribute, fake_run(campaign, outside),
        "--scenario", name, "--seed", "7", "--workdir", str(work), "--loopback",
    )  # fmt: skip
    assert code == 0, capsys.readouterr().out
    assert sorted(os.listdir(outside)) == ["precious"]
    assert not (work / name).is_symlink() and sorted(os.listdir(work / name)) == [history]


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_a_violation_keeps_every_file_names_the_replay_and_exits_1(
    campaign: str,
    name: str,
    attribute: str,
    history: str,
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = tmp_path / "work"
    code = run_main(
        monkeypatch, attribute, fake_run(campaign, outside, ok=False),
        "--scenario", name, "--seed", "7", "--workdir", str(work), "--loopback",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    kept = work / name
    assert {history, "logs", "etcd.log", "tmp-c0", "tmp-c1", "real-tmp-c0"} <= set(os.listdir(kept))  # fmt: skip
    assert (outside / "precious").read_text() == "keep me"
    assert f"  history and logs kept in {kept}\n" in out
    assert f"  replay: python -m tests.faults --scenario {name} --seed 7" in out
    assert f"histories under {work}" in out


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_a_run_that_raises_is_a_failure_named_with_its_replay(
    campaign: str,
    name: str,
    attribute: str,
    history: str,
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    work = tmp_path / "work"
    run = fake_run(campaign, outside, raises=TimeoutError("no primary"))
    code = run_main(
        monkeypatch, attribute, run,
        "--scenario", name, "--seed", "7", "--workdir", str(work), "--loopback", "--cycles", "3",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    assert "  FAILED to run: TimeoutError: no primary\n" in out
    replay = f"python -m tests.faults --scenario {name} --seed 7"
    assert f"  logs in {work / name}; replay: {replay}" in out
    assert (work / name / "logs" / "broker-0.log").exists()


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_a_skipped_scenario_is_no_failure(
    campaign: str,
    name: str,
    attribute: str,
    history: str,
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = run_main(
        monkeypatch, attribute, fake_run(campaign, outside, raises=ScenarioSkipped("no netns")),
        "--scenario", name, "--seed", "7", "--loopback",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "  skipped: no netns\n" in out and "histories under" not in out


# ---- spark-stream ------------------------------------------------------------------------------


def fake_once(outside: Path, seen: list[list[str]], *, ok: bool = True) -> Any:
    async def run_once(seed: int, work: Path) -> spark_stream.Outcome:
        seen.append(sorted(os.listdir(work)))
        (work / "ckpt-parquet").mkdir()
        (work / "ckpt-parquet" / "0").write_text("offsets")
        (work / "link").symlink_to(outside, target_is_directory=True)
        result = spark_stream.Outcome(seed)
        if not ok:
            result.fail("parquet: 1 committed messages missing")
        return result

    return run_once


def test_a_spark_stream_run_starts_in_an_empty_directory(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--workdir` used again: the earlier run's checkpoints are not the new run's."""
    seen: list[list[str]] = []
    monkeypatch.setattr(spark_stream, "run_once", fake_once(outside, seen))
    work = tmp_path / "work"
    for _ in range(2):
        assert spark_stream.main(["--runs", "1", "--seed", "3", "--workdir", str(work)]) == 0
    assert seen == [[], []]
    assert sorted(os.listdir(outside)) == ["precious"]


def test_spark_stream_runs_that_pass_leave_nothing_and_follow_no_symlink(
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "spark-stream-root"
    monkeypatch.setattr(spark_stream.tempfile, "mkdtemp", lambda **_: str(root.mkdir() or root))
    monkeypatch.setattr(spark_stream, "run_once", fake_once(outside, []))
    assert spark_stream.main(["--runs", "2", "--seed", "3"]) == 0
    assert not root.exists()
    assert sorted(os.listdir(outside)) == ["precious"]
    assert "spark-stream: 2 of 2 runs passed" in capsys.readouterr().out


def test_a_spark_stream_run_that_raises_fails_alone(
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run that raises (a batch that never came) is a failed run, named with its replay and
    its files kept; the next runs still run."""
    passing = fake_once(outside, [])

    async def run_once(seed: int, work: Path) -> spark_stream.Outcome:
        if seed == 3:
            (work / "driver-1.log").write_text("...")
            raise TimeoutError("timed out after 180s waiting for a first batch")
        return await passing(seed, work)

    monkeypatch.setattr(spark_stream, "run_once", run_once)
    work = tmp_path / "work"
    assert spark_stream.main(["--runs", "2", "--seed", "3", "--workdir", str(work)]) == 1
    out = capsys.readouterr().out
    assert "  FAILED to run: TimeoutError: timed out after 180s waiting for a first batch" in out
    assert "replay: python -m tests.faults.spark_stream --seed 3" in out
    assert (work / "run-0" / "driver-1.log").exists()
    assert "spark-stream seed 4: ok" in out and "spark-stream: 1 of 2 runs passed" in out


def test_a_failing_spark_stream_run_names_where_its_files_are(
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "spark-stream-root"
    monkeypatch.setattr(spark_stream.tempfile, "mkdtemp", lambda **_: str(root.mkdir() or root))
    monkeypatch.setattr(spark_stream, "run_once", fake_once(outside, [], ok=False))
    assert spark_stream.main(["--runs", "1", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "spark-stream seed 3: FAILED" in out
    assert f"kept in {root / 'run-0'}" in out
    assert "replay: python -m tests.faults.spark_stream --seed 3" in out
    assert (root / "run-0" / "ckpt-parquet" / "0").exists()
