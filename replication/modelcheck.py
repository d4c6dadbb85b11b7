"""A bounded exhaustive check of the replication rules and the causality filter.

    python -m replication.modelcheck                      # 4 locations, 2 events, 1 filter,
                                                          #   2 changes: some 2.5 CPU-minutes
    python -m replication.modelcheck --locations 3 --events 2 --filters 1 --changes 1
    python -m replication.modelcheck --without guard      # show what the guard prevents

The space grows fast: the issue's suggested bound (4 locations, 3 events, 2 filters, 3 changes)
runs, but not in minutes (4 locations, 3 events, 1 filter and 1 change was stopped unfinished
after 15 minutes on this machine, busy at the time); the default is a 4-location bound that fits
in a few minutes.

The hand-written anomaly tests show each rule of the seed on one history, and the property tests
sample histories at random; neither says that no interleaving up to some size breaks a promise.
This explores every one, breadth first, with a visited set of canonical states, using the real
model (`replication.model`, `replication.topology`) as the system under test: a bug found here
is a bug in that code or in the rules, not in a re-implementation of them.

Operations, in every order, up to the bound:

* an emit at any location (at most `events` in all), of kind `one` or `two`, so that filters on
  `kind` matter;
* one replication step over any connection of the current topology: `read_batch` of one event
  from the target's progress, then `write_batch` with the connection's filter and the group write
  guard (`Topology.guard_for`, as the location process applies it), unless the start rule holds
  the connection back (events the source deleted that the target's CVV lacks, as the process
  waits); and the same step with a crash between the write and the progress (the seed's separate
  transactions), so that the retry replays what the causality filter must then drop;
* a topology change (at most `changes`): connect (unfiltered, or with one of `filters` filters),
  disconnect, a filter change, and with `--fail-over` a fail-over of a filtered connection; each
  judged by the topology's rules (a refused change is no transition, only counted);
* with `--deletions N`, a physical deletion through any position of a log, judged by the rule
  DVV ≤ CVV-i of directly connected locations.

Replication steps that only move a progress on (the next event is in the target's causal past,
or a filter that can no longer change drops it) are taken at once after every step, which cuts
the states several times over without losing an interleaving (`Checker.settle` says why;
`--no-reduction` explores without it, and the tests compare the two).

The start state is a network given by `--topology`: `ring` (the default: every location but the
last on an unfiltered ring, the last a terminal location whose inbound connection from the ring
is filtered and whose outbound one is not), `ring-in` (the terminal location only receives),
`cycle` (every location on one unfiltered ring), or `empty`.

Checked in every state: each log is a linear extension of causality (the seed's storage order),
holds no event twice, and no two events share an id (emitter, time); each CVV is the least upper
bound of what its log holds and deleted; an event stored away from its emitter came along
connections whose filters (some filter each ever carried) let its kind through; and no event is
lost to the causality filter: an event that a location had (stored, or deleted after storing),
over a connection of the current topology whose every filter so far lets it through, is never in
the target's causal past without having been stored there (the anomaly of every appendix
example: once in the CVV, the causality filter drops it for good). Every topology the rules
accept passes `Topology.validate()`, and folding its keyed changes in every order of the changes
explored (before or after the start network's) gives the same view (`state()`, and the filters
every connection ever carried, which the rule of identical filters reads).

Checked in every quiescent state (no replication step changes anything; every state reaches one
through explored steps, since replication steps are never bounded): over every connection not
held back by the start rule, every event of the source's log whose kind every filter the
connection carried lets through has arrived, unless the connection is guarded and the target's
group is not strongly connected by current unfiltered connections (then the guard waits, by
design, for events the group cannot pass round); and locations strongly connected by current,
never-filtered connections not held back hold the same events. A connection the start rule holds
back at rest is a violation if its source deleted events while it was current (the deletion rule
promised its target had them), or if every deleted event it waits for is one its filter excludes
(it would wait for good for events it never gets).

Not covered: disaster recovery (loss of a log, metadata and event recovery), retirement, joining
for new events, each location's own view of the topology (one global view here: a change takes
effect everywhere at once, where real locations learn of it by replication), batches of more than
one event (a batch is a run of one-event steps with nothing in between, which the interleavings
include), and the journal-backed logs (`tests/test_replication_random.py` runs the rules there).
States are hashed to 64 bits for the visited sets: a collision would merge two states and could
hide one; at a million states the chance is below one in ten million.

What it showed (docs/reliability.md has the figures): no violation with the rules in place at
the bounds run. Left out one at a time, the topology rules, the group write guard and the start
rule each let an event be lost to the causality filter within five steps. The deletion rule,
left out alone, loses no event: the start rule, as the location process applies it (to any
connection whose progress is behind the source's deletions, not only to new ones), holds the
neighbour back instead, for good; so the deletion rule is what keeps the neighbour live, and
the cyclic-deletion loss appears only with both left out. Fail-over's cached-CVV rule, left out,
shows nothing at these bounds: the terminal location that fails over only receives (a location
that also sends would close a cycle through its filtered link, which the topology refuses), so
what it stores never flows back; this model does not show the rule necessary.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from replication.filters import parse_filter
from replication.model import (
    Event,
    EventFilter,
    LocationModel,
    Stored,
    check_fail_over,
    check_may_start,
    read_batch,
    write_batch,
)
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    RuleViolation,
    Topology,
)
from replication.vclock import VectorClock, lub

__all__ = ["Bound", "Checker", "Report", "Rules", "Violation", "main"]

NAMES = "ABCDEFGH"
KINDS = ("one", "two")
# Filters in the order `--filters N` takes them: the first drops `one`, the second `two`, the
# third lets both through (a filter all the same, for the rules).
FILTERS = ("kind=two", "kind=one", "kind in (one, two)")
TOPOLOGIES = ("ring", "ring-in", "cycle", "empty")
RULES = ("topology", "guard", "start", "deletion", "fail-over")

EventKey = tuple[str, VectorClock, str]  # Emitter, timestamp, kind: the event itself.
Connection = tuple[str, str]


@dataclass(frozen=True)
class Bound:
    """How far the exploration goes."""

    locations: int = 4
    events: int = 2
    filters: int = 1
    changes: int = 2
    deletions: int = 0
    fail_over: bool = False
    crashes: bool = True
    topology: str = "ring"

    def __str__(self) -> str:
        extra = " with fail-over" if self.fail_over else ""
        extra += "" if self.crashes else " without crashes"
        return (
            f"{self.locations} locations, {self.events} events, {self.filters} filters, "
            f"{self.changes} changes, {self.deletions} deletions, topology {self.topology}{extra}"
        )


@dataclass(frozen=True)
class Rules:
    """Which rules the checker applies: each can be left out, to show that the checker then
    finds the anomaly the rule exists for (a checker that finds nothing with a rule removed
    proves nothing about it)."""

    topology: bool = True  # check_connect / check_filter / check_fail_over on the history.
    guard: bool = True  # The group write guard of connections into a group from outside.
    start: bool = True  # A connection behind the source's deletions waits for DVV <= CVV.
    deletion: bool = True  # Deletion only if DVV <= CVV-i of directly connected locations.
    fail_over: bool = True  # Fail-over only if the cached CVV-previous <= CVV-candidate.

    @staticmethod
    def without(*names: str) -> Rules:
        unknown = set(names) - set(RULES)
        if unknown:
            raise ValueError(f"no rule {', '.join(sorted(unknown))}: the rules are {RULES}")
        return Rules(**{n.replace("-", "_"): False for n in names})


class Place(NamedTuple):
    """A location's state, canonical: what the visited set hashes, and what a `LocationModel` is
    rebuilt from."""

    log: tuple[tuple[int, EventKey], ...]
    cvv: VectorClock
    dvv: VectorClock
    next_seq: int
    deleted_through: int
    local_time: int
    progress: tuple[int, ...]  # Per source, in name order (0: none recorded).
    cached: tuple[tuple[str, VectorClock], ...]  # Only with fail-over: nothing else reads it.


class State(NamedTuple):
    places: tuple[Place, ...]
    history: tuple[Change, ...]  # The topology's changes, in command order.
    deleted: tuple[frozenset[EventKey], ...]  # What each location deleted (the checker's own).
    deletions: int
    # Connections whose source deleted events while they were current: the deletion rule
    # promised their targets had them (or their causal successors) by then.
    owed: frozenset[Connection]


Label = tuple[object, ...]


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str
    trace: tuple[str, ...]

    def __str__(self) -> str:
        steps = "\n".join(f"  {i}. {step}" for i, step in enumerate(self.trace, 1))
        return f"{self.kind}: {self.message}\n{steps or '  (the start state)'}"


@dataclass
class Report:
    bound: Bound
    rules: Rules
    states: int = 0
    transitions: int = 0
    max_depth: int = 0
    quiescent: int = 0
    refused: int = 0
    held: int = 0  # Replication steps the start rule held back.
    histories: int = 0
    orders: int = 0  # Orders of keyed changes folded to check the view's convergence.
    violation_states: int = 0
    violations: list[Violation] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: float = 0.0  # Seconds of this process's CPU: the figure to compare on a busy machine.
    complete: bool = True

    def lines(self) -> list[str]:
        off = [n for n in RULES if not getattr(self.rules, n.replace("-", "_"))]
        return [
            f"bound: {self.bound}" + (f" (rules left out: {', '.join(off)})" if off else ""),
            f"states explored: {self.states}" + ("" if self.complete else " (stopped early)"),
            f"transitions: {self.transitions}",
            f"max depth: {self.max_depth}",
            f"quiescent states: {self.quiescent}",
            f"refused by the rules: {self.refused}",
            f"held by the start rule: {self.held}",
            f"topology histories: {self.histories} ({self.orders} orders folded)",
            f"elapsed: {self.elapsed:.1f} s ({self.cpu:.1f} s of CPU)",
            f"violations: {self.violation_states}",
        ]


def _event_text(key: EventKey) -> str:
    emitter, stamp, kind = key
    return f"{emitter}{stamp[emitter]}:{kind}{stamp}"


def _change_text(change: Change) -> str:
    if isinstance(change, Connected):
        return f"connect {change.source}->{change.target} {change.filter!r}"
    if isinstance(change, Disconnected):
        return f"disconnect {change.source}->{change.target}"
    if isinstance(change, Filtered):
        return f"filter {change.source}->{change.target} {change.filter!r}"
    if isinstance(change, FailedOver):
        return (
            f"fail over {change.previous}->{change.target} to {change.source}->{change.target} "
            f"{change.filter!r}"
        )
    return str(change)


def _label_text(label: Label) -> str:
    op = label[0]
    if op == "then":
        _, first, done = label
        then = "; ".join(_label_text(step) for step in done)  # type: ignore[attr-defined]
        return f"{_label_text(first)} (then {then})"  # type: ignore[arg-type]
    if op == "emit":
        return f"{label[1]} emits {_event_text(label[2])}"  # type: ignore[arg-type]
    if op in ("replicate", "crash"):
        _, source, target, outcome, key = label
        what = "" if key is None else " " + _event_text(key)  # type: ignore[arg-type]
        crash = ", then crashes before recording the progress" if op == "crash" else ""
        return f"{source}->{target}: {outcome}{what}{crash}"
    if op == "delete":
        _, where, through, keys = label
        gone = ", ".join(_event_text(k) for k in keys)  # type: ignore[attr-defined]
        return f"{where} deletes through seq {through} ({gone})"
    if op == "change":
        return _change_text(label[1])  # type: ignore[arg-type]
    return repr(label)


class _View:
    """What the checker derives from one topology history, once: many states share it."""

    def __init__(self, checker: Checker, history: tuple[Change, ...]) -> None:
        self.history = history
        self.topology = Topology.of(history)
        self.current = dict(sorted(self.topology.current.items()))
        self.guard = {c: tuple(sorted(self.topology.guard_for(*c))) for c in self.current}
        names = checker.names
        self.neighbours = {
            x: tuple(sorted({t if s == x else s for s, t in self.current if x in (s, t)} - {x}))
            for x in names
        }
        # Every filter each connection ever carried, kept by the checker from the history
        # itself (the view forgets a connection that failed over; the events it carried stay).
        carried: dict[Connection, set[str]] = collections.defaultdict(set)
        for change in history:
            if isinstance(change, (Connected, Filtered, FailedOver)):
                carried[(change.source, change.target)].add(change.filter)
        self.carried = dict(carried)
        self.expected = {
            c: frozenset(k for k in KINDS if all(checker.passes(f, k) for f in fs))
            for c, fs in carried.items()
        }
        self.never_filtered = frozenset(c for c in self.current if carried[c] == {""})
        # Where an event of each kind may have come from: pairs (a, b) joined by a path of
        # connections each of which some filter it carried let that kind through.
        self.reach: dict[str, frozenset[Connection]] = {}
        for kind in KINDS:
            hops = [c for c, fs in carried.items() if any(checker.passes(f, kind) for f in fs)]
            self.reach[kind] = frozenset(_closure(names, hops))
        self._changes: list[tuple[Change, str | None]] | None = None

    def changes(self, checker: Checker) -> list[tuple[Change, str | None]]:
        """Every change the operations may make next, each with the rules' refusal (None if
        accepted)."""
        if self._changes is not None:
            return self._changes
        out: list[tuple[Change, str | None]] = []
        choices = ("", *checker.filters)
        for s, t in itertools.permutations(checker.names, 2):
            if (s, t) not in self.current:
                for f in choices:
                    out.append((Connected(s, t, f), self._judge(checker, "connect", s, t, f)))
                continue
            out.append((Disconnected(s, t), None))
            for f in choices:
                if f != self.current[(s, t)]:
                    out.append((Filtered(s, t, f), self._judge(checker, "filter", s, t, f)))
        if checker.bound.fail_over:
            for (previous, t), f in self.current.items():
                for s in checker.names:
                    if f and s not in (previous, t) and (s, t) not in self.current:
                        refusal = None
                        if checker.rules.topology:
                            try:
                                self.topology.check_fail_over(previous, s, t, f)
                            except RuleViolation as exc:
                                refusal = str(exc)
                        out.append((FailedOver(previous, s, t, f), refusal))
        self._changes = out
        return out

    def _judge(self, checker: Checker, what: str, s: str, t: str, f: str) -> str | None:
        if not checker.rules.topology:
            return None
        try:
            if what == "connect":
                self.topology.check_connect(s, t, f)
            else:
                self.topology.check_filter(s, t, f)
        except RuleViolation as exc:
            return str(exc)
        return None


def _covers(cvv: VectorClock, source: Place, seq: int) -> bool:
    """Whether `cvv` covers the source's DVV and every event of its log through `seq`."""
    return source.dvv.merge(*(k[1] for q, k in source.log if q <= seq)) <= cvv


def _at_rest(state: State) -> object:
    return (
        tuple((p.log, p.cvv, p.dvv, p.deleted_through) for p in state.places),
        state.history,
        state.deleted,
    )


def _touched(label: Label) -> frozenset[str] | None:
    """The one location a step changed (an emit, a write), or None (a change of topology or a
    deletion can make steps possible anywhere)."""
    if label[0] == "emit":
        return frozenset({str(label[1])})
    if label[0] in ("replicate", "crash"):
        return frozenset({str(label[2])})
    return None


def _closure(names: Sequence[str], hops: Iterable[Connection]) -> set[Connection]:
    out: dict[str, set[str]] = {n: set() for n in names}
    for a, b in hops:
        out[a].add(b)
    for _ in names:  # Few locations: repeat until nothing grows.
        for a in names:
            for b in list(out[a]):
                out[a] |= out[b]
    return {(a, b) for a in names for b in out[a]}


class Checker:
    """Breadth first over every interleaving up to the bound; the shortest trace to each
    violation is kept (breadth first finds the shortest first)."""

    def __init__(
        self,
        bound: Bound = Bound(),
        rules: Rules = Rules(),
        *,
        keep: int = 5,
        stop_at_first: bool = False,
        max_states: int | None = None,
        reduce: bool = True,
        collect: bool = False,
    ) -> None:
        if not 2 <= bound.locations <= len(NAMES):
            raise ValueError(f"--locations: 2 to {len(NAMES)}")
        if not 0 <= bound.filters <= len(FILTERS):
            raise ValueError(f"--filters: 0 to {len(FILTERS)}")
        if bound.topology not in TOPOLOGIES:
            raise ValueError(f"--topology: one of {', '.join(TOPOLOGIES)}")
        self.bound, self.rules = bound, rules
        self.keep, self.stop_at_first, self.max_states = keep, stop_at_first, max_states
        self.reduce = reduce
        # With `collect`: every quiescent state, less its progress (which the reduction moves
        # on sooner): the same set with and without the reduction, if it loses nothing.
        self.at_rest: set[object] | None = set() if collect else None
        self.names = tuple(NAMES[: bound.locations])
        self.index = {n: i for i, n in enumerate(self.names)}
        self.filters = FILTERS[: bound.filters]
        self._events: dict[EventKey, Event] = {}
        self._keys: dict[int, EventKey] = {}
        self._stored: dict[tuple[int, EventKey], Stored] = {}
        self._parsed: dict[str, EventFilter | None] = {}
        self._passes: dict[tuple[str, str], bool] = {}
        self._views: dict[tuple[Change, ...], _View] = {}
        self.start_history = self._start_history()
        self.report = Report(bound, rules)
        self._parents: dict[int, tuple[int, Label | None]] = {}
        self._cpu = 0.0

    # ---- filters and events ------------------------------------------------------------------

    def parsed(self, text: str) -> EventFilter | None:
        """The connection's filter for `read_batch`: the parsed selector's verdict, memoized by
        kind (the only attribute the explored filters read; matching a selector is most of a
        step's cost otherwise)."""
        if text not in self._parsed:
            if parse_filter(text) is None:
                self._parsed[text] = None
            else:
                verdict = {k: self.passes(text, k) for k in KINDS}
                self._parsed[text] = lambda event: verdict[str(event.payload["kind"])]
        return self._parsed[text]

    def passes(self, text: str, kind: str) -> bool:
        if (text, kind) not in self._passes:
            keep = parse_filter(text)
            probe = Event("X", VectorClock(), {"kind": kind})
            self._passes[(text, kind)] = keep is None or keep(probe)
        return self._passes[(text, kind)]

    def _intern(self, event: Event) -> EventKey:
        """The key of `event`; the first event of each key is kept as the one every rebuilt
        log holds (so that its key is found by identity next time)."""
        key = self._keys.get(id(event))
        if key is not None:
            return key
        key = (event.emitter, event.timestamp, str(event.payload["kind"]))
        if key not in self._events:
            self._events[key] = event
            self._keys[id(event)] = key  # Kept alive in _events: its id stays its own.
        return key

    # ---- states ------------------------------------------------------------------------------

    def _start_history(self) -> tuple[Change, ...]:
        top = self.bound.topology
        if top == "empty":
            return ()
        ring = list(self.names) if top == "cycle" else list(self.names[:-1])
        pairs = list(zip(ring, ring[1:] + ring[:1], strict=True)) if len(ring) > 2 else []
        if len(ring) == 2:
            pairs = [(ring[0], ring[1])]
        out: list[Change] = []
        for a, b in pairs:
            out += [Connected(a, b), Connected(b, a)]
        if top != "cycle":
            tail = self.names[-1]
            out.append(Connected(ring[-1], tail, self.filters[0] if self.filters else ""))
            if top == "ring":
                out.append(Connected(tail, ring[-1]))
        return tuple(out)

    def start(self) -> State:
        places = tuple(self._freeze(LocationModel(n)) for n in self.names)
        empty = tuple(frozenset[EventKey]() for _ in self.names)
        return State(places, self.start_history, empty, 0, frozenset())

    def _freeze(self, loc: LocationModel) -> Place:
        return Place(
            tuple((s.seq, self._intern(s.event)) for s in loc.log),
            loc.cvv,
            loc.dvv,
            loc.next_seq,
            loc.deleted_through,
            loc.local_time,
            tuple(loc.progress.get(n, 0) for n in self.names),
            tuple(sorted(loc.cached_cvv.items())) if self.bound.fail_over else (),
        )

    def _thaw(self, state: State, i: int) -> LocationModel:
        place = state.places[i]
        log = []
        for entry in place.log:
            stored = self._stored.get(entry)
            if stored is None:
                stored = self._stored[entry] = Stored(entry[0], self._events[entry[1]])
            log.append(stored)
        return LocationModel(
            self.names[i], log, place.cvv, place.dvv, place.next_seq, place.deleted_through,
            place.local_time, {n: p for n, p in zip(self.names, place.progress, strict=True) if p},
            dict(place.cached),
        )  # fmt: skip

    def view(self, history: tuple[Change, ...]) -> _View:
        view = self._views.get(history)
        if view is None:
            view = self._views[history] = _View(self, history)
        return view

    @staticmethod
    def _with(state: State, i: int, place: Place) -> State:
        return state._replace(places=(*state.places[:i], place, *state.places[i + 1 :]))

    # ---- transitions -------------------------------------------------------------------------

    def settle(
        self, state: State, touched: frozenset[str] | None = None
    ) -> tuple[State, tuple[Label, ...]]:
        """`state` (settled but for the locations `touched`, or none) after every replication
        step that only moves a progress on: over a current
        connection not held back by the start rule, the next event of the source is in the
        target's causal past (the causality filter drops it), or, once no topology change is
        left to make, the connection's filter drops it.

        Why taking them at once loses no interleaving: such a step writes nothing, so no check
        sees it, and its outcome is fixed whatever happens first (the target's CVV only grows,
        a drop ignores the filter, and a filter that can no longer change drops the same
        events). Nothing reads the progress it moves but its own connection's steps, the start
        rule and fail-over. The start rule holds a connection back while its progress is behind
        the source's deletions and DVV-source is not <= CVV-target: moving the progress over
        the step changes that verdict only for a later deletion through the very event stepped
        over, and only if the source deleted what the target's CVV lacks; so while deletions
        are left, the step is taken at once only if DVV-source and the source's events up to
        it are all <= CVV-target (then the verdict is "go on" either way, for good). Fail-over
        reads the CVV the step caches, of the filtered connection it replaces: with fail-over,
        a filtered connection's steps wait until no change is left, and an unfiltered one's
        until one is (filtering it, then failing it over, takes two). The steps are still taken by the real code: if one wrote something after all,
        the checks would see it. `--no-reduction` takes every step on its own (a test compares
        the two on the anomalies).
        """
        if not self.reduce:
            return state, ()
        deleting = state.deletions < self.bound.deletions
        left = self.bound.changes - (len(state.history) - len(self.start_history))
        no_changes = left <= 0
        view = self.view(state.history)
        done: list[Label] = []
        for (s, t), f in view.current.items():
            if touched is not None and s not in touched and t not in touched:
                continue  # Settled before, and neither end has changed since.
            if self.bound.fail_over and left > (0 if f else 1):
                continue  # It may yet fail over: the CVV it caches must not move sooner.
            si, ti = self.index[s], self.index[t]
            while True:  # A step moves only this connection's progress: drain it alone.
                after = state.places[ti].progress[si]
                seq, following = next(
                    ((q, k) for q, k in state.places[si].log if q > after), (0, None)
                )
                if following is None:
                    break
                cvv = state.places[ti].cvv
                dropped = following[1] <= cvv
                if not (dropped or (no_changes and not self.passes(f, following[2]))):
                    break
                if deleting and not _covers(cvv, state.places[si], seq):
                    break  # A deletion through here could hold the connection back.
                source, target = self._thaw(state, si), self._thaw(state, ti)
                if self.rules.start and after < source.deleted_through:
                    try:
                        check_may_start(source, target)
                    except RuleViolation:
                        break
                batch = read_batch(source, target, self.parsed(f), limit=1)
                guard = view.guard[(s, t)] if self.rules.guard else ()
                write_batch(target, batch, cycle=guard)
                state = self._with(state, ti, self._freeze(target))
                outcome = "drops (in the target's causal past)" if dropped else "filters out"
                done.append(("replicate", s, t, outcome, following))
        return state, tuple(done)

    def successors(
        self, state: State, view: _View
    ) -> tuple[list[tuple[Label, State]], set[Connection], bool]:
        """Every next state (with the step's label; not settled yet), the connections the
        start rule holds back, and whether any replication step changes anything (if none
        does, the state is quiescent)."""
        out: list[tuple[Label, State]] = []
        held: set[Connection] = set()
        moved = False
        emitted = sum(p.local_time for p in state.places)
        if emitted < self.bound.events:
            for i, name in enumerate(self.names):
                for kind in KINDS:
                    loc = self._thaw(state, i)
                    key = self._intern(loc.emit({"kind": kind}))
                    out.append((("emit", name, key), self._with(state, i, self._freeze(loc))))
        for (s, t), f in view.current.items():
            si, ti = self.index[s], self.index[t]
            after = state.places[ti].progress[si]
            if (
                after >= state.places[si].deleted_through
                and all(q <= after for q, _ in state.places[si].log)
                and (
                    not self.bound.fail_over
                    or dict(state.places[ti].cached).get(s) == state.places[si].cvv
                )
            ):
                continue  # Nothing to read, nothing to cache: the step changes nothing.
            source, target = self._thaw(state, si), self._thaw(state, ti)
            if self.rules.start and after < source.deleted_through:
                try:
                    check_may_start(source, target)
                except RuleViolation:
                    held.add((s, t))
                    self.report.held += 1
                    continue
            batch = read_batch(source, target, self.parsed(f), limit=1)
            read = source.read(after, 1)
            head = self._intern(read[0].event) if read else None
            guard = view.guard[(s, t)] if self.rules.guard else ()
            written = write_batch(target, batch, cycle=guard)
            place = self._freeze(target)
            if place == state.places[ti]:
                continue
            moved = True
            if written:
                outcome = "writes"
            elif target.progress.get(s, 0) == after:
                outcome = f"holds back (guard {''.join(guard)})"  # Only the cached CVV moved.
            elif head is None:
                outcome = "reads past deleted events"
            elif not batch.events and head[1] <= state.places[ti].cvv:
                outcome = "drops (in the target's causal past)"
            elif not batch.events:
                outcome = "filters out"
            else:
                outcome = "drops (in the target's causal past)"
            out.append((("replicate", s, t, outcome, head), self._with(state, ti, place)))
            if self.bound.crashes and written:
                crashed = self._thaw(state, ti)
                crashed.write([w.event for w in written])  # The progress is lost.
                out.append(
                    (("crash", s, t, "writes", head), self._with(state, ti, self._freeze(crashed)))
                )
        if state.deletions < self.bound.deletions:
            for i, name in enumerate(self.names):
                for seq, _ in state.places[i].log:
                    loc = self._thaw(state, i)
                    neighbours = [self._thaw(state, self.index[n]) for n in view.neighbours[name]]
                    try:
                        loc.delete(seq, neighbours if self.rules.deletion else [])
                    except RuleViolation:
                        self.report.refused += 1
                        continue
                    gone = frozenset(k for q, k in state.places[i].log if q <= seq)
                    deleted = (*state.deleted[:i], state.deleted[i] | gone, *state.deleted[i + 1 :])
                    after_state = self._with(state, i, self._freeze(loc))._replace(
                        deleted=deleted,
                        deletions=state.deletions + 1,
                        owed=state.owed | {(name, t) for s, t in view.current if s == name},
                    )
                    label = ("delete", name, seq, tuple(sorted(gone, key=_event_text)))
                    out.append((label, after_state))
        if len(state.history) - len(self.start_history) < self.bound.changes:
            for change, refusal in view.changes(self):
                if refusal is None and isinstance(change, FailedOver) and self.rules.fail_over:
                    target = self._thaw(state, self.index[change.target])
                    try:
                        check_fail_over(
                            target, change.previous, self._thaw(state, self.index[change.source])
                        )
                    except RuleViolation as exc:
                        refusal = str(exc)
                if refusal is not None:
                    self.report.refused += 1
                    continue
                out.append((("change", change), state._replace(history=(*state.history, change))))
        return out, held, moved

    # ---- invariants --------------------------------------------------------------------------

    def _had(self, state: State) -> list[set[EventKey]]:
        return [{k for _, k in p.log} | d for p, d in zip(state.places, state.deleted, strict=True)]

    def check_state(self, state: State, view: _View) -> tuple[str, str] | None:
        """The safety properties: a state that breaks one is a violation however it goes on."""
        ids: dict[tuple[str, int], EventKey] = {}
        had = self._had(state)
        for name, place, gone in zip(self.names, state.places, state.deleted, strict=True):
            mine: set[tuple[str, int]] = set()
            for _, key in place.log:
                ident = (key[0], key[1][key[0]])
                if ident in mine:
                    return "duplicate", f"{name} stores {_event_text(key)} twice"
                mine.add(ident)
            for key in [k for _, k in place.log] + sorted(gone, key=_event_text):
                ident = (key[0], key[1][key[0]])
                other = ids.setdefault(ident, key)
                if other != key:
                    return "reused id", f"{_event_text(other)} and {_event_text(key)} share an id"
            stamps = [k[1] for _, k in place.log]
            for a, b in itertools.combinations(range(len(stamps)), 2):
                if stamps[b] < stamps[a]:
                    first, then = place.log[a][1], place.log[b][1]
                    return "storage order", (
                        f"{name} stores {_event_text(first)} before its cause {_event_text(then)}"
                    )
            if place.cvv != lub(k[1] for k in had[self.index[name]]):
                return "cvv", f"CVV-{name} {place.cvv} is not the bound of what it held"
            for _, key in place.log:
                if key[0] != name and (key[0], name) not in view.reach[key[2]]:
                    return "filtered", (
                        f"{name} stores {_event_text(key)}, which no path of connections "
                        "whose filters let it through brings there"
                    )
        for s, t in view.current:
            kinds = view.expected.get((s, t), frozenset())
            cvv = state.places[self.index[t]].cvv
            have = had[self.index[t]]
            for key in had[self.index[s]]:
                if key[2] in kinds and key not in have and key[1] <= cvv:
                    return "lost", (
                        f"{_event_text(key)} is in {t}'s causal past (CVV-{t} {cvv}) but {t} "
                        f"never stored it, though {s} -> {t} lets it through: the causality "
                        "filter drops it for good"
                    )
        return None

    def check_view(self, view: _View) -> tuple[str, str] | None:
        """A new topology history: valid as a whole, and one view in every order of arrival."""
        if self.rules.topology:
            try:
                view.topology.validate()
            except RuleViolation as exc:
                return "topology", f"the rules accepted a view that breaks them: {exc}"
        keyed = view.topology.keyed()
        n = len(self.start_history)
        first, explored = keyed[:n], keyed[n:]
        want = (view.topology.state(), view.topology.filters_ever)
        for order in itertools.permutations(explored):
            for arrival in ([*first, *order], [*order, *first]):
                self.report.orders += 1
                other = Topology.of(arrival)
                if (other.state(), other.filters_ever) != want:
                    text = ", ".join(_change_text(c) for _, c in arrival)
                    return "view", f"folded in the order {text}, the view differs"
        return None

    def check_quiescent(
        self, state: State, view: _View, held: set[Connection]
    ) -> tuple[str, str] | None:
        """Convergence, where no replication step changes anything."""
        had = self._had(state)
        for s, t in sorted(held):
            if (s, t) in state.owed:
                return "held", (
                    f"{s} -> {t} waits for good: {s} deleted events while connected to {t}, "
                    f"before {t} had them (DVV-{s} {state.places[self.index[s]].dvv}, CVV-{t} "
                    f"{state.places[self.index[t]].cvv})"
                )
            kinds = view.expected.get((s, t), frozenset())
            cvv = state.places[self.index[t]].cvv
            awaited = [k for k in state.deleted[self.index[s]] if not k[1] <= cvv]
            waiting = [
                k for _, k in state.places[self.index[s]].log
                if k[2] in kinds and k not in had[self.index[t]] and not k[1] <= cvv
            ]  # fmt: skip
            if waiting and all(k[2] not in kinds for k in awaited):
                return "held", (
                    f"{s} -> {t} waits for good for deleted events its filter excludes "
                    f"({', '.join(_event_text(k) for k in sorted(awaited, key=_event_text))}), "
                    f"and {t} never gets {_event_text(waiting[0])}"
                )
        for s, t in view.current:
            if (s, t) in held:
                continue
            kinds = view.expected.get((s, t), frozenset())
            guard = view.guard[(s, t)] if self.rules.guard else ()
            if guard and not self._strongly_connected(guard, view, held):
                continue
            cvv = state.places[self.index[t]].cvv
            have = had[self.index[t]]
            for _, key in state.places[self.index[s]].log:
                if key[2] in kinds and key not in have and not key[1] <= cvv:
                    return "stuck", (
                        f"{_event_text(key)} never reaches {t} over {s} -> {t}, which lets it "
                        "through, with nothing left to replicate"
                    )
        links = [c for c in view.never_filtered if c not in held]
        for a, b in itertools.combinations(self.names, 2):
            if (
                had[self.index[a]] != had[self.index[b]]
                and self._reaches(a, b, links)
                and self._reaches(b, a, links)
            ):
                only = sorted(had[self.index[a]] ^ had[self.index[b]], key=_event_text)
                return "diverged", (
                    f"{a} and {b}, strongly connected by unfiltered connections, hold "
                    f"different events at rest ({', '.join(map(_event_text, only))})"
                )
        return None

    def _strongly_connected(self, group: Sequence[str], view: _View, held: set[Connection]) -> bool:
        inside = [
            (s, t)
            for s, t in view.never_filtered
            if s in group and t in group and (s, t) not in held
        ]
        return all(self._reaches(group[0], x, inside) for x in group) and all(
            self._reaches(x, group[0], inside) for x in group
        )

    @staticmethod
    def _reaches(a: str, b: str, links: Sequence[Connection]) -> bool:
        seen, todo = {a}, [a]
        while todo:
            here = todo.pop()
            for s, t in links:
                if s == here and t not in seen:
                    seen.add(t)
                    todo.append(t)
        return b in seen

    # ---- the search --------------------------------------------------------------------------

    def _trace(self, parents: dict[int, tuple[int, Label | None]], at: int) -> list[str]:
        steps: list[str] = []
        while True:
            parent, label = parents[at]
            if label is None:
                return steps[::-1]
            steps.append(_label_text(label))
            at = parent

    def _violation(self, found: tuple[str, str], trace: list[str]) -> None:
        self.report.violation_states += 1
        if len(self.report.violations) < self.keep:
            self.report.violations.append(Violation(found[0], found[1], tuple(trace)))

    def run(self) -> Report:
        started = time.monotonic()
        self._cpu = time.process_time()
        report = self.report
        start = self.start()
        root = hash(start)
        parents: dict[int, tuple[int, Label | None]] = {root: (root, None)}
        self._parents = parents
        view = self.view(start.history)
        checked = {start.history}
        report.histories = 1
        found = self.check_view(view) or self.check_state(start, view)
        if found:
            self._violation(found, [])
            return self._done(started)
        frontier: list[tuple[State, int]] = [(start, root)]
        unsettled: set[int] = set()  # States as steps left them, before `settle`.
        depth = 0
        while frontier:
            report.max_depth = depth
            following: list[tuple[State, int]] = []
            for state, at in frontier:
                view = self.view(state.history)
                successors, held, moved = self.successors(state, view)
                if not moved:
                    report.quiescent += 1
                    if self.at_rest is not None:
                        self.at_rest.add(_at_rest(state))
                    found = self.check_quiescent(state, view, held)
                    if found:
                        self._violation(found, self._trace(parents, at))
                        if self.stop_at_first:
                            return self._done(started)
                        continue
                for label, raw in successors:
                    report.transitions += 1
                    h = hash(raw)
                    if h in unsettled:
                        continue  # Settled before: the same state, seen already.
                    unsettled.add(h)
                    after, done = self.settle(raw, _touched(label))
                    if done:
                        label, h = ("then", label, done), hash(after)
                    if h in parents:
                        continue
                    parents[h] = (at, label)
                    after_view = self.view(after.history)
                    found = None
                    if after.history not in checked:
                        checked.add(after.history)
                        report.histories += 1
                        found = self.check_view(after_view)
                    found = found or self.check_state(after, after_view)
                    if found:
                        self._violation(found, self._trace(parents, h))
                        if self.stop_at_first:
                            return self._done(started)
                        continue  # Not explored further: it stays broken.
                    following.append((after, h))
                if self.max_states is not None and len(parents) >= self.max_states:
                    report.complete = False
                    return self._done(started)
            frontier = following
            depth += 1
        return self._done(started)

    def _done(self, started: float) -> Report:
        self.report.states = len(self._parents)
        self.report.elapsed = time.monotonic() - started
        self.report.cpu = time.process_time() - self._cpu
        return self.report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replication.modelcheck",
        description="Explore every interleaving of emits, replication steps (with crashes "
        "between a write and its progress), topology changes and deletions up to a bound, "
        "checking the replication rules' promises in every state.",
    )
    d = Bound()
    parser.add_argument("--locations", type=int, default=d.locations)
    parser.add_argument("--events", type=int, default=d.events)
    parser.add_argument("--filters", type=int, default=d.filters)
    parser.add_argument("--changes", type=int, default=d.changes)
    parser.add_argument("--deletions", type=int, default=d.deletions)
    parser.add_argument("--fail-over", action="store_true", help="fail-over as a change")
    parser.add_argument("--no-crashes", action="store_true", help="no crash between a "
                        "write and its progress")  # fmt: skip
    parser.add_argument("--topology", choices=TOPOLOGIES, default=d.topology)
    parser.add_argument("--without", action="append", default=[], choices=RULES,
                        help="leave a rule out (repeatable): the checker should then find "
                        "its anomaly")  # fmt: skip
    parser.add_argument("--no-reduction", action="store_true", help="take every progress-only "
                        "step as a step of its own (see Checker.settle)")  # fmt: skip
    parser.add_argument("--max-states", type=int, default=None)
    parser.add_argument("--show", type=int, default=3, help="counterexamples to print")
    args = parser.parse_args(argv)
    bound = Bound(
        args.locations, args.events, args.filters, args.changes, args.deletions,
        args.fail_over, not args.no_crashes, args.topology,
    )  # fmt: skip
    try:
        checker = Checker(bound, Rules.without(*args.without), keep=args.show,
                          max_states=args.max_states, reduce=not args.no_reduction)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    report = checker.run()
    for line in report.lines():
        print(line)
    for violation in report.violations:
        print()
        print(violation)
    return 1 if report.violation_states else 0


if __name__ == "__main__":
    sys.exit(main())
