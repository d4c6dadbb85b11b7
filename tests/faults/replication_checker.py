"""The replication campaign's history and its checker: given what the emitters were told and
what every location's log holds after healing, it finds every way the run broke the replication
network's promises (the seed's system model, docs/reliability.md "Replication networks under
faults").

* Causal order (`order`): at each location, if two stored events' vector timestamps are ordered
  (ts(e1) < ts(e2)) then e1 is stored first: each log is a linear extension of causality,
  restricted to what its inbound filters admit.
* No event is stored twice at a location (`duplicate`, by its id: emitter and emitter time); no
  emitter time is used by two different events (`reused-time`: two payloads stored under one id
  anywhere, or an acknowledged id that stores another payload).
* Completeness after healing (`missing`): every acknowledged event, and every event stored
  anywhere (acknowledged or not), is stored at every location whose inbound paths admit it. The
  only exemption is the seed's: events acknowledged at a location shortly before its log was
  lost in a disaster, that no other location had received, are gone with it (`lost_to_disaster`,
  counted apart, and checked to be gone everywhere).
* Nothing stored that no emitter emitted, or whose emit was refused (`unexpected`,
  `refused-present`).
* Nothing stored that the location's inbound filters drop (`not-admitted`).
* Views (`views`): every location holds the same topology history, etcd's (the authoritative
  one, when collected), and `gazctl replication topology --check` agreed.
* Operator commands (`refused-changed`, `forbidden-accepted`): a command gazctl refused moved
  etcd's topology head not at all (the scenario runs one command at a time), and a command the
  rules forbid on the whole history was refused, its change in no view.
* Deletions (`gazctl replication delete X --through N`; the scenario records what X held through
  N before, X's deletion state after, and each neighbour's CVV before and after): one refused
  for certain changed nothing (`refused-changed`: X's deleted_through moved, or an event it held
  through N is gone at the end); one accepted obeyed the rule (`delete-rule`: X's DVV after it
  is not <= the CVV a neighbour reported after it, which was then no larger), took effect
  (`delete-unapplied`) and for good (`deleted-back`: a deleted event stored at X again); one
  whose outcome is unknown (gazctl SIGKILLed, X unreachable) took effect whole or not at all
  (`delete-partial`); one the neighbours' CVVs before it allowed was not refused by the rule
  (`allowed-refused`). The events an accepted (or unknown) deletion removed are no longer
  required at X; every other location that admits them must still hold them, and X everything
  else (`missing`).
* Availability after healing (`unavailable-after-heal`): each location acknowledged an emit once
  the faults healed.

Why an exact yet fast order check works: for e1 emitted by Y, ts(e1) < ts(e2) implies
ts(e1)[Y] <= ts(e2)[Y]. So for each stored e2 and each emitter Y, the candidates are Y's events
with time <= ts(e2)[Y] stored after e2; each candidate is then compared by its whole vector.
Every true violation is a candidate, and a candidate counts only if the vectors say so.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

OK, FAIL, INFO = "ok", "fail", "info"
_LISTED = 5  # Violations of one kind and location listed in full; the rest only counted.
# Events acknowledged at a location this long before its journal was deleted may be lost with
# it (no other location had read them yet); anything older must have been replicated.
DISASTER_WINDOW = 5.0

EventId = tuple[str, int]


@dataclass
class Emit:
    """One Emit call: `event` is the id the location acknowledged (ok), else empty."""

    location: str
    uid: str  # The payload's unique `id`.
    kind: str  # red / blue (the terminal's filter admits red).
    invoked: float = 0.0
    completed: float = 0.0
    outcome: str = INFO
    emitter: str = ""
    time: int = 0
    error: str = ""


@dataclass
class Disaster:
    location: str
    deleted: float  # When its journal was deleted (history time).
    recovered: float = -1.0


@dataclass
class ReplicationHistory:
    scenario: str
    seed: int
    locations: list[str] = field(default_factory=list)
    # Location -> the payload `kind` values its inbound paths admit from other emitters (absent:
    # every event). System events and its own events are always admitted.
    admits: dict[str, list[str]] = field(default_factory=dict)
    cycles: int = 0
    emits: list[Emit] = field(default_factory=list)
    disasters: list[Disaster] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    healed: float = -1.0
    # Location -> its stored events in storage order: {"seq", "emitter", "ts", "payload"}.
    logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Location -> its topology history as Status reports it (keyed changes).
    views: dict[str, list[Any]] = field(default_factory=dict)
    topology_check: dict[str, Any] = field(default_factory=dict)  # {"code", "out"}
    # etcd's topology history as keyed changes (as Status reports a view), when collected.
    etcd_history: list[Any] = field(default_factory=list)
    # Operator commands: {"args", "code", "out", "forbidden": the change the rules forbid (or
    # None), "head_before", "head_after": etcd's last op around it, "killed": SIGKILLed,
    # "delete": for a deletion, its plan and what followed (None otherwise): {"location",
    # "through", "mode", "neighbours", "before": {"deleted_through", "dvv"}, "dvv": the DVV it
    # leaves, "cvv_before": {neighbour: CVV or None}, "events": X's stored events through
    # "through" (as `logs` holds them), "after": {"deleted_through", "dvv"} or None,
    # "cvv_after": {neighbour: CVV or None}}}.
    commands: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: float = field(default=0.0, repr=False)

    def now(self) -> float:
        import time

        if not self.started:
            self.started = time.monotonic()
        return round(time.monotonic() - self.started, 3)

    def note(self, text: str) -> None:
        self.notes.append(f"{self.now():8.3f} {text}")

    def save(self, path: Path) -> None:
        document = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "started"}
        document["emits"] = [asdict(e) for e in self.emits]
        document["disasters"] = [asdict(d) for d in self.disasters]
        path.write_text(json.dumps(document))

    @classmethod
    def load(cls, path: Path) -> ReplicationHistory:
        document = json.loads(path.read_text())
        document["emits"] = [Emit(**e) for e in document["emits"]]
        document["disasters"] = [Disaster(**d) for d in document["disasters"]]
        return cls(**document)


@dataclass(frozen=True)
class Violation:
    kind: str
    location: str
    detail: str


@dataclass
class Report:
    scenario: str
    seed: int
    cycles: int
    acked: int = 0
    indeterminate: int = 0
    events_checked: int = 0
    duplicates: int = 0
    reused_times: int = 0
    order_violations: int = 0
    missing: int = 0
    lost_to_disaster: int = 0
    reused_after_loss: int = 0  # A time of an event the disaster lost, used again (allowed).
    longest_unavailability: float = 0.0
    unavailable_location: str = ""
    violations: list[Violation] = field(default_factory=list)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.counts

    @property
    def violation_count(self) -> int:
        return sum(self.counts.values())

    def add(self, kind: str, location: str, detail: str) -> None:
        self.counts[(kind, location)] += 1
        n = self.counts[(kind, location)]
        if n <= _LISTED:
            self.violations.append(Violation(kind, location, detail))
        elif n == _LISTED + 1:
            self.violations.append(Violation(kind, location, "(more of this kind not listed)"))

    def count(self, kind: str) -> int:
        return sum(n for (k, _), n in self.counts.items() if k == kind)

    def summary(self) -> str:
        lines = [
            f"{self.scenario} (seed {self.seed}): {self.cycles} cycles, {self.acked} acknowledged "
            f"emits ({self.indeterminate} indeterminate), {self.events_checked} stored events "
            f"checked, {self.duplicates} duplicated, {self.reused_times} reused times, "
            f"{self.order_violations} out of causal order, {self.missing} missing, "
            f"{self.lost_to_disaster} lost to a disaster (allowed), longest unavailability "
            f"{self.longest_unavailability:.1f}s ({self.unavailable_location or '-'})"
        ]
        if self.ok:
            lines.append("OK: no violations")
        else:
            lines.append(f"{self.violation_count} VIOLATIONS:")
            lines += [f"  [{v.kind}] {v.location}: {v.detail}" for v in self.violations]
        return "\n".join(lines)


def _eid(event: dict[str, Any]) -> EventId:
    emitter = str(event["emitter"])
    return emitter, int(event["ts"][emitter])


def _system(event: dict[str, Any]) -> bool:
    payload = event.get("payload")
    return isinstance(payload, dict) and "system" in payload


def _payload_text(event: dict[str, Any]) -> str:
    return json.dumps(event.get("payload"), sort_keys=True)


def admitted(history: ReplicationHistory, location: str, event: dict[str, Any]) -> bool:
    """Whether `location`'s inbound paths admit `event` (system and own events always do)."""
    kinds = history.admits.get(location)
    if kinds is None or _system(event) or event["emitter"] == location:
        return True
    return event.get("payload", {}).get("kind") in kinds


def _less(a: dict[str, int], b: dict[str, int]) -> bool:
    """a < b as vector times (missing entries are 0)."""
    keys = a.keys() | b.keys()
    return all(a.get(k, 0) <= b.get(k, 0) for k in keys) and a != {k: v for k, v in b.items() if v}


def check_order(location: str, log: list[dict[str, Any]], report: Report) -> None:
    """At `location`, no event stored after one it causally precedes (see the module)."""
    by_emitter: dict[str, list[tuple[int, int]]] = defaultdict(list)  # emitter -> (time, pos)
    for pos, event in enumerate(log):
        emitter, time = _eid(event)
        by_emitter[emitter].append((time, pos))
    index: dict[str, tuple[list[int], list[int]]] = {}
    for emitter, entries in by_emitter.items():
        entries.sort()
        times = [t for t, _ in entries]
        prefix_max, best = [], -1
        for _, pos in entries:
            best = max(best, pos)
            prefix_max.append(best)
        index[emitter] = (times, prefix_max)
    for pos, event in enumerate(log):
        ts = {k: int(v) for k, v in event["ts"].items()}
        for emitter, bound in ts.items():
            if emitter not in index:
                continue
            times, prefix_max = index[emitter]
            upto = bisect.bisect_right(times, bound)
            if not upto or prefix_max[upto - 1] <= pos:
                continue
            for time, later in by_emitter[emitter][:upto]:
                if later <= pos:
                    continue
                other = log[later]
                if _less({k: int(v) for k, v in other["ts"].items()}, ts):
                    report.order_violations += 1
                    report.add(
                        "order", location,
                        f"{emitter}:{time} {other['ts']} (seq {other.get('seq')}) stored after "
                        f"{_eid(event)[0]}:{_eid(event)[1]} {event['ts']} (seq {event.get('seq')}),"
                        " which it causally precedes",
                    )  # fmt: skip


def check(history: ReplicationHistory) -> Report:
    report = Report(history.scenario, history.seed, history.cycles)
    emits = history.emits
    report.acked = sum(e.outcome == OK for e in emits)
    report.indeterminate = sum(e.outcome == INFO for e in emits)
    by_uid = {e.uid: e for e in emits}
    logs = history.logs

    # What is stored where, and under which payload.
    stored_at: dict[EventId, set[str]] = defaultdict(set)
    payloads: dict[EventId, set[str]] = defaultdict(set)
    events: dict[EventId, dict[str, Any]] = {}
    for location, log in logs.items():
        report.events_checked += len(log)
        counts = Counter(_eid(e) for e in log)
        for eid, n in counts.items():
            if n > 1:
                report.duplicates += n - 1
                report.add("duplicate", location, f"{eid[0]}:{eid[1]} stored {n} times")
        for event in log:
            eid = _eid(event)
            stored_at[eid].add(location)
            payloads[eid].add(_payload_text(event))
            events.setdefault(eid, event)
            if _system(event):
                continue
            if not admitted(history, location, event):
                report.add("not-admitted", location, f"{eid[0]}:{eid[1]} {event['payload']}: its filters drop it")  # fmt: skip
            uid = event.get("payload", {}).get("id")
            emit = by_uid.get(uid) if isinstance(uid, str) else None
            if emit is None:
                report.add("unexpected", location, f"{eid[0]}:{eid[1]} {event['payload']}: no emitter emitted it")  # fmt: skip
            elif emit.outcome == FAIL:
                report.add("refused-present", location, f"{eid[0]}:{eid[1]} {uid}: its emit was refused ({emit.error})")  # fmt: skip
            elif emit.location != eid[0]:
                report.add("unexpected", location, f"{uid} emitted at {emit.location} is stored as {eid[0]}'s")  # fmt: skip
        check_order(location, log, report)
    for eid, texts in payloads.items():
        if len(texts) > 1:
            report.reused_times += len(texts) - 1
            report.add("reused-time", eid[0], f"{eid[0]}:{eid[1]} stored with {len(texts)} payloads: {sorted(texts)[:2]}")  # fmt: skip

    # Acknowledged ids: each stores its own payload, and no two acknowledgements share one.
    exempt: set[EventId] = set()
    acked_ids: dict[EventId, list[Emit]] = defaultdict(list)
    for emit in emits:
        if emit.outcome == OK:
            acked_ids[(emit.emitter, emit.time)].append(emit)
    for eid, acks in acked_ids.items():
        lost = [a for a in acks if not _stored_as(events, eid, a.uid) and _lost_to_disaster(history, a)]  # fmt: skip
        if len(acks) > 1:
            if len(acks) - len(lost) <= 1 and lost:
                report.reused_after_loss += len(acks) - 1
            else:
                report.reused_times += len(acks) - 1
                report.add("reused-time", eid[0], f"{eid[0]}:{eid[1]} acknowledged for {[a.uid for a in acks]}")  # fmt: skip
        for ack in acks:
            if ack in lost:
                report.lost_to_disaster += 1
                exempt.add(eid)
                continue
            if eid in events and not _stored_as(events, eid, ack.uid):
                report.reused_times += 1
                report.add("reused-time", eid[0], f"{eid[0]}:{eid[1]} acknowledged for {ack.uid} stores {events[eid].get('payload')}")  # fmt: skip

    # Deletions: what each location held and deleted is still required everywhere else.
    deleted = _check_deletions(history, report)
    for d in _deletions(history):
        for event in d["events"]:
            events.setdefault(_eid(event), event)

    # Completeness: every acknowledged event and every event stored anywhere (or deleted where
    # it was stored), at every location that admits it but the ones that deleted it.
    for location, log in logs.items():
        have = {_eid(e) for e in log}
        required: dict[EventId, str] = {}
        for eid, event in events.items():
            if eid in deleted.get(location, ()):
                continue
            if admitted(history, location, event):
                required[eid] = f"stored at {sorted(stored_at[eid])}" if eid in stored_at else "deleted where it was stored"  # fmt: skip
        for eid, acks in acked_ids.items():
            if eid in exempt or eid in events or eid in deleted.get(location, ()):
                continue
            ack = acks[0]
            probe = {"emitter": ack.emitter, "ts": {ack.emitter: ack.time}, "payload": {"kind": ack.kind}}  # fmt: skip
            if admitted(history, location, probe):
                required[eid] = f"acknowledged ({ack.uid}) at {ack.completed:.3f}s, stored nowhere"
        for eid, why in sorted(required.items()):
            if eid not in have:
                report.missing += 1
                report.add("missing", location, f"{eid[0]}:{eid[1]} ({why})")

    _check_views(history, report)
    _check_commands(history, report)
    _availability(history, report)
    return report


def _stored_as(events: dict[EventId, dict[str, Any]], eid: EventId, uid: str) -> bool:
    event = events.get(eid)
    return event is not None and event.get("payload", {}).get("id") == uid


def _lost_to_disaster(history: ReplicationHistory, emit: Emit) -> bool:
    """An event the seed allows to be lost: emitted at a location before a disaster deleted
    its log, and acknowledged shortly before it (or as it happened: the reply of an append that
    committed just before the deletion can arrive after it), nobody else having read it."""
    return any(
        d.location == emit.location
        and emit.invoked <= d.deleted
        and d.deleted - DISASTER_WINDOW <= emit.completed
        for d in history.disasters
    )


def _deletions(history: ReplicationHistory) -> list[dict[str, Any]]:
    """The deletion commands' records, each with its args, code and out merged in."""
    return [
        c["delete"] | {"args": c["args"], "code": c["code"], "out": c.get("out", "")}
        for c in history.commands
        if c.get("delete")
    ]


def delete_outcome(d: dict[str, Any]) -> str:
    """ "ok" (gazctl said deleted), "refused" (it said no, for certain: the location answered
    with a refusal, or gazctl found it not running and asked nothing), or "unknown" (gazctl
    SIGKILLed, or the location itself unreachable: the deletion may have been done)."""
    if d["code"] == 0:
        return "ok"
    if d["code"] != 1:
        return "unknown"
    out, x = str(d["out"]), d["location"]
    mine = f"location {x} is unreachable ("
    if mine in out:
        # The location answered UNAVAILABLE because a neighbour is unreachable: its own words
        # follow its name (`location Y is unreachable (...)`, Y another), a refusal.
        said = out.split(mine, 1)[1].split("): ", 1)[-1]
        return "refused" if said.startswith("location ") and not said.startswith(f"location {x} ") else "unknown"  # fmt: skip
    if "is stopping in this process" in out:
        return "unknown"
    return "refused"


def _vector_le(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(int(v) <= int(b.get(k, 0)) for k, v in a.items())


def _check_deletions(history: ReplicationHistory, report: Report) -> dict[str, set[EventId]]:
    """The deletion rules (see the module); per location, the events it deleted (accepted
    deletions, and ones of unknown outcome: whole or not at all, as checked)."""
    final = {n: {_eid(e) for e in log} for n, log in history.logs.items()}
    records = _deletions(history)
    deleted: dict[str, set[EventId]] = defaultdict(set)
    for d in records:
        if delete_outcome(d) != "refused":
            deleted[d["location"]] |= {_eid(e) for e in d["events"]}
    for d in records:
        x, through, args = d["location"], int(d["through"]), " ".join(d["args"])
        outcome = delete_outcome(d)
        ids = [_eid(e) for e in d["events"]]
        after = d.get("after")
        have = final.get(x)
        if outcome == "refused":
            if after is not None and after["deleted_through"] != d["before"]["deleted_through"]:
                report.add("refused-changed", x, f"`{args}` was refused ({_line(d['out'])}), yet {x}'s deleted_through moved from {d['before']['deleted_through']} to {after['deleted_through']}")  # fmt: skip
            gone = [] if have is None else [i for i in ids if i not in have and i not in deleted[x]]
            if gone:
                report.add("refused-changed", x, f"`{args}` was refused ({_line(d['out'])}), yet {len(gone)} of the {len(ids)} events {x} held through {through} are gone: {_ids(gone)}")  # fmt: skip
            if "may not delete through" in str(d["out"]):
                allowed = [y for y, c in d.get("cvv_before", {}).items() if c is not None and _vector_le(d["dvv"], c)]  # fmt: skip
                named = [y for y in allowed if f"CVV-{y} " in str(d["out"])]
                if named:
                    report.add("allowed-refused", x, f"`{args}` was refused by the rule against {named[0]}, whose CVV {d['cvv_before'][named[0]]} covered the DVV {d['dvv']} before it: {_line(d['out'])}")  # fmt: skip
            continue
        back = [] if have is None else [i for i in ids if i in have]
        if outcome == "ok":
            if after is not None and int(after["deleted_through"]) < through:
                report.add("delete-unapplied", x, f"`{args}` was accepted, yet {x}'s deleted_through is {after['deleted_through']} after it")  # fmt: skip
            if back:
                report.add("deleted-back", x, f"`{args}` was accepted, yet {len(back)} of the events it deleted are stored at {x} at the end: {_ids(back)}")  # fmt: skip
            dvv = after["dvv"] if after is not None else d["dvv"]
            for y, cvv in sorted(d.get("cvv_after", {}).items()):
                if cvv is not None and not _vector_le(dvv, cvv):
                    report.add("delete-rule", x, f"`{args}` was accepted with DVV-{x} {dvv}, not <= CVV-{y} {cvv} as {y} reported after it (CVVs only grow)")  # fmt: skip
        else:
            # Whole or not at all, but for what another deletion there took (one through a
            # lower N, if this one was not done).
            others = set().union(*({_eid(e) for e in o["events"]} for o in records if o is not d and o["location"] == x and delete_outcome(o) != "refused"))  # fmt: skip
            mine = [i for i in ids if i not in others]
            kept = [] if have is None else [i for i in mine if i in have]
            if kept and len(kept) < len(mine):
                report.add("delete-partial", x, f"`{args}` ({_line(d['out']) or 'gazctl SIGKILLed'}): {len(kept)} of the {len(mine)} events {x} held through {through} are stored there at the end, the others not: {_ids(kept)}")  # fmt: skip
    return deleted


def _line(out: Any) -> str:
    lines = [line for line in str(out).splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _ids(ids: list[EventId]) -> str:
    shown = ", ".join(f"{e}:{t}" for e, t in ids[:3])
    return shown + (f" (+{len(ids) - 3})" if len(ids) > 3 else "")


def _check_views(history: ReplicationHistory, report: Report) -> None:
    views = {n: sorted(json.dumps(c, sort_keys=True) for c in v) for n, v in history.views.items()}
    every = set().union(*map(set, views.values())) if views else set()
    for name, view in sorted(views.items()):
        lacking = every - set(view)
        if lacking:
            report.add("views", name, f"lacks {len(lacking)} of {len(every)} topology changes: {sorted(lacking)[:2]}")  # fmt: skip
    for name in history.locations:
        if name not in history.views:
            report.add("views", name, "no view collected (its process did not answer)")
    if history.etcd_history:
        # A view as Status reports it carries no `--new-events-only` fields (the Location
        # service's Change message has none): etcd's changes are compared without them.
        unreported = ("new_events_only", "floor")
        etcd = {json.dumps({k: v for k, v in c.items() if k not in unreported}, sort_keys=True) for c in history.etcd_history}  # fmt: skip
        for name, view in sorted(views.items()):
            lacking, extra = etcd - set(view), set(view) - etcd
            if lacking or extra:
                report.add("views", name, f"differs from etcd's history: lacks {sorted(lacking)[:2]}, holds besides {sorted(extra)[:2]}")  # fmt: skip
    check = history.topology_check
    if check and check.get("code") != 0:
        report.add("views", "*", f"topology --check exited {check.get('code')}: {str(check.get('out', ''))[-300:]}")  # fmt: skip


def _check_commands(history: ReplicationHistory, report: Report) -> None:
    """A refused command changed nothing; a forbidden one was refused and is nowhere."""
    recorded = [*history.etcd_history, *(c for v in history.views.values() for c in v)]
    for command in history.commands:
        args = " ".join(command["args"])
        refused = command["code"] == 1 and "is connected, but" not in command.get("out", "")
        if refused and command["head_before"] != command["head_after"]:
            report.add("refused-changed", "*", f"`{args}` was refused, yet etcd's topology head moved from op {command['head_before']} to {command['head_after']}")  # fmt: skip
        forbidden = command.get("forbidden")
        if forbidden is None:
            continue
        # A gazctl SIGKILLed mid-command has no answer: only a record of its change, below,
        # shows it was accepted.
        if command["code"] != 1 and not command.get("killed"):
            report.add("forbidden-accepted", "*", f"`{args}` exited {command['code']}: the rules forbid it")  # fmt: skip
        for change in recorded:
            if all(change.get(k) == v for k, v in forbidden.items()):
                report.add("forbidden-accepted", "*", f"`{args}`'s change is recorded: {change}")  # fmt: skip
                break


def _availability(history: ReplicationHistory, report: Report) -> None:
    """Longest stretch without an acknowledged emit while the location's emitter kept trying
    (reported, not asserted); and an acknowledged emit at every location after healing."""
    for location in history.locations:
        mine = sorted((e for e in history.emits if e.location == location), key=lambda e: e.invoked)  # fmt: skip
        if not mine:
            continue
        last_ok = mine[0].invoked
        for emit in mine:
            if emit.outcome == OK:
                gap = emit.completed - last_ok
                if gap > report.longest_unavailability:
                    report.longest_unavailability, report.unavailable_location = gap, location
                last_ok = emit.completed
        if history.healed >= 0 and not any(
            e.outcome == OK and e.invoked >= history.healed for e in mine
        ):
            report.add("unavailable-after-heal", location, "no emit acknowledged after healing")
