"""The driver the spark-stream fault scenario kills: two streaming queries from one topic, in one
Spark (`local[2,2]`: a failed task is tried again), built as `gazctl spark stream` builds
them, with one stage between source and sink that fails each partition's first attempt of each
batch once (a marker file says it did), so that every batch retries its tasks.

    python -m tests.faults.spark_stream_driver --work DIR [--once]

Into Parquet (`DIR/table`, checkpoint `DIR/ckpt-parquet`) and into the topic `topic=fsout` by
field `key` (checkpoint `DIR/ckpt-topic`). Runs until killed, or with `--once` until both have
read what was there when they started (exit 0)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fail_first_attempts(markers: Path) -> Any:
    """A mapInArrow function: rows pass unchanged; a partition's first attempt in a batch
    raises once (after reading its input), so Spark tries the task again."""

    def stage(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        held = list(batches)
        context = TaskContext.get()
        assert context is not None
        batch = context.getLocalProperty("streaming.sql.batchId")
        marker = (
            markers
            / f"{context.getLocalProperty('sql.streaming.queryId')}-{batch}-{context.partitionId()}"
        )
        if context.attemptNumber() == 0 and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected: the first attempt of {marker.name} fails")
        yield from held

    return stage


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args()
    work: Path = args.work
    (work / "markers").mkdir(parents=True, exist_ok=True)
    from gazctl.spark.session import spark_session
    from gazctl.spark.stream_cli import build_query

    spark = spark_session("local[2,2]", "spark-stream fault driver")
    spark.conf.set("spark.sql.shuffle.partitions", "2")
    broker = os.environ["BROKER_ADDRESS"]
    source = {"selector": "topic=fs", "broker": broker, "framing": "auto",
              "file_root": os.environ["BROKER_FILE_ROOT"], "maxMessagesPerTrigger": "500"}  # fmt: skip
    stage = fail_first_attempts(work / "markers")

    def transform(frame: Any) -> Any:
        return frame.mapInArrow(stage, frame.schema)

    queries = [
        build_query(spark, source, "parquet", str(work / "table"), work / "ckpt-parquet",
                    trigger=1.0, once=args.once, key=None, broker=broker, transform=transform),
        build_query(spark, source, "topic", "topic=fsout", work / "ckpt-topic",
                    trigger=1.0, once=args.once, key="key", broker=broker, transform=transform),
    ]  # fmt: skip
    print("queries started", flush=True)
    for query in queries:
        query.awaitTermination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
