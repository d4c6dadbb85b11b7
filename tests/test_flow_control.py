"""The append rate limiter, on asyncio's real clock (delays are asserted as booleans, not times)."""

from __future__ import annotations

from broker.flow_control import RateLimiter


async def test_unlimited_never_waits() -> None:
    limiter = RateLimiter(0)
    assert not any([await limiter.take(1 << 30) for _ in range(3)])


async def test_burst_passes_then_excess_waits() -> None:
    limiter = RateLimiter(1_000_000)
    assert not await limiter.take(600_000)
    assert not await limiter.take(300_000)
    # More than a full bucket can ever hold (it is capped at one second's worth), so this
    # waits however long the machine stalled between calls.
    assert await limiter.take(1_100_000)


async def test_lowering_the_rate_caps_the_saved_burst() -> None:
    limiter = RateLimiter(10_000_000)
    limiter.set_rate(1_000)
    assert await limiter.take(2_000)
