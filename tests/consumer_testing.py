"""Fixtures of the consumer tests (a pytest plugin, registered in conftest): one in-process
broker with an input and an output journal of JSON lines, and a Journal stub to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from broker.client.journals import dial
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from tests.journals_testing import started_brokers
from tests.test_persistence import routed

INPUT, OUTPUT = "sums/input", "sums/output"


def spec(name: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.fragment.length = 1 << 20
    out.fragment.compression_codec = pb.NONE
    out.fragment.refresh_interval.seconds = 60
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    return out


@pytest.fixture
async def sums_broker(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-txn"], run_allocator=True
    ) as (harness,):
        async with harness.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(j)) for j in (INPUT, OUTPUT)])
            for journal in (INPUT, OUTPUT):
                await routed(client, journal, 1)
        yield harness


@pytest.fixture
async def sums_stub(sums_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(sums_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()
