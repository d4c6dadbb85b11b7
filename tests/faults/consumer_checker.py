"""The consumer campaign's history and its checker.

The history records every chunk the workload published (stream, sequence number, value, and
whether the brokers acknowledged it), every sum the summers committed as read back read-committed
from the sums journal after the run (with the shard, the store's fence or restore time of the
instance that published it, and its place in commit order), each shard's replica statuses once
the faults healed, and the FAILED statuses met while healing. The checker judges it afterwards
(and hand-made histories test the checker itself, `tests/test_consumer_fault_checker.py`):

* `wrong-sum`: a stream whose every chunk was acknowledged has a sum other than theirs, or counts
  another number of chunks: a chunk applied twice, or skipped;
* `duplicate-sum`: a stream summed twice (committed twice: a zombie's transaction, or one applied
  again after a recovery);
* `missing-sum`: a stream whose every chunk was acknowledged has no sum once the faults healed;
* `unexpected-sum`: a sum of a stream never completed (or never published);
* `zombie-commit`: a shard's committed sums go back to an earlier instance of its store (a lower
  fence, or an earlier restore): a commit of an instance accepted after its successor's;
* `failed-shard`: a shard FAILED after healing, or while healing, unless its status says why and
  the fault was its own (a fault of its store that the scenario names: `own_faults`); a shard
  FAILED for an etcd error is never excused (etcd's faults are no shard's own: a replica waits
  out etcd's restart);
* `out-of-sequence`: a summer's log says a chunk came out of sequence (its shard failed for it).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

OK, FAIL, INFO = "ok", "fail", "info"

# What a replica's error says when etcd failed it (aetcd's errors for a refused or timed-out
# call, or etcd named): never a shard's own fault.
ETCD_ERRORS = ("ConnectionFailedError", "ConnectionTimeoutError", "etcd")


@dataclass
class ChunkOp:
    """A chunk published committed (`ok`: its append acknowledged, at `offset` of `journal`)."""

    stream: str
    seq: int
    value: int
    last: bool
    journal: str = ""
    invoked: float = 0.0
    completed: float = -1.0
    outcome: str = INFO
    offset: int = -1
    error: str = ""


@dataclass
class SumRead:
    """A committed sum as read back (`position`: its place in the sums journal's commit order)."""

    stream: str
    sum: int
    chunks: int
    shard: str
    fence: int | None
    restored: float
    pid: int
    offset: int
    position: int


@dataclass
class ShardStatus:
    """One replica's status (`code`: PRIMARY, STANDBY, FAILED, ...), as a consumer listed it."""

    shard: str
    consumer: str
    code: str
    errors: list[str]
    at: float


@dataclass
class FaultRecord:
    kind: str
    target: str
    begin: float
    end: float = -1.0
    detail: str = ""


_LISTS: dict[str, type[Any]] = {
    "chunks": ChunkOp,
    "sums": SumRead,
    "statuses": ShardStatus,
    "failures": ShardStatus,
    "faults": FaultRecord,
}


@dataclass
class ConsumerHistory:
    scenario: str = ""
    seed: int = 0
    store: str = ""
    cycles: int = 0
    healed: float = 0.0
    own_faults: list[str] = field(default_factory=list)  # Fault kinds that are the shards' own.
    chunks: list[ChunkOp] = field(default_factory=list)
    sums: list[SumRead] = field(default_factory=list)
    statuses: list[ShardStatus] = field(default_factory=list)  # After healing.
    failures: list[ShardStatus] = field(default_factory=list)  # FAILED, seen while healing.
    faults: list[FaultRecord] = field(default_factory=list)
    log_problems: list[str] = field(default_factory=list)  # Summers' log lines to judge.
    evidence: dict[str, int] = field(default_factory=dict)  # Faults at work, from the logs.
    notes: list[str] = field(default_factory=list)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def note(self, text: str) -> None:
        self.notes.append(f"{self.now():8.3f} {text}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            out[f.name] = [asdict(v) for v in value] if f.name in _LISTS else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConsumerHistory:
        history = cls()
        for f in fields(cls):
            if f.name.startswith("_") or f.name not in data:
                continue
            value = data[f.name]
            if f.name in _LISTS:
                value = [_LISTS[f.name](**v) for v in value]
            setattr(history, f.name, value)
        return history

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> ConsumerHistory:
        return cls.from_json(json.loads(path.read_text()))


@dataclass
class Violation:
    kind: str
    detail: str


@dataclass
class Report:
    scenario: str = ""
    seed: int = 0
    store: str = ""
    cycles: int = 0
    chunks: int = 0  # Acknowledged.
    indeterminate: int = 0  # Chunks whose append was not known to be acknowledged.
    streams: int = 0  # Completed streams whose every chunk was acknowledged.
    sums: int = 0  # Committed sums read back.
    exact: int = 0
    failed_excused: int = 0  # FAILED replicas whose own fault explains them.
    evidence: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def count(self, kind: str) -> int:
        return sum(1 for v in self.violations if v.kind == kind)

    def summary(self) -> str:
        head = (
            f"{self.scenario} (seed {self.seed}, {self.store}): {self.cycles} cycles, "
            f"{self.chunks} chunks acknowledged ({self.indeterminate} in doubt), {self.streams} "
            f"streams, {self.sums} sums read back, {self.exact} exact, "
            f"{len(self.violations)} violations"
        )
        if self.evidence:
            head += (
                " (logs: " + ", ".join(f"{k} {v}" for k, v in sorted(self.evidence.items())) + ")"
            )
        lines = [head]
        kinds: dict[str, int] = {}
        for v in self.violations:
            kinds[v.kind] = kinds.get(v.kind, 0) + 1
            if kinds[v.kind] <= 5:
                lines.append(f"  {v.kind}: {v.detail}")
        for kind, n in kinds.items():
            if n > 5:
                lines.append(f"  ... {n - 5} more {kind}")
        return "\n".join(lines)


def _order_key(s: SumRead) -> tuple[int, float]:
    # A fence orders instances of the stores that fence; the restore time those that do not
    # (the recorded SQLite store: its recovery log fences it, and each take-over is later).
    return (s.fence if s.fence is not None else -1, s.restored)


def check(history: ConsumerHistory) -> Report:
    report = Report(history.scenario, history.seed, history.store, history.cycles)
    report.evidence = dict(history.evidence)
    out = report.violations
    by_stream: dict[str, list[ChunkOp]] = {}
    for chunk in history.chunks:
        by_stream.setdefault(chunk.stream, []).append(chunk)
        if chunk.outcome == OK:
            report.chunks += 1
        else:
            report.indeterminate += 1
    sums: dict[str, list[SumRead]] = {}
    for s in history.sums:
        sums.setdefault(s.stream, []).append(s)
    report.sums = len(history.sums)

    for stream, chunks in sorted(by_stream.items()):
        completed = any(c.last for c in chunks)
        certain = completed and all(c.outcome == OK for c in chunks)
        got = sums.get(stream, [])
        if len(got) > 1:
            where = ", ".join(
                f"{s.sum} by {s.shard} (fence {s.fence}, pid {s.pid}) at {s.offset}" for s in got
            )
            out.append(Violation("duplicate-sum", f"stream {stream} summed {len(got)} times: {where}"))  # fmt: skip
        if not completed:
            if got:
                out.append(Violation("unexpected-sum", f"stream {stream} was never completed, yet summed {got[0].sum}"))  # fmt: skip
            continue
        if not certain:
            continue  # A chunk in doubt: its sum may or may not count it.
        report.streams += 1
        expected = sum(c.value for c in chunks)
        if not got:
            last = max(c.completed for c in chunks)
            out.append(Violation("missing-sum", f"stream {stream} ({len(chunks)} chunks, the last acknowledged at {last:.3f}) has no sum"))  # fmt: skip
            continue
        first = got[0]
        if first.sum != expected or first.chunks != len(chunks):
            out.append(
                Violation(
                    "wrong-sum",
                    f"stream {stream}: sum {first.sum} of {first.chunks} chunks by {first.shard}, "
                    f"expected {expected} of {len(chunks)}",
                )
            )
        else:
            report.exact += 1
    for stream in sorted(set(sums) - set(by_stream)):
        out.append(Violation("unexpected-sum", f"stream {stream} was never published, yet summed {sums[stream][0].sum}"))  # fmt: skip

    by_shard: dict[str, list[SumRead]] = {}
    for s in sorted(history.sums, key=lambda s: s.position):
        by_shard.setdefault(s.shard, []).append(s)
    for shard, committed in sorted(by_shard.items()):
        newest = committed[0]
        for s in committed[1:]:
            if _order_key(s) < _order_key(newest):
                out.append(
                    Violation(
                        "zombie-commit",
                        f"shard {shard}: stream {s.stream}'s sum (fence {s.fence}, restored "
                        f"{s.restored:.3f}, pid {s.pid}) committed at {s.offset}, after a sum of "
                        f"a later instance (fence {newest.fence}, restored {newest.restored:.3f}, "
                        f"pid {newest.pid}) at {newest.offset}",
                    )
                )
            elif _order_key(s) > _order_key(newest):
                newest = s
    own = set(history.own_faults)
    own_struck = any(f.kind in own for f in history.faults)
    for status in [*history.failures, *history.statuses]:
        if status.code != "FAILED":
            continue
        reason = "; ".join(status.errors)
        for_etcd = any(words in reason for words in ETCD_ERRORS)
        if own_struck and reason and not for_etcd:
            report.failed_excused += 1
            continue
        why = f"its status says {reason!r}" if reason else "its status says nothing"
        if for_etcd:
            why += ", an etcd error (no shard's own fault)"
        when = "while the faults healed" if status in history.failures else "after healing"
        own_note = (
            f" (its own faults in this scenario: {sorted(own)})"
            if own
            else " (no fault here was its own)"
        )
        out.append(
            Violation(
                "failed-shard",
                f"shard {status.shard} FAILED on {status.consumer} {when} at {status.at:.3f}: "
                f"{why}{own_note}",
            )
        )
    for line in history.log_problems:
        out.append(Violation("out-of-sequence", line))
    return report
