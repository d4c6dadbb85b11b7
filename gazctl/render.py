"""Rendering of gazctl output with rich: journal tables and apply plans."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb

# Piped output is for machines and `grep`: never truncate it to a guessed terminal width.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)
err_console = Console(stderr=True, highlight=False)


def note(message: str) -> None:
    """One line of progress on stderr, as it is (no markup, no wrapping)."""
    err_console.print(message, markup=False, soft_wrap=True)


def lacks_replicas(journal: pb.ListResponse.Journal) -> bool:
    """Served by no broker though not suspended: its replicas are not placed."""
    return not journal.route.members and (journal.spec.suspend.level != pb.JournalSpec.Suspend.FULL)


def unplaced_note(journals: Sequence[pb.ListResponse.Journal], why: str) -> str | None:
    """One line for journals that have no replicas, saying why where the broker said."""
    count = sum(lacks_replicas(j) for j in journals)
    if not count:
        return None
    said = f"{count} journal has" if count == 1 else f"{count} journals have"
    return f"{said} no replicas: " + (
        why or "no broker has taken them yet (the brokers' logs say why, if it lasts)"
    )


def journals_table(
    journals: Sequence[pb.ListResponse.Journal],
    *,
    label_columns: Sequence[str] = (),
    primary: bool = False,
    replicas: bool = False,
    rf: bool = False,
    stores: bool = False,
) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("Name")
    unplaced = {j.spec.name for j in journals if lacks_replicas(j)}
    if unplaced:  # Only then: the usual listing keeps upstream's columns.
        table.add_column("Status")
    if rf:
        table.add_column("RF", justify="right")
    if primary:
        table.add_column("Primary")
    if replicas:
        table.add_column("Replicas")
    if stores:
        table.add_column("Stores")
    for name in label_columns:
        table.add_column(name)
    for journal in journals:
        route = journal.route
        primary_name = "<none>"
        replica_names = []
        for index, member in enumerate(route.members):
            if index == route.primary:
                primary_name = member.suffix
            else:
                replica_names.append(member.suffix)
        if journal.spec.suspend.level != pb.JournalSpec.Suspend.NONE:
            primary_name += " <S>"
        row = [journal.spec.name]
        if unplaced:
            row.append("no replicas" if journal.spec.name in unplaced else "")
        if rf:
            row.append(str(journal.spec.replication))
        if primary:
            row.append(primary_name)
        if replicas:
            row.append(",".join(replica_names))
        if stores:
            row.append(
                journal.spec.fragment.stores[0] if journal.spec.fragment.stores else "<none>"
            )
        for name in label_columns:
            values = labels.values_of(journal.spec.labels, name)
            row.append(",".join(values) if values else "<none>")
        table.add_row(*row)
    console.print(table)


@dataclass(frozen=True)
class PlannedChange:
    name: str
    action: str  # create | update | unchanged | delete | delete (absent)
    diff: list[str] = field(default_factory=list)
    conflict: str = ""


def spec_diff(before: Message, after: Message) -> list[str]:
    """Human-readable `field: old -> new` lines between two specs."""
    a = _flat(json_format.MessageToDict(before, preserving_proto_field_name=True))
    b = _flat(json_format.MessageToDict(after, preserving_proto_field_name=True))
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key, '<unset>')} -> {b.get(key, '<unset>')}")
    return out


def _flat(doc: object, prefix: str = "") -> dict[str, str]:
    if isinstance(doc, dict):
        out: dict[str, str] = {}
        for key, value in doc.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: str(doc)}


STYLES = {"create": "green", "update": "yellow", "delete": "red", "unchanged": "dim"}


def print_plan(planned: Sequence[PlannedChange], *, dry_run: bool) -> None:
    counts: dict[str, int] = {}
    for change in planned:
        counts[change.action] = counts.get(change.action, 0) + 1
        if change.action == "unchanged" and not dry_run and not change.conflict:
            continue
        style = STYLES.get(change.action.split()[0], "")
        line = f"[{style}]{change.action:<9}[/{style}] {change.name}"
        if change.conflict:
            line += f"  [bold red]conflict: {change.conflict}[/bold red]"
        console.print(line)
        for d in change.diff:
            console.print(f"            {d}", markup=False)
    summary = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
    conflicts = sum(1 for change in planned if change.conflict)
    if dry_run and conflicts:
        err_console.print(
            f"dry run, nothing applied: {summary}; applying would fail on "
            f"{conflicts} revision conflict(s)"
        )
    elif dry_run:
        err_console.print(f"dry run, nothing applied: {summary}")
    else:
        err_console.print(f"applied: {summary}")
