"""The fork server the tests' `gazctl` runs start from (tests/helpers/cli_fork.py) gives a run what
a fresh `python -m` process gets: its arguments, stdin, environment and directory, its stdout,
stderr and exit code, and a kill when it outlives its timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli_fork import ForkServer


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    started = ForkServer()
    try:
        yield started
    finally:
        started.stop()


def fresh(module: str, *args: str, **kw: object) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        **kw,  # type: ignore[call-overload]
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_a_run_reads_its_stdin_and_directory_as_a_fresh_process_does(
    server: ForkServer, tmp_path: Path
) -> None:
    (tmp_path / "in.json").write_text('{"b": [1, 2], "a": null}')
    env = dict(os.environ)
    assert server.run("json.tool", ["--sort-keys"], '{"z": 1, "y": 2}', env, None, 30) == fresh(
        "json.tool", "--sort-keys", input='{"z": 1, "y": 2}'
    )
    assert server.run("json.tool", ["in.json"], None, env, tmp_path, 30) == fresh(
        "json.tool", "in.json", cwd=tmp_path
    )


def test_a_run_has_its_own_environment_and_exit_code(server: ForkServer, tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "BROKER_ADDRESS": "http://127.0.0.1:7"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    got = server.run("gazctl.cli", ["print-config"], None, env, None, 60)
    assert got == fresh("gazctl.cli", "print-config", env=env)
    assert got[0] == 0 and "http://127.0.0.1:7" in got[1], got
    refused = server.run("gazctl.cli", ["journals", "list", "--no-such-flag"], None, env, None, 60)
    assert refused == fresh("gazctl.cli", "journals", "list", "--no-such-flag", env=env)
    assert refused[0] == 2, refused


def test_a_run_past_its_timeout_is_killed(server: ForkServer) -> None:
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        server.run("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(30)"], None,
                   dict(os.environ), None, 1.0)  # fmt: skip
    assert time.monotonic() - began < 10
    # The server goes on serving.
    assert server.run("json.tool", [], "[]", dict(os.environ), None, 30)[0] == 0


def test_a_run_whose_interpreter_or_imports_read_another_environment_is_not_a_fork(
    server: ForkServer,
) -> None:
    """What an interpreter reads as it starts (PYTHON* variables), or what gazctl's modules read
    as the server imported them (rich's console reads COLUMNS), a fork would not read again:
    such a run starts fresh (run_cli asks `serves`)."""
    env = dict(os.environ)
    assert server.serves(env)
    assert "COLUMNS" in server.read, server.read
    assert not server.serves({**env, "COLUMNS": "33"})
    assert not server.serves({**env, "PYTHONWARNINGS": "error"})
    assert server.serves({**env, "BROKER_ADDRESS": "http://127.0.0.1:7"})
