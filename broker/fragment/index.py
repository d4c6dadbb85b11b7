"""The fragments of one journal that a replica can serve reads from.

Today: fragments completed by the spool (still local, not yet persisted) and the spool's committed
head. The stores issue adds persisted fragments listed from fragment stores. Readers query by
offset and wait here for commits at the write head.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from broker.protocol import protocol_pb2 as pb


class Readable(Protocol):
    """Something holding a fragment's committed bytes."""

    def read(self, offset: int, size: int) -> bytes: ...


@dataclass(frozen=True)
class Found:
    """A fragment covering a read offset, and how to read its bytes."""

    fragment: pb.Fragment
    read: Callable[[int, int], bytes]


class Index:
    def __init__(self, journal: str) -> None:
        self.journal = journal
        # Completed local fragments, ordered on begin; each with what reads its bytes.
        self._fragments: list[tuple[pb.Fragment, Readable]] = []
        self._head = pb.Fragment(journal=journal)
        self._head_source: Readable | None = None
        self._changed = asyncio.Event()

    # ---- spool observer -------------------------------------------------------------------

    def attach_head(self, source: Readable, fragment: pb.Fragment) -> None:
        self._head_source = source
        self._head = _copy(fragment)
        self._signal()

    def on_commit(self, fragment: pb.Fragment) -> None:
        self._head = _copy(fragment)
        self._signal()

    def on_complete(self, fragment: pb.Fragment, source: Readable) -> None:
        if fragment.end > fragment.begin:
            keys = [f.begin for f, _ in self._fragments]
            at = bisect.bisect_right(keys, fragment.begin)
            self._fragments.insert(at, (_copy(fragment), source))
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- queries --------------------------------------------------------------------------

    @property
    def write_head(self) -> int:
        return max(self._head.end, self.end_offset())

    def end_offset(self) -> int:
        """The largest offset any fragment reaches (the index's max offset)."""
        end = self._head.end
        if self._fragments:
            end = max(end, max(f.end for f, _ in self._fragments))
        return end

    def begin_offset(self) -> int:
        if self._fragments:
            return self._fragments[0][0].begin
        return self._head.begin

    def query(self, offset: int) -> Found | None:
        """The fragment with the most content at `offset`, or None if nothing covers it yet."""
        best: tuple[pb.Fragment, Readable] | None = None
        for fragment, source in self._fragments:
            if fragment.begin <= offset < fragment.end and (
                best is None or fragment.end > best[0].end
            ):
                best = (fragment, source)
        head = self._head
        if (
            self._head_source is not None
            and head.begin <= offset < head.end
            and (best is None or head.end > best[0].end)
        ):
            best = (head, self._head_source)
        if best is None:
            return None
        fragment, source = best
        return Found(fragment, source.read)

    def next_offset(self, offset: int) -> int | None:
        """The begin of the first fragment after `offset`, if any (for skipping a gap)."""
        candidates = [f.begin for f, _ in self._fragments if f.begin > offset]
        if (
            self._head_source is not None
            and self._head.begin > offset
            and self._head.end > self._head.begin
        ):
            candidates.append(self._head.begin)
        return min(candidates) if candidates else None

    async def wait_for_change(self) -> None:
        await self._changed.wait()


def _copy(fragment: pb.Fragment) -> pb.Fragment:
    out = pb.Fragment()
    out.CopyFrom(fragment)
    return out
