"""Appends whose reply is lost on the way back, over real sockets (a TCP proxy that holds the
broker's answers, then cuts the connection): the client library repeats what is safe to repeat
(a zero-byte append, such as `gazctl journals suspend`), and never sends again a batch of content
whose commit went through (`gazctl journals append --mapping`): its outcome is unknown, and said
so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aetcd
import pytest

from broker.allocator import keyspace as aks
from broker.client.appender import append
from broker.client.dialer import Dialer
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from gazctl.fragments import _suspend_one
from tests.journals_testing import journal_spec, set_journal, started_brokers
from tests.tcp_proxy import TcpProxy, host_port

IDS = ["broker-r"]


@pytest.fixture
async def broker(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as harnesses:
        yield harnesses[0]


@pytest.fixture
async def proxy(broker: BrokerHarness) -> AsyncIterator[TcpProxy]:
    async with TcpProxy(host_port(broker.endpoint)).serving() as serving:
        yield serving


@pytest.fixture
async def dialer() -> AsyncIterator[Dialer]:
    dialer = Dialer()
    try:
        yield dialer
    finally:
        await dialer.close()


async def until(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    """Until `condition()` holds (polled: the state lives in another component)."""
    deadline = time.monotonic() + timeout
    while not await condition():  # type: ignore[misc]
        assert time.monotonic() < deadline, f"not {what} after {timeout}s"
        await asyncio.sleep(0.02)


async def spec_of(etcd: aetcd.Client, root: str, journal: str) -> pb.JournalSpec:
    kv = await etcd.get(aks.item_key(root, journal).encode())
    assert kv is not None
    return pb.JournalSpec.FromString(kv.value)


async def test_a_suspend_whose_reply_is_lost_is_repeated(
    broker: BrokerHarness, proxy: TcpProxy, dialer: Dialer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """`gazctl journals suspend --force` through a connection that loses the broker's answer
    once the suspension is applied: the zero-byte suspend writes nothing, so the client sends
    it again, and the command reports the journal suspended (it failed with UNAVAILABLE, the
    commit having been sent)."""
    journal = "lost/suspend"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    proxied = dialer.journal_stub(proxy.address)
    await append(proxied, journal, b"some content;")  # Connected (the broker's settings came).
    proxy.holding = True
    task = asyncio.ensure_future(_suspend_one(proxied, journal, pb.AppendRequest.SUSPEND_NOW, 30.0))
    try:

        async def suspended() -> bool:
            spec = await spec_of(etcd, etcd_prefix, journal)
            return spec.suspend.level == pb.JournalSpec.Suspend.PARTIAL

        await until(suspended, "suspended")
        assert not task.done()
        proxy.cut()  # The answer is lost; the suspension was applied.
        failed, _revision = await asyncio.wait_for(task, 60)
    finally:
        task.cancel()
    assert failed == ""
