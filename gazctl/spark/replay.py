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
_ENVELOPE_COLUMNS = ("journal", "offset", "end", "producer", "clock", "flags")


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


def sequence_group(frame: Any) -> Any:
    """applyInPandas over one (journal, producer) group: its committed rows, with
    `commit_offset`, in delivery order."""
    import pandas as pd  # type: ignore[import-untyped]

    frame = frame.sort_values("offset", kind="stable").reset_index(drop=True)
    envelopes = [
        Envelope(
            journal,
            int(offset),
            int(end),
            bytes.fromhex(producer) if isinstance(producer, str) else _NO_PRODUCER,
            int(clock),
            int(flags),
            index,
        )
        for index, (journal, offset, end, producer, clock, flags) in enumerate(
            zip(*(frame[name] for name in _ENVELOPE_COLUMNS), strict=True)
        )
    ]
    positions = list(committed_positions(envelopes))
    out = frame.iloc[[index for index, _ in positions]].copy()
    out["commit_offset"] = pd.Series([at for _, at in positions], index=out.index, dtype="int64")
    return out[[column.split()[0] for column in COMMITTED_SCHEMA.split(", ")]]


def committed(messages: Any) -> Any:
    """The read-committed DataFrame (ACK rows included, flags 2) of a message DataFrame of the
    gazette data source."""
    return messages.groupBy("journal", "producer").applyInPandas(sequence_group, COMMITTED_SCHEMA)
