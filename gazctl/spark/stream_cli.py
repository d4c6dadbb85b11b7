"""`gazctl spark stream`: a Structured Streaming query from journals into Parquet, a journal or
a topic, exactly-once, resumable from its checkpoint, with a progress line per batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gazctl.options import broker_options, file_root_option
from gazctl.render import err_console

TARGETS = ("parquet", "journal", "topic")


def parse_stream_target(text: str) -> tuple[str, str]:
    kind, sep, where = text.partition(":")
    if not sep or kind not in TARGETS or not where:
        raise click.BadParameter(
            f"{text!r}: give parquet:DIR, journal:NAME or topic:SELECTOR (with --key)"
        )
    return kind, where


def _size(text: str) -> int:
    from gazctl.spark.journals import size_in_bytes

    size = size_in_bytes(text)
    if size is None:
        raise click.BadParameter(f"{text!r} is not a size: give e.g. 4MiB, 1GiB or 1048576")
    return size


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def input_rows(progress: dict[str, Any]) -> int:
    """The batch's rows (its sources'; a Connect client's progress has no total)."""
    return sum(int(s.get("numInputRows") or 0) for s in progress.get("sources") or [])


def progress_line(progress: dict[str, Any]) -> str:
    """`batch 7: 12,400 rows, 3.1 MiB read, lag 0 B over 4 journals, 1.24 s`: from a query's
    progress (the source's offsets, its write heads for the lag)."""
    source = (progress.get("sources") or [{}])[0]

    def offsets(key: str) -> dict[str, Any]:
        value = source.get(key)
        try:
            found = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    start = offsets("startOffset").get("journals", {})
    end = offsets("endOffset").get("journals", {})
    heads = offsets("latestOffset").get("heads", {})
    read = sum(max(0, p["at"] - start.get(j, {}).get("at", 0)) for j, p in end.items())
    lag = sum(max(0, head - end.get(j, {}).get("at", 0)) for j, head in heads.items())
    seconds = (progress.get("durationMs") or {}).get("triggerExecution", 0) / 1000
    rows = input_rows(progress)
    return (
        f"batch {progress.get('batchId')}: {rows:,} rows, {_human(read)} read, lag "
        f"{_human(lag)} over {len(end)} journals, {seconds:.2f} s"
    )


def build_query(
    spark: Any,
    source: dict[str, str],
    kind: str,
    where: str,
    checkpoint: Path,
    *,
    trigger: float,
    once: bool,
    key: str | None,
    broker: str,
    transform: Callable[[Any], Any] | None = None,
) -> Any:
    """The streaming query `gazctl spark stream` runs, started (tests and applications start
    the same one). `transform` maps the source's DataFrame before the sink (it must be
    deterministic, and keep `content`, for the journal sinks' exactly-once)."""
    from pyspark.sql import functions as F

    from gazctl.spark.session import use_in_this_thread

    use_in_this_thread(spark)  # Spark finds the gazette sink through it.
    reader = spark.readStream.format("gazette")
    for name, value in source.items():
        reader = reader.option(name, value)
    frame = reader.load()
    if transform is not None:
        frame = transform(frame)
    if kind == "parquet":
        writer = frame.writeStream.format("parquet").option("path", where)
    else:
        frame = frame.select("content")
        if key is not None:
            frame = frame.withColumn("key", F.get_json_object("content", f"$.{key}"))
        writer = frame.writeStream.format("gazette").option("broker", broker)
        if kind == "journal":
            writer = writer.option("journal", where)
        else:
            writer = writer.option("selector", where).option("key", "key")
    writer = writer.option("checkpointLocation", str(checkpoint))
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{round(trigger * 1000)} milliseconds")
    return writer.start()


@click.command("stream")
@click.option("-l", "--selector", required=True, help="Label selector of the journals to read")
@click.option("--to", "target", required=True,
              help="parquet:DIR, journal:NAME or topic:SELECTOR (rows mapped by --key)")  # fmt: skip
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The query's checkpoint directory: where a restart resumes from")  # fmt: skip
@click.option("--trigger", default="1s", show_default=True,
              help="How often a batch starts (a duration: 500ms, 10s, 1m)")  # fmt: skip
@click.option("--once", is_flag=True,
              help="Read what is there now, in batches within the limits, then exit")  # fmt: skip
@click.option("--starting", default="earliest", show_default=True,
              help="Where a new query starts: earliest, latest, a JSON object of journal "
                   "offsets, or a time (unix seconds or ISO 8601 with a zone)")  # fmt: skip
@click.option("--max-messages-per-batch", type=int, default=None,
              help="At most this many messages a batch (a larger transaction comes alone)")  # fmt: skip
@click.option("--max-bytes-per-batch", default=None,
              help="At most this much message content a batch (e.g. 64MiB)")  # fmt: skip
@click.option("--read-uncommitted", is_flag=True,
              help="Every message as written: acknowledgements, duplicates, rolled back ones")  # fmt: skip
@click.option("--fail-on-data-loss/--no-fail-on-data-loss", default=True, show_default=True,
              help="Fail when content the query has not read is gone (pruned, or a journal "
                   "reset), or skip it and say so")  # fmt: skip
@click.option("--framing", type=click.Choice(["auto", "lines", "csv"]), default="auto",
              show_default=True, help="Message framing (auto: each journal's content-type)")  # fmt: skip
@click.option("--uuid-path", default="_meta.uuid", show_default=True,
              help="Where JSON messages carry their UUID")  # fmt: skip
@click.option("--key", default=None,
              help="topic: the JSON field whose value maps a message to a journal")  # fmt: skip
@file_root_option("Directory that roots file:// fragment stores (as brokers' --broker.file-root)")
@click.option("--master", default=None,
              help="Spark master URL (default: local[*], the embedded engine)")  # fmt: skip
@click.option("--remote", default=None,
              help="Spark Connect server (sc://host:port) to run the query on")  # fmt: skip
@broker_options
def stream_cmd(**given: Any) -> None:
    """Stream journals into Parquet, a journal or a topic, exactly-once.

    A Spark Structured Streaming query: journals the selector matches (new ones as they
    appear) are read read-committed, batch by batch, from where the checkpoint says; into
    Parquet through Spark's file sink, or into journals as one transaction per batch. Run it
    again with the same --checkpoint to resume; --once reads what is there and exits.
    """
    from gazctl.spark.cli import job

    job(_stream)(**given)


def _stream(
    selector: str,
    target: str,
    checkpoint: Path,
    trigger: str,
    once: bool,
    starting: str,
    max_messages_per_batch: int | None,
    max_bytes_per_batch: str | None,
    read_uncommitted: bool,
    fail_on_data_loss: bool,
    framing: str,
    uuid_path: str,
    key: str | None,
    file_root: Path | None,
    master: str | None,
    remote: str | None,
    **opts: Any,
) -> None:
    from gazctl.spark.cli import one_engine

    one_engine(master, remote)
    kind, where = parse_stream_target(target)
    if kind == "topic" and key is None:
        raise click.BadParameter("topic:SELECTOR maps messages by a field: give --key")
    if max_messages_per_batch is not None and max_messages_per_batch <= 0:
        raise click.BadParameter(
            f"--max-messages-per-batch {max_messages_per_batch}: give 1 or more"
        )
    from gazctl.spark.stream_plan import StreamOptions

    broker = str(opts["broker_address"])
    source = {"selector": selector, "broker": broker, "framing": framing,
              "uuid_path": uuid_path, "startingOffsets": starting,
              "readUncommitted": str(read_uncommitted).lower(),
              "failOnDataLoss": str(fail_on_data_loss).lower()}  # fmt: skip
    if file_root is not None:
        source["file_root"] = str(file_root)
    if max_messages_per_batch is not None:
        source["maxMessagesPerTrigger"] = str(max_messages_per_batch)
    if max_bytes_per_batch is not None:
        source["maxBytesPerTrigger"] = str(_size(max_bytes_per_batch))
    StreamOptions.parse(source)  # Bad options: one line now, not from inside Spark.
    every = 0.0 if once else _trigger_seconds(trigger)
    from gazctl.spark.journals import select_journals

    select_journals(selector, broker=broker)  # No journals: one line, before Spark starts.
    from gazctl.spark.session import check_requirements, spark_session

    check_requirements(java=remote is None)
    session = spark_session(master, "gazctl spark stream", remote)
    query = build_query(
        session, source, kind, where, checkpoint, trigger=every, once=once, key=key,
        broker=broker,
    )  # fmt: skip
    rows, batches = watch(query)
    if once:
        into = where if kind == "parquet" else f"{kind} {where}"
        err_console.print(f"streamed {rows:,} messages in {batches:,} batches into {into}")


def _trigger_seconds(text: str) -> float:
    from spec.durations import DurationError, parse_go_duration

    try:
        seconds = parse_go_duration(text) / 1e9
    except DurationError as exc:
        raise click.BadParameter(
            f"--trigger {text!r}: {exc} (a duration such as 1s or 500ms)"
        ) from None
    if seconds <= 0:
        raise click.BadParameter(f"--trigger {text!r}: give a positive duration such as 1s")
    return seconds


def as_dict(progress: Any) -> dict[str, Any]:
    """A query's progress as a dict (PySpark gives objects; over Connect, their JSON)."""
    if isinstance(progress, dict):
        return progress
    text = getattr(progress, "json", None)
    found = json.loads(text) if isinstance(text, str) else dict(progress)
    return found if isinstance(found, dict) else {}


def watch(query: Any) -> tuple[int, int]:
    """Print a line per batch until the query ends; its failure as one line (JobError); on
    Ctrl-C stop it (the checkpoint resumes it). The rows and batches it ran."""
    from gazctl.spark.jobs import executor_error

    seen: set[int] = set()
    rows = 0

    def report() -> None:
        nonlocal rows
        for found in query.recentProgress:
            progress = as_dict(found)
            batch = progress.get("batchId")
            if not isinstance(batch, int) or batch in seen:
                continue
            seen.add(batch)
            if progress.get("sources"):
                rows += input_rows(progress)
                err_console.print(progress_line(progress))

    try:
        while query.isActive:
            query.awaitTermination(0.5)
            report()
    except KeyboardInterrupt:
        query.stop()
        report()
        err_console.print("stopped: run again with the same --checkpoint to resume")
        return rows, len(seen)
    except Exception as exc:  # The query failed: waiting on it raises its failure.
        report()
        raise executor_error(exc) from None
    failure = query.exception()
    report()
    if failure is not None:
        raise executor_error(failure)
    return rows, len(seen)
