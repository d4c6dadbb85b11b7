"""A journal persisted to a store, as tests/test_persistence.py writes it: its spec,
payloads that roll fragments, a wait for persistence, and reads through a broker or from the
store alone."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from broker.client.reader import read
from broker.fragment.content import open_in_store
from broker.fragment.cover_set import CoverSet, IndexedFragment
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from tests.helpers.waiting import until

JOURNAL = "persist/journal"


def spec(
    store: str, codec: pb.CompressionCodec = pb.ZSTANDARD, replication: int = 3
) -> pb.JournalSpec:
    out = pb.JournalSpec(name=JOURNAL, replication=replication)
    out.fragment.length = 1024
    out.fragment.compression_codec = codec
    out.fragment.stores.append(store)
    out.fragment.refresh_interval.seconds = 1
    return out


def payloads(count: int, seed: int = 0) -> list[bytes]:
    """Appends of 200..900 bytes each, distinct and partly compressible, then one of 1100
    bytes: the fragment it ends is over the spec's 1 KiB length, so the next append (even of
    zero bytes) rolls it and every byte before is persisted."""
    out = []
    for i in range(count):
        digest = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest().encode()
        out.append((digest * 40)[: 200 + (i * 137) % 700 if i < count - 1 else 1100])
    return out


async def persisted_through(stub: pb_grpc.JournalStub, end: int, timeout: float = 30) -> list[Any]:
    """Wait until persisted fragments cover [0, end); returns them."""
    persisted: list[Any] = []

    async def covered() -> bool:
        nonlocal persisted
        response = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
        persisted = [f.spec for f in response.fragments if f.spec.backing_store]
        through = 0
        for fragment in sorted(persisted, key=lambda f: f.begin):
            if fragment.begin <= through:
                through = max(through, fragment.end)
        return through >= end

    await until(covered, f"persisted fragments covering [0, {end})", timeout, interval=0.1)
    return persisted


async def read_all(stub: pb_grpc.JournalStub, **options: Any) -> bytes:
    parts = []
    expect = 0
    async for chunk in read(stub, JOURNAL, 0, **options):
        assert chunk.offset == expect, "reads are contiguous from offset 0"
        parts.append(chunk.content)
        expect += len(chunk.content)
    return b"".join(parts)


def read_from_store(store_url: str, file_root: Path | None = None) -> bytes:
    """A journal's history from its store alone, with no broker: list, choose the covering
    fragments as the index does, and read each (verifying its SHA-1)."""
    store = open_store(store_url, file_root=file_root)
    cover = CoverSet()
    for fragment in store.list_fragments(JOURNAL):
        cover.add(IndexedFragment(fragment))
    out, offset = [], 0
    for entry in cover:
        assert entry.begin <= offset, f"a gap at {offset}"
        if entry.end <= offset:
            continue
        out.extend(open_in_store(store, entry.spec, offset))
        offset = entry.end
    return b"".join(out)
