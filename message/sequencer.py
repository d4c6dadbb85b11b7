"""Sequencer: turns read-uncommitted message envelopes into read-committed ones.

Journal appends are at-least-once and producers write transactions as pending CONTINUE_TXN
messages closed by an ACK_TXN, so a read-uncommitted stream holds duplicates, messages still
pending, and messages that will be rolled back. The Sequencer tracks, per (journal, producer),
the Clock of the last acknowledgement and the offset where the producer's pending span begins,
and from that decides what each message means (see `QueueOutcome`):

* a message with a Clock at or below the last acknowledged one is a duplicate and is ignored;
* an OUTSIDE_TXN message commits itself;
* a CONTINUE_TXN message is held as pending;
* an ACK_TXN commits the pending messages having a Clock at or below its own (delivered in
  journal order, then the ACK itself), and rolls back those above it. An ACK whose Clock is not
  above the last acknowledgement (a producer that restarted and re-wrote an older ACK) rolls back
  everything pending and re-establishes that Clock.

Committed messages are dequeued as soon as their ACK is read, while other producers' messages
stay pending: there is no head-of-line blocking across producers. Recent envelopes are kept in a
ring buffer; when an ACK commits messages that already left the ring (or that were read before a
restart from a checkpoint), `replay_range()` names the journal offsets to re-read and the caller
feeds those envelopes back through `start_replay()`.

ACK_TXN envelopes are themselves dequeued (last in their sequence), as upstream Gazette does:
consumers skip them (`env.is_ack`). Dequeuing them lets a reader know that a
transaction finished and keeps checkpointed offsets exact.

Checkpoints (`checkpoint()` and `offsets`) capture the state through the last *processed*
envelope: an envelope returned by `step()` counts as processed once `step()` is called again.
A Sequencer built from a checkpoint continues reading each journal from its checkpointed offset
and dequeues exactly the committed messages not yet processed.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "COMMITTING",
    "Envelope",
    "JournalProducer",
    "ProducerState",
    "QueueOutcome",
    "ReplayError",
    "Sequencer",
]

_log = logging.getLogger(__name__)

# UUID flags, as in message/uuid (kept private here so this module stands alone).
_OUTSIDE_TXN = 0x0
_CONTINUE_TXN = 0x1
_ACK_TXN = 0x2

DEFAULT_RING_SIZE = 8192  # As upstream's ShardSpec ring_buffer_size default.


class Envelope(NamedTuple):
    """A message read from a journal, with its frame's [begin, end) offsets and UUID parts.

    A zero `clock` marks a message without a UUID: it is always delivered, never de-duplicated.
    (A NamedTuple: a reader builds one per message, and a tuple is the cheapest to build.)
    """

    journal: str
    begin: int
    end: int
    producer: bytes
    clock: int
    flags: int
    message: Any

    @property
    def is_ack(self) -> bool:
        """Whether this is an ACK_TXN acknowledgement, which applications skip."""
        return self.flags == _ACK_TXN


class JournalProducer(NamedTuple):
    """A producer within one journal: the unit the Sequencer tracks state for."""

    journal: str
    producer: bytes


@dataclass(frozen=True, slots=True)
class ProducerState:
    """Checkpointed state of a JournalProducer.

    `last_ack` is the Clock of the last acknowledged (and processed) message; `begin` is the
    journal offset where the producer's pending span begins, or -1 if there is none.
    """

    last_ack: int
    begin: int


class QueueOutcome(enum.Enum):
    """What `Sequencer.queue_uncommitted` decided about an envelope."""

    OUTSIDE_ALREADY_ACKED = "outsideAlreadyAcked"
    """A duplicate OUTSIDE_TXN message; ignored."""
    OUTSIDE_COMMIT = "outsideCommit"
    """An OUTSIDE_TXN message committed itself; dequeue with `step()`."""
    CONTINUE_ALREADY_ACKED = "continueAlreadyAcked"
    """A CONTINUE_TXN message at or below the last ACK; ignored."""
    CONTINUE_TXN_CLOCK_LARGER = "continueRingClockLarger"
    """A CONTINUE_TXN message not above the pending span's largest Clock (a duplicate); ignored."""
    CONTINUE_BEGIN_SPAN = "continueBeginSpan"
    """A CONTINUE_TXN message began a pending span of this producer."""
    CONTINUE_EXTEND_SPAN = "continueExtendSpan"
    """A CONTINUE_TXN message extended the pending span of this producer."""
    ACK_ROLLBACK = "ackRollback"
    """An ACK_TXN not above the last ACK: the pending span is discarded."""
    ACK_EMPTY = "ackEmpty"
    """An ACK_TXN with nothing pending committed itself; dequeue with `step()`."""
    ACK_COMMIT_RING = "ackCommitRing"
    """An ACK_TXN committed a span held entirely in the ring (or nothing but the ACK remains
    to deliver); dequeue with `step()`."""
    ACK_COMMIT_REPLAY = "ackCommitReplay"
    """An ACK_TXN committed a span not all in the ring: `replay_range()`, `start_replay()`,
    then dequeue with `step()`."""


COMMITTING = frozenset(
    {
        QueueOutcome.OUTSIDE_COMMIT,
        QueueOutcome.ACK_EMPTY,
        QueueOutcome.ACK_COMMIT_RING,
        QueueOutcome.ACK_COMMIT_REPLAY,
    }
)
"""The outcomes of `queue_uncommitted` after which committed envelopes are to be dequeued."""


class ReplayError(ValueError):
    """Replayed envelopes did not match the requested replay range."""


class _Partial:
    """Per-JournalProducer sequencing state (upstream's partial sequence)."""

    __slots__ = (
        "begin",
        "journal",
        "max_clock",
        "min_clock",
        "producer",
        "ring_start",
        "ring_stop",
    )

    def __init__(
        self, journal: str, producer: bytes, min_clock: int, max_clock: int, begin: int
    ) -> None:
        self.journal = journal
        self.producer = producer
        self.min_clock = min_clock  # Exclusive lower bound: the last acknowledged Clock.
        self.max_clock = max_clock  # Inclusive upper bound of the current span.
        self.begin = begin  # Offset where the span begins, or -1.
        self.ring_start = -1  # Ring indices (inclusive) of the span's envelopes, or -1.
        self.ring_stop = -1

    def reset(self, clock: int) -> None:
        self.min_clock = self.max_clock = clock
        self.begin = self.ring_start = self.ring_stop = -1


class Sequencer:
    """Sequences read-uncommitted envelopes of journals into read-committed ones.

    Feed each read envelope to `queue_uncommitted`. If it committed something, call `step()`
    until it returns None (or iterate `dequeue_committed()`), first satisfying a replay if the
    outcome was ACK_COMMIT_REPLAY. `queue_uncommitted` must not be called while committed
    envelopes remain to dequeue.
    """

    def __init__(
        self,
        checkpoint: Mapping[JournalProducer, ProducerState]
        | Mapping[tuple[str, bytes], ProducerState]
        | None = None,
        *,
        offsets: Mapping[str, int] | None = None,
        ring_size: int = DEFAULT_RING_SIZE,
    ) -> None:
        """Start empty, or resume from `checkpoint()` states and `offsets` taken earlier.

        `ring_size` is how many recent envelopes are kept to serve commits without a replay;
        0 is allowed and keeps just the committing envelope.
        """
        if ring_size < 0:
            raise ValueError(f"ring_size {ring_size} is negative: use 0 or more")
        size = max(ring_size, 1)
        self._offsets: dict[str, int] = dict(offsets or {})
        self._partials: dict[tuple[str, bytes], _Partial] = {}
        self._pending: set[_Partial] = set()  # Spans begun or extended since the last checkpoint.
        self._emit: _Partial | None = None  # Committed span being dequeued.
        self._commit_end = 0  # End offset of the envelope that committed |_emit|.
        self._dequeued: Envelope | None = None
        self._dequeued_clock = 0
        self._replay: Iterator[Envelope] | AsyncIterator[Envelope] | None = None
        # Grown as envelopes arrive, up to `size` slots, then reused in turn: an idle reader
        # (a shard with nothing to read) holds no slots.
        self._size = size
        self._ring: list[Envelope | None] = []
        self._next: list[int] = []  # Links envelopes of the same JournalProducer.
        self._head = 0  # Next ring index to write.

        for journal, offset in self._offsets.items():
            if offset < 0:
                raise ValueError(f"offset {offset} of journal {journal!r} is negative")
        for key, state in (checkpoint or {}).items():
            journal, producer = key
            if len(producer) != 6:
                raise ValueError(
                    f"producer {producer.hex()} of journal {journal!r} is {len(producer)} bytes;"
                    " a ProducerID is 6 bytes"
                )
            if state.last_ack < 0 or state.begin < -1:
                raise ValueError(
                    f"state {state} of producer {producer.hex()} in journal {journal!r} is"
                    " invalid: last_ack must be >= 0 and begin >= -1"
                )
            self._partials[(journal, producer)] = _Partial(
                journal, producer, state.last_ack, state.last_ack, state.begin
            )

    # Reading ---------------------------------------------------------------------------

    def queue_uncommitted(self, env: Envelope) -> QueueOutcome:
        """Apply the next read-uncommitted envelope and return what it meant."""
        if self._emit is not None:
            raise RuntimeError(
                "committed messages remain to dequeue: call step() until it returns None"
            )
        if self._head < len(self._ring) and self._ring[self._head] is not None:
            self._evict_at_head()

        clock, flags = env.clock, env.flags
        if clock == 0:
            # No UUID: committed at once and not tracked.
            partial = _Partial(env.journal, env.producer, 0, 0, -1)
            flags, clock = _OUTSIDE_TXN, 1
        else:
            key = (env.journal, env.producer)
            found = self._partials.get(key)
            if found is None:
                found = _Partial(env.journal, env.producer, clock - 1, clock - 1, -1)
                self._partials[key] = found
            partial = found

        # Each outcome either advances the journal's read-through offset or sets |_emit|, never
        # both: a committing envelope counts as read only once its sequence is fully dequeued,
        # so that a restart from a checkpoint taken meanwhile reads it again.
        if flags == _CONTINUE_TXN:
            if clock <= partial.min_clock:
                outcome = QueueOutcome.CONTINUE_ALREADY_ACKED
            elif clock <= partial.max_clock:
                outcome = QueueOutcome.CONTINUE_TXN_CLOCK_LARGER
            else:
                if partial.begin == -1:
                    outcome = QueueOutcome.CONTINUE_BEGIN_SPAN
                    partial.begin = env.begin
                    self._pending.add(partial)
                else:
                    outcome = QueueOutcome.CONTINUE_EXTEND_SPAN
                self._add_at_head(env, partial)
                partial.max_clock = clock
            self._offsets[env.journal] = env.end
            return outcome

        if flags == _ACK_TXN:
            if clock <= partial.min_clock:
                if clock < partial.min_clock:
                    # A producer restarted from an older checkpoint and re-wrote its ACK. Later
                    # messages above this Clock may be re-sends of ones already delivered:
                    # this falls back to at-least-once for them rather than drop new ones.
                    self._log_error(env, partial, "ACK_TXN below the last ACK (exactly-once lost)")
                partial.reset(clock)
                self._pending.discard(partial)
                self._offsets[env.journal] = env.end
                return QueueOutcome.ACK_ROLLBACK
            if partial.begin == -1:
                outcome = QueueOutcome.ACK_EMPTY
                partial.begin = env.begin
            elif partial.ring_start == -1:
                # No part of the span is in the ring. But after a restart from a checkpoint
                # taken while this very ACK was being dequeued, only the ACK itself remains.
                if partial.begin == env.begin:
                    outcome = QueueOutcome.ACK_COMMIT_RING
                else:
                    outcome = QueueOutcome.ACK_COMMIT_REPLAY
            elif partial.begin != self._ring_begin(partial.ring_start):
                outcome = QueueOutcome.ACK_COMMIT_REPLAY  # Only a trailing part is in the ring.
            else:
                outcome = QueueOutcome.ACK_COMMIT_RING
            self._add_at_head(env, partial)
        else:
            if flags != _OUTSIDE_TXN:
                self._log_error(
                    env, partial, f"unexpected UUID flags {flags:#x}; treated as OUTSIDE_TXN"
                )
            if clock <= partial.min_clock:
                self._offsets[env.journal] = env.end
                return QueueOutcome.OUTSIDE_ALREADY_ACKED
            # A restored span's Clocks are unknown (max == min): don't blame a restart.
            if partial.begin != -1 and partial.max_clock > partial.min_clock:
                self._log_error(
                    env,
                    partial,
                    "OUTSIDE_TXN after a pending CONTINUE_TXN (committed and uncommitted"
                    " publishing mixed on one journal?); the pending span is discarded",
                )
            outcome = QueueOutcome.OUTSIDE_COMMIT
            self._add_at_head(env, partial)
            # Commit just this envelope, discarding any pending span.
            partial.begin = env.begin
            partial.ring_start = partial.ring_stop

        # Commit through |clock|: span messages above it are dropped while dequeuing.
        partial.max_clock = clock
        self._commit_end = env.end
        self._emit = partial
        return outcome

    # Dequeuing -------------------------------------------------------------------------

    @property
    def dequeued(self) -> Envelope | None:
        """The committed envelope last returned by `step()` and not yet stepped past."""
        return self._dequeued

    def replay_range(self) -> tuple[str, int, int] | None:
        """The (journal, begin, end) offsets to re-read before dequeuing, or None if no replay
        is needed. Feed the envelopes read from that range to `start_replay`."""
        emit = self._emit
        if emit is None or not self._must_replay(emit):
            return None
        return emit.journal, emit.begin, self._ring_begin(emit.ring_start)

    def start_replay(self, envelopes: Iterable[Envelope] | AsyncIterable[Envelope]) -> None:
        """Supply the envelopes read from `replay_range()`, in journal order. An asynchronous
        source must be consumed with `astep()`."""
        if self._emit is None:
            raise RuntimeError("start_replay() called with no committed messages to dequeue")
        if isinstance(envelopes, AsyncIterable):
            self._replay = aiter(envelopes)
        else:
            self._replay = iter(envelopes)

    def step(self) -> Envelope | None:
        """Mark the current `dequeued` envelope processed and return the next committed one, or
        None once the committed sequence is complete (then `queue_uncommitted` may resume).

        Raises ReplayError if replayed envelopes fall outside the replay range.
        """
        emit = self._begin_step()
        if emit is None:
            return None
        # The hot path of every reader: kept inline (ring entries are taken as _take_from_ring
        # does, and delivered as _deliver does).
        ring, links = self._ring, self._next
        while (index := emit.ring_start) != -1:
            replay = self._replay
            if replay is None:
                env = ring[index]
                assert env is not None, "span ring entries are present until dequeued"
                emit.ring_start = links[index]
                ring[index] = None  # Consumed: release it.
                links[index] = -1
            elif isinstance(replay, AsyncIterator):
                raise TypeError("the replay source is asynchronous: dequeue with astep()")
            else:
                try:
                    env = next(replay)
                except StopIteration:
                    self._replay = None  # Replay done: continue from the ring.
                    continue
                if not self._accept_replayed(emit, env):
                    continue
            clock = env.clock
            if clock != 0 and clock <= emit.min_clock:
                continue  # A duplicate (see _deliver).
            if clock > emit.max_clock:
                continue  # Above the committing ACK: rolled back.
            emit.begin = env.begin  # A restart resumes from here.
            self._dequeued = env
            self._dequeued_clock = clock
            return env
        self._finish_sequence(emit)
        return None

    async def astep(self) -> Envelope | None:
        """As `step()`, reading a replay source that may be asynchronous."""
        if not isinstance(self._replay, AsyncIterator):
            return self.step()
        emit = self._begin_step()
        if emit is None:
            return None
        while emit.ring_start != -1:
            replay = self._replay
            if replay is None:
                env = self._take_from_ring(emit)
            else:
                try:
                    if isinstance(replay, AsyncIterator):
                        env = await anext(replay)
                    else:
                        env = next(replay)
                except (StopIteration, StopAsyncIteration):
                    self._replay = None
                    continue
                if not self._accept_replayed(emit, env):
                    continue
            if self._deliver(emit, env):
                return env
        self._finish_sequence(emit)
        return None

    def dequeue_committed(self) -> Iterator[Envelope]:
        """Yield committed envelopes via `step()`: asking for the next one marks the previous
        one processed. Stopping early leaves the last yielded envelope as `dequeued`."""
        while (env := self.step()) is not None:
            yield env

    # Checkpoints -----------------------------------------------------------------------

    @property
    def offsets(self) -> dict[str, int]:
        """Per journal, the offset from which to continue reading after a restart."""
        return dict(self._offsets)

    def has_pending(self) -> bool:
        """Whether a pending span was begun or extended since the last `checkpoint()`: a hint
        that an acknowledgement may be forthcoming."""
        return bool(self._pending)

    def checkpoint(self, prune_horizon: float = 0.0) -> dict[JournalProducer, ProducerState]:
        """Snapshot producer states (pair them with `offsets`), first pruning producers older
        than `prune_horizon` seconds (see `prune`; 0 disables pruning). Also clears
        `has_pending()`: spans that did not complete by this checkpoint are not waited for."""
        if prune_horizon:
            self.prune(prune_horizon)
        self._pending.clear()
        return self.producer_states()

    def producer_states(self) -> dict[JournalProducer, ProducerState]:
        """The current state of each tracked producer, without checkpoint side effects."""
        return {
            JournalProducer(p.journal, p.producer): ProducerState(p.min_clock, p.begin)
            for p in self._partials.values()
        }

    def producer_state(self, journal: str, producer: bytes) -> ProducerState | None:
        """The current state of one producer, or None if it is not tracked."""
        p = self._partials.get((journal, producer))
        return None if p is None else ProducerState(p.min_clock, p.begin)

    def pending_envelopes(self, journal: str, producer: bytes) -> list[Envelope]:
        """The envelopes of the producer's pending span still held in the ring, in journal
        order (all of the span, unless it outgrew the ring)."""
        if self._emit is not None:
            raise RuntimeError(
                "committed messages remain to dequeue: call step() until it returns None"
            )
        p = self._partials.get((journal, producer))
        out: list[Envelope] = []
        index = -1 if p is None or p.begin == -1 else p.ring_start
        while index != -1:
            env = self._ring[index]
            assert env is not None, "span ring entries are present until dequeued"
            out.append(env)
            index = self._next[index]
        return out

    def prune(self, horizon: float) -> list[JournalProducer]:
        """Forget producers whose latest Clock is more than `horizon` seconds older than the
        newest acknowledged Clock within their journal; return those forgotten."""
        if horizon < 0:
            raise ValueError(f"prune horizon {horizon} is negative: use seconds >= 0")
        pruned: list[JournalProducer] = []
        if not horizon:
            return pruned
        # Clock units: 100 ns ticks, shifted left 4 bits over a sequence counter.
        units = (round(horizon * 1e9) // 100) << 4
        newest: dict[str, int] = {}
        for p in self._partials.values():
            if p.min_clock > newest.get(p.journal, 0):
                newest[p.journal] = p.min_clock
        for key, p in list(self._partials.items()):
            if p.max_clock < newest.get(p.journal, 0) - units:
                del self._partials[key]
                self._pending.discard(p)
                pruned.append(JournalProducer(p.journal, p.producer))
        return pruned

    # Internals -------------------------------------------------------------------------

    def _ring_begin(self, index: int) -> int:
        env = self._ring[index]
        assert env is not None, "ring index of a span must hold an envelope"
        return env.begin

    def _must_replay(self, emit: _Partial) -> bool:
        return (
            self._dequeued is None
            and self._replay is None
            and emit.begin != self._ring_begin(emit.ring_start)
        )

    def _begin_step(self) -> _Partial | None:
        emit = self._emit
        if emit is None:
            return None
        if self._must_replay(emit):
            raise RuntimeError(
                "committed messages must be replayed first: read replay_range() and call"
                " start_replay() with the envelopes of that range"
            )
        if self._dequeued is not None:
            emit.min_clock = self._dequeued_clock  # The last dequeued envelope is processed.
        return emit

    def _take_from_ring(self, emit: _Partial) -> Envelope:
        index = emit.ring_start
        env = self._ring[index]
        assert env is not None, "span ring entries are present until dequeued"
        emit.ring_start = self._next[index]
        self._ring[index] = None  # Consumed: release it.
        self._next[index] = -1
        return env

    def _accept_replayed(self, emit: _Partial, env: Envelope) -> bool:
        """Validate a replayed envelope; True if it belongs to the producer being dequeued."""
        if env.journal != emit.journal:
            raise ReplayError(f"replay of wrong journal ({env.journal}; expected {emit.journal})")
        if env.begin < emit.begin:
            raise ReplayError(f"replay has wrong begin ({env.begin}; expected >= {emit.begin})")
        ring_begin = self._ring_begin(emit.ring_start)
        if env.end > ring_begin:
            raise ReplayError(f"replay has wrong end ({env.end}; expected <= {ring_begin})")
        # Other producers' envelopes are interleaved in the replayed range. One without a Clock
        # was delivered when it was read: not again, and it must not reset the duplicate bound.
        return env.producer == emit.producer and env.clock != 0

    def _deliver(self, emit: _Partial, env: Envelope) -> bool:
        clock = env.clock
        if clock != 0 and clock <= emit.min_clock:
            # A duplicate: replays can re-read a span also (partly) in the ring, and a span
            # duplicated across a restart is not known to be a duplicate until now.
            return False
        if clock > emit.max_clock:
            return False  # Above the committing ACK: rolled back.
        emit.begin = env.begin  # A restart resumes from here.
        self._dequeued = env
        self._dequeued_clock = clock
        return True

    def _finish_sequence(self, emit: _Partial) -> None:
        # Only now does the committing envelope count as read.
        self._offsets[emit.journal] = self._commit_end
        emit.reset(emit.min_clock)
        self._pending.discard(emit)
        self._emit = None
        self._dequeued = None
        self._dequeued_clock = 0
        self._replay = None

    def _evict_at_head(self) -> None:
        head = self._head
        env = self._ring[head]
        if env is None:
            return
        # A span whose oldest ring entry is evicted now starts at its next entry, if any.
        p = self._partials.get((env.journal, env.producer))
        if p is not None and p.ring_start == head:
            if p.ring_start == p.ring_stop:
                p.ring_start = p.ring_stop = -1
            else:
                p.ring_start = self._next[head]
        self._ring[head] = None
        self._next[head] = -1

    def _add_at_head(self, env: Envelope, partial: _Partial) -> None:
        head = self._head
        if head == len(self._ring):  # Still growing.
            self._ring.append(env)
            self._next.append(-1)
        else:
            self._ring[head] = env
            self._next[head] = -1
        if partial.ring_stop == -1:
            partial.ring_start = head
        else:
            self._next[partial.ring_stop] = head
        partial.ring_stop = head
        self._head = (head + 1) % self._size

    @staticmethod
    def _log_error(env: Envelope, partial: _Partial, message: str) -> None:
        _log.error(
            "%s: journal %s offsets [%d, %d) producer %s clock %d flags %#x"
            " (last ack %d, span max %d, span begin %d)",
            message,
            env.journal,
            env.begin,
            env.end,
            env.producer.hex(),
            env.clock,
            env.flags,
            partial.min_clock,
            partial.max_clock,
            partial.begin,
        )
