"""A broker process persisting to a file:// store, and a history of fragments written to it.
`cluster` and `history` are module-scoped fixtures: a test module binds them to its own names
and its tests share one broker and one history."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.client import JournalsClient, dial
from broker.client.appender import append
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from tests.conftest import BrokerProcess, start_broker_process, stop_process
from tests.helpers.journals import routed
from tests.helpers.waiting import until

STORE = "file:///fragments/"


@dataclass
class Cluster:
    broker: BrokerProcess
    root: Path  # The broker's --broker.file-root.


@pytest.fixture(scope="module")
def cluster(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    where = tmp_path_factory.mktemp("fragments")
    root = where / "root"
    (root / "fragments").mkdir(parents=True)
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    broker = start_broker_process(
        etcd_server, prefix, where / "broker.log", extra=("--broker.file-root", str(root))
    )
    try:
        yield Cluster(broker, root)
    finally:
        stop_process(broker.proc)
        close_stores()


def journal(name: str, retention: int = 0, codec: pb.CompressionCodec = pb.NONE) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=1)
    spec.fragment.length = 1024
    spec.fragment.compression_codec = codec
    spec.fragment.stores.append(STORE)
    spec.fragment.refresh_interval.seconds = 1
    spec.fragment.retention.seconds = retention
    return spec


def content(n: int, seed: str) -> bytes:
    return (seed.encode() * n)[:n]


class Journals:
    """Library calls for test setup (fast: no subprocess per append)."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def create(self, *specs: pb.JournalSpec) -> None:
        async with JournalsClient(self.address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
            for spec in specs:
                await routed(client, spec.name, replicas=1)

    async def append(self, name: str, data: bytes) -> pb.AppendResponse:
        channel = dial(self.address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            return await append(stub, name, data)
        finally:
            await channel.close(None)

    async def fragments(self, name: str) -> list[pb.Fragment]:
        channel = dial(self.address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await stub.ListFragments(pb.FragmentsRequest(journal=name))
            return [f.spec for f in response.fragments]
        finally:
            await channel.close(None)

    async def settled(self, name: str, root: Path) -> list[pb.Fragment]:
        """The persisted fragments once the index holds the mod times the store lists (the
        persister's own clock reading may differ by a second until the next refresh)."""
        store = open_store(STORE, file_root=root)
        indexed: list[pb.Fragment] = []

        async def agree() -> bool:
            nonlocal indexed
            listed = {(f.begin, f.end): f.mod_time for f in store.list_fragments(name)}
            indexed = [f for f in await self.fragments(name) if f.backing_store]
            return {(f.begin, f.end): f.mod_time for f in indexed} == listed

        await until(agree, f"the index of {name} lists what the store holds", timeout=20)
        return indexed

    async def persisted(self, name: str, count: int) -> list[pb.Fragment]:
        """Wait until `count` of the journal's fragments are persisted; returns them."""
        done: list[pb.Fragment] = []

        async def enough() -> bool:
            nonlocal done
            done = [f for f in await self.fragments(name) if f.backing_store]
            return len(done) >= count

        await until(enough, f"{count} fragments of {name} persisted", timeout=20)
        return done


@dataclass
class History:
    """frag/a: fragments A [0,300) and B [300,1400) persisted a second apart, C [1400,1600)
    local. frag/b: 4 bytes, local."""

    data: bytes
    a: pb.Fragment
    b: pb.Fragment


@pytest.fixture(scope="module")
def history(cluster: Cluster) -> History:
    journals = Journals(cluster.broker.address)

    async def setup() -> History:
        await journals.create(journal("frag/a"), journal("frag/b"))
        parts = [content(300, "first "), content(1100, "second "), content(200, "third ")]
        # The first write is rolled by the next append, and B is over the fragment length.
        await journals.append("frag/a", parts[0])
        await journals.append("frag/a", parts[1])
        await journals.persisted("frag/a", 1)
        # B is persisted at a later second than A: once the clock is past A's (as the store
        # dates it).
        a_second = max(f.mod_time for f in open_store(STORE, file_root=cluster.root).list_fragments("frag/a"))  # fmt: skip
        await until(lambda: time.time() >= a_second + 1, "the clock past A's second")
        await journals.append("frag/a", parts[2])
        await journals.persisted("frag/a", 2)
        await journals.append("frag/b", b"bbb\n")
        a, b = await journals.settled("frag/a", cluster.root)
        return History(b"".join(parts), a, b)

    out = asyncio.run(setup())
    assert (out.a.begin, out.a.end, out.b.begin, out.b.end) == (0, 300, 300, 1400)
    assert 0 < out.a.mod_time < out.b.mod_time
    return out
