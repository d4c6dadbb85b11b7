"""The fault campaign: `python -m tests.faults` (what `nox -s faults` runs).

    python -m tests.faults                          # every scenario, a fresh seed
    python -m tests.faults --seed 1234              # every scenario under seed 1234
    python -m tests.faults --scenario sigstop --seed 1234   # replay one scenario of that run
    python -m tests.faults --check history.json.gz  # check a saved history again

Each scenario prints its seed and the command that replays it; the campaign ends with the table
of docs/reliability.md (`--table FILE` writes it) and exits 1 if the checker found a violation.
A failing scenario's history and logs are kept (the path is printed).

The replication scenarios (`tests/faults/replication_scenarios.py`: a network of locations on
broker clusters of their own, under location faults) run after the broker ones and print a table
of their own, and so do the consumer scenarios (`tests/faults/consumer_scenarios.py`: stream-sum
on each store under consumer, broker, etcd and PostgreSQL faults); `--brokers`, `--replication`
and `--consumers` run only that group (any two together, those two).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.faults.checker import Report, check
from tests.faults.consumer_checker import ConsumerHistory
from tests.faults.consumer_checker import Report as ConsumerReport
from tests.faults.consumer_checker import check as check_consumers
from tests.faults.consumer_harness import EVIDENCE
from tests.faults.consumer_scenarios import CONSUMER_SCENARIOS, run_consumer_scenario
from tests.faults.history import History, read_json_bytes
from tests.faults.network import namespaces_unavailable
from tests.faults.replication_checker import ReplicationHistory
from tests.faults.replication_checker import Report as ReplicationReport
from tests.faults.replication_checker import check as check_replication
from tests.faults.replication_scenarios import REPLICATION_SCENARIOS, run_replication_scenario
from tests.faults.scenarios import SCENARIOS, ScenarioSkipped, run_scenario

ALL_SCENARIOS = [*SCENARIOS, *REPLICATION_SCENARIOS, *CONSUMER_SCENARIOS]


def table(rows: list[tuple[Report, float]]) -> str:
    lines = [
        "| scenario | seed | cycles | acknowledged appends | acknowledged messages | lost "
        "| duplicated | offsets written twice | longest unavailability | wall time | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, wall in rows:
        lost = f"{r.lost}" + (
            f" (+{r.lost_to_reset} with every replica)" if r.lost_to_reset else ""
        )
        lines.append(
            f"| {r.scenario} | {r.seed} | {r.cycles} | {r.acked_appends} | {r.acked_messages} "
            f"| {lost} | {r.duplicated} | {r.conflicts} | {r.longest_unavailability:.1f} s "
            f"| {wall:.0f} s | {len(r.violations)} |"
        )
    total = [r for r, _ in rows]
    lines.append(
        f"| **all** | | {sum(r.cycles for r in total)} | {sum(r.acked_appends for r in total)} "
        f"| {sum(r.acked_messages for r in total)} | {sum(r.lost for r in total)} "
        f"| {sum(r.duplicated for r in total)} | {sum(r.conflicts for r in total)} "
        f"| {max((r.longest_unavailability for r in total), default=0):.1f} s "
        f"| {sum(w for _, w in rows):.0f} s | {sum(len(r.violations) for r in total)} |"
    )
    return "\n".join(lines)


def replication_table(rows: list[tuple[ReplicationReport, float]]) -> str:
    lines = [
        "| scenario | seed | cycles | acknowledged emits | indeterminate | events checked "
        "| duplicated | reused times | out of causal order | missing | lost to a disaster "
        "| longest unavailability | wall time | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, wall in rows:
        lines.append(
            f"| {r.scenario} | {r.seed} | {r.cycles} | {r.acked} | {r.indeterminate} "
            f"| {r.events_checked} | {r.duplicates} | {r.reused_times} | {r.order_violations} "
            f"| {r.missing} | {r.lost_to_disaster} | {r.longest_unavailability:.1f} s "
            f"({r.unavailable_location or '-'}) | {wall:.0f} s | {r.violation_count} |"
        )
    total = [r for r, _ in rows]
    lines.append(
        f"| **all** | | {sum(r.cycles for r in total)} | {sum(r.acked for r in total)} "
        f"| {sum(r.indeterminate for r in total)} | {sum(r.events_checked for r in total)} "
        f"| {sum(r.duplicates for r in total)} | {sum(r.reused_times for r in total)} "
        f"| {sum(r.order_violations for r in total)} | {sum(r.missing for r in total)} "
        f"| {sum(r.lost_to_disaster for r in total)} "
        f"| {max((r.longest_unavailability for r in total), default=0):.1f} s "
        f"| {sum(w for _, w in rows):.0f} s | {sum(r.violation_count for r in total)} |"
    )
    return "\n".join(lines)


def consumer_table(rows: list[tuple[ConsumerReport, float]]) -> str:
    lines = [
        "| scenario | store | seed | cycles | chunks acknowledged | in doubt | streams | exact sums "
        "| wrong | duplicated | missing | zombie commits | FAILED (own fault) "
        "| fenced / stray / take-overs / hints reads retried | wall time | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, wall in rows:
        lines.append(
            f"| {r.scenario} | {r.store} | {r.seed} | {r.cycles} | {r.chunks} | {r.indeterminate} "
            f"| {r.streams} | {r.exact} | {r.count('wrong-sum')} | {r.count('duplicate-sum')} "
            f"| {r.count('missing-sum')} | {r.count('zombie-commit')} "
            f"| {r.count('failed-shard')} ({r.failed_excused}) | {_evidence(r.evidence)} "
            f"| {wall:.0f} s | {len(r.violations)} |"
        )
    t = [r for r, _ in rows]
    lines.append(
        f"| **all** | | | {sum(r.cycles for r in t)} | {sum(r.chunks for r in t)} "
        f"| {sum(r.indeterminate for r in t)} | {sum(r.streams for r in t)} "
        f"| {sum(r.exact for r in t)} | {sum(r.count('wrong-sum') for r in t)} "
        f"| {sum(r.count('duplicate-sum') for r in t)} | {sum(r.count('missing-sum') for r in t)} "
        f"| {sum(r.count('zombie-commit') for r in t)} "
        f"| {sum(r.count('failed-shard') for r in t)} ({sum(r.failed_excused for r in t)}) "
        f"| {_evidence({k: sum(r.evidence.get(k, 0) for r in t) for k in EVIDENCE})} "
        f"| {sum(w for _, w in rows):.0f} s | {sum(len(r.violations) for r in t)} |"
    )
    return "\n".join(lines)


def _evidence(counts: dict[str, int]) -> str:
    """Zombie commits refused by a fence, stray bytes read past, standby take-overs, replicas'
    hints reads retried through etcd's restarts (from the summers' logs)."""
    return " / ".join(str(counts.get(k, 0)) for k in EVIDENCE)


def _dump_tasks() -> None:
    """SIGUSR1: print every task's stack (what a stuck run waits for)."""
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


async def campaign(args: argparse.Namespace) -> int:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
    if args.scenario:
        names = args.scenario
    else:
        groups = {"brokers": args.brokers, "replication": args.replication, "consumers": args.consumers}  # fmt: skip
        every = not any(groups.values())
        names = [
            *(SCENARIOS if every or args.brokers else []),
            *(
                [n for n, s in REPLICATION_SCENARIOS.items() if s.default]
                if every or args.replication
                else []
            ),
            *(
                [n for n, s in CONSUMER_SCENARIOS.items() if s.default]
                if every or args.consumers
                else []
            ),
        ]
    unknown = [n for n in names if n not in ALL_SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {', '.join(ALL_SCENARIOS)}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(1 << 31)
    namespaces = False if args.loopback else None
    secure = " with TLS" * args.tls + " with authorization" * args.auth
    print(f"fault campaign{secure}: seed {seed}, scenarios {', '.join(names)}")
    if not args.loopback and namespaces_unavailable():
        print(f"  network namespaces unavailable ({namespaces_unavailable()}): loopback only")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gazette-faults-"))
    rows: list[tuple[Report, float]] = []
    replication_rows: list[tuple[ReplicationReport, float]] = []
    consumer_rows: list[tuple[ConsumerReport, float]] = []
    failed = False
    for name in names:
        if name in CONSUMER_SCENARIOS:
            failed |= not await _consumers(args, name, seed, root, namespaces, consumer_rows)
            continue
        if name in REPLICATION_SCENARIOS:
            failed |= not await _replication(args, name, seed, root, namespaces, replication_rows)
            continue
        scenario = SCENARIOS[name]
        workdir = root / name
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        print(f"{name} (seed {seed}): {scenario.summary}", flush=True)
        try:
            history, report, wall = await run_scenario(
                scenario, seed, workdir, cycles=args.cycles, budget=args.budget or 60.0,
                namespaces=namespaces, tls=args.tls, auth=args.auth,
            )  # fmt: skip
        except ScenarioSkipped as exc:
            print(f"  skipped: {exc}")
            continue
        except Exception as exc:
            failed = True
            print(f"  FAILED to run: {type(exc).__name__}: {exc}")
            print(
                f"  logs in {workdir}; replay: python -m tests.faults --scenario {name} --seed {seed}"
            )
            continue
        history.save(workdir / "history.json.gz")
        rows.append((report, wall))
        print("  " + report.summary().replace("\n", "\n  "))
        if not report.ok:
            failed = True
            print(f"  history and logs kept in {workdir}")
            print(f"  replay: python -m tests.faults --scenario {name} --seed {seed}")
        elif not args.keep:
            # Keep the history (the table's evidence), not the logs, spools and stores.
            for child in workdir.iterdir():
                if child.name != "history.json.gz":
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink()
        sys.stdout.flush()
    print()
    tables = []
    if rows:
        tables.append(table(rows))
    if replication_rows:
        tables.append(replication_table(replication_rows))
    if consumer_rows:
        tables.append(consumer_table(consumer_rows))
    print("\n\n".join(tables))
    if args.table:
        Path(args.table).write_text("\n\n".join(tables) + "\n")
    if not failed and not args.keep and not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"histories under {root}")
    return 1 if failed else 0


async def _replication(
    args: argparse.Namespace,
    name: str,
    seed: int,
    root: Path,
    namespaces: bool | None,
    rows: list[tuple[ReplicationReport, float]],
) -> bool:
    """Run replication scenario `name` as `campaign` runs a broker one; whether it passed."""
    scenario = REPLICATION_SCENARIOS[name]
    workdir = root / name
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    print(f"{name} (seed {seed}): {scenario.summary}", flush=True)
    replay = f"python -m tests.faults --scenario {name} --seed {seed}"
    try:
        history, report, wall = await run_replication_scenario(
            scenario, seed, workdir, cycles=args.cycles, budget=args.budget, namespaces=namespaces
        )
    except ScenarioSkipped as exc:
        print(f"  skipped: {exc}")
        return True
    except Exception as exc:
        print(f"  FAILED to run: {type(exc).__name__}: {exc}")
        print(f"  logs in {workdir}; replay: {replay}")
        return False
    history.save(workdir / "history.json")
    rows.append((report, wall))
    print("  " + report.summary().replace("\n", "\n  "))
    if not report.ok:
        print(f"  history and logs kept in {workdir}")
        print(f"  replay: {replay}")
        return False
    if not args.keep:
        for child in workdir.iterdir():
            if child.name != "history.json":
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()
    sys.stdout.flush()
    return True


async def _consumers(
    args: argparse.Namespace,
    name: str,
    seed: int,
    root: Path,
    namespaces: bool | None,
    rows: list[tuple[ConsumerReport, float]],
) -> bool:
    """Run consumer scenario `name` as `campaign` runs a broker one; whether it passed."""
    scenario = CONSUMER_SCENARIOS[name]
    workdir = root / name
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    print(f"{name} (seed {seed}): {scenario.summary}", flush=True)
    replay = f"python -m tests.faults --scenario {name} --seed {seed}"
    try:
        history, report, wall = await run_consumer_scenario(
            scenario, seed, workdir, cycles=args.cycles, budget=args.budget, namespaces=namespaces
        )
    except ScenarioSkipped as exc:
        print(f"  skipped: {exc}")
        return True
    except Exception as exc:
        print(f"  FAILED to run: {type(exc).__name__}: {exc}")
        print(f"  logs in {workdir}; replay: {replay}")
        return False
    history.save(workdir / "history.json")
    rows.append((report, wall))
    print("  " + report.summary().replace("\n", "\n  "))
    if not report.ok:
        print(f"  history and logs kept in {workdir}")
        print(f"  replay: {replay}")
        return False
    if not args.keep:
        for child in workdir.iterdir():
            if child.name != "history.json":
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()
    sys.stdout.flush()
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, help="seed of every scenario (default: a new one)")
    parser.add_argument(
        "--scenario", action="append", choices=ALL_SCENARIOS, help="run only these (repeat)"
    )
    parser.add_argument("--replication", action="store_true", help="only the replication scenarios")  # fmt: skip
    parser.add_argument("--brokers", action="store_true", help="only the broker scenarios")
    parser.add_argument("--consumers", action="store_true", help="only the consumer scenarios")
    parser.add_argument("--spark-stream", action="store_true", help="only the Spark Structured Streaming scenario (tests.faults.spark_stream; --cycles: its runs)")  # fmt: skip
    parser.add_argument("--cycles", type=int, help="fault cycles per scenario (default: its own)")
    parser.add_argument(
        "--budget", type=float,
        help="seconds per scenario (default: 60 for broker scenarios, 85 for consumer ones, each replication one its own)",
    )  # fmt: skip
    parser.add_argument("--workdir", help="keep each scenario's logs and history under here")
    parser.add_argument("--keep", action="store_true", help="keep passing scenarios' files too")
    parser.add_argument("--loopback", action="store_true", help="no network namespaces")
    parser.add_argument("--tls", action="store_true", help="brokers and clients on TLS (client certificates required)")  # fmt: skip
    parser.add_argument("--auth", action="store_true", help="every call's token verified (brokers given auth keys)")  # fmt: skip
    parser.add_argument("--table", help="write the results table (markdown) to this file")
    parser.add_argument("--check", help="check a saved history.json again, and exit")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    if not args.verbose:
        # Readers report frames torn by a reset-head's new epoch; the checker judges them.
        logging.getLogger("message").setLevel(logging.CRITICAL)
    if args.spark_stream:
        from tests.faults import spark_stream

        runs = ["--runs", str(args.cycles or 5)]
        seed = ["--seed", str(args.seed)] if args.seed is not None else []
        workdir = ["--workdir", args.workdir] if args.workdir else []
        return spark_stream.main([*runs, *seed, *workdir])
    if args.check:
        document = json.loads(read_json_bytes(Path(args.check)))
        if "sums" in document:  # A consumer scenario's history.
            consumers = check_consumers(ConsumerHistory.load(Path(args.check)))
            print(consumers.summary())
            return 0 if consumers.ok else 1
        if "emits" in document:  # A replication scenario's history.
            replication = check_replication(ReplicationHistory.load(Path(args.check)))
            print(replication.summary())
            return 0 if replication.ok else 1
        report = check(History.load(Path(args.check)))
        print(report.summary())
        return 0 if report.ok else 1
    started = time.monotonic()
    try:
        return asyncio.run(campaign(args))
    finally:
        print(f"campaign took {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
