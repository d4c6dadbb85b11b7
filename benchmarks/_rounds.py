"""Measurements against a same-run baseline on a shared, noisy machine: the two are measured in
alternating rounds (ours, baseline, ours, baseline, ...) and each side is reported by its median
round, so that a burst of load from elsewhere lands on either side alike, and every round is
listed beside the figures."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Measure = Callable[[], dict[str, Any]]


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose `value` is the median (the lower middle one of an even count)."""
    return sorted(rounds, key=lambda r: r["value"])[(len(rounds) - 1) // 2]


def alternating(ours: Measure, baseline: Measure, pairs: int) -> tuple[dict[str, Any], dict[str, Any], float, list[str]]:  # fmt: skip
    """`pairs` rounds of each, alternating: the median round of each side, the median of the
    pairs' own ratios (`pair_ratio`) and every pair as "ours/baseline" values (see `paired`)."""
    mine: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for _ in range(pairs):
        mine.append(ours())
        theirs.append(baseline())
    pair_ratio, listed = paired(mine, theirs)
    return median_round(mine), median_round(theirs), pair_ratio, listed


def paired(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[float, list[str]]:
    """Rounds measured in pairs: the median of the pairs' own ratios (`pair_ratio`, rounded),
    and every pair as "ours/baseline" values."""
    zipped = list(zip(ours, theirs, strict=True))
    ratio = round(statistics.median(a["value"] / b["value"] for a, b in zipped), 2)
    return ratio, [f"{a['value']:.4g}/{b['value']:.4g}" for a, b in zipped]
