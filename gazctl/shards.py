"""`gazctl shards ...`: manage shards (apply, list, edit, unassign) through a consumer's Shard
service, and their recovery logs (recover, prune)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from google.protobuf import json_format
from rich.table import Table

from broker.client import ApplyConflict, ApplyTooLarge, JournalsClient
from broker.client.reader import write_head
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError
from consumer.client import PrimaryUnreachable, ShardsClient
from consumer.protocol import cpb, recovery_log, reduce_status, validate_shard_spec
from gazctl import render
from gazctl.options import (
    conflict_error,
    consumer_options,
    file_root_option,
    max_txn_size_option,
    parse_selector,
    read_specs,
    too_large_error,
)
from message.framing import framing_for
from spec import SpecError
from spec import shards as sspec

RECOVERY_LOG_CONTENT_TYPE = "application/x-gazette-recoverylog"


@click.group()
def shards() -> None:
    """Interact with consumer shards."""


def shards_client(opts: dict[str, Any]) -> ShardsClient:
    try:
        return ShardsClient(opts["consumer_address"])
    except ValueError as exc:
        raise click.ClickException(str(exc).replace("broker address", "consumer address")) from None


# ---- list -----------------------------------------------------------------------------------


def _code(status: cpb.ReplicaStatus) -> str:
    return cpb.ReplicaStatus.Code.Name(status.code)


def _rf(spec: cpb.ShardSpec) -> int:
    return 0 if spec.disable else spec.hot_standbys + 1


def shards_table(
    listed: Sequence[cpb.ListResponse.Shard],
    *,
    label_columns: Sequence[str] = (),
    primary: bool = False,
    replicas: bool = False,
    rf: bool = False,
    lag: dict[str, str] | None = None,
) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("ID")
    table.add_column("Status")
    if rf:
        table.add_column("RF", justify="right")
    if primary:
        table.add_column("Primary")
    if replicas:
        table.add_column("Replicas")
    for name in label_columns:
        table.add_column(name)
    if lag is not None:
        table.add_column("Lag")
    for shard in listed:
        route = shard.route
        primary_cell = "<none>"
        replica_cells = []
        for index, (member, status) in enumerate(zip(route.members, shard.status, strict=False)):
            cell = f"{member.suffix}:{_code(status)}"
            if index == route.primary:
                primary_cell = cell
            else:
                replica_cells.append(cell)
        row = [shard.spec.id, _code(reduce_status(shard.status))]
        if rf:
            row.append(str(_rf(shard.spec)))
        if primary:
            row.append(primary_cell)
        if replicas:
            row.append(", ".join(replica_cells))
        for name in label_columns:
            values = labels.values_of(shard.spec.labels, name)
            row.append(",".join(values) if values else "<none>")
        if lag is not None:
            row.append(lag.get(shard.spec.id, ""))
        table.add_row(*row)
    render.console.print(table)


async def _lags(opts: dict[str, Any], listed: cpb.ListResponse) -> dict[str, str]:
    """Per shard, `journal:N, ...`: each source's write head less what the shard read through
    (by Stat, answered by its primary); shards without a primary have none, and a primary
    that cannot be reached (its process died, and its lease has not expired) is marked."""
    out: dict[str, str] = {}
    async with JournalsClient(opts["broker_address"]) as brokers, shards_client(opts) as client:
        heads: dict[str, int] = {}
        for shard in listed.shards:
            if shard.route.primary == -1:
                continue
            try:
                stat = await client.stat(shard.spec.id)
            except PrimaryUnreachable as exc:
                out[shard.spec.id] = f"<{exc.member} unreachable>"
                continue
            parts = []
            for source in shard.spec.sources:
                journal = source.journal
                if journal not in heads:
                    heads[journal] = await write_head(brokers.stub, journal)
                parts.append(
                    f"{journal}:{max(0, heads[journal] - stat.read_through.get(journal, 0))}"
                )
            out[shard.spec.id] = ", ".join(parts)
    return out


async def _list(opts: dict[str, Any], selector: pb.LabelSelector, fmt: str, lag: bool) -> None:
    async with shards_client(opts) as client:
        listed = await client.list(selector)
    if fmt == "yaml":
        entries = [sspec.ShardEntry(s.spec, revision=s.mod_revision) for s in listed.shards]
        click.echo(sspec.encode_shards(entries) if entries else "", nl=False)
    elif fmt == "json":
        for shard in listed.shards:
            doc = json_format.MessageToDict(shard, preserving_proto_field_name=True)
            click.echo(json.dumps(doc, sort_keys=True))
    elif fmt == "proto":
        click.echo(str(listed), nl=False)
    else:
        shards_table(
            listed.shards,
            label_columns=list(opts["label_columns"]),
            primary=opts["primary"],
            replicas=opts["replicas"],
            rf=opts["rf"],
            lag=await _lags(opts, listed) if lag else None,
        )


@shards.command("list")
@consumer_options
@click.option("-l", "--selector", default="", help="Label selector of shards to list")
@click.option(
    "-o", "--format", "fmt", default="table", show_default=True,
    type=click.Choice(["table", "yaml", "json", "proto"]), help="Output format",
)  # fmt: skip
@click.option("-L", "--label-columns", multiple=True, help="Labels to present as columns")
@click.option("-p", "--primary", is_flag=True, help="Show the primary column")
@click.option("-r", "--replicas", is_flag=True, help="Show the replicas column")
@click.option("--rf", is_flag=True, help="Show the replication factor column")
@click.option("--lag", is_flag=True, help="Show the amount of unread data for each shard")
def list_cmd(selector: str, fmt: str, lag: bool, **opts: Any) -> None:
    """List shard specifications and status.

    The selector supports the meta-label "id", e.g. `-l "id=word-count-000"`. Output formats:
    table, yaml (a shardspace `shards apply` accepts), json (one shard per line), proto.
    """
    from gazctl.cli import run

    run(_list(opts, parse_selector(selector), fmt, lag))


# ---- apply ----------------------------------------------------------------------------------


def decode_entries(origin: str, text: str) -> list[sspec.ShardEntry]:
    """Decode and validate a shardspace; any problem names the shard or the line."""
    try:
        entries = sspec.decode_shards(text)
    except SpecError as exc:
        raise click.ClickException(f"{origin}: {exc}") from None
    for entry in entries:
        if entry.delete:
            continue
        try:
            validate_shard_spec(entry.spec, hint_prefix_optional=True)  # The consumer fills it in.
        except ValidationError as exc:
            where = f" (line {entry.line})" if entry.line else ""
            raise click.ClickException(f"{origin}: shard {entry.spec.id}{where}: {exc}") from None
    return entries


async def check_journals(opts: dict[str, Any], entries: Sequence[sspec.ShardEntry]) -> None:
    """Every source journal exists with a framed content type, and every recovery log exists
    labelled as one (upstream's check before an apply)."""
    async with JournalsClient(opts["broker_address"]) as client:
        listed = {j.spec.name: j.spec for j in (await client.list()).journals}
    for entry in entries:
        if entry.delete:
            continue
        spec = entry.spec
        for source in spec.sources:
            name = source.journal.partition(";")[0]
            journal = listed.get(name)
            if journal is None:
                raise click.ClickException(
                    f"shard {spec.id}: source journal {name} does not exist: create it first "
                    "(`gazctl journals apply`)"
                )
            content_type = labels.value_of(journal.labels, "content-type")
            try:
                framing_for(content_type)
            except ValueError as exc:
                raise click.ClickException(
                    f"shard {spec.id}: source journal {name}: {exc}"
                ) from None
        log = recovery_log(spec)
        if log:
            journal = listed.get(log)
            if journal is None:
                raise click.ClickException(
                    f"shard {spec.id}: recovery log {log} does not exist: create it first, "
                    f"labelled content-type: {RECOVERY_LOG_CONTENT_TYPE}"
                )
            if labels.value_of(journal.labels, "content-type") != RECOVERY_LOG_CONTENT_TYPE:
                raise click.ClickException(
                    f"shard {spec.id}: journal {log} is not a recovery log (label it "
                    f"content-type: {RECOVERY_LOG_CONTENT_TYPE})"
                )


def plan(
    entries: Sequence[sspec.ShardEntry], current: cpb.ListResponse
) -> list[render.PlannedChange]:
    by_id = {s.spec.id: s for s in current.shards}
    out = []
    for entry in entries:
        existing = by_id.get(entry.spec.id)
        conflict = ""
        if entry.revision != -1:
            have = existing.mod_revision if existing else 0
            if have != entry.revision:
                conflict = (
                    f"revision {entry.revision} but the shard is at {have}"
                    if have
                    else f"revision {entry.revision} but the shard does not exist"
                )
        diff: list[str] = []
        if entry.delete:
            action = "delete" if existing else "delete (absent)"
        elif existing is None:
            action = "create"
        else:
            diff = render.spec_diff(existing.spec, entry.spec)
            action = "update" if diff else "unchanged"
        out.append(render.PlannedChange(entry.spec.id, action, diff, conflict))
    return out


def changes_of(entries: Sequence[sspec.ShardEntry]) -> list[cpb.ApplyRequest.Change]:
    return [
        cpb.ApplyRequest.Change(expect_mod_revision=e.revision, delete=e.spec.id)
        if e.delete
        else cpb.ApplyRequest.Change(expect_mod_revision=e.revision, upsert=e.spec)
        for e in entries
    ]


async def _apply(
    opts: dict[str, Any], entries: list[sspec.ShardEntry], dry_run: bool, max_txn_size: int
) -> list[render.PlannedChange]:
    await check_journals(opts, entries)
    async with shards_client(opts) as client:
        planned = plan(entries, await client.list())
        if dry_run:
            return planned
        try:
            await client.apply(changes_of(entries), max_txn_size=max_txn_size)
        except ApplyConflict as exc:
            raise conflict_error("shards", [p.name for p in planned if p.conflict], exc) from None
        except ApplyTooLarge as exc:
            # A shard with primary hints takes two etcd operations.
            raise too_large_error(exc, fits=64) from None
        return planned


@shards.command("apply")
@consumer_options
@click.option(
    "--specs",
    default="-",
    show_default=True,
    help="Input specifications path to apply (- for stdin)",
)
@click.option("--dry-run", is_flag=True, help="Show what would change, and change nothing")
@max_txn_size_option
def apply_cmd(specs: str, dry_run: bool, max_txn_size: int, **opts: Any) -> None:
    """Apply a shardspace (as `shards list -o yaml` prints) to the consumers.

    First checks that every source journal exists with a framed content type, and every
    recovery log exists labelled as one.
    """
    origin, text = read_specs(specs)
    entries = decode_entries(origin, text)
    if not entries:
        raise click.ClickException(f"{origin}: no shards to apply")
    from gazctl.cli import run

    planned = run(_apply(opts, entries, dry_run, max_txn_size))
    render.print_plan(planned, dry_run=dry_run)
    if dry_run and any(change.conflict for change in planned):
        sys.exit(1)


# ---- unassign -------------------------------------------------------------------------------

UNASSIGN_BATCH = 100  # Shards per Unassign request, as upstream's.


async def _unassign(
    opts: dict[str, Any], selector: pb.LabelSelector, only_failed: bool, dry_run: bool
) -> list[str]:
    async with shards_client(opts) as client:
        listed = await client.list(selector)
        ids = [s.spec.id for s in listed.shards]
        out: list[str] = []
        for start in range(0, len(ids), UNASSIGN_BATCH):
            response = await client.unassign(
                ids[start : start + UNASSIGN_BATCH], only_failed=only_failed, dry_run=dry_run
            )
            if response.status != cpb.OK:
                raise click.ClickException(
                    f"unassign failed ({cpb.Status.Name(response.status)}): assignments changed "
                    "meanwhile; list the shards again and retry"
                )
            out.extend(response.shards)
        return out


@shards.command("unassign")
@consumer_options
@click.option("-l", "--selector", required=True, help="Label selector of shards to unassign")
@click.option("--failed", is_flag=True, help="Only remove assignments of FAILED replicas")
@click.option("--dry-run", is_flag=True, help="Show which shards would change, and change nothing")
def unassign_cmd(selector: str, failed: bool, dry_run: bool, **opts: Any) -> None:
    """Remove the assignments of the selected shards' FAILED replicas (and, unless --failed,
    their primaries), so the allocator assigns them afresh: how a FAILED shard is restarted."""
    from gazctl.cli import run

    changed = run(_unassign(opts, parse_selector(selector), failed, dry_run))
    for shard_id in changed:
        click.echo(shard_id)
    verb = "would be unassigned" if dry_run else "unassigned"
    render.err_console.print(f"{len(changed)} shard(s) {verb}")


# ---- edit -----------------------------------------------------------------------------------

EDIT_HEADER = """\
# Editing shards matching the selector: {selector}
# Save and close to apply; an empty file or unchanged content applies nothing.
# Lines starting with '#' are ignored.
"""


async def _edit(
    opts: dict[str, Any], selector_text: str, max_txn_size: int
) -> list[render.PlannedChange]:
    from gazctl.editor import edit_and_apply

    async with shards_client(opts) as client:
        listed = await client.list(parse_selector(selector_text))
    if not listed.shards:
        raise click.ClickException(f"no shards match the selector {selector_text!r}")
    entries = [sspec.ShardEntry(s.spec, revision=s.mod_revision) for s in listed.shards]
    original = EDIT_HEADER.format(selector=selector_text) + sspec.encode_shards(entries)

    async def apply_text(body: str) -> list[render.PlannedChange]:
        edited = decode_entries("edited specs", body)
        return await _apply(opts, edited, dry_run=False, max_txn_size=max_txn_size)

    return await edit_and_apply(original, "shards.yaml", apply_text)


@shards.command("edit")
@consumer_options
@click.option("-l", "--selector", required=True, help="Label selector of shards to edit")
@max_txn_size_option
def edit_cmd(selector: str, max_txn_size: int, **opts: Any) -> None:
    """Edit shard specifications in $GAZ_EDITOR (or $EDITOR) and apply the result.

    If the edit does not decode or apply, the editor re-opens with the error shown at the top.
    """
    from gazctl.cli import run

    planned = run(_edit(opts, selector, max_txn_size))
    if planned:
        render.print_plan(planned, dry_run=False)


# ---- prune ----------------------------------------------------------------------------------


async def _prune_plan(
    opts: dict[str, Any], selector: pb.LabelSelector
) -> tuple[list[pb.Fragment], dict[str, str], int]:
    """The fragments to remove, the logs skipped (with why), and the fragments examined."""
    from consumer.recoverylog.prune import LogSegments, PruneRefused, prunable
    from gazctl.fragment_ops import list_fragments

    hinted = LogSegments()
    async with shards_client(opts) as client:
        for shard in (await client.list(selector)).shards:
            log = recovery_log(shard.spec)
            if not log:
                continue
            response = await client.get_hints(shard.spec.id)
            sets = [response.primary_hints, *response.backup_hints]
            hinted.add_hints(
                log, [h.hints if h.HasField("hints") else None for h in sets], shard.spec.id
            )
    doomed: list[pb.Fragment] = []
    examined = 0
    async with JournalsClient(opts["broker_address"]) as journals:
        for log, segments in sorted(hinted.segments.items()):
            if log in hinted.skipped:
                continue
            listed = [f.spec for f in await list_fragments(journals.stub, log)]
            examined += len(listed)
            try:
                doomed.extend(prunable(listed, segments))
            except PruneRefused as exc:
                raise click.ClickException(f"{exc} (nothing was removed)") from None
    return doomed, hinted.skipped, examined


@shards.command("prune")
@consumer_options
@click.option(
    "-l", "--selector", required=True, help="Label selector of shards whose recovery logs to prune"
)
@click.option("--dry-run", is_flag=True, help="Show what would be removed, and remove nothing")
@file_root_option("Directory that roots file:// fragment stores (as brokers' --broker.file-root)")
def prune_cmd(selector: str, dry_run: bool, file_root: Path | None, **opts: Any) -> None:
    """Remove recovery-log fragments that no shard's hints still need.

    For every selected shard with a recovery log, its hints (the primary's and every backup)
    name the segments of the log that hold live files; fragments that hold none of them are
    deleted from their stores, with gazctl's own credentials. The open end of each log (from
    the last hinted segment on) is never removed. A log is skipped, saying when to prune
    again, if any shard using it has not written all its hints yet, or has hints that name no
    live files.

    CAUTION: select every shard that uses a log (a forked log is shared): hints of shards
    left out are not consulted. An unpersisted fragment that no hints need stops the prune
    before anything is removed, since it shows a shard was left out.
    """
    from gazctl.cli import run
    from gazctl.fragment_ops import remove_all, stores_of

    doomed, skipped, examined = run(_prune_plan(opts, parse_selector(selector)))
    for log, why in sorted(skipped.items()):
        click.echo(f"skipping {log}: {why}", err=True)
    for fragment in doomed:
        click.echo(
            f"{fragment.journal}\t{fragment.begin}\t{fragment.end}\t{fragment.backing_store}"
        )
    size = sum(f.end - f.begin for f in doomed)
    if dry_run:
        click.echo(
            f"dry run: would remove {len(doomed)} of {examined} fragment(s), {size} bytes",
            err=True,
        )
        return
    if doomed:
        remove_all(doomed, stores_of(doomed, file_root))
    click.echo(f"removed {len(doomed)} of {examined} fragment(s), {size} bytes", err=True)


# ---- recover ----------------------------------------------------------------------------------


async def _recover(opts: dict[str, Any], shard_id: str, directory: str) -> str:
    from broker.client.append_service import AppendService
    from broker.client.routes import Router
    from consumer.recoverylog.hints import pick_first_hints
    from consumer.recoverylog.player import PlaybackError, Player

    async with shards_client(opts) as client:
        listed = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="id", value=shard_id)]))
        )
        if len(listed.shards) != 1:
            raise click.ClickException(f"no shard exists with id {shard_id}")
        spec = listed.shards[0].spec
        log = recovery_log(spec)
        if not log:
            raise click.ClickException(
                f"shard {shard_id} has no recovery log (its spec sets no recovery_log_prefix)"
            )
        hints = pick_first_hints(await client.get_hints(shard_id), log)
    router = Router(opts["broker_address"])
    try:
        async with AppendService(router) as service:
            player = Player()
            player.finish_at_write_head()
            try:
                fsm = await player.play(hints, directory, lambda: router.stub_for(""), service)
            except PlaybackError as exc:
                raise click.ClickException(f"cannot recover shard {shard_id}: {exc}") from None
    finally:
        await router.close()
    return (
        f"recovered shard {shard_id} from {log} into {directory}: {len(fsm.live_nodes)} file(s), "
        f"through seq_no {fsm.next_seq_no - 1}"
    )


@shards.command("recover")
@consumer_options
@click.option("--id", "shard_id", required=True, help="Shard ID")
@click.option(
    "-d", "--dir", "directory", required=True, type=click.Path(file_okay=False),
    help="Directory to write the played recovery log into (emptied first)",
)  # fmt: skip
def recover_cmd(shard_id: str, directory: str, **opts: Any) -> None:
    """Recover the latest checkpoint of a shard by playing its recovery log.

    The log is played from the shard's hints (the primary's, else the first backup's, else from
    its start) up to its write head, into the directory: for inspection, or a backup."""
    from gazctl.cli import run

    click.echo(run(_recover(opts, shard_id, directory)), err=True)
