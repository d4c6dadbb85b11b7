"""The fault campaigns' runner, with fake scenarios and no cluster: every campaign (brokers,
replication, consumers) makes a scenario's directory afresh, keeps only the history of a passing
scenario (a symlink in its directory removed, never followed), keeps everything a failing one
left and names the command that replays it, and exits 1 on a violation or a run that failed; the
spark-stream runs likewise. `python -m tests.faults` is driven through its `main`, with each
campaign's scenario run replaced by a fake that writes into its directory."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tests.faults.__main__ as faults
from tests.faults import runner, spark_stream
from tests.faults.checker import Report
from tests.faults.consumer_checker import ConsumerHistory
from tests.faults.consumer_checker import Report as ConsumerReport
from tests.faults.consumer_checker import Violation as ConsumerViolation
from tests.faults.history import History
from tests.faults.replication_checker import ReplicationHistory
from tests.faults.replication_checker import Report as ReplicationReport
from tests.faults.runner import ScenarioSkipped

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


def made_at(root: Path) -> Callable[..., str]:
    """A tempfile.mkdtemp making `root`."""

    def mkdtemp(**_: Any) -> str:
        root.mkdir()
        return str(root)

    return mkdtemp


def fake_once(
    outside: Path, seen: list[list[str]], *, ok: bool = True
) -> Callable[[int, Path], Awaitable[spark_stream.Outcome]]:
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
    monkeypatch.setattr(tempfile, "mkdtemp", made_at(root))
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
    monkeypatch.setattr(tempfile, "mkdtemp", made_at(root))
    monkeypatch.setattr(spark_stream, "run_once", fake_once(outside, [], ok=False))
    assert spark_stream.main(["--runs", "1", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "spark-stream seed 3: FAILED" in out
    assert f"kept in {root / 'run-0'}" in out
    assert "replay: python -m tests.faults.spark_stream --seed 3" in out
    assert (root / "run-0" / "ckpt-parquet" / "0").exists()


# ---- the shared runner's pieces ----------------------------------------------------------------


@pytest.mark.parametrize(("campaign", "name", "attribute", "history"), CAMPAIGNS)
def test_the_replay_names_the_flags_that_shape_the_run(
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
        monkeypatch, attribute, fake_run(campaign, outside, ok=False),
        "--scenario", name, "--seed", "7", "--workdir", str(tmp_path / "work"), "--loopback",
        "--cycles", "3", "--budget", "42.5",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    replay = f"python -m tests.faults --scenario {name} --seed 7 --loopback --cycles 3 --budget 42.5"  # fmt: skip
    assert f"  replay: {replay}\n" in out


def test_cleaning_a_directory_removes_symlinks_and_follows_none(
    tmp_path: Path, outside: Path
) -> None:
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "a.log").write_text("")
    (work / "logs" / "out").symlink_to(outside, target_is_directory=True)  # Nested.
    (work / "real").mkdir()
    (work / "real" / "x").write_text("")
    (work / "in").symlink_to(work / "real", target_is_directory=True)
    (work / "out").symlink_to(outside, target_is_directory=True)
    (work / "file").symlink_to(outside / "precious")
    (work / "dangling").symlink_to(tmp_path / "nothing")
    (work / "history.json").write_text("{}")
    runner.clean_workdir(work, keep=("history.json",))
    assert sorted(os.listdir(work)) == ["history.json"]
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (outside / "precious").read_text() == "keep me"


def test_a_fresh_directory_replaces_a_symlink_or_a_file_and_empties_a_directory(
    tmp_path: Path, outside: Path
) -> None:
    (tmp_path / "link").symlink_to(outside, target_is_directory=True)
    (tmp_path / "file").write_text("")
    (tmp_path / "full" / "sub").mkdir(parents=True)
    for name in ("link", "file", "full", "new/deeper"):
        made = runner.fresh_workdir(tmp_path / name)
        assert made.is_dir() and not made.is_symlink() and list(made.iterdir()) == []
    assert sorted(os.listdir(outside)) == ["precious"]


@dataclass
class Recorder:
    cycles: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text)


async def test_cycles_run_to_their_count_each_noted() -> None:
    done: list[str] = []

    async def kill(ctx: list[str]) -> None:
        ctx.append("kill")

    async def stop(ctx: list[str]) -> None:
        ctx.append("stop")

    history = Recorder()
    far = time.monotonic() + 3600
    await runner.run_cycles(done, history, random.Random(1), count=3, deadline=far, cycle=kill)
    assert done == ["kill"] * 3 and history.cycles == 3
    assert history.notes == ["cycle 1: kill", "cycle 2: kill", "cycle 3: kill"]
    # Mixed: drawn by the rng, as rng.choice draws them (a seed replays the same schedule).
    mixed = Recorder()
    done.clear()
    await runner.run_cycles(
        done, mixed, random.Random(2), count=6, deadline=far, cycle=None, mixed=(kill, stop)
    )
    expected = random.Random(2)
    assert done == [expected.choice(["kill", "stop"]) for _ in range(6)]
    assert mixed.cycles == 6


async def test_cycles_stop_at_the_deadline_and_say_so() -> None:
    ran: list[int] = []
    history = Recorder()

    async def cycle(ctx: list[int]) -> None:
        ctx.append(1)

    past = time.monotonic() - 1
    await runner.run_cycles(ran, history, random.Random(1), count=5, deadline=past, cycle=cycle)
    assert ran == [] and history.cycles == 0
    assert history.notes == ["time budget reached after 0 cycles"]


def test_every_campaign_runs_through_the_one_runner() -> None:
    """Each campaign of `python -m tests.faults` is a `Campaign` of the shared runner, and no
    module of the campaigns removes a directory or makes a work directory on its own."""
    assert [c.name for c in faults.CAMPAIGNS] == ["brokers", "replication", "consumers"]
    assert sorted(n for c in faults.CAMPAIGNS for n in c.scenarios) == sorted(faults.ALL_SCENARIOS)  # fmt: skip
    for module in (faults, spark_stream):
        source = Path(module.__file__ or "").read_text()
        assert "rmtree" not in source and "mkdtemp" not in source, module.__name__


def test_a_run_of_two_campaigns_prints_their_tables_in_order_and_writes_them(
    tmp_path: Path,
    outside: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The runner alone, with campaigns of fake scenarios: a table per campaign that ran one,
    in the campaigns' order, also written to --table; a passing run's root removed."""

    @dataclass
    class Fake:
        name: str
        summary: str
        default: bool = True

    def campaign(label: str, ok: bool) -> runner.Campaign[Any]:
        async def run(scenario: Fake, seed: int, workdir: Path, options: runner.Options) -> Any:
            (workdir / "out").symlink_to(outside, target_is_directory=True)
            history, report = outcome("brokers", scenario.name, seed, ok)
            return history, report, 2.0

        def table(rows: list[tuple[Any, float]]) -> str:
            return f"{label}: " + ", ".join(f"{r.scenario} {w:.0f} s" for r, w in rows)

        return runner.Campaign(label, {f"{label}-a": Fake(f"{label}-a", "a fake")}, run, "h.json", table)  # fmt: skip

    first, second, third = campaign("one", True), campaign("two", True), campaign("three", True)
    root, table_file = tmp_path / "root", tmp_path / "table.md"
    monkeypatch.setattr(tempfile, "mkdtemp", made_at(root))
    run = runner.Runner(None, prefix="faults-", keep=False)
    code = asyncio.run(
        runner.run_campaigns(
            [first, second, third], ["two-a", "one-a"], 9, runner.Options(), run, str(table_file)
        )
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.endswith("\none: one-a 2 s\n\ntwo: two-a 2 s\n")
    assert table_file.read_text() == "one: one-a 2 s\n\ntwo: two-a 2 s\n"
    assert not root.exists() and sorted(os.listdir(outside)) == ["precious"]
