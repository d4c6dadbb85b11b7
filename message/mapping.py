"""Partitioned topics: a topic is the set of journals a label selector matches, and each message
is routed to one of them by its key, as upstream's mappings do (`message/routines.go`):

- `modulo_mapping`: 32-bit FNV-1a of the key, modulo the number of partitions;
- `rendezvous_mapping`: highest random weight, the partition maximizing FNV-1a(key) XOR
  FNV-1a(journal name), which moves only the keys of a partition that comes or goes;
- `random_mapping`: any partition.

Partitions are ordered by journal name (as List returns them), so every publisher maps a key to
the same journal. `WatchedPartitions` keeps the set current from a List watch, so partitions
added later are picked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from plumbing.backoff import Backoff

M = TypeVar("M")
log = logging.getLogger(__name__)

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a32(data: bytes) -> int:
    """32-bit FNV-1a, as Go's hash/fnv New32a."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


class NoPartitions(LookupError):
    """The topic's selector matches no journal."""


@dataclass(frozen=True)
class Partition:
    journal: str
    content_type: str


def partitions_of(journals: Sequence[pb.ListResponse.Journal]) -> list[Partition]:
    """The partitions of a List snapshot, ordered by journal name."""
    out = []
    for journal in journals:
        content_type = next(
            (label.value for label in journal.spec.labels.labels if label.name == "content-type"),
            "",
        )
        out.append(Partition(journal.spec.name, content_type))
    out.sort(key=lambda p: p.journal)
    return out


Partitions = Callable[[], Sequence[Partition]]
Mapping = Callable[[M], Partition]


def _current(partitions: Partitions) -> Sequence[Partition]:
    parts = partitions()
    if not parts:
        raise NoPartitions("no journal matches the topic's selector")
    return parts


def modulo_mapping(key: Callable[[M], bytes], partitions: Partitions) -> Mapping[M]:
    def mapping(message: M) -> Partition:
        parts = _current(partitions)
        return parts[fnv1a32(key(message)) % len(parts)]

    return mapping


def rendezvous_mapping(key: Callable[[M], bytes], partitions: Partitions) -> Mapping[M]:
    cache: dict[str, int] = {}

    def weight_of(journal: str) -> int:
        h = cache.get(journal)
        if h is None:
            if len(cache) > 65536:
                cache.clear()
            h = cache[journal] = fnv1a32(journal.encode())
        return h

    def mapping(message: M) -> Partition:
        parts = _current(partitions)
        h = fnv1a32(key(message))
        best, best_weight = 0, 0
        for index, part in enumerate(parts):
            weight = h ^ weight_of(part.journal)
            if weight > best_weight:  # Ties keep the earlier partition, as upstream.
                best, best_weight = index, weight
        return parts[best]

    return mapping


def random_mapping(partitions: Partitions, rng: random.Random | None = None) -> Mapping[object]:
    chooser = rng or random.Random()

    def mapping(message: object) -> Partition:
        parts = _current(partitions)
        return parts[chooser.randrange(len(parts))]

    return mapping


class WatchedPartitions:
    """The journals a selector matches, kept current by a List watch. Call it for the current
    partitions; `ready()` waits for the first snapshot."""

    def __init__(self, client: JournalsClient, selector: pb.LabelSelector) -> None:
        self._client = client
        self._selector = selector
        self._parts: list[Partition] = []
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __call__(self) -> Sequence[Partition]:
        return self._parts

    async def __aenter__(self) -> WatchedPartitions:
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def ready(self) -> None:
        await self._ready.wait()

    async def changed(self) -> None:
        """Wait for the next change of the partition set."""
        await self._changed.wait()

    async def _watch(self) -> None:
        backoff = Backoff(initial=0.5, maximum=5.0)
        while True:
            try:
                async for snapshot in self._client.watch(self._selector):
                    parts = partitions_of(snapshot.journals)
                    if parts != self._parts or not self._ready.is_set():
                        self._parts = parts
                        self._ready.set()
                        self._changed.set()
                        self._changed = asyncio.Event()
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # The broker went away: keep the last set, watch again.
                log.warning("watching the partitions of a topic failed (retrying): %s", exc)
            await backoff.sleep()
