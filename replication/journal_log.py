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
  them; their fragments may then be pruned), and the DVV that leaves, recorded;
* `{"kind": "joined", "floor": {...}}`: the location wants only new events from its new
  neighbours: its CVV and DVV raised to the least upper bound of their DVVs;
* `{"kind": "checkpoint", ...}`: the writer's whole state (next seq, local time, CVV, DVV,
  deletions, progress, cached CVVs, the topology's history), written after each deletion, so
  that the journal's fragments before it, holding only deleted events, can be removed (physical
  deletion) and the log still opened and read from what remains.

Event records keep their fields in one order (`replication.records`), so that replication reads
an event's sequence number, emitter and timestamp without decoding its payload, and writes it to
the target as the source's bytes with the target's sequence number.

Opening the log takes it (a writer record) and reads it through that record to rebuild the CVV,
the next sequence number, the local time and the progress of every source. A `SourceReader`
follows a log incrementally (an index of each event's offset, recent events kept as read, the CVV
as read), for `read_events` and for replication rounds. A round's append is staged (the writer's
state moves on at once, in the order of the appends) and may commit while the next round reads.
"""

from __future__ import annotations

import array
import asyncio
import bisect
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.client.append_service import AppendService, PendingSpan, Registers
from broker.client.reader import read_retrying
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from replication.model import (
    Event,
    EventFilter,
    ReplicationBatch,
    Stored,
    Vectors,
    check_deletion,
)
from replication.records import (
    EVENT_LINE,
    RawEvent,
    encode_event,
    event_of,
    index_records,
    merge_stamps,
    parse_event,
    record_line,
    split_records,
)
from replication.system import join_floor, keyed_change_of, keyed_changes, keyed_document
from replication.topology import Topology
from replication.vclock import VectorClock

__all__ = [
    "JournalEventLog",
    "LineBatch",
    "SourceReader",
    "read_events",
    "read_lines",
    "recover_location",
    "replicate_journals",
    "replicate_round",
    "scan_records",
    "select_lines",
]


def _done() -> asyncio.Future[None]:
    """The commit of an append that staged nothing: done already."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def _fence(author: int) -> pb.LabelSet:
    return pb.LabelSet(labels=[pb.Label(name="writer", value=str(author))])


class _LogVectors:
    """A log's CVV (kept as a dict, a VectorClock on demand), DVV and deletions, as its records
    say: what a writer and a reader of the log both track."""

    def __init__(self) -> None:
        self.deleted_through = 0
        self.dvv = VectorClock()
        self._cvv: dict[str, int] = {}
        self._cvv_clock: VectorClock | None = VectorClock()

    @property
    def cvv(self) -> VectorClock:
        if self._cvv_clock is None:
            self._cvv_clock = VectorClock(self._cvv)
        return self._cvv_clock

    def _raise_cvv(self, ts: Mapping[str, int]) -> None:
        """Merge a timestamp into the CVV."""
        for location, time in ts.items():
            if time > self._cvv.get(location, 0):
                self._cvv[location] = time
        self._cvv_clock = None

    def _fold_vectors(self, record: Mapping[str, Any]) -> None:
        """What a `deleted`, `joined` or `checkpoint` record says of the vectors."""
        kind = record.get("kind")
        if kind == "deleted":
            self.deleted_through = max(self.deleted_through, int(record["through"]))
            self.dvv = self.dvv.merge(VectorClock.from_json(record["dvv"], field="deleted.dvv"))
        elif kind == "joined":
            floor = VectorClock.from_json(record["floor"], field="joined.floor")
            self.dvv = self.dvv.merge(floor)
            self._raise_cvv(floor)
        elif kind == "checkpoint":
            self.deleted_through = max(self.deleted_through, int(record["deleted_through"]))
            self.dvv = self.dvv.merge(VectorClock.from_json(record["dvv"], field="checkpoint.dvv"))
            self._raise_cvv(VectorClock.from_json(record["cvv"], field="checkpoint.cvv"))


async def scan_records(
    stubs: Callable[[], pb_grpc.JournalStub], journal: str, begin: int = 0
) -> list[tuple[int, int, RawEvent | None, dict[str, Any]]]:
    """Every record of a location's journal from `begin` (or from where it begins) to its write
    head, each with its offset and end: an event as a RawEvent, or another record decoded."""
    at, data = await read_lines(stubs, journal, begin)
    out: list[tuple[int, int, RawEvent | None, dict[str, Any]]] = []
    for start, end, raw in split_records(data)[0]:
        record = _NO_RECORD
        if raw is None:
            raw, record = _record(data[start:end])
        out.append((at + start, at + end, raw, record))
    return out


_NO_RECORD: dict[str, Any] = {}


def _record(line: bytes) -> tuple[RawEvent | None, dict[str, Any]]:
    """A record the fast path did not read: an event as a RawEvent, or another record."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"not a record: {line[:80]!r}")
    if record.get("kind") == "event":
        return event_of(record), _NO_RECORD
    return None, record


async def read_events(
    stubs: Callable[[], pb_grpc.JournalStub], journal: str, after_seq: int = 0, limit: int = 1000
) -> tuple[list[Stored], VectorClock]:
    """Stored events of a location's log after `after_seq` (at most `limit`; deleted ones
    skipped), and the CVV of the whole log as read."""
    reader = SourceReader(stubs, journal)
    await reader.catch_up()
    return await reader.events_after(after_seq, limit), reader.cvv


async def read_lines(
    stubs: Callable[[], pb_grpc.JournalStub],
    journal: str,
    begin: int,
    *,
    block: bool = False,
    until: int | None = None,
    most: int | None = None,
) -> tuple[int, bytes]:
    """The whole lines of a journal from `begin` (or from where its content begins, if what
    was before was pruned: the offset it starts at, with the lines): to its write head, or to
    `until`, or once at least `most` bytes of them arrived (blocking: once some arrived)."""
    parts: list[bytes] = []
    size, at, whole = 0, begin, 0
    chunks: Any = read_retrying(stubs, journal, begin, block=block)
    async with contextlib.aclosing(chunks):  # An async generator: closed when we stop.
        async for chunk in chunks:
            if chunk.offset != at:
                if parts or chunk.offset < at:
                    raise ValueError(f"{journal}: content jumps to {chunk.offset} (a hole in the log)")  # fmt: skip
                begin = at = chunk.offset  # Pruned before it (deleted events): read on from there.
            parts.append(chunk.content)
            at += len(chunk.content)
            size += len(chunk.content)
            newline = chunk.content.rfind(b"\n")
            if newline != -1:
                whole = size - len(chunk.content) + newline + 1
            if (
                (until is not None and begin + whole >= until)
                or (block and whole == size)
                or (most is not None and whole >= most)
            ):
                break  # Enough: through `until`, or whole lines arrived.
    data = b"".join(parts)
    return begin, data[: max(0, until - begin) if until is not None else whole]


_WINDOW = 32 << 20  # Bytes of a log's recent content a SourceReader keeps.
_READ = 2 << 20  # Bytes a refresh reads at most (so a long backlog is replicated as it is read).


class SourceReader(_LogVectors):
    """A location's journal, read incrementally: an index of its events (sequence numbers and
    offsets), the CVV, DVV and deletions as read, and its recent content as bytes (events are
    parsed when a batch is asked for, not kept parsed)."""

    def __init__(self, stubs: Callable[[], pb_grpc.JournalStub], journal: str) -> None:
        super().__init__()
        self.stubs, self.journal = stubs, journal
        self.position = 0  # Journal offset read through (a record boundary).
        self._seqs = array.array("q")  # Event seq numbers, in order, and their offsets.
        self._offsets = array.array("q")
        self._chunks: list[tuple[int, bytes]] = []  # Recent content: (offset, bytes).
        self._kept = 0
        self._last_read = 0

    async def refresh(self, *, block: bool = False) -> int:
        """Read what is new, a few MiB at most (waiting for some, if `block`); the count of new
        events."""
        at, data = await read_lines(
            self.stubs, self.journal, self.position, block=block, most=_READ
        )
        self._last_read = len(data)
        if not data:
            return 0
        seqs, starts, others = index_records(data, self._cvv)
        late: list[tuple[int, int]] = []  # Events not in the fixed form: (start, seq).
        for start, end in others:
            raw, record = _record(data[start:end])
            if raw is not None:
                late.append((start, raw.seq))
                self._raise_cvv(raw.ts)
            else:
                self._fold_vectors(record)
        if late:
            merged = sorted([*zip(starts, seqs, strict=True), *late])
            starts, seqs = [st for st, _ in merged], [sq for _, sq in merged]
        if any(b <= a for a, b in itertools.pairwise([self.last_seq, *seqs])):
            starts, seqs = _first_of_each(starts, seqs, self.last_seq)
        self._seqs.extend(seqs)
        self._offsets.extend([at + start for start in starts] if at else starts)
        self._chunks.append((at, data))
        self._kept += len(data)
        while self._kept - len(self._chunks[0][1]) >= _WINDOW:
            self._kept -= len(self._chunks.pop(0)[1])
        self.position = at + len(data)
        if seqs:
            self._cvv_clock = None
        return len(seqs)

    async def catch_up(self) -> int:
        """Read to the write head; the count of new events."""
        new = await self.refresh()
        while self._last_read >= _READ:
            new += await self.refresh()
        return new

    @property
    def last_seq(self) -> int:
        return self._seqs[-1] if self._seqs else 0

    def offset_after(self, seq: int) -> int:
        """Where the first event after `seq` begins (the read position if none)."""
        i = bisect.bisect_right(self._seqs, seq)
        return self._offsets[i] if i < len(self._seqs) else self.position

    def seqs_between(self, after_seq: int, through_seq: int) -> list[int]:
        """Sequence numbers of stored (not deleted) events read, in (after, through]."""
        lo = bisect.bisect_right(self._seqs, max(after_seq, self.deleted_through))
        return list(self._seqs[lo : bisect.bisect_right(self._seqs, through_seq)])

    def _kept_content(self, begin: int, end: int) -> bytes | None:
        """The log's content in [begin, end) if it is still kept."""
        if not self._chunks or begin < self._chunks[0][0]:
            return None
        parts = []
        for at, data in self._chunks:
            if at + len(data) <= begin:
                continue
            if at >= end:
                break
            parts.append(data[max(0, begin - at) : end - at])
        return b"".join(parts)

    async def region_after(self, after_seq: int, limit: int = 1000) -> tuple[bytes, int] | None:
        """The content holding the stored events after `after_seq` (at most `limit`; other
        records among them), and the seq of the last of them; None if there are none."""
        i = bisect.bisect_right(self._seqs, max(after_seq, self.deleted_through))
        if i == len(self._seqs):
            return None
        j = min(i + limit, len(self._seqs))
        begin = self._offsets[i]
        end = self._offsets[j] if j < len(self._seqs) else self.position
        data = self._kept_content(begin, end)
        if data is None:
            _, data = await read_lines(self.stubs, self.journal, begin, until=end)
        return data, self._seqs[j - 1]

    async def raw_after(self, after_seq: int, limit: int = 1000) -> list[RawEvent]:
        """Stored events after `after_seq`, at most `limit`, parsed from their content."""
        region = await self.region_after(after_seq, limit)
        if region is None:
            return []
        data = region[0]
        out: list[RawEvent] = []
        lines, _ = split_records(data)
        for start, stop, raw in lines:
            if raw is None:
                raw, _ = _record(data[start:stop])
            if raw is not None and raw.seq > (out[-1].seq if out else after_seq):
                out.append(raw)  # (A record at or below the last one read is a repeat.)
        return out[:limit]

    async def events_after(self, after_seq: int, limit: int = 1000) -> list[Stored]:
        return [raw.stored() for raw in await self.raw_after(after_seq, limit)]


def _first_of_each(starts: list[int], seqs: list[int], last: int) -> tuple[list[int], list[int]]:
    """The events of an index read in order, less those at or below the last sequence number
    before them: an append stored twice (retried after its first attempt landed) repeats its
    records, and a log's sequence numbers otherwise only grow."""
    kept_starts, kept_seqs = [], []
    for start, seq in zip(starts, seqs, strict=True):
        if seq > last:
            kept_starts.append(start)
            kept_seqs.append(seq)
            last = seq
    return kept_starts, kept_seqs


@dataclass
class LineBatch:
    """What a source sends a target: the records of its events after the target's progress
    (as stored at the source; other records among them are skipped), through `through_seq`,
    and the source's CVV."""

    source: str
    data: bytes
    through_seq: int
    source_cvv: VectorClock


_NAMES: dict[bytes, str] = {}  # Emitter names as read, decoded once.
_SYSTEM_MARK = b'"payload":{"system":'


def _pass_events(
    data: bytes,
    cvv: Mapping[str, int],
    keep: EventFilter | None,
    first_seq: int | None,
    group: Collection[str] = (),
) -> tuple[list[bytes], list[bytes], list[RawEvent], int | None]:
    """The event records of `data` that pass the causality filter of `cvv` (and `keep`), in
    order: their lines (renumbered from `first_seq`, or as they are), their timestamps' entries
    (the fixed form, without braces), those that are system events (parsed), and the source
    seq of the event it stopped at, if any: with `group` (the target's unfiltered group, for a
    filtered connection into it), an event is written only once its timestamp restricted to the
    group is <= the CVV (else it and what follows are read again later: the seed's rule for
    redundant filtered connections).

    The causality filter compares an event's own entry only: ts <= CVV exactly when
    ts[emitter] <= CVV[emitter], because a CVV entry of the emitter at least that high comes
    from an event that had seen this one (an emitter's events are a chain). Events of one
    source's log, in its order, never cover each other later in a batch (its storage order is a
    linear extension of causality), so the CVV from before the batch decides for all of it."""
    out: list[bytes] = []
    stamps: list[bytes] = []
    systems: list[RawEvent] = []
    names = _NAMES
    seq = first_seq
    last = 0  # The source seq of the last event read: a record at or below it is a repeat.
    for match in EVENT_LINE.finditer(data):
        source_seq, body, emitter, own, stamp = match.groups()
        if source_seq is None:  # Another record, or an event not in the fixed form.
            raw, _ = _record(match.group(0))
            if raw is None:
                continue
            if raw.seq <= last:
                continue  # Stored twice (an append retried after its first attempt landed).
            last = raw.seq
            if raw.ts.get(raw.emitter, 0) <= cvv.get(raw.emitter, 0):
                continue
            if keep is not None and not keep(raw.event()):
                continue
            if any(raw.ts.get(k, 0) > cvv.get(k, 0) for k in group):
                return out, stamps, systems, raw.seq
            if raw.is_system:
                systems.append(raw)
            stamps.append(b",".join(b'"%s":%d' % (k.encode(), t) for k, t in raw.ts.items()))
            out.append(raw.line(raw.seq if seq is None else seq))
            if seq is not None:
                seq += 1
            continue
        number = int(source_seq)
        if number <= last:
            continue  # Stored twice (an append retried after its first attempt landed).
        last = number
        name = names.get(emitter)
        if name is None:
            name = names[emitter] = emitter.decode()
        if own is None:
            raise ValueError(f"event {name}/{source_seq.decode()}: no entry of its emitter in its timestamp")  # fmt: skip
        if int(own) <= cvv.get(name, 0):
            continue
        if keep is not None or group or _SYSTEM_MARK in body:
            ts = {k[1:-1].decode(): int(v) for k, v in (p.split(b":") for p in stamp.split(b","))}
            at = body.index(b',"payload":', len(emitter) + len(stamp)) + 11
            raw = RawEvent(int(source_seq), name, ts, body, at)
            if keep is not None and not keep(raw.event()):
                continue
            if any(ts.get(k, 0) > cvv.get(k, 0) for k in group):
                return out, stamps, systems, raw.seq
            if raw.is_system:
                systems.append(raw)
        stamps.append(stamp)
        if seq is None:
            out.append(match.group(0))
        else:
            out.append(b'{"kind":"event","seq":%d,%s' % (seq, body))
            seq += 1
    return out, stamps, systems, None


class JournalEventLog(_LogVectors):
    """One location's log, written by this process alone once `open` took it."""

    def __init__(
        self,
        location: str,
        journal: str,
        stubs: Callable[[], pb_grpc.JournalStub],
        service: AppendService | None,
        author: int,
    ) -> None:
        """`service` None: a log only folded (`fold`), by a standby, until `bind` gives it a
        writer."""
        super().__init__()
        self.location, self.journal = location, journal
        self.stubs, self.service, self.author = stubs, service, author
        self.folded_to = 0  # The journal's offset through which its records are folded.
        self.created = 0  # The etcd revision that created its journal, where known.
        self.next_seq = 1
        self.local_time = 0
        self.progress: dict[str, int] = {}
        self.cached_cvv: dict[str, VectorClock] = {}
        # The view of the topology's history folded from the system events stored here.
        self.topology = Topology()
        self.checkpoint_offset = 0  # Where its last checkpoint record is (0: none).
        # What its committed appends hold: the last sequence number and the CVV (the state above
        # moves on as appends are staged). What other locations are told (Status) and what a
        # deletion covers are committed events only.
        self.committed_seq = 0
        self._committed_cvv: dict[str, int] = {}
        self._last_queued: PendingSpan | None = None
        self._check = Registers(check=pb.LabelSelector(include=_fence(author)))
        self._grown: asyncio.Event | None = None

    async def grown(self) -> None:
        """Wait until the next append of this writer is committed."""
        if self._grown is None:
            self._grown = asyncio.Event()
        await self._grown.wait()

    def bind(
        self, stubs: Callable[[], pb_grpc.JournalStub], service: AppendService, author: int
    ) -> None:
        """Make a log folded by a standby this process's, to `open` as its writer."""
        self.stubs, self.service, self.author = stubs, service, author
        self._check = Registers(check=pb.LabelSelector(include=_fence(author)))

    async def open(self) -> None:
        """Take the log (fencing out any earlier writer) and rebuild its state: fold what was
        appended since it was last folded (all of it, for a log not folded before)."""
        record = record_line({"kind": "writer", "author": self.author})
        await (await self._writer().write(self.journal, record, Registers(union=_fence(self.author))))  # fmt: skip
        await self.fold()
        self.committed_seq, self._committed_cvv = self.next_seq - 1, dict(self._cvv)

    async def fold(self) -> None:
        """Fold the records appended since the last fold, through the write head (a standby
        keeps a log folded so, and its primary folds only the rest when it takes over)."""
        records = await scan_records(self.stubs, self.journal, self.folded_to)
        for offset, _, raw, rec in records:
            if raw is not None:
                self._fold_event(raw)
            else:
                self._fold(rec)
                if rec.get("kind") == "checkpoint":
                    self.checkpoint_offset = offset
        if records:
            self.folded_to = records[-1][1]

    def _writer(self) -> AppendService:
        if self.service is None:
            raise RuntimeError(f"location {self.location}: its log is only folded here, not written")  # fmt: skip
        return self.service

    def _fold_event(self, raw: RawEvent) -> None:
        self._raise_cvv(raw.ts)
        self.next_seq = max(self.next_seq, raw.seq + 1)
        if raw.emitter == self.location:
            self.local_time = max(self.local_time, raw.ts.get(self.location, 0))
        if raw.is_system:
            self._fold_system(raw)

    def _fold_system(self, raw: RawEvent) -> None:
        key, change = keyed_change_of(raw.event())
        self.topology.apply(change, key)

    def _fold(self, record: Mapping[str, Any]) -> None:
        self._fold_vectors(record)
        kind = record.get("kind")
        if kind == "progress":
            source, seq = str(record["source"]), int(record["seq"])
            if record.get("reset"):
                self.progress[source] = seq  # Metadata recovery of `source`: set, not raised.
            else:
                self.progress[source] = max(self.progress.get(source, 0), seq)
            self.cached_cvv[source] = VectorClock.from_json(record["cvv"], field="progress.cvv")
        elif kind == "local-time":
            self.local_time = max(self.local_time, int(record["time"]))
        elif kind == "checkpoint":  # The state of everything before it, as its writer had it.
            self.next_seq = max(self.next_seq, int(record["next_seq"]))
            self.local_time = max(self.local_time, int(record["local_time"]))
            for source, seq in dict(record["progress"]).items():
                self.progress[source] = max(self.progress.get(source, 0), int(seq))
            for source, cvv in dict(record["cached_cvv"]).items():
                self.cached_cvv.setdefault(source, VectorClock.from_json(cvv, field="checkpoint"))
            for key, change in keyed_changes(record["history"], "checkpoint.history"):
                self.topology.apply(change, key)

    @property
    def name(self) -> str:
        return self.location

    async def join(self, floor: VectorClock) -> None:
        """A location that wants only new events from its new neighbours: its CVV and DVV set
        to (at least) `floor`, the least upper bound of their DVVs (a `joined` record), so that
        the start rule DVV-neighbour <= CVV-here holds at once."""
        record = {"kind": "joined", "floor": floor.to_json()}
        await self._room()
        self._fold_vectors(record)
        await self._queue([record_line(record)])

    async def set_local_time(self, time: int) -> None:
        """Metadata recovery: the local clock set ahead to `time` (never back)."""
        await self._room()
        if time > self.local_time:
            commit = self._queue([record_line({"kind": "local-time", "time": time})])
            self.local_time = time  # Staged: no emit after it reuses a time below it.
            await commit

    async def reset_progress(self, source: str, seq: int) -> None:
        """Metadata recovery of `source`: its progress here set back to its last surviving
        sequence number (0 if it lost everything), so its new events are read again."""
        await self._room()
        cvv = self.cached_cvv.get(source, VectorClock())
        commit = self._queue(
            [record_line({"kind": "progress", "source": source, "seq": seq, "reset": True,
                          "cvv": cvv.to_json()})]
        )  # fmt: skip
        self.progress[source] = seq
        await commit

    async def delete(self, through_seq: int, neighbours: Sequence[Vectors]) -> VectorClock:
        """Delete every event through `through_seq`, if afterwards DVV ≤ CVV-i for every
        directly connected location i (RuleViolation, nothing recorded, if not); the DVV."""
        await self.settled()  # Events staged through `through_seq` are read below, committed.
        reader = SourceReader(self.stubs, self.journal)
        await reader.catch_up()
        doomed = await reader.raw_after(self.deleted_through, 1 << 30)
        dvv = self.dvv.merge(*(VectorClock(r.ts) for r in doomed if r.seq <= through_seq))
        check_deletion(self.location, through_seq, dvv, neighbours)
        await self._room()
        deleted = record_line({"kind": "deleted", "through": through_seq, "dvv": dvv.to_json()})
        self.deleted_through = max(self.deleted_through, through_seq)
        self.dvv = dvv
        checkpoint = self._checkpoint()
        span = await self._queue([deleted, checkpoint])
        self.checkpoint_offset = span.end - len(checkpoint)
        return dvv

    def _checkpoint(self) -> bytes:
        """A record of this log's whole state (the state its records before it build), from
        which a writer or a reader can start once what is before it was pruned."""
        return record_line({
            "kind": "checkpoint", "next_seq": self.next_seq, "local_time": self.local_time,
            "cvv": self._cvv, "dvv": self.dvv.to_json(), "deleted_through": self.deleted_through,
            "progress": self.progress,
            "cached_cvv": {k: v.to_json() for k, v in self.cached_cvv.items()},
            "history": [keyed_document(k, c) for k, c in self.topology.keyed()],
        })  # fmt: skip

    def _take(self, raw: RawEvent) -> tuple[int, bytes]:
        """Store `raw` next: its sequence number here, and its line (after the `joined` record
        it calls for, if any)."""
        seq = self.next_seq
        self.next_seq += 1
        self._raise_cvv(raw.ts)
        joined = self._take_system(raw) if raw.is_system else []
        return seq, b"".join([raw.line(seq), *joined])

    def _take_system(self, raw: RawEvent) -> list[bytes]:
        """Fold a system event this writer is storing (emitted here, or replicated from any
        source); the `joined` record to store in the same append, if the change is a
        `--new-events-only` one into this location that its view did not hold yet. So the
        target joins as the change enters its log, whichever route brought it, before its
        connection from the source can start (that connection is in the view only from now);
        another record of the same op (another location's) finds it held and joins no more."""
        key, change = keyed_change_of(raw.event())
        if not self.topology.apply(change, key):
            return []
        floor = join_floor(change, self.location)
        if floor is None:
            return []
        record = {"kind": "joined", "floor": floor.to_json(), "op": key[0]}
        self._fold_vectors(record)  # Staged now: the connection's start rule sees it.
        return [record_line(record)]

    async def _room(self) -> None:
        """Wait while the append service holds too much for this log: before a change of state
        is staged, never between the two (a write that waited after staging could be overtaken
        by a later one, storing an event before its causes)."""
        await self._writer().room(self.journal)

    def _queue(self, lines: Sequence[bytes]) -> PendingSpan:
        """Queue an append of `lines` (in order after every earlier one) at once; its commit.
        Callers wait for `_room` first, and stage their state and queue without awaiting in
        between."""
        commit = self._writer().write_now(self.journal, b"".join(lines), self._check)
        state = (self.next_seq - 1, dict(self._cvv))  # What it holds once it commits.
        commit.batch.add_done_callback(lambda batch: self._committed(batch, state))
        self._last_queued = commit
        return commit

    def _committed(self, batch: asyncio.Future[int], state: tuple[int, dict[str, int]]) -> None:
        if batch.cancelled() or batch.exception() is not None:
            return
        # Appends commit in order, so this is the state of everything committed.
        self.committed_seq, self._committed_cvv = state
        if self._grown is not None:
            self._grown.set()
            self._grown = None

    @property
    def committed_cvv(self) -> VectorClock:
        """The CVV of the events its committed appends hold."""
        return VectorClock(self._committed_cvv)

    async def settled(self) -> None:
        """Wait until every append staged so far has committed (AppendError if one failed)."""
        if self._last_queued is not None:
            await self._last_queued

    async def emit(self, payloads: Sequence[Mapping[str, Any]]) -> list[Event]:
        """New events, each causally after everything stored before it, in one append."""
        await self._room()
        events, lines = [], []
        for payload in payloads:
            self.local_time = max(self.local_time, self._cvv.get(self.location, 0)) + 1
            event = Event(self.location, self.cvv.set(self.location, self.local_time), payload)
            events.append(event)
            lines.append(self._take(encode_event(0, event))[1])
        await self._queue(lines)
        return events

    async def stage_lines(
        self,
        batch: LineBatch,
        keep: EventFilter | None = None,
        group: Collection[str] = (),
        *,
        after: int | None = None,
    ) -> tuple[list[bytes], Awaitable[Any]]:
        """Store what the causality filter (and `keep`) lets through, and the progress, in one
        append: the records written, and the append's commit. With `group` (a filtered
        connection into this location's unfiltered group), the batch stops at an event whose
        timestamp restricted to the group is not <= the CVV, and the progress before it. With
        `after` (the progress the batch was read from): nothing is staged, and nothing
        returned, if the progress for its source is no longer that. This log's state (CVV,
        sequence numbers, progress) moves on at once; appends commit in order."""
        await self._room()
        if after is not None and self.progress.get(batch.source, 0) != after:
            # Read before a reset of the progress (metadata recovery of the source: its log
            # made anew, reusing sequence numbers): staged, it would raise the progress back
            # past the new log's first events, and they would be skipped for good.
            return [], _done()
        lines, stamps, systems, stopped = _pass_events(
            batch.data, self._cvv, keep, self.next_seq, group
        )
        through = batch.through_seq if stopped is None else stopped - 1
        self.next_seq += len(lines)
        merge_stamps(stamps, self._cvv)
        self._cvv_clock = None
        joined = [line for raw in systems for line in self._take_system(raw)]
        progress = record_line(
            {"kind": "progress", "source": batch.source, "seq": through,
             "cvv": batch.source_cvv.to_json()}
        )  # fmt: skip
        self.progress[batch.source] = max(self.progress.get(batch.source, 0), through)
        self.cached_cvv[batch.source] = batch.source_cvv
        return lines, self._queue([*lines, *joined, progress])

    async def write_lines(
        self, batch: LineBatch, keep: EventFilter | None = None, group: Collection[str] = ()
    ) -> list[bytes]:
        lines, commit = await self.stage_lines(batch, keep, group)
        await commit
        return lines

    async def write_batch(self, batch: ReplicationBatch) -> list[Stored]:
        """Store what the causality filter lets through, and the progress, in one append."""
        data = b"".join(encode_event(s.seq, s.event).line(s.seq) for s in batch.events)
        written = await self.write_lines(
            LineBatch(batch.source, data, batch.through_seq, batch.source_cvv)
        )
        return [parse_event(line).stored() for line in written]


async def select_lines(
    source: str,
    reader: SourceReader,
    after_seq: int,
    target_cvv: Mapping[str, int],
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> LineBatch | None:
    """What a source sends a target from what `reader` has read of the source's log: its events
    after `after_seq` (the target's progress for it), less what the target's CVV (the causality
    filter, applied at the source) and the connection's filter exclude, through the last one
    read; None if there is nothing new. Payloads are decoded only for a filter."""
    region = await reader.region_after(after_seq, limit)
    if region is None:
        return None
    data, through = region
    lines, _, _, _ = _pass_events(data, target_cvv, replication_filter, None)
    return LineBatch(source, b"".join(lines), through, reader.cvv)


async def replicate_round(
    source: str,
    reader: SourceReader,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
    stats: dict[str, int] | None = None,
    *,
    wait: bool = True,
    group: Collection[str] = (),
) -> tuple[int, Awaitable[Any]] | None:
    """One round of replication source -> target from what `reader` has read of the source's
    journal: its events after the target's progress, filtered at the target (the causality
    filter, and the connection's), staged with the progress in one append; the count of events
    written and the append's commit (awaited already, if `wait`); None if there was nothing
    new. `stats` counts `read`, `filtered` (dropped by either filter) and `written` events."""
    after = target.progress.get(source, 0)
    region = await reader.region_after(after, limit)
    if region is None:
        return None
    data, through = region
    lines, commit = await target.stage_lines(
        LineBatch(source, data, through, reader.cvv), replication_filter, group, after=after
    )
    if wait:
        await commit
    if stats is not None:
        read = len(reader.seqs_between(after, through))
        stats["read"] = stats.get("read", 0) + read
        stats["filtered"] = stats.get("filtered", 0) + read - len(lines)
        stats["written"] = stats.get("written", 0) + len(lines)
    return len(lines), commit


async def replicate_journals(
    source: str,
    source_journal: str,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> list[Stored]:
    """One round of replication from a location's journal into `target`, read afresh; the
    events it stored."""
    reader = SourceReader(target.stubs, source_journal)
    await reader.catch_up()
    region = await reader.region_after(target.progress.get(source, 0), limit)
    if region is None:
        return []
    batch = LineBatch(source, region[0], region[1], reader.cvv)
    return [parse_event(line).stored() for line in await target.write_lines(batch, replication_filter)]  # fmt: skip


async def recover_location(
    recovering: JournalEventLog,
    survivors: int,
    neighbours: Sequence[tuple[JournalEventLog, str, bool]],
    others: Sequence[Vectors] = (),
) -> list[str]:
    """Disaster recovery of `recovering` (its log kept events through `survivors`), from
    directly connected locations given as (their writer, their journal, whether both directions
    between them are unfiltered). Metadata first: the local clock set to the most any neighbour,
    or any of `others`, saw of it (in a network whose connections change, a past connection may
    have carried its events further than its neighbours of now: the seed's rule, the neighbours
    alone, is for static networks), and the neighbours' progress for it reset to `survivors`.
    Then events, in rounds: from each
    unfiltered neighbour whose DVV ≤ CVV-recovering, again until no round adds any; the sources
    used, in order (a neighbour never allowed is left out: RuleViolation is not raised)."""
    from replication.model import check_recover_from
    from replication.topology import RuleViolation

    own = recovering.location
    seen = [n.cvv[own] for n, _, _ in neighbours] + [o.cvv[own] for o in others]
    await recovering.set_local_time(max(seen, default=0))
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
