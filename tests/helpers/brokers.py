"""Broker processes started on one etcd, and a journal's placement among them."""

from __future__ import annotations

import uuid
from pathlib import Path

from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.journals import journal_spec
from tests.helpers.waiting import until


async def current_route(address: str, journal: str) -> pb.Route:
    async with JournalsClient(address, timeout=2) as client:
        snapshot = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))
        )
    return snapshot.journals[0].route


def start_brokers(
    etcd_server: EtcdServer, tmp_path: Path, brokers: list[BrokerProcess], count: int = 4
) -> None:
    """`count` broker processes with 2 s leases under a fresh prefix, added to `brokers` (which
    the caller stops, even if starting one fails)."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    for i in range(count):
        brokers.append(
            start_broker_process(
                etcd_server, prefix, tmp_path / f"b{i}.log", f"broker-{i}", lease="2s"
            )
        )


async def placed(address: str, journal: str, replicas: int = 3) -> pb.Route:
    """Apply a journal at `replicas` and wait until the allocator has placed it; its route."""
    async with JournalsClient(address) as client:
        await client.apply(
            [pb.ApplyRequest.Change(upsert=journal_spec(journal, replication=replicas))]
        )
    route = pb.Route()

    async def assigned() -> bool:
        nonlocal route
        route = await current_route(address, journal)
        return len(route.members) == replicas

    await until(assigned, f"{journal} placed at {replicas} replicas", timeout=20, interval=0.05)
    return route
