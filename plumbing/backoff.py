"""The one retry backoff of the broker and its clients: a delay that grows by a factor from an
initial value up to a cap, reset after a success. Each retrying loop (fragment persists and
listings, the keyspace watch, pulses, the client's appends and reads, topic watches) keeps one
`Backoff` and asks it how long to wait; the loops differ in what they retry, not in how they
wait."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays between attempts: `initial`, then times `factor` up to `maximum`. With
    `immediate_first`, the first retry after a success waits nothing (most failures are one
    blip, such as a restarted peer). `attempt` counts failures since the last `reset`."""

    initial: float = 0.05
    maximum: float = 2.0
    factor: float = 2.0
    immediate_first: bool = False
    attempt: int = field(default=0, init=False)

    def reset(self) -> None:
        self.attempt = 0

    def next_delay(self) -> float:
        """The wait before the next attempt, counting this failure."""
        self.attempt += 1
        step = self.attempt - 1
        if self.immediate_first:
            if step == 0:
                return 0.0
            step -= 1
        return float(min(self.maximum, self.initial * self.factor**step))

    async def sleep(self) -> float:
        """Wait out the next delay (cancellable); returns it."""
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return delay
