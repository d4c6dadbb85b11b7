"""Lease keep-alives stop when cancelled, whatever etcd does: even when a refresh's reply lands in
the same loop turn as the cancellation (Python 3.11's `asyncio.wait_for` returns the reply then,
and a keep-alive loop built on it goes on through its owner's stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from consumer.runtime import Consumer
from replication.server import LocationServer


class RaceEtcd:
    """A fake etcd whose lease refresh waits until the test releases its reply: the test then
    cancels the keep-alive in the same loop turn, so the reply and the cancellation meet."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.reply = asyncio.Event()
        self.refreshes = 0

    async def refresh_lease(self, lease_id: int) -> Any:
        self.refreshes += 1
        self.asked.set()
        await self.reply.wait()
        return SimpleNamespace(TTL=5)


async def cancel_as_the_reply_lands(
    keep_alive: Callable[[RaceEtcd], Coroutine[Any, Any, None]],
) -> RaceEtcd:
    etcd = RaceEtcd()
    task = asyncio.create_task(keep_alive(etcd))
    async with asyncio.timeout(10):
        await etcd.asked.wait()
    etcd.reply.set()  # The refresh ends at the loop's next turn ...
    task.cancel()  # ... the very turn the keep-alive learns of its cancellation.
    done, _ = await asyncio.wait([task], timeout=5)
    if not done:  # Still looping: stop it for good so the test itself ends.
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        pytest.fail(f"the keep-alive went on after its cancellation ({etcd.refreshes} refreshes)")
    assert task.cancelled()
    return etcd


async def test_a_consumers_keep_alive_stops_when_cancelled_as_a_refresh_returns() -> None:
    def keep_alive(etcd: RaceEtcd) -> Coroutine[Any, Any, None]:
        consumer = SimpleNamespace(etcd=etcd, lease_id=7, member_key="/c/members/z#a")
        return Consumer._keep_lease_alive(consumer, ttl=1)  # type: ignore[arg-type]

    await cancel_as_the_reply_lands(keep_alive)


async def test_a_locations_keep_alive_stops_when_cancelled_as_a_refresh_returns() -> None:
    def keep_alive(etcd: RaceEtcd) -> Coroutine[Any, Any, None]:
        server = SimpleNamespace(_etcd=etcd, config=SimpleNamespace(lease=1.0), name="A")
        return LocationServer._keep_lease(server, 7)  # type: ignore[arg-type]

    await cancel_as_the_reply_lands(keep_alive)
