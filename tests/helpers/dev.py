"""`gazctl dev` clusters in the tests: the command, the environment it exports, a journal
applied and appended to through one, and every broker stopped gracefully."""

from __future__ import annotations

from pathlib import Path

from gazctl.dev import ClusterState, is_running
from tests.conftest import Result, run_cli
from tests.helpers.waiting import until_blocking

JOURNAL = "dev/suspended"


SPEC = (
    f"name: {JOURNAL}\nreplication: 2\nfragment:\n  length: 1048576\n"
    "  compression_codec: NONE\n  stores:\n    - file:///dev/\n  refresh_interval: 1m0s\n"
)


def dev(cluster_dir: Path, *args: str, timeout: float = 120) -> Result:
    return run_cli("gazctl", "dev", args[0], "--dir", str(cluster_dir), *args[1:], timeout=timeout)


def exported(out: str) -> dict[str, str]:
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in out.splitlines()
        if line.startswith("export ")
    )


def stop_every_broker_gracefully(cluster_dir: Path) -> None:
    """SIGTERM broker-1, then broker-0 (the last one flushes and suspends), each until gone."""
    state = ClusterState.load(cluster_dir)
    assert state is not None
    for broker in reversed(state.brokers):
        assert dev(cluster_dir, "kill", "--signal", "TERM", broker.role).code == 0
        until_blocking(lambda b=broker: not is_running(b), f"{broker.role} stopped by SIGTERM", 90)


def append_held(address: str, tmp_path: Path) -> None:
    """Apply `flush/j` (one replica, its store file:///flush/) through `address` and append
    `held\n` to it with gazctl, both checked."""
    env = {"BROKER_ADDRESS": address}
    specs = tmp_path / "journal.yaml"
    specs.write_text(
        "name: flush/j\nreplication: 1\nfragment:\n  length: 1048576\n"
        "  compression_codec: NONE\n  stores:\n    - file:///flush/\n  refresh_interval: 1m0s\n"
    )
    applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
    assert applied.code == 0, applied.err
    appended = run_cli(
        "gazctl", "journals", "append", "-l", "name=flush/j", input="held\n", env=env
    )
    assert appended.code == 0, appended.err
