"""Benchmarks measured at several sizes in turn (journal_scale, shard_scale): the sizes, from an
environment variable or the benchmark's own, and the loop that measures each size and keeps a
size that failed as a figure of its own, so that the sizes that completed are still reported."""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

Measure = Callable[[int, bool], Coroutine[Any, Any, dict[str, Any]]]


class Partial(TimeoutError):
    """A size that did not settle, with the figures it got (reported beside its error)."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def sizes(env: str, default: tuple[int, ...], quick_sizes: tuple[int, ...], quick: bool) -> tuple[int, ...]:  # fmt: skip
    """`quick_sizes` under `--quick`; otherwise the comma-separated sizes in the environment
    variable `env` (`JOURNAL_SCALE_SIZES=1000,10000`), or `default` without it."""
    if quick:
        return quick_sizes
    listed = os.environ.get(env)
    return tuple(int(s) for s in listed.split(",")) if listed else default


def each_size(measure: Measure, ns: tuple[int, ...], quick: bool) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """`measure(n, quick)` of each size, each in its own event loop: the figures of each size
    that completed, and `n{N}_error` of each that raised (with `n{N}_{figure}` of what a `Partial`
    got). Under `--quick` an error is raised, not kept; with no size completed, RuntimeError."""
    results: dict[int, dict[str, Any]] = {}
    failed: dict[str, Any] = {}
    for n in ns:
        try:
            results[n] = asyncio.run(measure(n, quick))
        except Exception as exc:
            if quick:
                raise
            traceback.print_exc()
            # A size the cluster cannot take in time is a figure too: the others are kept.
            failed[f"n{n}_error"] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, Partial):
                failed.update({f"n{n}_{k}": v for k, v in exc.figures.items()})
    if not results:
        raise RuntimeError(f"no size completed: {failed}")
    return results, failed
