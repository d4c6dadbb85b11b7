"""A fork server for the tests' `gazctl` runs: each run is still a process of its own, as a user's
is (its own pid, exit code, stdin, stdout and stderr, environment and directory; killed on a
timeout), but it starts as a fork of a process that has already imported the libraries every
`gazctl` imports (asyncio, gRPC, the etcd client, protobuf, rich, click), rather than importing
them again: about 0.3 s of CPU a run, and the suite runs some 700 of them.

Imported ahead are gazctl's modules and the libraries under them. What they read of the
environment as they import is recorded (tests/helpers/server_fork.py's `preload`), and a run
whose environment differs in one of those, or in what an interpreter reads as it starts (the
PYTHON* variables, the locale), starts as a fresh interpreter instead (`serves`). The server
holds one thread, so forking it is safe; the gRPC core starts in each run, after the fork.

`python -m tests.helpers.cli_fork SOCKET` serves; `ForkServer` starts and asks it. Each request
is one connection: a line of JSON with the run's stdin, stdout and stderr as passed file
descriptors. The server forks a waiter for it, which forks the run, answers its pid, waits for
it and answers its exit code (negative for a signal, as subprocess's)."""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.helpers.server_fork import agrees, preload, startup_environment, take_environment

PRELOAD = (
    "asyncio",
    "grpc",
    "grpc.aio",
    "aetcd",
    "google.protobuf.json_format",
    "rich.console",
    "rich.table",
    "rich.progress",
    "click",
    "yaml",
    "broker.protocol.protocol_pb2",
    "broker.protocol.protocol_pb2_grpc",
    "gazctl.cli",
    "gazctl.journals",
    "gazctl.journals_io",
    "gazctl.shards",
    "gazctl.fragments",
    "gazctl.replication",
    "gazctl.attach_uuids",
    "gazctl.editor",
    "gazctl.dev.cli",
)


def _serve(path: str) -> dict[str, Any]:
    """Serve until killed; returns only in a forked run, with its request, its descriptors in
    place, its directory and environment set."""
    # As gazctl's package sets it as it is imported, before gRPC could read it.
    os.environ.update(_as_gazctl_sets_it(dict(os.environ)))
    read = preload(PRELOAD)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # Waiters are reaped as they end.
    print(json.dumps({"ready": True, "read": read}), flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork():
            conn.close()
            continue
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        run = os.fork()
        if run == 0:
            conn.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            sys.path[0] = request["cwd"]  # As `python -m` puts its directory first.
            take_environment(_as_gazctl_sets_it(request["env"]))
            return request  # type: ignore[no-any-return]
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": run}).encode() + b"\n")
        _, status = os.waitpid(run, 0)
        conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        os._exit(0)


def _as_gazctl_sets_it(env: dict[str, str]) -> dict[str, str]:
    """`env` as gazctl's package leaves it as it is imported, before gRPC could read it."""
    return {"GRPC_VERBOSITY": "ERROR", **env}


def main() -> None:
    request = _serve(sys.argv[1])
    # The run, as `python -m MODULE ARGS` runs it; the interpreter then exits as that one does.
    sys.argv = [sys.argv[0], *request["args"]]
    sys.modules.pop(request["module"], None)  # Run as `__main__` only, as a fresh one is.
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


class ForkServer:
    """The fork server of this (test) process, started by `start` and stopped by `stop`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.dir = ""
        self.lock = threading.Lock()  # Tests run commands from threads too (asyncio.to_thread).
        self.read: dict[str, str | None] = {}
        self.startup: tuple[tuple[str, str], ...] = ()

    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gazctl-fork-")
        self.startup = startup_environment(dict(os.environ))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.cli_fork", self.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[2],
            # os.environ, not the C library's (readline sets COLUMNS and LINES there).
            env=dict(os.environ),
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.stop()
            raise RuntimeError("the gazctl fork server did not start")
        self.read = json.loads(line)["read"]

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a run with `env` may be a fork: it agrees with the server on what an
        interpreter reads as it starts, and on what the server's imports read."""
        with self.lock:
            if self.proc is None:
                self.start()
        env = _as_gazctl_sets_it(env)
        return startup_environment(env) == self.startup and agrees(env, self.read)

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "socket")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        if self.dir:
            with_socket = Path(self.path)
            with_socket.unlink(missing_ok=True)
            os.rmdir(self.dir)
            self.dir = ""

    def run(
        self,
        module: str,
        args: list[str],
        input: str | None,
        env: dict[str, str],
        cwd: Path | None,
        timeout: float,
    ) -> tuple[int, str, str]:
        """Run `python -m MODULE ARGS` as a fork: its exit code, stdout and stderr (as
        subprocess.run(text=True) gives them). Past `timeout` it is killed and
        subprocess.TimeoutExpired raised, as subprocess.run does."""
        with self.lock:
            if self.proc is None:
                self.start()
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd or os.getcwd())}
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
        ):
            if input is not None:
                stdin.write(input.encode())
                stdin.seek(0)
            conn.connect(self.path)
            socket.send_fds(
                conn,
                [json.dumps(request).encode()],
                [stdin.fileno(), stdout.fileno(), stderr.fileno()],
            )
            replies = _Lines(conn)
            pid = json.loads(replies.next())["pid"]
            conn.settimeout(timeout)
            try:
                line = replies.next()
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                replies.next()  # Its waiter saw it end.
                raise subprocess.TimeoutExpired([module, *args], timeout) from None
            code = int(json.loads(line)["code"])
            stdout.seek(0)
            stderr.seek(0)
            return code, _text(stdout.read()), _text(stderr.read())


class _Lines:
    """The lines a waiter answers, read from its connection (a socket timeout leaves it usable,
    where a socket's file object would be broken by one)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffered = b""

    def next(self) -> bytes:
        while b"\n" not in self.buffered:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("the gazctl fork server's waiter went away")
            self.buffered += chunk
        line, _, self.buffered = self.buffered.partition(b"\n")
        return line


def _text(raw: bytes) -> str:
    """As subprocess's text mode reads it: decoded, with universal newlines."""
    return raw.decode().replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    main()
