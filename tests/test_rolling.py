"""When the spool rolls to a new fragment (length, codec, flush_interval bucket, a larger offset),
and the compressed form the primary builds as content commits."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from broker.append_fsm import maybe_roll_fragment
from broker.fragment import CompletedFragment, Spool, codecs, sum_of
from broker.protocol import protocol_pb2 as pb

JOURNAL = "a/journal"
T0 = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)


class Completions:
    def __init__(self) -> None:
        self.completed: list[CompletedFragment] = []

    def on_commit(self, fragment: pb.Fragment) -> None:
        pass

    def on_complete(self, completed: CompletedFragment) -> None:
        self.completed.append(completed)


@pytest.fixture
def completions() -> Iterator[Completions]:
    c = Completions()
    yield c
    for completed in c.completed:
        completed.close()


def new_spool(completions: Completions, tmp_path: Path, clock: datetime = T0) -> Spool:
    return Spool(JOURNAL, completions, directory=tmp_path, clock=lambda: clock)


def append(spool: Spool, content: bytes, primary: bool = True) -> None:
    """Commit `content` as the primary's pipeline does: a chunk, then the proposal."""
    spool.apply(pb.ReplicateRequest(content=content, content_delta=0), primary=primary)
    response = spool.apply(
        pb.ReplicateRequest(proposal=spool.next_proposal(), registers=spool.registers),
        primary=primary,
    )
    assert response.status == pb.OK


def roll(spool: Spool, proposal: pb.Fragment, primary: bool = True) -> None:
    response = spool.apply(pb.ReplicateRequest(proposal=proposal), primary=primary)
    assert response.status == pb.OK


def spec(
    length: int = 1 << 20, codec: pb.CompressionCodec = pb.NONE, flush: int = 0
) -> pb.JournalSpec.Fragment:
    out = pb.JournalSpec.Fragment(length=length, compression_codec=codec)
    out.flush_interval.seconds = flush
    return out


def test_an_empty_spool_rolls_to_the_specs_codec(completions: Completions, tmp_path: Path) -> None:
    with new_spool(completions, tmp_path) as spool:
        proposal = maybe_roll_fragment(spool, 0, spec(codec=pb.ZSTANDARD))
        assert (proposal.begin, proposal.end, proposal.compression_codec) == (0, 0, pb.ZSTANDARD)


def test_rolls_only_past_the_target_length(completions: Completions, tmp_path: Path) -> None:
    with new_spool(completions, tmp_path) as spool:
        roll(spool, maybe_roll_fragment(spool, 0, spec(length=1024)))
        append(spool, b"x" * 1024)
        # At the length, not over it: the fragment continues.
        assert maybe_roll_fragment(spool, 0, spec(length=1024)) == spool.fragment
        append(spool, b"y")
        proposal = maybe_roll_fragment(spool, 0, spec(length=1024))
        assert (proposal.begin, proposal.end) == (1025, 1025)
        roll(spool, proposal)
        # The completed fragment holds both appends whole: a roll never splits an append.
        (completed,) = completions.completed
        assert (completed.fragment.begin, completed.fragment.end) == (0, 1025)


def test_rolls_when_the_codec_changes(completions: Completions, tmp_path: Path) -> None:
    with new_spool(completions, tmp_path) as spool:
        roll(spool, maybe_roll_fragment(spool, 0, spec(codec=pb.NONE)))
        append(spool, b"hello")
        assert maybe_roll_fragment(spool, 0, spec(codec=pb.NONE)) == spool.fragment
        proposal = maybe_roll_fragment(spool, 0, spec(codec=pb.GZIP))
        assert (proposal.begin, proposal.compression_codec) == (5, pb.GZIP)


def test_rolls_when_the_flush_interval_bucket_changes(
    completions: Completions, tmp_path: Path
) -> None:
    # The first append lands at 07:08:09; hourly buckets start on the hour (UTC, from the epoch).
    with new_spool(completions, tmp_path, clock=T0) as spool:
        hourly = spec(flush=3600)
        roll(spool, maybe_roll_fragment(spool, 0, hourly))
        append(spool, b"hello")
        same_hour = T0.replace(minute=59, second=59)
        assert maybe_roll_fragment(spool, 0, hourly, now=same_hour) == spool.fragment
        next_hour = T0.replace(hour=8, minute=0, second=0)
        assert maybe_roll_fragment(spool, 0, hourly, now=next_hour).begin == 5
        # Without a flush interval, time never rolls a fragment.
        later = T0 + timedelta(days=3)
        assert maybe_roll_fragment(spool, 0, spec(), now=later) == spool.fragment


def test_rolls_forward_to_a_larger_offset(completions: Completions, tmp_path: Path) -> None:
    with new_spool(completions, tmp_path) as spool:
        roll(spool, maybe_roll_fragment(spool, 0, spec()))
        append(spool, b"abc")
        proposal = maybe_roll_fragment(spool, 100, spec())
        assert (proposal.begin, proposal.end) == (100, 100)
        with pytest.raises(AssertionError, match="behind"):
            maybe_roll_fragment(spool, 2, spec())


@pytest.mark.parametrize("codec", [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY])
@pytest.mark.parametrize("primary", [True, False])
def test_completed_fragments_compress_to_their_codec(
    completions: Completions, tmp_path: Path, codec: pb.CompressionCodec, primary: bool
) -> None:
    # Content spanning several compression batches, committed in uneven appends. The primary
    # compresses as content commits; a replica only when asked for the compressed form.
    pieces = [hashlib.sha256(bytes([i])).digest() * (4096 * (i % 7 + 1)) for i in range(24)]
    content = b"".join(pieces)
    assert len(content) > 2 * codecs.BATCH_SIZE
    with new_spool(completions, tmp_path) as spool:
        roll(spool, maybe_roll_fragment(spool, 0, spec(length=1 << 30, codec=codec)), primary)
        for piece in pieces:
            append(spool, piece, primary)
        roll(spool, pb.Fragment(journal=JOURNAL, begin=len(content), end=len(content)), primary)
    (completed,) = completions.completed
    assert completed.fragment.sum == sum_of(content)
    assert completed.fragment.compression_codec == codec
    file, length = completed.compressed(str(tmp_path))
    file.seek(0)
    data = file.read()
    assert len(data) == length
    assert codecs.decompress(codec, data) == content
    if codec == pb.NONE:
        assert data == content
    else:
        assert length < len(content)
    # Asking again gives the same finished file.
    _, again_length = completed.compressed(str(tmp_path))
    assert again_length == length
