"""standby_takeover: SIGKILL the process hosting a shard's primary, the shard on the SQLite store
recorded into its recovery log with a hot standby tailing it; seconds until the standby, promoted,
has completed its hand-off and committed a transaction (Stat through it reads past the kill).
Beside, in the same run: `shard_failover` (the JSON-file store, nothing to play) and the lease's
expiry (the floor).

The harness is shard_failover's (two stream-sum summer processes, `--etcd.lease`, chunks
written before each kill), with `setup --store sqlite`."""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.shard_failover import measure, summary


def run(quick: bool = False, kills: int | None = None, lease: int = 5) -> dict[str, Any]:
    kills = kills if kills is not None else (1 if quick else 3)
    lease = 2 if quick else lease
    standby = asyncio.run(measure(kills, lease, store="sqlite"))
    plain = sorted(asyncio.run(measure(kills, lease, store="json"))["times"])
    return summary(standby, lease, kills) | {"without_standby": round(plain[len(plain) // 2], 2)}


if __name__ == "__main__":
    print(run())
