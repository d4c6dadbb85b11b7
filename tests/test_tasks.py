"""The task owner, the one wait for the first of several awaitables (and on events), the taking of an owned item from a queue, work
on a worker thread waited out through cancellation, and the one retry backoff."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from plumbing.backoff import Backoff
from plumbing.tasks import Event, Slot, TaskOwner, first_of, in_thread, take_unless, wait_any
from tests.helpers.waiting import until


async def test_close_cancels_and_awaits_every_task_and_refuses_new_ones() -> None:
    owner = TaskOwner("test")
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)  # Clean-up that itself awaits: close waits for it.
            ended.append(name)

    owner.spawn(forever("a"), "a")
    owner.spawn(forever("b"), "b")
    assert len(owner) == 2
    await asyncio.sleep(0)  # Both started (a task cancelled before its start never runs).
    await owner.close()
    assert sorted(ended) == ["a", "b"] and len(owner) == 0
    coro = forever("c")
    with pytest.raises(RuntimeError, match="closed"):
        owner.spawn(coro, "c")
    await owner.close()  # Twice is fine.


async def test_close_cancels_again_a_task_that_swallowed_its_cancellation() -> None:
    """Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives as its inner
    call ends: the task goes on as if never cancelled. A broker's lease keep-alive did so once
    in CI, inside `await asyncio.wait_for(refresh_lease(...))`, and `close` waited for it
    forever, holding the broker's stop (and the test) until pytest's timeout."""
    owner = TaskOwner("test")
    swallowed = asyncio.Event()

    async def loses_one_cancellation() -> None:
        while True:
            try:
                await asyncio.sleep(10)  # Longer than the test: it ends only cancelled.
            except asyncio.CancelledError:
                if swallowed.is_set():
                    raise
                swallowed.set()  # And loops on, as the keep-alive did.

    owner.spawn(loses_one_cancellation(), "stubborn")
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await owner.close()
    assert swallowed.is_set() and len(owner) == 0


async def test_join_waits_for_tasks_to_end_by_themselves_within_a_bound() -> None:
    owner = TaskOwner("test")
    owner.spawn(asyncio.sleep(0.05), "short")  # A task that ends by itself, soon.
    assert await owner.join(timeout=5)
    owner.spawn(asyncio.Event().wait(), "stuck")
    assert not await owner.join(timeout=0.05)
    await owner.close(grace=0.01)
    assert len(owner) == 0


async def test_a_failed_task_is_logged_with_its_name(caplog: pytest.LogCaptureFixture) -> None:
    owner = TaskOwner("test")

    async def fail() -> None:
        raise ValueError("boom")

    task = owner.spawn(fail(), "failing")
    await asyncio.wait({task})
    await asyncio.sleep(0)
    assert "test: failing failed: ValueError('boom')" in caplog.text
    await owner.close()


async def test_wait_any_returns_on_an_event_or_the_timeout() -> None:
    a, b = asyncio.Event(), asyncio.Event()
    assert not await wait_any(a, b, timeout=0.02)
    asyncio.get_running_loop().call_later(0.01, b.set)
    assert await wait_any(a, b, timeout=5)
    assert await wait_any(b)  # Already set: at once.


async def test_wait_any_on_our_events_needs_no_task_and_leaves_no_waiter() -> None:
    """On `Event`s, wait_any lists one future with each event (no task per event); whether it
    ends on an event, on its timeout or cancelled, it is unlisted from every event."""
    a, b = Event(), Event()
    tasks_before = len(asyncio.all_tasks())
    waiting = asyncio.ensure_future(wait_any(a, b, timeout=5))
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == tasks_before + 1  # The waiter itself, nothing more.
    assert a._waiting is not None and b._waiting is not None
    b.set()
    assert await waiting and a._waiting is None and b._waiting is None
    b.clear()
    assert not await wait_any(a, b, timeout=0.01)
    assert a._waiting is None and b._waiting is None
    cancelled = asyncio.ensure_future(wait_any(a, b))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert a._waiting is None and b._waiting is None
    a.set()  # Nothing left listening: no error from a cancelled future.
    mixed = asyncio.Event()  # Not ours: waited on as before.
    asyncio.get_running_loop().call_later(0.01, mixed.set)
    b.clear()
    assert await wait_any(b, mixed, timeout=5) and b._waiting is None


async def test_first_of_returns_at_the_first_done_and_cancels_only_what_it_started() -> None:
    cleaned: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(60)  # Longer than the test: it ends only cancelled.
        finally:
            await asyncio.sleep(0.01)  # Clean-up that awaits: first_of waits for it.
            cleaned.append(name)
        return name

    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    theirs = asyncio.ensure_future(asyncio.sleep(60))  # The caller's: never done, nor cancelled.
    try:
        done = await first_of(slow("a"), quick(), theirs)
        assert [f.done() for f in done] == [True, True, False]
        assert done[0].cancelled() and done[1].result() == 7 and done[2] is theirs
        assert cleaned == ["a"]  # Cancelled and awaited before first_of returned.
        assert not theirs.cancelled()
    finally:
        theirs.cancel()


async def test_first_of_ends_at_its_timeout_and_a_given_future_already_done_returns_at_once() -> (
    None
):
    done = await first_of(asyncio.sleep(60), timeout=0.01)  # Never done: the timeout ends it.
    assert done[0].cancelled()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    ready.set_result("now")
    waited = await first_of(asyncio.sleep(60), ready)  # Never done: `ready` ends it.
    assert waited[0].cancelled() and waited[1].result() == "now"
    assert await first_of(timeout=0) == []  # Nothing to wait on: it sleeps out its timeout.
    with pytest.raises(ValueError):
        await first_of()


async def test_first_of_cancelled_cancels_and_awaits_what_it_started() -> None:
    started, cleaned = asyncio.Event(), asyncio.Event()

    async def waits() -> None:
        started.set()
        try:
            await asyncio.sleep(60)  # Longer than the test: it ends only cancelled.
        finally:
            await asyncio.sleep(0.01)
            cleaned.set()

    caller = asyncio.ensure_future(first_of(waits(), asyncio.Event().wait()))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert cleaned.is_set()  # Its clean-up ran before the caller saw the cancellation.


async def test_first_of_hands_a_failure_to_the_caller_and_leaves_none_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("broken")

    done = await first_of(fails(), asyncio.sleep(60))  # Never done: the failure ends it.
    assert isinstance(done[0].exception(), RuntimeError)
    # A failure nobody looks at: not logged. (The sleep is never done.)
    await first_of(fails(), asyncio.sleep(60))
    del done
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_take_unless_never_loses_an_item_to_cancellation() -> None:
    for spins in range(6):
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        event = asyncio.Event()
        task = asyncio.ensure_future(take_unless(queue, event))
        await asyncio.sleep(0)
        queue.put_nowait("spool")
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        try:
            taken, item = await task
        except asyncio.CancelledError:
            assert queue.qsize() == 1, f"lost after {spins} steps"
        else:  # It finished first: the caller holds the item.
            assert taken and item == "spool" and queue.qsize() == 0
    queue = asyncio.Queue(maxsize=1)
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await take_unless(queue, event) == (False, None)


async def test_take_unless_never_loses_an_item_of_a_slot_to_cancellation() -> None:
    for spins in range(6):
        slot: Slot[str] = Slot()
        event = Event()
        task = asyncio.ensure_future(take_unless(slot, event))
        await asyncio.sleep(0)
        slot.put_nowait("spool")
        for _ in range(spins):
            await asyncio.sleep(0)
        task.cancel()
        try:
            taken, item = await task
        except asyncio.CancelledError:
            assert slot.qsize() == 1, f"lost after {spins} steps"
        else:
            assert taken and item == "spool" and slot.qsize() == 0
    event = Event()
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await take_unless(Slot[str](), event) == (False, None)


async def test_a_slot_serves_getters_in_order_and_a_woken_getter_cancelled_passes_it_on() -> None:
    slot: Slot[int] = Slot()
    with pytest.raises(asyncio.QueueEmpty):
        slot.get_nowait()
    got: list[tuple[str, int]] = []

    async def getter(name: str) -> None:
        got.append((name, await slot.get()))

    first, second, third = (asyncio.ensure_future(getter(n)) for n in ("first", "second", "third"))
    await asyncio.sleep(0)
    slot.put_nowait(1)
    with pytest.raises(asyncio.QueueFull):
        slot.put_nowait(2)
    first.cancel()  # Woken by the put, cancelled before it ran: the item goes to the next.
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert got == [("second", 1)] and first.cancelled()
    await second
    slot.put_nowait(3)
    await third
    assert got == [("second", 1), ("third", 3)] and slot.empty()


async def test_an_event_wakes_every_waiter_and_a_cancelled_waiter_leaves() -> None:
    event = Event()
    waiters = [asyncio.ensure_future(event.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    await asyncio.sleep(0)
    event.set()
    assert await asyncio.gather(*waiters[1:]) == [True, True] and waiters[0].cancelled()
    assert event.is_set() and await event.wait()
    event.clear()
    assert not event.is_set()
    assert not await wait_any(event, timeout=0.01)


async def test_in_thread_is_waited_out_when_cancelled() -> None:
    """A cancellation (twice, even) is raised only once the thread's work is done: nothing it
    does happens after its caller moved on."""
    release, done = threading.Event(), threading.Event()

    started = threading.Event()

    def work() -> None:
        started.set()
        release.wait(10)
        done.set()

    task = asyncio.ensure_future(in_thread(work))
    await until(started.is_set, "the work running on its thread")
    task.cancel()
    await asyncio.sleep(0)  # The task takes the first cancellation.
    task.cancel()
    await asyncio.sleep(0.05)  # A hold: cancelled twice, the task waits for the thread.
    assert not task.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done.is_set()
    assert await in_thread(sum, [1, 2]) == 3


def test_backoff_grows_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial=0.1, factor=3.0, maximum=1.0)
    assert [round(backoff.next_delay(), 3) for _ in range(5)] == [0.1, 0.3, 0.9, 1.0, 1.0]
    assert backoff.attempt == 5
    backoff.reset()
    assert backoff.next_delay() == 0.1
    first_free = Backoff(initial=0.05, maximum=2.0, immediate_first=True)
    assert [first_free.next_delay() for _ in range(4)] == [0.0, 0.05, 0.1, 0.2]
