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
