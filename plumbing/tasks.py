"""Ownership of background tasks, the one wait for "the first of these" (`first_of`), and
blocking work (disk I/O) run on worker threads that are waited out, never abandoned.

Every background task of a process (keyspace watch, lease, allocator, pulses, fragment refresh,
persists, pipeline teardowns and readers in turn) is started through the `TaskOwner` of the
object that needs it, and that object's shutdown cancels (or joins) and awaits them: no task
outlives its owner, and none is started in a constructor. `asyncio.TaskGroup` fits a task whose
lifetime is one block of code; these belong to objects with a start and a stop, hence this
small owner type.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Literal, TypeVar, cast

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskOwner:
    """The background tasks of one object. `spawn` starts one; `join` waits for them to end
    on their own, `close` cancels what is left and waits for that. A task that fails is
    logged (with its name) when it ends; `on_failure` may also react to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        """Whether `close` was called: `spawn` refuses from then on."""
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T], name: str = "") -> asyncio.Task[T]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name} is closed: cannot start {name or coro!r}")
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(f"{self.name}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("%s failed: %r", task.get_name(), exc)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for every task (and any they start meanwhile) to end by itself, for up to
        `timeout` seconds; returns whether they all did."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=remaining)
        return True

    async def close(self, grace: float = 0.0) -> None:
        """Stop: no new task; wait `grace` seconds for those running, then cancel the rest and
        wait until each has ended. Safe to call twice. A task still running a second after its
        cancellation is cancelled again: one that swallowed it (Python 3.11's `wait_for` can,
        when the cancellation meets its inner call's end) would otherwise be waited for
        forever."""
        self._closed = True
        if grace > 0:
            await self.join(grace)
        while self._tasks:
            tasks = set(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=RECANCEL_AFTER)


# Seconds `TaskOwner.close` waits for cancelled tasks to end before it cancels them again.
RECANCEL_AFTER = 1.0


async def first_of(
    *awaitables: Awaitable[Any], timeout: float | None = None
) -> list[asyncio.Future[Any]]:
    """Wait until the first of `awaitables` is done, or `timeout` seconds pass, and return them
    as futures in the order given, for the caller to look into (`done()`, `result()`).

    A coroutine given becomes a task owned by this call: if it is not done when the call ends,
    however it ends (cancellation included), it is cancelled and awaited first. A future or task
    given is waited on and never cancelled: it is its owner's. With nothing to wait on, it
    sleeps out `timeout`."""
    futures: list[asyncio.Future[Any]] = []
    owned: list[asyncio.Future[Any]] = []
    try:
        for awaitable in awaitables:
            if asyncio.isfuture(awaitable):
                futures.append(awaitable)
            else:
                future = asyncio.ensure_future(awaitable)
                futures.append(future)
                owned.append(future)
        if not futures:
            if timeout is None:
                raise ValueError("first_of: nothing to wait on, and no timeout")
            await asyncio.sleep(timeout)
        elif not any(future.done() for future in futures):
            await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [mine for mine in owned if not mine.done()]
        for mine in pending:
            mine.cancel()
        if pending:
            await asyncio.wait(pending)
        for mine in owned:  # Their outcome is the caller's to read: never "unretrieved".
            if not mine.cancelled():
                mine.exception()
    return futures


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> bool:
    """Until any of `events` is set, or `timeout` seconds pass: returns whether one is set.

    On our `Event`s (every one the broker waits on) this is one future listed with each event
    and one timer: no task per event. Every idle replica waits so (its refresh daemon, its
    pulse loop) and every tailing reader at each wake-up, so the tasks were most of what an
    idle wait cost. Other events are waited on with a task each (`first_of`)."""
    if any(event.is_set() for event in events):
        return True
    if not all(type(event) is Event for event in events):
        await first_of(*(event.wait() for event in events), timeout=timeout)
        return any(event.is_set() for event in events)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[bool] = loop.create_future()
    ours = cast("tuple[Event, ...]", events)
    for event in ours:
        event._listen(future)
    timer = None if timeout is None else loop.call_later(timeout, _settle, future)
    try:
        await future
    finally:
        if timer is not None:
            timer.cancel()
        for event in ours:
            event._unlisten(future)
    return any(event.is_set() for event in events)


def _settle(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


class Event(asyncio.Event):
    """An `asyncio.Event` whose waiters are listed only while there are some. An
    `asyncio.Event` allocates a deque of waiters when it is made (about 760 bytes), and an idle
    journal replica holds eight events that are rarely waited on (issue 26: most of what a
    replica cost in Python objects was such deques). Same behaviour: `set` wakes every waiter,
    a waiter cancelled leaves the list."""

    def __init__(self) -> None:
        # No call to asyncio.Event.__init__: every method that reads its state is ours.
        self._value = False
        self._waiting: list[asyncio.Future[bool]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if not self._value:
            self._value = True
            for future in self._waiting or ():
                if not future.done():
                    future.set_result(True)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> Literal[True]:
        if self._value:
            return True
        future = asyncio.get_running_loop().create_future()
        self._listen(future)
        try:
            await future
            return True
        finally:
            self._unlisten(future)

    def _listen(self, future: asyncio.Future[bool]) -> None:
        """`set` will set `future`'s result (if it is not done by then)."""
        if self._waiting is None:
            self._waiting = []
        self._waiting.append(future)

    def _unlisten(self, future: asyncio.Future[bool]) -> None:
        if self._waiting is not None:
            self._waiting.remove(future)
            if not self._waiting:
                self._waiting = None

    def __repr__(self) -> str:
        state = "set" if self._value else "unset"
        return f"<{type(self).__name__} [{state}, waiters:{len(self._waiting or ())}]>"


class Slot(Generic[T]):
    """A one-item `asyncio.Queue` (`get`, `get_nowait`, `put_nowait`, `qsize`, `empty`) that
    lists waiting getters only while there are some: what a replica's spool and pipeline are
    taken from and put back to (an `asyncio.Queue` allocates four deques, about 3 KiB, when it
    is made). Getters are served in the order they came; a getter cancelled takes nothing."""

    __slots__ = ("_getters", "_has", "_item")

    def __init__(self) -> None:
        self._has = False
        self._item: T | None = None
        self._getters: list[asyncio.Future[None]] | None = None

    def qsize(self) -> int:
        return 1 if self._has else 0

    def empty(self) -> bool:
        return not self._has

    def put_nowait(self, item: T) -> None:
        if self._has:
            raise asyncio.QueueFull
        self._has, self._item = True, item
        for getter in self._getters or ():
            if not getter.done():
                getter.set_result(None)
                break

    def get_nowait(self) -> T:
        if not self._has:
            raise asyncio.QueueEmpty
        item = self._item
        self._has, self._item = False, None
        return item  # type: ignore[return-value]  # (T may include None)

    async def get(self) -> T:
        while not self._has:
            getter = asyncio.get_running_loop().create_future()
            if self._getters is None:
                self._getters = []
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()
                if self._has and not getter.cancelled():
                    # Woken, then cancelled: wake the next getter in our place.
                    self._wake_next(getter)
                raise
            finally:
                if self._getters is not None:
                    with contextlib.suppress(ValueError):
                        self._getters.remove(getter)
                    if not self._getters:
                        self._getters = None
        return self.get_nowait()

    def _wake_next(self, skip: asyncio.Future[None]) -> None:
        for getter in self._getters or ():
            if getter is not skip and not getter.done():
                getter.set_result(None)
                return


async def take_unless(
    queue: asyncio.Queue[T] | Slot[T], event: asyncio.Event
) -> tuple[bool, T | None]:
    """Take an item from `queue` unless `event` is set first: (True, item) or (False, None).
    Whatever interrupts the wait, cancellation included, an item taken is never lost: it goes
    back to the queue (queues here hold what one owner at a time may use: a spool, a
    pipeline)."""
    if event.is_set():
        return False, None
    get = asyncio.ensure_future(queue.get())
    wait = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({get, wait}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        if get.done() and not get.cancelled() and get.exception() is None:
            queue.put_nowait(get.result())
        raise
    finally:
        # No await here: a cancellation arriving at it would lose an item just taken.
        wait.cancel()
        if not get.done():
            get.cancel()  # asyncio.Queue leaves the item queued for the next getter.
    if get.done() and not get.cancelled() and get.exception() is None:
        return True, get.result()
    return False, None


def start_in_thread(fn: Callable[..., T], /, *args: Any) -> asyncio.Future[T]:
    """Start `fn(*args)` on a worker thread of the loop's default executor; await what this
    returns with `wait_out` (a thread cannot be cancelled: it must be waited for)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return asyncio.get_running_loop().run_in_executor(None, call)


async def wait_out(future: asyncio.Future[T]) -> T:
    """The result of `future`, a thread's work: a cancellation that arrives meanwhile is
    raised only once the thread is done, so nothing it does (writing into a directory, removing
    one) happens after its caller moved on."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.wait({future})  # Unlike an await of it, this never cancels it.
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not future.cancelled():
            future.exception()  # Retrieved: the cancellation is what the caller gets.
        raise cancelled
    return future.result()


async def in_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """`fn(*args)` on a worker thread, off the event loop (disk I/O: writes, fsyncs, `rmtree`),
    waited out as `wait_out` does."""
    return await wait_out(start_in_thread(fn, *args))
