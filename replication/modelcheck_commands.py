"""A bounded exhaustive check of the replication operator commands over partial views (issue 38).

    python -m replication.modelcheck_commands --protocol old --start issue7 --commands 1
    python -m replication.modelcheck_commands --protocol new --locations 3 --commands 2

`replication.modelcheck` checks the replication rules on one global topology view that every
change reaches at once. The commands do not work that way: each location holds the changes
recorded at it and those replication brought it (system events pass every filter, but only over
connections into it), and gazctl asks locations, and records, one step at a time. This module
models that protocol at the level of topology changes (no application events) and explores every
interleaving of its steps, breadth first, up to a bound:

* gazctl commands (at most `commands` in all; with `operators` 2, two at once): `connect S T`
  (no filter, or a filter), `disconnect S T`, with `--both` also `connect --both`, and with
  `--new-events-only` also that flag; each command is a run of steps, each one transition;
* gazctl dying before its next step (at most `deaths` times);
* a location's process stopping (at most `stops` times) and starting again: a location that
  starts has not heard from those down at the time, and its clock is safe again once each has
  started (the clock check of `LocationProcess._check_may_emit`);
* replication of one system event over a connection the target's own view holds, both ends
  running: the first change in the source's log order that the target lacks;
* with the new protocol, a location catching up from etcd: one change of etcd's history that
  involves it and that its log lacks, recorded once its clock is safe.

The protocols (`--protocol`):

* `old`, today's code (gazctl/replication.py `Network.changes`, replication/process.py
  `LocationProcess.change`): gazctl reads the target's view (connected already? a filter
  change?), asks every location the change involves to check it against its own view, joins
  for `--new-events-only`, then for each change has etcd issue an op (`registry.issue_op`) and
  records at the target, then the source; each record checks the location's view again and its
  clock (`_check_may_emit`), and may refuse.
* `new`, the design of issue 38: gazctl reads etcd's head and whole history at one revision,
  checks the rules against the view they fold into and asks the locations involved for the
  live checks (running, clock safe), which change nothing; then one compare-and-swap txn on the
  head records the command's changes (a concurrent command makes it fail: gazctl reads and
  checks again); then it delivers the change to each location involved, idempotently by op
  (a location down or not yet safe to emit is skipped: it catches up). A location records a
  change etcd holds and never refuses it. The target of `--new-events-only` joins as the change
  enters its log by any route (`--join fold`, the default): gazctl's delivery, catch-up, or
  replication from a location that had it first. With `--join delivery` (only where gazctl or
  catch-up records it) the check finds the change that replication brings first, and the join
  never made; with `--join gazctl` (the protocol as first built: gazctl asks the target to
  join once etcd recorded the change, and repeats the join when the command is run again on a
  connection made already), a gazctl that dies after the txn leaves the connection recorded
  without its join until the operator runs the command again. The code now does as `fold`:
  the recorded change carries its join floor, and the target's writer joins as it stores the
  change, whichever route brought it (replication/journal_log.py). Catch-up
  records every change of etcd's that the log lacks, in op order, whether it involves the
  location or not (as `LocationProcess` does). With `--no-cas`, the txn does not compare the head gazctl read: two operators'
  commands, each keeping the rules alone, are both recorded.

The start network (`--start`), recorded with the protocol under check, each command run to its
end and replication to rest: `empty`; `issue7`, the issue's (connect A B, connect C D, connect B
D --both); `chain` (connect A B, connect B C).

Checked:

* `refused`: a command that ends in an error (a refusal, a location down or unsafe, a record
  refused) changed nothing anywhere: no location holds a change it issued, etcd holds none,
  no location joined for it. Checked the moment it ends.
* `topology`: the history recorded (the union of what locations hold, with etcd's for the new
  protocol) keeps the topology rules (`Topology.validate`, replication/topology.py). Checked in
  every state.
* once quiet (no command in flight, every location running and safe, no replication or catch-up
  step left): `half-done`, every recorded change is held by each location it involves (each
  end of a connection), a join was made for exactly the `--new-events-only` commands recorded,
  and (new protocol) no location holds a change etcd lacks; `diverged`, with the new protocol
  every location holds etcd's whole history, and with either every location's view of its own
  connections (current and ever, with their filters) is the authoritative one (etcd's, or the
  union's for the old protocol: there a send-only location never learns the changes that do
  not involve it, which `topology --check` names, and which is not counted here).

Not covered: application events (the topology properties are what `replication.modelcheck`
shows sufficient for no event lost, on one view: with a history that breaks the rules, events
are lost, which that check finds with the rules left out), fail-over, retirement, deletions,
and the group write guard on partial views (the old protocol's views are partial for good; the
new protocol's converge to etcd's).

What it finds (tests/test_replication_modelcheck.py asserts each): on the old protocol, from
the issue's network (`--start issue7`: connect A B, connect C D, connect B D --both), `connect
A C --filter kind=x` is accepted on A's and C's views and the recorded history breaks the rules
(defect 7); from three locations, a connect refused by its source's clock check after the
target recorded it (defect 8), and a refused `--new-events-only` that joined (defect 9). On the
new protocol, none at the same bounds; with `--join delivery`, the join that replication
bypasses; with `--no-cas` and two operators from `chain`, `connect A C` and `connect A B
--filter kind=x` both recorded, closing the cycle A - B - C through a filter.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from replication.topology import (
    Change,
    Connected,
    Disconnected,
    Filtered,
    RuleViolation,
    Topology,
    command_key,
)

__all__ = ["Bound", "Checker", "Report", "Spec", "Violation", "main"]

NAMES = "ABCDEFGH"
FILTER = "kind=x"
PROTOCOLS = ("old", "new")
STARTS = ("empty", "issue7", "chain")
JOINS = ("fold", "delivery", "gazctl")
PROPERTIES = ("refused", "topology", "half-done", "diverged")

Entry = tuple[int, Change]  # (op, change): one system event of a topology change.


@dataclass(frozen=True)
class Bound:
    """How far the exploration goes."""

    protocol: str = "old"
    locations: int = 3
    commands: int = 1
    filters: bool = True
    both: bool = False
    new_only: bool = False
    stops: int = 1
    deaths: int = 1
    operators: int = 1
    start: str = "empty"
    # New protocol: where the target of `--new-events-only` joins: as the change enters its log
    # by any route ("fold": gazctl's delivery, catch-up, or replication from a location that
    # had it), or only as gazctl or catch-up records it ("delivery", which misses the change
    # that replication brings first).
    join: str = "fold"
    cas: bool = True  # New protocol: the txn compares the head gazctl read (off: it does not).

    def __str__(self) -> str:
        flags = [f for f, on in (("--both", self.both), ("--new-events-only", self.new_only)) if on]
        return (
            f"protocol {self.protocol}, {self.locations} locations, start {self.start}, "
            f"{self.commands} commands ({self.operators} at once"
            + (", filters" if self.filters else "")
            + (", " + ", ".join(flags) if flags else "")
            + f"), {self.stops} stops, {self.deaths} gazctl deaths"
            + (f", join at {self.join}" if self.protocol == "new" else "")
            + ("" if self.cas or self.protocol != "new" else ", no compare-and-swap")
        )


class Spec(NamedTuple):
    """An operator command as typed."""

    kind: str  # "connect" or "disconnect"
    source: str
    target: str
    filter: str = ""
    both: bool = False
    new_only: bool = False

    def __str__(self) -> str:
        words = ["gazctl replication", self.kind, self.source, self.target]
        if self.filter:
            words.append(f"--filter {self.filter}")
        if self.both:
            words.append("--both")
        if self.new_only:
            words.append("--new-events-only")
        return " ".join(words)


Planned = tuple[tuple[Change, tuple[str, ...]], ...]  # The command's changes, each with its `at`.


class Step(NamedTuple):
    """One step of gazctl's: what it does, for which planned change, at which location."""

    what: str
    n: int = 0
    name: str = ""


class Command(NamedTuple):
    """A command in flight: what gazctl knows and its remaining steps."""

    cid: int
    spec: Spec
    steps: tuple[Step, ...]  # The next first; () before the first step has planned them.
    planned: Planned
    ops: tuple[int, ...]  # The op of each planned change, once issued (old) or recorded (new).
    snapshot: int  # The etcd head it read (new protocol).


class Issued(NamedTuple):
    """A change that got an op: who issued it, and the locations it involves."""

    op: int
    change: Change
    at: tuple[str, ...]
    cid: int
    new_only: bool  # Its command's target joins for new events only.
    target: str


class State(NamedTuple):
    logs: tuple[tuple[Entry, ...], ...]  # Per location, in log order.
    running: tuple[bool, ...]
    unheard: tuple[frozenset[str], ...]  # Per location: not heard from since it started.
    head: int  # etcd's topology head: the last op issued.
    etcd: tuple[Issued, ...]  # New protocol: the authoritative history. Old: the ops issued.
    # Joins for new events only: (command, source, target).
    joined: frozenset[tuple[int, str, str]]
    flight: tuple[Command, ...]
    issued_commands: int
    stops: int
    deaths: int


Label = str


Found = tuple[str, str, str]  # A property broken: its kind, the case of it, one line.


@dataclass(frozen=True)
class Violation:
    kind: str  # One of PROPERTIES.
    case: str  # Which way it broke (the cause of a refusal and what took effect, ...).
    message: str
    trace: tuple[str, ...]  # The shortest, as operator commands and what each step did.

    def __str__(self) -> str:
        steps = "\n".join(f"  {i}. {step}" for i, step in enumerate(self.trace, 1))
        return f"{self.kind} ({self.case}): {self.message}\n{steps or '  (the start state)'}"


@dataclass
class Report:
    bound: Bound
    states: int = 0
    transitions: int = 0
    max_depth: int = 0
    quiet: int = 0
    refused: int = 0  # Commands that ended in an error.
    completed: int = 0
    violation_states: int = 0
    # The shortest trace of each kind and case ("refused: clock, recorded", ...).
    violations: dict[str, Violation] = field(default_factory=dict)
    elapsed: float = 0.0
    cpu: float = 0.0
    complete: bool = True
    retried: int = 0  # New protocol: txns that failed on a moved head (transitions).

    def lines(self) -> list[str]:
        return [
            f"bound: {self.bound}",
            f"states explored: {self.states}" + ("" if self.complete else " (stopped early)"),
            f"transitions: {self.transitions}",
            f"max depth: {self.max_depth}",
            f"quiet states: {self.quiet}",
            f"commands ended in an error: {self.refused}, completed: {self.completed}"
            + (f", txns retried: {self.retried}" if self.bound.protocol == "new" else ""),
            f"elapsed: {self.elapsed:.1f} s ({self.cpu:.1f} s of CPU)",
            f"violations: {self.violation_states}"
            + (f" ({', '.join(sorted(self.violations))})" if self.violations else ""),
        ]


def describe(change: Change) -> str:
    if isinstance(change, Connected):
        return f"{change.source} -> {change.target}" + (
            f" (filter {change.filter})" if change.filter else ""
        )
    if isinstance(change, Filtered):
        return f"{change.source} -> {change.target} filter {change.filter or '(none)'}"
    if isinstance(change, Disconnected):
        return f"{change.source} -> {change.target} disconnected"
    return str(change)


def _involves(change: Change, name: str) -> bool:
    return name in (getattr(change, "source", None), getattr(change, "target", None))


class Ended(Exception):
    """A command's step ends it in an error (the one line gazctl would print); `cause` says
    which kind: "down" (a location does not answer) or "clock" (one not safe to emit)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class Checker:
    """Breadth first over every interleaving up to the bound; the shortest trace to each kind
    of violation is kept."""

    def __init__(
        self, bound: Bound = Bound(), *, max_states: int | None = None, stop_at_first: bool = False
    ) -> None:
        if bound.protocol not in PROTOCOLS:
            raise ValueError(f"--protocol: one of {', '.join(PROTOCOLS)}")
        if bound.start not in STARTS:
            raise ValueError(f"--start: one of {', '.join(STARTS)}")
        if not 2 <= bound.locations <= len(NAMES):
            raise ValueError(f"--locations: 2 to {len(NAMES)}")
        if bound.start == "issue7" and bound.locations < 4:
            raise ValueError("--start issue7 needs 4 locations")
        if bound.operators not in (1, 2):
            raise ValueError("--operators: 1 or 2")
        if bound.join not in JOINS:
            raise ValueError(f"--join: one of {', '.join(JOINS)}")
        self.bound = bound
        self.new = bound.protocol == "new"
        self.names = tuple(NAMES[: bound.locations])
        self.index = {n: i for i, n in enumerate(self.names)}
        self.max_states, self.stop_at_first = max_states, stop_at_first
        self.report = Report(bound)
        self._views: dict[frozenset[Entry], Topology] = {}
        self._valid: dict[frozenset[Entry], str | None] = {}  # The rules' verdict on a history.
        self.specs = self._specs()

    # ---- views -------------------------------------------------------------------------------

    def view(self, entries: Iterable[Entry]) -> Topology:
        """The view a set of system events folds into (memoized: many states share one)."""
        key = frozenset(entries)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = Topology.of((command_key(op), c) for op, c in sorted(key, key=lambda e: e[0]))  # fmt: skip
        return view

    def authoritative(self, state: State) -> frozenset[Entry]:
        """The history recorded: every location's, with etcd's for the new protocol."""
        out = {e for log in state.logs for e in log}
        if self.new:
            out |= {(i.op, i.change) for i in state.etcd}
        return frozenset(out)

    # ---- commands ----------------------------------------------------------------------------

    def _specs(self) -> list[Spec]:
        out = []
        filters = ("", FILTER) if self.bound.filters else ("",)
        for s in self.names:
            for t in self.names:
                if s == t:
                    continue
                for f in filters:
                    out.append(Spec("connect", s, t, f))
                    if self.bound.both and s < t:
                        out.append(Spec("connect", s, t, f, both=True))
                    if self.bound.new_only:
                        out.append(Spec("connect", s, t, f, new_only=True))
                out.append(Spec("disconnect", s, t))
        return out

    def _ask(self, state: State, name: str) -> int:
        i = self.index[name]
        if not state.running[i]:
            raise Ended(f"location {name} is not running (UNAVAILABLE)", "down")
        return i

    def _plan(self, spec: Spec, view_of: Callable[[str], Topology]) -> Planned:
        """The changes gazctl makes of a command, from the view `view_of` each connection's
        target (the target's own, or etcd's)."""
        pairs = [(spec.source, spec.target)] + ([(spec.target, spec.source)] if spec.both else [])
        out: list[tuple[Change, tuple[str, ...]]] = []
        for s, t in pairs:
            if spec.kind == "disconnect":
                out.append((Disconnected(s, t), (t, s)))
                continue
            view = view_of(t)
            if (s, t) in view.current and view.current[(s, t)] == spec.filter:
                continue  # "connected already"
            elif (s, t) in view.current:
                out.append((Filtered(s, t, spec.filter), (t, s)))
            else:
                out.append((Connected(s, t, spec.filter), (t, s)))
        return tuple(out)

    @staticmethod
    def _check(view: Topology, change: Change, *, op_held: bool = False) -> bool:
        """`LocationProcess.change`'s check on a location's view (RuleViolation if refused);
        True if the change is in effect there already."""
        if op_held:
            return True
        key = (getattr(change, "source", ""), getattr(change, "target", ""))
        if isinstance(change, Disconnected):
            if key not in view.current and key in view.ever:
                return True
            if key not in view.current:
                raise RuleViolation(f"{key[0]} -> {key[1]} is not connected")
            return False
        if (
            isinstance(change, (Connected, Filtered))
            and view.current.get(key, "\0") == change.filter
        ):
            return True  # In effect here already.
        if isinstance(change, Connected):
            if key in view.current:
                raise RuleViolation(f"{key[0]} -> {key[1]} is connected already, with another filter")  # fmt: skip
            view.check_connect(*key, change.filter)
        elif isinstance(change, Filtered):
            if key not in view.current:
                raise RuleViolation(f"{key[0]} -> {key[1]} is not connected")
            view.check_filter(*key, change.filter)
        return False

    @staticmethod
    def _check_whole(view: Topology, planned: Planned) -> None:
        """The new protocol's check: each change against etcd's whole view, the ones before it
        made (RuleViolation if refused)."""
        keyed = list(view.keyed())
        for change, _ in planned:
            here = Topology.of(keyed)
            key = (getattr(change, "source", ""), getattr(change, "target", ""))
            if isinstance(change, Disconnected):
                if key not in here.current:
                    raise RuleViolation(f"{key[0]} -> {key[1]} is not connected")
            elif isinstance(change, Connected):
                here.check_connect(*key, change.filter)
            elif isinstance(change, Filtered):
                here.check_filter(*key, change.filter)
            keyed.append((here.next_key(), change))

    def _record(self, state: State, i: int, entry: Entry) -> State:
        """The system event `entry` stored at location i (by a record, or replication)."""
        if entry in state.logs[i]:
            return state
        logs = (*state.logs[:i], (*state.logs[i], entry), *state.logs[i + 1 :])
        after = state._replace(logs=logs)
        if self.new and self.bound.join == "fold":
            for issued in state.etcd:
                if issued.op == entry[0] and issued.new_only and issued.target == self.names[i]:
                    after = self._join(after, issued.cid, issued.change)
        return after

    @staticmethod
    def _join(state: State, cid: int, change: Change) -> State:
        pair = (cid, getattr(change, "source", ""), getattr(change, "target", ""))
        return state._replace(joined=state.joined | {pair})

    def _replace_command(self, state: State, k: int, command: Command | None) -> State:
        flight = list(state.flight)
        if command is None:
            del flight[k]
        else:
            flight[k] = command
        return state._replace(flight=tuple(flight))

    def step(self, state: State, k: int) -> tuple[State, Label, str | None]:
        """The next step of the k-th command in flight: the state after, its label, and the
        command's end ("refused ..." / "done"), or None while it goes on."""
        command = state.flight[k]
        try:
            if self.new:
                return self._step_new(state, k, command)
            return self._step_old(state, k, command)
        except (Ended, RuleViolation) as exc:
            cause = exc.cause if isinstance(exc, Ended) else "rules"
            return self._replace_command(state, k, None), f"[{command.cid}] refused: {exc}", f"refused[{cause}]: {exc}"  # fmt: skip

    def _step_old(self, state: State, k: int, c: Command) -> tuple[State, Label, str | None]:
        spec = c.spec
        tag = f"[{c.cid}]"
        if not c.steps:
            # `_current(net, t)`: each connection's target's view says what the command changes.
            planned = self._plan(spec, lambda t: self.view(state.logs[self._ask(state, t)]))
            if not planned:
                return self._replace_command(state, k, None), f"{tag} {spec}: connected already", "done"  # fmt: skip
            steps: list[Step] = [Step("check", n, name) for n, (_, at) in enumerate(planned) for name in at]  # fmt: skip
            if spec.new_only:
                steps.append(Step("join"))
            for n, (_, at) in enumerate(planned):
                steps.append(Step("op", n))
                steps += [Step("record", n, name) for name in at]
            c = c._replace(steps=tuple(steps), planned=planned, ops=(0,) * len(planned))
            text = "; ".join(describe(ch) for ch, _ in planned)
            return self._replace_command(state, k, c), f"{tag} {spec}: reads {spec.target}'s view: {text}", None  # fmt: skip
        what, n, name = c.steps[0]
        rest = c._replace(steps=c.steps[1:])
        after: State = state
        if what == "check":
            i = self._ask(state, name)
            self._check(self.view(state.logs[i]), c.planned[n][0])
            label = f"{tag} {name} checks {describe(c.planned[n][0])} on its view: passes"
        elif what == "join":
            i = self._ask(state, spec.target)
            self._ask(state, spec.source)  # Its DVV is the floor.
            after = self._join(state, c.cid, Connected(spec.source, spec.target))
            label = f"{tag} {spec.target} joins for new events from {spec.source}"
        elif what == "op":
            op = state.head + 1
            change, at = c.planned[n]
            issued = Issued(op, change, at, c.cid, spec.new_only, spec.target)
            after = state._replace(head=op, etcd=(*state.etcd, issued))
            rest = rest._replace(ops=(*c.ops[:n], op, *c.ops[n + 1 :]))
            label = f"{tag} etcd issues op {op} for {describe(change)}"
        else:
            i = self._ask(state, name)
            op, change = c.ops[n], c.planned[n][0]
            held = any(e[0] == op for e in state.logs[i])
            self._check(self.view(state.logs[i]), change, op_held=held)
            if not held:
                if state.unheard[i]:
                    raise Ended(
                        f"{name} refuses to record op {op}: location {name} has not heard "
                        f"from {', '.join(sorted(state.unheard[i]))} since it started",
                        "clock",
                    )
                after = self._record(state, i, (op, change))
            label = f"{tag} {name} records op {op} ({describe(change)})"
        if not rest.steps:
            return self._replace_command(after, k, None), label + f"; {spec}: done", "done"
        return self._replace_command(after, k, rest), label, None

    def _step_new(self, state: State, k: int, c: Command) -> tuple[State, Label, str | None]:
        spec = c.spec
        tag = f"[{c.cid}]"
        if not c.steps or c.steps[0].what == "snapshot":
            whole = self.view((i.op, i.change) for i in state.etcd)
            planned = self._plan(spec, lambda _: whole)
            gazctl_joins = spec.new_only and self.bound.join == "gazctl"
            if not planned and gazctl_joins:
                # Repeated on a connection made already (a gazctl that died before its join).
                again = c._replace(steps=(Step("join"),), planned=(), ops=(), snapshot=state.head)
                return self._replace_command(state, k, again), f"{tag} {spec}: connected already (etcd's history)", None  # fmt: skip
            if not planned:
                return self._replace_command(state, k, None), f"{tag} {spec}: connected already (etcd's history)", "done"  # fmt: skip
            self._check_whole(whole, planned)
            live = [w for ch, w in planned if not isinstance(ch, Disconnected)]  # `_involved`
            at = sorted({name for where in live for name in where})
            steps: list[Step] = [Step("live", name=name) for name in at]
            steps.append(Step("txn"))
            steps += [Step("deliver", n, name) for n, (_, where) in enumerate(planned) for name in where]  # fmt: skip
            if gazctl_joins:
                steps.append(Step("join"))
            c = c._replace(steps=tuple(steps), planned=planned, ops=(), snapshot=state.head)
            text = "; ".join(describe(ch) for ch, _ in planned)
            label = f"{tag} {spec}: reads etcd's history at head {state.head}, checks {text} on it: passes"  # fmt: skip
            return self._replace_command(state, k, c), label, None
        what, n, name = c.steps[0]
        rest = c._replace(steps=c.steps[1:])
        after: State = state
        if what == "join":
            try:
                self._ask(state, spec.target)
                self._ask(state, spec.source)  # Its DVV is the floor.
            except Ended as exc:
                gone = self._replace_command(state, k, None)
                return gone, f"{tag} {spec}: connected, but {spec.target} did not join ({exc}): run it again", f"incomplete: {exc}"  # fmt: skip
            after = self._join(state, c.cid, Connected(spec.source, spec.target))
            label = f"{tag} {spec.target} joins for new events from {spec.source}"
        elif what == "live":
            i = self._ask(state, name)
            if state.unheard[i]:
                raise Ended(f"location {name} has not heard from {', '.join(sorted(state.unheard[i]))} since it started", "clock")  # fmt: skip
            label = f"{tag} {name} answers: running, clock safe"
        elif what == "txn":
            if state.head != c.snapshot and self.bound.cas:
                self.report.retried += 1
                retry = c._replace(steps=(Step("snapshot"),))
                return self._replace_command(state, k, retry), f"{tag} etcd txn fails (head moved from {c.snapshot} to {state.head}): read again", None  # fmt: skip
            # Without the compare-and-swap (`cas` off), on whatever head etcd has now.
            ops = tuple(range(state.head + 1, state.head + 1 + len(c.planned)))
            issued = tuple(
                Issued(op, ch, at, c.cid, spec.new_only, spec.target)
                for op, (ch, at) in zip(ops, c.planned, strict=True)
            )
            after = state._replace(head=ops[-1], etcd=(*state.etcd, *issued))
            rest = rest._replace(ops=ops)
            label = f"{tag} etcd txn on head {c.snapshot} records ops {', '.join(map(str, ops))}"
        else:
            i = self.index[name]
            issued_one = state.etcd[[x.op for x in state.etcd].index(c.ops[n])]
            if state.running[i] and not state.unheard[i]:
                after = self._deliver(state, i, issued_one)
                label = f"{tag} delivers op {issued_one.op} to {name}"
            else:
                label = f"{tag} skips {name} (down or not yet safe): it catches up"
        if not rest.steps:
            return self._replace_command(after, k, None), label + f"; {spec}: done", "done"
        return self._replace_command(after, k, rest), label, None

    def _deliver(self, state: State, i: int, issued: Issued) -> State:
        """A location records a change etcd holds (idempotent by op); the target of
        `--new-events-only` joins as it records it."""
        if any(e[0] == issued.op for e in state.logs[i]):
            return state
        after = self._record(state, i, (issued.op, issued.change))
        if self.bound.join == "delivery" and issued.new_only and self.names[i] == issued.target:
            after = self._join(after, issued.cid, issued.change)
        return after

    # ---- transitions -------------------------------------------------------------------------

    def start(self) -> State:
        n = len(self.names)
        state = State(
            tuple(() for _ in self.names), (True,) * n, tuple(frozenset[str]() for _ in self.names),
            0, (), frozenset(), (), 0, 0, 0,
        )  # fmt: skip
        script: list[Spec] = []
        if self.bound.start == "issue7":
            script = [Spec("connect", "A", "B"), Spec("connect", "C", "D"),
                      Spec("connect", "B", "D", both=True)]  # fmt: skip
        elif self.bound.start == "chain":
            script = [Spec("connect", "A", "B"), Spec("connect", "B", "C")]
        for cid, spec in enumerate(script, start=-len(script)):
            state = state._replace(flight=(Command(cid, spec, (), (), (), 0),))
            while state.flight:
                state, label, end = self.step(state, 0)
                if end is not None and end != "done":
                    raise AssertionError(f"the start script failed: {label}")
            state = self._settle(state)
        return state

    def _settle(self, state: State) -> State:
        """Every internal step, to rest (for the start script)."""
        while True:
            internal = self.internal(state)
            if not internal:
                return state
            state = internal[0][1]

    def internal(self, state: State) -> list[tuple[Label, State]]:
        """Replication and catch-up steps that change something."""
        out: list[tuple[Label, State]] = []
        for t, target in enumerate(self.names):
            if not state.running[t]:
                continue
            mine = set(state.logs[t])
            view = self.view(state.logs[t])
            for s_name, t_name in sorted(view.current):
                if t_name != target:
                    continue
                s = self.index[s_name]
                if not state.running[s]:
                    continue
                held_ops = {e[0] for e in mine}
                entry = next((e for e in state.logs[s] if e not in mine and e[0] not in held_ops), None)  # fmt: skip
                if entry is not None:
                    label = f"{s_name} -> {target} replicates op {entry[0]} ({describe(entry[1])})"
                    out.append((label, self._record(state, t, entry)))
            if self.new and not state.unheard[t]:
                held_ops = {e[0] for e in mine}
                lacking = [i for i in sorted(state.etcd) if i.op not in held_ops]
                if lacking:
                    first = lacking[0]
                    label = f"{target} catches up from etcd: op {first.op} ({describe(first.change)})"  # fmt: skip
                    out.append((label, self._deliver(state, t, first)))
        return out

    def successors(self, state: State) -> tuple[list[tuple[Label, State, str | None, int]], bool]:
        """Every next state (label, state, a command's end, its cid), and whether the state is
        quiet."""
        out: list[tuple[Label, State, str | None, int]] = []
        internal = self.internal(state)
        out += [(label, after, None, -1) for label, after in internal]
        for k, command in enumerate(state.flight):
            after, label, end = self.step(state, k)
            out.append((label, after, end, command.cid))
            if state.deaths < self.bound.deaths:
                gone = self._replace_command(state, k, None)._replace(deaths=state.deaths + 1)
                out.append((f"[{command.cid}] gazctl dies ({command.spec})", gone, None, -1))
        if len(state.flight) < self.bound.operators and state.issued_commands < self.bound.commands:  # fmt: skip
            cid = state.issued_commands
            for spec in self.specs:
                fresh = state._replace(
                    flight=(*state.flight, Command(cid, spec, (), (), (), 0)),
                    issued_commands=cid + 1,
                )
                after, label, end = self.step(fresh, len(state.flight))
                out.append((label, after, end, cid))
        for i, name in enumerate(self.names):
            if state.running[i] and state.stops < self.bound.stops:
                running = (*state.running[:i], False, *state.running[i + 1 :])
                out.append((f"{name} stops", state._replace(running=running, stops=state.stops + 1), None, -1))  # fmt: skip
            elif not state.running[i]:
                running = (*state.running[:i], True, *state.running[i + 1 :])
                down = frozenset(n for n, up in zip(self.names, running, strict=True) if not up)
                unheard = tuple(down if j == i else u - {name} for j, u in enumerate(state.unheard))
                label = f"{name} starts" + (f" (has not heard from {', '.join(sorted(down))})" if down else "")  # fmt: skip
                out.append((label, state._replace(running=running, unheard=unheard), None, -1))
        quiet = not internal and not state.flight and all(state.running) and not any(state.unheard)
        return out, quiet

    # ---- properties --------------------------------------------------------------------------

    def check_state(self, state: State) -> Found | None:
        history = self.authoritative(state)
        if history not in self._valid:
            try:
                self.view(history).validate()
                self._valid[history] = None
            except RuleViolation as exc:
                self._valid[history] = str(exc)
        refusal = self._valid[history]
        if refusal is not None:
            return "topology", "rules", f"the history recorded breaks the topology rules: {refusal}"  # fmt: skip
        return None

    def check_refused(self, state: State, cid: int, end: str) -> Found | None:
        ops = {i.op for i in state.etcd if i.cid == cid}
        where = sorted(self.names[i] for i, log in enumerate(state.logs) if any(e[0] in ops for e in log))  # fmt: skip
        what, effects = [], []
        if where:
            what.append(f"recorded at {', '.join(where)}")
            effects.append("recorded")
        if self.new and ops:
            what.append("recorded in etcd")
            effects.append("etcd")
        if any(j[0] == cid for j in state.joined):
            what.append("its target joined for new events only")
            effects.append("joined")
        if what:
            cause = end[end.index("[") + 1 : end.index("]")]
            return "refused", f"{cause}, {'+'.join(effects)}", f"command [{cid}] ended in an error ({end}) but took effect: {'; '.join(what)}"  # fmt: skip
        return None

    def check_quiet(self, state: State) -> Found | None:
        history = self.authoritative(state)
        recorded: list[Issued] = [i for i in state.etcd if self.new or (i.op, i.change) in history]
        for issued in recorded:
            lacking = [n for n in issued.at if (issued.op, issued.change) not in state.logs[self.index[n]]]  # fmt: skip
            if lacking:
                holding = [n for n in issued.at if n not in lacking]
                return (
                    "half-done",
                    "not held where it belongs",
                    (
                        f"op {issued.op} ({describe(issued.change)}) is held by "
                        f"{', '.join(holding) or 'etcd alone'} but not {', '.join(lacking)}, for good"
                    ),
                )
            pair = (getattr(issued.change, "source", ""), issued.target)
            if issued.new_only and not any(j[1:] == pair for j in state.joined):
                return "half-done", "recorded without its join", f"op {issued.op} ({describe(issued.change)}) is recorded, but {issued.target} never joined for new events only"  # fmt: skip
        # A join is for a connection recorded (by its command, or made already: gazctl repeats
        # the join of a command run again).
        ever = self.view(history).ever
        for cid, *_ in sorted(j for j in state.joined if tuple(j[1:]) not in ever):
            return "half-done", "joined without its record", f"command [{cid}]'s target joined for new events only, but its change is recorded nowhere"  # fmt: skip
        if self.new:
            known = {(i.op, i.change) for i in state.etcd}
            for name, log in zip(self.names, state.logs, strict=True):
                extra = [e for e in log if e not in known]
                if extra:
                    return (
                        "half-done",
                        "not in etcd",
                        f"{name} holds op {extra[0][0]}, which etcd lacks",
                    )
            # Catch-up records every change of etcd's, so every view is etcd's once quiet.
            for name, log in zip(self.names, state.logs, strict=True):
                missing = sorted(known - set(log), key=lambda e: e[0])
                if missing:
                    op, change = missing[0]
                    return "diverged", "whole view", f"{name} lacks op {op} ({describe(change)}) of etcd's history, for good"  # fmt: skip
        whole = self.view(history)
        for name, log in zip(self.names, state.logs, strict=True):
            mine = self.view(log)
            for attribute in ("current", "ever"):
                want = _own(getattr(whole, attribute), name)
                have = _own(getattr(mine, attribute), name)
                if want != have:
                    return (
                        "diverged",
                        "own connections",
                        (
                            f"{name}'s view of its own connections ({attribute}: {_text(have)}) "
                            f"is not the recorded history's ({_text(want)})"
                        ),
                    )
        return None

    # ---- the search --------------------------------------------------------------------------

    def _violation(self, found: Found, trace: list[str]) -> None:
        self.report.violation_states += 1
        kind, case, message = found
        self.report.violations.setdefault(f"{kind}: {case}", Violation(kind, case, message, tuple(trace)))  # fmt: skip

    def run(self) -> Report:
        started, cpu = time.monotonic(), time.process_time()
        report = self.report
        start = self.start()
        # States by their hash (64 bits: a collision would merge two states and could hide
        # one; at a few million states the chance is below one in a million), each with its
        # parent's and the step's label, for the shortest trace (breadth first finds it first).
        root = hash(start)
        parents: dict[int, tuple[int, Label]] = {root: (root, "")}

        def trace(at: int) -> list[str]:
            steps: list[str] = []
            while at != root:
                at, label = parents[at]
                steps.append(label)
            return steps[::-1]

        def done() -> Report:
            report.states = len(parents)
            report.elapsed = time.monotonic() - started
            report.cpu = time.process_time() - cpu
            return report

        found = self.check_state(start)
        if found:
            self._violation(found, [])
            return done()
        frontier = [start]
        depth = 0
        while frontier:
            report.max_depth = depth
            following: list[State] = []
            for state in frontier:
                successors, quiet = self.successors(state)
                if quiet:
                    report.quiet += 1
                    found = self.check_quiet(state)
                    if found:
                        self._violation(found, trace(hash(state)))
                        if self.stop_at_first:
                            return done()
                        continue
                here = hash(state)
                for label, after, end, cid in successors:
                    report.transitions += 1
                    found = None
                    if end is not None and end.startswith("refused"):
                        report.refused += 1
                        found = self.check_refused(after, cid, end)
                    elif end == "done":
                        report.completed += 1
                    h = hash(after)
                    if found:
                        self._violation(found, [*trace(here), label])
                        if self.stop_at_first:
                            return done()
                    if h in parents:
                        continue
                    parents[h] = (here, label)
                    found = found or self.check_state(after)
                    if found:
                        self._violation(found, trace(h))
                        if self.stop_at_first:
                            return done()
                        continue  # Not explored further: it stays broken.
                    following.append(after)
                if self.max_states is not None and len(parents) >= self.max_states:
                    report.complete = False
                    return done()
            frontier = following
            depth += 1
        return done()


def _own(connections: object, name: str) -> object:
    if isinstance(connections, dict):
        return {k: v for k, v in connections.items() if name in k}
    assert isinstance(connections, set)
    return {k for k in connections if name in k}


def _text(connections: object) -> str:
    if isinstance(connections, dict):
        items = [f"{s}->{t}" + (f" {f}" if f else "") for (s, t), f in sorted(connections.items())]
    else:
        assert isinstance(connections, set)
        items = [f"{s}->{t}" for s, t in sorted(connections)]
    return ", ".join(items) or "none"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replication.modelcheck_commands",
        description="Explore every interleaving of operator commands (each a run of gazctl's "
        "steps), gazctl deaths, location stops and starts, replication of system events and "
        "catch-up from etcd up to a bound, checking that a refused command changes nothing, the "
        "history recorded keeps the topology rules, and views converge once quiet.",
    )
    d = Bound()
    parser.add_argument("--protocol", choices=PROTOCOLS, default=d.protocol)
    parser.add_argument("--locations", type=int, default=d.locations)
    parser.add_argument("--commands", type=int, default=d.commands)
    parser.add_argument("--no-filters", action="store_true", help="connect without filters only")
    parser.add_argument("--both", action="store_true", help="also connect --both")
    parser.add_argument("--new-events-only", action="store_true", help="also connect --new-events-only")  # fmt: skip
    parser.add_argument("--stops", type=int, default=d.stops)
    parser.add_argument("--deaths", type=int, default=d.deaths)
    parser.add_argument("--operators", type=int, default=d.operators)
    parser.add_argument("--start", choices=STARTS, default=d.start)
    parser.add_argument("--join", choices=JOINS, default=d.join, help="new protocol: where "
                        "the target of --new-events-only joins (see Bound.join)")  # fmt: skip
    parser.add_argument("--no-cas", action="store_true", help="new protocol: the txn does not "
                        "compare the head gazctl read (to see what the compare-and-swap "
                        "prevents)")  # fmt: skip
    parser.add_argument("--max-states", type=int, default=None)
    args = parser.parse_args(argv)
    bound = Bound(
        args.protocol, args.locations, args.commands, not args.no_filters, args.both,
        args.new_events_only, args.stops, args.deaths, args.operators, args.start, args.join,
        not args.no_cas,
    )  # fmt: skip
    try:
        checker = Checker(bound, max_states=args.max_states)
    except ValueError as exc:
        parser.error(str(exc))
    report = checker.run()
    for line in report.lines():
        print(line)
    for _, violation in sorted(report.violations.items(), key=lambda kv: (PROPERTIES.index(kv[1].kind), len(kv[1].trace))):  # fmt: skip
        print()
        print(violation)
    return 1 if report.violation_states else 0


if __name__ == "__main__":
    sys.exit(main())
