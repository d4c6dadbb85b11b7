"""Tally: the Sequencer's decisions for one journal, as indices rather than envelopes.

A reader that holds a whole range of a journal (the Spark stream source's planner and its
executors) does not need the Sequencer's ring or its replays to know what commits: it only needs,
per producer, the Clock of the last acknowledgement, the pending span's begin, and which of the
messages it holds belong to that span. `Tally.add` takes the messages in journal order, each by
its index in the caller's columns, and answers what the Sequencer's `queue_uncommitted` and
`step()` would deliver: the indices of the committed messages, in the order the Sequencer
dequeues them (ACKs left out), or None when nothing commits.

`Tally.add_run` takes a run of messages as columns at once (numpy), when every producer's
messages in it are in order: Clocks strictly increasing past its span, ACKs and OUTSIDE_TXN
messages that commit everything pending (no rollback, no duplicate, no REPLAY). It answers what
`add` one at a time would, computed in C; for any other run it answers None and changes nothing,
and the caller adds the run's messages one at a time.

One case needs messages the caller does not hold: a span restored from a checkpoint
(`ProducerState.begin` set) began before the range the caller reads. Its commit says `REPLAY`;
the caller reads `replay_range()` again and passes the envelopes to `replayed()`, which answers
the envelopes delivered from that range and the held indices after them.

The rules are the Sequencer's (see its module): a Clock at or below the last ACK is a duplicate;
a span only grows by Clocks above its largest; an ACK commits the span's messages at or below its
Clock and rolls back the rest; an ACK not above the last ACK rolls back everything pending; an
OUTSIDE_TXN message commits itself and discards a pending span; a message without a UUID (Clock
0) is always delivered. `tests/test_tally.py` checks the two agree on random histories.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from message.sequencer import Envelope, JournalProducer, ProducerState

__all__ = ["REPLAY", "RUN_PRODUCERS", "Tally"]

_log = logging.getLogger(__name__)

_CONTINUE_TXN = 0x1
_ACK_TXN = 0x2

REPLAY: list[int] = []  # `Tally.add`: the commit needs `replay_range()` read again (an identity).
RUN_PRODUCERS = 64  # `Tally.add_run` takes runs of at most this many producers.


class _Span:
    """A producer's state: its last ACK, its span's largest Clock and begin, and the held
    messages of its span (indices and Clocks, Clocks strictly increasing)."""

    __slots__ = ("begin", "clocks", "first", "indices", "last_ack", "restored", "top")

    def __init__(self, last_ack: int, begin: int, restored: bool) -> None:
        self.last_ack = last_ack
        self.top = last_ack
        self.begin = begin
        self.restored = restored  # The span began before the held range.
        self.first = -1  # The begin offset of its first held message.
        self.indices: list[int] = []
        self.clocks: list[int] = []

    def reset(self, clock: int) -> None:
        self.last_ack = self.top = clock
        self.begin = -1
        self.restored = False
        self.first = -1
        if self.indices:
            self.indices = []
            self.clocks = []


class Tally:
    """What a Sequencer restored from `checkpoint` at offset `start` of `journal` commits, for
    the messages added from there in journal order."""

    def __init__(
        self, journal: str, checkpoint: Mapping[JournalProducer, ProducerState], start: int
    ) -> None:
        self.journal = journal
        self.start = start
        self._spans: dict[bytes, _Span] = {}
        for key, state in checkpoint.items():
            if key[0] == journal:
                self._spans[key[1]] = _Span(state.last_ack, state.begin, state.begin != -1)
        # A deferred commit: producer, span, ACK Clock, the offsets to read again [from, to).
        self._replay: tuple[bytes, _Span, int, int, int] | None = None

    def add(self, index: int, producer: bytes, clock: int, flags: int, begin: int) -> list[int] | None:  # fmt: skip
        """The message at `index` (of Clock, flags and begin offset given): the held indices it
        commits, in delivery order (an empty list when an ACK commits nothing else), None when
        nothing commits, or `REPLAY` (then call `replayed()` before adding more)."""
        if clock == 0:  # No UUID (or a Clock of 0): delivered, not tracked; an ACK is no row.
            return [] if flags == _ACK_TXN else [index]
        span = self._spans.get(producer)
        if span is None:
            span = self._spans[producer] = _Span(clock - 1, -1, False)
        if flags == _CONTINUE_TXN:
            if clock > span.top:
                if span.begin == -1:
                    span.begin = begin
                if not span.indices:
                    span.first = begin
                span.indices.append(index)
                span.clocks.append(clock)
                span.top = clock
            return None
        if flags == _ACK_TXN:
            if clock <= span.last_ack:
                if clock < span.last_ack:
                    self._error(producer, clock, flags, begin, span, "ACK_TXN below the last ACK")
                span.reset(clock)
                return None
            if span.begin == -1:
                span.reset(clock)
                return []
            if span.restored:
                first = span.first if span.indices else begin
                if span.begin != first:  # Its messages before the held ones are read again.
                    self._replay = (producer, span, clock, span.begin, first)
                    return REPLAY
            clocks = span.clocks
            if clocks and clocks[-1] > clock:
                out = span.indices[: bisect.bisect_right(clocks, clock)]
            else:
                out = span.indices
            span.reset(clock)
            return out
        if flags != 0:
            self._error(producer, clock, flags, begin, span, "unexpected UUID flags")
        if clock <= span.last_ack:
            return None
        if span.begin != -1 and span.top > span.last_ack:
            self._error(producer, clock, flags, begin, span, "OUTSIDE_TXN after a pending span")
        span.reset(clock)
        return [index]

    def add_run(
        self, first: int, producers: list[bytes], which: Any, clocks: Any, flags: Any, begins: Any
    ) -> Any:
        """Messages at indices `first`, `first` + 1, ... in journal order, as numpy columns:
        each one's producer (`which`: an index into `producers`), Clock, flags and begin
        offset. The held indices they commit, in delivery order (a numpy int64 array), if every
        producer's messages are in order; else None, with nothing changed."""
        import numpy as np

        n = len(clocks)
        if self._replay is not None or len(producers) > RUN_PRODUCERS:
            return None
        if n == 0:
            return np.zeros(0, np.int64)
        if (clocks <= 0).any() or (
            (flags != 0) & (flags != _CONTINUE_TXN) & (flags != _ACK_TXN)
        ).any():
            return None
        # Each producer's messages together, in journal order.
        order = np.argsort(which, kind="stable")
        group, clock, flag = which[order], clocks[order], flags[order]
        same = group[1:] == group[:-1]
        if (same & (clock[1:] <= clock[:-1])).any():
            return None  # A Clock not above the one before it: a duplicate or a rollback.
        heads = np.flatnonzero(np.concatenate(([True], ~same)))  # Each group's first position.
        ends = np.append(heads[1:], n)
        cont = flag == _CONTINUE_TXN
        commit = ~cont  # ACKs and OUTSIDE_TXN messages: each commits what is pending.
        # Per position: CONTINUE_TXNs before it in its group, and the last commit before it.
        conts_before = np.cumsum(cont) - cont
        positions = np.arange(n)
        last_commit = np.maximum.accumulate(np.where(commit, positions, -1))
        before = np.concatenate(([-1], last_commit[:-1]))
        group_head = np.repeat(heads, ends - heads)
        before = np.where(before >= group_head, before, -1)  # (Within the group only.)
        pending_at_head = np.zeros(len(heads), bool)
        carried: list[list[int]] = []
        for g, head in enumerate(heads.tolist()):
            span = self._spans.get(producers[int(group[head])])
            if span is not None and int(clock[head]) <= span.top:
                return None  # At or below its span's largest, or its last ACK.
            pending = span is not None and span.begin != -1 and span.top > span.last_ack
            if span is not None and span.restored and commit[head : ends[g]].any():
                return None  # Its commit may need what was read before the held range.
            pending_at_head[g] = pending
            carried.append(list(span.indices) if span is not None else [])
        # An OUTSIDE_TXN message with a span pending (the Sequencer logs it): one at a time.
        # Pending at a position: a CONTINUE_TXN since the group's last commit (or its head),
        # or, with no commit before it in the run, the span held from before.
        since = conts_before - conts_before[np.where(before >= 0, before, group_head)]
        group_of = np.repeat(np.arange(len(heads)), ends - heads)
        open_span = (since > 0) | ((before < 0) & pending_at_head[group_of])
        if ((flag == 0) & open_span).any():
            return None
        # What commits: each CONTINUE_TXN at its group's next commit (if any), each OUTSIDE_TXN
        # at itself, and the spans held from before at their group's first commit.
        next_commit = np.minimum.accumulate(np.where(commit, positions, n)[::-1])[::-1]
        next_commit = np.where(next_commit < np.repeat(ends, ends - heads), next_commit, n)
        index = order + first
        rows = np.flatnonzero((cont & (next_commit < n)) | (flag == 0))
        row_index = index[rows]
        row_at = np.where(cont[rows], index[np.minimum(next_commit[rows], n - 1)], row_index)
        extra_index: list[int] = []
        extra_at: list[int] = []
        for g, head in enumerate(heads.tolist()):
            if carried[g]:
                at = next_commit[head]
                if at < n:
                    extra_index += carried[g]
                    extra_at += [int(index[at])] * len(carried[g])
        if extra_index:
            row_index = np.concatenate((np.array(extra_index, np.int64), row_index))
            row_at = np.concatenate((np.array(extra_at, np.int64), row_at))
        delivered = row_index[np.lexsort((row_index, row_at))]
        # The producers' states after the run.
        for g, head in enumerate(heads.tolist()):
            end = int(ends[g])
            key = producers[int(group[head])]
            span = self._spans.get(key)
            if span is None:
                span = self._spans[key] = _Span(int(clock[head]) - 1, -1, False)
            last = int(last_commit[end - 1])
            if last >= head:
                span.reset(int(clock[last]))
            tail = range(max(last + 1, head), end)
            if tail:
                tail_index = index[tail.start : tail.stop]
                if span.begin == -1:
                    span.begin = int(begins[tail_index[0] - first])
                if not span.indices:
                    span.first = int(begins[tail_index[0] - first])
                span.indices += tail_index.tolist()
                span.clocks += clock[tail.start : tail.stop].tolist()
                span.top = int(clock[end - 1])
        return delivered

    def replay_range(self) -> tuple[str, int, int]:
        """The (journal, begin, end) offsets to read again after `add` said REPLAY."""
        assert self._replay is not None, "no replay is due"
        _, _, _, begin, end = self._replay
        return self.journal, begin, end

    def replayed(self, envelopes: Iterable[Envelope]) -> tuple[list[Envelope], list[int]]:
        """The commit `add` deferred: the envelopes delivered from `replay_range()` (given in
        journal order, every producer's), then the held indices delivered after them."""
        assert self._replay is not None, "no replay is due"
        producer, span, ack, begin, end = self._replay
        self._replay = None
        last = span.last_ack
        before: list[Envelope] = []
        for env in envelopes:
            if env.begin < begin or env.end > end:
                raise ValueError(
                    f"replayed envelope [{env.begin}, {env.end}) is outside [{begin}, {end})"
                )
            if env.producer != producer or env.clock == 0:
                continue  # (One without a Clock was delivered when it was read.)
            if last < env.clock <= ack:
                before.append(env)
                last = env.clock
        held: list[int] = []
        for index, clock in zip(span.indices, span.clocks, strict=True):
            if last < clock <= ack:
                held.append(index)
                last = clock
        span.reset(ack)
        return [e for e in before if e.flags != _ACK_TXN], held

    def oldest_held(self) -> int | None:
        """The smallest held index a later commit may still deliver (None: none): the caller
        may let go of the messages before it."""
        return min((s.indices[0] for s in self._spans.values() if s.indices), default=None)

    def checkpoint(self) -> dict[JournalProducer, ProducerState]:
        """Each producer's state now, as `Sequencer.checkpoint()` gives it."""
        return {
            JournalProducer(self.journal, producer): ProducerState(span.last_ack, span.begin)
            for producer, span in self._spans.items()
        }

    def _error(
        self, producer: bytes, clock: int, flags: int, begin: int, span: _Span, message: str
    ) -> None:
        _log.error(
            "%s: journal %s offset %d producer %s clock %d flags %#x (last ack %d, span max %d,"
            " span begin %d)",
            message, self.journal, begin, producer.hex(), clock, flags, span.last_ack, span.top,
            span.begin,
        )  # fmt: skip
