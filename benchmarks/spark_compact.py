"""spark_compact: MB/s compacting 1 GiB held in 1,000 fragments (NONE codec, file:// store) into
512 MiB fragments with Spark on local[2]: read and SHA-1 check every fragment, write each merged
fragment, read it back whole to verify it, remove what it covers. Baseline in the same run: one
Python process doing the same work with the same code (`write_merged`, `remove_covered`) on a
fresh copy of the fragments. Target ratio >= 0.5: Spark's overhead on one machine within 2x, so
that a cluster multiplies the rate. The Spark session's start-up is reported, not timed."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._fragments import read_spec, write_fragments
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.compaction import Plan, plan_journal, remove_covered, write_merged

JOURNAL = "bench/compact"


def plan(root: Path, target: int) -> Plan:
    spec = read_spec(JOURNAL)
    fragments = open_store(spec.fragment.stores[0], file_root=root).list_fragments(JOURNAL)
    return plan_journal(spec, fragments, target_size=target, codec=pb.NONE, min_age=0, now=1e12)


def baseline(root: Path, target: int) -> float:
    work = plan(root, target)
    start = time.perf_counter()
    for run in work.runs:
        write_merged(run, root)
    remove_covered([f for run in work.runs for f in run.fragments], root)
    return time.perf_counter() - start


def with_spark(root: Path, session: Any, target: int) -> float:
    from rich.progress import Progress

    from gazctl.spark.jobs import merge_runs, remove_fragments

    work = plan(root, target)
    covered = [f for run in work.runs for f in run.fragments]
    with Progress(disable=True) as progress:
        start = time.perf_counter()
        merge_runs(session, work.runs, str(root), progress)
        remove_fragments(session, covered, str(root), progress)
        return time.perf_counter() - start


def run(quick: bool = False) -> dict[str, Any]:
    from gazctl.spark.session import spark_session, stop_spark

    total = (64 if quick else 1024) << 20
    count = 64 if quick else 1000
    size = -(-total // count)
    target = total // 2 if quick else 512 << 20
    started = time.perf_counter()
    session = spark_session("local[2]", "spark_compact benchmark")
    startup = time.perf_counter() - started
    try:
        with tempfile.TemporaryDirectory(prefix="gazette-bench-compact-") as tmp:
            root = Path(tmp)
            write_fragments(root, JOURNAL, total, size)
            spark_seconds = with_spark(root, session, target)
            after = open_store(read_spec(JOURNAL).fragment.stores[0], file_root=root)
            merged = len(after.list_fragments(JOURNAL))
        close_stores()
        with tempfile.TemporaryDirectory(prefix="gazette-bench-compact-") as tmp:
            root = Path(tmp)
            write_fragments(root, JOURNAL, total, size)
            base_seconds = baseline(root, target)
        close_stores()
    finally:
        stop_spark(session)
    value, base = total / spark_seconds / 1e6, total / base_seconds / 1e6
    return {
        "value": round(value, 1),
        "unit": "MB/s",
        "baseline": round(base, 1),
        "ratio": round(value / base, 2),
        "target": 0.5,
        "fragments": count,
        "merged_into": merged,
        "bytes": total,
        "session_startup_s": round(startup, 1),
    }


if __name__ == "__main__":
    print(run())
