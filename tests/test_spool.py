"""The Spool's transitions (commit, rollback, roll, mismatch) with upstream's semantics, its file
handling, and the fragment helpers; a state-machine test compares it with an in-memory model."""

from __future__ import annotations

import hashlib
import os
import threading
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from broker.fragment import (
    ZERO_DIGEST,
    CompletedFragment,
    Spool,
    SpoolError,
    apply_register_updates,
    check_registers,
    codec_extension,
    codec_from_extension,
    content_length,
    content_name,
    content_path,
    digest_of,
    parse_content_name,
    parse_relative_path,
    sum_from_digest,
    sum_of,
    zero_sum,
)
from broker.protocol import protocol_pb2 as pb
from broker.protocol import wire
from broker.protocol.labels import label_set, parse_selector
from broker.protocol.validate import ValidationError

JOURNAL = "a/journal"
REG_EMPTY = label_set()
REG_FOO = label_set(("reg", "foo"))
REG_BAR = label_set(("reg", "bar"))
REG_BAZ = label_set(("reg", "baz"))
FIXED_TIME = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)


class Recorder:
    """A SpoolObserver keeping what it is told; completed fragments are closed by `close`."""

    def __init__(self) -> None:
        self.commits: list[pb.Fragment] = []
        self.completes: list[CompletedFragment] = []

    def on_commit(self, fragment: pb.Fragment) -> None:
        self.commits.append(fragment)

    def on_complete(self, completed: CompletedFragment) -> None:
        self.completes.append(completed)

    def close(self) -> None:
        for completed in self.completes:
            completed.close()


@pytest.fixture
def observer() -> Iterator[Recorder]:
    recorder = Recorder()
    yield recorder
    recorder.close()


@pytest.fixture
def spool(observer: Recorder, tmp_path: Path) -> Iterator[Spool]:
    with Spool(JOURNAL, observer, directory=tmp_path, clock=lambda: FIXED_TIME) as s:
        yield s


def fragment(
    begin: int,
    end: int,
    content: bytes = b"",
    codec: pb.CompressionCodec = pb.NONE,
    journal: str = JOURNAL,
) -> pb.Fragment:
    return pb.Fragment(
        journal=journal,
        begin=begin,
        end=end,
        sum=sum_of(content) if end != begin else None,
        compression_codec=codec,
    )


def propose(proposal: pb.Fragment, registers: pb.LabelSet = REG_EMPTY) -> pb.ReplicateRequest:
    return pb.ReplicateRequest(proposal=proposal, registers=registers)


def chunk(content: bytes, delta: int) -> pb.ReplicateRequest:
    return pb.ReplicateRequest(content=content, content_delta=delta)


OK = pb.ReplicateResponse()


def mismatch(s: Spool) -> pb.ReplicateResponse:
    return pb.ReplicateResponse(
        status=pb.PROPOSAL_MISMATCH, fragment=s.fragment, registers=s.registers
    )


def state(s: Spool) -> tuple[bytes, bytes, int, datetime | None]:
    """Everything a refused request must leave unchanged."""
    return (
        s.fragment.SerializeToString(),
        s.registers.SerializeToString(),
        s.delta,
        s.first_append_time,
    )


def read_all(source: Spool | CompletedFragment, begin: int) -> bytes:
    parts = []
    offset = begin
    while data := source.read(offset, 1 << 20):
        parts.append(data)
        offset += len(data)
    return b"".join(parts)


# --- Transitions ---------------------------------------------------------------------------------


def test_next_proposal(spool: Spool) -> None:
    # A new spool proposes the empty fragment at 0, without content and so with the zero sum.
    assert spool.next_proposal() == pb.Fragment(journal=JOURNAL, compression_codec=pb.NONE)
    assert digest_of(spool.next_proposal().sum) == ZERO_DIGEST

    assert spool.apply(propose(fragment(100, 100, codec=pb.SNAPPY))) == OK
    assert spool.next_proposal() == fragment(100, 100, codec=pb.SNAPPY)

    assert spool.apply(chunk(b"some", 0)) == OK
    assert spool.apply(chunk(b" content", 4)) == OK
    assert spool.next_proposal() == fragment(100, 112, b"some content", pb.SNAPPY)
    # Nothing is committed yet.
    assert spool.fragment == fragment(100, 100, codec=pb.SNAPPY)
    assert spool.delta == 12


def test_commit_rollback_and_roll_sequence(spool: Spool, observer: Recorder) -> None:
    steps = [
        propose(fragment(0, 0, codec=pb.GZIP), REG_EMPTY),  # Synchronize.
        chunk(b"an init", 0),
        chunk(b"ial write ", 7),
        propose(fragment(0, 17, b"an initial write ", pb.GZIP), REG_FOO),  # Commit.
        chunk(b"WHO", 0),
        chunk(b"OPS!", 3),
        propose(fragment(0, 17, b"an initial write ", pb.GZIP), REG_FOO),  # Rollback.
        chunk(b"final write", 0),
        propose(fragment(0, 28, b"an initial write final write", pb.GZIP), REG_BAR),  # Commit.
        chunk(b"extra ", 0),
        chunk(b"partial content", 6),
        propose(fragment(28, 28, codec=pb.GZIP), REG_BAR),  # Roll, dropping the pending bytes.
    ]
    for step in steps:
        assert spool.apply(step, primary=True) == OK
        # Only a fragment with content has a first append time.
        assert spool.first_append_time == (FIXED_TIME if spool.content_length else None)

    assert observer.commits == [
        fragment(0, 17, b"an initial write ", pb.GZIP),
        fragment(0, 28, b"an initial write final write", pb.GZIP),
    ]
    [completed] = observer.completes
    assert completed.fragment == fragment(0, 28, b"an initial write final write", pb.GZIP)
    assert completed.registers == REG_BAR
    assert completed.first_append_time == FIXED_TIME
    assert completed.primary
    assert completed.content_length == 28
    assert read_all(completed, 0) == b"an initial write final write"
    assert completed.read(3, 7) == b"initial"

    assert spool.fragment == fragment(28, 28, codec=pb.GZIP)
    assert spool.registers == REG_BAR
    assert spool.delta == 0


def test_roll_before_current_end_is_refused(spool: Spool, observer: Recorder) -> None:
    spool.apply(chunk(b"0123456789", 0))
    assert spool.apply(propose(fragment(0, 10, b"0123456789"), REG_BAR)) == OK

    before = state(spool)
    response = spool.apply(propose(fragment(9, 9), REG_BAZ))
    assert response == mismatch(spool)
    assert response.registers == REG_BAR
    assert state(spool) == before

    assert spool.apply(propose(fragment(11, 11), REG_BAZ)) == OK
    assert spool.fragment == fragment(11, 11)
    assert spool.registers == REG_BAZ  # Taken: the roll moved forward.
    assert len(observer.completes) == 1


def test_identical_empty_proposal_is_a_no_op(spool: Spool, observer: Recorder) -> None:
    assert spool.apply(propose(fragment(5, 5), REG_FOO)) == OK
    before = state(spool)
    for _ in range(3):
        assert spool.apply(propose(fragment(5, 5), REG_FOO)) == OK
    assert state(spool) == before
    assert observer.completes == []
    assert observer.commits == []


def test_empty_proposal_at_end_rolls_pending_away_and_may_change_codec(spool: Spool) -> None:
    assert spool.apply(propose(fragment(0, 0))) == OK
    spool.apply(chunk(b"pending", 0))
    assert spool.apply(propose(fragment(0, 0, codec=pb.ZSTANDARD))) == OK
    assert spool.fragment == fragment(0, 0, codec=pb.ZSTANDARD)
    assert spool.delta == 0
    # Content then restarts at delta 0, over the discarded bytes.
    spool.apply(chunk(b"new", 0))
    assert spool.apply(propose(fragment(0, 3, b"new", pb.ZSTANDARD))) == OK
    assert spool.read(0, 100) == b"new"


def test_empty_proposal_within_pending_bytes_does_not_roll(spool: Spool) -> None:
    spool.apply(chunk(b"abcd", 0))
    spool.apply(propose(fragment(0, 4, b"abcd"), REG_FOO))
    spool.apply(chunk(b"efgh", 0))
    before = state(spool)
    for at in (5, 8):  # Past the committed end, but not past the pending bytes.
        assert spool.apply(propose(fragment(at, at), REG_BAR)) == mismatch(spool)
        assert state(spool) == before
    assert spool.apply(propose(fragment(9, 9), REG_BAR)) == OK


def test_roll_at_same_end_keeps_registers(spool: Spool, observer: Recorder) -> None:
    # An empty proposal at exactly our end rolls, but does not take its registers (only a roll
    # to a larger offset does): with other registers it answers a mismatch, having rolled.
    spool.apply(chunk(b"abcd", 0))
    assert spool.apply(propose(fragment(0, 4, b"abcd"), REG_FOO)) == OK

    response = spool.apply(propose(fragment(4, 4), REG_BAR))
    assert response.status == pb.PROPOSAL_MISMATCH
    assert response.fragment == fragment(4, 4)
    assert response.registers == REG_FOO
    assert len(observer.completes) == 1

    assert spool.apply(propose(fragment(4, 4), REG_FOO)) == OK


def test_more_mismatch_cases(spool: Spool, observer: Recorder) -> None:
    assert spool.apply(propose(fragment(0, 0, codec=pb.GZIP))) == OK
    spool.apply(chunk(b"abcd", 0))
    committed = spool.next_proposal()
    assert spool.apply(propose(committed, REG_FOO)) == OK

    # Re-committing exactly the current fragment and registers succeeds...
    assert spool.apply(propose(committed, REG_FOO)) == OK
    # ...but not with other registers.
    response = spool.apply(propose(committed, REG_BAR))
    assert response.status == pb.PROPOSAL_MISMATCH
    assert response.registers == REG_FOO

    # A rollback with the wrong registers is refused, and keeps the pending bytes.
    spool.apply(chunk(b"efgh", 0))
    before = state(spool)
    assert spool.apply(propose(committed, REG_BAR)).status == pb.PROPOSAL_MISMATCH
    assert state(spool) == before

    # A mismatching proposal within the spool's bounds changes nothing.
    proposal = spool.next_proposal()
    proposal.begin = 1
    assert spool.apply(propose(proposal, REG_BAR)).status == pb.PROPOSAL_MISMATCH
    assert state(spool) == before
    assert observer.completes == []

    # Beyond the bounds (end + delta = 8), the spool rolls forward to the proposal's end and
    # takes its registers, though the proposal itself still mismatches.
    proposal.end = 9
    response = spool.apply(propose(proposal, REG_BAR))
    assert response.status == pb.PROPOSAL_MISMATCH
    assert response.fragment == fragment(9, 9, codec=pb.GZIP)
    assert (spool.begin, spool.end, spool.delta) == (9, 9, 0)
    assert spool.registers == REG_BAR
    [completed] = observer.completes
    assert read_all(completed, 0) == b"abcd"  # Not the rolled-back "efgh".

    # An empty spool seeing a proposal within its bounds stays as it is.
    proposal.end = 8
    before = state(spool)
    assert spool.apply(propose(proposal, REG_BAZ)).status == pb.PROPOSAL_MISMATCH
    assert state(spool) == before

    # An empty spool rolled forward completes nothing.
    proposal.end = 11
    assert spool.apply(propose(proposal, REG_BAZ)).status == pb.PROPOSAL_MISMATCH
    assert (spool.begin, spool.end) == (11, 11)
    assert spool.registers == REG_BAZ
    assert len(observer.completes) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("end", 5),  # Short of the pending content.
        ("begin", 1),
        ("sum", sum_of(b"foobaz")),
        ("compression_codec", pb.SNAPPY),
        ("journal", "another/journal"),
        ("backing_store", "file:///root/"),
        ("mod_time", 1234),
        ("path_postfix", "a=b"),
    ],
)
def test_commit_mismatch(spool: Spool, observer: Recorder, field: str, value: object) -> None:
    spool.apply(chunk(b"foobar", 0))
    before = state(spool)
    proposal = fragment(0, 6, b"foobar")
    if field == "sum":
        assert isinstance(value, pb.SHA1Sum)
        proposal.sum.CopyFrom(value)
    else:
        setattr(proposal, field, value)

    response = spool.apply(propose(proposal, REG_FOO))
    assert response == mismatch(spool)
    assert response.registers == REG_EMPTY
    assert state(spool) == before
    assert observer.commits == []

    assert spool.apply(propose(fragment(0, 6, b"foobar"), REG_FOO)) == OK
    assert spool.registers == REG_FOO


def test_wrong_journal_never_rolls(spool: Spool, observer: Recorder) -> None:
    spool.apply(chunk(b"abc", 0))
    spool.apply(propose(fragment(0, 3, b"abc")))
    before = state(spool)
    other = fragment(50, 50, journal="another/journal")
    assert spool.apply(propose(other)).status == pb.PROPOSAL_MISMATCH
    assert state(spool) == before
    assert observer.completes == []


def test_content_delta_mismatch_is_an_invalid_transition(spool: Spool) -> None:
    assert spool.apply(chunk(b"foo", 0)) == OK
    before = state(spool)
    with pytest.raises(SpoolError, match=r"invalid content_delta of a/journal \(2; expected 3\)"):
        spool.apply(chunk(b"bar", 2))
    assert state(spool) == before
    # The stream's owner rolls back; the spool then accepts content at delta 0 again.
    spool.rollback()
    assert spool.apply(chunk(b"bar", 0)) == OK
    assert spool.next_proposal() == fragment(0, 3, b"bar")


def test_empty_chunks_are_accepted_at_the_right_delta(spool: Spool) -> None:
    assert spool.apply(chunk(b"", 0)) == OK
    assert spool.apply(chunk(b"ab", 0)) == OK
    assert spool.apply(chunk(b"", 2)) == OK
    with pytest.raises(SpoolError):
        spool.apply(chunk(b"", 0))
    assert spool.next_proposal() == fragment(0, 2, b"ab")


def test_commit_adopts_registers_and_responses_are_copies(spool: Spool) -> None:
    spool.apply(chunk(b"x", 0))
    registers = label_set(("owner", "me"), ("reg", "foo"))
    assert spool.apply(propose(fragment(0, 1, b"x"), registers)) == OK
    registers.labels[0].value = "changed"  # The spool keeps its own copy.
    assert spool.registers == label_set(("owner", "me"), ("reg", "foo"))

    response = spool.apply(propose(fragment(0, 1, b"y"), REG_FOO))
    assert response.status == pb.PROPOSAL_MISMATCH
    response.fragment.end = 99
    del response.registers.labels[:]
    assert spool.fragment == fragment(0, 1, b"x")
    assert spool.registers == label_set(("owner", "me"), ("reg", "foo"))


def test_commit_without_pending_content_is_a_mismatch(spool: Spool) -> None:
    # Registers change only with appended bytes: an equal fragment with new registers is refused.
    spool.apply(chunk(b"x", 0))
    spool.apply(propose(fragment(0, 1, b"x"), REG_FOO))
    assert spool.apply(propose(fragment(0, 1, b"x"), REG_BAR)).status == pb.PROPOSAL_MISMATCH


# --- Content: reads, sums, files -----------------------------------------------------------------


def test_reads_never_see_pending_bytes(spool: Spool) -> None:
    assert spool.read(0, 10) == b""
    spool.apply(chunk(b"hello", 0))
    assert spool.read(0, 10) == b""
    spool.apply(propose(fragment(0, 5, b"hello")))
    spool.apply(chunk(b" world", 0))
    assert spool.read(0, 100) == b"hello"
    assert spool.read(2, 2) == b"ll"
    assert spool.read(5, 10) == b""
    with pytest.raises(ValueError, match="outside of the fragment"):
        spool.read(6, 1)

    spool.apply(propose(fragment(0, 5, b"hello")))  # Rollback.
    spool.apply(chunk(b"!", 0))
    spool.apply(propose(fragment(0, 6, b"hello!")))
    assert spool.read(0, 100) == b"hello!"


def test_completed_fragments_stay_readable(tmp_path: Path) -> None:
    observer = Recorder()
    spool = Spool(JOURNAL, observer, directory=tmp_path)
    spool.apply(chunk(b"first", 0))
    spool.apply(propose(fragment(0, 5, b"first")))
    spool.apply(chunk(b"discarded", 0))
    spool.apply(propose(fragment(5, 5)))
    spool.apply(chunk(b"second", 0))
    spool.apply(propose(fragment(5, 11, b"second")))
    with pytest.raises(ValueError, match=r"offset 0 is outside of the fragment \[5, 11\)"):
        spool.read(0, 5)
    spool.close()
    with pytest.raises(ValueError, match="closed spool"):
        spool.read(5, 1)
    with pytest.raises(SpoolError, match="closed"):
        spool.apply(chunk(b"x", 0))

    [completed] = observer.completes
    assert not completed.primary
    # The spool is gone, and the completed fragment's file with it stays readable.
    assert read_all(completed, 0) == b"first"
    assert completed.read(5, 10) == b""
    with pytest.raises(ValueError):
        completed.read(6, 1)
    completed.close()
    assert completed.closed
    with pytest.raises(ValueError, match="closed"):
        completed.read(0, 1)
    completed.close()  # Idempotent.


def _spool_fds(directory: Path) -> int:
    """Open descriptors of (unlinked) files made in `directory`, whoever else opens files."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # Closed meanwhile (e.g. the descriptor listdir itself used).
        count += target.startswith(str(directory) + "/")
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_files_are_unlinked_and_closed(tmp_path: Path) -> None:
    observer = Recorder()
    spool = Spool(JOURNAL, observer, directory=tmp_path)
    for i in range(3):
        spool.apply(chunk(b"data", 0))
        spool.apply(propose(fragment(4 * i, 4 * i + 4, b"data")))
        spool.apply(propose(fragment(4 * i + 4, 4 * i + 4)))
    # Spool files never have names: nothing is left behind even if the process dies.
    assert list(tmp_path.iterdir()) == []
    assert _spool_fds(tmp_path) == 3  # Three completed fragments; the spool has no file yet.
    spool.apply(chunk(b"more", 0))
    assert _spool_fds(tmp_path) == 4
    spool.close()
    observer.close()
    assert _spool_fds(tmp_path) == 0


def test_sha1_matches_hashlib_over_all_content(spool: Spool) -> None:
    # Chunk sizes straddle hashlib's internal block size and the GIL-release threshold.
    whole = hashlib.sha1()
    committed = b""
    for i, size in enumerate([1, 63, 64, 65, 2047, 2048, 4096, 100_000, 7]):
        data = bytes((i * 31 + j) % 251 for j in range(size))
        spool.apply(chunk(data, 0))
        if i % 3 == 2:  # Some are rolled back rather than committed.
            spool.apply(propose(spool.fragment, spool.registers))
            continue
        whole.update(data)
        committed += data
        proposal = spool.next_proposal()
        assert digest_of(proposal.sum) == whole.digest()
        assert spool.apply(propose(proposal)) == OK
    assert digest_of(spool.fragment.sum) == hashlib.sha1(committed).digest()
    assert read_all(spool, 0) == committed


def test_large_content_is_not_held_in_memory(spool: Spool, observer: Recorder) -> None:
    mib = 1 << 20
    total = 40 * mib
    block = os.urandom(mib)
    expected = hashlib.sha1()
    tracemalloc.start()
    try:
        for i in range(total // mib):
            # Vary the chunks cheaply so that misplaced writes change the sum.
            data = block if i % 2 else block[::-1]
            expected.update(data)
            spool.apply(chunk(data, spool.delta))
            if i % 8 == 7:
                assert spool.apply(propose(spool.next_proposal())) == OK
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A request's content and its copy in flight: a few MiB, never the 40 MiB of content.
    assert peak < 6 * mib
    assert spool.content_length == total
    assert digest_of(spool.fragment.sum) == expected.digest()

    spool.apply(propose(fragment(total, total)))
    [completed] = observer.completes
    reread = hashlib.sha1()
    for offset in range(0, total, 3 * mib):
        reread.update(completed.read(offset, 3 * mib))
    assert reread.digest() == expected.digest()


def test_reads_from_another_thread_see_only_committed_bytes(spool: Spool) -> None:
    stop = threading.Event()
    seen: list[int] = []
    failures: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            begin = spool.begin
            try:
                data = spool.read(begin, 1 << 16)
            except ValueError:
                continue  # The spool rolled on between our two looks at it.
            if data.strip(b"c"):
                failures.append(f"read pending bytes at {begin}: {data[:40]!r}")
                return
            seen.append(len(data))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(400):
            spool.apply(chunk(b"c" * (50 + i % 7), 0))
            spool.apply(propose(spool.next_proposal()))
            spool.apply(chunk(b"X" * 97, 0))  # Written to the file but never committed.
            spool.apply(propose(spool.fragment))
            if i % 50 == 49:
                spool.apply(propose(fragment(spool.end, spool.end)))
    finally:
        stop.set()
        thread.join()
    assert failures == []
    assert seen


def test_repr(spool: Spool) -> None:
    spool.apply(chunk(b"abc", 0))
    spool.apply(propose(fragment(0, 3, b"abc"), REG_FOO))
    spool.apply(chunk(b"de", 0))
    assert repr(spool) == "Spool<a/journal [0, 3) +2 pending, registers: reg=foo>"


# --- State machine against a model ---------------------------------------------------------------

REGISTER_CHOICES = [REG_EMPTY, REG_FOO, REG_BAR, label_set(("a", "1"), ("reg", "foo"))]
CODECS = [pb.NONE, pb.GZIP, pb.SNAPPY]


class SpoolModel:
    """The spool's rules over plain bytes: what a replica must believe after each request."""

    def __init__(self) -> None:
        self.begin = 0
        self.content = b""  # Committed content of the current fragment.
        self.pending = b""
        self.codec: pb.CompressionCodec = pb.NONE
        self.registers = REG_EMPTY
        self.completed: list[tuple[pb.Fragment, bytes, pb.LabelSet]] = []

    @property
    def end(self) -> int:
        return self.begin + len(self.content)

    def fragment(self, extra: bytes = b"") -> pb.Fragment:
        return fragment(self.begin, self.end + len(extra), self.content + extra, self.codec)

    def apply(self, proposal: pb.Fragment, registers: pb.LabelSet) -> bool:
        if proposal.journal != JOURNAL:
            return False
        if proposal.end > self.end + len(self.pending) or (
            proposal.end == self.end and proposal.begin == proposal.end
        ):
            if self.content:
                self.completed.append((self.fragment(), self.content, self.registers))
            if proposal.end > self.end:
                self.registers = registers
            self.begin, self.content, self.pending = proposal.end, b"", b""
            self.codec = proposal.compression_codec
        if proposal == self.fragment() and registers == self.registers:
            self.pending = b""
            return True
        if self.pending and proposal == self.fragment(self.pending):
            self.content += self.pending
            self.pending = b""
            self.registers = registers
            return True
        return False


class SpoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.observer = Recorder()
        self.spool = Spool(JOURNAL, self.observer)
        self.model = SpoolModel()

    @initialize(begin=st.integers(0, 1000), codec=st.sampled_from(CODECS))
    def synchronize(self, begin: int, codec: pb.CompressionCodec) -> None:
        self.propose(fragment(begin, begin, codec=codec), REG_EMPTY)

    def propose(self, proposal: pb.Fragment, registers: pb.LabelSet) -> None:
        response = self.spool.apply(propose(proposal, registers))
        ok = self.model.apply(proposal, registers)
        assert response.status == (pb.OK if ok else pb.PROPOSAL_MISMATCH)
        if not ok:
            assert response.fragment == self.model.fragment()
            assert response.registers == self.model.registers

    @rule(data=st.binary(max_size=300))
    def content(self, data: bytes) -> None:
        self.spool.apply(chunk(data, len(self.model.pending)))
        self.model.pending += data

    @precondition(lambda self: self.model.pending)
    @rule(offset=st.sampled_from([-1, 1, 1000]))
    def wrong_delta(self, offset: int) -> None:
        with pytest.raises(SpoolError):
            self.spool.apply(chunk(b"zz", len(self.model.pending) + offset))

    @rule(registers=st.sampled_from(REGISTER_CHOICES))
    def commit(self, registers: pb.LabelSet) -> None:
        self.propose(self.model.fragment(self.model.pending), registers)

    @rule()
    def rollback(self) -> None:
        self.propose(self.model.fragment(), self.model.registers)

    @rule(
        where=st.sampled_from(["end", "pending", "pending_end", "beyond"]),
        jitter=st.integers(-2, 2),
        codec=st.sampled_from(CODECS),
        registers=st.sampled_from(REGISTER_CHOICES),
    )
    def roll(
        self, where: str, jitter: int, codec: pb.CompressionCodec, registers: pb.LabelSet
    ) -> None:
        # Aim at the edges that decide whether a spool rolls: its end, and end plus pending.
        end, pending = self.model.end, len(self.model.pending)
        at = {
            "end": end,
            "pending": end + pending // 2,
            "pending_end": end + pending,
            "beyond": end + pending + 100,
        }[where]
        at = max(0, at + jitter)
        self.propose(fragment(at, at, codec=codec), registers)

    @rule(
        kind=st.sampled_from(["begin", "end", "sum", "codec", "journal", "beyond"]),
        registers=st.sampled_from(REGISTER_CHOICES),
    )
    def perturbed(self, kind: str, registers: pb.LabelSet) -> None:
        proposal = self.model.fragment(self.model.pending)
        if kind == "begin":
            proposal.begin += 1
        elif kind == "end":
            proposal.end -= 1
        elif kind == "sum":
            proposal.sum.part3 ^= 1
        elif kind == "codec":
            proposal.compression_codec = pb.ZSTANDARD
        elif kind == "journal":
            proposal.journal = "other/journal"
        else:  # Non-empty, and past everything we have: rolls, then mismatches.
            proposal.end += 5
        self.propose(proposal, registers)

    @invariant()
    def agrees_with_model(self) -> None:
        model, spool = self.model, self.spool
        assert spool.fragment == model.fragment()
        assert spool.registers == model.registers
        assert spool.delta == len(model.pending)
        assert spool.next_proposal() == model.fragment(model.pending)
        assert spool.read(model.begin, len(model.content) + 10) == model.content
        assert (spool.first_append_time is None) == (not model.content)

    @invariant()
    def completions_agree(self) -> None:
        assert len(self.observer.completes) == len(self.model.completed)
        for completed, (frag, content, registers) in zip(
            self.observer.completes, self.model.completed, strict=True
        ):
            if completed.closed:
                continue
            assert completed.fragment == frag
            assert completed.registers == registers
            assert completed.read(frag.begin, len(content) + 1) == content
            completed.close()

    def teardown(self) -> None:
        self.spool.close()
        self.observer.close()


SpoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSpoolMachine = SpoolMachine.TestCase


# --- Fragment helpers ----------------------------------------------------------------------------

EXAMPLE_SUM = pb.SHA1Sum(part1=0x0102030405060708, part2=0x090A0B0C0D0E0F10, part3=0x11121314)
EXAMPLE_NAME = "00000000499602d2-7fffffffffffffff-0102030405060708090a0b0c0d0e0f1011121314"


def test_sum_digest_layout() -> None:
    digest = bytes(range(1, 21))
    assert sum_from_digest(digest) == EXAMPLE_SUM
    assert digest_of(EXAMPLE_SUM) == digest
    assert sum_of(b"") == sum_from_digest(hashlib.sha1(b"").digest())
    with pytest.raises(ValueError, match="20 bytes"):
        sum_from_digest(b"short")


def test_empty_fragments_use_the_zero_sum(spool: Spool) -> None:
    assert digest_of(zero_sum()) == ZERO_DIGEST == bytes(20)
    assert digest_of(spool.fragment.sum) == ZERO_DIGEST
    assert spool.fragment.sum != sum_of(b"")
    assert content_name(spool.fragment) == "0000000000000000-0000000000000000-" + "0" * 40 + ".raw"


@given(st.binary(min_size=20, max_size=20))
def test_sum_round_trip(digest: bytes) -> None:
    assert digest_of(sum_from_digest(digest)) == digest


@pytest.mark.parametrize(
    "codec, extension",
    [
        (pb.NONE, ".raw"),
        (pb.GZIP, ".gz"),
        (pb.ZSTANDARD, ".zst"),
        (pb.SNAPPY, ".sz"),
        (pb.GZIP_OFFLOAD_DECOMPRESSION, ""),
    ],
)
def test_content_names(codec: pb.CompressionCodec, extension: str) -> None:
    f = pb.Fragment(
        journal=JOURNAL, begin=1234567890, end=2**63 - 1, sum=EXAMPLE_SUM, compression_codec=codec
    )
    assert codec_extension(codec) == extension
    assert content_name(f) == EXAMPLE_NAME + extension
    assert content_length(f) == 2**63 - 1 - 1234567890
    assert parse_content_name(content_name(f), journal=JOURNAL) == f


def test_codec_extension_aliases() -> None:
    assert codec_from_extension(".GZIP") == pb.GZIP
    assert codec_from_extension(".Zstandard") == pb.ZSTANDARD
    assert codec_from_extension(".SNAPPY") == pb.SNAPPY
    assert codec_from_extension(".gzod") == pb.GZIP_OFFLOAD_DECOMPRESSION
    assert codec_from_extension(".RAW") == pb.NONE
    with pytest.raises(ValidationError, match=r"unrecognized compression extension '\.lz4'"):
        codec_from_extension(".lz4")
    with pytest.raises(ValueError, match="no file extension"):
        codec_extension(pb.INVALID)


def test_content_path_and_relative_paths() -> None:
    f = pb.Fragment(
        journal="a/journal/name",
        begin=1234567890,
        end=2**63 - 1,
        sum=EXAMPLE_SUM,
        compression_codec=pb.GZIP,
    )
    name = content_name(f)
    assert content_path(f.journal, "", name) == f"a/journal/name/{EXAMPLE_NAME}.gz"
    assert content_path(f.journal, "a=1/b=2", name) == f"a/journal/name/a=1/b=2/{EXAMPLE_NAME}.gz"

    assert parse_relative_path(f.journal, name) == f
    f.path_postfix = "a=b/two=3"
    assert parse_relative_path(f.journal, f"a=b/two=3/{name}") == f

    empty = parse_relative_path(JOURNAL, "00000000499602d2-00000000499602d2-" + "0" * 40 + ".raw")
    assert empty == pb.Fragment(
        journal=JOURNAL, begin=1234567890, end=1234567890, sum=zero_sum(), compression_codec=pb.NONE
    )
    assert digest_of(empty.sum) == ZERO_DIGEST


@pytest.mark.parametrize(
    "name, problem",
    [
        (f"{EXAMPLE_NAME}-extra.gz", "is not a fragment name"),
        (EXAMPLE_NAME.replace("d2-", "XX-", 1) + ".gz", "is not a hexadecimal offset"),
        (EXAMPLE_NAME.replace("ff-", "XX-", 1) + ".gz", "is not a hexadecimal offset"),
        (EXAMPLE_NAME[:-2] + "XX.gz", "is not a 40-digit hex SHA-1 sum"),
        (EXAMPLE_NAME[:-2] + ".gz", "is not a 40-digit hex SHA-1 sum"),
        ("0x10-0000000000000020-" + "0" * 40 + ".gz", "is not a hexadecimal offset"),
        ("1_0-0000000000000020-" + "0" * 40 + ".gz", "is not a hexadecimal offset"),
        ("8000000000000000-8000000000000000-" + "0" * 40 + ".gz", "out of range"),
        ("0000000000000020-0000000000000010-" + "0" * 40 + ".gz", "is after end"),
        (EXAMPLE_NAME + ".lz4", "unrecognized compression extension"),
    ],
)
def test_parse_errors(name: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        parse_content_name(name, journal=JOURNAL)


def test_parse_validates_journal_and_postfix() -> None:
    with pytest.raises(ValidationError):
        parse_relative_path("a", EXAMPLE_NAME + ".gz")
    with pytest.raises(ValidationError, match="clean path"):
        parse_relative_path(JOURNAL, f"a=b//c/{EXAMPLE_NAME}.gz")
    # A directory whose name is not UTF-8, as a file store lists it (found by
    # tests/test_fuzz.py: protobuf refused the name with UnicodeEncodeError, which stopped
    # every listing of the journal's store).
    with pytest.raises(ValidationError, match="path_postfix"):
        parse_relative_path(JOURNAL, f"date=\udce9/{EXAMPLE_NAME}.gz")


HEX = "0123456789abcdefABCDEF"
store_paths = st.one_of(
    st.text(),
    st.text(st.sampled_from([*HEX, "-", "+", ".", "/", "=", "x", "\udcff", "é", " "])),
    st.builds(
        "{}{}-{}-{}{}".format,
        st.sampled_from(["", "date=2024-01-01/", "a//b/", "../", "./", "\udcff/", "é/", " /"]),
        st.text(st.sampled_from(["-", "+", *HEX]), min_size=1, max_size=17),
        st.text(st.sampled_from(["-", "+", *HEX]), min_size=1, max_size=17),
        st.text(st.sampled_from(HEX), min_size=39, max_size=41),
        st.sampled_from(["", ".raw", ".GZ", ".zst", ".sz", ".snappy", ".gzod", ".x", "."]),
    ),
)


@settings(max_examples=500)
@given(store_paths)
def test_any_path_found_in_a_store_is_a_fragment_or_one_line(relative: str) -> None:
    try:
        fragment = parse_relative_path(JOURNAL, relative)
    except ValidationError as err:
        assert "\n" not in str(err)
        return
    # What parses is a fragment that protobuf holds, and that is found again at its own path.
    fragment.SerializeToString()
    assert 0 <= fragment.begin <= fragment.end
    postfix, _, name = content_path("", fragment.path_postfix, content_name(fragment)).rpartition(
        "/"
    )
    assert parse_relative_path(JOURNAL, f"{postfix}/{name}" if postfix else name) == fragment


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    begin=st.integers(0, 2**62),
    length=st.integers(0, 2**40),
    digest=st.binary(min_size=20, max_size=20),
    codec=st.sampled_from(
        [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION]
    ),
    postfix=st.sampled_from(["", "a=1", "date=2024-01-01/hour=07"]),
)
def test_name_round_trip(
    begin: int, length: int, digest: bytes, codec: pb.CompressionCodec, postfix: str
) -> None:
    f = pb.Fragment(
        journal=JOURNAL,
        begin=begin,
        end=begin + length,
        sum=sum_from_digest(digest),
        compression_codec=codec,
        path_postfix=postfix,
    )
    relative = content_path("", postfix, content_name(f))
    assert parse_relative_path(JOURNAL, relative) == f
    assert content_path(JOURNAL, postfix, content_name(f)) == f"{JOURNAL}/{relative}"


# --- Registers -----------------------------------------------------------------------------------


def test_check_registers() -> None:
    locked = label_set(("owner", "me"))
    assert check_registers(parse_selector("owner=me"), locked)
    assert not check_registers(parse_selector("owner=you"), locked)
    assert check_registers(parse_selector("!other"), locked)
    assert not check_registers(parse_selector("!owner"), locked)
    assert check_registers(pb.LabelSelector(), locked)  # Nothing asked.
    assert check_registers(None, locked)
    # Empty registers are "unlocked": every selector matches, even one requiring a label.
    assert check_registers(parse_selector("owner=you"), REG_EMPTY)
    assert check_registers(parse_selector("owner"), REG_EMPTY)


def test_apply_register_updates() -> None:
    registers = label_set(("a", "1"), ("b", "1"), ("b", "2"), ("c", "x"))
    # Subtraction removes a name only when all its values are given exactly; union then replaces
    # the values of each name it carries.
    assert apply_register_updates(
        registers, union=label_set(("c", "y"), ("d", "z")), subtract=label_set(("a", "1"))
    ) == label_set(("b", "1"), ("b", "2"), ("c", "y"), ("d", "z"))
    assert apply_register_updates(registers, None, label_set(("b", "1"))) == registers
    assert apply_register_updates(registers, None, label_set(("b", "1"), ("b", "2"))) == label_set(
        ("a", "1"), ("c", "x")
    )
    # Subtract first: a label both subtracted and unioned ends up present.
    assert (
        apply_register_updates(
            registers, union=label_set(("a", "1")), subtract=label_set(("a", "1"))
        )
        == registers
    )
    assert apply_register_updates(REG_EMPTY, label_set(("owner", "me")), None) == label_set(
        ("owner", "me")
    )
    assert apply_register_updates(registers, None, None) == registers


@given(content=st.binary(max_size=300), delta=st.integers(min_value=0, max_value=2**62))
def test_encoded_content_is_what_protobuf_serializes(content: bytes, delta: int) -> None:
    # The pipeline writes content chunks pre-encoded; peers parse them as ReplicateRequests.
    expected = pb.ReplicateRequest(content=content, content_delta=delta).SerializeToString()
    assert wire.replicate_content(content, delta) == expected
    parsed = pb.ReplicateRequest.FromString(wire.replicate_content(content, delta))
    assert (parsed.content, parsed.content_delta) == (content, delta)


@given(offset=st.integers(min_value=0, max_value=2**62), content=st.binary(max_size=300))
def test_encoded_read_content_is_what_protobuf_serializes(offset: int, content: bytes) -> None:
    expected = pb.ReadResponse(offset=offset, content=content).SerializeToString()
    assert wire.read_content(offset, content) == expected
    with pytest.raises(ValueError, match="negative"):
        wire.read_content(-1, b"x")


def test_encoded_content_of_a_large_chunk() -> None:
    content = bytes(range(256)) * 512  # 128 KiB: a three-byte length varint.
    expected = pb.ReplicateRequest(content=content, content_delta=1 << 40).SerializeToString()
    assert wire.replicate_content(content, 1 << 40) == expected
    with pytest.raises(ValueError, match="negative"):
        wire.replicate_content(b"x", -1)
