"""Locations, their local event logs, and replication between them: the seed's system model and
its extensions, as logic over a log's storage (in memory here; a journal-backed log implements
the same storage).

A location's local event log assigns each event it emits a vector timestamp (its CVV, with its own
entry set to its next local time) and, to every event it stores, the next local sequence number.
The local time is kept apart from the CVV: after a disaster it is set ahead (to the most that
neighbours saw of it) while the CVV covers only what the log holds, so that events recovered from
neighbours pass the causality filter and new ones never reuse a time. Its CVV is the least
upper bound of every stored event's timestamp; its DVV that of every physically deleted one.
Replication from A to B reads A's log from B's recorded progress for A, drops what B's causality
filter excludes (a timestamp ≤ CVV-B: in B's causal past) and what the connection's replication
filter excludes, writes the rest to B in A's order, and only then records the progress (A,
sequence number): a crash between the two replays events the causality filter then drops, so
nothing is stored twice.

The rules of the extended model, each refusing with a `RuleViolation` naming the vectors:

* deletion: events up to a position may be physically deleted only if afterwards DVV-A ≤ CVV-i
  for every directly connected location i;
* a new connection X -> Y replicates only once DVV-X ≤ CVV-Y;
* disaster recovery from B is allowed only if DVV-B ≤ CVV-A (rounds: try again after others);
* fail-over of a filtered connection from A to B only if the CVV-A cached with A's last batch is
  ≤ CVV-B;
* a redundant filtered connection writes an event only if its timestamp restricted to the target's
  cycle is ≤ the target's CVV (else it is retried later).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from replication.topology import RuleViolation
from replication.vclock import VectorClock, lub

__all__ = [
    "Event",
    "LocationModel",
    "ReplicationBatch",
    "Stored",
    "Vectors",
    "check_deletion",
    "check_fail_over",
    "check_may_start",
    "check_recover_from",
    "join_for_new_events",
    "read_batch",
    "recover_metadata",
    "replicate",
    "write_batch",
]

EventFilter = Callable[["Event"], bool]


class Vectors(Protocol):
    """What the rules look at of a location: its name, CVV and DVV (an in-memory `LocationModel`, or
    a journal's `JournalEventLog`)."""

    @property
    def name(self) -> str: ...

    @property
    def cvv(self) -> VectorClock: ...

    @property
    def dvv(self) -> VectorClock: ...


@dataclass(frozen=True)
class Event:
    """An event: where it was emitted, its vector timestamp there, and its payload."""

    emitter: str
    timestamp: VectorClock
    payload: Mapping[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> tuple[str, int]:
        """Unique across the network: the emitter and its own time in the timestamp."""
        return (self.emitter, self.timestamp[self.emitter])


@dataclass(frozen=True)
class Stored:
    seq: int
    event: Event


@dataclass(frozen=True)
class ReplicationBatch:
    """What a read of a source log returns to a target: events after `from_seq` through
    `through_seq` that passed the filters at the source, and the source's CVV at the read
    (cached at the target for fail-over)."""

    source: str
    events: tuple[Stored, ...]
    through_seq: int
    source_cvv: VectorClock


@dataclass
class LocationModel:
    """One location's local event log and replication metadata."""

    name: str
    log: list[Stored] = field(default_factory=list)
    cvv: VectorClock = field(default_factory=VectorClock)
    dvv: VectorClock = field(default_factory=VectorClock)
    next_seq: int = 1
    deleted_through: int = 0  # Physically deleted: every event with seq <= this.
    local_time: int = 0  # The own entry of the last timestamp emitted here.
    progress: dict[str, int] = field(default_factory=dict)  # Source -> seq read through.
    cached_cvv: dict[str, VectorClock] = field(default_factory=dict)  # Source -> its last CVV.

    # ---- the local event log ------------------------------------------------------------------

    def emit(self, payload: Mapping[str, Any] | None = None) -> Event:
        """A new event, causally after everything stored here, stored here."""
        self.local_time = max(self.local_time, self.cvv[self.name]) + 1
        event = Event(self.name, self.cvv.set(self.name, self.local_time), dict(payload or {}))
        self._store(event)
        return event

    def _store(self, event: Event) -> Stored:
        stored = Stored(self.next_seq, event)
        self.log.append(stored)
        self.next_seq += 1
        self.cvv = self.cvv.merge(event.timestamp)
        return stored

    def causality_filter(self, event: Event) -> bool:
        """Whether `event` is new here (not in this log's causal past)."""
        return not event.timestamp <= self.cvv

    def write(self, events: Sequence[Event]) -> list[Stored]:
        """Store, in order, the events the causality filter lets through."""
        return [self._store(e) for e in events if self.causality_filter(e)]

    def read(self, after_seq: int, limit: int = 1000) -> list[Stored]:
        """Stored events after `after_seq` (physically deleted ones are gone)."""
        return [s for s in self.log if s.seq > after_seq][:limit]

    # ---- deletion ------------------------------------------------------------------------------

    def delete(self, through_seq: int, neighbours: Sequence[Vectors]) -> VectorClock:
        """Physically delete every event through `through_seq`, if afterwards DVV ≤ CVV-i for
        every directly connected location i; the new DVV."""
        doomed = [s for s in self.log if s.seq <= through_seq]
        dvv = self.dvv.merge(*(s.event.timestamp for s in doomed))
        check_deletion(self.name, through_seq, dvv, neighbours)
        self.log = [s for s in self.log if s.seq > through_seq]
        self.dvv = dvv
        self.deleted_through = max(self.deleted_through, through_seq)
        return dvv


def check_deletion(
    name: str, through_seq: int, dvv: VectorClock, neighbours: Sequence[Vectors]
) -> None:
    """Deletion through `through_seq` (the DVV it would leave) only if DVV ≤ CVV-i for every
    directly connected location i."""
    for other in neighbours:
        if not dvv <= other.cvv:
            raise RuleViolation(
                f"{name} may not delete through {through_seq}: its DVV would be {dvv}, "
                f"not <= CVV-{other.name} {other.cvv} (replicate to {other.name} first)"
            )


def check_may_start(source: Vectors, target: Vectors) -> None:
    """A new connection source -> target replicates only once DVV-source ≤ CVV-target."""
    if not source.dvv <= target.cvv:
        raise RuleViolation(
            f"replication {source.name} -> {target.name} may not start yet: DVV-{source.name} "
            f"{source.dvv} is not <= CVV-{target.name} {target.cvv}"
        )


def read_batch(
    source: LocationModel,
    target: LocationModel,
    replication_filter: EventFilter | None = None,
    limit: int = 1000,
) -> ReplicationBatch:
    """What source sends target: its events after target's progress for it, filtered at the
    source by target's CVV (most are dropped here) and by the connection's filter."""
    after = target.progress.get(source.name, 0)
    read = source.read(after, limit)
    through = read[-1].seq if read else max(after, source.deleted_through)
    passing = tuple(
        s
        for s in read
        if target.causality_filter(s.event)
        and (replication_filter is None or replication_filter(s.event))
    )
    return ReplicationBatch(source.name, passing, through, source.cvv)


def write_batch(
    target: LocationModel, batch: ReplicationBatch, *, cycle: Sequence[str] = ()
) -> list[Stored]:
    """Write a batch to target (its causality filter again: the CVV may have moved), then record
    the progress. With `cycle` (a redundant filtered connection into that cycle), an event whose
    timestamp restricted to the cycle is not ≤ CVV-target stops the batch there: it and what
    follows are read again later, and the progress stops before it."""
    written: list[Stored] = []
    through = batch.through_seq
    for stored in batch.events:
        event = stored.event
        if cycle and not event.timestamp.restrict(cycle) <= target.cvv:
            through = stored.seq - 1
            break
        written.extend(target.write([event]))
    target.progress[batch.source] = max(target.progress.get(batch.source, 0), through)
    target.cached_cvv[batch.source] = batch.source_cvv
    return written


def replicate(
    source: LocationModel,
    target: LocationModel,
    replication_filter: EventFilter | None = None,
    *,
    cycle: Sequence[str] = (),
    limit: int = 1000,
) -> list[Stored]:
    """One round of replication source -> target."""
    return write_batch(target, read_batch(source, target, replication_filter, limit), cycle=cycle)


class CachesVectors(Protocol):
    """What the fail-over rule looks at of a target: its name, and the CVV each source sent
    with its last batch (a `LocationModel`, or a journal's `JournalEventLog`)."""

    @property
    def name(self) -> str: ...

    @property
    def cached_cvv(self) -> Mapping[str, VectorClock]: ...


def check_fail_over(target: CachesVectors, previous: str, candidate: Vectors) -> None:
    """A filtered connection may switch from `previous` to `candidate` only if the CVV of
    `previous` cached at target (from its last batch) is ≤ CVV-candidate."""
    cached = target.cached_cvv.get(previous, VectorClock())
    if not cached <= candidate.cvv:
        raise RuleViolation(
            f"{target.name} may not fail over from {previous} to {candidate.name} yet: "
            f"CVV-{previous} {cached} is not <= CVV-{candidate.name} {candidate.cvv}"
        )


def check_recover_from(recovering: Vectors, source: Vectors) -> None:
    """Event recovery of `recovering` from `source` only if DVV-source ≤ CVV-recovering."""
    if not source.dvv <= recovering.cvv:
        raise RuleViolation(
            f"{recovering.name} may not recover from {source.name} yet: DVV-{source.name} "
            f"{source.dvv} is not <= CVV-{recovering.name} {recovering.cvv}"
        )


def recover_metadata(
    recovering: LocationModel, survivors: int, neighbours: Sequence[LocationModel]
) -> None:
    """After a disaster that kept the first `survivors` events (by seq): the local clock set to
    the maximum of its own time seen at directly connected locations, and their progress for it
    reset to the last surviving sequence number (0 if none)."""
    kept = [s for s in recovering.log if s.seq <= survivors]
    recovering.log = kept
    recovering.cvv = lub(s.event.timestamp for s in kept).merge(recovering.dvv)
    recovering.local_time = max(
        [recovering.cvv[recovering.name]] + [n.cvv[recovering.name] for n in neighbours]
    )
    recovering.next_seq = (kept[-1].seq if kept else recovering.deleted_through) + 1
    for n in neighbours:
        if recovering.name in n.progress:
            n.progress[recovering.name] = min(n.progress[recovering.name], survivors)


def join_for_new_events(new: LocationModel, neighbours: Sequence[LocationModel]) -> None:
    """A new location that wants only new events: its CVV and DVV set to the least upper bound
    of its new neighbours' DVVs, before the start rule applies."""
    floor = lub(n.dvv for n in neighbours)
    new.cvv = new.cvv.merge(floor)
    new.dvv = new.dvv.merge(floor)
