"""Read-committed replay in Spark: journal history from the fragment stores, sequenced exactly
as the read-committed iterator does, one task per fragment.

The Sequencer's state is per journal and producer: the last acknowledged Clock, the largest
Clock of the pending span, and the span's envelopes. A task reading one fragment does not know
the state its producers arrive with, but for each producer it does know everything after that
producer's first ACK_TXN in the fragment: an ACK leaves the same state whether it commits or
rolls back (nothing pending, the ACK's Clock acknowledged). So each fragment splits, per
producer, into:

* the *head*: the producer's messages before its first ACK (all of them, if it has none);
* the *first ACK*;
* the *middle*, sequenced right there by a Sequencer that starts at the first ACK;
* the *tail*: the span still pending when the fragment ends, committed or not by a later one.

`sequence_fragment` delivers the middle (and messages without a UUID) for good. Head
OUTSIDE_TXN messages are delivered *provisionally*: one commits iff its Clock is above both
the head's earlier OUTSIDE_TXN Clocks, which the task knows, and the producer's incoming
acknowledged Clock (just below its first Clock, for a producer never seen before), which it
does not. Head CONTINUE_TXN messages, first ACKs and tails go to a side table, undecided.

Each fragment also returns a summary per producer: a short stream of envelopes with the same
effect on the producer's state as the whole fragment (its head, each run of consecutive head
OUTSIDE_TXN messages reduced to the one with the largest Clock, its first ACK, a stand-in ACK
carrying the state the middle leaves, and its tail). `resolve` feeds the summaries of a
journal's fragments, in order, through one real Sequencer, which decides every side-table row
and tells the incoming acknowledged Clock of each fragment: a provisionally delivered message at
or below it is withdrawn (a retried append across a fragment boundary; rare). The summaries are
small: they hold the transactions that cross fragment boundaries, not the journal.

To Parquet, a first pass writes each fragment's delivered rows (a part file) and its side
table; after `resolve`, a second pass writes the side rows delivered (a second part file) and
rewrites the rare part file with withdrawals. Message content never leaves the Python tasks:
no shuffle, no Arrow round trip through the JVM. To a journal, the second pass reads each
fragment again and yields its committed rows, with no staging files.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from message.sequencer import COMMITTING, Envelope, QueueOutcome, Sequencer

COMMITTED_SCHEMA = (
    "journal STRING, offset LONG, end LONG, commit_offset LONG, producer STRING, clock LONG, "
    "flags INT, uuid STRING, content STRING"
)
CONTINUE_TXN = 0x1
ACK_TXN = 0x2
NOT_SIDE = -1  # A summary envelope standing for no side-table row (a run, the stand-in ACK).


@dataclass(slots=True)
class ProducerSummary:
    """A producer's part of a fragment, as `resolve` needs it."""

    head_end: int  # Offset of the first ACK (the head is below it), or the fragment's end.
    rows: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """Envelopes (side row or NOT_SIDE, begin, end, clock, flags), in journal order."""
    provisional_min: int = 0  # Smallest Clock provisionally delivered in the head (0: none).
    first_clock: int = 0  # The producer's first Clock in the fragment.


@dataclass(slots=True)
class Sequenced:
    """What `sequence_fragment` decided for one fragment."""

    delivered: list[int]  # Row indices delivered (ACKs included)...
    commit_offsets: list[int]  # ... and the offset of the envelope that committed each.
    side: list[int]  # Row indices left undecided, in journal order (side-table row i is side[i]).
    producers: dict[bytes, ProducerSummary]


@dataclass(slots=True)
class Resolution:
    """What `resolve` decided for one fragment."""

    side: dict[int, int] = field(default_factory=dict)  # Side row delivered -> commit offset.
    withdraw: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    """Producer -> (incoming acknowledged Clock, head end): head OUTSIDE_TXN messages below the
    head end with a Clock at or below it were delivered provisionally and are withdrawn."""


def sequence_fragment(
    journal: str,
    offsets: Sequence[int],
    ends: Sequence[int],
    producers: Sequence[bytes | None],
    clocks: Sequence[int],
    flags: Sequence[int],
) -> Sequenced:
    """Sequence one fragment's messages (columns, in journal order) as far as it alone can."""
    seq = Sequencer(ring_size=len(offsets) + 1)  # Every span in the ring: no replays.
    summaries: dict[bytes, ProducerSummary] = {}
    started: set[bytes] = set()  # Producers whose first ACK was read.
    head_max: dict[bytes, int] = {}  # Largest head OUTSIDE_TXN Clock, per producer.
    delivered: list[int] = []
    commit_offsets: list[int] = []
    side: list[int] = []
    fragment_end = ends[-1] if ends else 0
    queue, step = seq.queue_uncommitted, seq.step
    extend, begin_span = QueueOutcome.CONTINUE_EXTEND_SPAN, QueueOutcome.CONTINUE_BEGIN_SPAN
    columns = zip(offsets, ends, producers, clocks, flags, strict=True)
    for i, (offset, end, producer, clock, flag) in enumerate(columns):
        if clock == 0 or producer is None:  # No UUID: delivered, never de-duplicated.
            delivered.append(i)
            commit_offsets.append(offset)
            continue
        if producer in started:  # The hot path: most messages of most fragments.
            outcome = queue(
                _new_envelope(Envelope, (journal, offset, end, producer, clock, flag, i))
            )
            if outcome is extend or outcome is begin_span:
                continue
            if outcome in COMMITTING:
                while (env := step()) is not None:
                    delivered.append(env.message)
                    commit_offsets.append(offset)
            continue
        summary = summaries.get(producer)
        if summary is None:
            summary = summaries[producer] = ProducerSummary(fragment_end, first_clock=clock)
        row = (len(side), offset, end, clock, flag)
        if flag == ACK_TXN:  # The first ACK: the Sequencer starts here.
            started.add(producer)
            summary.head_end = offset
            summary.rows.append(row)
            side.append(i)
            seq.queue_uncommitted(Envelope(journal, offset, end, producer, clock, flag, i))
            while seq.step() is not None:
                pass  # It commits itself here; `resolve` decides whether it really does.
        elif flag == CONTINUE_TXN:
            summary.rows.append(row)
            side.append(i)
        else:  # OUTSIDE_TXN, or flags the Sequencer treats as such.
            if clock > head_max.get(producer, 0):
                head_max[producer] = clock
                delivered.append(i)
                commit_offsets.append(offset)
                if not summary.provisional_min:
                    summary.provisional_min = clock  # Later ones are larger.
            last = summary.rows[-1] if summary.rows else None
            if last is not None and last[0] == NOT_SIDE and last[4] not in (CONTINUE_TXN, ACK_TXN):
                if clock > last[3]:  # A run: only its largest Clock matters to the state.
                    summary.rows[-1] = (NOT_SIDE, offset, end, clock, flag)
            else:
                summary.rows.append((NOT_SIDE, offset, end, clock, flag))
    for producer in started:
        summary = summaries[producer]
        state = seq.producer_state(journal, producer)
        assert state is not None, "a started producer is tracked"
        first_ack = next(r for r in summary.rows if r[4] == ACK_TXN and r[0] != NOT_SIDE)
        if state.last_ack != first_ack[3]:
            # Stand-in for the middle: an ACK of the Clock it leaves acknowledged, which sets
            # that state whether it commits or rolls back.
            summary.rows.append((NOT_SIDE, first_ack[1], first_ack[2], state.last_ack, ACK_TXN))
        for env in seq.pending_envelopes(journal, producer):
            summary.rows.append((len(side), env.begin, env.end, env.clock, env.flags))
            side.append(env.message)
    return Sequenced(delivered, commit_offsets, side, summaries)


_new_envelope = tuple.__new__  # Builds an Envelope without NamedTuple's keyword handling.


@dataclass(slots=True)
class FragmentSummary:
    """A fragment's identity and its producers' summaries, sent to the driver."""

    index: int
    journal: str
    begin: int
    producers: dict[bytes, ProducerSummary]


def resolve(fragments: Iterable[FragmentSummary]) -> dict[int, Resolution]:
    """Decide every fragment's side-table rows and withdrawals, by feeding the summaries of
    each journal's fragments, in journal order, through one Sequencer."""
    ordered = sorted(fragments, key=lambda f: (f.journal, f.begin))
    size = sum(len(p.rows) for f in ordered for p in f.producers.values())
    seq = Sequencer(ring_size=size + 1)  # Every summary envelope in the ring: no replays.
    out: dict[int, Resolution] = {f.index: Resolution() for f in ordered}
    for fragment in ordered:
        journal = fragment.journal
        for producer, summary in fragment.producers.items():
            state = seq.producer_state(journal, producer)
            # A producer's first message ever starts it just below its own Clock.
            last_ack = summary.first_clock - 1 if state is None else state.last_ack
            if summary.provisional_min and summary.provisional_min <= last_ack:
                out[fragment.index].withdraw[producer] = (last_ack, summary.head_end)
            for side_row, begin, end, clock, flag in summary.rows:
                env = Envelope(
                    journal, begin, end, producer, clock, flag, (fragment.index, side_row)
                )
                if seq.queue_uncommitted(env) not in COMMITTING:
                    continue
                while (committed := seq.step()) is not None:
                    index, row = committed.message
                    if row != NOT_SIDE:
                        out[index].side[row] = begin
    return {index: r for index, r in out.items() if r.side or r.withdraw}


def is_withdrawn(
    withdraw: dict[bytes, tuple[int, int]], producer: bytes | None, offset: int, clock: int
) -> bool:
    """Whether a row delivered by `sequence_fragment` is withdrawn by its Resolution."""
    found = withdraw.get(producer) if producer is not None else None
    return found is not None and clock != 0 and offset < found[1] and clock <= found[0]


# ---- Spark tasks -----------------------------------------------------------------------------


def _sequenced(partition: Any) -> tuple[Any, Sequenced, list[bytes | None]] | None:
    """A fragment's message table (pyarrow), what `sequence_fragment` decided, and each row's
    producer; None for a fragment holding no messages."""
    import numpy as np
    import pyarrow as pa

    from gazctl.spark.source import GazetteReader

    batches = list(GazetteReader({}).read(partition))
    if not batches:
        return None
    table = pa.Table.from_batches(batches)
    # Each row's ProducerID as bytes (the Sequencer's key), converted once per producer.
    encoded = table.column("producer").dictionary_encode().combine_chunks()
    ids = [bytes.fromhex(text) for text in encoded.dictionary.to_pylist()]
    index = encoded.indices.fill_null(len(ids)).to_numpy()
    producers = np.array([*ids, None], dtype=object)[index].tolist()
    # A fragment's envelopes live until it is sequenced and hold no cycles: collecting garbage
    # meanwhile would only scan them, again and again.
    collecting = gc.isenabled()
    gc.disable()
    try:
        sequenced = sequence_fragment(
            table.column("journal")[0].as_py(),
            table.column("offset").to_pylist(),
            table.column("end").to_pylist(),
            producers,
            table.column("clock").to_pylist(),
            table.column("flags").to_pylist(),
        )
    finally:
        if collecting:
            gc.enable()
    return table, sequenced, producers


def _committed(table: Any, rows: Sequence[int], commits: Sequence[int], keep_acks: bool) -> Any:
    """The rows (with their commit offsets) in commit order, ACKs dropped unless kept."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = table.take(pa.array(rows, pa.int64()))
    out = out.append_column("commit_offset", pa.array(commits, pa.int64()))
    if not keep_acks:
        out = out.filter(pc.not_equal(out.column("flags"), ACK_TXN))
    out = out.take(pc.sort_indices(out, [("commit_offset", "ascending"), ("offset", "ascending")]))
    return out.select(arrow_committed_schema().names)


def part_paths(staging: str, index: int) -> tuple[str, str, str]:
    """A fragment's part file, late part file and side table, in a staging directory."""
    import os

    name = f"part-{index:05d}"
    return (
        os.path.join(staging, f"{name}.parquet"),
        os.path.join(staging, f"{name}-late.parquet"),
        os.path.join(staging, "_side", f"{name}.parquet"),
    )


def _summary(index: int, partition: Any, sequenced: Sequenced | None) -> FragmentSummary:
    from broker.protocol import protocol_pb2 as pb

    fragment = pb.Fragment.FromString(partition.fragment)
    producers = sequenced.producers if sequenced is not None else {}
    # A split of a fragment is sequenced as a fragment of its own, in journal order by where
    # it begins: what `resolve` decides does not depend on where fragments were cut.
    return FragmentSummary(index, fragment.journal, partition.begin, producers)


def summary_of(index: int, partition: Any) -> FragmentSummary:
    """A fragment's summary for `resolve`, with nothing written."""
    found = _sequenced(partition)
    return _summary(index, partition, found[1] if found is not None else None)


def first_pass(
    index: int, partition: Any, staging: str, keep_acks: bool
) -> tuple[FragmentSummary, int]:
    """Parquet, pass one (a task per fragment): write the rows delivered here and the side
    table; return the summary for `resolve` and how many rows were written."""
    import pyarrow.parquet as pq

    found = _sequenced(partition)
    if found is None:
        return _summary(index, partition, None), 0
    table, sequenced, _ = found
    part, _, side = part_paths(staging, index)
    out = _committed(table, sequenced.delivered, sequenced.commit_offsets, keep_acks)
    if out.num_rows:
        pq.write_table(out, part)
    if sequenced.side:
        import pyarrow as pa

        pq.write_table(table.take(pa.array(sequenced.side, pa.int64())), side)
    return _summary(index, partition, sequenced), out.num_rows


def second_pass(index: int, resolution: Resolution, staging: str, keep_acks: bool) -> int:
    """Parquet, pass two (a task per fragment with a Resolution): write the side rows
    delivered, and withdraw rows from the part file; returns the change in rows."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    part, late, side = part_paths(staging, index)
    change = 0
    if resolution.side:
        rows = sorted(resolution.side)
        out = _committed(pq.read_table(side), rows, [resolution.side[r] for r in rows], keep_acks)
        if out.num_rows:
            pq.write_table(out, late)
        change += out.num_rows
    if resolution.withdraw:
        table = pq.read_table(part)
        keep = [
            not is_withdrawn(
                resolution.withdraw, bytes.fromhex(producer) if producer else None, offset, clock
            )
            for producer, offset, clock in zip(
                table.column("producer").to_pylist(),
                table.column("offset").to_pylist(),
                table.column("clock").to_pylist(),
                strict=True,
            )
        ]
        kept = table.filter(pa.array(keep, pa.bool_()))
        change -= table.num_rows - kept.num_rows
        if kept.num_rows:
            pq.write_table(kept, part + ".tmp")
            os.replace(part + ".tmp", part)
        else:
            os.remove(part)
    return change


def committed_rows(
    partition: Any, resolution: Resolution | None, keep_acks: bool
) -> Iterable[dict[str, Any]]:
    """A fragment's committed rows, decided in full (the journal target's single pass)."""
    found = _sequenced(partition)
    if found is None:
        return []
    table, sequenced, producers = found
    offsets = table.column("offset").to_pylist()
    clocks = table.column("clock").to_pylist()
    withdraw = resolution.withdraw if resolution else {}
    rows, commits = [], []
    for row, commit in zip(sequenced.delivered, sequenced.commit_offsets, strict=True):
        if not is_withdrawn(withdraw, producers[row], offsets[row], clocks[row]):
            rows.append(row)
            commits.append(commit)
    for side_row, commit in (resolution.side if resolution else {}).items():
        rows.append(sequenced.side[side_row])
        commits.append(commit)
    out: list[dict[str, Any]] = _committed(table, rows, commits, keep_acks).to_pylist()
    return out


def arrow_committed_schema(binary: bool = False) -> Any:
    import pyarrow as pa

    types = {"STRING": pa.string(), "LONG": pa.int64(), "INT": pa.int32()}
    fields = []
    for column in COMMITTED_SCHEMA.split(", "):
        name, kind = column.split()
        fields.append(pa.field(name, pa.binary() if binary and name == "content" else types[kind]))
    return pa.schema(fields)
