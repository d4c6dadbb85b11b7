"""`gazctl journals ...`: manage journal specs (apply, list, edit)."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import click
import grpc
from google.protobuf import json_format

from broker.client import ApplyConflict, ApplyTooLarge, JournalsClient, ListSnapshot
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate
from gazctl import render
from gazctl.editor import edit_and_apply
from gazctl.options import (
    broker_options,
    client_of,
    conflict_error,
    max_txn_size_option,
    parse_selector,
    read_specs,
    too_large_error,
)
from spec import journals as jspec


@click.group()
def journals() -> None:
    """Interact with broker journals."""


# ---- apply ----------------------------------------------------------------------------------


def decode_entries(origin: str, text: str) -> list[jspec.JournalEntry]:
    """Decode and validate a YAML journal tree; any problem names the journal or the line."""
    try:
        entries = jspec.flatten(jspec.decode_tree(text))
    except jspec.SpecError as exc:
        raise click.ClickException(f"{origin}: {exc}") from None
    for entry in entries:
        if entry.delete:
            continue
        try:
            validate.validate_journal_spec(entry.spec)
        except validate.ValidationError as exc:
            raise click.ClickException(f"{origin}: journal {entry.spec.name}: {exc}") from None
    return entries


def changes_of(entries: list[jspec.JournalEntry]) -> list[pb.ApplyRequest.Change]:
    changes = []
    for entry in entries:
        if entry.delete:
            changes.append(
                pb.ApplyRequest.Change(expect_mod_revision=entry.revision, delete=entry.spec.name)
            )
        else:
            changes.append(
                pb.ApplyRequest.Change(expect_mod_revision=entry.revision, upsert=entry.spec)
            )
    return changes


def plan(entries: list[jspec.JournalEntry], current: ListSnapshot) -> list[render.PlannedChange]:
    """What applying `entries` would do against the `current` listing, including conflicts."""
    by_name = {j.spec.name: j for j in current.journals}
    out = []
    for entry in entries:
        existing = by_name.get(entry.spec.name)
        conflict = ""
        if entry.revision != -1:
            have = existing.mod_revision if existing else 0
            if have != entry.revision:
                conflict = (
                    f"revision {entry.revision} but the journal is at {have}"
                    if have
                    else f"revision {entry.revision} but the journal does not exist"
                )
        if entry.delete:
            action = "delete" if existing else "delete (absent)"
            diff: list[str] = []
        elif existing is None:
            action, diff = "create", []
        else:
            diff = render.spec_diff(existing.spec, entry.spec)
            action = "update" if diff else "unchanged"
        out.append(render.PlannedChange(entry.spec.name, action, diff, conflict))
    return out


async def dropped_store_warnings(
    client: JournalsClient, entries: list[jspec.JournalEntry], current: ListSnapshot
) -> list[str]:
    """A warning for each journal whose new spec drops a store that holds fragments of it:
    once the store is no longer listed, the brokers' index forgets those fragments, and reads
    cannot reach that content (upstream's index behaves the same)."""
    by_name = {j.spec.name: j.spec for j in current.journals}
    warnings = []
    for entry in entries:
        before = by_name.get(entry.spec.name)
        if entry.delete or before is None:
            continue
        dropped = [s for s in before.fragment.stores if s not in entry.spec.fragment.stores]
        if not dropped:
            continue
        held: list[pb.Fragment] = []
        token = 0
        while True:
            try:
                listed = await client.stub.ListFragments(
                    pb.FragmentsRequest(journal=entry.spec.name, next_page_token=token)
                )
            except grpc.aio.AioRpcError:
                break  # Not served right now: nothing to say about its fragments.
            held += [f.spec for f in listed.fragments if f.spec.backing_store in dropped]
            token = listed.next_page_token
            if not token:
                break
        if not held:
            continue
        ranges = ", ".join(f"[{f.begin}, {f.end})" for f in held[:3])
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        stores = " ".join(dropped)
        warnings.append(
            f"warning: {entry.spec.name}: the change drops {stores}, which holds "
            f"{len(held)} of its fragments ({ranges}{more}): reads will not reach them. To keep "
            f"them readable, list {stores} after the new store(s)"
        )
    return warnings


async def _apply(
    opts: dict[str, Any], entries: list[jspec.JournalEntry], dry_run: bool, max_txn_size: int
) -> list[render.PlannedChange]:
    async with client_of(opts) as client:
        # The plan names what changes (and which journals conflict) for dry runs and summaries.
        current = await client.list()
        planned = plan(entries, current)
        for warning in await dropped_store_warnings(client, entries, current):
            render.note(warning)
        if dry_run:
            return planned
        try:
            await client.apply(changes_of(entries), max_txn_size=max_txn_size)
        except ApplyConflict as exc:
            raise conflict_error("journals", [p.name for p in planned if p.conflict], exc) from None
        except ApplyTooLarge as exc:
            raise too_large_error(exc, fits=128) from None  # One etcd operation per journal.
        return planned


@journals.command("apply")
@broker_options
@click.option(
    "--specs",
    default="-",
    show_default=True,
    help="Input specifications path to apply (- for stdin)",
)
@click.option("--dry-run", is_flag=True, help="Show what would change, and change nothing")
@max_txn_size_option
def apply_cmd(specs: str, dry_run: bool, max_txn_size: int, **opts: Any) -> None:
    """Apply a YAML journal hierarchy (as `journals list -o yaml` prints) to the brokers."""
    origin, text = read_specs(specs)
    entries = decode_entries(origin, text)
    if not entries:
        raise click.ClickException(f"{origin}: no journals to apply")
    from gazctl.cli import run

    planned = run(_apply(opts, entries, dry_run, max_txn_size))
    render.print_plan(planned, dry_run=dry_run)
    if dry_run and any(change.conflict for change in planned):
        sys.exit(1)  # The dry run predicts that the apply would fail.


# ---- list -----------------------------------------------------------------------------------


def output(snapshot: ListSnapshot, fmt: str, opts: dict[str, Any]) -> None:
    if fmt == "yaml":
        entries = [
            jspec.JournalEntry(spec=j.spec, revision=j.mod_revision) for j in snapshot.journals
        ]
        click.echo(jspec.encode_tree(jspec.hoist(entries)) if entries else "", nl=False)
    elif fmt == "json":
        for journal in snapshot.journals:
            doc = json_format.MessageToDict(journal, preserving_proto_field_name=True)
            click.echo(json.dumps(doc, sort_keys=True))
    elif fmt == "proto":
        click.echo(str(snapshot.as_response()), nl=False)
    else:
        render.journals_table(
            snapshot.journals,
            label_columns=list(opts["label_columns"]),
            primary=opts["primary"],
            replicas=opts["replicas"],
            rf=opts["rf"],
            stores=opts["stores"],
        )
        if (note := render.unplaced_note(snapshot.journals, snapshot.placement)) is not None:
            render.note(note)


async def _list(opts: dict[str, Any], selector: pb.LabelSelector, fmt: str, watch: bool) -> None:
    async with client_of(opts) as client:
        if not watch:
            output(await client.list(selector), fmt, opts)
            return
        async for snapshot in client.watch(selector):
            output(snapshot, fmt, opts)
            sys.stdout.flush()


@journals.command("list")
@broker_options
@click.option("-l", "--selector", default="", help="Label selector of journals to list")
@click.option(
    "-o",
    "--format",
    "fmt",
    default="table",
    type=click.Choice(["table", "yaml", "json", "proto"]),
    show_default=True,
    help="Output format",
)
@click.option("-L", "--label-columns", multiple=True, help="Labels to present as columns")
@click.option("-p", "--primary", is_flag=True, help="Show the primary column")
@click.option("-r", "--replicas", is_flag=True, help="Show the replicas column")
@click.option("--rf", is_flag=True, help="Show the replication factor column")
@click.option("--stores", is_flag=True, help="Show the fragment store column")
@click.option("--watch", is_flag=True, help="Keep listing as journals change")
def list_cmd(selector: str, fmt: str, watch: bool, **opts: Any) -> None:
    """List journal specifications and status.

    Selectors support the meta-labels "name" and "prefix", e.g. `-l "prefix=examples/"`.
    Output formats: table, yaml (a hierarchy `journals apply` accepts), json (one journal per
    line), proto (text format).
    """
    from gazctl.cli import run

    sel = parse_selector(selector)
    with contextlib.suppress(KeyboardInterrupt):
        run(_list(opts, sel, fmt, watch))


# ---- edit -----------------------------------------------------------------------------------

EDIT_HEADER = """\
# Editing journals matching the selector: {selector}
# Save and close to apply; an empty file or unchanged content applies nothing.
# Lines starting with '#' are ignored.
"""


async def _edit(
    opts: dict[str, Any], selector_text: str, max_txn_size: int
) -> list[render.PlannedChange]:
    selector = parse_selector(selector_text)
    async with client_of(opts) as client:
        snapshot = await client.list(selector)
    if not snapshot.journals:
        raise click.ClickException(f"no journals match the selector {selector_text!r}")
    entries = [jspec.JournalEntry(spec=j.spec, revision=j.mod_revision) for j in snapshot.journals]
    original = EDIT_HEADER.format(selector=selector_text) + jspec.encode_tree(jspec.hoist(entries))

    async def apply_text(body: str) -> list[render.PlannedChange]:
        edited = decode_entries("edited specs", body)
        return await _apply(opts, edited, dry_run=False, max_txn_size=max_txn_size)

    return await edit_and_apply(original, "journals.yaml", apply_text)


@journals.command("edit")
@broker_options
@click.option("-l", "--selector", required=True, help="Label selector of journals to edit")
@max_txn_size_option
def edit_cmd(selector: str, max_txn_size: int, **opts: Any) -> None:
    """Edit journal specifications in $GAZ_EDITOR (or $EDITOR) and apply the result.

    If the edit does not decode or apply, the editor re-opens with the error shown at the top.
    """
    from gazctl.cli import run

    planned = run(_edit(opts, selector, max_txn_size))
    if planned:
        render.print_plan(planned, dry_run=False)
