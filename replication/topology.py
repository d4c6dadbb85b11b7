"""The replication network's topology history and the global view built from it (the seed's
"Replication network history" and "Global topology view").

Connection changes, filter changes and retirements are system events; every location folds the
same history into the same view, eventually. The *projected history* is the network of every
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Connected", "Disconnected", "Filtered", "Retired", "RuleViolation", "Topology"]


class RuleViolation(ValueError):
    """A change the extended system model forbids; the message names the rule."""


@dataclass(frozen=True)
class Connected:
    """Replication from `source` to `target` began (with a filter, or none)."""

    source: str
    target: str
    filter: str = ""


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


Change = Connected | Disconnected | Filtered | Retired


def _link(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


@dataclass
class Topology:
    """The view of a replication network built from its history of changes."""

    history: list[Change] = field(default_factory=list)
    current: dict[tuple[str, str], str] = field(default_factory=dict)  # (source, target): filter
    ever: set[tuple[str, str]] = field(default_factory=set)  # Every connection that existed.
    ever_filtered: set[tuple[str, str]] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)
    locations: set[str] = field(default_factory=set)

    @staticmethod
    def of(history: Iterable[Change]) -> Topology:
        view = Topology()
        for change in history:
            view.apply(change)
        return view

    def apply(self, change: Change) -> None:
        """Fold one change in (no rule checked: the history is what happened)."""
        self.history.append(change)
        if isinstance(change, Retired):
            self.retired.add(change.location)
            for key in [k for k in self.current if change.location in k]:
                del self.current[key]
            return
        key = (change.source, change.target)
        self.locations.update(key)
        if isinstance(change, Connected):
            self.current[key] = change.filter
            self.ever.add(key)
            if change.filter:
                self.ever_filtered.add(key)
        elif isinstance(change, Disconnected):
            self.current.pop(key, None)
        else:
            self.current[key] = change.filter
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
        previous: dict[str, str] = {a: a}
        queue = collections.deque([a])
        while queue:
            here = queue.popleft()
            if here == b:
                path = [b]
                while path[-1] != a:
                    path.append(previous[path[-1]])
                return path[::-1]
            for there in sorted(neighbours[here]):
                if there not in previous:
                    previous[there] = here
                    queue.append(there)
        return None

    def cycles(self) -> set[tuple[str, str]]:
        """The links that lie on a cycle of the projected history."""
        return {link for link in self.links() if self.cycle_through(*link) is not None}

    # ---- rules ------------------------------------------------------------------------------------

    def check_location(self, *locations: str) -> None:
        for location in locations:
            if location in self.retired:
                raise RuleViolation(f"location {location} is retired: it takes no connections")

    def check_filter(self, source: str, target: str) -> None:
        """May the connection source -> target (existing or new) carry a replication filter?"""
        self.check_location(source, target)
        cycle = self.cycle_through(source, target, extra=[(source, target)])
        if cycle is not None:
            raise RuleViolation(
                f"no filter on {source} -> {target}: it lies on the cycle "
                f"{' - '.join(cycle)} - {source} of the topology's history"
            )

    def check_connect(self, source: str, target: str, filter: str = "") -> None:
        """May replication source -> target begin (the filter rule for it, and no cycle closed
        through a connection that was ever filtered)?"""
        self.check_location(source, target)
        if source == target:
            raise RuleViolation(f"{source} -> {target}: a location does not replicate to itself")
        if filter:
            self.check_filter(source, target)
        extra = [(source, target)]
        for s, t in sorted(self.ever_filtered):
            if s in self.retired or t in self.retired:
                continue
            cycle = self.cycle_through(s, t, extra=extra)
            if cycle is not None:
                raise RuleViolation(
                    f"{source} -> {target} would close the cycle {' - '.join(cycle)} - {s} "
                    f"through {s} -> {t}, which is (or was) filtered"
                )
