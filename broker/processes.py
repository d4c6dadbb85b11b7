"""Stopping a child process by its pid: SIGTERM, then SIGKILL if it lingers."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> int:
    """Stop `proc` (SIGTERM; SIGKILL after `timeout` seconds) and return its exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
