"""The zygote the tests' server processes start from (tests/helpers/server_fork.py): a clone is a
child of the test's process, with the command's arguments, descriptors (and no others),
environment and directory, as a fresh `python -m` process; a command the zygote cannot start as
it would start fresh does start fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server_fork import ForkedPopen, Zygotes

PROBE = """
import json, os, random, sys, threading
preloaded = "grpc" in sys.modules
from tests.helpers.server_fork import _Clone
try:
    _Clone()  # Finds this thread's id in glibc's descriptor, exactly once.
    tid = "ok"
except RuntimeError as e:
    tid = str(e)
ran = []
thread = threading.Thread(target=lambda: ran.append(threading.get_native_id()))
thread.start(); thread.join()
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
    "path0": sys.path[0], "fds": sorted(int(f) for f in os.listdir("/proc/self/fd"))[:3],
    "extra_fds": len(os.listdir("/proc/self/fd")) - 4,
    "env": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read(),
    "preloaded": preloaded, "tid": tid, "thread": ran[0] != threading.get_native_id(),
    "random": random.random(), "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygotes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Zygotes]:
    """Zygotes of the test's own, in place of the suite's."""
    import tests.helpers.server_fork as server_fork

    own = Zygotes()
    monkeypatch.setattr(server_fork, "ZYGOTES", own)
    try:
        yield own
    finally:
        own.stop()


def probe(tmp_path: Path, code: int, env: dict[str, str], popen: Any) -> dict[str, Any]:
    (tmp_path / "probe.py").write_text(PROBE)
    # The probe imports the zygote's module, as the suite's directory is on its path.
    env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with (tmp_path / "out").open("wb") as out:
        proc = popen(
            [sys.executable, "-m", "probe", str(code), "an argument"],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )  # fmt: skip
        proc.communicate(b"its input")
    # Unbuffered, stdout's line comes first; buffered, at the exit, after stderr's.
    lines = (tmp_path / "out").read_text().splitlines()
    assert len(lines) == 2 and "to stderr" in lines, lines
    got = json.loads(next(line for line in lines if line.startswith("{")))
    assert proc.returncode == code and got["pid"] == proc.pid, got
    return got  # type: ignore[no-any-return]


def test_a_clone_is_a_child_of_the_test_with_what_a_fresh_process_gets(
    zygotes: Zygotes, tmp_path: Path
) -> None:
    env = {**os.environ, "PROBE_VALUE": "a value"}
    clone = probe(tmp_path, 3, env, ForkedPopen)
    fresh = probe(tmp_path, 3, env, subprocess.Popen)
    assert clone["preloaded"] and not fresh["preloaded"], (clone, fresh)
    assert clone["ppid"] == os.getpid() == fresh["ppid"]
    for key in ("argv", "cwd", "path0", "fds", "extra_fds", "env", "stdin", "tid", "thread"):
        assert clone[key] == fresh[key], key
    assert clone["extra_fds"] == 0 and clone["tid"] == "ok" and clone["thread"], clone
    # Each clone has its own random state, as after a fork.
    assert probe(tmp_path, 0, env, ForkedPopen)["random"] != clone["random"]
    assert len(zygotes.started) == 1


def test_a_clone_is_waited_for_and_signalled_as_any_child(zygotes: Zygotes) -> None:
    proc = ForkedPopen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert len(zygotes.started) == 1


def test_an_interpreter_setting_of_its_own_gets_a_zygote_of_its_own(
    zygotes: Zygotes, tmp_path: Path
) -> None:
    """PYTHONUNBUFFERED (and every PYTHON* variable) is read as an interpreter starts: a command
    with another value of one is a clone of another zygote, started with it."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    one = probe(tmp_path, 0, buffered, ForkedPopen)
    other = probe(tmp_path, 0, {**buffered, "PYTHONUNBUFFERED": "1"}, ForkedPopen)
    assert one["preloaded"] and other["preloaded"]
    assert (one["unbuffered"], other["unbuffered"]) == (None, "1")
    assert len(zygotes.started) == 2


def test_a_command_whose_environment_the_imports_read_otherwise_starts_fresh(
    zygotes: Zygotes, tmp_path: Path
) -> None:
    """The zygote's imports read PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION (protobuf chooses its
    implementation by it): a command that sets it otherwise is not a clone."""
    zygote_env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}  # fmt: skip
    assert probe(tmp_path, 0, zygote_env, ForkedPopen)["preloaded"]
    read = next(iter(zygotes.started.values())).read
    assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" in read, read
    other = {**zygote_env, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    assert not probe(tmp_path, 0, other, ForkedPopen)["preloaded"]


def test_what_a_clone_cannot_be_starts_fresh(zygotes: Zygotes, tmp_path: Path) -> None:
    """A new session, descriptors passed on, a command that is not `python -m`: as Popen."""
    r, w = os.pipe()
    try:
        passed = ForkedPopen(
            [sys.executable, "-m", "json.tool", "--help"], stdout=subprocess.DEVNULL,
            pass_fds=(w,), start_new_session=True,
        )  # fmt: skip
        assert passed.wait(60) == 0
    finally:
        os.close(r)
        os.close(w)
    script = ForkedPopen([sys.executable, "-c", "import sys; sys.exit(4)"])
    assert script.wait(60) == 4
    assert zygotes.started == {}


def test_the_zygotes_stop_with_their_test_process(tmp_path: Path) -> None:
    """A zygote whose test process is gone exits (its end of the pipe closes)."""
    program = (
        "import subprocess, sys\n"
        "from tests.helpers.server_fork import ZYGOTES, ForkedPopen\n"
        "p = ForkedPopen([sys.executable, '-m', 'json.tool', '--help'], stdout=subprocess.DEVNULL)\n"
        "p.wait()\n"
        "print(next(iter(ZYGOTES.started.values())).proc.pid, flush=True)\n"
        "import os; os._exit(0)\n"  # No atexit: as a test process killed.
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    zygote = int(run.stdout)
    from tests.helpers.waiting import until_blocking

    def gone() -> bool:
        try:
            os.kill(zygote, 0)
        except ProcessLookupError:
            return True
        # Orphaned, it is reaped by init; a zombie still answers kill(0).
        return Path(f"/proc/{zygote}/stat").read_text().split(")")[1].split()[0] == "Z"

    until_blocking(gone, "the orphaned zygote exited", 30, 0.05)
