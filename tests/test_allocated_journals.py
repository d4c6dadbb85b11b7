"""Journals placed by the allocator (not by hand): brokers join and leave, the pulse makes the
journal consistent, and appends follow the route."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aetcd
import pytest

from allocator import keyspace as aks
from broker.client.appender import AppendError, append
from broker.client.routes import append_routed
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec
from tests.helpers.waiting import until


async def route_of(h: BrokerHarness, journal: str) -> pb.Route:
    async with h.client() as client:
        snapshot = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))
        )
    return snapshot.journals[0].route if snapshot.journals else pb.Route(primary=-1)


async def wait_route(h: BrokerHarness, journal: str, members: int, timeout: float = 20) -> pb.Route:
    route = pb.Route(primary=-1)

    async def assigned() -> bool:
        nonlocal route
        route = await route_of(h, journal)
        return len(route.members) == members and route.primary != -1

    await until(assigned, f"{journal} routed to {members} members", timeout, interval=0.05)
    return route


async def wait_consistent(etcd: aetcd.Client, root: str, journal: str, route: pb.Route) -> None:
    """Until every assignment's value holds the route (the pulse's doing)."""

    async def consistent() -> bool:
        kvs = await etcd.get_prefix(f"{root}{aks.ASSIGNMENTS}{journal}{aks.SEP}".encode())
        values = [pb.Route.FromString(kv.value) if kv.value else None for kv in kvs]
        return len(values) == len(route.members) and all(
            v is not None and list(v.members) == list(route.members) and v.primary == route.primary
            for v in values
        )

    await until(consistent, f"every assignment of {journal} holds its route", 20, interval=0.05)


@pytest.fixture
async def cluster(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    started: list[BrokerHarness] = []
    try:
        for i in range(3):
            h = BrokerHarness(
                etcd_server.endpoint, etcd_prefix, id=f"broker-{i}", drain_timeout=1.0
            )
            await h.__aenter__()
            started.append(h)
        yield started
    finally:
        for h in reversed(started):
            if h.broker.server is not None:
                await h.__aexit__(None, None, None)


async def test_allocated_journal_accepts_appends_and_becomes_consistent(
    cluster: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str, etcd_server: EtcdServer
) -> None:
    async with cluster[0].client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=journal_spec("alloc/j", replication=3))])
    route = await wait_route(cluster[0], "alloc/j", 3)
    stub = cluster[1].broker.service.dialer.journal_stub(cluster[1].endpoint)
    response = await append(stub, "alloc/j", b"first")
    assert (response.commit.begin, response.commit.end) == (0, 5)
    await wait_consistent(etcd, etcd_prefix, "alloc/j", route)

    # A broker leaves: with three brokers and replication 3 it cannot be drained, so the
    # journal is under-replicated and refuses appends rather than acknowledge fewer copies.
    primary = route.members[route.primary].suffix
    leaving = next(h for h in cluster if h.broker.config.id != primary)
    await leaving.__aexit__(None, None, None)
    await wait_route(cluster[0] if cluster[0] is not leaving else cluster[2], "alloc/j", 2)
    survivor = next(h for h in cluster if h is not leaving)
    with pytest.raises(AppendError) as info:
        await append(
            survivor.broker.service.dialer.journal_stub(survivor.endpoint), "alloc/j", b"x"
        )
    assert info.value.status == pb.INSUFFICIENT_JOURNAL_BROKERS

    # A new broker joins: the allocator adds it, the pipeline re-synchronizes, appends resume
    # after the offsets already written (never re-using them).
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-new") as newcomer:
        route = await wait_route(newcomer, "alloc/j", 3)
        assert "broker-new" in [m.suffix for m in route.members]
        response = await append_routed(
            newcomer.broker.service.dialer.journal_stub(newcomer.endpoint), "alloc/j", b"second"
        )
        assert response.commit.begin == 5
        await wait_consistent(etcd, etcd_prefix, "alloc/j", route)
