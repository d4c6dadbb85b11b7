"""Vector clocks: the potential causality of events across locations (the seed's system model).

A `VectorClock` maps each location to the count of events emitted there that it has seen (a
missing location counts 0). Two clocks compare as BEFORE (every entry ≤, one <: the first
causally precedes), AFTER, EQUAL, or CONCURRENT (neither precedes the other). `merge` is the least
upper bound (entry-wise maximum). A local event log's current version vector (CVV) is the merge
of the timestamps of every event it stores; its deletion version vector (DVV) the merge of those
physically deleted. A clock restricted to some locations (`restrict`) is what redundant filtered
connections compare ("the ABC part of its vector timestamp"); `without` drops retired locations.

Clocks are immutable and hashable; they encode as a sorted JSON object for events and system
records.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["Order", "VectorClock", "lub"]


class Order(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


class VectorClock(Mapping[str, int]):
    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping[str, int] | Iterable[tuple[str, int]] = ()) -> None:
        items = entries.items() if isinstance(entries, Mapping) else entries
        clean: dict[str, int] = {}
        for location, time in items:
            if not isinstance(location, str) or not location:
                raise ValueError(f"vector clock location {location!r}: expected a non-empty name")
            if isinstance(time, bool) or not isinstance(time, int) or time < 0:
                raise ValueError(f"vector clock time of {location}: {time!r} is not a count")
            if time:
                clean[location] = time
        self._entries = dict(sorted(clean.items()))
        self._hash: int | None = None

    # ---- Mapping --------------------------------------------------------------------------------

    def __getitem__(self, location: str) -> int:
        return self._entries.get(location, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, location: object) -> bool:
        return location in self._entries

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VectorClock):
            return self._entries == other._entries
        if isinstance(other, Mapping):  # A plain mapping of counts (zeros left out or not).
            return self._entries == {k: v for k, v in other.items() if v}
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._entries.items()))
        return self._hash

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self._entries.items())
        return f"VectorClock({inner})"

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self._entries.items()) + "}"

    # ---- the order ------------------------------------------------------------------------------

    def compare(self, other: VectorClock) -> Order:
        less = more = False
        for location in self._entries.keys() | other._entries.keys():
            mine, theirs = self[location], other[location]
            if mine < theirs:
                less = True
            elif mine > theirs:
                more = True
            if less and more:
                return Order.CONCURRENT
        if less:
            return Order.BEFORE
        if more:
            return Order.AFTER
        return Order.EQUAL

    def __le__(self, other: VectorClock) -> bool:
        """Causally precedes or equals (the seed's "→ or =")."""
        return all(time <= other[location] for location, time in self._entries.items())

    def __lt__(self, other: VectorClock) -> bool:
        return self <= other and self != other

    def __ge__(self, other: VectorClock) -> bool:
        return other <= self

    def __gt__(self, other: VectorClock) -> bool:
        return other < self

    def concurrent(self, other: VectorClock) -> bool:
        return self.compare(other) is Order.CONCURRENT

    # ---- operations -----------------------------------------------------------------------------

    def merge(self, *others: VectorClock) -> VectorClock:
        """The least upper bound of this clock and `others`."""
        out = dict(self._entries)
        for other in others:
            for location, time in other._entries.items():
                if time > out.get(location, 0):
                    out[location] = time
        return VectorClock(out)

    def tick(self, location: str) -> VectorClock:
        """This clock with `location`'s time one more: the timestamp of its next event."""
        out = dict(self._entries)
        out[location] = out.get(location, 0) + 1
        return VectorClock(out)

    def set(self, location: str, time: int) -> VectorClock:
        out = dict(self._entries)
        out[location] = time
        return VectorClock(out)

    def restrict(self, locations: Iterable[str]) -> VectorClock:
        """Only the entries of `locations` (a cycle's part of a timestamp)."""
        keep = set(locations)
        return VectorClock({k: v for k, v in self._entries.items() if k in keep})

    def without(self, locations: Iterable[str]) -> VectorClock:
        """Without the entries of `locations` (retired locations)."""
        drop = set(locations)
        return VectorClock({k: v for k, v in self._entries.items() if k not in drop})

    # ---- encoding -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, int]:
        return dict(self._entries)

    @staticmethod
    def from_json(value: Any, *, field: str = "clock") -> VectorClock:
        if not isinstance(value, dict):
            raise ValueError(f"{field}: expected a JSON object of location counts")
        try:
            return VectorClock(value)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None


def lub(clocks: Iterable[VectorClock]) -> VectorClock:
    """The least upper bound of `clocks` (the empty clock for none)."""
    return VectorClock().merge(*clocks)
