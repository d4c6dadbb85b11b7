"""Fragment-parallel read-committed sequencing (gazctl/spark/replay.py), without Spark: for random
histories cut into random fragments, `sequence_fragment` per fragment plus `resolve` over their
summaries deliver exactly what one Sequencer over the whole history delivers, with the same
commit offsets (and so the same order)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gazctl.spark.replay import (
    FragmentSummary,
    is_withdrawn,
    resolve,
    sequence_fragment,
)
from message.sequencer import COMMITTING, Envelope, Sequencer

OUTSIDE, CONTINUE, ACK = 0, 1, 2
JOURNAL = "a/journal"


@dataclass
class Message:
    producer: bytes | None
    clock: int
    flags: int


@pytest.fixture(autouse=True)
def _quiet_sequencer() -> None:
    # Odd histories make the Sequencer log errors (by design); keep test output readable.
    logging.getLogger("message.sequencer").setLevel(logging.CRITICAL)


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """Producers publishing committed messages and transactions (committed, aborted, or left
    pending), re-appended batches, Clocks that go back, odd flags and messages without UUIDs."""
    producers = [bytes([p]) * 6 for p in range(draw(st.integers(1, 3)))]
    clocks = dict.fromkeys(producers, 100)
    out: list[Message] = []
    for _ in range(draw(st.integers(0, 40))):
        producer = draw(st.sampled_from(producers))
        action = draw(
            st.sampled_from(
                ["outside", "txn", "txn", "abort", "pending", "retry", "back", "odd", "none"]
            )
        )
        tick = draw(st.integers(1, 3))
        if action == "outside":
            for _ in range(draw(st.integers(1, 4))):
                clocks[producer] += tick
                out.append(Message(producer, clocks[producer], OUTSIDE))
        elif action in ("txn", "abort", "pending"):
            first = clocks[producer] + 1
            for _ in range(draw(st.integers(0, 5))):
                clocks[producer] += tick
                out.append(Message(producer, clocks[producer], CONTINUE))
            if action == "txn":
                # Usually above the span; sometimes equal to or inside it (a partial commit).
                clocks[producer] += draw(st.sampled_from([1, 1, 1, 0, -1]))
                out.append(Message(producer, clocks[producer], ACK))
            elif action == "abort":
                out.append(Message(producer, first - 1, ACK))
        elif action == "retry" and out:
            start = draw(st.integers(0, len(out) - 1))
            out += out[start : start + draw(st.integers(1, 12))]
        elif action == "back":
            clocks[producer] -= draw(st.integers(1, 20))
            out.append(Message(producer, clocks[producer], draw(st.sampled_from([0, 1, 2]))))
        elif action == "odd":
            clocks[producer] += tick
            out.append(Message(producer, clocks[producer], 3))
        else:
            out.append(Message(None, 0, 0))
    return out


def expected(history: list[Message], offsets: list[int]) -> list[tuple[int, int]]:
    """(row, commit offset) in delivery order, from one Sequencer over the whole history."""
    seq = Sequencer()
    out = []
    for i, m in enumerate(history):
        env = Envelope(JOURNAL, offsets[i], offsets[i + 1], m.producer or bytes(6), m.clock,
                       m.flags, i)  # fmt: skip
        if seq.queue_uncommitted(env) in COMMITTING:
            if (replay := seq.replay_range()) is not None:
                _, begin, end = replay
                seq.start_replay(
                    Envelope(
                        JOURNAL,
                        offsets[j],
                        offsets[j + 1],
                        h.producer or bytes(6),
                        h.clock,
                        h.flags,
                        j,
                    )
                    for j, h in enumerate(history)
                    if begin <= offsets[j] and offsets[j + 1] <= end
                )
            while (committed := seq.step()) is not None:
                out.append((committed.message, offsets[i]))
    return out


def by_fragments(
    history: list[Message], offsets: list[int], cuts: list[int]
) -> list[tuple[int, int]]:
    """(row, commit offset) as the Spark job decides them, ordered by commit offset, offset."""
    bounds = [0, *cuts, len(history)]
    summaries, parts = [], []
    for index, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        rows = range(lo, hi)
        sequenced = sequence_fragment(
            JOURNAL,
            [offsets[i] for i in rows],
            [offsets[i + 1] for i in rows],
            [history[i].producer for i in rows],
            [history[i].clock for i in rows],
            [history[i].flags for i in rows],
        )
        summaries.append(FragmentSummary(index, JOURNAL, offsets[lo], sequenced.producers))
        parts.append((lo, sequenced))
    resolutions = resolve(reversed(summaries))  # Any order: resolve orders them.
    out = []
    for index, (lo, sequenced) in enumerate(parts):
        resolution = resolutions.get(index)
        withdraw = resolution.withdraw if resolution else {}
        for row, commit in zip(sequenced.delivered, sequenced.commit_offsets, strict=True):
            m = history[lo + row]
            if not is_withdrawn(withdraw, m.producer, offsets[lo + row], m.clock):
                out.append((lo + row, commit))
        for side_row, commit in (resolution.side if resolution else {}).items():
            out.append((lo + sequenced.side[side_row], commit))
    return sorted(out, key=lambda rc: (rc[1], offsets[rc[0]]))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), data=st.data())
def test_fragments_deliver_what_one_sequencer_delivers(
    history: list[Message], data: st.DataObject
) -> None:
    sizes = data.draw(st.lists(st.integers(1, 30), min_size=len(history), max_size=len(history)))
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(history) - 1)), max_size=8))))
    cuts = [c for c in cuts if 0 < c < len(history)]
    assert by_fragments(history, offsets, cuts) == expected(history, offsets)


def test_a_transaction_across_three_fragments_commits_with_its_ack() -> None:
    p = b"\x01" * 6
    history = [Message(p, c, CONTINUE) for c in range(10, 16)] + [Message(p, 16, ACK)]
    offsets = list(range(0, 80, 10))
    got = by_fragments(history, offsets, [2, 4])
    assert got == [(i, 60) for i in range(7)]  # All committed by the ACK at offset 60.
    assert got == expected(history, offsets)


def test_a_retried_append_across_a_boundary_is_withdrawn() -> None:
    p = b"\x01" * 6
    history = [Message(p, c, OUTSIDE) for c in (1, 2, 3)] + [
        Message(p, c, OUTSIDE) for c in (2, 3, 4)
    ]
    offsets = list(range(0, 70, 10))
    # The second fragment alone would deliver 2 and 3 again: resolve withdraws them.
    assert by_fragments(history, offsets, [3]) == [(0, 0), (1, 10), (2, 20), (5, 50)]
    assert by_fragments(history, offsets, [3]) == expected(history, offsets)
