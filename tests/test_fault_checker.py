"""The fault campaign's history checker, on hand-made histories: a clean one passes, and each
broken promise (a lost acknowledgement, a duplicate, two contents at one offset, a read that goes
back or jumps, uncommitted bytes read, a register check ignored, a read-committed duplicate, an
aborted message delivered, a journal that never recovers, an append committed after its client
left, a record its retry wrote twice, a message too large for peers, replicas apart) is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from message.framing import JSONLines
from message.types import DictMessages
from message.uuid import Flags, build
from tests.faults.checker import LEAVE_MARGIN, CommittedReader, Tape, check
from tests.faults.history import (
    CHECKED,
    CROWD,
    FAIL,
    HELD,
    INFO,
    LEFT,
    OK,
    PROBE,
    RETRY,
    TAKEOVER,
    TORN,
    AppendOp,
    Delivery,
    Fault,
    HeadSample,
    History,
    Observation,
    Publish,
    ReadChunk,
    ResetHead,
    SpoolsRenewed,
    Txn,
)

J = "raw/0"
M = "msg/0"
RECORDS = [b"a 0 xx\n", b"b 0 yyy\n", b"a 1 zzzz\n"]


def acked(journal: str, client: str, payload: bytes, begin: int, at: float) -> AppendOp:
    return AppendOp(
        journal, client, payload, invoked=at - 0.1, completed=at, outcome=OK,
        begin=begin, end=begin + len(payload),
    )  # fmt: skip


def clean() -> History:
    """Three acknowledged appends, read back by a tailing reader and by the final read, held
    by a replica and a store fragment; the journal takes a probe after the faults healed."""
    h = History(scenario="hand-made", seed=1, raw_journals=[J], cycles=1)
    h.workload_began, h.workload_ended, h.healed = 0.0, 10.0, 10.0
    offset = 0
    for i, payload in enumerate(RECORDS):
        h.appends.append(acked(J, payload[:1].decode(), payload, offset, 1.0 + i))
        offset += len(payload)
    content = b"".join(RECORDS)
    h.reads.append(ReadChunk("reader-0", J, 0, content[:10], 2.0))
    h.reads.append(ReadChunk("reader-0", J, 10, content[10:], 4.0))
    h.observations.append(Observation("read", J, 0, content, 11.0))
    h.observations.append(Observation("replica:b1", J, 7, content[7:], 11.0))
    h.observations.append(Observation("store:f1", J, 0, content[:15], 11.0))
    h.appends.append(AppendOp(J, "probe", b"", PROBE, 10.5, 10.6, OK, len(content), len(content)))
    return h


def kinds(h: History) -> set[str]:
    return {v.kind for v in check(h).violations}


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.ok, report.summary()
    assert (report.acked_appends, report.lost, report.duplicated, report.conflicts) == (3, 0, 0, 0)
    # The longest stretch without an acknowledgement: from the last one to the end.
    assert report.longest_unavailability == pytest.approx(7.0)


def test_an_unacknowledged_append_may_or_may_not_be_there() -> None:
    h = clean()
    h.appends[1].outcome, h.appends[1].begin, h.appends[1].end = INFO, -1, -1
    assert check(h).ok
    h.appends.append(AppendOp(J, "c", b"c 9 never\n", outcome=INFO))
    assert check(h).ok


def test_a_lost_acknowledgement() -> None:
    h = clean()
    h.appends.append(acked(J, "c", b"c 0 lost\n", 24, 5.0))
    report = check(h)
    assert report.lost == 1 and "lost" in kinds(h)


def test_an_append_acknowledged_at_other_offsets_than_it_is() -> None:
    h = clean()
    h.appends[2].begin, h.appends[2].end = 30, 39
    assert "misplaced" in kinds(h)


def test_a_duplicate_record() -> None:
    h = clean()
    content = b"".join(RECORDS) + RECORDS[1]
    h.observations[0] = Observation("read", J, 0, content, 11.0)
    report = check(h)
    assert report.duplicated == 1 and "duplicated" in kinds(h)


def test_two_acknowledgements_of_one_offset() -> None:
    h = clean()
    h.appends.append(acked(J, "c", b"c 0 q\n", 3, 5.0))
    assert "ack-overlap" in kinds(h)


def test_two_contents_at_one_offset_across_replicas() -> None:
    h = clean()
    h.observations[1] = Observation("replica:b1", J, 7, b"b 0 YYY\n" + RECORDS[2], 11.0)
    report = check(h)
    assert report.conflicts >= 1 and "conflict" in kinds(h)


def test_content_only_a_replica_holds_is_not_lost_but_unreadable() -> None:
    # The final read stopped at 15; a surviving replica still holds the rest (not persisted).
    h = clean()
    h.observations[0] = Observation("read", J, 0, b"".join(RECORDS)[:15], 11.0)
    report = check(h)
    assert report.ok, report.summary()
    assert report.unreadable == 9
    # Bytes a replica holds that no client appended are caught all the same.
    h.observations.append(Observation("replica:b2", J, 24, b"extra\n", 11.0))
    assert "unexpected" in kinds(h)


def test_content_no_client_appended_or_that_was_refused() -> None:
    h = clean()
    h.observations[0] = Observation("read", J, 0, b"".join(RECORDS) + b"zz\n", 11.0)
    assert "unexpected" in kinds(h)
    h = clean()
    torn = b"x torn 0\n"
    h.appends.append(AppendOp(J, "x", torn, TORN, 3.0, 3.2, FAIL, error="abandoned"))
    h.observations[0] = Observation("read", J, 0, b"".join(RECORDS) + torn, 11.0)
    assert "refused-present" in kinds(h)


def test_a_hole_in_the_journal() -> None:
    h = clean()
    h.observations[0] = Observation("read", J, 7, b"".join(RECORDS)[7:], 11.0)
    h.observations[2] = Observation("store:f1", J, 7, b"".join(RECORDS)[7:15], 11.0)
    assert {"gap", "lost"} <= kinds(h)


def test_a_read_that_goes_back() -> None:
    h = clean()
    h.reads.append(ReadChunk("reader-0", J, 3, b"".join(RECORDS)[3:8], 5.0))
    assert "non-monotonic" in kinds(h)


def test_a_read_that_jumps_over_committed_bytes() -> None:
    h = clean()
    h.reads[1] = ReadChunk("reader-0", J, 15, b"".join(RECORDS)[15:], 4.0)
    assert "skipped" in kinds(h)


def test_uncommitted_bytes_read() -> None:
    # A reader saw a rolled-back append's bytes where other content was committed later.
    h = clean()
    h.reads.insert(1, ReadChunk("reader-1", J, 15, b"x torn\n", 3.0))
    assert "uncommitted-read" in kinds(h)
    # ... or past everything the journal holds.
    h = clean()
    h.reads.append(ReadChunk("reader-0", J, 24, b"x torn\n", 5.0))
    assert "uncommitted-read" in kinds(h)


def test_a_register_check_applied_while_another_owned_the_registers() -> None:
    h = clean()
    h.register_journal = J
    for op, kind in zip(h.appends, [TAKEOVER, TAKEOVER, CHECKED], strict=False):
        op.kind = kind
    # a takes over, then b, then b's checked append: fine.
    h.appends[2].client = "b"
    assert check(h).ok
    # a's checked append applied while b owned the registers.
    h.appends[2].client = "a"
    assert "register" in kinds(h)
    # ... unless the registers may have started empty again in between (every broker
    # restarted): empty registers match every check, as upstream.
    h.spools_renewed.append(SpoolsRenewed(J, 15, 2.8, lossy=False))
    assert check(h).ok


def test_empty_registers_match_every_check() -> None:
    h = clean()
    h.register_journal = J
    h.appends[0].kind = CHECKED
    assert check(h).ok


def test_a_journal_that_never_takes_appends_again() -> None:
    h = clean()
    h.appends[-1].outcome, h.appends[-1].error = FAIL, "INDEX_HAS_GREATER_OFFSET"
    assert "unavailable-after-heal" in kinds(h)


def test_a_reset_head_forgives_what_every_replica_lost() -> None:
    # Every replica died with [15, 24) not yet persisted; the operator reset the head to 15
    # and new appends took those offsets.
    h = clean()
    h.reads.append(ReadChunk("reader-0", J, 24, b"", 5.0))
    new = b"n 0 new!\n"
    h.resets.append(ResetHead(J, 15, 6.0))
    h.appends.insert(3, acked(J, "n", new, 15, 7.0))
    h.observations[0] = Observation("read", J, 0, b"".join(RECORDS[:2]) + new, 11.0)
    h.observations[1] = Observation("replica:b1", J, 7, RECORDS[1] + new, 11.0)
    h.appends[-1].begin = h.appends[-1].end = 24
    report = check(h)
    assert report.ok, report.summary()
    assert (report.lost, report.lost_to_reset) == (0, 1)
    # Without the reset, the same history has lost an acknowledged append, and the reader's
    # earlier bytes disagree with the journal's.
    h.resets.clear()
    assert {"lost", "uncommitted-read", "ack-overlap"} <= kinds(h)


# ---- read-committed messages --------------------------------------------------------------


def frame(mid: str, producer: bytes, clock: int, flags: Flags) -> bytes:
    messages = DictMessages()
    msg = messages.new_acknowledgement(M) if flags == Flags.ACK_TXN else {"id": mid}
    messages.set_uuid(msg, build(producer, clock, flags))
    out = bytearray()
    JSONLines().marshal(messages.encode(msg), out)
    return bytes(out)


P = b"\x01\x02\x03\x04\x05\x06"


def message_history() -> History:
    """m1 committed on its own; t1 (m2, m3) committed; t2 (m4) aborted; m1 retried."""
    h = History(scenario="messages", seed=2, message_journals=[M])
    h.workload_began, h.workload_ended, h.healed = 0.0, 10.0, 10.0
    frames = [
        frame("m1", P, 16, Flags.OUTSIDE_TXN),
        frame("m1", P, 16, Flags.OUTSIDE_TXN),  # A retried batch: in the journal twice.
        frame("m2", P, 32, Flags.CONTINUE_TXN),
        frame("m3", P, 48, Flags.CONTINUE_TXN),
        frame("", P, 64, Flags.ACK_TXN),
        frame("m4", P, 80, Flags.CONTINUE_TXN),
        frame("", P, 79, Flags.ACK_TXN),  # Abort: an ACK below the pending message.
    ]
    h.observations.append(Observation("read", M, 0, b"".join(frames), 11.0))
    h.publishes += [
        Publish("m1", "p", M, "", 1.0, 1.5, OK),
        Publish("m2", "p", M, "t1", 2.0, 2.5, OK),
        Publish("m3", "p", M, "t1", 2.0, 2.5, OK),
        Publish("m4", "p", M, "t2", 3.0, 3.5, OK),
    ]
    h.txns += [
        Txn("t1", "p", "commit", 2.5, 3.0, "committed"),
        Txn("t2", "p", "abort", 3.5, 4.0, "aborted"),
    ]
    h.deliveries += [Delivery("rc-0", M, i, 0, 5.0) for i in ("m1", "m2", "m3")]
    end = sum(map(len, frames))
    h.appends.append(AppendOp(M, "probe", b"", PROBE, 10.5, 10.6, OK, end, end))
    return h


def test_read_committed_messages_pass() -> None:
    report = check(message_history())
    assert report.ok, report.summary()
    assert report.acked_messages == 3


def test_a_stalled_message_journal_counts_as_unavailable() -> None:
    h = message_history()
    h.publishes[0].completed = 9.0  # m1 waited 8 s for its batch.
    report = check(h)
    assert report.longest_unavailability == pytest.approx(8.0)
    assert report.unavailable_journal == M


def test_a_reader_across_a_reset_head_may_deliver_an_aborted_message() -> None:
    # Every replica died with the abort's ACK; the operator reset the head; a reader that
    # read on across the reset delivered m4 when the producer's next ACK came.
    h = message_history()
    h.deliveries.append(Delivery("rc-0", M, "m4", 0, 6.0))
    h.resets.append(ResetHead(M, 0, 3.8))
    report = check(h)
    assert report.ok, report.summary()


def test_a_read_committed_duplicate() -> None:
    h = message_history()
    h.deliveries.append(Delivery("rc-0", M, "m2", 0, 6.0))
    assert "rc-duplicate" in kinds(h)


def test_an_aborted_message_delivered() -> None:
    h = message_history()
    h.deliveries.append(Delivery("rc-0", M, "m4", 0, 6.0))
    assert {"rc-aborted", "rc-vanished"} <= kinds(h)


def test_a_committed_message_lost() -> None:
    h = message_history()
    h.publishes.append(Publish("m5", "p", M, "", 4.0, 4.5, OK))
    assert "lost" in kinds(h)


def test_the_committed_reader_sequences_as_read_committed_does() -> None:
    reader = CommittedReader(M)
    content = message_history().observations[0].content
    # Fed in uneven pieces, as reads come.
    out = [e for at in range(0, len(content), 37) for e in reader.feed(at, content[at : at + 37])]
    assert [e.message["id"] for e in out] == ["m1", "m2", "m3"]


# ---- the pieces ---------------------------------------------------------------------------


def test_tape_reports_where_bytes_disagree() -> None:
    tape = Tape()
    assert tape.put(2, b"cdef") == []
    assert tape.put(0, b"abcXeZ") == [(3, 4), (5, 6)]
    assert tape.get(0, 6) == b"abcdef"
    assert tape.compare(4, b"ef!!") == ([], 2)
    assert list(tape.segments()) == [(0, b"abcdef")]
    tape.put(10, b"k")
    assert list(tape.segments()) == [(0, b"abcdef"), (10, b"k")]
    assert not tape.holds_any(6, 10) and tape.holds_any(6, 11)


def test_a_history_survives_json() -> None:
    h = message_history()
    h.faults.append(
        __import__("tests.faults.history", fromlist=["Fault"]).Fault("kill", "b1", 1.0, 2.0)
    )
    again = History.from_json(json.loads(json.dumps(h.to_json())))
    assert again.to_json() == h.to_json()
    assert check(again).ok


# ---- clients that give up, crowds and replicas' heads ----------------------------------------

R = "rate/leave"
HELD_RECORD = b"H held 0 " + b"." * 190 + b"\n"
GONE = b"L l0.0 0 " + b"." * 20 + b"\n"  # Gave up after its commit was sent (in doubt).
TORN_AWAY = b"L l0.1 0 " + b"." * 30 + b"\n"  # Cancelled before its commit (never committed).


def leave_history() -> History:
    """A held append takes the pipeline at 1.0 and sends its commit at 4.0, committed at
    [0, 200); two clients give up behind it at 2.0 (one in doubt, one before its commit) and
    their retries through AppendService are acknowledged after it."""
    h = History(scenario="leavers", seed=3, raw_journals=[R], round_journals=[R], cycles=1)
    h.workload_began, h.workload_ended, h.healed = 0.0, 10.0, 10.0
    held = acked(R, "held", HELD_RECORD, 0, 4.2)
    held.kind, held.invoked, held.committing = HELD, 1.0, 4.0
    gone = AppendOp(R, "l0.0", GONE, LEFT, 1.3, 2.0, INFO, error="DEADLINE_EXCEEDED", left=2.0)
    away = AppendOp(R, "l0.1", TORN_AWAY, LEFT, 1.3, 2.0, FAIL, error="left", left=2.0)
    retry_gone = acked(R, "l0.0", GONE, 200, 4.3)
    retry_away = acked(R, "l0.1", TORN_AWAY, 200 + len(GONE), 4.3)
    retry_gone.kind = retry_away.kind = RETRY
    retry_gone.invoked = retry_away.invoked = 2.0
    h.appends += [held, gone, away, retry_gone, retry_away]
    content = HELD_RECORD + GONE + TORN_AWAY
    h.observations.append(Observation("read", R, 0, content, 11.0))
    h.appends.append(AppendOp(R, "probe", b"", PROBE, 10.5, 10.6, OK, len(content), len(content)))
    return h


def with_content(h: History, content: bytes) -> History:
    h.observations[0] = Observation("read", R, 0, content, 11.0)
    h.appends[-1].begin = h.appends[-1].end = len(content)
    return h


def test_clients_that_gave_up_and_retried_are_counted_once() -> None:
    report = check(leave_history())
    assert report.ok, report.summary()
    assert (report.acked_appends, report.duplicated, report.left_landed) == (3, 0, 0)
    # Appended in rounds: the pauses between them are not unavailability.
    assert report.longest_unavailability == 0.0


def test_an_append_committed_after_its_client_left() -> None:
    # The in-doubt attempt is committed after the held append, whose commit was sent 2 s after
    # the client left: it was proposed after a broker knew the client had gone.
    h = with_content(leave_history(), HELD_RECORD + GONE + TORN_AWAY + GONE)
    assert "left-committed" in kinds(h)
    # Proposed before the held append (so, in time, before its client left): allowed, once.
    h = leave_history()
    h.appends[0].begin, h.appends[0].end = len(GONE), len(GONE) + len(HELD_RECORD)
    for retry in h.appends[3:5]:
        retry.begin, retry.end = retry.begin + len(GONE), retry.end + len(GONE)
    h = with_content(h, GONE + HELD_RECORD + GONE + TORN_AWAY)
    report = check(h)
    assert report.ok, report.summary()
    assert report.left_landed == 1


def test_a_late_commit_is_no_proof_when_a_broker_was_paused_or_cut_off() -> None:
    h = with_content(leave_history(), HELD_RECORD + GONE + TORN_AWAY + GONE)
    h.faults.append(Fault("SIGSTOP", "broker-1", 1.5, 2.5))
    assert check(h).ok, check(h).summary()
    # Nor when the commit was sent within the margin of the leaving.
    h = with_content(leave_history(), HELD_RECORD + GONE + TORN_AWAY + GONE)
    h.appends[0].committing = 2.0 + LEAVE_MARGIN / 2
    assert check(h).ok, check(h).summary()


def test_a_record_given_up_before_its_commit_is_never_in_the_journal() -> None:
    # Cancelled before its commit: rolled back, only its retry may be there.
    h = with_content(leave_history(), HELD_RECORD + GONE + TORN_AWAY + TORN_AWAY)
    assert "duplicated" in kinds(h)
    # ... and with its retry refused, not at all.
    h = leave_history()
    h.appends[4].outcome, h.appends[4].error = FAIL, "REGISTER_MISMATCH"
    assert "refused-present" in kinds(h)


def test_a_retry_sent_twice_is_a_duplicate() -> None:
    # The in-doubt attempt's copy is accounted for once; a third copy is AppendService's
    # retry sent again after its commit.
    h = with_content(leave_history(), HELD_RECORD + GONE + TORN_AWAY + GONE + GONE)
    report = check(h)
    assert report.duplicated == 1 and "duplicated" in kinds(h)


def test_a_message_too_large_for_the_peers() -> None:
    h = leave_history()
    h.appends.append(
        AppendOp(
            R, "k0.1", b"K k0.1 0 x\n", CROWD, 5.0, 6.0, INFO,
            error="ABORTED: append failed: Received message larger than max (6021125 vs. 4194304)",
        )
    )  # fmt: skip
    assert kinds(h) == {"oversized"}


def test_replicas_at_different_write_heads_after_a_quiet_crowd() -> None:
    h = leave_history()
    h.head_samples.append(HeadSample(R, 5.0, 8.0, {"broker-0": 239, "broker-1": 239}))
    assert check(h).ok
    h.head_samples.append(HeadSample(R, 5.0, 8.0, {"broker-0": 6144006, "broker-1": 122886}))
    assert kinds(h) == {"replica-heads"}
    # A fault meanwhile may leave an append in doubt, and replicas apart until the next.
    h.faults.append(Fault("SIGKILL", "broker-2", 6.0, 7.0))
    assert check(h).ok


def test_a_history_with_clients_that_gave_up_survives_gzipped_json(tmp_path: Path) -> None:
    h = leave_history()
    h.head_samples.append(HeadSample(R, 5.0, 8.0, {"broker-0": 239}))
    h.save(tmp_path / "history.json.gz")
    assert (tmp_path / "history.json.gz").read_bytes()[:2] == b"\x1f\x8b"
    again = History.load(tmp_path / "history.json.gz")
    assert again.to_json() == h.to_json()
    assert again.appends[1].left == 2.0 and again.appends[0].committing == 4.0
