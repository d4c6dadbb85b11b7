"""`gazctl journals ...`: manage journal specs (apply, list, edit)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import grpc
from google.protobuf import json_format

from broker.client import ApplyConflict, ApplyTooLarge, JournalsClient, ListSnapshot
from broker.protocol import labels, validate
from broker.protocol import protocol_pb2 as pb
from gazctl import render
from plumbing import config as cfg
from spec import journals as jspec

F = TypeVar("F", bound=Callable[..., Any])


def broker_options(f: F) -> F:
    """The Broker option group of upstream gazctl's `journals` commands."""
    for decorator in reversed(
        [
            cfg.option("--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"),
            cfg.option("--broker.cache.size", default=0, type=int, help="Size of client route cache (0 disables it: the broker proxies)"),
            cfg.option("--broker.cache.ttl", default="1m", help="Time-to-live of route cache entries"),
            cfg.option("--zone", env="ZONE", default="local", help="Availability zone within which this process is running"),
            cfg.option("--log.level", default="warn", type=click.Choice(["trace", "debug", "info", "warn", "error", "fatal"]), help="Logging level"),
            cfg.option("--log.format", default="text", type=click.Choice(["json", "text", "color"]), help="Logging output format"),
        ]
    ):  # fmt: skip
        f = decorator(f)
    return cfg.client_credentials("broker")(cfg.logging_from_options(f))


def file_root_option(help_: str) -> Callable[[F], F]:
    """--file-root: the directory that roots file:// fragment stores, as brokers' own
    --broker.file-root, and read from the same environment variable ($BROKER_FILE_ROOT, which
    `gazctl dev up` prints)."""
    return click.option(
        "--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
        envvar="BROKER_FILE_ROOT", show_envvar=True, help=help_,
    )  # fmt: skip


def _wait_seconds(_ctx: click.Context, _param: click.Parameter, value: str) -> float:
    from spec.durations import DurationError, parse_go_duration

    try:
        seconds = parse_go_duration(str(value)) / 1e9
    except DurationError as exc:
        raise click.BadParameter(f"{exc} (a duration such as 30s or 2m)") from None
    if seconds < 0:
        raise click.BadParameter(f"{value} is negative: give a duration such as 30s, or 0s")
    return seconds


wait_option = click.option(
    "--wait",
    default="30s",
    show_default=True,
    callback=_wait_seconds,
    help="How long to wait through a journal that has no primary or too few brokers yet (just "
    "created or moving) or an unreachable broker, before giving up (0s: do not wait)",
)


max_txn_size_option = click.option(
    "--max-txn-size",
    default=0,
    type=int,
    show_default=True,
    help=(
        "Maximum changes per etcd transaction (0: all in one, all-or-nothing; etcd takes 128 "
        "by default)"
    ),
)


def some_names(names: list[str], shown: int = 3) -> str:
    """The first few of `names` and how many more: a refusal naming thousands stays short."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def conflict_error(kind: str, names: list[str], exc: ApplyConflict) -> click.ClickException:
    """The one line of an apply whose transaction failed on a revision (`kind`: journals or
    shards): how many conflict, the first few by name, and what to do."""
    detail = f" ({len(names)} {kind}: {some_names(names)})" if len(names) > 1 else ""
    detail = f": {names[0]}" if len(names) == 1 else detail
    return click.ClickException(
        f"revision conflict{detail} changed since the specs were read; nothing in the "
        f"failed transaction was applied (batch {exc.batch + 1}). List the {kind} "
        f"again (`gazctl {kind} list -o yaml`) and re-apply, or use revision: -1"
    )


def too_large_error(exc: ApplyTooLarge, fits: int) -> click.ClickException:
    """The one line of an apply that etcd refused as too large (ApplyTooLarge): what was
    applied, and the flag that applies it in batches (`fits`: a batch size that fits)."""
    if exc.batch == 0:
        where = f"{exc}."
    else:
        where = f"batch {exc.batch + 1}: {exc}; the {exc.batch} batch(es) before it were applied."
    return click.ClickException(
        f"{where} Apply in batches with --max-txn-size {fits} (or fewer; each batch is then "
        "all-or-nothing, not the whole apply: a failed batch stops the run and the batches "
        "before it stay applied), or raise etcd's --max-txn-ops"
    )


@click.group()
def journals() -> None:
    """Interact with broker journals."""


def parse_selector(text: str) -> pb.LabelSelector:
    return labels.parse_selector(text) if text else pb.LabelSelector()


def client_of(opts: dict[str, Any]) -> JournalsClient:
    try:
        return JournalsClient(opts["broker_address"])
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


# ---- apply ----------------------------------------------------------------------------------


def read_specs(path: str) -> tuple[str, str]:
    if path == "-":
        return "stdin", sys.stdin.read()
    try:
        return path, Path(path).read_text()
    except OSError as exc:
        raise click.ClickException(f"--specs {path}: {exc.strerror or exc}") from None


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


def editor_command() -> list[str]:
    editor = os.environ.get("GAZ_EDITOR") or os.environ.get("EDITOR") or "vi"
    return shlex.split(editor)


def run_editor(path: Path) -> None:
    cmd = [*editor_command(), str(path)]
    try:
        result = subprocess.run(cmd, check=False)
    except FileNotFoundError:
        raise click.ClickException(
            f"editor {cmd[0]!r} not found: set $GAZ_EDITOR or $EDITOR"
        ) from None
    if result.returncode != 0:
        raise click.ClickException(
            f"editor {cmd[0]!r} exited with status {result.returncode}; nothing applied"
        )


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


async def edit_and_apply(
    original: str,
    filename: str,
    apply_text: Callable[[str], Awaitable[list[render.PlannedChange]]],
) -> list[render.PlannedChange]:
    """Open `original` in the editor and apply what comes back; when that fails, re-open the
    editor with the error at the top, keeping the user's edits. Unchanged or empty: nothing."""
    with tempfile.TemporaryDirectory(prefix="gazctl-edit-") as tmp:
        path = Path(tmp) / filename
        path.write_text(original)
        while True:
            run_editor(path)
            body = strip_error_comments(path.read_text())
            if not body.strip() or body == strip_error_comments(original):
                click.echo("no changes to apply", err=True)
                return []
            try:
                return await apply_text(body)
            except click.ClickException as exc:
                path.write_text(f"{ERROR_MARK} {exc.message}\n{body}")
                click.echo(f"error: {exc.message} (re-opening the editor)", err=True)


ERROR_MARK = "# ERROR:"


def strip_error_comments(text: str) -> str:
    return "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith(ERROR_MARK)
    )


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
