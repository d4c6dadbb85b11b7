"""The appender's half-close meeting the end of its call.

grpc.aio raises its internal ExecuteBatchError, not an AioRpcError, from `done_writing` when the
call ended (its deadline passed, or the broker answered) in the instant between the last write
and the half-close: seen under load in `test_writers_whose_clients_leave_at_random_points_commit_each_append_at_most_once`.
The call's own outcome is what the caller must see. A fake call stands in for that one instant,
which a real server cannot be made to hit on demand."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc.aio import InternalError as CoreError

from broker.client.appender import append
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer


class EndedCall:
    """A streaming Append call that ends (with `outcome`) as the client half-closes it."""

    def __init__(self, outcome: BaseException | pb.AppendResponse) -> None:
        self.outcome = outcome
        self.written: list[pb.AppendRequest] = []
        self.cancelled = False

    async def write(self, request: pb.AppendRequest) -> None:
        self.written.append(request)

    async def done_writing(self) -> None:
        raise CoreError('Failed "execute_batch": (SendCloseFromClientOperation,)')

    def done(self) -> bool:
        return False

    def add_done_callback(self, _callback: object) -> None:
        pass

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __await__(self) -> Any:
        async def result() -> pb.AppendResponse:
            await asyncio.sleep(0)
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return result().__await__()

    async def initial_metadata(self) -> tuple[()]:
        return ()


class Stub:
    def __init__(self, call: EndedCall) -> None:
        self.call = call

    def Append(self, **_kwargs: object) -> EndedCall:
        return self.call


async def test_a_deadline_that_ends_the_call_at_its_half_close_is_the_callers_error() -> None:
    deadline = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Deadline Exceeded",
    )
    call = EndedCall(deadline)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await append(Stub(call), "a/journal", b"x" * 70_000, timeout=0.5)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The commit chunk was written: the append's outcome is unknown, and says so.
    assert info.value.commit_sent is True  # type: ignore[attr-defined]
    assert call.written[-1] == pb.AppendRequest()


async def test_an_answer_that_ends_the_call_at_its_half_close_is_returned() -> None:
    answer = pb.AppendResponse(
        status=pb.OK, commit=pb.Fragment(journal="a/journal", begin=0, end=3)
    )
    call = EndedCall(answer)
    response = await append(Stub(call), "a/journal", [b"abc"])  # type: ignore[arg-type]
    assert response.commit.end == 3
    assert not call.cancelled


async def test_an_append_whose_channel_closes_as_it_starts_fails_and_does_not_wait_for_good(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A real call, this one: its channel closed before the call's metadata was sent. grpc.aio
    then ends the call CANCELLED, and its first write waits for the metadata for good (seen in
    `test_a_client_closed_with_batches_in_flight_settles_them_all_unlogged` under load: the
    AppendService's next batch started on the channel closing under it, and its close hung).
    The append fails with the call's status."""
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix) as harness:
        for turns in range(1, 5):  # A few loop turns after the call started.
            channel = grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://"))
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            appending = asyncio.ensure_future(append(stub, "races/closed", b"x" * 100_000))
            for _ in range(turns):
                await asyncio.sleep(0)
            await channel.close(None)
            async with asyncio.timeout(10):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await appending
            assert info.value.code() == grpc.StatusCode.CANCELLED, info.value
