"""Short runs of the consumer fault campaign (`nox -s faults` runs it whole): stream-sum's
summers as processes over three brokers on loopback, under a recorded chunk workload, two cycles
of SIGKILL (SQLite recorded into recovery logs, with hot standbys) or SIGSTOP past the lease
(JSON files), and the checker's verdict. Each run uses a fresh seed (or GAZETTE_FAULT_SEED),
named on failure with the command that replays it.

`nox -s tests` runs `consumer-sigkill` (recorded SQLite, standbys) as the campaign's
representative; `consumer-sigstop`, which `nox -s faults` runs whole and tests/test_zombie.py's
fenced zombie primary covers in `nox -s tests`, is marked `faults` (`nox -s tests -- -m faults`
runs it)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from tests.faults.consumer_scenarios import CONSUMER_SCENARIOS, run_consumer_scenario


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["consumer-sigkill", pytest.param("consumer-sigstop", marks=pytest.mark.faults)]
)
async def test_a_short_consumer_fault_scenario_keeps_every_sum_exact(
    name: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("GAZETTE_FAULT_SEED") or secrets.randbelow(1 << 31))
    history, report, _ = await run_consumer_scenario(
        CONSUMER_SCENARIOS[name], seed, tmp_path, cycles=2, namespaces=False, say=lambda _: None
    )
    replay = f"python -m tests.faults --scenario {name} --seed {seed}"
    assert report.ok, f"{report.summary()}\nreplay: {replay}"
    assert history.cycles == 2, history.notes
    assert report.streams > 0 and report.exact == report.streams
