"""Topology changes as system events (the seed's "Global topology view").

A connection change, a filter change or a retirement is emitted as an event at the location that
makes it (payload `{"system": {...}}`), and replicated like any other event; replication filters
never drop system events. Every location folds the system events of its own log, in storage
order, into the topology view. A change made by an operator command carries the command's
order (`op`, an etcd revision): one command recorded at both ends of a connection is one change,
and the view folds changes in that order, not in the order they arrived, so all locations build
the same view of the network's history, eventually, whatever order replication brought the
events in (see `replication.topology`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from replication.model import Event, EventFilter
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    OpKey,
    Retired,
    Topology,
    command_key,
)
from replication.vclock import VectorClock

__all__ = [
    "change_document",
    "change_from",
    "change_of",
    "is_system",
    "join_floor",
    "key_from",
    "keyed_change_of",
    "keyed_changes",
    "keyed_document",
    "passes",
    "system_payload",
    "topology_of",
    "topology_of_documents",
]


def system_payload(change: Change, op: int | None = None) -> dict[str, Any]:
    """The payload of the system event recording `change`, made by the operator command etcd
    ordered at revision `op` (None: a change without one, ordered by its event's timestamp)."""
    return {"system": change_document(change, op)}


def change_document(change: Change, op: int | None = None) -> dict[str, Any]:
    """A change as JSON (in a system event, a checkpoint, the Location service)."""
    body: dict[str, Any]
    if isinstance(change, Retired):
        body = {"type": "retired", "location": change.location}
    elif isinstance(change, FailedOver):
        body = {"type": "failed-over", "previous": change.previous, "source": change.source,
                "target": change.target, "filter": change.filter}  # fmt: skip
    else:
        body = {"source": change.source, "target": change.target}
        if isinstance(change, Connected):
            body |= {"type": "connected", "filter": change.filter}
        elif isinstance(change, Disconnected):
            body |= {"type": "disconnected"}
        else:
            body |= {"type": "filtered", "filter": change.filter}
    if isinstance(change, Connected | FailedOver) and change.new_only:
        body |= {"new_events_only": True, "floor": dict(change.floor)}
    if op is not None:
        body["op"] = op
    return body


def _join_of(body: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The `--new-events-only` fields of a connection change's JSON (none in a change recorded
    before they existed: that one is not new-events-only)."""
    if not body.get("new_events_only"):
        return {}
    floor = VectorClock.from_json(body.get("floor") or {}, field=f"{what}: floor")
    return {"new_only": True, "floor": tuple(sorted(floor.to_json().items()))}


def join_floor(change: Change, location: str) -> VectorClock | None:
    """What `location` raises its CVV and DVV to as it records `change` (None: it does not
    join for it)."""
    if isinstance(change, Connected | FailedOver) and change.new_only and change.target == location:
        return VectorClock(dict(change.floor))
    return None


def keyed_document(key: OpKey, change: Change) -> dict[str, Any]:
    """A change and its key as JSON (a checkpoint's history, the Location service's)."""
    return change_document(change) | {"key": list(key)}


def key_from(body: Any, what: str = "change") -> OpKey | None:
    """The key a change's JSON carries (`key`, or a command's `op`), or None."""
    if not isinstance(body, Mapping):
        return None
    try:
        if "key" in body:
            rev, total, emitter, time = body["key"]
            return (int(rev), int(total), str(emitter), int(time))
        if "op" in body:
            op = body["op"]
            if isinstance(op, bool) or not isinstance(op, int) or op < 1:
                raise ValueError(op)
            return command_key(op)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: not a change's order ({exc})") from None
    return None


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
            return Connected(source, target, str(body.get("filter", "")), **_join_of(body, what))
        if kind == "disconnected":
            return Disconnected(source, target)
        if kind == "filtered":
            return Filtered(source, target, str(body.get("filter", "")))
        if kind == "failed-over":
            return FailedOver(
                str(body["previous"]), source, target, str(body.get("filter", "")),
                **_join_of(body, what),
            )  # fmt: skip
        raise KeyError(kind)
    except (AssertionError, KeyError) as exc:
        raise ValueError(f"{what}: not a topology change ({exc})") from None


def keyed_change_of(event: Event) -> tuple[OpKey, Change]:
    """The change a system event records, and its place in the history: its command's order, or
    (for a change made without one) its timestamp's sum, emitter and time."""
    change = change_of(event)
    key = key_from(event.payload.get("system"), f"system event {event.id}")
    if key is None:
        ts = event.timestamp.to_json()
        key = (0, sum(ts.values()), event.emitter, ts.get(event.emitter, 0))
    return key, change


def keyed_changes(history: Iterable[Any], what: str = "history") -> list[tuple[OpKey, Change]]:
    """A history as JSON (a checkpoint's, a location's Status) as keyed changes; one written
    before changes had keys holds them in the order folded, and keeps that order."""
    return [
        (key_from(body, what) or (0, -1, "", i), change_from(body, what))
        for i, body in enumerate(history)
    ]


def topology_of_documents(history: Iterable[Any]) -> Topology:
    """The view of a history as JSON (a location's Status)."""
    return Topology.of(keyed_changes(history))


def topology_of(events: Iterable[Event]) -> Topology:
    """The view of the system events among `events` (in any order: the view is the same)."""
    return Topology.of(keyed_change_of(e) for e in events if is_system(e))


def passes(replication_filter: EventFilter | None) -> EventFilter | None:
    """A connection's filter that lets every system event through."""
    if replication_filter is None:
        return None
    keep = replication_filter
    return lambda event: is_system(event) or keep(event)
