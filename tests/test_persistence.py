"""Fragments persisted to stores, end to end on real brokers: durability across killing every
broker, reading history with no broker, the same journal on file, gs, s3 and azure stores, and a store
outage that persistence rides out."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from broker.client import JournalsClient
from broker.client.appender import AppendError, append, reset_head
from broker.client.journals import dial
from broker.client.routes import append_routed
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_processes
from plumbing import metrics
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.journals import routed, started_brokers
from tests.helpers.persistence import (
    JOURNAL,
    payloads,
    persisted_through,
    read_all,
    read_from_store,
    spec,
)
from tests.helpers.waiting import until

# ---- durability across every broker dying -----------------------------------------------------


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Path:
    (tmp_path / "store" / "fragments").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    return tmp_path


def start_brokers(
    etcd_server: EtcdServer, prefix: str, where: Path, names: list[str]
) -> list[BrokerProcess]:
    brokers = []
    try:
        for name in names:
            brokers.append(
                start_broker_process(
                    etcd_server,
                    prefix,
                    where / "logs" / f"{name}.log",
                    broker_id=name,
                    extra=("--broker.file-root", str(where / "store")),
                )
            )
    except BaseException:
        stop_processes(broker.proc for broker in brokers)
        raise
    return brokers


def kill_all(brokers: list[BrokerProcess]) -> None:
    for broker in brokers:
        os.kill(broker.proc.pid, signal.SIGKILL)
        broker.proc.wait()


async def create_journal(address: str) -> None:
    """The journal on the file store, replicated on three brokers."""
    async with JournalsClient(address) as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec("file:///fragments/"))])
        await routed(client, JOURNAL, 3)


async def test_acknowledged_bytes_survive_killing_every_broker(
    etcd_server: EtcdServer, cluster_dir: Path
) -> None:
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    first = start_brokers(etcd_server, prefix, cluster_dir, ["alpha-0", "alpha-1", "alpha-2"])
    second: list[BrokerProcess] = []
    try:
        await create_journal(first[0].address)
        channel = dial(first[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        written = payloads(12)
        acked = []
        for content in written:
            response = await append_routed(stub, JOURNAL, content)
            acked.append((response.commit.begin, response.commit.end))
        end = acked[-1][1]
        assert acked[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(acked))
        # A zero-byte append rolls the last fragment (it is over its length): all is persisted.
        await append_routed(stub, JOURNAL, b"")
        persisted = await persisted_through(stub, end)
        assert {f.compression_codec for f in persisted} == {pb.ZSTANDARD}
        assert all(f.backing_store == "file:///fragments/" and f.mod_time for f in persisted)
        await channel.close(None)

        kill_all(first)

        # History is readable from the store with no broker running.
        assert read_from_store("file:///fragments/", cluster_dir / "store") == b"".join(written)

        second = start_brokers(etcd_server, prefix, cluster_dir, ["beta-0", "beta-1", "beta-2"])
        async with JournalsClient(second[0].address) as client:
            await routed(client, JOURNAL, 3, members="beta-")
        channel = dial(second[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            # Every acknowledged byte reads back, through the broker and straight from the store.
            async def read_back() -> bool:
                return await read_all(stub) == b"".join(written)

            await until(read_back, f"all {end} bytes read back", timeout=30, interval=0.2)
            direct = await read_all(stub, direct=True, file_root=cluster_dir / "store")
            assert direct == b"".join(written)

            # The new brokers cannot know whether bytes past the store's end were acknowledged
            # and lost with every replica: a plain append is refused until an operator resets
            # the head (as upstream), and an append at an explicit offset must name the end.
            with pytest.raises(AppendError) as refused:
                await append_routed(stub, JOURNAL, b"after restart\n")
            assert refused.value.status == pb.INDEX_HAS_GREATER_OFFSET
            with pytest.raises(AppendError) as wrong:
                await append(stub, JOURNAL, b"x", offset=end - 1)
            assert wrong.value.status == pb.WRONG_APPEND_OFFSET
            await reset_head(stub, JOURNAL)
            response = await append_routed(stub, JOURNAL, b"after restart\n")
            assert (response.commit.begin, response.commit.end) == (end, end + 14)
            assert await read_all(stub) == b"".join(written) + b"after restart\n"
        finally:
            await channel.close(None)
    finally:
        stop_processes(broker.proc for broker in first + second)


# ---- the same journal on each kind of store ---------------------------------------------------


@pytest.fixture(params=["file", "gs", "s3", "azure"])
async def store_url(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, Path]]:
    root = tmp_path / "root"
    if request.param == "file":
        (root / "fragments").mkdir(parents=True)
        yield "file:///fragments/", root
        return
    if request.param == "azure":
        azure = request.getfixturevalue("azure_server")
        yield f"azure://{azure.create_container()}/fragments/", root
        return
    server = request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[request.param])
    bucket = server.create_bucket()
    if request.param == "gs":
        yield f"gs://{bucket}/fragments/", root
    else:
        endpoint = urllib.parse.quote(server.endpoint, safe="")
        yield f"s3://{bucket}/fragments/?endpoint={endpoint}&region=us-east-1", root


async def test_a_journal_persists_and_reads_back_on_every_store(
    etcd_server: EtcdServer, etcd_prefix: str, store_url: tuple[str, Path]
) -> None:
    url, root = store_url
    root.mkdir(parents=True, exist_ok=True)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-0", "bk-1"], run_allocator=True, file_root=str(root)
    ) as brokers:
        async with brokers[0].client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(url, pb.GZIP, 2))])
            await routed(client, JOURNAL, 2)
        channel = dial(brokers[0].endpoint)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            written = payloads(8, seed=3)
            for content in written:
                await append_routed(stub, JOURNAL, content)
            end = sum(len(c) for c in written)
            await append_routed(stub, JOURNAL, b"")
            persisted = await persisted_through(stub, end)
            assert all(f.backing_store == url for f in persisted)
            # Each fragment was written once: the store lists exactly the persisted set.
            listed = open_store(url, file_root=root).list_fragments(JOURNAL)
            assert sorted((f.begin, f.end) for f in listed) == sorted(
                (f.begin, f.end) for f in persisted
            )
            assert read_from_store(url, root) == b"".join(written)
            # Once persisted, the brokers serve those fragments from the store.
            assert await read_all(stub) == b"".join(written)
            assert await read_all(stub, direct=True, file_root=root) == b"".join(written)
            # Signed URLs come with ListFragments when asked for.
            response = await stub.ListFragments(
                pb.FragmentsRequest(journal=JOURNAL, signatureTTL={"seconds": 60})
            )
            assert all(f.signed_url for f in response.fragments if f.spec.backing_store)
        finally:
            await channel.close(None)


async def test_persisting_retries_through_a_store_outage(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True, file_root=str(root)
    ) as brokers:
        async with brokers[0].client() as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=spec("file:///fragments/", pb.NONE, 1))]
            )
            await routed(client, JOURNAL, 1)
        channel = dial(brokers[0].endpoint)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            first = payloads(4, seed=5)
            for content in first:
                await append_routed(stub, JOURNAL, content)
            await append_routed(stub, JOURNAL, b"")
            head = sum(len(c) for c in first)
            await persisted_through(stub, head)

            # The store goes away: appends go on, and what completes waits to be persisted.
            failed_puts = {"store": metrics.store_label("file:///fragments/"), "operation": "put",
                           "status": "error"}  # fmt: skip
            failed_before = REGISTRY.get_sample_value("gazette_store_operation_total", failed_puts)
            (root / "fragments").rename(root / "away")
            second = payloads(4, seed=6)
            for content in second:
                await append_routed(stub, JOURNAL, content)
            await append_routed(stub, JOURNAL, b"")
            end = head + sum(len(c) for c in second)
            await until(
                lambda: (REGISTRY.get_sample_value("gazette_store_operation_total", failed_puts)
                         or 0) > (failed_before or 0),
                "a persist attempt failed",
            )  # fmt: skip
            response = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
            assert any(not f.spec.backing_store and f.spec.end > head for f in response.fragments)

            (root / "away").rename(root / "fragments")
            await persisted_through(stub, end, timeout=60)
            listed = open_store("file:///fragments/", file_root=root).list_fragments(JOURNAL)
            spans = [(f.begin, f.end) for f in listed]
            assert len(spans) == len(set(spans)), "no fragment is written twice"
            assert read_from_store("file:///fragments/", root) == b"".join(first + second)
        finally:
            await channel.close(None)


async def test_a_suspended_journal_resumes_at_its_offset_after_every_broker_dies(
    etcd_server: EtcdServer, cluster_dir: Path
) -> None:
    # Suspending flushes the journal (its spool is rolled and persisted) and records its
    # offset in etcd: brokers that start afresh resume there, with no operator action.
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    first = start_brokers(etcd_server, prefix, cluster_dir, ["gamma-0", "gamma-1", "gamma-2"])
    second: list[BrokerProcess] = []
    try:
        await create_journal(first[0].address)
        channel = dial(first[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        written = [b"one\n" * 50, b"two\n" * 50, b"three\n" * 20]  # Well under a fragment.
        for content in written:
            await append_routed(stub, JOURNAL, content)
        end = sum(len(c) for c in written)

        # Not a retry: as upstream's protocol goes (and `gazctl journals suspend`), the first
        # SUSPEND_NOW suspends PARTIAL, the next rolls the remaining replica's spool, and one
        # answers SUSPENDED once nothing is left to roll.
        deadline = time.monotonic() + 30
        while True:
            response = await append(
                stub, JOURNAL, b"", suspend=pb.AppendRequest.SUSPEND_NOW, check=False
            )
            if response.status == pb.SUSPENDED:
                break
            assert time.monotonic() < deadline, pb.Status.Name(response.status)
            await asyncio.sleep(0.1)
        async with JournalsClient(first[0].address) as client:
            listing = await client.list(pb.LabelSelector())
            suspend = listing.journals[0].spec.suspend
            assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.PARTIAL, end)
            await routed(client, JOURNAL, 1)  # A partially suspended journal keeps one replica.
        await persisted_through(stub, end)
        await channel.close(None)
        kill_all(first)

        second = start_brokers(etcd_server, prefix, cluster_dir, ["delta-0", "delta-1", "delta-2"])
        async with JournalsClient(second[0].address) as client:
            await routed(client, JOURNAL, 1, members="delta-")
        channel = dial(second[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await append_routed(stub, JOURNAL, b"resumed\n")
            assert (response.commit.begin, response.commit.end) == (end, end + 8)
            async with JournalsClient(second[0].address) as client:
                listing = await client.list(pb.LabelSelector())
                assert listing.journals[0].spec.suspend.level == pb.JournalSpec.Suspend.NONE
            assert await read_all(stub) == b"".join(written) + b"resumed\n"
        finally:
            await channel.close(None)
    finally:
        stop_processes(broker.proc for broker in first + second)


async def test_graceful_stop_of_every_broker_persists_and_resumes_without_reset_head(
    etcd_server: EtcdServer, cluster_dir: Path
) -> None:
    """SIGTERM to every broker at once, right after acknowledged appends: every acknowledged
    byte is in the store once they exit, and brokers started again take appends at once, with
    no `reset-head`: the stopping brokers flushed the journal and recorded where it ends (the
    suspension offset), only after its content was persisted."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    names = ["eps-0", "eps-1", "eps-2"]
    first = start_brokers(etcd_server, prefix, cluster_dir, names)
    second: list[BrokerProcess] = []
    try:
        await create_journal(first[0].address)
        channel = dial(first[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        written = [b"one\n" * 50, b"two\n" * 50, b"three\n" * 20]  # Well under a fragment.
        for content in written:
            await append_routed(stub, JOURNAL, content)
        end = sum(len(c) for c in written)
        await channel.close(None)

        for broker in first:
            os.kill(broker.proc.pid, signal.SIGTERM)
        for broker in first:
            assert broker.proc.wait(timeout=60) == 0, broker.log.read_text()[-2000:]
        assert read_from_store("file:///fragments/", cluster_dir / "store") == b"".join(written)

        second = start_brokers(etcd_server, prefix, cluster_dir, names)
        channel = dial(second[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await append_routed(stub, JOURNAL, b"after restart\n")
            assert (response.commit.begin, response.commit.end) == (end, end + 14)
            assert await read_all(stub) == b"".join(written) + b"after restart\n"
        finally:
            await channel.close(None)
    finally:
        stop_processes(broker.proc for broker in first + second)
