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
the next sequence number, the local time and the progress of every source. A `SourceReader`
follows a log incrementally (an index of each event's offset, recent events kept parsed, the CVV
as read), for `read_events` and for replication rounds.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
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
from replication.system import change_of, is_system
from replication.topology import Topology
from replication.vclock import VectorClock

__all__ = [
    "JournalEventLog",
    "SourceReader",
    "read_events",
    "recover_location",
    "replicate_journals",
    "replicate_round",
    "scan_records",
    "select_batch",
]

_RECENT = 100_000  # Events kept parsed by a SourceReader (between this and twice as many).


def _line(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _fence(author: int) -> pb.LabelSet:
    return pb.LabelSet(labels=[pb.Label(name="writer", value=str(author))])


async def scan_records(
    stubs: Callable[[], pb_grpc.JournalStub],
    journal: str,
    begin: int = 0,
    *,
    block: bool = False,
    events: int | None = None,
) -> list[tuple[int, int, dict[str, Any]]]:
    """Whole records of a location's journal from `begin`, to its write head (blocking: once
    some arrived; `events`: once that many events were read), each with its offset and end."""
    out: list[tuple[int, int, dict[str, Any]]] = []
    partial, at, seen = b"", begin, 0
    chunks: Any = read_retrying(stubs, journal, begin, block=block)
    async with contextlib.aclosing(chunks):  # An async generator: closed when we stop.
        async for chunk in chunks:
            if chunk.offset != at + len(partial):
                raise ValueError(f"{journal}: content jumps to {chunk.offset} (a hole in the log)")
            data = partial + chunk.content
            start = 0
            while (end := data.find(b"\n", start)) != -1:
                record = json.loads(data[start:end])
                out.append((at + start, at + end + 1, record))
                seen += record.get("kind") == "event"
                start = end + 1
            at += start
            partial = data[start:]
            if (block and not partial) or (events is not None and seen >= events):
                break  # Enough: whole records arrived, or the events asked for.
    return out


def _event(record: Mapping[str, Any]) -> Stored:
    ts = VectorClock.from_json(record["ts"], field="event.ts")
    return Stored(int(record["seq"]), Event(str(record["emitter"]), ts, dict(record["payload"])))


async def read_events(
    stubs: Callable[[], pb_grpc.JournalStub], journal: str, after_seq: int = 0, limit: int = 1000
) -> tuple[list[Stored], VectorClock]:
    """Stored events of a location's log after `after_seq` (at most `limit`; deleted ones
    skipped), and the CVV of the whole log as read."""
    reader = SourceReader(stubs, journal)
    await reader.refresh()
    return await reader.events_after(after_seq, limit), reader.cvv


class SourceReader:
    """A location's journal, read incrementally."""

    def __init__(self, stubs: Callable[[], pb_grpc.JournalStub], journal: str) -> None:
        self.stubs, self.journal = stubs, journal
        self.position = 0  # Journal offset read through (a record boundary).
        self.cvv = VectorClock()
        self.deleted_through = 0  # The source's deletions, as read, and their DVV.
        self.dvv = VectorClock()
        self._seqs: list[int] = []  # Event seq numbers, in order, and their offsets.
        self._offsets: list[int] = []
        # The most recent events as parsed (the window a connection usually reads from).
        self._recent: list[Stored] = []

    async def refresh(self, *, block: bool = False) -> int:
        """Read what is new (waiting for some, if `block`); the count of new events."""
        records = await scan_records(self.stubs, self.journal, self.position, block=block)
        new = 0
        for offset, end, record in records:
            if record.get("kind") == "event":
                stored = _event(record)
                self._seqs.append(stored.seq)
                self._offsets.append(offset)
                self._recent.append(stored)
                self.cvv = self.cvv.merge(stored.event.timestamp)
                new += 1
            elif record.get("kind") == "deleted":
                self.deleted_through = max(self.deleted_through, int(record["through"]))
                self.dvv = self.dvv.merge(VectorClock.from_json(record["dvv"], field="deleted.dvv"))
            self.position = end
        if len(self._recent) > 2 * _RECENT:
            del self._recent[:-_RECENT]
        return new

    @property
    def last_seq(self) -> int:
        return self._seqs[-1] if self._seqs else 0

    def seqs_between(self, after_seq: int, through_seq: int) -> list[int]:
        """Sequence numbers of stored (not deleted) events read, in (after, through]."""
        lo = bisect.bisect_right(self._seqs, max(after_seq, self.deleted_through))
        return self._seqs[lo : bisect.bisect_right(self._seqs, through_seq)]

    async def events_after(self, after_seq: int, limit: int = 1000) -> list[Stored]:
        """Stored events after `after_seq`, at most `limit`, read from their offset."""
        i = bisect.bisect_right(self._seqs, max(after_seq, self.deleted_through))
        if i == len(self._seqs):
            return []
        first_recent = len(self._seqs) - len(self._recent)
        if i >= first_recent:  # Parsed already.
            return self._recent[i - first_recent : i - first_recent + limit]
        out: list[Stored] = []
        for _, _, record in await scan_records(
            self.stubs, self.journal, self._offsets[i], events=limit
        ):
            if record.get("kind") == "event":
                out.append(_event(record))
                if len(out) == limit:
                    break
        return out


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
        # The view of the topology's history folded from the system events stored here.
        self.topology = Topology()
        self._check = Registers(check=pb.LabelSelector(include=_fence(author)))
        self._grown: asyncio.Event | None = None

    async def grown(self) -> None:
        """Wait until the next append of this writer is committed."""
        if self._grown is None:
            self._grown = asyncio.Event()
        await self._grown.wait()

    async def open(self) -> None:
        """Take the log (fencing out any earlier writer) and rebuild its state."""
        record = _line({"kind": "writer", "author": self.author})
        await (await self.service.write(self.journal, record, Registers(union=_fence(self.author))))
        for _, _, rec in await scan_records(self.stubs, self.journal):
            self._fold(rec)

    def _fold(self, record: Mapping[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "event":
            stored = _event(record)
            self.cvv = self.cvv.merge(stored.event.timestamp)
            self.next_seq = max(self.next_seq, stored.seq + 1)
            if stored.event.emitter == self.location:
                self.local_time = max(self.local_time, stored.event.timestamp[self.location])
            if is_system(stored.event):
                self.topology.apply(change_of(stored.event))
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
        if is_system(event):
            self.topology.apply(change_of(event))
        line = _line(
            {"kind": "event", "seq": stored.seq, "emitter": event.emitter,
             "ts": event.timestamp.to_json(), "payload": dict(event.payload)}
        )  # fmt: skip
        return stored, line

    async def _append(self, lines: Sequence[bytes]) -> None:
        await (await self.service.write(self.journal, b"".join(lines), self._check))
        if self._grown is not None:
            self._grown.set()
            self._grown = None

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


async def select_batch(
    source: str,
    reader: SourceReader,
    after_seq: int,
    target_cvv: VectorClock,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> ReplicationBatch | None:
    """What a source sends a target from what `reader` has read of the source's log: its events
    after `after_seq` (the target's progress for it), less what the target's CVV (the causality
    filter, applied at the source) and the connection's filter exclude, through the last one
    read; None if there is nothing new."""
    events = await reader.events_after(after_seq, limit)
    if not events:
        return None
    passing = tuple(
        s
        for s in events
        if not s.event.timestamp <= target_cvv
        and (replication_filter is None or replication_filter(s.event))
    )
    return ReplicationBatch(source, passing, events[-1].seq, reader.cvv)


async def replicate_round(
    source: str,
    reader: SourceReader,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
    stats: dict[str, int] | None = None,
) -> list[Stored] | None:
    """One round of replication source -> target from what `reader` has read (`select_batch`),
    written with the progress in one append; None if there was nothing new. `stats` counts
    `read` (through the batch), `filtered` (dropped by either filter) and `written` events."""
    after = target.progress.get(source, 0)
    batch = await select_batch(source, reader, after, target.cvv, replication_filter, limit)
    if batch is None:
        return None
    written = await target.write_batch(batch)
    if stats is not None:
        read = len(reader.seqs_between(after, batch.through_seq))
        stats["read"] = stats.get("read", 0) + read
        stats["filtered"] = stats.get("filtered", 0) + read - len(written)
        stats["written"] = stats.get("written", 0) + len(written)
    return written


async def replicate_journals(
    source: str,
    source_journal: str,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> list[Stored]:
    """One round of replication from a location's journal into `target`, read afresh."""
    reader = SourceReader(target.stubs, source_journal)
    await reader.refresh()
    return await replicate_round(source, reader, target, replication_filter, limit) or []


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
