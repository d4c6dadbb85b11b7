"""The history checker, in the spirit of Jepsen's queue checker: given a fault run's History,
it finds every way the run broke the broker's promises.

* Every acknowledged append is in the journal exactly once, at the offsets it was acknowledged
  at (`lost`, `misplaced`, `duplicated`); nothing is in the journal that no client appended, or
  that the broker refused or rolled back (`unexpected`, `refused-present`), and no two appends
  were acknowledged at overlapping offsets (`ack-overlap`).
* No offset ever holds two different contents, across replicas, stores, readers and time
  (`conflict`); the journal has no hole (`gap`).
* No reader saw bytes the journal does not hold, such as uncommitted or rolled-back ones
  (`uncommitted-read`); reads never go backwards (`non-monotonic`) nor jump over committed bytes
  (`skipped`).
* A register-checked append is applied only while the registers allow it (`register`): they
  hold its owner, or nothing (upstream's rule: empty registers match every check, as after
  they were lost with every replica).
* Read-committed streams deliver each message at most once (`rc-duplicate`), never an aborted
  one (`rc-aborted`) nor one the journal does not hold committed (`rc-vanished`); every
  acknowledged committed message is delivered exactly once (`lost`).
* Once the faults healed, every journal took an append again (`unavailable-after-heal`).
* An append whose client gave up (a deadline, a cancelled call) and that the broker had not
  proposed by then is never committed (`left-committed`): upstream aborts it as it would take
  the pipeline. The proof that it was proposed after its client left is an append acknowledged
  before it in the journal whose commit was sent more than `LEAVE_MARGIN` after the client
  left, with no pause or partition in between that could have kept the news from the broker.
  A record written again through AppendService after its client left may be in the journal a
  second time only then (the first attempt proposed in time, its acknowledgement lost).
* No append fails because a broker built a message its peers refuse (`oversized`: every
  message of the workload is far below gRPC's 4 MiB).
* Once a crowd's appends have all returned, with no fault meanwhile, every replica of its
  journal is at the same write head (`replica-heads`).

The canonical content of a journal is what a read through a broker returned after the run,
completed by what replicas and stores held that the read did not reach. An
operator's `reset-head` (after every replica of a journal was lost, which the seed allows to lose
unpersisted bytes) starts a new epoch: acknowledged bytes past its offset from before it are
counted as `lost_to_reset`, not as lost, and earlier observations of those offsets are not
compared with later ones.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from message.framing import FrameReader, JSONLines
from message.publisher import Reader
from message.sequencer import Envelope, Sequencer
from message.types import DictMessages
from tests.faults.history import (
    CHECKED,
    FAIL,
    INFO,
    OK,
    PROBE,
    TAKEOVER,
    AppendOp,
    History,
    ResetHead,
    SpoolsRenewed,
)

# More envelopes than a run writes: commits never need a replay from the journal.
_RING = 1 << 18
# Violations of one kind and journal listed in full before the rest are only counted.
_LISTED = 5
# Seconds within which a broker learns that a client left (its call cancelled, its deadline
# passed), when no broker is paused or cut off: an append whose commit was sent later than this
# after a client left reached a broker that knew it.
LEAVE_MARGIN = 1.0
# Faults that may keep a broker from learning in time that a client left: a paused broker
# (a proxy, or the primary) reads both later, in any order; a partition delays the cancel.
_DELAYING = ("SIGSTOP", "partition")


@dataclass(frozen=True)
class Violation:
    kind: str
    journal: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.journal}: {self.detail}"


@dataclass
class Report:
    scenario: str
    seed: int
    cycles: int
    acked_appends: int = 0
    acked_messages: int = 0
    lost: int = 0
    lost_to_reset: int = 0  # Acknowledged, then lost with every replica (allowed; reset-head).
    duplicated: int = 0
    conflicts: int = 0
    longest_unavailability: float = 0.0
    # Bytes some replica or store held that the final read through a broker did not return.
    unreadable: int = 0
    # Holes left where every replica was lost: (journal, offset where content resumes).
    holes: list[tuple[str, int]] = field(default_factory=list)
    unavailable_journal: str = ""
    # Copies of records whose client gave up on an attempt, in the journal apart from an
    # acknowledgement of them: allowed if the attempt was proposed before its client left
    # (else a `left-committed` violation as well).
    left_landed: int = 0
    violations: list[Violation] = field(default_factory=list)
    _counted: Counter[tuple[str, str]] = field(default_factory=Counter, repr=False)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, kind: str, journal: str, detail: str) -> None:
        """Record a violation (the first few of each kind and journal in full)."""
        self._counted[(kind, journal)] += 1
        n = self._counted[(kind, journal)]
        if n <= _LISTED:
            self.violations.append(Violation(kind, journal, detail))
        elif n == _LISTED + 1:
            self.violations.append(Violation(kind, journal, "(more of this kind not listed)"))

    def count(self, kind: str) -> int:
        return sum(n for (k, _), n in self._counted.items() if k == kind)

    def summary(self) -> str:
        lines = [
            f"{self.scenario} (seed {self.seed}): {self.cycles} cycles, "
            f"{self.acked_appends} acknowledged appends, {self.acked_messages} acknowledged "
            f"messages, {self.lost} lost, {self.duplicated} duplicated, {self.conflicts} "
            f"conflicting offsets, longest unavailability {self.longest_unavailability:.1f}s"
            + (f" ({self.unavailable_journal})" if self.unavailable_journal else "")
            + (f", {self.lost_to_reset} lost with every replica" if self.lost_to_reset else "")
            + (f", {self.unreadable} bytes unreadable through brokers" if self.unreadable else "")
            + (f", holes (content resumes at) {self.holes}" if self.holes else "")
            + (
                f", {self.left_landed} appends given up on in the journal"
                if self.left_landed
                else ""
            )
        ]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        return "\n".join(lines)


class Tape:
    """A journal's bytes by offset, as far as known; `put` reports where new bytes disagree
    with what the tape already holds."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._known = bytearray()

    def __len__(self) -> int:
        return len(self._data)

    def put(self, offset: int, content: bytes) -> list[tuple[int, int]]:
        """Write `content` at `offset` where unknown; the [begin, end) ranges where the tape
        already held other bytes (left as they were)."""
        stop = offset + len(content)
        if stop > len(self._data):
            grow = stop - len(self._data)
            self._data.extend(bytes(grow))
            self._known.extend(bytes(grow))
        mask = self._known[offset:stop]
        unknown = mask.count(0)
        if unknown == len(content):
            self._data[offset:stop] = content
            self._known[offset:stop] = b"\x01" * len(content)
            return []
        if unknown == 0 and self._data[offset:stop] == content:
            return []
        conflicts: list[tuple[int, int]] = []
        for i, byte in enumerate(content):
            at = offset + i
            if not self._known[at]:
                self._data[at] = byte
                self._known[at] = 1
            elif self._data[at] != byte:
                if conflicts and conflicts[-1][1] == at:
                    conflicts[-1] = (conflicts[-1][0], at + 1)
                else:
                    conflicts.append((at, at + 1))
        return conflicts

    def compare(self, offset: int, content: bytes) -> tuple[list[tuple[int, int]], int]:
        """Without writing: the ranges where the tape holds other bytes than `content`, and how
        many of its bytes the tape does not know."""
        stop = offset + len(content)
        known = self._known[offset:stop] + bytes(max(0, stop - max(offset, len(self._data))))
        unknown = known.count(0)
        if unknown == 0 and self._data[offset:stop] == content:
            return [], 0
        conflicts: list[tuple[int, int]] = []
        for i, byte in enumerate(content):
            at = offset + i
            if known[i] and self._data[at] != byte:
                if conflicts and conflicts[-1][1] == at:
                    conflicts[-1] = (conflicts[-1][0], at + 1)
                else:
                    conflicts.append((at, at + 1))
        return conflicts, unknown

    def get(self, begin: int, end: int) -> bytes | None:
        """The bytes of [begin, end) if all are known."""
        if end > len(self._data) or self._known[begin:end].count(0):
            return None
        return bytes(self._data[begin:end])

    def holds_any(self, begin: int, end: int) -> bool:
        return bool(self._known[begin:end].count(1))

    def segments(self) -> Iterator[tuple[int, bytes]]:
        """The runs of known bytes, in offset order."""
        at = 0
        while True:
            begin = self._known.find(1, at)
            if begin < 0:
                return
            end = self._known.find(0, begin)
            end = len(self._known) if end < 0 else end
            yield begin, bytes(self._data[begin:end])
            at = end


class CommittedReader:
    """Read-committed sequencing of one journal's content, fed in order as `read_committed`
    does; `feed` returns the committed messages (ACKs left out) each chunk completes."""

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.reader = Reader(DictMessages(), JSONLines())
        self.frames = FrameReader(JSONLines())
        self.sequencer = Sequencer(ring_size=_RING)

    def feed(self, offset: int, content: bytes) -> list[Envelope]:
        out: list[Envelope] = []
        envelopes = self.reader.envelopes(self.journal, self.frames.feed(offset, content))
        for envelope in envelopes:
            self.sequencer.queue_uncommitted(envelope)
            if self.sequencer.replay_range() is not None:
                raise AssertionError("a commit needs a replay: raise the ring size")
            while (committed := self.sequencer.step()) is not None:
                if not committed.is_ack:
                    out.append(committed)
        return out

    @property
    def errors(self) -> list[Any]:
        return self.reader.errors


def message_id(envelope: Envelope) -> str:
    message = envelope.message
    return str(message.get("id", "")) if isinstance(message, dict) else ""


class _Epochs:
    """A journal's reset-heads (which earlier offsets a later reset re-assigned) and the
    moments every replica's spool was lost (`lossy` renewals: what no store held yet went with
    them, as the seed allows, whether or not the brokers then asked for a reset-head)."""

    def __init__(self, resets: Iterable[ResetHead], renewals: Iterable[SpoolsRenewed]) -> None:
        self.resets = sorted(resets, key=lambda r: r.at)
        self.renewals = sorted(renewals, key=lambda r: r.at)

    def lost_with_every_replica(self, at: float) -> bool:
        """Whether something acknowledged at `at` may since have gone with every replica."""
        return self.limit(at) is not None or any(r.lossy and r.at > at for r in self.renewals)

    def discontinuous(self) -> bool:
        """Whether readers may have read across a reset or a loss of every replica."""
        return bool(self.resets) or any(r.lossy for r in self.renewals)

    def limit(self, at: float) -> int | None:
        """Offsets at or past this were re-assigned by a reset after time `at` (None: none)."""
        later = [r.offset for r in self.resets if r.at > at]
        return min(later) if later else None

    def clip(self, offset: int, content: bytes, at: float) -> bytes:
        """The part of an observation made at `at` that belongs to the final epoch."""
        limit = self.limit(at)
        if limit is None:
            return content
        return content[: max(0, limit - offset)]

    def boundaries(self) -> set[int]:
        """Offsets from which registers may have started empty again."""
        return {r.offset for r in self.resets} | {r.offset for r in self.renewals}


def check(history: History) -> Report:
    report = Report(history.scenario, history.seed, history.cycles)
    epochs = {
        journal: _Epochs(
            (r for r in history.resets if r.journal == journal),
            (r for r in history.spools_renewed if r.journal == journal),
        )
        for journal in history.raw_journals + history.message_journals
    }
    canonical = _canonical(history, report)
    for journal in history.raw_journals:
        _check_raw_journal(history, journal, canonical[journal], epochs[journal], report)
    for journal in history.message_journals:
        _check_acks_do_not_overlap(history, journal, epochs[journal], report)
    _check_reads(history, canonical, epochs, report)
    _check_messages(history, canonical, epochs, report)
    _check_recovered(history, report)
    _check_oversized(history, report)
    _check_replica_heads(history, report)
    _measure_unavailability(history, report)
    report.conflicts = report.count("conflict")
    return report


def _canonical(history: History, report: Report) -> dict[str, Tape]:
    """Each journal's content after the run: what a read through a broker returned, and what
    replicas and stores hold that the read did not reach (a fragment only a surviving replica
    holds until it persists it). Where any two of them disagree is a conflict."""
    tapes = {j: Tape() for j in history.raw_journals + history.message_journals}
    read = {j: Tape() for j in tapes}
    ordered = sorted(history.observations, key=lambda o: o.source != "read")
    for obs in ordered:
        if obs.journal not in tapes:
            continue
        if obs.source == "read":
            read[obs.journal].put(obs.offset, obs.content)
        for begin, end in tapes[obs.journal].put(obs.offset, obs.content):
            report.add(
                "conflict",
                obs.journal,
                f"{obs.source} holds other bytes than the journal at [{begin}, {end}): "
                f"{_excerpt(obs.content, begin - obs.offset)}",
            )
    for journal, tape in tapes.items():
        for begin, content in tape.segments():
            _, unread = read[journal].compare(begin, content)
            report.unreadable += unread
    return tapes


def _excerpt(content: bytes, at: int) -> str:
    return repr(content[max(0, at - 20) : at + 40])


def _records(
    tape: Tape, journal: str, epochs: _Epochs, report: Report
) -> Iterator[tuple[int, bytes]]:
    """The journal's records (each ending in a newline) with their offsets; a hole (unless
    every replica was lost, taking unpersisted fragments with it) or a torn record is a
    violation."""
    for begin, content in tape.segments():
        if begin != 0:
            if epochs.discontinuous():
                report.holes.append((journal, begin))
            else:
                report.add("gap", journal, f"the journal holds nothing before offset {begin}")
        at = begin
        for line in content.split(b"\n")[:-1]:
            yield at, line + b"\n"
            at += len(line) + 1
        if at != begin + len(content):
            report.add(
                "unexpected",
                journal,
                f"a torn record at [{at}, {begin + len(content)}): {content[at - begin :][:60]!r}",
            )


def _check_raw_journal(
    history: History, journal: str, tape: Tape, epochs: _Epochs, report: Report
) -> None:
    ops = [op for op in history.appends if op.journal == journal]
    # A record is one client's: its attempts are its append and, once its client left, the
    # same record written again (through AppendService).
    attempts: dict[bytes, list[AppendOp]] = defaultdict(list)
    for op in ops:
        if op.payload:
            attempts[op.payload].append(op)
    positions: dict[bytes, list[int]] = defaultdict(list)
    resets = sorted(epochs.boundaries())
    owner: str | None = None
    next_reset = 0
    for offset, record in _records(tape, journal, epochs, report):
        positions[record].append(offset)
        tries = attempts.get(record)
        while next_reset < len(resets) and offset >= resets[next_reset]:
            owner = None  # Registers went with every replica's spool.
            next_reset += 1
        if tries is None:
            report.add("unexpected", journal, f"no client appended {record[:60]!r} (at {offset})")
            continue
        op = tries[0]
        if all(t.outcome == FAIL for t in tries):
            report.add(
                "refused-present",
                journal,
                f"{op.kind} append {record[:60]!r} by {op.client} failed ({op.error}) but is "
                f"at {offset}",
            )
        if journal == history.register_journal:
            if op.kind == TAKEOVER:
                owner = op.client
            elif op.kind == CHECKED and owner not in (None, op.client):
                report.add(
                    "register",
                    journal,
                    f"{op.client}'s append checked owner={op.client} was applied at {offset} "
                    f"while the registers said owner={owner}",
                )

    for record, where in positions.items():
        tries = attempts.get(record, [])
        acked_at = {t.begin for t in tries if t.outcome == OK}
        # Each attempt accounts for one copy at most: an acknowledged one for the copy at its
        # offsets, one in doubt for a copy anywhere, a refused one for none.
        allowed = max(1, len(acked_at & set(where)) + sum(t.outcome == INFO for t in tries))
        if len(where) > allowed:
            report.duplicated += len(where) - allowed
            report.add("duplicated", journal, f"{record[:60]!r} is at offsets {where}")
        if any(t.left >= 0 and t.outcome != OK for t in tries):
            report.left_landed += sum(w not in acked_at for w in where)

    for op in ops:
        if op.outcome != OK or not op.payload:
            continue
        report.acked_appends += 1
        if op.end - op.begin != len(op.payload):
            report.add(
                "ack-span",
                journal,
                f"{op.client}'s {len(op.payload)}-byte append was acknowledged as "
                f"[{op.begin}, {op.end})",
            )
        if op.begin in positions.get(op.payload, []):
            continue
        limit = epochs.limit(op.completed)
        renewed = any(r.lossy and r.at > op.completed for r in epochs.renewals)
        if (limit is not None and op.end > limit) or renewed:
            report.lost_to_reset += 1
            continue
        report.lost += 1
        found = positions.get(op.payload)
        report.add(
            "lost" if not found else "misplaced",
            journal,
            f"{op.client}'s append {op.payload[:50]!r} acknowledged at [{op.begin}, {op.end}) "
            f"at {op.completed:.3f}s "
            + (f"is at {found} instead" if found else "is not in the journal")
            + f"; the journal holds {_excerpt(tape.get(op.begin, min(op.end, len(tape))) or b'', 0)} there",
        )
    _check_acks_do_not_overlap(history, journal, epochs, report)
    if not epochs.discontinuous():
        _check_left(history, ops, attempts, positions, report)


def _delayed(history: History, begin: float, end: float) -> bool:
    """Whether a fault that may delay a broker's news of a client leaving overlapped
    [begin, end]."""
    return any(
        f.kind in _DELAYING and f.begin <= end and (f.end < 0 or f.end >= begin)
        for f in history.faults
    )


def _check_left(
    history: History,
    ops: list[AppendOp],
    attempts: dict[bytes, list[AppendOp]],
    positions: dict[bytes, list[int]],
    report: Report,
) -> None:
    """`left-committed`: a copy of a record whose only attempt in doubt is one its client gave
    up on (so the copy is that attempt's), found after an append whose commit was sent
    LEAVE_MARGIN past the leaving: offsets are given in the order of proposals, so that attempt
    was proposed after a broker knew its client had gone."""
    acks = sorted(
        (op for op in ops if op.outcome == OK and op.end > op.begin), key=lambda op: op.end
    )
    for record, where in positions.items():
        tries = attempts.get(record, [])
        doubtful = [t for t in tries if t.outcome == INFO]
        if len(doubtful) != 1 or doubtful[0].left < 0:
            continue
        gone = doubtful[0]
        acked_at = {t.begin for t in tries if t.outcome == OK}
        for at in where:
            if at in acked_at:
                continue
            for ack in acks:
                if ack.end > at:
                    break
                sent = ack.commit_sent_at
                if sent >= gone.left + LEAVE_MARGIN and not _delayed(history, gone.left, sent):
                    report.add(
                        "left-committed",
                        gone.journal,
                        f"{gone.client}'s append ({gone.error or 'given up'} at "
                        f"{gone.left:.3f}s) is at {at}, after {ack.client}'s {ack.kind} append "
                        f"at [{ack.begin}, {ack.end}) whose commit was sent at {sent:.3f}s",
                    )
                    break


def _check_acks_do_not_overlap(
    history: History, journal: str, epochs: _Epochs, report: Report
) -> None:
    ops = [
        op
        for op in history.appends
        if op.journal == journal and op.outcome == OK and op.end > op.begin
        if (limit := epochs.limit(op.completed)) is None or op.end <= limit
    ]
    spans = sorted(((op.begin, op.end, op) for op in ops), key=lambda s: (s[0], s[1]))
    for (b1, e1, op1), (b2, e2, op2) in itertools.pairwise(spans):
        if b2 < e1:
            report.add(
                "ack-overlap",
                journal,
                f"[{b1}, {e1}) ({op1.client}) and [{b2}, {e2}) ({op2.client}) were both "
                "acknowledged",
            )


def _check_reads(
    history: History, canonical: dict[str, Tape], epochs: dict[str, _Epochs], report: Report
) -> None:
    last: dict[tuple[str, str], int] = {}
    for chunk in history.reads:
        if chunk.journal not in canonical or not chunk.content:
            continue
        tape = canonical[chunk.journal]
        key = (chunk.reader, chunk.journal)
        previous = last.get(key, 0)  # Readers start at offset 0.
        if chunk.offset < previous:
            report.add(
                "non-monotonic",
                chunk.journal,
                f"{chunk.reader} read [{chunk.offset}, {chunk.offset + len(chunk.content)}) "
                f"at {chunk.at:.3f}s after reading through {previous}",
            )
        elif chunk.offset > previous:
            limit = epochs[chunk.journal].limit(chunk.at)
            stop = chunk.offset if limit is None else min(chunk.offset, limit)
            if tape.holds_any(previous, stop):
                report.add(
                    "skipped",
                    chunk.journal,
                    f"{chunk.reader} jumped from {previous} to {chunk.offset} at {chunk.at:.3f}s "
                    "over bytes the journal holds",
                )
        last[key] = max(previous, chunk.offset + len(chunk.content))
        content = epochs[chunk.journal].clip(chunk.offset, chunk.content, chunk.at)
        conflicts, unknown = tape.compare(chunk.offset, content)
        for begin, end in conflicts:
            report.add(
                "uncommitted-read",
                chunk.journal,
                f"{chunk.reader} read other bytes than the journal holds at [{begin}, {end}) "
                f"at {chunk.at:.3f}s: {_excerpt(chunk.content, begin - chunk.offset)}",
            )
            report.add(
                "conflict", chunk.journal, f"{chunk.reader} and the journal at [{begin}, {end})"
            )
        if unknown:
            report.add(
                "uncommitted-read",
                chunk.journal,
                f"{chunk.reader} read {unknown} bytes in [{chunk.offset}, "
                f"{chunk.offset + len(content)}) at {chunk.at:.3f}s that the journal does not "
                f"hold: {chunk.content[:60]!r}",
            )


def _check_messages(
    history: History, canonical: dict[str, Tape], epochs: dict[str, _Epochs], report: Report
) -> None:
    final: dict[str, set[str]] = {}
    for journal in history.message_journals:
        reader = CommittedReader(journal)
        delivered: Counter[str] = Counter()
        for offset, content in canonical[journal].segments():
            for envelope in reader.feed(offset, content):
                delivered[message_id(envelope)] += 1
        for error in reader.errors:
            report.add("unexpected", journal, f"an undecodable message: {error}")
        for mid, n in delivered.items():
            if n > 1:
                report.duplicated += n - 1
                report.add("rc-duplicate", journal, f"reading committed delivers {mid} {n} times")
        final[journal] = set(delivered)

    streams: dict[str, Counter[str]] = defaultdict(Counter)
    for d in history.deliveries:
        streams[d.stream][d.id] += 1
        vanished = d.journal in final and d.id not in final[d.journal]
        # A stream that read across a reset-head (it began at 0, before any reset) carries
        # the old epoch's pending messages into the new one, where later ACKs commit them.
        if vanished and not epochs[d.journal].discontinuous():
            report.add(
                "rc-vanished",
                d.journal,
                f"{d.stream} delivered {d.id} (at {d.offset}, {d.at:.3f}s), which the "
                "journal does not hold committed",
            )
    for stream, counts in streams.items():
        for mid, n in counts.items():
            if n > 1:
                report.duplicated += n - 1
                report.add("rc-duplicate", stream, f"{stream} delivered {mid} {n} times")

    txns = {t.id: t for t in history.txns}
    everything = set().union(*final.values()) if final else set()
    for p in history.publishes:
        txn = txns.get(p.txn) if p.txn else None
        if txn is not None and txn.outcome == "aborted":
            # A message written before a reset-head may sit in the old epoch while the abort's
            # ACK is lost with every replica or lands in the new one: the producer's next
            # commit then commits it for a reader that read across the reset.
            forgiven = epochs[p.journal].lost_with_every_replica(p.invoked)
            seen = p.id in everything or any(p.id in c for c in streams.values())
            if seen and not forgiven:
                report.add("rc-aborted", p.journal, f"{p.id} of aborted {p.txn} was delivered")
            continue
        acked = (p.outcome == OK and not p.txn) or (txn is not None and txn.outcome == "committed")
        if not acked:
            continue
        report.acked_messages += 1
        if p.id in final.get(p.journal, set()):
            continue
        if epochs[p.journal].lost_with_every_replica(txn.completed if txn else p.completed):
            report.lost_to_reset += 1
            continue
        report.lost += 1
        report.add(
            "lost",
            p.journal,
            f"message {p.id} "
            + (f"of committed {p.txn} " if p.txn else "")
            + "was acknowledged but is not delivered by reading committed",
        )


def _check_recovered(history: History, report: Report) -> None:
    for journal in history.raw_journals + history.message_journals:
        probes = [
            op
            for op in history.appends
            if op.journal == journal and op.kind == PROBE and op.invoked >= history.healed
        ]
        if not any(op.outcome == OK for op in probes):
            errors = sorted({op.error for op in probes}) or ["no probe was made"]
            report.add(
                "unavailable-after-heal",
                journal,
                f"no append succeeded once the faults healed: {', '.join(errors)}",
            )


def _check_oversized(history: History, report: Report) -> None:
    failed = [(op.journal, op.client, op.error) for op in history.appends]
    failed += [(p.journal, p.id, p.error) for p in history.publishes]
    for journal, client, error in failed:
        if "larger than max" in error:
            report.add(
                "oversized",
                journal,
                f"{client}'s append failed on a message a broker built too large: {error}",
            )


def _check_replica_heads(history: History, report: Report) -> None:
    for sample in history.head_samples:
        if len(set(sample.heads.values())) <= 1:
            continue
        if any(
            f.begin <= sample.at and (f.end < 0 or f.end >= sample.since) for f in history.faults
        ):
            continue  # An append in doubt may leave replicas apart until the next one.
        report.add(
            "replica-heads",
            sample.journal,
            f"every append since {sample.since:.3f}s returned, no fault meanwhile, and at "
            f"{sample.at:.3f}s the replicas' write heads differ: {sample.heads}",
        )


def _measure_unavailability(history: History, report: Report) -> None:
    """The longest time a journal could not take appends while clients were appending to it
    (faults and recovery included: reported, not asserted): for raw journals, the longest
    stretch without an acknowledged append; for message journals, the longest a published
    message waited for its batch to be acknowledged (or for its publisher to give up)."""
    for journal in history.raw_journals:
        if journal in history.round_journals:
            continue  # Appended to in rounds, with pauses between them.
        times = sorted(
            op.completed
            for op in history.appends
            if op.journal == journal and op.outcome == OK and op.payload
            if history.workload_began <= op.completed <= history.workload_ended
        )
        points = [history.workload_began, *times, history.workload_ended]
        gap = max((b - a for a, b in itertools.pairwise(points)), default=0.0)
        if gap > report.longest_unavailability:
            report.longest_unavailability = gap
            report.unavailable_journal = journal
    for p in history.publishes:
        wait = min(p.completed, history.workload_ended) - p.invoked
        if p.journal in history.message_journals and wait > report.longest_unavailability:
            report.longest_unavailability = wait
            report.unavailable_journal = p.journal
