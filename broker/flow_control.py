"""Append flow control: token buckets enforcing `max_append_rate`, per journal (its spec) and
per broker (`--broker.max-append-rate`). A chunk over the rate is delayed, not refused; the
Append response counts delayed chunks. Bursts of up to one second's worth pass undelayed."""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._tokens = float(rate)
        self._last = time.monotonic()

    def set_rate(self, rate: int) -> None:
        if rate == self.rate:
            return
        if self.rate <= 0:
            # From unlimited: start with a full bucket, as a new limiter does.
            self._tokens, self._last = float(rate), time.monotonic()
        else:
            self._tokens = min(self._tokens, float(rate))
        self.rate = rate

    async def take(self, size: int) -> bool:
        """Spend `size` bytes of budget, sleeping until it accrues. Returns whether it waited.
        A rate of zero is unlimited."""
        if self.rate <= 0:
            return False
        now = time.monotonic()
        self._tokens = min(float(self.rate), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= size
        if self._tokens >= 0:
            return False
        # In debt: wait until the bucket is back at zero. Debt lets a chunk larger than the
        # burst pass, at the price of a proportionally longer wait.
        await asyncio.sleep(-self._tokens / self.rate)
        return True
