"""Short runs of the fault campaign (`nox -s faults` runs it whole): five broker processes on
loopback under a recorded workload, two cycles of SIGKILL, SIGSTOP or SIGTERM, and the history
checker's verdict. Each run uses a fresh seed (or GAZETTE_FAULT_SEED), named on failure with the
command that replays it.

`nox -s tests` runs SIGSTOP (zombie primaries) and SIGKILL with TLS and authorization; the plain
SIGKILL and SIGTERM runs, which those and `nox -s faults` cover, are marked `faults` (`nox -s tests
-- -m faults` runs them)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from tests.faults.scenarios import SCENARIOS, run_scenario


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("sigkill", marks=pytest.mark.faults),
        "sigstop",
        pytest.param("sigterm", marks=pytest.mark.faults),
    ],
)
async def test_a_short_fault_scenario_keeps_every_promise(name: str, tmp_path: Path) -> None:
    seed = int(os.environ.get("GAZETTE_FAULT_SEED") or secrets.randbelow(1 << 31))
    history, report, _ = await run_scenario(
        SCENARIOS[name], seed, tmp_path, cycles=2, namespaces=False, say=lambda _: None,
        crowd=(8, 16),
    )  # fmt: skip
    replay = f"python -m tests.faults --scenario {name} --seed {seed}"
    assert report.ok, f"{report.summary()}\nreplay: {replay}"
    assert history.cycles == 2, history.notes
    assert report.acked_appends > 0 and report.acked_messages > 0


@pytest.mark.slow
async def test_a_fault_scenario_keeps_every_promise_with_tls_and_authorization(
    tmp_path: Path,
) -> None:
    """The campaign unchanged but for TLS (client certificates required) and token checks on
    every call: the workload, the brokers' replication and proxying, and the checker's reads."""
    seed = int(os.environ.get("GAZETTE_FAULT_SEED") or secrets.randbelow(1 << 31))
    _, report, _ = await run_scenario(
        SCENARIOS["sigkill"], seed, tmp_path, cycles=2, namespaces=False, say=lambda _: None,
        tls=True, auth=True, crowd=(8, 16),
    )  # fmt: skip
    replay = f"python -m tests.faults --scenario sigkill --seed {seed} --tls --auth"
    assert report.ok, f"{report.summary()}\nreplay: {replay}"
    assert report.acked_appends > 0 and report.acked_messages > 0
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    assert "--broker.auth-keys" not in logs  # Flags are not logged.
    assert (tmp_path / "pki" / "ca.crt").exists()
