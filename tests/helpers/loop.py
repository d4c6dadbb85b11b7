"""A probe of the event loop's stalls, for tests that check blocking work stays off the loop:
a task sleeps a few milliseconds at a time and records how late it wakes."""

from __future__ import annotations

import asyncio
import contextlib
import gc


class StallProbe:
    """`async with StallProbe() as probe:` ... then `probe.worst`: the longest the loop was
    kept from running a ready task, in seconds, while the block ran (a stall still going on as
    the block ends counts too). The objects that exist as it starts are frozen out of garbage
    collection meanwhile: a full collection over a test session's heap takes tens of
    milliseconds, and is not what a test measures."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.worst = 0.0
        self._asleep_since = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StallProbe:
        gc.freeze()
        self._asleep_since = asyncio.get_running_loop().time()
        self._task = asyncio.ensure_future(self._probe())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._note(asyncio.get_running_loop().time())
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        gc.unfreeze()

    def _note(self, now: float) -> None:
        self.worst = max(self.worst, now - self._asleep_since - self.interval)

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._asleep_since = loop.time()
            await asyncio.sleep(self.interval)  # The probe's period: lateness past it is lag.
            self._note(loop.time())
