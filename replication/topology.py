"""The replication network's topology history and the global view built from it (the seed's
"Replication network history" and "Global topology view").

Connection changes, filter changes and retirements are system events; every location folds the
same history into the same view, eventually. The view is a convergent replicated data type: each
change carries the order of the operator command that made it (`OpKey`, issued by etcd), one
command recorded at several locations is one change, and the view is the fold of its changes in
that order, whatever order they arrived in. Any two locations holding the same set of changes
hold the same view; for a connection, the latest command wins. The *projected history* is the network of every
connection that ever existed between locations not retired, as undirected links (a
bi-directional pair is one link; cycles need three or more locations). A link lies on a cycle of
the projected history when removing it leaves its two ends connected. A connection that was ever
filtered counts as filtered for good.

The rule this module enforces (the redundant filtered connections of the seed's later comments
are the one exception, checked by their own rule): no replication filter on a connection that lies
on a cycle of the projected history, and no new connection that would close a cycle through a
connection that was ever filtered. Refusals are `RuleViolation`, one line naming the rule and the
cycle.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Connected",
    "Disconnected",
    "FailedOver",
    "Filtered",
    "OpKey",
    "Retired",
    "RuleViolation",
    "Topology",
]


class RuleViolation(ValueError):
    """A change the extended system model forbids; the message names the rule."""


@dataclass(frozen=True)
class Connected:
    """Replication from `source` to `target` began (with a filter, or none). With `new_only`
    (`--new-events-only`), `target` joins as it records the change, by whatever route it came
    (its CVV and DVV raised to `floor`, the source's DVV when the command was checked, as
    sorted (location, time) pairs). The join is an effect on the target's vectors, not part of
    what the change is: views, and their comparisons, leave both fields out."""

    source: str
    target: str
    filter: str = ""
    new_only: bool = field(default=False, compare=False)
    floor: tuple[tuple[str, int], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Disconnected:
    source: str
    target: str


@dataclass(frozen=True)
class Filtered:
    """The filter of an existing connection changed ("" removes it; it stays filtered in the
    history)."""

    source: str
    target: str
    filter: str


@dataclass(frozen=True)
class Retired:
    location: str


@dataclass(frozen=True)
class FailedOver:
    """The filtered connection `previous` -> `target` switched to `source` -> `target` (the
    seed's fail-over): the old connection leaves the projected history, as if it had not been;
    only the new one counts."""

    previous: str
    source: str
    target: str
    filter: str
    new_only: bool = field(default=False, compare=False)  # As Connected's.
    floor: tuple[tuple[str, int], ...] = field(default=(), compare=False)


Change = Connected | Disconnected | Filtered | Retired | FailedOver

# The order of a change in the history: (etcd revision of the operator command, then, for a
# change recorded without one, the sum of its event's vector timestamp, its emitter and the
# emitter's time). Every location gives one change the same key; keys sort commands in the order
# etcd issued them, and changes without a command in an order consistent with causality (a
# timestamp's sum grows along every causal chain), ahead of every command's.
OpKey = tuple[int, int, str, int]


def _link(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _path(neighbours: Mapping[str, set[str]], a: str, b: str) -> list[str] | None:
    """A shortest path a ... b (breadth first, neighbours in name order), or None."""
    previous = {a: a}
    queue = collections.deque([a])
    while queue:
        here = queue.popleft()
        if here == b:
            path = [b]
            while path[-1] != a:
                path.append(previous[path[-1]])
            return path[::-1]
        for there in sorted(neighbours.get(here, ())):
            if there not in previous:
                previous[there] = here
                queue.append(there)
    return None


def command_key(revision: int) -> OpKey:
    """The key of a change made by the operator command etcd ordered at `revision`."""
    return (revision, 0, "", 0)


@dataclass
class Topology:
    """The view of a replication network built from its history of changes: a set of keyed
    changes, folded in key order."""

    changes: dict[OpKey, Change] = field(default_factory=dict)
    current: dict[tuple[str, str], str] = field(default_factory=dict)  # (source, target): filter
    ever: set[tuple[str, str]] = field(default_factory=set)  # Every connection that existed.
    ever_filtered: set[tuple[str, str]] = field(default_factory=set)
    # Every filter a connection ever carried ("" for none): redundant connections filter alike
    # over the history, since a disconnected one's events stay where it took them.
    filters_ever: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    locations: set[str] = field(default_factory=set)
    _last: OpKey | None = None  # The greatest key folded.

    @staticmethod
    def of(history: Iterable[Change | tuple[OpKey, Change]]) -> Topology:
        """The view of `history`: keyed changes, or plain ones taken as commands in order."""
        view = Topology()
        for item in history:
            if isinstance(item, tuple):
                view.apply(item[1], item[0])
            else:
                view.apply(item)
        return view

    @property
    def history(self) -> list[Change]:
        """Every change, in the order the view folds them."""
        return [self.changes[k] for k in sorted(self.changes)]

    def keyed(self) -> list[tuple[OpKey, Change]]:
        return sorted(self.changes.items())

    def next_key(self) -> OpKey:
        """A key after every change held (for a change not yet ordered by etcd: a check)."""
        return command_key(max((k[0] for k in self.changes), default=0) + 1)

    def state(self) -> tuple[object, ...]:
        """What two views must agree on to be the same view."""
        return (
            self.keyed(), self.current, self.ever, self.ever_filtered, self.retired,
            self.locations,
        )  # fmt: skip

    def apply(self, change: Change, key: OpKey | None = None) -> bool:
        """Fold one change in at its key (no rule checked: the history is what happened);
        False if the view holds that change already (recorded at another location too)."""
        if key is None:
            key = self.next_key()
        if key in self.changes:
            return False
        self.changes[key] = change
        if self._last is None or key > self._last:
            self._last = key
            self._fold(change)
            return True
        # It sorts before changes folded already: fold the whole history again, in key order.
        self.current, self.ever, self.ever_filtered, self.filters_ever = {}, set(), set(), {}
        self.retired, self.locations = set(), set()
        for _, each in self.keyed():
            self._fold(each)
        return True

    def _fold(self, change: Change) -> None:
        if isinstance(change, Retired):
            self.retired.add(change.location)
            for key in [k for k in self.current if change.location in k]:
                del self.current[key]
            return
        if isinstance(change, FailedOver):
            old = (change.previous, change.target)
            self.current.pop(old, None)
            self.ever.discard(old)
            self.ever_filtered.discard(old)
            self.filters_ever.pop(old, None)
            change = Connected(change.source, change.target, change.filter)  # The history
            # keeps the FailedOver; the view folds it as the new connection.
        key = (change.source, change.target)
        self.locations.update(key)
        if isinstance(change, Connected):
            self.current[key] = change.filter
            self.ever.add(key)
            self.filters_ever.setdefault(key, set()).add(change.filter)
            if change.filter:
                self.ever_filtered.add(key)
        elif isinstance(change, Disconnected):
            self.current.pop(key, None)
        else:
            self.current[key] = change.filter
            self.ever.add(key)
            self.filters_ever.setdefault(key, set()).add(change.filter)
            if change.filter:
                self.ever_filtered.add(key)

    # ---- the projected history --------------------------------------------------------------------

    def links(self, extra: Sequence[tuple[str, str]] = ()) -> set[tuple[str, str]]:
        """The undirected links of the projected history (and of `extra` connections), between
        locations not retired."""
        out = set()
        for a, b in [*self.ever, *extra]:
            if a != b and a not in self.retired and b not in self.retired:
                out.add(_link(a, b))
        return out

    def cycle_through(
        self, a: str, b: str, extra: Sequence[tuple[str, str]] = ()
    ) -> list[str] | None:
        """A cycle of the projected history through the link a-b (as its locations, from a
        back to b), or None if the link is on no cycle."""
        links = self.links(extra)
        if _link(a, b) not in links:
            return None
        neighbours: dict[str, set[str]] = collections.defaultdict(set)
        for x, y in links:
            if _link(x, y) != _link(a, b):
                neighbours[x].add(y)
                neighbours[y].add(x)
        # A path from a to b without the link itself closes a cycle with it.
        return _path(neighbours, a, b)

    def cycles(self) -> set[tuple[str, str]]:
        """The links that lie on a cycle of the projected history."""
        return {link for link in self.links() if self.cycle_through(*link) is not None}

    # ---- rules ------------------------------------------------------------------------------------

    def check_location(self, *locations: str) -> None:
        for location in locations:
            if location in self.retired:
                raise RuleViolation(f"location {location} is retired: it takes no connections")

    # ---- unfiltered groups ------------------------------------------------------------------------

    def groups(self) -> dict[str, frozenset[str]]:
        """Each location's unfiltered group: the locations joined to it by links of the
        projected history that were never filtered (a composite location, in the seed's
        words: an unfiltered cycle such as ABC is one)."""
        filtered = self._filtered_links()
        parent: dict[str, str] = {}

        def root(x: str) -> str:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in self.links():
            root(a), root(b)
            if (a, b) not in filtered:
                parent[root(a)] = root(b)
        members: dict[str, set[str]] = collections.defaultdict(set)
        for x in list(parent):
            members[root(x)].add(x)
        return {x: frozenset(members[root(x)]) for x in parent}

    def group_of(self, location: str) -> frozenset[str]:
        return self.groups().get(location, frozenset({location}))

    def guarded_group(self, location: str) -> frozenset[str]:
        """The locations whose part of an event's timestamp must be in `location`'s CVV before
        a filtered connection writes the event there (the rule of redundant filtered
        connections): its unfiltered group; none for a location alone, which lacks events of
        its own only after a disaster, and gets them back only so."""
        group = self.group_of(location)
        return group if len(group) > 1 else frozenset()

    def guard_for(self, source: str, target: str) -> frozenset[str]:
        """The locations whose part of an event's timestamp must be in the target's CVV before
        the connection source -> target writes the event there: the target's unfiltered group
        when the source is outside it, whether the connection is filtered or not (an event from
        outside may carry the group's events that a filter on the way out left behind)."""
        group = self.guarded_group(target)
        return frozenset() if source in group else group

    def _filtered_links(self) -> set[tuple[str, str]]:
        return {
            _link(a, b)
            for a, b in self.ever_filtered
            if a not in self.retired and b not in self.retired
        }

    def _unfiltered_path(self, a: str, b: str) -> list[str] | None:
        """A path a ... b over links never filtered (None if there is none)."""
        filtered = self._filtered_links()
        neighbours: dict[str, set[str]] = collections.defaultdict(set)
        for x, y in self.links():
            if (x, y) not in filtered:
                neighbours[x].add(y)
                neighbours[y].add(x)
        return _path(neighbours, a, b)

    # ---- rules ------------------------------------------------------------------------------------

    def check_filter(self, source: str, target: str, filter: str | None = None) -> None:
        """May the connection source -> target (existing or new) carry a replication filter
        (`filter`, if given, for the rule of identical filters)?"""
        self.check_location(source, target)
        text = "\0" if filter is None else filter  # None: any filter (not compared).
        change: Change = (
            Filtered(source, target, text)
            if (source, target) in self.current
            else Connected(source, target, text)
        )
        self._with(change)._check(source, target, filter is not None)

    def check_fail_over(self, previous: str, source: str, target: str, filter: str) -> None:
        """May the filtered connection previous -> target switch to source -> target (the
        topology's part of the rule; the target checks the cached CVV of `previous`)?"""
        self.check_location(source, target)
        if self.current.get((previous, target)) in (None, ""):
            raise RuleViolation(
                f"{previous} -> {target} is not a filtered connection: only a filtered one "
                "fails over"
            )
        if source in (previous, target):
            raise RuleViolation(f"{target} cannot fail over from {previous} to {source}")
        if (source, target) in self.current:
            raise RuleViolation(f"{source} -> {target} is connected already")
        change = FailedOver(previous, source, target, filter)
        self._with(change)._check(source, target)

    def check_connect(self, source: str, target: str, filter: str = "") -> None:
        """May replication source -> target begin, with this filter (or none)?"""
        self.check_location(source, target)
        if source == target:
            raise RuleViolation(f"{source} -> {target}: a location does not replicate to itself")
        self._with(Connected(source, target, filter))._check(source, target)

    def _with(self, change: Change) -> Topology:
        """This view with `change` made next."""
        return Topology.of([*self.keyed(), (self.next_key(), change)])

    def validate(self) -> None:
        """Whether the view as it is keeps the rules (RuleViolation naming one that breaks)."""
        self._check("", "")

    def _check(self, source: str, target: str, same_filters: bool = True) -> None:
        """The rules on this view, refusals worded around the change source -> target:

        1. no filtered link inside an unfiltered group (a filter on a cycle of the projected
           history, or an unfiltered connection closing a cycle through a filtered one);
        2. the groups joined by filtered links form a tree (no cycle of filtered connections
           across three or more groups);
        3. the connections from one group to another carry identical filters (the seed's
           redundant filtered connections: D -> A and D -> B into the cycle ABC alike)."""
        groups = self.groups()
        changed = _link(source, target) if source else None
        for a, b in sorted(self._filtered_links()):
            if groups[a] != groups[b]:
                continue
            path = self._unfiltered_path(a, b)
            cycle = " - ".join(path or [a, b]) + f" - {a}"
            if changed == (a, b) and (source, target) in self.ever_filtered:
                raise RuleViolation(
                    f"no filter on {source} -> {target}: it lies on the cycle {cycle} of the "
                    "topology's history"
                )
            s, t = next((s, t) for s, t in sorted(self.ever_filtered) if _link(s, t) == (a, b))
            what = f"{source} -> {target} would close" if source else "there is"
            raise RuleViolation(
                f"{what} the cycle {cycle} through {s} -> {t}, which is (or was) filtered"
            )
        # 2: the graph of groups is a forest (several links between two groups are one edge).
        edges = {tuple(sorted((min(groups[a]), min(groups[b])))) for a, b in self._filtered_links()}
        parent: dict[str, str] = {}

        def root(x: str) -> str:
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for x, y in sorted(edges):
            if root(x) == root(y):
                named = ", ".join(
                    "{" + ",".join(sorted(g)) + "}" for g in sorted({groups[x], groups[y]}, key=min)
                )
                what = f"{source} -> {target} would close" if source else "there is"
                raise RuleViolation(
                    f"{what} a cycle of filtered connections across unfiltered groups (through "
                    f"{named}): filtered connections may join groups only as a tree"
                )
            parent[root(x)] = root(y)
        if not same_filters:
            return
        # 3: identical filters from one group to another, over the history: every filter that
        # any connection between the two groups ever carried, a disconnected one's too.
        between: dict[tuple[frozenset[str], frozenset[str]], list[tuple[str, str]]] = {}
        for s, t in sorted(self.ever, key=lambda c: (c != (source, target), c)):
            if s in self.retired or t in self.retired or groups.get(s) == groups.get(t):
                continue
            between.setdefault((groups[s], groups[t]), []).append((s, t))
        for connections in between.values():
            if len(connections) < 2:
                continue  # One connection alone may change its filter: nothing is redundant.
            filters = [(c, f) for c in connections for f in sorted(self.filters_ever.get(c, ()))]
            first = next(((c, f) for c, f in filters if c != (source, target)), filters[0])
            for (x, y), f in filters:
                if f != first[1]:
                    (s, t), other = first
                    if (s, t) == (source, target):
                        (s, t), other, (x, y), f = (x, y), f, (s, t), other
                    tense = "does" if self.current.get((s, t)) == other else "did"
                    raise RuleViolation(
                        f"{x} -> {y} must filter as {s} -> {t} {tense} ({other or 'no filter'!r}): "
                        "connections from one unfiltered group to another are redundant and "
                        "filter alike, over the topology's history"
                    )

    # ---- a command against the whole history -------------------------------------------------------

    def check_change(self, change: Change) -> bool:
        """Whether `change`, made next, is allowed on this view (the whole history's: etcd's),
        RuleViolation naming the rule if not. False when it is in effect already (nothing to
        record). A view that already breaks a rule (a change recorded before commands were
        checked whole) is repaired, not frozen: a disconnection or a retirement is always
        allowed, and another change is allowed if it breaks no rule that the view does not
        break already (`violations`)."""
        if isinstance(change, Retired):
            return change.location not in self.retired
        key = (change.source, change.target)
        if isinstance(change, Disconnected):
            if key not in self.current:
                raise RuleViolation(f"{change.source} -> {change.target} is not connected")
            return True
        if isinstance(change, FailedOver):
            if self.current.get(key) == change.filter and (change.previous, change.target) not in self.current:  # fmt: skip
                return False
        elif isinstance(change, Connected):
            if self.current.get(key) == change.filter:
                return False
            if key in self.current:
                raise RuleViolation(
                    f"{change.source} -> {change.target} is connected already, with another "
                    "filter (a filter change is a Filtered change)"
                )
        else:
            if key not in self.current:
                raise RuleViolation(f"{change.source} -> {change.target} is not connected")
            if self.current[key] == change.filter:
                return False
        try:
            self._check_rules(change)
        except RuleViolation:
            before = self.violations()
            if not before or not self._with(change).violations() <= before:
                raise
            self.check_location(*key)  # A retired location takes no connection, ever.
        return True

    def _check_rules(self, change: Connected | Filtered | FailedOver) -> None:
        if isinstance(change, FailedOver):
            self.check_fail_over(change.previous, change.source, change.target, change.filter)
        elif isinstance(change, Connected):
            self.check_connect(change.source, change.target, change.filter)
        else:
            self.check_filter(change.source, change.target, change.filter)

    def violations(self) -> set[tuple[str, str, str]]:
        """Every way this view breaks the rules `_check` enforces, each named by the rule and a
        connection (so that a change can be told to make things no worse): a filtered link
        inside an unfiltered group ("cycle"), a filtered link between groups that closes a
        cycle of groups ("tree"), a connection between two groups that filters otherwise than
        another one between them did ("filters")."""
        out: set[tuple[str, str, str]] = set()
        groups = self.groups()
        between: dict[tuple[str, str], set[tuple[str, str]]] = {}
        for a, b in self._filtered_links():
            if groups[a] == groups[b]:
                out.add(("cycle", a, b))
            else:
                ends = (min(groups[a]), min(groups[b]))
                between.setdefault((min(ends), max(ends)), set()).add((a, b))
        for edge, links in between.items():
            neighbours: dict[str, set[str]] = collections.defaultdict(set)
            for x, y in between:
                if (x, y) != edge:
                    neighbours[x].add(y)
                    neighbours[y].add(x)
            if _path(neighbours, *edge) is not None:
                out.update(("tree", a, b) for a, b in links)
        buckets: dict[tuple[frozenset[str], frozenset[str]], list[tuple[str, str]]] = {}
        for s, t in self.ever:
            if s in self.retired or t in self.retired or groups.get(s) == groups.get(t):
                continue
            buckets.setdefault((groups[s], groups[t]), []).append((s, t))
        for connections in buckets.values():
            if len({f for c in connections for f in self.filters_ever.get(c, ())}) > 1:
                out.update(("filters", s, t) for s, t in connections)
        return out
