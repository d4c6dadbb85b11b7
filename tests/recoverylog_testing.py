"""Fixtures of the recovery-log tests (a pytest plugin, registered in conftest): one in-process
broker, a Journal stub to it, and fresh recovery-log journals on it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from broker.client.journals import dial
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from tests.journals_testing import started_brokers
from tests.test_persistence import routed

RECOVERYLOG = "application/x-gazette-recoverylog"


@pytest.fixture
async def recovery_broker(
    etcd_server: EtcdServer, etcd_prefix: str
) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-recovery"], run_allocator=True
    ) as (harness,):
        yield harness


@pytest.fixture
async def recovery_stub(recovery_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(recovery_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()


async def new_log(broker: BrokerHarness, fragment_length: int = 1 << 20) -> str:
    """A new recovery-log journal, placed."""
    name = f"recovery/logs/{uuid.uuid4().hex[:8]}"
    spec = pb.JournalSpec(name=name, replication=1)
    spec.fragment.length = fragment_length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    spec.labels.labels.add(name="content-type", value=RECOVERYLOG)
    async with broker.client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec)])
        await routed(client, name, 1)
    return name
