"""Baseline server processes: started with `python -m <module>`, each announces the port it bound
on its first stdout line, and each is stopped by its pid. Shared by the relay and unary baselines.

A server also exits when its stdin closes, so none outlives a benchmark that was killed.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from plumbing.processes import stop_process

ROOT = Path(__file__).resolve().parents[2]
PORT_LINE = b"PORT "
# Large enough for any chunk size a benchmark asks for; gRPC's default is 4 MiB.
MAX_MESSAGE = 64 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE)]
# Variables that would slow a baseline down without saying so (asyncio debug mode, gRPC tracing).
_SLOWING_ENV = ("PYTHONASYNCIODEBUG", "PYTHONDEVMODE", "PYTHONTRACEMALLOC", "GRPC_TRACE")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid


def _spawn(module: str, args: Iterable[str]) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in _SLOWING_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["GRPC_VERBOSITY"] = "ERROR"
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip


def _await_port(proc: subprocess.Popen[bytes], module: str, deadline: float) -> int:
    assert proc.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{module} did not announce its port")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            byte = os.read(proc.stdout.fileno(), 1)
            if not byte:
                code = proc.wait()
                raise RuntimeError(f"{module} exited with status {code} before serving")
            line += byte
    if not line.startswith(PORT_LINE):
        raise RuntimeError(f"{module} announced {line!r}, expected a port")
    return int(line[len(PORT_LINE) :])


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Stop one process by its pid: SIGTERM, then SIGKILL if it lingers."""
    try:
        stop_process(proc, timeout)
    finally:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


@contextmanager
def servers(
    module: str, *arg_lists: list[str], timeout: float = 30.0
) -> Iterator[list[ServerProcess]]:
    """Start one server process per argument list (all at once) and stop every one on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for args in arg_lists:
            procs.append(_spawn(module, args))
        deadline = time.monotonic() + timeout
        yield [ServerProcess(p, _await_port(p, module, deadline)) for p in procs]
    finally:
        for p in procs:
            stop(p)


def cpu_seconds(pids: Iterable[int]) -> float | None:
    """User + system CPU time of the given processes, from /proc (None where there is no /proc)."""
    total = 0
    try:
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


def serve(
    handlers: list[grpc.GenericRpcHandler[Any, Any]],
    setup: Callable[[], Awaitable[None]] | None = None,
    teardown: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Child-process entry: serve `handlers` on a free loopback port, announce it, run until killed.

    Plain `asyncio.run` (no uvloop, no debug mode), the same event loop our broker runs on.
    """

    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        if setup is not None:
            await setup()
        await server.start()
        sys.stdout.buffer.write(PORT_LINE + b"%d\n" % port)
        sys.stdout.buffer.flush()
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
        # The parent holds our stdin open for as long as it wants us; EOF means it is gone.
        stdin = sys.stdin.fileno()

        def parent_gone() -> None:
            if not os.read(stdin, 1):
                loop.remove_reader(stdin)
                stopped.set()

        loop.add_reader(stdin, parent_gone)
        await stopped.wait()
        await server.stop(grace=None)
        if teardown is not None:
            await teardown()

    asyncio.run(main())


def describe(result: dict[str, object]) -> str:
    """One line of `key=value` for a baseline run from the command line."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
    )
