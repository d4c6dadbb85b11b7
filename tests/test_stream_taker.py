"""The executors' side of a planned batch: a Taker cuts the plan's rows out of the range's
bytes as they are read. On random ranges (frames of random sizes, rows delivered after later
frames as transactions are, chunks cut anywhere, reads retried over bytes already read, holes
skipped), it gives each row whose frame was read once, in the plan's order, with its content
and UUID columns, and names the rows a hole took."""

from __future__ import annotations

import itertools
import random

import pytest

from gazctl.spark.columns import BATCH_ROWS, json_fields
from gazctl.spark.stream_plan import NO_PRODUCER, Plan
from gazctl.spark.stream_source import Taker, planned_batch, stream_arrow_schema
from message.sequencer import Envelope
from message.uuid import text_of

J = "a/journal"


def frames(rng: random.Random, base: int, count: int) -> list[tuple[int, int, bytes]]:
    """(begin, end, bytes) of frames end to end from `base`, each ending in a newline."""
    out = []
    at = base
    for i in range(count):
        data = f"{i}:".encode() + bytes(rng.choices(b"abcxyz\r ", k=rng.randint(0, 30))) + b"\n"
        out.append((at, at + len(data), data))
        at += len(data)
    return out


def plan_rows(rng: random.Random, held: list[tuple[int, int, bytes]]) -> list[Envelope]:
    """Some frames as rows in delivery order: each delivered at a commit at or after it."""
    producers = [bytes([0, 0, 0, 0, 0, i + 1]) for i in range(3)] + [NO_PRODUCER]
    chosen = []
    for i, (begin, end, _) in enumerate(held):
        if rng.random() < 0.6:
            commit = i + (rng.randint(0, 40) if rng.random() < 0.3 else 0)
            producer = rng.choice(producers)
            clock = 0 if producer == NO_PRODUCER else rng.randint(1, 1 << 62)
            flags = 0 if producer == NO_PRODUCER else rng.choice([0, 1, 2])
            chosen.append((min(commit, len(held) - 1), begin, end, producer, clock, flags))
    chosen.sort(key=lambda c: (c[0], c[1]))
    return [Envelope(J, b, e, p, c, f, None) for _, b, e, p, c, f in chosen]


def chunks(
    rng: random.Random, data: bytes, base: int, holes: bool
) -> tuple[list[tuple[int, bytes]], list[tuple[int, int]]]:
    """The bytes [base, base + len(data)) as a read gives them: cut anywhere, some parts given
    twice (a retried read), and with `holes` some parts never given (and said so)."""
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 30))))
    bounds = [0, *cuts, len(data)]
    out: list[tuple[int, bytes]] = []
    skipped: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(bounds):
        if holes and rng.random() < 0.15:
            skipped.append((base + a, base + b))
            continue
        if out and out[-1][0] - base + len(out[-1][1]) == a and rng.random() < 0.1:
            back = max(out[-1][0] - base, a - rng.randint(1, 20))  # Again, from a little before.
            out.append((base + back, data[back:b]))
        else:
            out.append((base + a, data[a:b]))
    return out, skipped


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", range(150))
def test_a_taker_gives_each_read_row_once_in_plan_order(seed: int, holes: bool) -> None:
    rng = random.Random(seed)
    base = rng.randint(0, 5000)
    held = frames(rng, base, rng.randint(1, 300))
    rows = plan_rows(rng, held)
    plan = Plan.of(rows, [])
    data = b"".join(f[2] for f in held)
    by_begin = {b: d for b, _, d in held}
    given, skipped = chunks(rng, data, base, holes)

    taker = Taker(plan, base)
    schema, fields = stream_arrow_schema(), json_fields(None)
    got = []
    for offset, content in given:
        for first, stop, special in taker.feed(offset, content):
            assert stop - first <= BATCH_ROWS
            got += planned_batch(J, taker, first, stop, special, schema, fields).to_pylist()
    if taker.rest():  # Only a hole at the end leaves rows not taken: the rest, now.
        assert skipped and skipped[-1][1] == base + len(data)
        for first, stop, special in taker.finish(base + len(data)):
            got += planned_batch(J, taker, first, stop, special, schema, fields).to_pylist()
    assert not taker.rest()

    # Every row once, in order, except those whose frames a hole touched.
    def lost(env: Envelope) -> bool:
        return any(a < env.end and env.begin < b for a, b in skipped)

    want = [env for env in rows if not lost(env)]
    assert [r["offset"] for r in got] == [env.begin for env in want]
    for row, env in zip(got, want, strict=True):
        assert row["end"] == env.end
        assert row["content"] == by_begin[env.begin][:-1].decode()
        assert row["clock"] == env.clock and row["flags"] == env.flags
        if env.clock:
            assert row["uuid"] == text_of(env.producer.hex(), env.clock, env.flags)
            assert row["producer"] == env.producer.hex()
        else:
            assert row["uuid"] is None and row["producer"] is None


def test_a_taker_holds_only_from_the_oldest_row_still_to_come() -> None:
    """A long range read in small chunks, rows delivered as read: the bytes held stay a few
    chunks' worth, not the range."""
    rng = random.Random(7)
    held = frames(rng, 0, 5000)
    plan = Plan.of([Envelope(J, b, e, NO_PRODUCER, 0, 0, None) for b, e, _ in held], [])
    data = b"".join(f[2] for f in held)
    taker = Taker(plan, 0)
    most = 0
    for at in range(0, len(data), 512):
        for _ in taker.feed(at, data[at : at + 512]):
            pass
        most = max(most, len(taker.buf))
    assert not taker.rest() and most < 4 * 512
