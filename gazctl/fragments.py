"""`gazctl journals fragments|prune|store-health|suspend`: journal fragments and their stores.

`fragments` pages through the ListFragments RPC; `prune` deletes aged fragments straight from
their stores with gazctl's own credentials; `store-health` asks a broker to check a store;
`suspend` asks brokers to suspend idle journals (zero-byte appends with a suspend mode).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from google.protobuf import duration_pb2, json_format
from rich.table import Table

from broker.client import JournalsClient
from broker.client.appender import AppendError, append
from broker.client.routes import waiting
from broker.fragment.stores import check_store_url
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from gazctl.fragment_ops import (
    RPC_TIMEOUT,
    Listed,
    aged_fragments,
    list_fragments,
    remove_all,
    stores_of,
)
from gazctl.journals import journals
from gazctl.journals_io import matching
from gazctl.options import broker_options, client_of, file_root_option, wait_option
from gazctl.render import console, err_console, note
from spec.durations import DurationError, parse_duration, seconds_from_duration

NONE = pb.JournalSpec.Suspend.NONE
FULL = pb.JournalSpec.Suspend.FULL
PARTIAL = pb.JournalSpec.Suspend.PARTIAL


# ---- listing ----------------------------------------------------------------------------------


def persisted_at(fragment: pb.Fragment) -> str:
    if not fragment.backing_store or not fragment.mod_time:
        return "local"
    return datetime.fromtimestamp(fragment.mod_time, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fragments_table(fragments: Sequence[Listed], *, urls: bool = False) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("Journal", "Begin", "End", "Length", "Codec", "Persisted", "Store"):
        table.add_column(name, justify="right" if name in ("Begin", "End", "Length") else "left")
    if urls:
        table.add_column("URL", overflow="fold")
    for listed in fragments:
        f = listed.spec
        row = [
            f.journal,
            str(f.begin),
            str(f.end),
            str(f.end - f.begin),
            pb.CompressionCodec.Name(f.compression_codec),
            persisted_at(f),
            f.backing_store or "-",
        ]
        if urls:
            row.append(listed.signed_url or "-")
        table.add_row(*row)
    return table


def _unix_seconds(flag: str, value: int | None) -> int:
    if value is None:
        return 0
    if value < 0:
        raise click.ClickException(f"{flag} {value}: give unix seconds since the epoch (>= 0)")
    return value


async def _fragments(
    opts: dict[str, Any],
    selector: str,
    begin: int,
    end: int,
    ttl: duration_pb2.Duration | None,
) -> tuple[list[Listed], int]:
    journals_ = await matching(opts, selector)
    readable = [j.spec.name for j in journals_ if j.spec.suspend.level != FULL]
    async with client_of(opts) as client:
        pages = await asyncio.gather(
            *(
                list_fragments(
                    client.stub, name, begin_mod_time=begin, end_mod_time=end, signature_ttl=ttl
                )
                for name in readable
            )
        )
    return [f for page in pages for f in page], len(journals_) - len(readable)


@journals.command("fragments")
@broker_options
@click.option(
    "-l", "--selector", required=True, help="Label selector of journals whose fragments to list"
)
@click.option(
    "-o",
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Output format",
)
@click.option(
    "--from",
    "from_unix",
    type=int,
    default=None,
    help="Only fragments persisted at or after this time (unix seconds)",
)
@click.option(
    "--to",
    "to_unix",
    type=int,
    default=None,
    help="Only fragments persisted at or before this time (unix seconds); excludes local fragments",
)
@click.option(
    "--url-ttl",
    default="0s",
    show_default=True,
    help="Include a signed GET URL valid for this long (e.g. 1m); 0s: no URLs",
)
def fragments_cmd(
    selector: str, fmt: str, from_unix: int | None, to_unix: int | None, url_ttl: str,
    **opts: Any,
) -> None:  # fmt: skip
    """List the fragments of the selected journals.

    Fragments are listed as the journals' brokers index them: persisted ones, with their
    store and the time it holds them since, and local ones, not persisted yet. --from and
    --to select on the persisted time, in unix seconds (e.g. `--from $(date -d '1 hour ago'
    +%s)`). With --url-ttl, each persisted fragment comes with a signed URL from which it can
    be read without a broker. Output formats: table, or json (one fragment per line: its
    spec, and signed_url).
    """
    from gazctl.cli import run

    begin = _unix_seconds("--from", from_unix)
    end = _unix_seconds("--to", to_unix)
    if to_unix is not None and from_unix is not None and end < begin:
        raise click.ClickException(
            f"--to {end} is before --from {begin}: give a range that is not empty"
        )
    try:
        ttl = parse_duration(url_ttl)
    except DurationError as exc:
        raise click.ClickException(f"--url-ttl: {exc}") from None
    if ttl.seconds < 0 or ttl.nanos < 0:
        raise click.ClickException(f"--url-ttl {url_ttl}: must not be negative")
    with_urls = ttl.seconds > 0 or ttl.nanos > 0
    listed, skipped = run(_fragments(opts, selector, begin, end, ttl if with_urls else None))
    if fmt == "json":
        for item in listed:
            doc: dict[str, Any] = {
                "spec": json_format.MessageToDict(item.spec, preserving_proto_field_name=True)
            }
            if item.signed_url:
                doc["signed_url"] = item.signed_url
            click.echo(json.dumps(doc, sort_keys=True))
    else:
        console.print(fragments_table(listed, urls=with_urls))
    if skipped:
        err_console.print(
            f"skipped {_count(skipped, 'fully suspended journal')}: they have no replicas, "
            "nor fragments",
            soft_wrap=True,
        )


# ---- prune ------------------------------------------------------------------------------------


@dataclass
class PrunePlan:
    """What pruning removes (`doomed`), and what it looked at."""

    doomed: list[pb.Fragment] = field(default_factory=list)
    journals: int = 0  # Journals whose fragments were examined.
    fragments: int = 0  # Fragments those journals' indexes list.
    no_retention: list[str] = field(default_factory=list)
    suspended: list[str] = field(default_factory=list)


async def _prune_plan(opts: dict[str, Any], selector: str, now: float) -> PrunePlan:
    plan = PrunePlan()
    journals_ = await matching(opts, selector)
    async with client_of(opts) as client:
        for journal in journals_:
            spec = journal.spec
            retention = seconds_from_duration(spec.fragment.retention)
            if retention <= 0:
                plan.no_retention.append(spec.name)
                continue
            if spec.suspend.level == FULL:
                plan.suspended.append(spec.name)  # No replicas: its fragments cannot be listed.
                continue
            listed = [f.spec for f in await list_fragments(client.stub, spec.name)]
            plan.journals += 1
            plan.fragments += len(listed)
            plan.doomed.extend(aged_fragments(listed, retention, now))
    return plan


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@journals.command("prune")
@broker_options
@click.option("-l", "--selector", required=True, help="Label selector of journals to prune")
@click.option("--dry-run", is_flag=True, help="List what would be removed, and remove nothing")
@file_root_option("Directory that roots file:// fragment stores (as brokers' --broker.file-root)")
def prune_cmd(selector: str, dry_run: bool, file_root: Path | None, **opts: Any) -> None:
    """Delete persisted fragments older than their journal's fragment.retention.

    For each selected journal with a retention, the fragments its brokers' index lists are
    examined, and those persisted at least the retention ago are deleted directly from their
    stores, with gazctl's own credentials (brokers never delete). Journals without a
    retention are left alone, and so are local (not yet persisted) fragments.

    A journal's last persisted fragment is always kept, however old: it records how far the
    journal was written, and a cluster that restarts recovers its write head from the stores.
    Without it, brokers would find an empty index and could write the same offsets twice.

    Only the fragments the index lists (those covering the journal) are deleted; smaller
    fragments that they overlap stay until a later prune, once brokers list them again.
    Brokers list removed fragments until they next list their stores (each journal's
    fragment.refresh_interval): until then, reads of the removed content fail.
    """
    from gazctl.cli import run

    plan = run(_prune_plan(opts, selector, time.time()))
    doomed = plan.doomed
    size = sum(f.end - f.begin for f in doomed)
    skipped = ""
    if plan.no_retention:
        skipped += f"; {_count(len(plan.no_retention), 'journal')} without a retention skipped"
    if plan.suspended:
        skipped += f"; {_count(len(plan.suspended), 'fully suspended journal')} skipped"
    examined = (
        f"examined {_count(plan.fragments, 'fragment')} of {_count(plan.journals, 'journal')}"
    )
    if dry_run:
        if doomed:
            console.print(fragments_table([Listed(spec=f) for f in doomed]))
        err_console.print(
            f"dry run, nothing removed: would remove {_count(len(doomed), 'fragment')} "
            f"({size} bytes); {examined}{skipped}",
            soft_wrap=True,
        )
        return
    if doomed:
        remove_all(doomed, stores_of(doomed, file_root))
    err_console.print(
        f"removed {_count(len(doomed), 'fragment')} ({size} bytes); {examined}{skipped}",
        soft_wrap=True,
    )


# ---- store-health -----------------------------------------------------------------------------


async def _store_health(
    opts: dict[str, Any], url: str, delete_prefix: str | None
) -> pb.FragmentStoreHealthResponse:
    request = pb.FragmentStoreHealthRequest(fragment_store=url)
    if delete_prefix is not None:
        request.check_delete = True
        request.check_delete_prefix = delete_prefix
    async with client_of(opts) as client:
        response: pb.FragmentStoreHealthResponse = await client.stub.FragmentStoreHealth(
            request, timeout=RPC_TIMEOUT
        )
    return response


@journals.command("store-health")
@broker_options
@click.argument("store_url")
@click.option("--check-delete-prefix", default=None,
              help="Also check delete permission: put and remove a probe object under this prefix, "
                   "which ends in '/' (an empty value probes the store's root)")  # fmt: skip
def store_health_cmd(store_url: str, check_delete_prefix: str | None, **opts: Any) -> None:
    """Check the health of a fragment store (e.g. s3://bucket/prefix/).

    A broker checks the store as it uses it, with its own credentials: put, get and list an
    object, and sign and fetch a URL of it. Exits 1 when the store is unhealthy."""
    from gazctl.cli import run

    try:
        check_store_url(store_url)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if check_delete_prefix and not check_delete_prefix.endswith("/"):
        raise click.ClickException(
            f"--check-delete-prefix {check_delete_prefix!r} must end in '/' "
            "(or be empty for the store's root)"
        )
    response = run(_store_health(opts, store_url, check_delete_prefix))
    if response.status == pb.OK:
        console.print(f"fragment store {store_url} is healthy", markup=False)
    elif response.status == pb.FRAGMENT_STORE_UNHEALTHY:
        raise click.ClickException(
            f"fragment store {store_url} is unhealthy: {response.store_health_error}"
        )
    else:
        raise click.ClickException(
            f"health check of fragment store {store_url} failed: {pb.Status.Name(response.status)}"
        )


# ---- suspend ----------------------------------------------------------------------------------


@dataclass
class Suspension:
    journal: str
    before: pb.JournalSpec.Suspend
    after: pb.JournalSpec.Suspend | None = None
    failed: str = ""  # Why the append failed, when it did.

    @property
    def final(self) -> pb.JournalSpec.Suspend:
        """The suspension as listed afterwards (as before, if the journal was not listed)."""
        return self.after if self.after is not None else self.before

    def outcome(self, force: bool) -> str:
        after = self.final
        if self.failed:
            return f"failed: {self.failed}"
        if self.before.level == FULL:
            return "already fully suspended"
        if after.level == FULL:
            return "suspended: it holds no content, so it keeps no replicas"
        if after.level == PARTIAL and self.before.level == PARTIAL:
            return "already suspended; one replica keeps serving reads"
        if after.level == PARTIAL:
            return "suspended: one replica keeps serving reads"
        if force:
            return "not suspended"
        return (
            "not suspended: it has fragments not yet persisted, or persisted within its "
            "flush interval (use --force to suspend it now)"
        )


async def _suspend_one(
    stub: pb_grpc.JournalStub, name: str, mode: pb.AppendRequest.Suspend, wait: float
) -> tuple[str, int]:
    """A zero-byte suspending append, waiting (up to `wait` seconds) while the journal's route
    forms; returns a failure ("" if none) and the etcd revision its response was served at."""
    try:
        response = await waiting(
            lambda: append(stub, name, b"", suspend=mode, timeout=RPC_TIMEOUT),
            f"suspend of {name}", wait=wait, on_wait=note,
        )  # fmt: skip
    except AppendError as exc:
        # SUSPENDED answers an append to a journal that is (now) suspended: that is success.
        if exc.status == pb.SUSPENDED:
            return "", exc.response.header.etcd.revision
        return pb.Status.Name(exc.status), 0
    return "", response.header.etcd.revision


async def _suspend(opts: dict[str, Any], selector: str, force: bool) -> list[Suspension]:
    journals_ = await matching(opts, selector)
    mode = pb.AppendRequest.SUSPEND_NOW if force else pb.AppendRequest.SUSPEND_IF_FLUSHED
    outcomes = [Suspension(j.spec.name, j.spec.suspend) for j in journals_]
    async with client_of(opts) as client:
        todo = [o for o in outcomes if o.before.level != FULL]
        results = await asyncio.gather(
            *(_suspend_one(client.stub, o.journal, mode, opts["wait"]) for o in todo)
        )
        for outcome, (failed, _) in zip(todo, results, strict=True):
            outcome.failed = failed
        # The suspension is in the journal spec: list it, once the broker has seen the updates.
        revision = max((rev for _, rev in results), default=0)
        by_name = await _listed_through(client, selector, revision)
    for outcome in outcomes:
        listed = by_name.get(outcome.journal)
        if listed is not None:
            outcome.after = listed.spec.suspend
    return outcomes


async def _listed_through(
    client: JournalsClient, selector: str, revision: int
) -> dict[str, pb.ListResponse.Journal]:
    deadline = time.monotonic() + 5
    while True:
        snapshot = await client.list(labels.parse_selector(selector))
        if snapshot.header.etcd.revision >= revision or time.monotonic() > deadline:
            return {j.spec.name: j for j in snapshot.journals}
        await asyncio.sleep(0.05)


@journals.command("suspend")
@broker_options
@wait_option
@click.option("-l", "--selector", required=True, help="Label selector of journals to suspend")
@click.option("-f", "--force", is_flag=True,
              help="Suspend even journals whose fragments are not yet persisted")  # fmt: skip
def suspend_cmd(selector: str, force: bool, **opts: Any) -> None:
    """Suspend idle journals, so that they use one broker replica, or none.

    A journal without content is suspended FULL: it keeps no replicas until an append
    resumes it. One whose fragments are all persisted, and persisted longer ago than its
    flush interval (24h when unset), is suspended PARTIAL: its content is persisted and one
    replica keeps serving reads. With --force, journals are suspended PARTIAL now, and what
    they hold is rolled into a fragment and persisted. Any append resumes a journal.

    The suspension is written to the journal's spec: when applying spec changes, keep its
    `suspend` field (`journals edit` does).
    """
    from gazctl.cli import run

    outcomes = run(_suspend(opts, selector, force))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("Journal", "Suspend", "Offset", "Result"):
        table.add_column(name, justify="right" if name == "Offset" else "left")
    for o in outcomes:
        level = pb.JournalSpec.Suspend.Level.Name(o.final.level)
        table.add_row(o.journal, level, str(o.final.offset), o.outcome(force))
    console.print(table)
    ok = [o for o in outcomes if not o.failed]
    now = sum(1 for o in ok if o.before.level != FULL and o.final.level != o.before.level)
    already = sum(1 for o in ok if o.before.level != NONE and o.final.level == o.before.level)
    idle = sum(1 for o in ok if o.final.level == NONE)
    summary = (
        f"{_count(len(outcomes), 'journal')}: {now} suspended now, {already} already "
        f"suspended, {idle} not suspended"
    )
    if idle and not force:
        summary += " (--force suspends journals with unpersisted fragments)"
    failed = [o for o in outcomes if o.failed]
    if failed:
        raise click.ClickException(
            f"{summary}; failed to suspend {_count(len(failed), 'journal')}: "
            + ", ".join(f"{o.journal} ({o.failed})" for o in failed[:5])
        )
    err_console.print(summary, soft_wrap=True)
