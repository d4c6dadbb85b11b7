"""Read-committed replay in Spark: journal history from the fragment stores, sequenced exactly
as the read-committed iterator does, at scale.

The Sequencer's state is per journal and producer, and nothing one producer writes changes
what another's messages mean. So the messages are grouped by (journal, producer), and each
group runs through the very `Sequencer` the iterator uses, in offset order, with a ring that
holds the whole group (no replays are needed). Groups run in parallel; no journal is collected
into one task. Each committed message keeps the offset of the envelope that committed it
(`commit_offset`: its ACK, or itself outside a transaction): ordering by journal, commit offset
and offset gives the order in which the iterator delivers them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from broker.message.sequencer import Envelope, QueueOutcome, Sequencer

COMMITTED_SCHEMA = (
    "journal STRING, offset LONG, end LONG, commit_offset LONG, producer STRING, clock LONG, "
    "flags INT, uuid STRING, content STRING"
)
ACK_TXN = 0x2
_COMMITTING = {
    QueueOutcome.OUTSIDE_COMMIT,
    QueueOutcome.ACK_EMPTY,
    QueueOutcome.ACK_COMMIT_RING,
    QueueOutcome.ACK_COMMIT_REPLAY,
}
_NO_PRODUCER = bytes(6)


def committed_positions(envelopes: list[Envelope]) -> Iterator[tuple[int, int]]:
    """For envelopes of one journal and producer in offset order (each `message` its index),
    the (index, commit offset) of each committed one, in delivery order (ACKs included)."""
    seq = Sequencer(ring_size=len(envelopes) + 1)
    for envelope in envelopes:
        if seq.queue_uncommitted(envelope) not in _COMMITTING:
            continue
        if seq.replay_range() is not None:  # The ring holds the whole group: never.
            raise AssertionError("a replay was needed with a ring holding every envelope")
        while (committed := seq.step()) is not None:
            yield committed.message, envelope.begin


def sequence_group(table: Any) -> Any:
    """applyInArrow over one (journal, producer) group (a pyarrow Table): its committed rows,
    with `commit_offset`, in delivery order. Only the numeric columns become Python values;
    the content stays in Arrow buffers and is selected by index."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if table.num_rows == 0:
        return pa.table(
            {name: pa.array([], type) for name, type in _arrow_committed_schema().items()}
        )
    table = table.take(pc.sort_indices(table, sort_keys=[("offset", "ascending")]))
    journal = table.column("journal")[0].as_py()
    producer_hex = table.column("producer")[0].as_py()
    producer = bytes.fromhex(producer_hex) if producer_hex else _NO_PRODUCER
    envelopes = [
        _new_envelope(Envelope, (journal, offset, end, producer, clock, flags, index))
        for index, (offset, end, clock, flags) in enumerate(
            zip(
                table.column("offset").to_pylist(),
                table.column("end").to_pylist(),
                table.column("clock").to_pylist(),
                table.column("flags").to_pylist(),
                strict=True,
            )
        )
    ]
    positions = list(committed_positions(envelopes))
    out = table.take(pa.array([index for index, _ in positions], pa.int64()))
    out = out.append_column("commit_offset", pa.array([at for _, at in positions], pa.int64()))
    return out.select(list(_arrow_committed_schema()))


def _arrow_committed_schema() -> dict[str, Any]:
    import pyarrow as pa

    types = {"STRING": pa.string(), "LONG": pa.int64(), "INT": pa.int32()}
    return {column.split()[0]: types[column.split()[1]] for column in COMMITTED_SCHEMA.split(", ")}


_new_envelope = tuple.__new__


def committed(messages: Any) -> Any:
    """The read-committed DataFrame (ACK rows included, flags 2) of a message DataFrame of the
    gazette data source."""
    return messages.groupBy("journal", "producer").applyInArrow(sequence_group, COMMITTED_SCHEMA)
