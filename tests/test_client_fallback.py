"""Against upstream's brokers, which refuse the one-message append form, the client falls back
to streaming once per broker: the refusal is remembered by the dialer for the endpoint, so every
later small append is one call, whichever stub (the router builds one a call) sends it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from broker.client.append_service import AppendService
from broker.client.routes import Router, append_routed
from broker.protocol import protocol_pb2 as pb
from tests.helpers.fake_broker import UpstreamLikeJournal, fake_broker

APPENDS = 10


class CountingUpstream(UpstreamLikeJournal):
    """UpstreamLikeJournal that counts every Append call it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        self.calls += 1
        return await super().Append(request_iterator, context)


async def test_small_appends_through_a_router_cost_one_call_each_after_one_refusal() -> None:
    """N small appends to an upstream-shaped broker through the library's routed appender: the
    broker receives N + 1 calls (the first append's one-message form refused once), not 2N."""
    servicer = CountingUpstream()
    async with fake_broker(servicer) as (_, address):
        router = Router(address)
        try:
            for i in range(APPENDS):
                await append_routed(router, "a/journal", f"record {i}\n".encode())
        finally:
            await router.close()
    assert len(servicer.committed) == APPENDS
    assert servicer.refused == 1
    assert servicer.calls == APPENDS + 1


async def test_append_service_batches_to_an_upstream_broker_cost_one_call_each() -> None:
    """AppendService over a Router, one batch after another: one refusal in all."""
    servicer = CountingUpstream()
    async with fake_broker(servicer) as (_, address):
        router = Router(address)
        try:
            async with AppendService(router) as service:
                for i in range(APPENDS):
                    await service.append("a/journal", f"record {i}\n".encode())
        finally:
            await router.close()
    assert len(servicer.committed) == APPENDS
    assert servicer.refused == 1
    assert servicer.calls == APPENDS + 1
