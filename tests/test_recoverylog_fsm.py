"""The recovery log's FSM and segments, against logs written here from the format's description
(frames of magic, little-endian length and RecordedOp; checksums a CRC-32C chained over each
op's protobuf bytes, computed by a bitwise CRC of this file, not the library's): sequencing and
checksums, hints that skip dead files, a forked log read along its hinted branch, and segment sets
merging and refusing as upstream's."""

from __future__ import annotations

import struct

import pytest

from broker.protocol import recorded_op_pb2 as rpb
from consumer.recoverylog.fsm import (
    FSM,
    Applied,
    ChecksumMismatch,
    NotHintedAuthor,
    WrongSeqNo,
    author_fence,
    checksum_extend,
    decode_header,
    encode_frame,
)
from consumer.recoverylog.segments import Segment, SegmentError, SegmentSet
from tests.helpers.recoverylog import LOG, LogWriter, crc32c_bitwise, create, link, unlink, write


def test_checksums_and_frames_follow_the_format() -> None:
    assert crc32c_bitwise(0, b"123456789") == 0xE3069283  # The standard check value.
    for data in (b"", b"a", bytes(range(256)) * 3):
        assert checksum_extend(7, data) == crc32c_bitwise(7, data)
    op = rpb.RecordedOp(
        seq_no=3, checksum=0xDEADBEEF, author=9, create=rpb.RecordedOp.Create(path="/x")
    )
    frame = encode_frame(op)
    body = op.SerializeToString()
    assert frame == b"\x66\x33\x93\x36" + struct.pack("<I", len(body)) + body
    assert decode_header(frame[:8]) == len(body)
    with pytest.raises(ValueError, match="not a recovery-log frame"):
        decode_header(b"\x00" * 8)
    # Upstream's Author.Fence: the author in base 32, as Go's strconv.FormatUint(a, 32).
    assert author_fence(1234567).labels[0].name == "author"
    assert author_fence(1234567).labels[0].value == "15lk7"
    assert author_fence(0xFFFFFFFF).labels[0].value == "3vvvvvv"


def test_ops_apply_only_in_sequence_with_their_checksums() -> None:
    w = LogWriter()
    a = w.op(7, **create("/a"))
    fsm = FSM(rpb.FSMHints(log=LOG))
    assert fsm.apply(a, w.ops[0][1]) == Applied.APPLIED
    b = w.op(7, **write(1, 0, 10))
    wrong = rpb.RecordedOp()
    wrong.CopyFrom(b)
    wrong.seq_no = 5
    with pytest.raises(WrongSeqNo):
        fsm.apply(wrong, wrong.SerializeToString())
    wrong.seq_no, wrong.checksum = b.seq_no, b.checksum + 1
    with pytest.raises(ChecksumMismatch):
        fsm.apply(wrong, wrong.SerializeToString())
    assert (fsm.next_seq_no, fsm.next_checksum) == (2, crc32c_bitwise(0, w.ops[0][1]))
    assert fsm.apply(b, w.ops[1][1]) == Applied.APPLIED
    assert fsm.links == {"/a": 1} and fsm.live_nodes[1].segments == [
        Segment(7, 1, 0, 0, 2, b.last_offset, LOG)
    ]


def test_hints_skip_dead_files_and_rebuild_the_same_state() -> None:
    w = LogWriter()
    w.op(1, **create("/dead"))  # fnode 1
    w.op(1, **write(1, 0, 100))
    w.op(1, **create("/live"))  # fnode 3
    w.op(2, **write(3, 0, 5))  # Another author takes over (a hand-off).
    w.op(2, **link(3, "/also"))
    w.op(2, **unlink(1, "/dead"))
    w.op(2, **write(3, 5, 5))

    full = FSM(rpb.FSMHints(log=LOG))
    for op, body in w.ops:
        assert full.apply(op, body) == Applied.APPLIED
    hints = full.build_hints(LOG)
    assert [n.fnode for n in hints.live_nodes] == [3]
    assert [(s.author, s.first_seq_no, s.last_seq_no, s.log) for s in hints.live_nodes[0].segments] == [
        (1, 3, 3, ""), (2, 4, 7, "")
    ]  # fmt: skip

    # Played from the hints: the dead file's ops are skipped (out of sequence, or untracked).
    hinted = FSM(hints)
    outcomes = []
    for op, body in w.ops:
        try:
            outcomes.append(hinted.apply(op, body).value)
        except WrongSeqNo:
            outcomes.append("skipped")
    assert outcomes == [
        "skipped",
        "skipped",
        "applied",
        "applied",
        "applied",
        "untracked",
        "applied",
    ]
    assert not hinted.has_remaining_hints()
    assert hinted.links == full.links and hinted.live_nodes.keys() == full.live_nodes.keys()
    assert (hinted.next_seq_no, hinted.next_checksum) == (full.next_seq_no, full.next_checksum)
    assert hinted.build_hints(LOG) == hints


def test_a_forked_log_is_read_along_its_hinted_branch() -> None:
    w = LogWriter()
    w.op(1, **create("/f"))
    w.op(1, **write(1, 0, 4))
    zombie, successor = w.fork(), w.fork()
    # Two recorders append at once: the same sequence numbers, on two branches.
    zombie.op(1, **write(1, 4, 4))
    successor.op(2, **write(1, 4, 8))
    successor.op(2, **create("/g"))
    interleaved = [*w.ops, zombie.ops[0], successor.ops[0], successor.ops[1]]

    branch = FSM(rpb.FSMHints(log=LOG))
    for op, body in w.ops:
        branch.apply(op, body)
    for op, body in successor.ops:
        op.first_offset += 1000  # Where they landed in the log (after the zombie's).
        op.last_offset += 1000
        branch.apply(op, body)
    hints = branch.build_hints(LOG)

    hinted = FSM(hints)
    applied = []
    for op, body in interleaved:
        try:
            hinted.apply(op, body)
            applied.append(op.author)
        except NotHintedAuthor:
            applied.append(-op.author)
    assert applied == [1, 1, -1, 2, 2]  # The zombie's op is not on the hinted branch.
    assert hinted.links == {"/f": 1, "/g": 4}


def seg(
    author: int, first: int, last: int, first_offset: int = 0, last_offset: int = 0, log: str = LOG
) -> Segment:
    return Segment(author, first, first_offset, 0, last, last_offset, log)


def test_segment_sets_merge_and_refuse_as_upstreams() -> None:
    s = SegmentSet()
    s.add(seg(1, 1, 3, 0, 30))
    s.add(seg(1, 4, 6, 30, 60))  # Adjacent, same author: merged.
    assert s == [seg(1, 1, 6, 0, 60)]
    s.add(seg(2, 7, 9, 60, 90))  # Adjacent, another author: kept apart.
    s.add(seg(2, 12, 12, 100, 110))  # Disjoint.
    assert [(x.author, x.first_seq_no, x.last_seq_no) for x in s] == [
        (1, 1, 6),
        (2, 7, 9),
        (2, 12, 12),
    ]
    s.add(seg(2, 8, 12, 70, 110))  # Overlaps both of author 2: one segment.
    assert [(x.author, x.first_seq_no, x.last_seq_no) for x in s] == [(1, 1, 6), (2, 7, 12)]
    with pytest.raises(SegmentError, match="same author"):
        s.add(seg(3, 5, 8, 50, 80))
    with pytest.raises(SegmentError, match="monotonic last_offset"):
        s.add(seg(1, 2, 6, 10, 70))
    with pytest.raises(SegmentError, match="author is zero"):
        s.add(seg(0, 20, 21))
    assert [(x.first_offset, x.last_offset) for x in s.intersect(LOG, 65, 66)] == [(60, 110)]
    assert [(x.first_offset, x.last_offset) for x in s.intersect(LOG, 0, 200)] == [
        (0, 60),
        (60, 110),
    ]
    assert s.intersect(LOG, 200, 300) == []
