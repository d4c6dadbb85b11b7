"""The one wait of the tests: `until` a condition holds, polled, within a bound."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], object | Awaitable[object]],
    what: str = "",
    timeout: float = 30.0,
    interval: float = 0.02,
) -> None:
    """Until `condition()` is true (it may be a coroutine function), polled every `interval`
    seconds: the state it reads lives in another component, task or process. Past `timeout`
    seconds the test fails, naming `what` it waited for (or the condition)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if loop.time() >= deadline:
            name = what or getattr(condition, "__qualname__", repr(condition))
            raise AssertionError(f"not {name} after {timeout:g}s")
        await asyncio.sleep(interval)
