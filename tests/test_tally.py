"""The Tally against the Sequencer: on random histories (transactions, re-sends, rollbacks,
producers restarted from older checkpoints, messages without a UUID, unknown flags), read from a
checkpoint taken anywhere, both commit the same messages in the same order and end in the same
producer states."""

from __future__ import annotations

import functools
import random

import pytest

from message.sequencer import COMMITTING, Envelope, Sequencer
from message.tally import REPLAY, Tally

J = "a/journal"


def history(rng: random.Random, length: int) -> list[Envelope]:
    """Messages of a few producers, 10 bytes each, as a journal holds them."""
    producers = [bytes([0, 0, 0, 0, 0, i + 1]) for i in range(rng.randint(1, 4))]
    clocks = dict.fromkeys(producers, 100)
    sent: dict[bytes, list[tuple[int, int]]] = {p: [] for p in producers}
    out: list[Envelope] = []
    at = 0
    while len(out) < length:
        p = rng.choice(producers)
        roll = rng.random()
        if roll < 0.05:
            clock, flags = 0, 0  # No UUID.
            producer = bytes(6)
        elif roll < 0.15 and sent[p]:
            clock, flags = rng.choice(sent[p])  # A re-send (a retried append).
            producer = p
        elif roll < 0.2:
            clocks[p] -= rng.randint(1, 30)  # Restarted from an older checkpoint.
            clock, flags = max(1, clocks[p]), 0x2
            producer = p
        else:
            clocks[p] += rng.randint(1, 3)
            clock = clocks[p]
            flags = rng.choices([0x1, 0x2, 0x0, 0x5], [70, 20, 8, 2])[0]
            producer = p
        if clock:
            sent[producer].append((clock, flags))
        out.append(Envelope(J, at, at + 10, producer, clock, flags, None))
        at += 10
    return out


def by_sequencer(envs: list[Envelope], start: int, seq: Sequencer) -> list[list[int]]:
    """Each commit's delivered begins (ACKs left out), feeding envs[start:] to `seq`."""
    commits: list[list[int]] = []
    for env in envs[start:]:
        if seq.queue_uncommitted(env) in COMMITTING:
            replay = seq.replay_range()
            if replay is not None:
                _, b, e = replay
                seq.start_replay([x for x in envs if b <= x.begin and x.end <= e])
            commits.append([d.begin for d in seq.dequeue_committed() if d.flags != 0x2])
    return commits


def by_tally(envs: list[Envelope], start: int, tally: Tally) -> list[list[int]]:
    """As `by_sequencer`; and no commit delivers a message before what `oldest_held()` said
    could be let go."""
    commits: list[list[int]] = []
    floor = 0
    for index, env in enumerate(envs[start:]):
        found = tally.add(index, env.producer, env.clock, env.flags, env.begin)
        if found is REPLAY:
            _, b, e = tally.replay_range()
            before, held = tally.replayed([x for x in envs if b <= x.begin and x.end <= e])
            commits.append([x.begin for x in before] + [envs[start + i].begin for i in held])
        elif found is not None:
            held = found
            commits.append([envs[start + i].begin for i in found])
        else:
            held = []
        assert all(i >= floor for i in held), (held, floor)
        oldest = tally.oldest_held()
        assert oldest is None or oldest >= floor
        floor = index + 1 if oldest is None else oldest
    return commits


def nonempty(commits: list[list[int]]) -> list[list[int]]:
    return [c for c in commits if c]


@pytest.mark.parametrize("seed", range(300))
def test_the_tally_commits_what_the_sequencer_does_from_any_checkpoint(seed: int) -> None:
    rng = random.Random(seed)
    envs = history(rng, rng.randint(1, 120))
    cut = rng.randint(0, len(envs))
    # A checkpoint at `cut`: a Sequencer fed everything before it (each commit dequeued).
    first = Sequencer(ring_size=rng.choice([0, 2, 8192]))
    by_sequencer(envs[:cut], 0, first)
    states = first.checkpoint()
    at = envs[cut].begin if cut < len(envs) else (envs[-1].end if envs else 0)

    seq = Sequencer(states, offsets={J: at}, ring_size=8192)
    tally = Tally(J, states, at)
    expected = by_sequencer(envs, cut, seq)
    assert nonempty(by_tally(envs, cut, tally)) == nonempty(expected)
    assert tally.checkpoint() == seq.checkpoint()


ZERO = bytes(6)  # The producer a message without a UUID is given.


def two_batches(envs: list[Envelope], cut: int) -> list[int]:
    """Begins delivered when envs are read in two batches cut before envs[cut], the second
    restored from the first's checkpoint (as the stream source's planner makes it); ACKs out."""
    out: list[int] = []
    first = Tally(J, {}, 0)
    for i, e in enumerate(envs[:cut]):
        found = first.add(i, e.producer, e.clock, e.flags, e.begin)
        assert found is not REPLAY
        out += [envs[j].begin for j in found or []]
    second = Tally(J, first.checkpoint(), envs[cut].begin)
    for i, e in enumerate(envs[cut:]):
        found = second.add(i, e.producer, e.clock, e.flags, e.begin)
        if found is REPLAY:
            _, b, end = second.replay_range()
            before, held = second.replayed([x for x in envs if b <= x.begin and x.end <= end])
            out += [x.begin for x in before] + [envs[cut + j].begin for j in held]
        else:
            out += [envs[cut + j].begin for j in found or []]
    return out


def envelopes_of(rows: list[tuple[bytes, int, int]]) -> list[Envelope]:
    return [Envelope(J, 10 * i, 10 * i + 10, p, c, f, None) for i, (p, c, f) in enumerate(rows)]


def test_a_message_without_a_clock_flagged_ack_is_an_ack_not_a_row() -> None:
    """A UUID of Clock 0 with the ACK flag: the Sequencer dequeues it as an ACK, which readers
    skip; the Tally leaves it out as it does every ACK (found by review: it was a row)."""
    producer = bytes.fromhex("0102030405a6")
    seq = Sequencer()
    assert seq.queue_uncommitted(envelopes_of([(producer, 0, 0x2)])[0]) in COMMITTING
    assert [d.is_ack for d in seq.dequeue_committed()] == [True]
    assert Tally(J, {}, 0).add(0, producer, 0, 0x2, 0) == []
    assert Tally(J, {}, 0).add(0, producer, 0, 0x0, 0) == [0]


def test_a_message_without_a_clock_is_delivered_once_whatever_the_cut() -> None:
    """Messages without a Clock are delivered when read, so a span replayed from before a cut
    does not deliver them again, nor do they reset what counts as a duplicate (found by review:
    a span of the all-zero producer, cut, delivered [10, 0, 10, 20])."""
    envs = envelopes_of([(ZERO, 41, 0x1), (ZERO, 0, 0x0), (ZERO, 41, 0x1), (ZERO, 45, 0x2)])
    for cut in range(1, len(envs)):
        assert sorted(two_batches(envs, cut)) == [0, 10], cut


# Runs at once (`add_run`) ------------------------------------------------------------------


def orderly(rng: random.Random, length: int, odd: float) -> list[Envelope]:
    """Messages of a few producers mostly in order (what add_run takes), now and then one that
    is not: a re-send, an OUTSIDE_TXN inside a transaction, a message without a UUID."""
    producers = [bytes([0, 0, 0, 0, 0, i + 1]) for i in range(rng.randint(1, 5))]
    clocks = dict.fromkeys(producers, 100)
    sent: dict[bytes, list[tuple[int, int]]] = {p: [] for p in producers}
    pending = dict.fromkeys(producers, False)
    out: list[Envelope] = []
    at = 0
    while len(out) < length:
        p = rng.choice(producers)
        if rng.random() < odd and sent[p]:
            clock, flags = rng.choice(sent[p]) if rng.random() < 0.7 else (0, 0)
            producer = p if clock else bytes(6)
        else:
            clocks[p] += rng.randint(1, 3)
            clock, flags, producer = clocks[p], rng.choices([1, 2, 0], [70, 22, 8])[0], p
            if flags == 0 and pending[p] and rng.random() >= odd:
                flags = 2  # (An OUTSIDE_TXN inside a transaction: now and then only.)
            pending[p] = flags == 1
        if clock:
            sent[producer].append((clock, flags))
        out.append(Envelope(J, at, at + 10, producer, clock, flags, None))
        at += 10
    return out


def by_runs(
    envs: list[Envelope], start: int, tally: Tally, rng: random.Random
) -> tuple[list[int], int, int]:
    """Begins delivered feeding envs[start:] to `tally` in runs of random lengths, each at once
    if add_run takes it, else one at a time; how many runs it declined, and how many there
    were."""
    import numpy as np

    out: list[int] = []
    held = envs[start:]
    declined = runs = 0
    i = 0
    while i < len(held):
        run = held[i : i + rng.randint(1, 40)]
        producers = sorted({e.producer for e in run})
        got = tally.add_run(
            i,
            producers,
            np.array([producers.index(e.producer) for e in run], np.int64),
            np.array([e.clock for e in run], np.int64),
            np.array([e.flags for e in run], np.int64),
            np.array([e.begin for e in run], np.int64),
        )
        runs += 1
        if got is not None:
            out += [held[j].begin for j in got.tolist()]
        else:
            declined += 1
            for k, env in enumerate(run, i):
                found = tally.add(k, env.producer, env.clock, env.flags, env.begin)
                if found is REPLAY:
                    _, b, e = tally.replay_range()
                    before, indices = tally.replayed(
                        [x for x in envs if b <= x.begin and x.end <= e]
                    )
                    out += [x.begin for x in before] + [held[j].begin for j in indices]
                elif found:
                    out += [held[j].begin for j in found]
        i += len(run)
    return out, declined, runs


@pytest.mark.parametrize("seed", range(300))
def test_runs_at_once_commit_what_one_at_a_time_does(seed: int) -> None:
    """add_run on runs of in-order (and sometimes not) histories, from a checkpoint taken
    anywhere: the same messages in the same order, and the same states, as add. In order, it
    takes every run but those where a span restored from the checkpoint commits (which may
    need what was read before the range)."""
    rng = random.Random(seed)
    odd = [0.0, 0.0, 0.01, 0.05][seed % 4]
    envs = orderly(rng, rng.randint(1, 300), odd) if seed % 5 else history(rng, rng.randint(1, 120))
    cut = rng.randint(0, len(envs))
    first = Tally(J, {}, 0)
    for i, env in enumerate(envs[:cut]):
        assert first.add(i, env.producer, env.clock, env.flags, env.begin) is not REPLAY
    states = first.checkpoint()
    at = envs[cut].begin if cut < len(envs) else (envs[-1].end if envs else 0)
    one, runs = Tally(J, states, at), Tally(J, states, at)
    want = [b for commit in by_tally(envs, cut, one) for b in commit]
    got, declined, count = by_runs(envs, cut, runs, rng)
    assert got == want
    assert runs.checkpoint() == one.checkpoint()
    assert runs.oldest_held() == one.oldest_held()
    if seed % 5 and not odd:
        restored = sum(1 for s in states.values() if s.begin != -1)
        assert declined <= restored, (declined, count)


def test_a_run_it_declines_changes_nothing() -> None:
    import numpy as np

    p = bytes([0, 0, 0, 0, 0, 1])
    tally = Tally(J, {}, 0)
    assert tally.add(0, p, 10, 1, 0) is None  # A span: Clock 10 pending.
    before = tally.checkpoint(), tally.oldest_held()
    # Clock 12 pending, then a re-send of 12: declined.
    col = functools.partial(np.array, dtype=np.int64)
    assert tally.add_run(1, [p], col([0, 0]), col([12, 12]), col([1, 1]), col([10, 20])) is None
    assert (tally.checkpoint(), tally.oldest_held()) == before
    # An OUTSIDE_TXN while Clock 10 is pending: declined (add logs it).
    assert tally.add_run(1, [p], col([0]), col([13]), col([0]), col([10])) is None
    assert (tally.checkpoint(), tally.oldest_held()) == before
    # In order: the ACK commits the held span and the run's.
    got = tally.add_run(1, [p], col([0, 0]), col([12, 14]), col([1, 2]), col([10, 20]))
    assert got is not None and got.tolist() == [0, 1]
    assert tally.oldest_held() is None
