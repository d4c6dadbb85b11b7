"""The fault campaigns' one runner: what brokers, replication, consumers and spark-stream share.

A campaign supplies only what is its own (its scenarios, the run of one: harness, workload and
checker, the file its history is saved to, and its results table); the runner does the rest the
same way for every one of them:

* a scenario's directory is made afresh under the run's root (`--workdir`, else a new temporary
  directory): whatever was there is removed first, a symlink unlinked, never followed;
* a passing scenario keeps its history alone (or every file with `--keep`): the rest of its
  directory is removed, a symlink in it unlinked and what it points to left alone, in the
  directory or out of it (`clean_workdir`);
* a failing one (a violation, or a run that raised) keeps everything, and its path and the
  command that replays it (seed and the flags that shape the run) are printed;
* a scenario this machine cannot run (`ScenarioSkipped`) is skipped, no failure;
* the exit status is 1 if any scenario failed, and the root is removed only when every scenario
  passed, nothing was to be kept and no `--workdir` was given (else its path is printed);
* within a scenario, fault cycles run until their count or the budget's deadline
  (`run_cycles`), each noted in the history.

Every process a scenario starts is its harness's, stopped by its pid in the harness's `close`
(`tests/faults/harness.py`'s `_stop`); the runner starts none.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

Say = Callable[[str], None]


class ScenarioSkipped(RuntimeError):
    """A scenario this machine cannot run (no network namespaces, no PostgreSQL, ...)."""


class Verdict(Protocol):
    """A checker's report, as the runner reads it."""

    @property
    def ok(self) -> bool: ...

    def summary(self) -> str: ...


class Saved(Protocol):
    def save(self, path: Path) -> None: ...


class Recorded(Protocol):
    """A history, as the cycle loop writes it."""

    cycles: int

    def note(self, text: str) -> None: ...


R = TypeVar("R", bound=Verdict)
C = TypeVar("C")


# ---- directories ------------------------------------------------------------------------------


def remove(path: Path) -> None:
    """Remove `path`: a symlink (to a directory or not) is unlinked, never followed."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_workdir(workdir: Path, keep: Collection[str] = ()) -> None:
    """Remove everything in `workdir` but the entries named in `keep`. A symlink in it is removed
    and what it points to (in `workdir` or out of it) is left as it is."""
    for child in workdir.iterdir():
        if child.name not in keep:
            remove(child)


def fresh_workdir(path: Path) -> Path:
    """An empty directory at `path`, whatever was there removed first (a symlink unlinked, not
    followed: what it pointed to stays)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# ---- a campaign's options, seed and replay -----------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What the command line gives every scenario's run."""

    cycles: int | None = None  # Fault cycles per scenario (None: the scenario's own).
    budget: float | None = None  # Seconds per scenario (None: the campaign's or scenario's own).
    namespaces: bool | None = None  # False: loopback only (--loopback); None: if available.
    tls: bool = False
    auth: bool = False

    def flags(self) -> list[str]:
        """The command-line flags that shape a run as these options do (for its replay)."""
        return [
            *(["--loopback"] if self.namespaces is False else []),
            *(["--tls"] if self.tls else []),
            *(["--auth"] if self.auth else []),
            *(["--cycles", str(self.cycles)] if self.cycles is not None else []),
            *(["--budget", f"{self.budget:g}"] if self.budget is not None else []),
        ]


def pick_seed(seed: int | None) -> int:
    """`seed`, or a new one when none was given."""
    return seed if seed is not None else secrets.randbelow(1 << 31)


def replay_command(name: str, seed: int, options: Options) -> str:
    return " ".join(["python -m tests.faults", "--scenario", name, "--seed", str(seed), *options.flags()])  # fmt: skip


# ---- the process ------------------------------------------------------------------------------


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.ERROR)
    if not verbose:
        # Readers report frames torn by a reset-head's new epoch; the checker judges them.
        logging.getLogger("message").setLevel(logging.CRITICAL)


def _dump_tasks() -> None:
    """SIGUSR1: print every task's stack (what a stuck run waits for)."""
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def dump_tasks_on_sigusr1() -> None:
    """In the running loop: SIGUSR1 prints every task's stack (removed as the loop closes)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)


# ---- running scenarios ------------------------------------------------------------------------


class Runner:
    """Runs scenarios, each in a fresh directory under one root; keeps what a failure leaves,
    cleans what a pass leaves, and knows whether any failed."""

    def __init__(
        self, workdir: str | Path | None, *, prefix: str, keep: bool, say: Say = print
    ) -> None:
        self.given = bool(workdir)
        self.root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=prefix))
        self.keep = keep
        self.say = say
        self.failed = False

    async def attempt(
        self,
        dirname: str,
        replay: str,
        run: Callable[[Path], Awaitable[tuple[Saved | None, R, float]]],
        *,
        history: str | None,
        indent: str = "  ",
        kept: str = "history and logs",
    ) -> tuple[R, float] | None:
        """Run `run` in the fresh directory `dirname`; its report and wall time (None if it was
        skipped or raised). `history`: the file its history is saved to, all that a passing run
        keeps (None: it saves none). `indent`: the report summary's; `kept`: what a failing run's
        directory is said to hold."""
        workdir = fresh_workdir(self.root / dirname)
        try:
            saved, report, wall = await run(workdir)
        except ScenarioSkipped as exc:
            self.say(f"  skipped: {exc}")
            return None
        except Exception as exc:
            self.failed = True
            self.say(f"  FAILED to run: {type(exc).__name__}: {exc}")
            self.say(f"  logs in {workdir}; replay: {replay}")
            sys.stdout.flush()
            return None
        if saved is not None and history is not None:
            saved.save(workdir / history)
        self.say(indent + report.summary().replace("\n", "\n" + indent))
        if not report.ok:
            self.failed = True
            self.say(f"  {kept} kept in {workdir}")
            self.say(f"  replay: {replay}")
        elif not self.keep and history is None:
            remove(workdir)  # Nothing of a passing run without a history is kept.
        elif not self.keep:
            clean_workdir(workdir, keep=(history,))
        sys.stdout.flush()
        return report, wall

    def finish(self, what: str) -> int:
        """Remove the root if every scenario passed and nothing is to be kept, else name it (as
        holding `what`); the exit status."""
        if not self.failed and not self.keep and not self.given:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            self.say(f"{what} under {self.root}")
        return 1 if self.failed else 0


class Scenario(Protocol):
    @property
    def summary(self) -> str: ...


RunScenario = Callable[[Any, int, Path, Options], Awaitable[tuple[Saved, R, float]]]


@dataclass(frozen=True)
class Campaign(Generic[R]):
    """What one campaign has of its own."""

    name: str  # Its flag (--brokers) and the table's place.
    scenarios: Mapping[str, Scenario]
    run: RunScenario[R]  # One scenario under a seed in a directory, with the options.
    history: str  # The file its histories are saved to.
    table: Callable[[list[tuple[R, float]]], str]

    def default_scenarios(self) -> list[str]:
        """The scenarios of a run that names none (those not marked `default=False`)."""
        return [n for n, s in self.scenarios.items() if getattr(s, "default", True)]


async def run_campaigns(
    campaigns: Sequence[Campaign[Any]],
    names: Sequence[str],
    seed: int,
    options: Options,
    runner: Runner,
    table_path: str | None = None,
) -> int:
    """Run scenarios `names` (each of one of `campaigns`) under `seed`; print each campaign's
    table (and write them to `table_path`); the exit status."""
    say = runner.say
    rows: dict[str, list[tuple[Any, float]]] = {c.name: [] for c in campaigns}
    for name in names:
        campaign = next(c for c in campaigns if name in c.scenarios)
        scenario = campaign.scenarios[name]
        say(f"{name} (seed {seed}): {scenario.summary}")
        sys.stdout.flush()

        def run(workdir: Path, c: Campaign[Any] = campaign, s: Scenario = scenario) -> Any:
            return c.run(s, seed, workdir, options)

        result = await runner.attempt(
            name, replay_command(name, seed, options), run, history=campaign.history
        )
        if result is not None:
            rows[campaign.name].append(result)
    say("")
    tables = [c.table(rows[c.name]) for c in campaigns if rows[c.name]]
    say("\n\n".join(tables))
    if table_path:
        Path(table_path).write_text("\n\n".join(tables) + "\n")
    return runner.finish("histories")


# ---- within a scenario ------------------------------------------------------------------------


async def run_cycles(
    ctx: C,
    history: Recorded,
    rng: random.Random,
    *,
    count: int,
    deadline: float,
    cycle: Callable[[C], Awaitable[None]] | None,
    mixed: Sequence[Callable[[C], Awaitable[None]]] = (),
) -> None:
    """Up to `count` fault cycles, until `deadline` (time.monotonic()): each drawn by `rng`
    from `mixed` when there is one, else `cycle`; each noted in `history` and counted once
    done."""
    for n in range(count):
        if time.monotonic() > deadline:
            history.note(f"time budget reached after {n} cycles")
            break
        chosen = rng.choice(mixed) if mixed else cycle
        assert chosen is not None, "a scenario has a cycle or cycles to mix"
        history.note(f"cycle {n + 1}: {chosen.__name__}")
        await chosen(ctx)
        history.cycles = n + 1
