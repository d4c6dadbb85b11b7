"""`python -m benchmarks [--json PATH] [--only NAME ...] [--quick]` (what `nox -s bench` runs).

Each benchmark is a module exposing `run(quick: bool = False) -> dict[str, Any]`; see
`benchmarks/_runner.py` for what it returns. Modules are imported only when run, so an entry whose
module is not written yet prints "not yet available" instead of failing the others.
"""

from __future__ import annotations

import sys

from benchmarks._runner import main

BENCHMARKS: dict[str, str] = {
    "journal_specs": "benchmarks.journal_specs",
    "allocator_round": "benchmarks.allocator_round",
    "append_throughput": "benchmarks.append_throughput",
    "append_small": "benchmarks.append_small",
    "append_service": "benchmarks.append_service",
    "read_broker": "benchmarks.read_broker",
    "read_direct": "benchmarks.read_direct",
    "persist": "benchmarks.persist",
    "publish": "benchmarks.publish",
    "read_committed": "benchmarks.read_committed",
    "spark_compact": "benchmarks.spark_compact",
    "spark_replay": "benchmarks.spark_replay",
    "spark_split": "benchmarks.spark_split",
    "spark_stream": "benchmarks.spark_stream",
    "failover": "benchmarks.failover",
    "idle_tails": "benchmarks.idle_tails",
    "consumer_throughput": "benchmarks.consumer_throughput",
    "shard_failover": "benchmarks.shard_failover",
    "standby_takeover": "benchmarks.standby_takeover",
    "recovery_playback": "benchmarks.recovery_playback",
    "sqlite_store": "benchmarks.sqlite_store",
    "replication_throughput": "benchmarks.replication_throughput",
    "convergence": "benchmarks.convergence",
    "location_takeover": "benchmarks.location_takeover",
    "tls_cost": "benchmarks.tls_cost",
    "auth_overhead": "benchmarks.auth_overhead",
    "journal_scale": "benchmarks.journal_scale",
    "reader_fanout": "benchmarks.reader_fanout",
    "shard_scale": "benchmarks.shard_scale",
}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], BENCHMARKS))
