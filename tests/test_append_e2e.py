"""Appends and reads through real in-process brokers replicating over real gRPC."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import aetcd
import pytest

from broker.client.appender import AppendError, append
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import (
    IDS,
    append_streams,
    journal_spec,
    read_all,
    set_journal,
    started_brokers,
    stub,
)
from tests.helpers.waiting import until


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    # Assignments are written by the tests themselves (set_journal), so no allocator runs.
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as harnesses:
        yield harnesses


async def test_append_commits_on_every_replica_and_reads_back(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(etcd, etcd_prefix, journal_spec("e2e/one"), [("local", i) for i in IDS])
    first = await append(stub(brokers[0]), "e2e/one", b"hello, ")
    assert first.commit.begin == 0 and first.commit.end == 7
    second = await append(stub(brokers[0]), "e2e/one", b"world\n")
    assert (second.commit.begin, second.commit.end) == (7, 13)
    for h in brokers:
        assert await read_all(h, "e2e/one") == b"hello, world\n"


async def test_append_through_a_non_primary_is_proxied(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(etcd, etcd_prefix, journal_spec("e2e/proxy"), [("local", i) for i in IDS])
    response = await append(stub(brokers[2]), "e2e/proxy", b"via c")
    assert response.header.process_id.suffix == "broker-a"
    assert await read_all(brokers[1], "e2e/proxy") == b"via c"
    with pytest.raises(AppendError) as info:
        await append(stub(brokers[2]), "e2e/proxy", b"x", do_not_proxy=True)
    assert info.value.status == pb.NOT_JOURNAL_PRIMARY_BROKER


async def test_too_few_brokers(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(
        etcd, etcd_prefix, journal_spec("e2e/few", replication=3), [("local", "broker-a")]
    )
    with pytest.raises(AppendError) as info:
        await append(stub(brokers[0]), "e2e/few", b"x")
    assert info.value.status == pb.INSUFFICIENT_JOURNAL_BROKERS
    with pytest.raises(AppendError) as info:
        await append(stub(brokers[0]), "e2e/absent", b"x")
    assert info.value.status == pb.JOURNAL_NOT_FOUND


async def test_cancelled_append_rolls_back_everywhere(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await set_journal(etcd, etcd_prefix, journal_spec("e2e/abort"), [("local", i) for i in IDS])
    await append(stub(brokers[0]), "e2e/abort", b"kept;")
    streams = append_streams(monkeypatch)
    call = stub(brokers[0]).Append()
    await call.write(pb.AppendRequest(journal="e2e/abort"))
    await call.write(pb.AppendRequest(content=b"never visible"))
    await until(
        lambda: any(s.bytes_received == len(b"never visible") for s in streams),
        "the primary reads the content it is to roll back",
    )
    call.cancel()
    # The next append lands at the same offset the aborted one would have used.
    response = await append(stub(brokers[0]), "e2e/abort", b"next")
    assert (response.commit.begin, response.commit.end) == (5, 9)
    for h in brokers:
        assert await read_all(h, "e2e/abort") == b"kept;next"


async def test_concurrent_appends_are_each_present_once(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    await set_journal(etcd, etcd_prefix, journal_spec("e2e/many"), [("local", i) for i in IDS])
    payloads = [f"<{i:03d}:{'x' * (i % 7)}>".encode() for i in range(60)]
    responses = await asyncio.gather(
        *(append(stub(brokers[i % 3]), "e2e/many", p) for i, p in enumerate(payloads))
    )
    spans = sorted((r.commit.begin, r.commit.end) for r in responses)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # No gap, no overlap.
    content = await read_all(brokers[1], "e2e/many")
    for payload, response in zip(payloads, responses, strict=True):
        assert content[response.commit.begin : response.commit.end] == payload
    assert len(content) == sum(len(p) for p in payloads)


async def test_registers_and_offsets_check_and_set(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    from broker.protocol import labels

    await set_journal(etcd, etcd_prefix, journal_spec("e2e/cas"), [("local", i) for i in IDS])
    s = stub(brokers[0])
    r = await append(s, "e2e/cas", b"a", union_registers=labels.label_set(("owner", "me")))
    assert labels.values_of(r.registers, "owner") == ["me"]
    with pytest.raises(AppendError) as info:
        await append(s, "e2e/cas", b"b", check_registers=labels.parse_selector("owner=you"))
    assert info.value.status == pb.REGISTER_MISMATCH
    await append(s, "e2e/cas", b"c", check_registers=labels.parse_selector("owner=me"))
    with pytest.raises(AppendError) as info:
        await append(s, "e2e/cas", b"d", offset=1)
    assert info.value.status == pb.WRONG_APPEND_OFFSET
    r = await append(s, "e2e/cas", b"e", offset=2)
    assert (r.commit.begin, r.commit.end) == (2, 3)
    assert await read_all(brokers[2], "e2e/cas") == b"ace"


class _Bytes:
    def __init__(self, data: bytes, begin: int) -> None:
        self.data, self.begin = data, begin

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset - self.begin : offset - self.begin + size]


async def test_index_with_a_greater_offset_refuses_appends_until_reset_head(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    from broker.client.appender import reset_head

    await set_journal(etcd, etcd_prefix, journal_spec("e2e/lost"), [("local", i) for i in IDS])
    s = stub(brokers[0])
    await append(s, "e2e/lost", b"0123456789")
    # The primary's index learns of a fragment beyond what the replicas synchronized on, as
    # when consistency was lost (another broker wrote [10, 20) and persisted it elsewhere).
    replica = brokers[0].broker.service.resolver.replicas["e2e/lost"]  # type: ignore[index]
    lost = pb.Fragment(journal="e2e/lost", begin=10, end=20)
    replica.index.on_complete(lost, _Bytes(b"abcdefghij", 10))
    with pytest.raises(AppendError) as info:
        await append(s, "e2e/lost", b"x")
    assert info.value.status == pb.INDEX_HAS_GREATER_OFFSET

    response = await reset_head(s, "e2e/lost")  # The operator confirms: continue at 20.
    assert response.commit.end == 20
    response = await append(s, "e2e/lost", b"after")
    assert (response.commit.begin, response.commit.end) == (20, 25)
    # Offsets [10, 20) were never written twice: the replicas skipped them.
    assert await read_all(brokers[1], "e2e/lost", 20) == b"after"


async def test_max_append_rate_delays_chunks(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    spec = journal_spec("e2e/rate")
    spec.max_append_rate = 64 * 1024
    await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
    s = stub(brokers[0])
    # The first second's worth passes at once; what exceeds it is delayed, not refused.
    first = await append(s, "e2e/rate", b"a" * 32 * 1024)
    assert first.delayed_chunks == 0
    second = await append(s, "e2e/rate", [b"b" * 32 * 1024] * 4)
    assert second.total_chunks == 4 and second.delayed_chunks >= 1
    assert second.commit.end == 5 * 32 * 1024


async def test_router_learns_the_primary_and_recovers_from_a_stale_route(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    from broker.client.routes import Router, append_routed

    await set_journal(
        etcd,
        etcd_prefix,
        journal_spec("e2e/routed", replication=2),
        [("local", "broker-a"), ("local", "broker-b")],
    )
    router = Router(brokers[2].endpoint)  # Knows only broker-c, which is not a replica.
    try:
        first = await append_routed(router, "e2e/routed", b"one;")
        route = router.cache.get("e2e/routed")
        assert route is not None and route.endpoints[route.primary] == brokers[0].endpoint
        # Now straight to the primary; then the journal moves away from broker-a, which
        # stops: the cached route fails, is forgotten, and the append goes through broker-c.
        await append_routed(router, "e2e/routed", b"two;")
        await set_journal(
            etcd,
            etcd_prefix,
            journal_spec("e2e/routed", replication=2),
            [("local", "broker-b"), ("local", "broker-c")],
        )
        await brokers[0].__aexit__(None, None, None)
        third = await append_routed(router, "e2e/routed", b"three;")
        assert third.header.process_id.suffix == "broker-b"
        assert first.commit.begin == 0 and third.commit.begin >= 8
        route = router.cache.get("e2e/routed")
        assert route is not None and route.endpoints[route.primary] == brokers[1].endpoint
    finally:
        await router.close()


async def test_retrying_reader_resumes_on_another_broker(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    from broker.client.dialer import Dialer
    from broker.client.reader import read_retrying

    await set_journal(
        etcd,
        etcd_prefix,
        journal_spec("e2e/tail", replication=2),
        [("local", "broker-a"), ("local", "broker-b")],
    )
    await append(stub(brokers[0]), "e2e/tail", b"one;")
    # Read through broker-c (which proxies) first; once it is gone, through broker-a.
    dialer = Dialer()  # The reader's own channels (a broker's dialer closes with it).
    targets = [dialer.journal_stub(brokers[2].endpoint), dialer.journal_stub(brokers[0].endpoint)]
    calls = 0

    def next_stub():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return targets[0] if calls == 1 else targets[1]

    received = bytearray()
    reader = read_retrying(next_stub, "e2e/tail", 0)
    async with asyncio.timeout(20):
        async for chunk in reader:
            assert chunk.offset == len(received)  # Resumed exactly where it left off.
            received += chunk.content
            if received == b"one;":
                await brokers[2].__aexit__(None, None, None)  # The broker read through dies.
                await append(stub(brokers[0]), "e2e/tail", b"two;")
            if received == b"one;two;":
                break
    await reader.aclose()
    await dialer.close()
    assert calls >= 2
