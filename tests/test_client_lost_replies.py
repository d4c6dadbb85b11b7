"""Appends whose reply is lost on the way back, over real sockets (a TCP proxy that holds the
broker's answers, then cuts the connection): the client library repeats what is safe to repeat
(a zero-byte append, such as `gazctl journals suspend`), and never sends again a batch of content
whose commit went through (`gazctl journals append --mapping`): its outcome is unknown, and said
so."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator

import aetcd
import pytest

from allocator import keyspace as aks
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.dialer import Dialer
from broker.client.reader import write_head
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from gazctl.fragments import _suspend_one
from tests.helpers.journals import journal_spec, read_all, set_journal, started_brokers
from tests.helpers.tcp_proxy import TcpProxy, host_port
from tests.helpers.waiting import until

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


async def test_append_service_never_sends_again_a_batch_whose_commit_went_through(
    broker: BrokerHarness, proxy: TcpProxy, dialer: Dialer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """AppendService, told its records are raw (`at_least_once=False`: no UUIDs to
    de-duplicate them by), sends a batch; the broker commits it, and the answer is lost with
    the connection. The batch may have landed, so it is not sent again: its records fail with
    AppendOutcomeUnknown, and the journal holds them once (the service retried the transient
    failure: they landed twice)."""
    from broker.client.append_service import AppendOutcomeUnknown

    journal = "lost/batch"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    direct = dialer.journal_stub(broker.endpoint)
    proxied = dialer.journal_stub(proxy.address)
    async with AppendService(proxied, max_retry_delay=0.1, at_least_once=False) as service:
        first = await service.append(journal, b"first;")  # Connected through the proxy.
        proxy.holding = True
        pending = await service.write(journal, b"second;")

        async def landed() -> bool:
            return await write_head(direct, journal) > first.end

        await until(landed, "landed")
        proxy.cut()  # The answer is lost; the batch was committed.
        with pytest.raises(AppendOutcomeUnknown) as unknown:
            await asyncio.wait_for(pending, 60)
    assert "second" not in str(unknown.value)  # Records are the writers', not the message's.
    assert journal in str(unknown.value) and "may have" in str(unknown.value)
    assert await read_all(broker, journal) == b"first;second;"


async def test_append_service_sends_messages_again_at_least_once_by_default(
    broker: BrokerHarness, proxy: TcpProxy, dialer: Dialer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """By default (messages, de-duplicated by their UUIDs downstream, as upstream's service),
    the same lost answer has the batch sent again: it lands, perhaps twice, and is acknowledged
    at its second place."""
    journal = "lost/messages"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    direct = dialer.journal_stub(broker.endpoint)
    async with AppendService(dialer.journal_stub(proxy.address), max_retry_delay=0.1) as service:
        first = await service.append(journal, b"first;")
        proxy.holding = True
        pending = await service.write(journal, b"again;")

        async def landed() -> bool:
            return await write_head(direct, journal) > first.end

        await until(landed, "landed")
        proxy.cut()
        span = await asyncio.wait_for(pending, 60)
    assert await read_all(broker, journal) == b"first;again;again;"
    assert (span.begin, span.end) == (12, 18)


async def test_gazctl_append_mapping_says_a_batch_whose_answer_was_lost_may_have_landed(
    broker: BrokerHarness, proxy: TcpProxy, dialer: Dialer, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """`gazctl journals append --mapping direct` through a connection that loses the answer to
    its second batch once the broker committed it: the records land once (they landed twice),
    and gazctl exits 1 with one line saying their outcome is unknown and what to do; the first
    batch is counted as appended."""
    journal = "lost/mapped"
    await set_journal(etcd, etcd_prefix, journal_spec(journal, replication=1), [("local", IDS[0])])
    direct = dialer.journal_stub(broker.endpoint)
    env = {k: v for k, v in os.environ.items() if k not in ("BROKER_ADDRESS", "BROKER_FILE_ROOT")}
    env["BROKER_ADDRESS"] = proxy.address
    gazctl = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gazctl.cli", "journals", "append", "-l", f"name={journal}",
        "--framing", "lines", "--mapping", "direct", "--wait", "5s",
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert gazctl.stdin is not None and gazctl.stderr is not None
    try:
        gazctl.stdin.write(f"{journal}\nfirst\n".encode())
        await gazctl.stdin.drain()

        async def head_past(offset: int) -> bool:
            if gazctl.returncode is not None:
                raise AssertionError((await gazctl.stderr.read()).decode())  # type: ignore[union-attr]
            return await write_head(direct, journal) > offset

        await until(lambda: head_past(0), "first landed", timeout=60)
        proxy.holding = True
        gazctl.stdin.write(f"{journal}\nsecond\n".encode())
        await gazctl.stdin.drain()
        await until(lambda: head_past(len(b"first\n")), "second landed", timeout=60)
        proxy.cut()  # The answer is lost; the batch was committed.
        gazctl.stdin.close()
        err = (await asyncio.wait_for(gazctl.stderr.read(), 60)).decode()
        code = await asyncio.wait_for(gazctl.wait(), 60)
    finally:
        if gazctl.returncode is None:
            gazctl.kill()
            await gazctl.wait()
    assert await read_all(broker, journal) == b"first\nsecond\n"
    assert code == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "failed after its commit was sent" in lines[0], err
    assert "may have been appended or not" in lines[0], err
    assert f"read {journal} to check before appending them again" in lines[0], err
    assert f"records appended: 1 to {journal}" in lines[0], err
