"""The fault campaign: `python -m tests.faults` (what `nox -s faults` runs).

    python -m tests.faults                          # every scenario, a fresh seed
    python -m tests.faults --seed 1234              # every scenario under seed 1234
    python -m tests.faults --scenario sigstop --seed 1234   # replay one scenario of that run
    python -m tests.faults --check history.json     # check a saved history again

Each scenario prints its seed and the command that replays it; the campaign ends with the table
of docs/reliability.md (`--table FILE` writes it) and exits 1 if the checker found a violation.
A failing scenario's history and logs are kept (the path is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.faults.checker import Report, check
from tests.faults.history import History
from tests.faults.network import namespaces_unavailable
from tests.faults.scenarios import SCENARIOS, ScenarioSkipped, run_scenario


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


def _dump_tasks() -> None:
    """SIGUSR1: print every task's stack (what a stuck run waits for)."""
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


async def campaign(args: argparse.Namespace) -> int:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
    names = args.scenario or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(1 << 31)
    namespaces = False if args.loopback else None
    secure = " with TLS" * args.tls + " with authorization" * args.auth
    print(f"fault campaign{secure}: seed {seed}, scenarios {', '.join(names)}")
    if not args.loopback and namespaces_unavailable():
        print(f"  network namespaces unavailable ({namespaces_unavailable()}): loopback only")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gazette-faults-"))
    rows: list[tuple[Report, float]] = []
    failed = False
    for name in names:
        scenario = SCENARIOS[name]
        workdir = root / name
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        print(f"{name} (seed {seed}): {scenario.summary}", flush=True)
        try:
            history, report, wall = await run_scenario(
                scenario, seed, workdir, cycles=args.cycles, budget=args.budget,
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
        history.save(workdir / "history.json")
        rows.append((report, wall))
        print("  " + report.summary().replace("\n", "\n  "))
        if not report.ok:
            failed = True
            print(f"  history and logs kept in {workdir}")
            print(f"  replay: python -m tests.faults --scenario {name} --seed {seed}")
        elif not args.keep:
            # Keep the history (the table's evidence), not the logs, spools and stores.
            for child in workdir.iterdir():
                if child.name != "history.json":
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink()
        sys.stdout.flush()
    print()
    print(table(rows))
    if args.table:
        Path(args.table).write_text(table(rows) + "\n")
    if not failed and not args.keep and not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"histories under {root}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, help="seed of every scenario (default: a new one)")
    parser.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="run only these (repeat)"
    )
    parser.add_argument("--cycles", type=int, help="fault cycles per scenario (default: its own)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per scenario")
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
        logging.getLogger("broker.message").setLevel(logging.CRITICAL)
    if args.check:
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
