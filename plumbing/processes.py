"""Stopping child processes by their pids: SIGTERM, then SIGKILL if they linger."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> int:
    """Stop `proc` (SIGTERM; SIGKILL after `timeout` seconds) and return its exit status."""
    return stop_processes([proc], timeout)[0]


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 10) -> list[int]:
    """Stop every process of `procs` at once (SIGTERM to all, SIGKILL to those still running
    `timeout` seconds later) and return their exit statuses: brokers stopped together exit
    sooner than one by one, each waiting on the others' streams into it."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return [proc.returncode for proc in procs]


# The Popen class the test kits (broker.testing, consumer.testing) start server processes with
# (`python -m ...` commands). A test suite may set a subclass that starts the same command
# another way, as a process of its own all the same: this project's tests start them as clones
# of a process that has their modules imported (tests/helpers/server_fork.py).
SERVER_POPEN: type[subprocess.Popen[bytes]] = subprocess.Popen
