"""gazctl as a user runs it (a subprocess), and the one-line error a refused command prints."""

from __future__ import annotations

from tests.conftest import BrokerProcess, run_cli


def gazctl(broker: BrokerProcess, *args: str, **kw: object) -> object:
    env = {"BROKER_ADDRESS": broker.address}
    env.update(kw.pop("env", {}) or {})  # type: ignore[arg-type]
    return run_cli("gazctl", *args, env=env, **kw)  # type: ignore[arg-type]


def assert_one_line_error(r: object, *needles: str) -> None:
    assert r.code != 0
    assert "Traceback" not in r.err
    lines = [line for line in r.err.strip().splitlines() if line]
    assert len(lines) == 1, r.err
    for needle in needles:
        assert needle in lines[0], r.err
