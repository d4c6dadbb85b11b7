"""A replication connection's process: source -> target, run for good at the target's writer.

Round after round (`replicate_round`, from a `SourceReader` following the source's journal): the
events after the target's progress for the source, filtered by the target's CVV and the
connection's filter, written with the progress in one append; when there is nothing new it waits
for the source to grow (a blocking read).
"""

from __future__ import annotations

import asyncio

from replication.journal_log import JournalEventLog, SourceReader, replicate_round
from replication.location import EventFilter

__all__ = ["SourceReader", "run_connection"]


async def run_connection(
    source: str,
    reader: SourceReader,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    *,
    limit: int = 1000,
    rounds: int | None = None,
    stats: dict[str, int] | None = None,
) -> int:
    """Replicate source -> target until cancelled (or for `rounds` rounds); events written.
    `stats` is `replicate_round`'s."""
    written = 0
    done = 0
    while rounds is None or done < rounds:
        done += 1
        await reader.refresh()
        stored = await replicate_round(source, reader, target, replication_filter, limit, stats)
        if stored is None:
            if rounds is None:
                await reader.refresh(block=True)  # Until the source grows.
            continue
        written += len(stored)
        await asyncio.sleep(0)
    return written
