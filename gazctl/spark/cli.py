"""`gazctl spark compact` and `gazctl spark replay`: Spark jobs over journals' fragment stores."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import click
import grpc
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from broker.client import BrokerUnavailable, JournalsClient
from broker.client.journals import BrokerAddressError
from broker.fragment.content import describe
from broker.protocol import protocol_pb2 as pb
from broker.protocol.labels import SelectorError
from broker.protocol.validate import ValidationError
from gazctl.options import broker_options, file_root_option
from gazctl.render import console, err_console
from gazctl.spark.compaction import Plan, plan_journal
from gazctl.spark.journals import (
    JobError,
    listed_fragments,
    select_journals,
    size_in_bytes,
    stores_end,
    unpersisted,
)
from spec import SpecError
from spec.durations import DurationError, parse_duration, seconds_from_duration

T = TypeVar("T")

CODECS = ("NONE", "GZIP", "ZSTANDARD", "SNAPPY", "GZIP_OFFLOAD_DECOMPRESSION")


def parse_size(text: str) -> int:
    size = size_in_bytes(text)
    if size is None:
        raise click.BadParameter(f"{text!r} is not a size: give e.g. 512MiB, 1GiB or 1048576")
    return size


def _seconds(text: str, flag: str) -> float:
    try:
        return seconds_from_duration(parse_duration(text))
    except DurationError as exc:
        raise click.BadParameter(f"{flag} {text!r}: {exc}") from None


def job(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a job command, turning JobError into one line (exit 1)."""

    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (
            JobError, BrokerUnavailable, BrokerAddressError, SelectorError, SpecError,
            ValidationError,
        ) as exc:  # fmt: skip
            raise click.ClickException(str(exc)) from None
        except grpc.aio.AioRpcError as exc:
            detail = (exc.details() or "").split("\n")[0]
            raise click.ClickException(f"broker refused the request ({exc.code().name}): {detail}") from None  # fmt: skip

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def journal_source_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option("-l", "--selector", required=True, help="Label selector of journals"),
            click.option("--specs", type=click.Path(dir_okay=False, path_type=Path), default=None,
                         help="Journal specs (as `journals list -o yaml` writes them) to use "
                              "instead of asking a broker: no broker needed"),
            file_root_option("Directory that roots file:// fragment stores "
                             "(as brokers' --broker.file-root)"),
            click.option("--master", default=None,
                         help="Spark master URL (default: local[*], the embedded engine)"),
            click.option("--remote", default=None,
                         help="Spark Connect server (sc://host:port) to run the job on, "
                              "instead of --master"),
            broker_options,
        ]
    ):  # fmt: skip
        f = decorator(f)
    return f


def one_engine(master: str | None, remote: str | None) -> None:
    """--master and --remote each say where the job runs: one of them at most."""
    if master is not None and remote is not None:
        raise JobError(
            f"give --master or --remote, not both (--master {master} starts Spark here, "
            f"--remote {remote} uses a Spark Connect server's)"
        )
    if remote is not None and not remote.startswith("sc://"):
        raise click.BadParameter(f"{remote!r}: give a Spark Connect URL, sc://host:port")


@click.group()
def spark() -> None:
    """Spark jobs over journal fragment stores (needs `pip install 'gazette-py[spark]'`)."""


# ---- compact ------------------------------------------------------------------------------------


def _plans(
    selector: str,
    opts: dict[str, Any],
    specs: Path | None,
    file_root: Path | None,
    target: int,
    codec: pb.CompressionCodec | None,
    min_age: float | None,
) -> tuple[list[pb.JournalSpec], list[Plan], dict[str, int]]:
    """The journals, a plan for each with a store, and where each store ends."""
    journals = select_journals(
        selector, broker=None if specs else opts["broker_address"], specs=specs
    )
    now = time.time()
    plans = []
    ends = {}
    for spec in journals:
        if not spec.fragment.stores:
            continue
        age = min_age
        if age is None:  # The journal's flush interval: fragments older than it are settled.
            age = seconds_from_duration(spec.fragment.flush_interval) or 3600.0
        listed = listed_fragments(spec, file_root)
        ends[spec.name] = stores_end(listed)
        plans.append(
            plan_journal(
                spec,
                listed,
                target_size=target,
                codec=codec,
                min_age=age,
                now=now,
            )
        )
    if not plans:
        raise JobError(f"none of the journals {selector!r} selects has a fragment store")
    return journals, plans, ends


def _note_unpersisted(
    broker: str | None, journals: Sequence[pb.JournalSpec], ends: dict[str, int]
) -> None:
    """One line for each journal whose brokers hold content past its store's end, which a job
    reading stores leaves out. Journals from --specs have no broker to ask: nothing is said."""
    if broker is None:
        return
    for found in unpersisted(broker, journals, ends):
        err_console.print(found.note(), soft_wrap=True)


def _ranges(fragments: Sequence[pb.Fragment], most: int = 6) -> str:
    """Each fragment's offsets, `[begin, end)`; past `most`, the first and last few."""
    spans = [f"[{f.begin}, {f.end})" for f in fragments]
    if len(spans) > most:
        spans = [*spans[: most // 2], f"… {len(spans) - most} more …", *spans[-(most // 2) :]]
    return " ".join(spans)


def _plan_table(plans: Sequence[Plan], min_age: str | None) -> Table:
    """The dry run's plan: a row per merge (the fragments merged, their offsets and bytes, the
    fragment they become), per redundant fragment to remove, and per journal what stays."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("Journal", "Action", "Fragments", "Offsets", "Bytes", "Into"):
        table.add_column(name, justify="right" if name == "Bytes" else "left")
    age = (
        f"{min_age} ago (--min-age)"
        if min_age is not None
        else ("--min-age ago (by default the journal's flush interval, or 1h)")
    )
    for plan in plans:
        for run in plan.runs:
            postfix = f" under {run.postfix}/" if run.postfix else ""
            table.add_row(
                run.journal, "merge", _ranges(run.fragments), f"[{run.begin}, {run.end})",
                str(run.size),
                f"[{run.begin}, {run.end}) {pb.CompressionCodec.Name(run.codec)}{postfix}",
            )  # fmt: skip
        for fragment in plan.redundant:
            cover = next(
                (f for f in plan.kept if f.begin <= fragment.begin and fragment.end <= f.end),
                None,
            )
            into = f"covered by [{cover.begin}, {cover.end})" if cover else "covered"
            table.add_row(
                plan.journal, "remove", f"[{fragment.begin}, {fragment.end})",
                f"[{fragment.begin}, {fragment.end})", str(fragment.end - fragment.begin),
                f"nothing: {into}",
            )  # fmt: skip
        stays = plan.untouched + plan.too_young
        if stays:
            why = []
            if plan.untouched:
                why.append(f"{plan.untouched} with no adjacent fragment to merge with")
            if plan.too_young:
                why.append(f"{plan.too_young} persisted less than {age}")
            table.add_row(
                plan.journal, "keep", _count(stays, "fragment"), "", "",
                f"as they are: {'; '.join(why)}",
            )  # fmt: skip
    return table


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@spark.command("compact")
@journal_source_options
@click.option(
    "--target-size",
    default="512MiB",
    show_default=True,
    help="Content size that merged fragments approach (and never pass)",
)
@click.option(
    "--codec",
    type=click.Choice(CODECS, case_sensitive=False),
    default=None,
    help="Codec of merged fragments (default: each journal's)",
)
@click.option(
    "--min-age",
    default=None,
    help="Only fragments persisted at least this long ago (default: the journal's "
    "flush interval, or 1h if it has none)",
)
@click.option("--dry-run", is_flag=True, help="Print the plan as a table; change nothing")
@job
def compact_cmd(
    selector: str,
    specs: Path | None,
    file_root: Path | None,
    master: str | None,
    remote: str | None,
    target_size: str,
    codec: str | None,
    min_age: str | None,
    dry_run: bool,
    **opts: Any,
) -> None:
    """Merge runs of adjacent persisted fragments into fewer, larger ones.

    Each run of adjacent fragments (same store and path postfix, persisted at least --min-age
    ago) is merged into one fragment covering exactly the same offsets, under its
    content-addressed name, written with a no-overwrite precondition and verified (read back
    whole: length and SHA-1). Only then, once brokers list it (their index prefers the larger
    fragment), are the fragments it covers removed. Re-running finishes an interrupted run;
    killing it at any step leaves the journal readable, with identical bytes.

    Only stores are read: asked through a broker (not with --specs), each journal whose
    content past its store's end is not persisted yet is named, with how to persist it.
    """
    one_engine(master, remote)
    target = parse_size(target_size)
    age = _seconds(min_age, "--min-age") if min_age is not None else None
    if not dry_run:
        from gazctl.spark.session import check_requirements

        check_requirements(java=remote is None)  # Before any work: what is missing.
    chosen = cast(pb.CompressionCodec, pb.CompressionCodec.Value(codec.upper())) if codec else None
    journals, plans, ends = _plans(selector, opts, specs, file_root, target, chosen, age)
    _note_unpersisted(None if specs else opts["broker_address"], journals, ends)
    runs = [run for plan in plans for run in plan.runs]
    redundant = [f for plan in plans for f in plan.redundant]
    merging = sum(len(run.fragments) for run in runs)
    size = sum(run.size for run in runs)
    untouched = sum(plan.untouched for plan in plans)
    young = sum(plan.too_young for plan in plans)
    summary = (
        f"{_count(len(plans), 'journal')}: {_count(merging, 'fragment')} ({size} bytes) into "
        f"{_count(len(runs), 'fragment')}; {_count(len(redundant), 'redundant fragment')} "
        f"to remove; {untouched} left as they are, {young} too young"
    )
    if dry_run:
        if any(plan.runs or plan.redundant or plan.untouched or plan.too_young for plan in plans):
            console.print(_plan_table(plans, min_age))
        err_console.print(f"dry run, nothing changed: would merge {summary}", soft_wrap=True)
        return
    if not runs and not redundant:
        err_console.print(f"nothing to compact: {summary}", soft_wrap=True)
        return

    from gazctl.spark.jobs import merge_runs, remove_fragments
    from gazctl.spark.session import spark_session

    session = spark_session(master, "gazctl spark compact", remote)
    root = str(file_root) if file_root is not None else None
    with _progress() as progress:
        merged = merge_runs(session, runs, root, progress)
        if not specs:
            _wait_listed(opts["broker_address"], journals, [m.fragment for m in merged])
        covered = [f for run in runs for f in run.fragments] + redundant
        remove_fragments(session, covered, root, progress)
    existed = sum(m.existed for m in merged)
    err_console.print(
        f"compacted {summary.replace(' to remove', ' removed')}"
        + (f" ({existed} already written by an earlier run)" if existed else ""),
        soft_wrap=True,
    )


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), DownloadColumn(),
        console=err_console, transient=False, disable=not err_console.is_terminal,
    )  # fmt: skip


def _wait_listed(
    broker: str, journals: Sequence[pb.JournalSpec], merged: Sequence[pb.Fragment]
) -> None:
    """Wait until the brokers' indexes list each merged fragment (reads then use it), for at
    most a few of the journal's refresh intervals."""
    from gazctl.fragment_ops import list_fragments

    specs = {s.name: s for s in journals}
    by_journal: dict[str, list[pb.Fragment]] = {}
    for fragment in merged:
        by_journal.setdefault(fragment.journal, []).append(fragment)

    async def wait_journal(client: JournalsClient, name: str, fragments: list[pb.Fragment]) -> None:
        spec = specs[name]
        if spec.suspend.level == pb.JournalSpec.Suspend.FULL:
            return  # No replica serves it: nothing reads through an index.
        refresh = seconds_from_duration(spec.fragment.refresh_interval) or 300.0
        deadline = time.monotonic() + 3 * refresh + 30
        while True:  # One listing per poll covers every merged fragment of the journal.
            listed = {
                (f.spec.begin, f.spec.end)
                for f in await list_fragments(client.stub, name)
                if f.spec.backing_store
            }
            missing = [f for f in fragments if (f.begin, f.end) not in listed]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise JobError(
                    f"brokers have not listed {describe(missing[0])} yet, so the fragments "
                    "it covers were not removed: re-run once they have"
                )
            await asyncio.sleep(min(1.0, refresh / 4))

    async def wait() -> None:
        async with JournalsClient(broker) as client:
            await asyncio.gather(*(wait_journal(client, n, f) for n, f in by_journal.items()))

    try:
        asyncio.run(wait())
    except BrokerUnavailable as exc:
        raise JobError(f"{exc} (to compact without brokers, give --specs)") from None


# ---- replay -------------------------------------------------------------------------------------


def _parse_target(text: str) -> tuple[str, str]:
    kind, sep, where = text.partition(":")
    if not sep or kind not in ("parquet", "journal") or not where:
        raise click.BadParameter(
            f"{text!r}: give parquet:PATH (a directory to create) or journal:NAME"
        )
    return kind, where


def _from_time(text: str | None) -> float:
    if text is None:
        return 0.0
    from datetime import datetime

    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a time: give unix seconds or an ISO 8601 time "
            "(2026-11-22T10:00:00+00:00)"
        ) from None
    if moment.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no time zone: add one, e.g. +00:00")
    return moment.timestamp()


@spark.command("replay")
@journal_source_options
@click.option(
    "--to",
    "target",
    required=True,
    help="parquet:PATH (a new directory) or journal:NAME (re-published, UUIDs kept)",
)
@click.option(
    "--from-time",
    default=None,
    help="Skip fragments persisted before this time (unix seconds or ISO 8601)",
)
@click.option(
    "--framing",
    type=click.Choice(["auto", "lines", "csv"]),
    default="auto",
    show_default=True,
    help="Message framing (auto: each journal's content-type)",
)
@click.option(
    "--flatten",
    is_flag=True,
    help="Parquet: also a column per top-level field of the JSON messages",
)
@click.option(
    "--uuid-path",
    default="_meta.uuid",
    show_default=True,
    help="Where JSON messages carry their UUID",
)
@click.option(
    "--split-size",
    default="128MiB",
    show_default=True,
    help="Read a larger fragment as several tasks of about this much content, split at message "
    "boundaries (what a task holds in memory)",
)
@job
def replay_cmd(
    selector: str,
    specs: Path | None,
    file_root: Path | None,
    master: str | None,
    remote: str | None,
    target: str,
    from_time: str | None,
    framing: str,
    flatten: bool,
    uuid_path: str,
    split_size: str,
    **opts: Any,
) -> None:
    """Replay journal history read-committed into Parquet or another journal.

    Messages are read from the fragment stores and sequenced as a read-committed reader does:
    duplicates dropped (by producer and clock), pending messages kept only if acknowledged,
    rolled-back ones dropped. To Parquet: one row per committed message (journal, offset,
    end, commit_offset, producer, clock, flags, uuid, content); ordering rows by journal,
    commit_offset and offset gives the order a reader delivers them. To a journal: the
    committed messages and their acknowledgements are appended with their original UUIDs, in
    clock order per producer, so a read-committed reader of that journal sees each message once
    however many times the replay runs (messages without a UUID: once per run).

    Only stores are read: asked through a broker (not with --specs), each journal whose
    content past its store's end is not persisted yet is named, with how to persist it.
    """
    one_engine(master, remote)
    kind, where = _parse_target(target)
    if remote is not None and kind == "journal":
        raise JobError(
            "replaying into a journal needs RDDs and accumulators, which Spark Connect has "
            "not: give --master (or neither, for local[*]) instead of --remote"
        )
    if remote is not None and flatten:
        raise JobError(
            "--flatten infers the messages' schema through an RDD, which Spark Connect has "
            "not: give --master (or neither, for local[*]) instead of --remote, or leave out "
            "--flatten"
        )
    since = _from_time(from_time)
    split_bytes = parse_size(split_size)
    from gazctl.spark.session import check_requirements

    check_requirements(java=remote is None)
    if kind == "parquet" and Path(where).exists():
        raise JobError(f"{where} already exists: remove it or give another path")
    broker = None if specs else opts["broker_address"]
    # Plan on the driver first: bad selectors and stores fail here, as one line.
    journals = select_journals(selector, broker=broker, specs=specs)
    if broker is not None:
        ends = {s.name: stores_end(listed_fragments(s, file_root)) for s in journals}
        _note_unpersisted(broker, journals, ends)

    from gazctl.spark.jobs import replay_to_journal, replay_to_parquet
    from gazctl.spark.session import spark_session

    session = spark_session(master, "gazctl spark replay", remote)
    options = {"selector": selector, "framing": framing, "uuid_path": uuid_path,
               "from_time": str(since), "split_bytes": str(split_bytes)}  # fmt: skip
    if specs is not None:
        options["specs"] = str(specs)
    elif broker is not None:
        options["broker"] = str(broker)
    if file_root is not None:
        options["file_root"] = str(file_root)
    if kind == "parquet":
        with _progress() as progress:
            rows = replay_to_parquet(session, options, where, flatten, progress)
        err_console.print(f"replayed {_count(rows, 'committed message')} into {where}")
    else:
        if broker is None:
            raise JobError("replaying into a journal needs a broker: give --broker.address")
        with _progress() as progress:
            rows = replay_to_journal(session, options, where, broker, progress)
        err_console.print(
            f"replayed {_count(rows, 'committed message')} (acknowledgements included) into "
            f"journal {where}"
        )


from gazctl.spark.stream_cli import stream_cmd  # noqa: E402  (it builds on `job` above)

spark.add_command(stream_cmd)
