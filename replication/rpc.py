"""The Location service's client, and conversions between its messages (replication/location.proto)
and the replication model's values.

Methods: `Status`, `Emit`, `Read` (a replication batch, filtered at the source by the target's
CVV and the connection's filter), `Change` (check, and record, a topology change), `Delete`,
`ResetProgress`, `Recover`, `Join` and `TrustClock`. A rule the request would break is
FAILED_PRECONDITION, a bad argument INVALID_ARGUMENT, an unknown location NOT_FOUND; each with
one line that says why."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from broker.client.journals import dial
from replication import location_pb2 as lpb
from replication import location_pb2_grpc as lpb_grpc
from replication.model import Stored
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    OpKey,
    Retired,
    Topology,
)
from replication.vclock import VectorClock

__all__ = [
    "SERVICE",
    "LocationClient",
    "LocationError",
    "change_message",
    "change_of_message",
    "clock_message",
    "clock_of",
    "key_message",
    "key_of_message",
    "named_locations",
    "status_document",
    "topology_of_status",
]

SERVICE = "gazette_py.replication.Location"

Document = dict[str, Any]


# ---- conversions ----------------------------------------------------------------------------------


def clock_message(clock: Mapping[str, int]) -> lpb.Clock:
    return lpb.Clock(times={k: v for k, v in clock.items() if v})


def clock_of(message: lpb.Clock, what: str = "clock") -> VectorClock:
    return VectorClock.from_json(dict(message.times), field=what)


def change_message(change: Change) -> lpb.Change:
    if isinstance(change, Retired):
        return lpb.Change(retired=change.location)
    if isinstance(change, FailedOver):
        return lpb.Change(
            failed_over=lpb.Change.FailOver(
                previous=change.previous, source=change.source, target=change.target,
                filter=change.filter,
            )
        )  # fmt: skip
    if isinstance(change, Connected):
        return lpb.Change(connected=_connection(change.source, change.target, change.filter))
    if isinstance(change, Filtered):
        return lpb.Change(filtered=_connection(change.source, change.target, change.filter))
    return lpb.Change(disconnected=_connection(change.source, change.target))


def _connection(source: str, target: str, filter: str = "") -> lpb.Change.Connection:
    return lpb.Change.Connection(source=source, target=target, filter=filter)


def change_of_message(message: lpb.Change, what: str = "change") -> Change:
    """The change a message carries (ValueError naming `what` if it carries none, or names no
    location where it must)."""
    kind = message.WhichOneof("change")
    if kind == "retired":
        if not message.retired:
            raise ValueError(f"{what}: a retirement names no location")
        return Retired(message.retired)
    if kind == "failed_over":
        f = message.failed_over
        _named(what, f.previous, f.source, f.target)
        return FailedOver(f.previous, f.source, f.target, f.filter)
    if kind is None:
        raise ValueError(f"{what}: no change given")
    c = getattr(message, kind)
    _named(what, c.source, c.target)
    if kind == "connected":
        return Connected(c.source, c.target, c.filter)
    if kind == "filtered":
        return Filtered(c.source, c.target, c.filter)
    return Disconnected(c.source, c.target)


def _named(what: str, *names: str) -> None:
    if not all(names):
        raise ValueError(f"{what}: a connection names its source and target locations")


# The string fields of the service's requests that are not locations' names: a replication
# filter's text (an event selector over the log it filters).
NOT_NAMES = frozenset({"filter"})


def named_locations(request: Message) -> list[str]:
    """Every location a Location request names, each once, in order: every string field and
    string map key set, at any depth, except a filter's text (NOT_NAMES). Found from the
    message's own fields, not a list of them, so that a field added to the proto is a name
    unless declared otherwise: authorization fails closed on it."""
    out: dict[str, None] = {}
    _collect_names(request, out)
    return list(out)


def _collect_names(message: Message, out: dict[str, None]) -> None:
    for f, value in message.ListFields():
        if f.name in NOT_NAMES:
            continue
        entry = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:
            if entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING:
                out.update(dict.fromkeys(k for k in value if k))
            if entry.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for item in value.values():
                    _collect_names(item, out)
        elif entry is not None:
            for item in value if f.is_repeated else [value]:
                _collect_names(item, out)
        elif f.type == FieldDescriptor.TYPE_STRING:
            out.update(dict.fromkeys(v for v in (value if f.is_repeated else [value]) if v))


def key_message(key: OpKey) -> lpb.ChangeKey:
    revision, total, emitter, time = key
    return lpb.ChangeKey(revision=revision, sum=total, emitter=emitter, time=time)


def key_of_message(message: lpb.ChangeKey) -> OpKey:
    return (message.revision, message.sum, message.emitter, message.time)


def topology_of_status(status: lpb.StatusResponse) -> Topology:
    """A location's view of the topology, as its Status reports it."""
    return Topology.of(
        (key_of_message(k.key), change_of_message(k.change, f"{status.location}'s history"))
        for k in status.history
    )


def status_document(status: lpb.StatusResponse) -> Document:
    """A Status as JSON (`gazctl replication status --format json`): vectors as objects, the
    history's changes as a system event stores them, each with its key."""
    from replication.system import keyed_document

    def clock(c: lpb.Clock) -> dict[str, int]:
        return dict(sorted(c.times.items()))

    view = topology_of_status(status)
    return {
        "location": status.location, "journal": status.journal, "endpoint": status.endpoint,
        "cvv": clock(status.cvv), "dvv": clock(status.dvv), "last_seq": status.last_seq,
        "deleted_through": status.deleted_through, "local_time": status.local_time,
        "progress": dict(sorted(status.progress.items())),
        "cached_cvv": {s: clock(c) for s, c in sorted(status.cached_cvv.items())},
        "connections": [
            {
                "source": c.source, "filter": c.filter, "state": c.state, "via": c.via,
                "progress": c.progress, "source_last_seq": c.source_last_seq, "lag": c.lag,
                "read": c.read, "written": c.written, "error": c.error,
            }
            for c in status.connections
        ],
        "history": [keyed_document(k, c) for k, c in view.keyed()],
        "retired": list(status.retired), "lost": status.lost,
        "prunable_before": status.prunable_before,
        "clock": "ok" if status.clock_ok else f"not heard from {', '.join(status.unheard)}",
        "journal_created": status.journal_created, "recovering": status.recovering,
    }  # fmt: skip


# ---- the client -----------------------------------------------------------------------------------


class LocationError(RuntimeError):
    """A Location service call that failed: its status code and one line."""

    def __init__(self, location: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(location, code, detail)
        self.location, self.code, self.detail = location, code, detail

    def __str__(self) -> str:
        # CANCELLED from the peer: its process stopped while it answered (a host that lost
        # its lease stops its locations).
        unreachable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)  # fmt: skip
        if self.code in unreachable:
            return f"location {self.location} is unreachable ({self.code.name}): {self.detail}"
        return self.detail


class LocationClient:
    """Calls to one location's process, each a method of the Location service; a refusal or an
    unreachable process is a LocationError."""

    def __init__(self, location: str, endpoint: str, *, timeout: float = 30.0) -> None:
        self.location, self.endpoint, self.timeout = location, endpoint, timeout
        self.channel = dial(endpoint)
        self.stub = lpb_grpc.LocationStub(self.channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> LocationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def invoke(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """The reply of `method` (a name of the service) to `request` (its request message)."""
        try:
            return await getattr(self.stub, method)(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            task = asyncio.current_task()
            if exc.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
                raise asyncio.CancelledError() from None  # Ours, not the peer's: a cancellation.
            detail = (exc.details() or "").split("\n")[0]
            raise LocationError(self.location, exc.code(), detail) from None

    async def status(self, timeout: float | None = None) -> lpb.StatusResponse:
        reply: lpb.StatusResponse = await self.invoke("Status", lpb.StatusRequest(), timeout)
        return reply

    async def emit(self, *payloads: Mapping[str, Any]) -> list[tuple[str, int]]:
        """Emit events at the location (each payload a JSON object); their ids, (emitter,
        time)."""
        request = lpb.EmitRequest(payloads=[json.dumps(dict(p)).encode() for p in payloads])
        reply: lpb.EmitResponse = await self.invoke("Emit", request)
        return [(e.emitter, e.time) for e in reply.events]

    async def read(
        self,
        after: int = 0,
        limit: int = 1000,
        *,
        cvv: Mapping[str, int] | None = None,
        filter: str = "",
        or_emitter: str = "",
        wait: float = 0.0,
    ) -> lpb.ReadResponse:
        """A replication batch: the events after `after` that `cvv` does not cover and `filter`
        admits (or `or_emitter` emitted), waiting up to `wait` seconds for some."""
        request = lpb.ReadRequest(
            after=after, limit=limit, cvv=clock_message(cvv or {}), filter=filter,
            or_emitter=or_emitter, wait=wait,
        )  # fmt: skip
        reply: lpb.ReadResponse = await self.invoke("Read", request)
        return reply

    async def events(self, after: int = 0, limit: int = 1000, wait: float = 0.0) -> list[Stored]:
        """The location's stored events after sequence number `after`, in storage order
        (read-committed; deleted ones left out), waiting up to `wait` seconds for some."""
        from replication.records import split_records

        reply = await self.read(after, limit, wait=wait)
        return [raw.stored() for _, _, raw in split_records(reply.records)[0] if raw is not None]

    async def change(self, change: Change, *, record: bool = False, op: int = 0) -> bool:
        """Without `record`: the location's live checks of `change` (changing nothing). With
        `record` and `op`: the location records what etcd's topology history holds (through
        `op`) and its log lacks; with `record` and no `op`: the whole command at the location
        (checked on etcd's history, recorded there, then in its log). Whether it recorded."""
        request = lpb.ChangeRequest(change=change_message(change), record=record, op=op)
        reply: lpb.ChangeResponse = await self.invoke("Change", request)
        return reply.recorded

    async def delete(self, through: int) -> lpb.DeleteResponse:
        reply: lpb.DeleteResponse = await self.invoke("Delete", lpb.DeleteRequest(through=through))
        return reply

    async def reset_progress(self, source: str, seq: int) -> int:
        request = lpb.ResetProgressRequest(source=source, seq=seq)
        reply: lpb.ResetProgressResponse = await self.invoke("ResetProgress", request)
        return reply.progress

    async def recover(self) -> lpb.RecoverResponse:
        reply: lpb.RecoverResponse = await self.invoke("Recover", lpb.RecoverRequest())
        return reply

    async def join(self, sources: Sequence[str]) -> lpb.JoinResponse:
        reply: lpb.JoinResponse = await self.invoke("Join", lpb.JoinRequest(sources=sources))
        return reply

    async def trust_clock(self, without: Iterable[str]) -> lpb.TrustClockResponse:
        request = lpb.TrustClockRequest(without=list(without))
        reply: lpb.TrustClockResponse = await self.invoke("TrustClock", request)
        return reply
