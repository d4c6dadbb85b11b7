"""The Spark side of gazctl's jobs: tasks over runs and fragments, their progress (accumulators
polled while the job runs), and executor failures brought back as one line.

Over Spark Connect (`--remote`) there is no SparkContext: tasks run as `mapInArrow` over one row
per task (their results pickled into a binary column), and without accumulators a job's progress
shows when its tasks have finished."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rich.progress import Progress

from broker.protocol import protocol_pb2 as pb
from gazctl.spark.compaction import Merged, Run, remove_covered, write_merged
from gazctl.spark.journals import JobError
from gazctl.spark.session import is_connect

T = TypeVar("T")

_JOB_ERROR = re.compile(r"JobError: (.+)")


def executor_error(exc: BaseException) -> JobError:
    """The JobError an executor raised (its message), or the failure's first line."""
    text = str(exc)
    found = _JOB_ERROR.findall(text)
    if found:
        return JobError(found[-1].strip())
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return JobError(f"the Spark job failed: {first}")


class Unmetered:
    """What stands for an accumulator over Spark Connect, which has none: it counts nothing,
    and run_with_progress completes its task when the action returns."""

    value = 0

    def add(self, n: int) -> None:
        pass


def counter(session: Any) -> Any:
    """An accumulator of the session's SparkContext, or Unmetered over Spark Connect."""
    return Unmetered() if is_connect(session) else session.sparkContext.accumulator(0)


def parallelism(session: Any) -> int:
    """The SparkContext's default parallelism; over Spark Connect, spark.default.parallelism
    if the server sets it, else 4."""
    if not is_connect(session):
        return int(session.sparkContext.defaultParallelism)
    return int(session.conf.get("spark.default.parallelism", None) or 4)


def map_tasks(session: Any, items: Sequence[Any], fn: Callable[[Any], T]) -> list[T]:
    """`fn` over `items`, one Spark task per item, the results in the items' order."""
    items = list(items)
    if not is_connect(session):
        sc = session.sparkContext
        return list(sc.parallelize(items, max(1, len(items))).map(fn).collect())
    import pickle

    def tasks(batches: Any) -> Any:
        import pyarrow as pa

        for batch in batches:
            ids = batch.column(0).to_pylist()
            results = [pickle.dumps(fn(items[i])) for i in ids]
            yield pa.RecordBatch.from_pydict(
                {"i": pa.array(ids, pa.int64()), "result": pa.array(results, pa.binary())}
            )

    rows = (
        session.range(0, len(items), 1, max(1, len(items)))
        .mapInArrow(tasks, "i long, result binary")
        .collect()
    )
    return [pickle.loads(row.result) for row in sorted(rows, key=lambda row: row.i)]


def run_with_progress(
    action: Callable[[], T], progress: Progress, meters: Sequence[tuple[Any, Any]]
) -> T:
    """Run a Spark action while showing accumulator values: `meters` pairs a progress task id
    with the accumulator feeding it."""
    done = threading.Event()
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(action())
        except BaseException as exc:  # Re-raised on the calling thread.
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=target, name="spark-action", daemon=True)
    thread.start()
    while not done.wait(0.2):
        for task, accumulator in meters:
            progress.update(task, completed=accumulator.value)
    thread.join()
    for task, accumulator in meters:
        if isinstance(accumulator, Unmetered) and not failure:
            completed = next(t.total for t in progress.tasks if t.id == task)
        else:
            completed = accumulator.value
        progress.update(task, completed=completed)
    if failure:
        if isinstance(failure[0], JobError):
            raise failure[0]
        raise executor_error(failure[0]) from None
    return result[0]


def merge_runs(
    session: Any, runs: Sequence[Run], file_root: str | None, progress: Progress
) -> list[Merged]:
    """Write and verify every run's merged fragment, one Spark task per run."""
    from pathlib import Path

    fragments, content = counter(session), counter(session)
    root = Path(file_root) if file_root is not None else None

    def merge(run: Run) -> Merged:
        merged = write_merged(run, root)
        fragments.add(len(run.fragments))
        content.add(run.size)
        return merged

    meters = [
        (
            progress.add_task("fragments merged", total=sum(len(r.fragments) for r in runs)),
            fragments,
        ),
        (progress.add_task("bytes merged", total=sum(r.size for r in runs)), content),
    ]
    return run_with_progress(lambda: map_tasks(session, runs, merge), progress, meters)


def remove_fragments(
    session: Any, fragments: Sequence[pb.Fragment], file_root: str | None, progress: Progress
) -> int:
    """Remove covered fragments from their stores, in parallel."""
    from pathlib import Path

    if not fragments:
        return 0
    removed = counter(session)
    root = Path(file_root) if file_root is not None else None

    def remove(batch: list[pb.Fragment]) -> int:
        n = remove_covered(batch, root)
        removed.add(n)
        return n

    slices = max(1, min(len(fragments), parallelism(session) * 4))
    batches = [list(fragments[i::slices]) for i in range(slices)]
    meters = [(progress.add_task("fragments removed", total=len(fragments)), removed)]
    return sum(run_with_progress(lambda: map_tasks(session, batches, remove), progress, meters))


def _fragments(options: dict[str, str]) -> list[Any]:
    """The replay's input partitions, planned on the driver as the data source plans them."""
    from gazctl.spark.source import GazetteReader

    return list(GazetteReader(options).partitions())


def _resolved(
    session: Any, partitions: list[Any], staging: str | None, keep_acks: bool, progress: Progress
) -> tuple[dict[int, Any], int]:
    """Pass one over every fragment (writing part files when `staging` is given, else only
    summarizing), then `resolve` on the driver. Returns the resolutions and rows written."""
    from gazctl.spark.replay import FragmentSummary, first_pass, resolve, summary_of

    done = counter(session)

    def summarize(item: tuple[int, Any]) -> tuple[FragmentSummary, int]:
        index, partition = item
        if staging is not None:
            result = first_pass(index, partition, staging, keep_acks)
        else:
            result = summary_of(index, partition), 0
        done.add(1)
        return result

    meters = [(progress.add_task("fragments read", total=len(partitions)), done)]
    items = list(enumerate(partitions))
    results = run_with_progress(lambda: map_tasks(session, items, summarize), progress, meters)
    return resolve(summary for summary, _ in results), sum(n for _, n in results)


def replay_to_parquet(
    session: Any, options: dict[str, str], path: str, flatten: bool, progress: Progress
) -> int:
    """Write the committed messages (no acknowledgements) to a new Parquet directory; returns
    how many. Each part file is in commit order; ordering by journal, commit_offset and offset
    gives the read-committed iterator's order."""
    import os
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from gazctl.spark.replay import arrow_committed_schema, second_pass

    partitions = _fragments(options)  # Planning errors come first, leaving nothing behind.
    target = os.path.abspath(path)
    staging = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.replaying")
    shutil.rmtree(staging, ignore_errors=True)  # Left by an interrupted replay.
    os.makedirs(os.path.join(staging, "_side"))
    try:
        resolutions, rows = _resolved(session, partitions, staging, False, progress)
        if resolutions:
            # Pass two is light (side tables are small): a few tasks, each several fragments.
            items = list(resolutions.items())
            slices = min(len(items), parallelism(session) * 2)
            batches = [items[i::slices] for i in range(slices)]

            def finish(batch: list[tuple[int, Any]]) -> int:
                return sum(second_pass(index, found, staging, False) for index, found in batch)

            rows += sum(
                run_with_progress(lambda: map_tasks(session, batches, finish), progress, [])
            )
        shutil.rmtree(os.path.join(staging, "_side"))
        if not any(name.endswith(".parquet") for name in os.listdir(staging)):
            binary = any(getattr(p, "framing", "") == "fixed" for p in partitions)
            schema = arrow_committed_schema(binary)
            pq.write_table(
                pa.table([[] for _ in schema], schema=schema),
                os.path.join(staging, "part-00000.parquet"),
            )
        if flatten:
            _flatten(session, staging, target)
            shutil.rmtree(staging)
        else:
            open(os.path.join(staging, "_SUCCESS"), "wb").close()
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return rows


def _flatten(session: Any, staging: str, target: str) -> None:
    """Rewrite the staged table with a column per top-level field of the JSON messages."""
    from pyspark.sql import functions as F

    rows = session.read.parquet(staging)
    documents = rows.select("content").rdd.map(lambda row: row.content)
    schema = session.read.json(documents).schema
    taken = set(rows.columns)
    fields = [
        F.col("document").getField(name).alias(name if name not in taken else f"message_{name}")
        for name in schema.fieldNames()
    ]
    rows = rows.withColumn("document", F.from_json("content", schema)).select(
        *rows.columns, *fields
    )
    try:
        rows.write.mode("errorifexists").parquet(target)
    except Exception as exc:
        raise executor_error(exc) from None


def replay_to_journal(
    session: Any, options: dict[str, str], journal: str, broker: str, progress: Progress
) -> int:
    """Append the committed messages and their ACKs to `journal`, original bytes and UUIDs,
    each producer's in clock order (one task per producer); returns how many."""
    from gazctl.spark.replay import COMMITTED_SCHEMA, committed_rows

    partitions = _fragments(options)
    resolutions, _ = _resolved(session, partitions, None, True, progress)
    sc = session.sparkContext
    rdd = sc.parallelize(list(enumerate(partitions)), max(1, len(partitions))).flatMap(
        lambda item: committed_rows(item[1], resolutions.get(item[0]), True)
    )
    rows = (
        session.createDataFrame(rdd, COMMITTED_SCHEMA)
        .repartition("producer")
        .sortWithinPartitions("producer", "clock")
    )
    appended = sc.accumulator(0)

    def write(partition: Any) -> None:
        import asyncio

        from broker.client.append_service import AppendService
        from broker.client.journals import dial
        from broker.protocol import protocol_pb2_grpc as pb_grpc

        async def append_all() -> None:
            channel = dial(broker)
            try:
                stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
                async with AppendService(stub) as service:
                    last = None
                    for row in partition:
                        last = await service.write(journal, row.content.encode() + b"\n")
                        appended.add(1)
                    if last is not None:
                        await last
            finally:
                await channel.close(None)

        asyncio.run(append_all())

    try:
        rows.foreachPartition(write)
    except Exception as exc:
        raise executor_error(exc) from None
    return int(appended.value)
