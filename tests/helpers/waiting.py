"""The one wait of the tests: `until` a condition holds, polled, within a bound. A test that
runs no event loop (it drives processes with blocking calls) has `until_blocking`, the same wait
for a caller that may not await."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], object | Awaitable[object]],
    what: str = "",
    timeout: float = 30.0,
    interval: float = 0.02,
) -> None:
    """Until `condition()` is true (it may be a coroutine function), polled every `interval`
    seconds: the state it reads lives in another component, task or process. Past `timeout`
    seconds the test fails, naming `what` it waited for (or the condition); the bound holds
    over a condition's own await too (one that hangs fails the test as late as one that stays
    false)."""
    bound = asyncio.timeout(timeout)
    try:
        async with bound:
            while True:
                held = condition()
                if inspect.isawaitable(held):
                    held = await held
                if held:
                    return
                await asyncio.sleep(interval)
    except TimeoutError:
        if not bound.expired():
            raise  # The condition's own, not the wait's.
        raise AssertionError(_late(condition, what, timeout)) from None


def until_blocking(
    condition: Callable[[], object],
    what: str = "",
    timeout: float = 30.0,
    interval: float = 0.1,
) -> None:
    """`until` for a caller with no event loop: `condition()` (a plain function) polled every
    `interval` seconds, sleeping the thread between; past `timeout` the test fails."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(_late(condition, what, timeout))
        time.sleep(interval)


def _late(condition: Callable[[], object], what: str, timeout: float) -> str:
    name = what or getattr(condition, "__qualname__", repr(condition))
    return f"not {name} after {timeout:g}s"
