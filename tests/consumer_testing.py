"""Fixtures of the consumer tests (a pytest plugin, registered in conftest): one in-process
broker with an input and an output journal of JSON lines, and a Journal stub to it. Consumer
processes (`ConsumerProcesses`) and the rest come from the test kit, `consumer.testing`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from broker.client.journals import dial
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from consumer.testing import ConsumerProcesses as ConsumerProcesses
from consumer.testing import create_journals, journal_spec
from tests.journals_testing import started_brokers

INPUT, OUTPUT = "sums/input", "sums/output"


def spec(name: str) -> pb.JournalSpec:
    """A journal of JSON lines, one replica."""
    return journal_spec(name)


@pytest.fixture
async def sums_broker(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-txn"], run_allocator=True
    ) as (harness,):
        await create_journals(harness.endpoint, [spec(INPUT), spec(OUTPUT)])
        yield harness


@pytest.fixture
async def sums_stub(sums_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(sums_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()
