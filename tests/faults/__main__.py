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

Each group is a `Campaign` of the one runner (`tests/faults/runner.py`), which makes and cleans
the scenarios' directories, reports failures and their replays, and sets the exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from tests.faults.checker import Report, check
from tests.faults.consumer_checker import ConsumerHistory
from tests.faults.consumer_checker import Report as ConsumerReport
from tests.faults.consumer_checker import check as check_consumers
from tests.faults.consumer_harness import EVIDENCE
from tests.faults.consumer_scenarios import (
    CONSUMER_SCENARIOS,
    ConsumerScenario,
    run_consumer_scenario,
)
from tests.faults.history import History, read_json_bytes
from tests.faults.network import namespaces_unavailable
from tests.faults.replication_checker import ReplicationHistory
from tests.faults.replication_checker import Report as ReplicationReport
from tests.faults.replication_checker import check as check_replication
from tests.faults.replication_scenarios import (
    REPLICATION_SCENARIOS,
    ReplicationScenario,
    run_replication_scenario,
)
from tests.faults.runner import (
    Campaign,
    Options,
    Runner,
    configure_logging,
    dump_tasks_on_sigusr1,
    pick_seed,
    run_campaigns,
)
from tests.faults.scenarios import SCENARIOS, Scenario, run_scenario

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


def _run_brokers(scenario: Scenario, seed: int, workdir: Path, o: Options) -> Awaitable[Any]:
    return run_scenario(
        scenario, seed, workdir, cycles=o.cycles, budget=o.budget, namespaces=o.namespaces,
        tls=o.tls, auth=o.auth,
    )  # fmt: skip


def _run_replication(
    scenario: ReplicationScenario, seed: int, workdir: Path, o: Options
) -> Awaitable[Any]:
    return run_replication_scenario(
        scenario, seed, workdir, cycles=o.cycles, budget=o.budget, namespaces=o.namespaces
    )


def _run_consumers(scenario: ConsumerScenario, seed: int, workdir: Path, o: Options) -> Awaitable[Any]:  # fmt: skip
    return run_consumer_scenario(
        scenario, seed, workdir, cycles=o.cycles, budget=o.budget, namespaces=o.namespaces
    )


# The campaigns, in the order of a default run and of its tables. Only the broker scenarios take
# --tls and --auth (the other harnesses run without them).
CAMPAIGNS: list[Campaign[Any]] = [
    Campaign("brokers", SCENARIOS, _run_brokers, "history.json.gz", table),
    Campaign("replication", REPLICATION_SCENARIOS, _run_replication, "history.json", replication_table),
    Campaign("consumers", CONSUMER_SCENARIOS, _run_consumers, "history.json", consumer_table),
]  # fmt: skip


async def campaign(args: argparse.Namespace) -> int:
    dump_tasks_on_sigusr1()
    if args.scenario:
        names = args.scenario
    else:
        chosen = [c for c in CAMPAIGNS if getattr(args, c.name)] or CAMPAIGNS
        names = [n for c in chosen for n in c.default_scenarios()]
    unknown = [n for n in names if n not in ALL_SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {', '.join(ALL_SCENARIOS)}", file=sys.stderr)
        return 2
    seed = pick_seed(args.seed)
    options = Options(
        cycles=args.cycles, budget=args.budget, namespaces=False if args.loopback else None,
        tls=args.tls, auth=args.auth,
    )  # fmt: skip
    secure = " with TLS" * args.tls + " with authorization" * args.auth
    print(f"fault campaign{secure}: seed {seed}, scenarios {', '.join(names)}")
    if not args.loopback and namespaces_unavailable():
        print(f"  network namespaces unavailable ({namespaces_unavailable()}): loopback only")
    runner = Runner(args.workdir, prefix="gazette-faults-", keep=args.keep)
    return await run_campaigns(CAMPAIGNS, names, seed, options, runner, args.table)


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
    configure_logging(args.verbose)
    if args.spark_stream:
        from tests.faults import spark_stream

        runs = ["--runs", str(args.cycles or 5)]
        seed = ["--seed", str(args.seed)] if args.seed is not None else []
        workdir = ["--workdir", args.workdir] if args.workdir else []
        verbose = ["--verbose"] if args.verbose else []
        return spark_stream.main([*runs, *seed, *workdir, *verbose])
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
