"""Placing many journals at once (issue 26, "Scale"): a placement changes the routes of every
journal together, and each primary pulses at its route change. The pulses run a bounded number
at a time (unbounded, 3,333 of them a broker held its event loop past the etcd lease's TTL and
every broker exited), and a journal without fragment stores starts without a listing."""

from __future__ import annotations

import asyncio

import pytest

from broker import service as service_module
from broker.client.appender import append
from broker.fragment.persister import Persister
from broker.protocol import protocol_pb2 as pb
from broker.replica import Replica
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec
from tests.helpers.waiting import until

pytestmark = pytest.mark.timeout(120)

JOURNALS = 40


async def test_the_pulses_of_a_placement_run_a_bounded_number_at_a_time(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "PULSES_IN_FLIGHT", 4)
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-b") as h:
        service = h.broker.service
        assert service is not None
        in_flight = peak = 0
        pulsed: set[str] = set()
        real = service._pulse

        async def counted(replica: Replica) -> None:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(0.01)  # Long enough for the others to be due meanwhile.
                await real(replica)
                pulsed.add(replica.journal)
            finally:
                in_flight -= 1

        monkeypatch.setattr(service, "_pulse", counted)
        names = [f"burst/j-{i:03d}" for i in range(JOURNALS)]
        async with h.client() as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=journal_spec(n, replication=1)) for n in names]
            )
        await until(lambda: len(pulsed) >= JOURNALS, "every journal pulsed", 60, 0.05)
        # Every journal's route changed at once: without the bound, all of them pulse together.
        assert peak == 4
        stub = service.dialer.journal_stub(h.endpoint)
        response = await append(stub, names[-1], b"after the burst")
        assert response.status == pb.OK and response.commit.begin == 0


async def test_a_journal_without_stores_starts_without_a_listing(
    etcd_server: EtcdServer, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed: list[str] = []

    def list_blocking(self: Persister, journal: str, spec: pb.JournalSpec) -> list[pb.Fragment]:
        listed.append(journal)
        return []

    monkeypatch.setattr(Persister, "list_blocking", list_blocking)
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-b") as h:
        spec = journal_spec("storeless/j", replication=1)
        assert not spec.fragment.stores
        async with h.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec)])
        service = h.broker.service
        assert service is not None and service.resolver.replicas is not None
        replicas = service.resolver.replicas
        await until(lambda: "storeless/j" in replicas, "storeless/j resolved", 30, 0.05)
        async with asyncio.timeout(30):
            await replicas["storeless/j"].index.first_refresh.wait()
        response = await append(service.dialer.journal_stub(h.endpoint), "storeless/j", b"x")
        assert response.commit.end == 1
        # No thread was given a listing of no stores (10,000 of them a minute at 10,000 journals).
        assert listed == []
