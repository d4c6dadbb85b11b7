"""A location's local event log on a journal, with one fenced writer.

The journal holds JSON lines of four kinds, all appended by the location's writer:

* `{"kind": "writer", "author": N}`: a writer took the log (appended with `union_registers`
  `writer=N`; every later append of that writer checks the register, so a writer that another
  replaced fails its next append and writes nothing more: sequence numbers and the vector clock
  are assigned in one place);
* `{"kind": "event", "seq": S, "emitter": E, "ts": {...}, "payload": {...}}`: a stored event, in
  storage order (a linear extension of causality);
* `{"kind": "progress", "source": A, "seq": S, "cvv": {...}}`: replication from A read through
  S, appended in the same append as the events that batch stored, so a retry after a crash
  finds either both or neither (and the causality filter drops what it finds again); with
  `"reset": true`, A lost events in a disaster and its progress is set back to S;
* `{"kind": "local-time", "time": T}`: the local clock set ahead (metadata recovery);
* `{"kind": "deleted", "through": S, "dvv": {...}}`: events through S are deleted (readers skip
  them; their fragments may then be pruned), and the DVV that leaves, recorded.

Opening the log takes it (a writer record) and reads it through that record to rebuild the CVV,
the next sequence number, the local time and the progress of every source. `read(after_seq)`
returns stored events from the journal (an index of each event's offset is kept as it is read).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from broker.client.append_service import AppendService, Registers
from broker.client.reader import read_retrying
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from replication.location import (
    Event,
    EventFilter,
    ReplicationBatch,
    Stored,
    Vectors,
    check_deletion,
)
from replication.vclock import VectorClock

__all__ = ["JournalEventLog", "read_events", "recover_location", "replicate_journals"]


def _line(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _fence(author: int) -> pb.LabelSet:
    return pb.LabelSet(labels=[pb.Label(name="writer", value=str(author))])


async def _records(
    stubs: Callable[[], pb_grpc.JournalStub], journal: str, offset: int = 0
) -> list[tuple[int, dict[str, Any]]]:
    """Every record of the journal from `offset` to its write head, with its offset."""
    out: list[tuple[int, dict[str, Any]]] = []
    partial = b""
    at = offset
    async for chunk in read_retrying(stubs, journal, offset, block=False):
        if chunk.offset != at + len(partial):
            raise ValueError(f"{journal}: content jumps to {chunk.offset} (a hole in the log)")
        data = partial + chunk.content
        start = 0
        while (end := data.find(b"\n", start)) != -1:
            out.append((at + start, json.loads(data[start:end])))
            start = end + 1
        at += start
        partial = data[start:]
    return out


def _event(record: Mapping[str, Any]) -> Stored:
    ts = VectorClock.from_json(record["ts"], field="event.ts")
    return Stored(int(record["seq"]), Event(str(record["emitter"]), ts, dict(record["payload"])))


async def read_events(
    stubs: Callable[[], pb_grpc.JournalStub], journal: str, after_seq: int = 0, limit: int = 1000
) -> tuple[list[Stored], VectorClock]:
    """Stored events of a location's log after `after_seq` (at most `limit`), and the CVV of
    the whole log as read (for a connection's batches)."""
    events: list[Stored] = []
    cvv = VectorClock()
    deleted = 0
    for _, record in await _records(stubs, journal):
        if record.get("kind") == "event":
            stored = _event(record)
            cvv = cvv.merge(stored.event.timestamp)
            if stored.seq > after_seq:
                events.append(stored)
        elif record.get("kind") == "deleted":
            deleted = max(deleted, int(record["through"]))
    return [s for s in events if s.seq > deleted][:limit], cvv


class JournalEventLog:
    """One location's log, written by this process alone once `open` took it."""

    def __init__(
        self,
        location: str,
        journal: str,
        stubs: Callable[[], pb_grpc.JournalStub],
        service: AppendService,
        author: int,
    ) -> None:
        self.location, self.journal = location, journal
        self.stubs, self.service, self.author = stubs, service, author
        self.cvv = VectorClock()
        self.dvv = VectorClock()
        self.deleted_through = 0
        self.next_seq = 1
        self.local_time = 0
        self.progress: dict[str, int] = {}
        self.cached_cvv: dict[str, VectorClock] = {}
        self._check = Registers(check=pb.LabelSelector(include=_fence(author)))

    async def open(self) -> None:
        """Take the log (fencing out any earlier writer) and rebuild its state."""
        record = _line({"kind": "writer", "author": self.author})
        await (await self.service.write(self.journal, record, Registers(union=_fence(self.author))))
        for _, rec in await _records(self.stubs, self.journal):
            self._fold(rec)

    def _fold(self, record: Mapping[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "event":
            stored = _event(record)
            self.cvv = self.cvv.merge(stored.event.timestamp)
            self.next_seq = max(self.next_seq, stored.seq + 1)
            if stored.event.emitter == self.location:
                self.local_time = max(self.local_time, stored.event.timestamp[self.location])
        elif kind == "progress":
            source, seq = str(record["source"]), int(record["seq"])
            if record.get("reset"):
                self.progress[source] = seq  # Metadata recovery of `source`: set, not raised.
            else:
                self.progress[source] = max(self.progress.get(source, 0), seq)
            self.cached_cvv[source] = VectorClock.from_json(record["cvv"], field="progress.cvv")
        elif kind == "local-time":
            self.local_time = max(self.local_time, int(record["time"]))
        elif kind == "deleted":
            self.deleted_through = max(self.deleted_through, int(record["through"]))
            self.dvv = self.dvv.merge(VectorClock.from_json(record["dvv"], field="deleted.dvv"))

    @property
    def name(self) -> str:
        return self.location

    async def set_local_time(self, time: int) -> None:
        """Metadata recovery: the local clock set ahead to `time` (never back)."""
        if time > self.local_time:
            await self._append([_line({"kind": "local-time", "time": time})])
            self.local_time = time

    async def reset_progress(self, source: str, seq: int) -> None:
        """Metadata recovery of `source`: its progress here set back to its last surviving
        sequence number (0 if it lost everything), so its new events are read again."""
        cvv = self.cached_cvv.get(source, VectorClock())
        await self._append(
            [_line({"kind": "progress", "source": source, "seq": seq, "reset": True,
                    "cvv": cvv.to_json()})]
        )  # fmt: skip
        self.progress[source] = seq

    async def delete(self, through_seq: int, neighbours: Sequence[Vectors]) -> VectorClock:
        """Delete every event through `through_seq`, if afterwards DVV ≤ CVV-i for every
        directly connected location i (RuleViolation, nothing recorded, if not); the DVV."""
        events, _ = await read_events(self.stubs, self.journal, self.deleted_through, 1 << 30)
        doomed = [s.event.timestamp for s in events if s.seq <= through_seq]
        dvv = self.dvv.merge(*doomed)
        check_deletion(self.location, through_seq, dvv, neighbours)
        await self._append(
            [_line({"kind": "deleted", "through": through_seq, "dvv": dvv.to_json()})]
        )
        self.deleted_through = max(self.deleted_through, through_seq)
        self.dvv = dvv
        return dvv

    def _stored(self, event: Event) -> tuple[Stored, bytes]:
        stored = Stored(self.next_seq, event)
        self.next_seq += 1
        self.cvv = self.cvv.merge(event.timestamp)
        line = _line(
            {"kind": "event", "seq": stored.seq, "emitter": event.emitter,
             "ts": event.timestamp.to_json(), "payload": dict(event.payload)}
        )  # fmt: skip
        return stored, line

    async def _append(self, lines: Sequence[bytes]) -> None:
        await (await self.service.write(self.journal, b"".join(lines), self._check))

    async def emit(self, payloads: Sequence[Mapping[str, Any]]) -> list[Event]:
        """New events, each causally after everything stored before it, in one append."""
        events, lines = [], []
        for payload in payloads:
            self.local_time = max(self.local_time, self.cvv[self.location]) + 1
            event = Event(self.location, self.cvv.set(self.location, self.local_time), payload)
            events.append(event)
            lines.append(self._stored(event)[1])
        await self._append(lines)
        return events

    def causality_filter(self, event: Event) -> bool:
        return not event.timestamp <= self.cvv

    async def write_batch(self, batch: ReplicationBatch) -> list[Stored]:
        """Store what the causality filter lets through, and the progress, in one append."""
        written, lines = [], []
        for s in batch.events:
            if self.causality_filter(s.event):
                stored, line = self._stored(s.event)
                written.append(stored)
                lines.append(line)
        lines.append(
            _line({"kind": "progress", "source": batch.source, "seq": batch.through_seq,
                   "cvv": batch.source_cvv.to_json()})
        )  # fmt: skip
        await self._append(lines)
        self.progress[batch.source] = max(self.progress.get(batch.source, 0), batch.through_seq)
        self.cached_cvv[batch.source] = batch.source_cvv
        return written


async def replicate_journals(
    source: str,
    source_journal: str,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> list[Stored]:
    """One round of replication from a location's journal into `target`: read after the
    target's progress for `source`, drop what target's CVV (causality filter, at the source) and
    the connection's filter exclude, and write the rest with the progress."""
    after = target.progress.get(source, 0)
    events, cvv = await read_events(target.stubs, source_journal, after, limit)
    through = events[-1].seq if events else after
    passing = tuple(
        s
        for s in events
        if target.causality_filter(s.event)
        and (replication_filter is None or replication_filter(s.event))
    )
    if not events:
        return []
    return await target.write_batch(ReplicationBatch(source, passing, through, cvv))


async def recover_location(
    recovering: JournalEventLog,
    survivors: int,
    neighbours: Sequence[tuple[JournalEventLog, str, bool]],
) -> list[str]:
    """Disaster recovery of `recovering` (its log kept events through `survivors`), from
    directly connected locations given as (their writer, their journal, whether both directions
    between them are unfiltered). Metadata first: the local clock set to the most any neighbour
    saw of it, and their progress for it reset to `survivors`. Then events, in rounds: from each
    unfiltered neighbour whose DVV ≤ CVV-recovering, again until no round adds any; the sources
    used, in order (a neighbour never allowed is left out: RuleViolation is not raised)."""
    from replication.location import check_recover_from
    from replication.topology import RuleViolation

    own = recovering.location
    await recovering.set_local_time(max(n.cvv[own] for n, _, _ in neighbours))
    for neighbour, _, _ in neighbours:
        await neighbour.reset_progress(own, survivors)
    used: list[str] = []
    pending = [(n, j) for n, j, unfiltered in neighbours if unfiltered]
    while pending:
        progressed = False
        for neighbour, journal in list(pending):
            try:
                check_recover_from(recovering, neighbour)
            except RuleViolation:
                continue  # Another round, once others raised CVV-recovering.
            await replicate_journals(neighbour.location, journal, recovering, limit=1 << 30)
            used.append(neighbour.location)
            pending.remove((neighbour, journal))
            progressed = True
        if not progressed:
            break
    return used
