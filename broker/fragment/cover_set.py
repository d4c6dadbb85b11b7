"""CoverSet: the fragments of one journal, chosen so that each offset maps to a best fragment.

A fragment index holds both local fragments (with their bytes at hand) and persisted ones listed
from stores, which often overlap. The CoverSet keeps only fragments that no other one fully covers
("prefer larger fragments"), ordered on begin and end, so a read finds its fragment by bisection.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, overload

from broker.protocol import protocol_pb2 as pb


class Readable(Protocol):
    """Local content of a fragment. `offset` is a journal offset within the fragment."""

    def read(self, offset: int, size: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class IndexedFragment:
    """A fragment of the index: its spec, and its local content (None if only persisted)."""

    spec: pb.Fragment
    file: Readable | None = None

    @property
    def journal(self) -> str:
        return self.spec.journal

    @property
    def begin(self) -> int:
        return self.spec.begin

    @property
    def end(self) -> int:
        return self.spec.end

    @property
    def mod_time(self) -> int:
        """Unix seconds at which the fragment was persisted; 0 while it is only local."""
        return self.spec.mod_time

    @property
    def backing_store(self) -> str:
        """The store the fragment is persisted to; "" while it is only local."""
        return self.spec.backing_store

    def __repr__(self) -> str:
        where = self.backing_store or "local"
        return f"IndexedFragment({self.journal!r}, [{self.begin}, {self.end}), {where})"


class CoverSet:
    """Fragments ordered on (begin, end), none of which is fully covered by another.

    It follows that both begins and ends strictly increase along the set: a fragment's begin and
    end may overlap its neighbours', but it never nests inside one. The first begin and last end
    bound the offsets the set covers, which may have gaps.
    """

    __slots__ = ("_begins", "_ends", "_fragments")

    def __init__(self, fragments: Iterable[IndexedFragment] = ()) -> None:
        self._fragments: list[IndexedFragment] = []
        # Parallel keys, so that bisection compares plain ints.
        self._begins: list[int] = []
        self._ends: list[int] = []
        for fragment in fragments:
            self.add(fragment)

    @classmethod
    def _of_ordered(cls, fragments: list[IndexedFragment]) -> CoverSet:
        # `fragments` already satisfy the invariant (e.g. a subsequence of another CoverSet).
        out = cls()
        out._fragments = fragments
        out._begins = [f.begin for f in fragments]
        out._ends = [f.end for f in fragments]
        return out

    def add(self, fragment: IndexedFragment) -> bool:
        """Add `fragment`, replacing the fragments it covers; returns whether the set changed.

        A fragment covered by a larger one already present is not added (False). One with the
        same span as a present fragment replaces it, as upstream's does (True). Empty fragments
        are ignored (False).
        """
        begin, end = fragment.begin, fragment.end
        if begin > end:
            raise ValueError(
                f"fragment of {fragment.journal!r} has begin {begin} after end {end}; "
                "it cannot be indexed"
            )
        if begin == end:
            return False
        if self._fragments and fragment.journal != self._fragments[0].journal:
            raise ValueError(
                f"fragment of journal {fragment.journal!r} cannot join the index of journal "
                f"{self._fragments[0].journal!r}"
            )

        # The last fragment beginning at or before `begin` has the greatest end of all such.
        at = bisect.bisect_right(self._begins, begin) - 1
        if at >= 0 and self._ends[at] >= end:
            if self._begins[at] != begin or self._ends[at] != end:
                return False  # Strictly covered already.
            self._fragments[at] = fragment
            return True

        # Replace the run of fragments that `fragment` covers: those beginning at or after
        # `begin` (contiguous, as begins increase) and ending at or before `end` (as do ends).
        lo = bisect.bisect_left(self._begins, begin)
        hi = max(lo, bisect.bisect_right(self._ends, end))
        self._fragments[lo:hi] = [fragment]
        self._begins[lo:hi] = [begin]
        self._ends[lo:hi] = [end]
        return True

    def longest_overlapping(self, offset: int) -> tuple[int, bool]:
        """The index of the fragment covering `offset` with the most content after it, and True.

        When no fragment covers `offset`: the index of the first fragment beginning after it
        (len(self) if there is none), and False.
        """
        after = bisect.bisect_right(self._ends, offset)  # First fragment ending after `offset`.
        if after == len(self._ends) or self._begins[after] > offset:
            return after, False
        # Every fragment from `after` on that begins at or before `offset` covers it; the last
        # of them ends latest.
        return bisect.bisect_right(self._begins, offset) - 1, True

    def begin_offset(self) -> int:
        """The first offset of the set, or 0 if it is empty."""
        return self._begins[0] if self._begins else 0

    def end_offset(self) -> int:
        """The offset just past the set's last fragment, or 0 if it is empty."""
        return self._ends[-1] if self._ends else 0

    def difference(self, other: CoverSet) -> CoverSet:
        """The fragments of this set covering some offset that no fragment of `other` covers.

        A fragment counts as covered when the fragments of `other` together leave no gap over
        it, however many it takes. The index uses this to drop local fragments once persisted
        copies of their content are listed from the stores.
        """
        # reach[i]: the end of the gapless run of `other` extending from its fragment i.
        count = len(other._fragments)
        reach = [0] * count
        for i in range(count - 1, -1, -1):
            if i + 1 < count and other._begins[i + 1] <= other._ends[i]:
                reach[i] = reach[i + 1]
            else:
                reach[i] = other._ends[i]

        kept = []
        for fragment in self._fragments:
            at, found = other.longest_overlapping(fragment.begin)
            if not found or reach[at] < fragment.end:
                kept.append(fragment)
        return CoverSet._of_ordered(kept)

    def __len__(self) -> int:
        return len(self._fragments)

    def __iter__(self) -> Iterator[IndexedFragment]:
        return iter(self._fragments)

    @overload
    def __getitem__(self, index: int) -> IndexedFragment: ...

    @overload
    def __getitem__(self, index: slice) -> list[IndexedFragment]: ...

    def __getitem__(self, index: int | slice) -> IndexedFragment | list[IndexedFragment]:
        return self._fragments[index]

    def __repr__(self) -> str:
        spans = ", ".join(f"[{f.begin}, {f.end})" for f in self._fragments)
        return f"CoverSet({spans})"
