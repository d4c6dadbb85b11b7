"""The benchmark runner behind `python -m benchmarks`: import each registered module lazily, call its
`run(quick)`, print one line per benchmark, and optionally write every result to one JSON file.

A benchmark module exposes `run(quick: bool = False) -> dict[str, Any]` returning at least `value`
and `unit`; `baseline` (same unit) and `ratio` (value / baseline: the fraction of the baseline
reached) where it measured a same-run baseline; any other fields are extra figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Run = Callable[..., dict[str, Any]]
REQUIRED = ("value", "unit")


class NotYetAvailable(Exception):
    """The benchmark's module does not exist (yet)."""


def load(module_name: str) -> Run:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the module itself missing is "not yet available"; a missing dependency inside it
        # is a real failure and propagates.
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise NotYetAvailable(f"not yet available (no module {module_name})") from None
        raise
    run: Run | None = getattr(module, "run", None)
    if run is None:
        raise NotYetAvailable(f"not yet available ({module_name} has no run())")
    return run


def check(name: str, result: object) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise TypeError(f"benchmark {name} returned {type(result).__name__}, expected a dict")
    missing = [k for k in REQUIRED if k not in result]
    if "baseline" in result and "ratio" not in result:
        missing.append("ratio")
    if missing:
        raise ValueError(f"benchmark {name} returned no {', '.join(missing)}")
    return result


def number(v: object) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int) or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def line(name: str, result: Mapping[str, Any], width: int) -> str:
    unit = result["unit"]
    text = f"{name:<{width}}  {number(result['value'])} {unit}"
    if "baseline" in result:
        text += f"   baseline {number(result['baseline'])} {unit}   ratio {number(result['ratio'])}"
    extras = [
        f"{k}={number(v)}" for k, v in result.items() if k not in {*REQUIRED, "baseline", "ratio"}
    ]
    if extras:
        text += "   " + " ".join(extras)
    return text


def parse(argv: list[str], names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run benchmarks, each beside a baseline measured in the same run.",
        epilog=f"benchmarks: {', '.join(names)}",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write all results to PATH")
    parser.add_argument(
        "--only", nargs="+", action="extend", metavar="NAME", help="run only these benchmarks"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, short runs (smoke test)")
    return parser.parse_args(argv)


def main(argv: list[str], registry: Mapping[str, str]) -> int:
    """Run the benchmarks of `registry` (name -> module) that `argv` asks for; return the exit status:
    0 if every one ran, 1 if one failed or an explicitly requested one is not yet available,
    2 for an unknown name."""
    args = parse(argv, list(registry))
    names: list[str] = list(dict.fromkeys(args.only)) if args.only else list(registry)
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(
            f"unknown benchmark {', '.join(unknown)}; known: {', '.join(registry)}",
            file=sys.stderr,
        )
        return 2

    width = max(map(len, names))
    results: dict[str, dict[str, Any]] = {}
    status = 0
    for name in names:
        try:
            run = load(registry[name])
        except NotYetAvailable as exc:
            print(f"{name:<{width}}  {exc}", flush=True)
            status = 1 if args.only else status
            continue
        started = time.monotonic()
        try:
            result = check(name, run(quick=args.quick))
        except Exception as exc:
            traceback.print_exc()
            print(f"{name:<{width}}  FAILED: {type(exc).__name__}: {exc}", flush=True)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            status = 1
            continue
        results[name] = result
        print(line(name, result, width) + f"   ({time.monotonic() - started:.0f} s)", flush=True)

    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return status
