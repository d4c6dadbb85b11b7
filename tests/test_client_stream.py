"""ClientStream, the Append handler's reader of the client's messages, against a client that
streams as a test tells it (a fake peer for this one state: the e2e tests cover the RPC). Its
read waits in the FSM's own task: a client that leaves, or streams too slowly, cuts only that
wait short; a cancellation of the task from elsewhere still cancels it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from broker import append_api
from broker.append_api import ClientStream
from broker.protocol import protocol_pb2 as pb


class Client:
    """Messages the test hands over, one at a time."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.AppendRequest | None] = asyncio.Queue()

    async def requests(self) -> AsyncIterator[pb.AppendRequest]:
        while (request := await self.queue.get()) is not None:
            yield request


async def test_messages_then_the_end_of_the_stream() -> None:
    client = Client()
    stream = ClientStream(client.requests(), min_rate=0)
    client.queue.put_nowait(pb.AppendRequest(content=b"abc"))
    client.queue.put_nowait(None)
    first = await stream.receive()
    assert first.request is not None and first.request.content == b"abc"
    assert first.error is None and stream.bytes_received == 3
    end = await stream.receive()
    assert end.request is None and end.error is None


async def test_a_client_that_leaves_ends_the_read_and_not_the_task() -> None:
    client = Client()
    stream = ClientStream(client.requests(), min_rate=0)

    async def fsm() -> tuple[str, int]:
        chunk = await stream.receive()
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # The task goes on: nothing of the cut is left pending.
        assert chunk.error is not None
        return str(chunk.error), task.cancelling()

    task = asyncio.ensure_future(fsm())
    await asyncio.sleep(0.01)
    stream.leave()
    why, cancelling = await task
    assert "went away" in why and cancelling == 0
    again = await stream.receive()  # And every later read.
    assert again.error is not None and "went away" in str(again.error)


async def test_a_client_slower_than_the_minimum_rate_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(append_api, "FLOW_GRACE", 0.05)
    client = Client()
    stream = ClientStream(client.requests(), min_rate=1 << 20)
    chunk = await asyncio.wait_for(stream.receive(), 5)
    assert chunk.error is not None and "min-append-rate" in str(chunk.error)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


@pytest.mark.parametrize("left_too", [False, True])
async def test_a_cancellation_from_elsewhere_still_cancels_the_task(left_too: bool) -> None:
    client = Client()
    stream = ClientStream(client.requests(), min_rate=0)
    task = asyncio.ensure_future(stream.receive())
    await asyncio.sleep(0.01)
    task.cancel()  # The broker stops, say.
    if left_too:
        stream.leave()  # And the client leaves in the same turn.
    with pytest.raises(asyncio.CancelledError):
        await task
