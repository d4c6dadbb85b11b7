"""Fault campaign finding 3: the brokers' etcd lease through etcd outages. A short outage (or a
series of them) is a pause, not a loss: a broker keeps its lease as long as etcd does (etcd keeps
leases across its own restart), stops taking appends only while its lease may have lapsed, and
exits only once etcd says the lease is gone, having put what its spools held in the store."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import pytest
from aetcd import exceptions as etcd_errors

from allocator import keyspace as aks
from broker.client import JournalsClient
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.routes import append_routed
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer, stop_processes
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.journals import journal_spec, routed, set_journal, started_brokers
from tests.helpers.persistence import JOURNAL, read_all, read_from_store
from tests.helpers.waiting import until

NAMES = ["lease-0", "lease-1", "lease-2"]


def spec(replication: int = 3) -> pb.JournalSpec:
    """On the file store; fragments of 1 MiB, so that what the tests append stays in the spools
    (nothing is persisted unless a spool is rolled)."""
    out = pb.JournalSpec(name=JOURNAL, replication=replication)
    out.fragment.length = 1 << 20
    out.fragment.compression_codec = pb.GZIP
    out.fragment.stores.append("file:///fragments/")
    out.fragment.refresh_interval.seconds = 1
    return out


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Path:
    (tmp_path / "store" / "fragments").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    return tmp_path


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own, which it kills and starts again."""
    with EtcdServer() as server:
        yield server


def kill_etcd(server: EtcdServer) -> None:
    """SIGKILL etcd, as a machine failing (its data directory stays)."""
    proc, server.proc = server.proc, None
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def start_brokers(
    etcd_server: EtcdServer, prefix: str, where: Path, lease: str = "5s"
) -> list[BrokerProcess]:
    brokers: list[BrokerProcess] = []
    try:
        for name in NAMES:
            log = where / "logs" / f"{name}.log"
            extra = ("--broker.file-root", str(where / "store"))
            brokers.append(
                start_broker_process(etcd_server, prefix, log, name, lease=lease, extra=extra)
            )
    except BaseException:
        stop_processes(broker.proc for broker in brokers)
        raise
    return brokers


def logs(brokers: list[BrokerProcess]) -> str:
    return "\n".join(f"--- {b.log.name}\n{b.log.read_text()[-3000:]}" for b in brokers)


async def test_a_short_etcd_outage_is_a_pause_not_a_loss(
    own_etcd: EtcdServer, cluster_dir: Path
) -> None:
    """Finding 3 as the campaign saw it (5 s lease): etcd SIGKILLed, serving again 3.1 s later,
    for 1.75 s, then SIGKILLed again for 1 s. No broker exits; the journal takes appends afterwards
    right where it was (no reset-head), and every acknowledged byte reads back."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    brokers = start_brokers(own_etcd, prefix, cluster_dir)
    try:
        async with JournalsClient(brokers[0].address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec())])
            await routed(client, JOURNAL, 3)
        channel = dial(brokers[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            written = [f"before the outage {i}\n".encode() for i in range(20)]
            for content in written:
                await append_routed(stub, JOURNAL, content)

            # The campaign's schedule: 3.1 s from the kill until etcd served again, 1.75 s of
            # service, then down again for 1 s (and its start).
            killed = time.monotonic()
            kill_etcd(own_etcd)
            await asyncio.sleep(2.5)  # The outage's schedule (above): etcd down.
            await asyncio.to_thread(own_etcd.start)
            await asyncio.sleep(max(0.0, killed + 3.1 - time.monotonic()))  # The schedule.
            await asyncio.sleep(1.75)  # The schedule: etcd serving.
            kill_etcd(own_etcd)
            await asyncio.sleep(1.0)  # The schedule: etcd down again.
            await asyncio.to_thread(own_etcd.start)

            # Longer than the lease: a broker that gave its lease up would be gone by now.
            await asyncio.sleep(7.0)  # A hold past the lease: no broker exits meanwhile.
            exited = [b.log.name for b in brokers if b.proc.poll() is not None]
            assert not exited, f"brokers exited: {exited}\n{logs(brokers)}"

            # Appends go on where the journal was: INDEX_HAS_GREATER_OFFSET (every replica
            # lost, reset-head needed) is not retried by append_routed.
            end = sum(len(c) for c in written)
            response = await append_routed(stub, JOURNAL, b"after the outage\n")
            assert (response.commit.begin, response.commit.end) == (end, end + 17)
            assert await read_all(stub) == b"".join(written) + b"after the outage\n"
        finally:
            await channel.close(None)
    finally:
        stop_processes(broker.proc for broker in brokers)


async def test_a_broker_whose_lease_is_gone_persists_its_spools_before_exiting(
    etcd_server: EtcdServer, etcd: aetcd.Client, cluster_dir: Path
) -> None:
    """Every broker's lease revoked in etcd (as when etcd expired them): each exits, non-zero,
    but only once what its spools held is in the store, so no acknowledged byte is lost."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    brokers = start_brokers(etcd_server, prefix, cluster_dir)
    try:
        async with JournalsClient(brokers[0].address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec())])
            await routed(client, JOURNAL, 3)
        channel = dial(brokers[0].address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            written = [f"acknowledged {i}\n".encode() * 3 for i in range(25)]
            for content in written:
                await append_routed(stub, JOURNAL, content)
        finally:
            await channel.close(None)
        # Well under a fragment: what the store holds (fragments rolled while the route formed)
        # stops short of the end; the spools alone hold the rest.
        stored = read_from_store("file:///fragments/", cluster_dir / "store")
        assert len(stored) < sum(len(c) for c in written)

        members = await etcd.get_prefix(f"{prefix}{aks.MEMBERS}".encode())
        leases = {kv.lease for kv in members}
        assert len(leases) == len(NAMES)
        for lease in leases:
            await etcd.revoke_lease(lease)

        for broker in brokers:
            status = await asyncio.to_thread(broker.proc.wait, 90)
            assert status != 0, f"{broker.log.name} exited 0 without a lease\n{logs(brokers)}"
        stored = read_from_store("file:///fragments/", cluster_dir / "store")
        assert stored == b"".join(written), logs(brokers)
    finally:
        stop_processes(broker.proc for broker in brokers)


# ---- in-process: a broker that cannot reach etcd while etcd keeps its lease ---------------------


@pytest.fixture
async def lone_broker(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, cluster_dir: Path
) -> AsyncIterator[BrokerHarness]:
    root = str(cluster_dir / "store")
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["fenced"], lease=2.0, file_root=root
    ) as harnesses:
        journal = journal_spec("lease/j", 1)
        journal.fragment.stores.append("file:///fragments/")
        await set_journal(etcd, etcd_prefix, journal, [("local", "fenced")])
        yield harnesses[0]


async def test_a_broker_cut_off_from_etcd_pauses_appends_then_resumes(
    lone_broker: BrokerHarness, etcd: aetcd.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker's lease refreshes fail (etcd unreachable from it) while etcd keeps the lease
    alive (here, the test refreshes it). Past the TTL the broker may have lost its lease, so it
    takes no append (one in flight waits, unacknowledged), yet it stays up; once a refresh
    succeeds again, the waiting append goes through."""
    broker = lone_broker.broker
    stub = broker.service.dialer.journal_stub(lone_broker.endpoint)  # type: ignore[union-attr]
    first = await append(stub, "lease/j", b"first\n")
    assert first.commit.end == 6

    cut_off = True
    refresh = broker.etcd.refresh_lease

    async def refresh_unless_cut_off(lease_id: int) -> object:
        if cut_off:
            raise etcd_errors.ConnectionFailedError("etcd unreachable (test)")
        return await refresh(lease_id)

    async def keep_alive_for_it() -> None:
        while True:
            await etcd.refresh_lease(broker.lease_id)
            await asyncio.sleep(0.3)  # A keep-alive's period, well inside the TTL.

    monkeypatch.setattr(broker.etcd, "refresh_lease", refresh_unless_cut_off)
    keeper = asyncio.ensure_future(keep_alive_for_it())
    try:
        # Past the TTL: the broker is still up.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert not broker.done.is_set(), f"the broker stopped: {broker.failure}"
            await asyncio.sleep(0.05)  # A hold past the TTL, checked throughout.
        assert broker.fenced

        pending = asyncio.ensure_future(append(stub, "lease/j", b"while cut off\n"))
        await asyncio.sleep(2.0)  # A hold: no append is acknowledged while cut off.
        assert not pending.done(), "an append was acknowledged while the lease may have lapsed"
        assert not broker.done.is_set(), f"the broker stopped: {broker.failure}"

        cut_off = False
        async with asyncio.timeout(5):
            response = await pending
        assert (response.commit.begin, response.commit.end) == (6, 20)
        assert not broker.fenced
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)


async def test_a_fenced_broker_exits_once_etcd_says_its_lease_is_gone(
    lone_broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut off from etcd past its TTL, the broker waits, up but fenced; etcd then answers that
    the lease is gone (it expired meanwhile): the broker stops with LeaseLost."""
    broker = lone_broker.broker
    refresh = broker.etcd.refresh_lease
    cut_off = True

    async def refresh_unless_cut_off(lease_id: int) -> object:
        if cut_off:
            raise etcd_errors.ConnectionFailedError("etcd unreachable (test)")
        return await refresh(lease_id)

    monkeypatch.setattr(broker.etcd, "refresh_lease", refresh_unless_cut_off)
    await asyncio.sleep(3.0)  # Past the TTL.
    assert not broker.done.is_set(), f"the broker stopped: {broker.failure}"
    assert broker.fenced
    # Nobody refreshed the lease meanwhile: etcd expired it (and deleted the member key and the
    # assignments), as it would for a broker cut off from it.
    cut_off = False
    async with asyncio.timeout(5):
        await broker.done.wait()
    assert "expired or was revoked" in str(broker.failure)


async def test_a_refresh_that_times_out_is_logged_by_its_type_and_bound(
    lone_broker: BrokerHarness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease refresh that etcd does not answer in time fails with TimeoutError, whose text
    is empty: the warning names it and its bound ("TimeoutError after 0.5s"), rather than
    ending in an empty reason."""
    broker = lone_broker.broker
    refresh = broker.etcd.refresh_lease
    hung = True

    async def refresh_or_hang(lease_id: int) -> object:
        if hung:
            await asyncio.sleep(60)  # Etcd that does not answer: the refresh's bound cuts it.
        return await refresh(lease_id)

    monkeypatch.setattr(broker.etcd, "refresh_lease", refresh_or_hang)
    try:
        await until(
            lambda: "failed (retrying): " in caplog.text, "a refresh's failure logged", 5, 0.05
        )
    finally:
        hung = False
    [message] = [r.getMessage() for r in caplog.records if "failed (retrying): " in r.message]
    reason = message.split("(retrying): ", 1)[1]
    assert reason.startswith("TimeoutError after ") and reason.endswith("s"), message


def test_a_refresh_failure_is_described_even_when_its_text_is_empty() -> None:
    from plumbing.membership import describe_refresh_failure

    assert describe_refresh_failure(TimeoutError(), 2.0) == "TimeoutError after 2.0s"
    assert describe_refresh_failure(ConnectionError(), 2.0) == "ConnectionError"
    assert (
        describe_refresh_failure(etcd_errors.ConnectionFailedError("etcd unreachable"), 2.0)
        == "etcd unreachable"
    )
    assert describe_refresh_failure(None, 2.0) == "no answer"


async def test_an_apply_while_etcd_refuses_connections_is_unavailable_in_one_line(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """etcd refusing connections (down, not paused): a Journal Apply, with stores and without,
    is answered UNAVAILABLE in one line naming etcd, never UNKNOWN with an exception's name;
    nothing is applied, and once etcd is back the same Apply goes through."""
    import grpc

    from broker.protocol import protocol_pb2_grpc as pb_grpc
    from broker.testing import BrokerHarness

    (tmp_path / "fragments").mkdir()
    harness = BrokerHarness(own_etcd.endpoint, "/refused", file_root=str(tmp_path))
    async with (
        harness,
        grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://")) as channel,
    ):
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        with_stores = journal_spec("refused/with-stores")
        without = pb.JournalSpec()
        without.CopyFrom(with_stores)
        without.name = "refused/without"
        del without.fragment.stores[:]
        kill_etcd(own_etcd)
        for spec in (with_stores, without):
            change = pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Apply(pb.ApplyRequest(changes=[change]), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            details = refused.value.details() or ""
            assert "etcd" in details and "\n" not in details, details
        own_etcd.start()
        for spec in (with_stores, without):
            change = pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)
            async with asyncio.timeout(30):
                applied = await stub.Apply(pb.ApplyRequest(changes=[change]))
            assert applied.status == pb.OK
