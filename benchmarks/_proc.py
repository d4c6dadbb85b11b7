"""What /proc says of a process: its CPU time and resident memory (Linux)."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, every thread included (OSError once
    it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # Fields after the command (which may hold spaces), from the 3rd: utime is the 14th.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (OSError once it is gone)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for {pid}")
