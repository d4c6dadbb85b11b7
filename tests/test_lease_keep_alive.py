"""The membership component's contract (`plumbing.membership`), which brokers, consumers and
locations share: it announces; it keeps the lease; it stops on cancel, whatever etcd does; it
tells its owner when the lease is lost, as its policy says.

A keep-alive must stop when cancelled even when a refresh's reply lands in the same loop turn as
the cancellation: Python 3.11's `asyncio.wait_for` returns the reply then, and a keep-alive loop
built on it went on through its owner's stop (the consumer's and the location's copies did,
after the broker's was fixed: the defect that made them one component)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

import aetcd
import pytest
from aetcd import exceptions as etcd_errors

from broker.server import Broker
from consumer.runtime import Consumer
from plumbing.membership import (
    AnnounceError,
    LeaseLost,
    LeasePolicy,
    Membership,
    ProcessTasks,
    describe_refresh_failure,
)
from replication.process import LocationProcess
from tests.helpers.waiting import until

POLICIES = list(LeasePolicy)


class FakeLeases:
    """An etcd's lease calls, scripted by the test: `refresh` answers with `ttl` (0: the lease
    is gone), raises `error`, hangs while `hang` is set, or waits for `reply` when `race` is
    set (the test then cancels the keep-alive in the same loop turn as the reply)."""

    def __init__(self, ttl: int = 1) -> None:
        self.ttl = ttl
        self.error: BaseException | None = None
        self.hang = False
        self.race = False
        self.asked = asyncio.Event()
        self.reply = asyncio.Event()
        self.refreshes = 0
        self.granted = 0

    async def lease(self, ttl: int) -> Any:
        self.granted += 1
        return SimpleNamespace(id=100 + self.granted, ttl=ttl)

    async def refresh_lease(self, lease_id: int) -> Any:
        self.refreshes += 1
        self.asked.set()
        if self.race:
            await self.reply.wait()
        while self.hang:
            await asyncio.sleep(3600)  # A refresh etcd never answers (the fake's hang).
        if self.error is not None:
            raise self.error
        return SimpleNamespace(TTL=self.ttl)


def member(fake: FakeLeases, policy: LeasePolicy, **kwargs: Any) -> Membership:
    m = Membership(fake, "/test/members/z#a", 1.0, policy, **kwargs)  # type: ignore[arg-type]
    m.lease_id, m.granted_ttl = 7, 1
    m.valid_until = asyncio.get_running_loop().time() + 1
    return m


async def cancel_as_the_reply_lands(
    keep_alive: Coroutine[Any, Any, None], fake: FakeLeases
) -> None:
    fake.race = True
    task = asyncio.create_task(keep_alive)
    async with asyncio.timeout(10):
        await fake.asked.wait()
    fake.reply.set()  # The refresh ends at the loop's next turn ...
    task.cancel()  # ... the very turn the keep-alive learns of its cancellation.
    done, _ = await asyncio.wait([task], timeout=5)
    if not done:  # Still looping: stop it for good so the test itself ends.
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        pytest.fail(f"the keep-alive went on after its cancellation ({fake.refreshes} refreshes)")
    assert task.cancelled()


# ---- it stops on cancel, whatever etcd does ---------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
async def test_a_keep_alive_stops_when_cancelled_as_a_refresh_returns(policy: LeasePolicy) -> None:
    fake = FakeLeases()
    await cancel_as_the_reply_lands(member(fake, policy).keep_alive(), fake)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
@pytest.mark.parametrize("etcd_does", ["hangs", "refuses", "answers"])
async def test_a_keep_alive_stops_when_cancelled_whatever_etcd_does(
    policy: LeasePolicy, etcd_does: str
) -> None:
    fake = FakeLeases(ttl=3600)
    fake.hang = etcd_does == "hangs"
    if etcd_does == "refuses":
        fake.error = etcd_errors.ConnectionFailedError("connection refused (test)")
    m = member(fake, policy)
    m.valid_until += 3600  # Silence never lapses here: only the cancellation ends it.
    task = asyncio.create_task(m.keep_alive())
    await until(lambda: fake.refreshes >= 2, timeout=10)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert done and task.cancelled(), f"the keep-alive went on ({fake.refreshes} refreshes)"


async def test_the_processes_keep_alives_are_the_component() -> None:
    """Brokers, consumers and locations hold no keep-alive of their own (copies drifted: the
    defect this suite is for was fixed in one and not the others)."""
    for process in (Broker, Consumer, LocationProcess):
        own = [name for name in vars(process) if "lease" in name and callable(vars(process)[name])]
        assert own == [], f"{process.__name__} keeps its own lease code: {own}"


# ---- it tells its owner when the lease is lost ------------------------------------------------


@pytest.mark.parametrize("policy", [LeasePolicy.FENCE, LeasePolicy.EXIT], ids=lambda p: p.value)
async def test_a_lease_etcd_says_is_gone_raises_lease_lost(policy: LeasePolicy) -> None:
    fake = FakeLeases(ttl=0)
    async with asyncio.timeout(10):
        with pytest.raises(LeaseLost, match="expired or was revoked"):
            await member(fake, policy).keep_alive()


async def test_under_exit_a_ttl_without_an_answer_loses_the_lease() -> None:
    fake = FakeLeases()
    fake.error = etcd_errors.ConnectionFailedError("connection refused (test)")
    async with asyncio.timeout(10):
        with pytest.raises(
            LeaseLost, match="no etcd lease refresh answered for 1s: connection refused"
        ):
            await member(fake, LeasePolicy.EXIT).keep_alive()


async def test_under_exit_a_process_paused_past_its_ttl_asks_etcd_before_giving_up() -> None:
    """Paused (SIGSTOP, a long GC) past the TTL since its last answered refresh, the process
    may still hold its lease: etcd counts the TTL from when it got the refresh, and may not
    have expired it. Resumed, a consumer asks etcd first, and goes on when etcd answers that
    the lease is alive (`gazctl dev kill --signal STOP` then `CONT` once stopped consumers)."""
    fake = FakeLeases(ttl=1)
    m = member(fake, LeasePolicy.EXIT)
    m.valid_until = asyncio.get_running_loop().time() - 0.5  # The pause outlasted the TTL.
    task = asyncio.create_task(m.keep_alive())
    try:
        await until(lambda: fake.refreshes >= 2 or task.done(), timeout=10)
        assert not task.done(), task.exception()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_under_fence_silence_fences_and_an_answer_unfences() -> None:
    fake = FakeLeases()
    fake.error = etcd_errors.ConnectionFailedError("connection refused (test)")
    told: list[bool] = []
    m = member(fake, LeasePolicy.FENCE, on_fence=told.append)
    task = asyncio.create_task(m.keep_alive())
    try:
        await until(lambda: told == [True], timeout=10)
        assert m.fenced
        loop = asyncio.get_running_loop()
        # Fenced before etcd could have expired the lease (by its margin).
        assert loop.time() <= m.valid_until + 0.5
        refreshes = fake.refreshes
        await until(lambda: fake.refreshes > refreshes + 2, timeout=10)
        assert not task.done() and told == [True], "fenced, it keeps asking and stays up"
        fake.error = None
        await until(lambda: told == [True, False], timeout=10)
        assert not m.fenced
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_under_renew_a_lost_lease_is_replaced_unless_another_took_the_key(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/endpoints/A"
    m = Membership(etcd, key, 1.0, LeasePolicy.RENEW, take_over=True)
    deadline = m.start_deadline()
    await m.grant(deadline)
    await m.announce(b"mine", deadline)
    task = asyncio.create_task(m.keep_alive())
    try:
        # Its lease goes (the process was paused past it) and another process takes the key.
        first = m.lease_id
        await etcd.revoke_lease(first)
        other = await etcd.lease(30)
        await etcd.put(key.encode(), b"theirs", lease=other)
        await until(lambda: m.lease_id != first, timeout=10)
        got = await etcd.get(key.encode())
        assert got is not None and got.value == b"theirs", "it overwrote the other's key"
        # The other goes: the key is put again under a new lease.
        await etcd.revoke_lease(other.id)

        async def mine_again() -> bool:
            got = await etcd.get(key.encode())
            return got is not None and got.value == b"mine" and got.lease == m.lease_id

        await until(mine_again, timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await m.revoke(2.0)
    assert await etcd.get(key.encode()) is None


# ---- it announces, and keeps the lease --------------------------------------------------------


async def test_it_announces_and_keeps_the_key_past_its_ttl_then_gives_it_up(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/members/z#a"
    m = Membership(etcd, key, 1.0, LeasePolicy.EXIT)
    deadline = m.start_deadline()
    await m.grant(deadline)
    task = asyncio.create_task(m.keep_alive())
    applied: list[int] = []

    async def apply(revision: int) -> None:
        applied.append(revision)

    try:
        await m.announce(b"spec", deadline, applied=apply)
        got = await etcd.get(key.encode())
        assert got is not None and got.value == b"spec" and got.lease == m.lease_id
        assert applied == [got.mod_revision]
        # Three TTLs later the key is still there: the lease was kept.
        loop = asyncio.get_running_loop()
        until_then = loop.time() + 3.0
        await until(lambda: loop.time() > until_then, timeout=10)
        assert not task.done()
        assert await etcd.get(key.encode()) is not None
        await m.mark_exiting(b"spec, exiting", 2.0)
        got = await etcd.get(key.encode())
        assert got is not None and got.value == b"spec, exiting" and got.lease == m.lease_id
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await m.revoke(2.0)
    assert await etcd.get(key.encode()) is None
    assert m.lease_id == 0


async def test_a_key_held_by_another_live_process_is_waited_for_then_refused(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/members/z#a"
    holder = await etcd.lease(30)
    await etcd.put(key.encode(), b"theirs", lease=holder)
    m = Membership(etcd, key, 1.0, LeasePolicy.FENCE, conflict="give it another --x.id")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 1.5
    await m.grant(deadline)
    with pytest.raises(
        AnnounceError, match=r"held by another live process: give it another --x\.id"
    ):
        await m.announce(b"mine", deadline)
    got = await etcd.get(key.encode())
    assert got is not None and got.value == b"theirs"
    await m.revoke(2.0)
    # Its holder gone, the key is announced.
    await etcd.revoke_lease(holder.id)
    await m.grant(m.start_deadline())
    await m.announce(b"mine", m.start_deadline())
    got = await etcd.get(key.encode())
    assert got is not None and got.value == b"mine"
    await m.revoke(2.0)


async def test_an_announce_whose_reply_was_lost_finds_the_key_under_its_own_lease(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/members/z#a"
    m = Membership(etcd, key, 5.0, LeasePolicy.EXIT)
    await m.grant(m.start_deadline())
    # The put landed, its reply did not: the key is there, under our own lease.
    await etcd.put(key.encode(), b"spec", lease=m.lease_id)
    async with asyncio.timeout(5):
        await m.announce(b"spec", m.start_deadline())
    await m.revoke(2.0)


async def test_take_over_replaces_another_processs_key(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/endpoints/A"
    other = await etcd.lease(30)
    await etcd.put(key.encode(), b"theirs", lease=other)
    m = Membership(etcd, key, 5.0, LeasePolicy.RENEW, take_over=True)
    await m.grant(m.start_deadline())
    await m.announce(b"mine", m.start_deadline())
    got = await etcd.get(key.encode())
    assert got is not None and got.value == b"mine" and got.lease == m.lease_id
    await m.revoke(2.0)
    await etcd.revoke_lease(other.id)


# ---- the process's task-failure policy --------------------------------------------------------


async def test_the_first_failure_of_a_process_task_stops_it_named_by_its_owner() -> None:
    class Missing(Exception):
        pass

    tasks = ProcessTasks(
        "proc", translate=lambda e: LeaseLost("gone") if isinstance(e, Missing) else e
    )

    async def fails(exc: BaseException) -> None:
        raise exc

    async def returns() -> None:
        return None

    fine = tasks.spawn(returns(), "fine")
    await asyncio.wait([fine])
    assert not tasks.done.is_set(), "a task that returned is no failure"
    tasks.spawn(fails(Missing()), "allocator")
    async with asyncio.timeout(5):
        await tasks.done.wait()
    assert isinstance(tasks.failure, LeaseLost)
    later = tasks.spawn(fails(ValueError("later")), "other")
    await asyncio.wait([later])
    assert isinstance(tasks.failure, LeaseLost), "the first failure is kept"
    await tasks.close()


def test_a_refresh_failure_is_described_even_when_its_text_is_empty() -> None:
    assert describe_refresh_failure(TimeoutError(), 2.0) == "TimeoutError after 2.0s"
    assert describe_refresh_failure(ConnectionError(), 2.0) == "ConnectionError"
    assert describe_refresh_failure(None, 2.0) == "no answer"
