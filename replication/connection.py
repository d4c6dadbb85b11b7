"""A replication connection's process: source -> target, run for good at the target's writer.

`SourceReader` follows a source location's journal: it reads only what is new each time (an
index of each event's offset, and the source's CVV as read), and waits for new content with a
blocking read. `run_connection` replicates round after round: the events after the target's
progress for the source, filtered by the target's CVV and the connection's filter, written with
the progress in one append; when there is nothing new it waits for the source to grow.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
from collections.abc import Callable
from typing import Any

from broker.client.reader import read_retrying
from broker.protocol import protocol_pb2_grpc as pb_grpc
from replication.journal_log import JournalEventLog, _event
from replication.location import EventFilter, ReplicationBatch, Stored
from replication.vclock import VectorClock

__all__ = ["SourceReader", "run_connection"]

_RECENT = 100_000  # Events kept parsed by a SourceReader (between this and twice as many).


class SourceReader:
    """A location's journal, read incrementally."""

    def __init__(self, stubs: Callable[[], pb_grpc.JournalStub], journal: str) -> None:
        self.stubs, self.journal = stubs, journal
        self.position = 0  # Journal offset read through (a record boundary).
        self.cvv = VectorClock()
        self.deleted_through = 0  # The source's deletions, as read.
        self._seqs: list[int] = []  # Event seq numbers, in order, and their offsets.
        self._offsets: list[int] = []
        # The most recent events as parsed (the window a connection usually reads from).
        self._recent: list[Stored] = []

    async def _scan(
        self, begin: int, *, block: bool = False, events: int | None = None
    ) -> list[tuple[int, int, dict[str, Any]]]:
        """Whole records from `begin` (to the write head, or once `events` events were read):
        (offset, end offset, record)."""
        out: list[tuple[int, int, dict[str, Any]]] = []
        partial, at, seen = b"", begin, 0
        chunks: Any = read_retrying(self.stubs, self.journal, begin, block=block)
        async with contextlib.aclosing(chunks):  # An async generator: closed when we stop.
            async for chunk in chunks:
                if chunk.offset != at + len(partial):
                    raise ValueError(f"{self.journal}: content jumps to {chunk.offset}")
                data = partial + chunk.content
                start = 0
                while (end := data.find(b"\n", start)) != -1:
                    record = json.loads(data[start:end])
                    out.append((at + start, at + end + 1, record))
                    seen += record.get("kind") == "event"
                    start = end + 1
                at += start
                partial = data[start:]
                if (block and not partial) or (events is not None and seen >= events):
                    break  # Enough: whole records arrived, or the events asked for.
        return out

    async def refresh(self, *, block: bool = False) -> int:
        """Read what is new (waiting for some, if `block`); the count of new events."""
        records = await self._scan(self.position, block=block)
        new = 0
        for offset, end, record in records:
            if record.get("kind") == "event":
                stored = _event(record)
                self._seqs.append(stored.seq)
                self._offsets.append(offset)
                self._recent.append(stored)
                self.cvv = self.cvv.merge(stored.event.timestamp)
                new += 1
            elif record.get("kind") == "deleted":
                self.deleted_through = max(self.deleted_through, int(record["through"]))
            self.position = end
        if len(self._recent) > 2 * _RECENT:
            del self._recent[:-_RECENT]
        return new

    @property
    def last_seq(self) -> int:
        return self._seqs[-1] if self._seqs else 0

    async def events_after(self, after_seq: int, limit: int = 1000) -> list[Stored]:
        """Stored events after `after_seq`, at most `limit`, read from their offset."""
        i = bisect.bisect_right(self._seqs, max(after_seq, self.deleted_through))
        if i == len(self._seqs):
            return []
        first_recent = len(self._seqs) - len(self._recent)
        if i >= first_recent:  # Parsed already.
            return self._recent[i - first_recent : i - first_recent + limit]
        out: list[Stored] = []
        for _, _, record in await self._scan(self._offsets[i], events=limit):
            if record.get("kind") == "event":
                out.append(_event(record))
                if len(out) == limit:
                    break
        return out


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
    `stats` counts `read`, `filtered` (in the target's causal past) and `written` events."""
    written = 0
    done = 0
    while rounds is None or done < rounds:
        done += 1
        await reader.refresh()
        after = target.progress.get(source, 0)
        events = await reader.events_after(after, limit)
        if not events:
            if rounds is not None:
                continue
            await reader.refresh(block=True)  # Until the source grows.
            continue
        passing = tuple(
            s
            for s in events
            if target.causality_filter(s.event)
            and (replication_filter is None or replication_filter(s.event))
        )
        batch = ReplicationBatch(source, passing, events[-1].seq, reader.cvv)
        stored = len(await target.write_batch(batch))
        written += stored
        if stats is not None:
            stats["read"] = stats.get("read", 0) + len(events)
            stats["filtered"] = stats.get("filtered", 0) + len(events) - stored
            stats["written"] = stats.get("written", 0) + stored
        await asyncio.sleep(0)
    return written
