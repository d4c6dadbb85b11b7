"""A replication connection's process: source -> target, run for good at the target's writer.

Round after round (`replicate_round`, from a `SourceReader` following the source's journal): the
events after the target's progress for the source, filtered by the target's CVV and the
connection's filter, written with the progress in one append that commits while the next round
reads; when there is nothing new it waits for the source to grow (a blocking read).
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable
from typing import Any

from replication.journal_log import JournalEventLog, SourceReader, replicate_round
from replication.model import EventFilter

__all__ = ["SourceReader", "run_connection"]

_IN_FLIGHT = 16  # Rounds whose appends may commit while the next round reads and stages.


async def run_connection(
    source: str,
    reader: SourceReader,
    target: JournalEventLog,
    replication_filter: EventFilter | None = None,
    *,
    limit: int = 1000,
    rounds: int | None = None,
    through: int | None = None,
    stats: dict[str, int] | None = None,
) -> int:
    """Replicate source -> target until cancelled (or for `rounds` rounds, or until the target
    has read the source `through` that sequence number); events written.
    Each round's append commits while the next rounds read (up to `_IN_FLIGHT`). `stats` is
    `replicate_round`'s."""
    written = 0
    done = 0
    pending: collections.deque[Awaitable[Any]] = collections.deque()
    try:
        while rounds is None or done < rounds:
            if through is not None and target.progress.get(source, 0) >= through:
                break
            done += 1
            if reader.last_seq <= target.progress.get(source, 0):
                await reader.refresh()  # Read on only once what was read is replicated.
            staged = await replicate_round(
                source, reader, target, replication_filter, limit, stats, wait=False
            )
            if staged is None:
                while pending:  # Caught up: everything staged is committed before waiting.
                    await pending.popleft()
                if rounds is None:
                    await reader.refresh(block=True)  # Until the source grows.
                continue
            count, commit = staged
            pending.append(commit)
            written += count
            if len(pending) > _IN_FLIGHT:
                await pending.popleft()
    finally:
        while pending:
            await pending.popleft()
    return written
