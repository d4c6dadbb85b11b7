"""The journal of a location's local event log: its spec, and applying it."""

from __future__ import annotations

from typing import Any

from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb

__all__ = [
    "apply_location_journals",
    "journal_created",
    "journal_listed",
    "location_journal",
    "location_journal_spec",
]


def location_journal(location: str) -> str:
    return f"replication/{location}"


def location_journal_spec(
    location: str,
    store: str = "",
    replication: int = 1,
    fragment_length: int = 64 << 20,
    refresh_seconds: int = 60,
    name: str = "",
) -> pb.JournalSpec:
    """JSON lines (one record each), uncompressed, in fragments of up to 64 MiB persisted to
    `store` (none: the brokers' spools only), its store listed every minute. Its name is
    `name`, or replication/LOCATION."""
    spec = pb.JournalSpec(name=name or location_journal(location), replication=replication)
    spec.fragment.length = fragment_length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = refresh_seconds
    if store:
        spec.fragment.stores.append(store)
    spec.labels.labels.add(name="content-type", value="application/x-ndjson")
    return spec


async def apply_location_journals(
    broker: str, *locations: str, store: str = "", **spec: Any
) -> None:
    """Create the journals of these locations' logs at `broker`'s cluster, those that do not
    exist yet (an existing one is left as it is: its brokers may be changing it)."""
    async with JournalsClient(broker) as client:
        existing = {j.spec.name for j in (await client.list()).journals}
        missing = [n for n in locations if location_journal(n) not in existing]
        if missing:
            await client.apply(
                [
                    pb.ApplyRequest.Change(upsert=location_journal_spec(n, store, **spec))
                    for n in missing
                ]
            )


async def journal_listed(client: JournalsClient, journal: str) -> pb.ListResponse.Journal | None:
    """`journal` as the brokers list it (its spec, create revision...), or None."""
    selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))  # fmt: skip
    listed = await client.list(selector)
    for j in listed.journals:
        if j.spec.name == journal:
            return j
    return None


async def journal_created(client: JournalsClient, journal: str) -> int:
    """The etcd revision that created `journal` (0: it does not exist): a journal deleted and
    made anew (a lost log) has another."""
    found = await journal_listed(client, journal)
    return int(found.create_revision) if found is not None else 0
