"""The one-message append: a small append whose content the client holds whole goes as one unary
call, its parameters and content in one message (`JournalStub.AppendWhole`), where the protocol
streams the parameters, the content and an empty commit message. Our brokers take it as the
whole append; a broker that refuses it (upstream's: "unexpected Content") is sent the streamed
form instead, by the same `append` call, and nothing lands twice."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from broker.client.appender import append
from broker.client.journals import JournalStub, dial
from broker.fragment.fragments import digest_of
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, free_port
from tests.helpers.fake_broker import UpstreamLikeJournal, fake_broker
from tests.helpers.journals import IDS, journal_spec, read_all, set_journal, started_brokers, stub


@pytest.fixture
async def brokers(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as harnesses:  # type: ignore[attr-defined]
        yield harnesses


async def test_a_one_message_append_commits_on_every_replica(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(etcd, etcd_prefix, journal_spec("whole/one"), [("local", i) for i in IDS])
    journal_stub = stub(brokers[0])
    assert isinstance(journal_stub, JournalStub) and journal_stub.whole_appends
    # The call itself: one message, no commit message after it.
    first = await journal_stub.AppendWhole(pb.AppendRequest(journal="whole/one", content=b"one\n"))
    assert first.status == pb.OK and (first.commit.begin, first.commit.end) == (0, 4)
    # Then a streamed append (content in pieces), and one-message appends with registers.
    second = await append(journal_stub, "whole/one", [b"two", b"\n"])
    third = await append(
        journal_stub, "whole/one", b"three\n", union_registers=labels.label_set(("owner", "me"))
    )
    fourth = await append(
        journal_stub, "whole/one", b"four\n",
        check_registers=labels.selector(include=labels.label_set(("owner", "me"))),
    )  # fmt: skip
    refused = await append(
        journal_stub, "whole/one", b"never\n", check=False,
        check_registers=labels.selector(include=labels.label_set(("owner", "other"))),
    )  # fmt: skip
    assert [(a.commit.begin, a.commit.end) for a in (second, third, fourth)] == [
        (4, 8), (8, 14), (14, 19),
    ]  # fmt: skip
    assert refused.status == pb.REGISTER_MISMATCH
    assert journal_stub.whole_appends  # Our broker took the form: it stays in use.
    for h in brokers:
        assert await read_all(h, "whole/one") == b"one\ntwo\nthree\nfour\n"


async def test_a_one_message_append_at_an_offset_and_a_large_one(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """Appends not committed in a group (an explicit offset; content past what a group takes)
    stream their one message's content through the state machine as any append's."""
    await set_journal(etcd, etcd_prefix, journal_spec("whole/big"), [("local", i) for i in IDS])
    journal_stub = stub(brokers[0])
    big = b"".join(b"%07d\n" % i for i in range(12_000))  # 96,000 bytes: past a group's 64 KiB.
    first = await append(journal_stub, "whole/big", big)
    assert (first.commit.begin, first.commit.end) == (0, len(big))
    assert digest_of(first.commit.sum) == hashlib.sha1(big).digest()
    at = await append(journal_stub, "whole/big", b"at\n", offset=len(big))
    assert at.commit.begin == len(big)
    wrong = await append(journal_stub, "whole/big", b"wrong\n", offset=5, check=False)
    assert wrong.status == pb.WRONG_APPEND_OFFSET
    for h in brokers:
        assert await read_all(h, "whole/big") == big + b"at\n"


async def test_a_one_message_append_through_a_non_primary_is_proxied_once(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(
        etcd, etcd_prefix, journal_spec("whole/proxy", replication=2),
        [("local", "broker-a"), ("local", "broker-b")],
    )  # fmt: skip
    proxy = stub(brokers[2])  # broker-c: not a replica; it forwards the append.
    answers = [await append(proxy, "whole/proxy", b"line %d\n" % i) for i in range(3)]
    assert [a.commit.begin for a in answers] == [0, 7, 14]
    assert await read_all(brokers[0], "whole/proxy") == b"line 0\nline 1\nline 2\n"


async def test_a_broker_that_refuses_the_one_message_form_gets_the_streamed_form() -> None:
    servicer = UpstreamLikeJournal()
    async with fake_broker(servicer) as (_, address):
        channel = dial(address)
        try:
            journal_stub = JournalStub(channel)
            first = await append(journal_stub, "a/journal", b"first\n")
            second = await append(journal_stub, "a/journal", b"second\n")
            assert (first.commit.begin, second.commit.begin) == (0, 6)
            assert servicer.committed == [b"first\n", b"second\n"]  # Each once.
            assert servicer.refused == 1  # Once per stub: after it, appends stream.
            assert not journal_stub.whole_appends
        finally:
            await channel.close(None)


class SilentJournal(pb_grpc.JournalServicer):
    """Takes an Append's message and never answers."""

    def __init__(self) -> None:
        self.received = asyncio.Event()

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        await anext(request_iterator)
        self.received.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_one_message_append_that_failed_says_whether_its_commit_went() -> None:
    """A one-message append carries its commit: once the call may have reached a broker, its
    failure is marked `commit_sent` (it may have landed: `append_routed` does not send it
    again), and only a call that never left, for want of a connection, is not."""
    nobody = dial(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await append(JournalStub(nobody), "a/journal", b"never sent\n")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.commit_sent is False  # type: ignore[attr-defined]
    finally:
        await nobody.close(None)

    servicer = SilentJournal()
    async with fake_broker(servicer) as (server, address):
        channel = dial(address)
        try:
            call = asyncio.ensure_future(append(JournalStub(channel), "a/journal", b"sent\n"))
            await asyncio.wait_for(servicer.received.wait(), 10)
            await server.stop(None)  # The broker goes away with the append in hand.
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await call
            assert lost.value.commit_sent is True  # type: ignore[attr-defined]
        finally:
            await channel.close(None)
