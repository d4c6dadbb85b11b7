"""Bad input to a broker: a clear status or error, the broker keeps serving, nothing is lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from broker.client import BrokerUnavailable
from broker.client.appender import append
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import (
    append_streams,
    journal_spec,
    read_all,
    set_journal,
    started_brokers,
)
from tests.helpers.waiting import until

IDS = ["broker-a", "broker-b"]


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> AsyncIterator[list[BrokerHarness]]:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as hs:
        await set_journal(
            etcd, etcd_prefix, journal_spec("bad/j", replication=2), [("local", i) for i in IDS]
        )
        yield hs


def stub(h: BrokerHarness):  # type: ignore[no-untyped-def]
    return h.broker.service.dialer.journal_stub(h.endpoint)


async def test_invalid_requests_are_refused_and_the_broker_keeps_serving(
    brokers: list[BrokerHarness],
) -> None:
    s = stub(brokers[0])
    await append(s, "bad/j", b"kept")
    for journal in ("/leading/slash", "no", "bad//double", "x" * 600):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await append(s, journal, b"x")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "journal" in (info.value.details() or "")
    # Content in the first message is the whole append (the one-message form): a stream that
    # goes on after it is refused, and none of it appended. Then a negative offset.
    call = s.Append()
    await call.write(pb.AppendRequest(journal="bad/j", content=b"sneaky"))
    await call.write(pb.AppendRequest(content=b"more"))
    await call.write(pb.AppendRequest())
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the stream must end after it" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await append(s, "bad/j", b"x", offset=-5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in s.Read(pb.ReadRequest(journal="bad j", offset=0)):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Oversized messages are refused by gRPC itself (4 MiB by default): the broker answers
    # RESOURCE_EXHAUSTED, which the client may see as its own send failing.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await append(s, "bad/j", b"y" * (5 << 20), chunk_size=5 << 20)
    assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
    # Still serving, and nothing was lost or half-applied.
    await append(s, "bad/j", b";after")
    for h in brokers:
        assert await read_all(h, "bad/j") == b"kept;after"


async def replicate_header(h: BrokerHarness, journal: str) -> pb.Header:
    """The header a primary would send `h`, once `h` has seen the journal's assignments."""
    resolver = h.broker.service.resolver
    async with asyncio.timeout(10):
        while len(resolver.assignments_of(journal)) != len(IDS):
            await h.broker.ks.wait_for_update()
    return pb.Header(
        process_id=pb.ProcessSpec.ID(zone="local", suffix=h.broker.config.id),
        route=resolver.route_of(resolver.assignments_of(journal)),
        etcd=resolver.etcd_header(),
    )


async def ghost_primary(etcd: aetcd.Client, etcd_prefix: str, journal: str) -> aetcd.Lease:
    """`journal`, replicated by broker-b from a primary that is a member running no broker, so
    that broker-b's spool is free for a rogue (a live primary's pipeline would own it). The
    ghost lives as long as the lease returned."""
    from allocator import keyspace as aks

    lease = await etcd.lease(30)
    ghost = pb.BrokerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="local", suffix="ghost-broker"), endpoint="http://127.0.0.1:1"
        )
    )
    await etcd.put(
        aks.member_key(etcd_prefix, "local", "ghost-broker").encode(),
        ghost.SerializeToString(),
        lease=lease.id,
    )
    await set_journal(
        etcd,
        etcd_prefix,
        journal_spec(journal, replication=2),
        [("local", "ghost-broker"), ("local", "broker-b")],
    )
    return lease


async def test_a_rogue_replication_stream_cannot_corrupt_a_replica(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    lease = await ghost_primary(etcd, etcd_prefix, "bad/k")
    replica = stub(brokers[1])
    call = replica.Replicate()
    # A proposal that does not match the replica's spool is answered PROPOSAL_MISMATCH.
    bogus = pb.Fragment(journal="bad/k", begin=0, end=4)
    await call.write(
        pb.ReplicateRequest(
            header=await replicate_header(brokers[1], "bad/k"), proposal=bogus, acknowledge=True
        )
    )
    response = await asyncio.wait_for(call.read(), 10)
    assert response.status == pb.PROPOSAL_MISMATCH
    # A content chunk at the wrong delta is an invalid transition: the stream is aborted.
    await call.write(pb.ReplicateRequest(content=b"junk", content_delta=99))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The journal carries on under a real primary (offsets only ever move forward), and the
    # junk is nowhere.
    await set_journal(
        etcd, etcd_prefix, journal_spec("bad/k", replication=2), [("local", i) for i in IDS]
    )
    await lease.revoke()
    response = await append(stub(brokers[0]), "bad/k", b"ABC")
    for h in brokers:
        content = await read_all(h, "bad/k", response.commit.begin)
        assert content == b"ABC"


async def test_a_replicate_stream_waits_while_the_primary_owns_the_spool(
    brokers: list[BrokerHarness],
) -> None:
    await append(stub(brokers[0]), "bad/j", b"first")  # The primary's pipeline now owns b's spool.
    call = stub(brokers[1]).Replicate()
    proposal = pb.Fragment(journal="bad/j", begin=0, end=0)
    await call.write(
        pb.ReplicateRequest(
            header=await replicate_header(brokers[1], "bad/j"), proposal=proposal, acknowledge=True
        )
    )
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(call.read()), 0.5)
    call.cancel()
    await append(stub(brokers[0]), "bad/j", b";second")
    for h in brokers:
        assert await read_all(h, "bad/j") == b"first;second"


async def test_route_change_mid_append(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = stub(brokers[0])
    await append(s, "bad/j", b"one;")
    streams = append_streams(monkeypatch)
    call = s.Append()
    await call.write(pb.AppendRequest(journal="bad/j"))
    await call.write(pb.AppendRequest(content=b"two;"))
    await until(
        lambda: any(st.bytes_received == len(b"two;") for st in streams),
        "the primary reads the append's content",
    )
    # The primary and replica swap while the append streams.
    await set_journal(
        etcd,
        etcd_prefix,
        journal_spec("bad/j", replication=2),
        [("local", "broker-b"), ("local", "broker-a")],
    )
    await call.write(pb.AppendRequest())
    await call.done_writing()
    try:
        response = await call
        in_flight_ok = response.status == pb.OK
    except grpc.aio.AioRpcError:
        in_flight_ok = False
    # Either the in-flight append committed or it rolled back; the next lands after it.
    after = await append(stub(brokers[1]), "bad/j", b"three;")
    expected = b"one;two;three;" if in_flight_ok else b"one;three;"
    assert after.commit.end == len(expected)
    for h in brokers:
        assert await read_all(h, "bad/j") == expected


async def test_the_client_library_dials_https_addresses_with_tls_only() -> None:
    from broker.client import JournalsClient
    from broker.client.journals import grpc_target

    assert grpc_target("https://127.0.0.1:8080") == "127.0.0.1:8080"
    assert grpc_target("https://broker.example") == "broker.example:443"
    assert grpc_target("http://127.0.0.1:8080") == "127.0.0.1:8080"
    assert grpc_target("127.0.0.1:8080") == "127.0.0.1:8080"
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        grpc_target("unix:///var/run/broker.sock")
    # What an https:// address is sent: a TLS handshake (a record of type 22), never HTTP/2.
    async with counting_listener() as (port, connections, first_bytes):
        async with JournalsClient(f"https://127.0.0.1:{port}", timeout=2) as client:
            with pytest.raises(BrokerUnavailable):
                await client.list()
        assert connections and first_bytes and all(b[:1] == b"\x16" for b in first_bytes)


@contextlib.asynccontextmanager
async def counting_listener() -> AsyncIterator[tuple[int, list[int], list[bytes]]]:
    """A TCP port on loopback that counts the connections made to it, keeps the first bytes
    sent on each, and closes them."""
    connections: list[int] = []
    first_bytes: list[bytes] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(Exception):
            first_bytes.append(await asyncio.wait_for(reader.read(16), 2))
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], connections, first_bytes
    finally:
        server.close()
        await server.wait_closed()


async def test_a_peer_advertising_https_is_not_dialled_in_plaintext(
    brokers: list[BrokerHarness], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    # Another broker advertises an https:// endpoint but does not complete a TLS handshake:
    # replication to it and proxying to it fail, and nothing is sent to it in plaintext.
    from allocator import keyspace as aks

    async with counting_listener() as (port, connections, first_bytes):
        endpoint = f"https://127.0.0.1:{port}"
        lease = await etcd.lease(30)
        tls = pb.BrokerSpec(
            process_spec=pb.ProcessSpec(
                id=pb.ProcessSpec.ID(zone="local", suffix="tls-broker"), endpoint=endpoint
            )
        )
        await etcd.put(
            aks.member_key(etcd_prefix, "local", "tls-broker").encode(),
            tls.SerializeToString(),
            lease=lease.id,
        )
        a, b = (("local", i) for i in IDS)
        tls_member = ("local", "tls-broker")
        await set_journal(etcd, etcd_prefix, journal_spec("tls/replica", 2), [a, tls_member])
        await set_journal(etcd, etcd_prefix, journal_spec("tls/primary", 2), [tls_member, a])
        await set_journal(etcd, etcd_prefix, journal_spec("tls/only", 1), [tls_member])
        s = stub(brokers[0])

        # Replication: the pipeline to the peer fails, and the append with it.
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(append(s, "tls/replica", b"never"), 10)
        # Proxying an append to it, and a read.
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(append(s, "tls/primary", b"never"), 10)
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(read_all(brokers[0], "tls/only"), 10)

        # The failed pipeline gave its spool back: once the journal moves to brokers that
        # can be dialled, it takes appends again.
        await set_journal(etcd, etcd_prefix, journal_spec("tls/replica", 2), [a, b])
        await lease.revoke()
        response = await append(s, "tls/replica", b"after")
        for h in brokers:
            assert await read_all(h, "tls/replica", response.commit.begin) == b"after"
        # It was dialled, with TLS only: every connection began with a handshake record.
        assert connections and all(b[:1] == b"\x16" for b in first_bytes), first_bytes


class _Registered:
    """Stands in for a grpc.aio.Server to capture the handlers a service registers."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []  # type: ignore[type-arg]

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:  # type: ignore[type-arg]
        self.handlers.extend(handlers)


@contextlib.asynccontextmanager
async def refusing_server(h: BrokerHarness) -> AsyncIterator[grpc.aio.Channel]:
    """The broker's Journal service, its handlers wrapped by wire.refusing_undecodable, on a
    server of its own; a channel to it."""
    from broker.protocol import wire
    from broker.service import add_journal_service

    registered = _Registered()
    add_journal_service(h.broker.service, registered)  # type: ignore[arg-type]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        tuple(wire.refusing_undecodable(handler) for handler in registered.handlers)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


SHAPES = {
    "List": "unary_stream",
    "Apply": "unary_unary",
    "Read": "unary_stream",
    "Append": "stream_unary",
    "Replicate": "stream_stream",
    "ListFragments": "unary_unary",
    "FragmentStoreHealth": "unary_unary",
}


async def raw_call(channel: grpc.aio.Channel, method: str, payloads: list[bytes]) -> object:
    """Send `payloads` as they are (no serializer) and return what the call answered."""
    shape = SHAPES[method]
    multicallable = getattr(channel, shape)(f"/protocol.Journal/{method}")
    if shape == "unary_unary":
        return await multicallable(payloads[0], timeout=10)
    if shape == "unary_stream":
        return [r async for r in multicallable(payloads[0], timeout=10)]
    if shape == "stream_unary":
        return await multicallable(iter(payloads), timeout=10)
    return [r async for r in multicallable(iter(payloads), timeout=10)]


async def test_requests_that_are_not_protobuf_are_refused_in_one_line(
    brokers: list[BrokerHarness],
    etcd: aetcd.Client,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by tests/test_fuzz.py: gRPC answers UNKNOWN and logs a traceback for request bytes
    # its deserializer refuses. Wrapped, the service answers INVALID_ARGUMENT instead.
    undecodable = b"\xff\xff\xff"
    await append(stub(brokers[0]), "bad/j", b"kept;")
    async with refusing_server(brokers[0]) as channel:
        for method in SHAPES:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(channel, method, [undecodable])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            details = info.value.details() or ""
            assert "not a valid protobuf message (3 bytes)" in details and "\n" not in details
        # A stream is refused at its first message that does not parse: an append in the
        # middle of its content is rolled back, and a Replicate stream gives its spool back.
        first = pb.AppendRequest(journal="bad/j").SerializeToString()
        chunk = pb.AppendRequest(content=b"never").SerializeToString()
        for payloads in ([first, chunk, undecodable], [first, undecodable, chunk]):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw_call(channel, "Append", payloads)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        lease = await ghost_primary(etcd, etcd_prefix, "bad/g")
        proposal = pb.ReplicateRequest(
            header=await replicate_header(brokers[1], "bad/g"),
            proposal=pb.Fragment(journal="bad/g", begin=0, end=0),
            acknowledge=True,
        )
        rogue = [proposal.SerializeToString(), undecodable]
        async with refusing_server(brokers[1]) as replica:
            for _ in range(2):  # The second stream finds the spool the first gave back.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await raw_call(replica, "Replicate", rogue)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await lease.revoke()
        # Valid requests are served as before.
        listed = await raw_call(channel, "List", [pb.ListRequest().SerializeToString()])
        assert isinstance(listed, list) and pb.ListResponse.FromString(listed[0]).status == pb.OK
    await append(stub(brokers[0]), "bad/j", b"after")
    for h in brokers:
        assert await read_all(h, "bad/j") == b"kept;after"
    assert "raised by servicer method" not in caplog.text
    assert "Abort" not in caplog.text
