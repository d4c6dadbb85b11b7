"""A read that meets a range its broker's index does not cover yet, although the range is
committed and persisted: the broker lists its stores at once instead of answering as if the
journal ended there (until its next listing, a minute later by default).

Found by the replication fault campaign (`location-broker-kill`): a broker restarted with an
empty spool listed its store just before the surviving replica persisted the fragment of the
last appends; reads through it stopped at that range, and a location's log looked as if it
ended there, acknowledged events and all."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from broker.client import JournalsClient
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.reader import read
from broker.fragment.content import fragment_path
from broker.fragment.fragments import sum_from_digest
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_process
from tests.conftest import start_broker_process
from tests.test_persistence import routed

STORE = "file:///fragments/"
JOURNAL = "holes/journal"


def content(begin: int, end: int) -> bytes:
    """Lines of the journal's content in [begin, end): each byte known by its offset."""
    return b"".join(b"\n" if i % 20 == 19 else bytes([97 + i % 26]) for i in range(begin, end))


def persist(root: Path, begin: int, end: int) -> None:
    """A fragment of [begin, end) put straight into the store, as another broker would."""
    body = content(begin, end)
    fragment = pb.Fragment(
        journal=JOURNAL, begin=begin, end=end,
        sum=sum_from_digest(hashlib.sha1(body).digest()), compression_codec=pb.NONE,
    )  # fmt: skip
    assert open_store(STORE, file_root=root).put(
        fragment_path(fragment), io.BytesIO(body), len(body)
    )


async def test_a_read_across_a_range_persisted_after_the_last_listing_reads_it(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    persist(root, 0, 100)
    persist(root, 200, 300)  # [100, 200) persisted later: a range no listing has seen yet.
    broker = start_broker_process(
        etcd_server, etcd_prefix, tmp_path / "broker.log",
        extra=("--broker.file-root", str(root)),
    )  # fmt: skip
    channel = dial(broker.address)
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        spec = pb.JournalSpec(name=JOURNAL, replication=1)
        spec.fragment.length = 1 << 20
        spec.fragment.compression_codec = pb.NONE
        spec.fragment.stores.append(STORE)
        spec.fragment.refresh_interval.seconds = 60
        async with JournalsClient(broker.address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec)])
            await routed(client, JOURNAL, 1)
        listed = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
        assert [(f.spec.begin, f.spec.end) for f in listed.fragments] == [(0, 100), (200, 300)]
        await append(stub, JOURNAL, content(300, 340), offset=300)  # The write head is at 300.
        persist(root, 100, 200)  # Committed content, persisted as a replica would.

        got = b"".join([c.content async for c in read(stub, JOURNAL, 0, block=False)])
        assert got == content(0, 340)
    finally:
        await channel.close(None)
        stop_process(broker.proc)
