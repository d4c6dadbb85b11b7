"""Operations on journals' fragments that several gazctl commands share: listing a journal's
fragments through ListFragments, choosing those past retention, and removing fragments straight
from their stores with gazctl's own credentials (`journals prune`, `shards prune`,
`replication delete`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
from google.protobuf import duration_pb2
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from broker.fragment.content import fragment_path
from broker.fragment.stores import FragmentStore, StoreError, open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from gazctl.render import err_console

RPC_TIMEOUT = 60.0  # Seconds for one RPC gazctl makes.

Listed = pb.FragmentsResponse._Fragment


async def list_fragments(
    stub: pb_grpc.JournalStub,
    journal: str,
    *,
    begin_mod_time: int = 0,
    end_mod_time: int = 0,
    signature_ttl: duration_pb2.Duration | None = None,
) -> list[Listed]:
    """Every fragment the journal's index lists (local and persisted, in offset order) within
    the mod-time range, following next_page_token across pages."""
    out: list[Listed] = []
    token = 0
    while True:
        request = pb.FragmentsRequest(
            journal=journal,
            begin_mod_time=begin_mod_time,
            end_mod_time=end_mod_time,
            next_page_token=token,
        )
        if signature_ttl is not None:
            request.signatureTTL.CopyFrom(signature_ttl)
        response: pb.FragmentsResponse = await stub.ListFragments(request, timeout=RPC_TIMEOUT)
        if response.status != pb.OK:
            raise click.ClickException(
                f"listing fragments of {journal}: {pb.Status.Name(response.status)}"
            )
        out.extend(response.fragments)
        if not response.next_page_token:
            return out
        if response.next_page_token <= token:
            raise click.ClickException(
                f"listing fragments of {journal}: the broker returned page token "
                f"{response.next_page_token} after {token} (no progress)"
            )
        token = response.next_page_token


def aged_fragments(
    listed: Sequence[pb.Fragment], retention: float, now: float
) -> list[pb.Fragment]:
    """Persisted fragments at least `retention` seconds old, except the last persisted one
    (highest end), which stays whatever its age: it records the journal's write head for
    brokers that recover from the stores. Local fragments are never included."""
    persisted = [f for f in listed if f.backing_store and f.mod_time]
    if not persisted:
        return []
    last = max(persisted, key=lambda f: (f.end, f.begin))
    return [f for f in persisted if f is not last and now - f.mod_time >= retention]


def stores_of(doomed: Sequence[pb.Fragment], file_root: Path | None) -> dict[str, FragmentStore]:
    """Open every store holding a doomed fragment before anything is removed."""
    stores: dict[str, FragmentStore] = {}
    for url in sorted({f.backing_store for f in doomed}):
        if url.startswith("file:") and file_root is None:
            raise click.ClickException(
                f"fragments to prune are in {url}: give --file-root, the directory that "
                "brokers' --broker.file-root names, to delete them"
            )
        try:
            stores[url] = open_store(url, file_root=file_root)
        except (StoreError, ValueError) as exc:
            raise click.ClickException(f"cannot open fragment store {url}: {exc}") from None
    return stores


def remove_all(doomed: Sequence[pb.Fragment], stores: dict[str, FragmentStore]) -> None:
    columns = (
        TextColumn("pruning"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
    )
    # On terminals only: piped, a progress bar is noise in the logs.
    progress = Progress(
        *columns, console=err_console, transient=True, disable=not err_console.is_terminal
    )
    with progress:
        task = progress.add_task("", total=len(doomed))
        for done, fragment in enumerate(doomed):
            progress.update(task, description=fragment.journal)
            try:
                stores[fragment.backing_store].remove(fragment_path(fragment))
            except StoreError as exc:
                raise click.ClickException(
                    f"{exc} ({done} of {len(doomed)} fragments were removed before it)"
                ) from None
            progress.advance(task)
