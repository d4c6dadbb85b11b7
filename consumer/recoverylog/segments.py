"""Segments of a recovery log: runs of operations of one author in one log, by sequence number and
offset (upstream's `Segment` and `SegmentSet`). Hints list each live file's segments; the player
reads only them, and pruning keeps every fragment they touch.

A `SegmentSet` is ordered by first sequence number, its segments disjoint: adding one merges it
with those it overlaps or continues (same author and log), and refuses one that contradicts them
(offsets going backwards, another author for the same sequence numbers, another first checksum).
A last offset of 0 means "unbounded" (the segment runs to the log's head)."""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, replace

from broker.protocol import recorded_op_pb2 as rpb

__all__ = ["Segment", "SegmentError", "SegmentSet"]


class SegmentError(ValueError):
    """A segment that is invalid, or contradicts another of its set."""


@dataclass
class Segment:
    author: int
    first_seq_no: int
    first_offset: int
    first_checksum: int
    last_seq_no: int
    last_offset: int
    log: str

    @staticmethod
    def of(message: rpb.Segment, default_log: str = "") -> Segment:
        return Segment(
            message.author, message.first_seq_no, message.first_offset, message.first_checksum,
            message.last_seq_no, message.last_offset, message.log or default_log,
        )  # fmt: skip

    def message(self, hints_log: str = "") -> rpb.Segment:
        """As protobuf; a log equal to `hints_log` is left out (implied by the hints)."""
        return rpb.Segment(
            author=self.author, first_seq_no=self.first_seq_no, first_offset=self.first_offset,
            first_checksum=self.first_checksum, last_seq_no=self.last_seq_no,
            last_offset=self.last_offset, log="" if self.log == hints_log else self.log,
        )  # fmt: skip

    def validate(self) -> None:
        if self.author == 0:
            raise SegmentError(f"{self}: author is zero")
        if self.first_seq_no <= 0:
            raise SegmentError(f"{self}: first_seq_no is not positive")
        if self.first_offset < 0:
            raise SegmentError(f"{self}: first_offset is negative")
        if self.last_seq_no < self.first_seq_no:
            raise SegmentError(f"{self}: last_seq_no is below first_seq_no")
        if self.last_offset != 0 and self.last_offset <= self.first_offset:
            raise SegmentError(f"{self}: last_offset is not past first_offset")
        if not self.log:
            raise SegmentError(f"{self}: no log")


class _NotReducible(Exception):
    pass


def _nonzero_and_less(a: int, b: int) -> bool:
    return a != 0 and a < b


def _reduce(a: Segment, b: Segment) -> Segment:
    """`a` and `b` as one segment; _NotReducible if they are disjoint, SegmentError if they
    contradict each other."""
    if a.first_seq_no > b.first_seq_no or (
        a.first_seq_no == b.first_seq_no and a.last_seq_no < b.last_seq_no
    ):
        a, b = b, a
    same_log = a.log == b.log
    if a.first_seq_no < b.first_seq_no and same_log and a.first_offset > b.first_offset:
        raise SegmentError(f"expected monotonic first_offset: {a} vs {b}")
    if a.first_seq_no < b.first_seq_no and a.last_offset == 0 and b.last_offset != 0:
        raise SegmentError(f"expected the preceding segment to have a last_offset: {a} vs {b}")
    if a.last_offset == 0 and not same_log:
        raise SegmentError(f"a segment after an unbounded one cannot use another log: {a} vs {b}")
    if same_log and (
        (a.last_seq_no <= b.last_seq_no and _nonzero_and_less(b.last_offset, a.last_offset))
        or (a.last_seq_no >= b.last_seq_no and _nonzero_and_less(a.last_offset, b.last_offset))
    ):
        raise SegmentError(f"expected monotonic last_offset: {a} vs {b}")
    if a.first_seq_no == b.first_seq_no and a.first_checksum != b.first_checksum:
        raise SegmentError(f"expected equal first_checksum: {a} vs {b}")
    if a.last_seq_no + 1 < b.first_seq_no:
        raise _NotReducible  # Disjoint.
    if a.last_seq_no + 1 == b.first_seq_no and (a.author != b.author or not same_log):
        raise _NotReducible  # Adjacent, of different authors or logs.
    if a.author != b.author:
        raise SegmentError(f"expected the same author: {a} vs {b}")
    if not same_log:
        raise SegmentError(f"expected the same log: {a} vs {b}")
    out = replace(a)
    if a.first_seq_no == b.first_seq_no and a.first_offset < b.first_offset:
        out.first_offset = b.first_offset  # The tighter lower bound.
    if a.last_seq_no == b.last_seq_no and a.last_offset == 0:
        out.last_offset = b.last_offset
    if a.last_seq_no < b.last_seq_no:
        out.last_seq_no, out.last_offset = b.last_seq_no, b.last_offset
    return out


def _first_seq_no(segment: Segment) -> int:
    return segment.first_seq_no


class SegmentSet(list[Segment]):
    """Disjoint segments ordered by first sequence number (upstream's SegmentSet)."""

    def add(self, segment: Segment) -> None:
        segment.validate()
        # By key, not a list of keys made at each add: hints of thousands of files are added
        # one segment at a time (FSM(hints), on the loop).
        begin = bisect.bisect_left(self, segment.first_seq_no, key=_first_seq_no)
        if begin > 0:
            with contextlib.suppress(_NotReducible):
                segment, begin = _reduce(self[begin - 1], segment), begin - 1
        end = begin
        while end < len(self):
            try:
                segment = _reduce(self[end], segment)
            except _NotReducible:
                break
            end += 1
        self[begin:end] = [segment]

    def intersect(self, log: str, first_offset: int, last_offset: int) -> SegmentSet:
        """The segments (all of `log`) that hold offsets in [first_offset, last_offset)."""
        if last_offset < first_offset:
            raise ValueError(f"invalid range [{first_offset}, {last_offset})")
        for s in self:
            if s.log != log:
                raise ValueError(f"segment of {s.log} in a set intersected with {log}")
        j = bisect.bisect_left([s.first_offset for s in self], last_offset)
        i = j
        while i > 0 and (self[i - 1].last_offset == 0 or self[i - 1].last_offset > first_offset):
            i -= 1
        return SegmentSet(self[i:j])
