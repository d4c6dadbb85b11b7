"""Topology changes as system events (the seed's "Global topology view").

A connection change, a filter change or a retirement is emitted as an event at the location that
makes it (payload `{"system": {...}}`), and replicated like any other event; replication filters
never drop system events. Every location folds the system events of its own log, in storage
order, into the topology view, so all locations build the same view of the network's history,
eventually (storage order is a linear extension of causality, so a change is never seen before
what it depends on)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from replication.location import Event, EventFilter
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    Retired,
    Topology,
)

__all__ = [
    "change_document",
    "change_from",
    "change_of",
    "is_system",
    "passes",
    "system_payload",
    "topology_of",
]


def system_payload(change: Change) -> dict[str, Any]:
    """The payload of the system event recording `change`."""
    return {"system": change_document(change)}


def change_document(change: Change) -> dict[str, Any]:
    """A change as JSON (in a system event, a checkpoint, the Location service)."""
    if isinstance(change, Retired):
        return {"type": "retired", "location": change.location}
    if isinstance(change, FailedOver):
        return {"type": "failed-over", "previous": change.previous, "source": change.source,
                "target": change.target, "filter": change.filter}  # fmt: skip
    body: dict[str, Any] = {"source": change.source, "target": change.target}
    if isinstance(change, Connected):
        body |= {"type": "connected", "filter": change.filter}
    elif isinstance(change, Disconnected):
        body |= {"type": "disconnected"}
    else:
        body |= {"type": "filtered", "filter": change.filter}
    return body


def is_system(event: Event) -> bool:
    return isinstance(event.payload.get("system"), Mapping)


def change_of(event: Event) -> Change:
    """The change a system event records (ValueError, naming the event, if malformed)."""
    return change_from(event.payload.get("system"), f"system event {event.id}")


def change_from(body: Any, what: str = "change") -> Change:
    """A change from its JSON (ValueError naming `what`, if it is not one)."""
    try:
        assert isinstance(body, Mapping)
        kind = body["type"]
        if kind == "retired":
            return Retired(str(body["location"]))
        source, target = str(body["source"]), str(body["target"])
        if kind == "connected":
            return Connected(source, target, str(body.get("filter", "")))
        if kind == "disconnected":
            return Disconnected(source, target)
        if kind == "filtered":
            return Filtered(source, target, str(body.get("filter", "")))
        if kind == "failed-over":
            return FailedOver(str(body["previous"]), source, target, str(body.get("filter", "")))
        raise KeyError(kind)
    except (AssertionError, KeyError) as exc:
        raise ValueError(f"{what}: not a topology change ({exc})") from None


def topology_of(events: Iterable[Event]) -> Topology:
    """The view of the system events among `events`, in their order."""
    return Topology.of(change_of(e) for e in events if is_system(e))


def passes(replication_filter: EventFilter | None) -> EventFilter | None:
    """A connection's filter that lets every system event through."""
    if replication_filter is None:
        return None
    keep = replication_filter
    return lambda event: is_system(event) or keep(event)
