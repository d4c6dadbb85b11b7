"""An adversarial review of the membership component (`plumbing.membership`) and its users:
cancellation at each await point, what etcd may do (refuse, hang, answer TTL 0, raise what the
client does not expect), each policy's promise (FENCE, EXIT, RENEW), announce's take-over and
wait, `ProcessTasks` and `drained`.

Tests that fail name a defect in their docstring ("Defect:"); the others pin what held."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import aetcd
import pytest
from aetcd import exceptions as etcd_errors

from allocator import drained
from allocator.keyspace import Member
from broker.protocol import protocol_pb2 as pb
from broker.server import Broker, BrokerConfig
from broker.testing import BrokerHarness, EtcdServer
from plumbing import etcd as etcdx
from plumbing import membership as membership_module
from plumbing.membership import (
    AnnounceError,
    LeaseLost,
    LeasePolicy,
    Membership,
    ProcessTasks,
)
from tests.helpers.waiting import until

KEY = "/review/members/z#a"


async def forever() -> Any:
    await asyncio.get_running_loop().create_future()


class ScriptedEtcd:
    """An etcd client's lease and key calls, scripted: each call hangs while `hang` is set,
    raises `error` if set, else answers (`refresh_lease` with `ttl`, after `delay` seconds).
    Calls are counted and the time of each refresh recorded."""

    def __init__(self, ttl: int = 1) -> None:
        self.ttl = ttl
        self.error: BaseException | None = None
        self.hang = False
        self.delay = 0.0
        self.calls: dict[str, int] = {}
        self.called = asyncio.Event()
        self.refreshed_at: list[float] = []
        self.granted = 0

    async def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.called.set()
        if self.hang:
            await forever()
        if self.error is not None:
            raise self.error

    async def lease(self, ttl: int) -> Any:
        await self._call("lease")
        self.granted += 1
        return SimpleNamespace(id=100 + self.granted, ttl=ttl)

    async def refresh_lease(self, lease_id: int) -> Any:
        self.refreshed_at.append(asyncio.get_running_loop().time())
        await self._call("refresh_lease")
        if self.delay:
            await asyncio.sleep(self.delay)  # A slow etcd: the latency under test.
        return SimpleNamespace(TTL=self.ttl)

    async def get(self, key: bytes) -> Any:
        await self._call("get")
        return SimpleNamespace(lease=999, mod_revision=1)  # Held by another process's lease.

    async def put(self, key: bytes, value: bytes, lease: Any = None) -> Any:
        await self._call("put")

    async def revoke_lease(self, lease_id: int) -> Any:
        await self._call("revoke_lease")


def member(fake: Any, policy: LeasePolicy, ttl: float = 1.0, **kwargs: Any) -> Membership:
    m = Membership(fake, KEY, ttl, policy, **kwargs)
    m.lease_id, m.granted_ttl = 7, max(1, round(ttl))
    m.valid_until = asyncio.get_running_loop().time() + m.granted_ttl
    return m


async def ends_cancelled(task: asyncio.Task[Any], within: float = 2.0) -> bool:
    """Cancel `task`; whether it ended cancelled within `within` seconds (it is stopped for
    good either way, so that the test itself ends)."""
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=within)
    if not done:
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        return False
    return task.cancelled()


# ---- cancellation at each await point ---------------------------------------------------------


@pytest.mark.parametrize("etcd_does", ["refuses", "hangs"])
async def test_grant_is_cancellable_in_its_backoff_and_in_a_hung_call(etcd_does: str) -> None:
    fake = ScriptedEtcd()
    fake.hang = etcd_does == "hangs"
    fake.error = etcd_errors.ConnectionFailedError("refused (test)") if not fake.hang else None
    m = Membership(fake, KEY, 1.0, LeasePolicy.FENCE)  # type: ignore[arg-type]
    task = asyncio.create_task(m.grant(asyncio.get_running_loop().time() + 60))
    await until(lambda: fake.calls.get("lease", 0) >= (2 if etcd_does == "refuses" else 1), timeout=10)  # fmt: skip
    assert await ends_cancelled(task)
    assert m.lease_id == 0


async def test_announce_is_cancellable_while_it_waits_out_another_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = ScriptedEtcd()

    async def held(*_args: Any) -> etcdx.TxnResult:
        return etcdx.TxnResult(False, 1, 0, 0, 0)

    monkeypatch.setattr(membership_module.etcdx, "txn", held)
    m = member(fake, LeasePolicy.EXIT)
    task = asyncio.create_task(m.announce(b"x", asyncio.get_running_loop().time() + 60))
    await until(lambda: fake.calls.get("get", 0) >= 2, timeout=10)  # In its 1 s sleep loop.
    assert await ends_cancelled(task)


@pytest.mark.parametrize("step", ["mark_exiting", "revoke"])
async def test_mark_exiting_and_revoke_are_cancellable_and_bounded(step: str) -> None:
    fake = ScriptedEtcd()
    fake.hang = True
    m = member(fake, LeasePolicy.FENCE)
    m.announced = True  # (mark_exiting puts only a key announced under our lease.)
    call: Callable[[], Awaitable[None]] = (
        (lambda: m.mark_exiting(b"x", 30.0)) if step == "mark_exiting" else (lambda: m.revoke(30.0))
    )
    task = asyncio.create_task(call())
    await fake.called.wait()
    assert await ends_cancelled(task)
    # And bounded: against a silent etcd each returns after its bound, logging, not raising.
    m.lease_id = 7
    loop = asyncio.get_running_loop()
    started = loop.time()
    if step == "mark_exiting":
        await m.mark_exiting(b"x", 0.2)
    else:
        await m.revoke(0.2)
    assert loop.time() - started < 1.0


async def test_announce_against_a_silent_etcd_is_cancellable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A defect, now fixed: an announce whose transaction etcd never answers could not be
    cancelled. The transaction goes through `etcdx.uncancelled`, which lets the Txn RPC finish "bounded by its
    own timeout" before the cancellation goes on, but brokers and consumers connect with no
    client timeout (`etcdx.connect(..., timeout=None)`): against an etcd that accepts the
    connection and says nothing (SIGSTOPped, a black-holed network), a cancelled
    `Broker.start`/`Consumer.start` (an embedding program, a test harness) waits for ever.
    Location processes connect with timeout=10, so theirs (and their keep-alive's renewal)
    waits up to 10 s. Fix: bound the announce's transaction (and `_announce_again`'s) with the
    start deadline or an attempt bound, e.g. give `uncancelled` a bound of its own, or connect
    brokers and consumers with a client timeout. `uncancelled` now has a bound of its own."""
    monkeypatch.setattr(etcdx, "UNCANCELLED_BOUND", 1.0)
    client = aetcd.Client(host="127.0.0.1", port=9, timeout=None)
    client._connected.set()  # As connected: the call below is the Txn RPC itself.
    sent = asyncio.Event()

    def txn_rpc(request: Any, timeout: Any = None, metadata: Any = None) -> Any:
        sent.set()
        return forever()  # etcd took the request and never answers.

    client.kvstub = SimpleNamespace(Txn=txn_rpc)
    m = Membership(client, KEY, 1.0, LeasePolicy.FENCE)
    m.lease_id = 7
    task = asyncio.create_task(m.announce(b"x", asyncio.get_running_loop().time() + 5))
    await sent.wait()
    # Bounded by etcdx.UNCANCELLED_BOUND, the time a sent transaction is let finish.
    assert await ends_cancelled(task, within=3.0), "announce swallowed its cancellation"


async def test_a_grant_against_a_silent_etcd_gives_up_at_its_deadline() -> None:
    """A defect, now fixed (the old consumer's `_starting` had it too): `grant` and `announce` were
    "tried again while etcd is unreachable until `deadline`", but a call etcd never answers is
    not bounded by the deadline at all: with no client timeout (brokers, consumers) a process
    started against a silent etcd waits for ever rather than failing at 2 TTLs + 2 s. Fix:
    bound each attempt in `while_etcd_starts` by the time left to the deadline
    (`asyncio.timeout_at(deadline)`), as keep_alive bounds each refresh."""
    fake = ScriptedEtcd()
    fake.hang = True
    m = Membership(fake, KEY, 1.0, LeasePolicy.EXIT)  # type: ignore[arg-type]
    deadline = asyncio.get_running_loop().time() + 0.5
    task = asyncio.create_task(m.grant(deadline))
    done, _ = await asyncio.wait([task], timeout=3.0)
    if not done:
        await ends_cancelled(task)
    assert done, "grant waited past its deadline for an etcd that never answers"


# ---- FENCE: no append acknowledged past the lapse -------------------------------------------


async def test_under_fence_an_etcd_silent_from_the_first_refresh_fences_before_the_lapse() -> None:
    """Lease granted, then etcd silent from the very first refresh: fenced before
    `valid_until` (where etcd could first expire the lease)."""
    fake = ScriptedEtcd()
    loop = asyncio.get_running_loop()
    told: list[tuple[bool, float]] = []
    m = Membership(fake, KEY, 2.0, LeasePolicy.FENCE, on_fence=lambda f: told.append((f, loop.time())))  # type: ignore[arg-type]  # fmt: skip
    await m.grant(loop.time() + 5)
    fake.hang = True
    task = asyncio.create_task(m.keep_alive())
    try:
        await until(lambda: told, timeout=10)
        fenced, at = told[0]
        assert fenced and at <= m.valid_until, (at, m.valid_until)
        assert fake.calls.get("refresh_lease", 0) >= 1
    finally:
        assert await ends_cancelled(task)


async def test_under_fence_a_slow_reply_counts_the_ttl_from_when_it_was_sent() -> None:
    fake = ScriptedEtcd(ttl=3)
    fake.delay = 0.4  # Each reply lands 0.4 s after the refresh was sent.
    m = member(fake, LeasePolicy.FENCE, ttl=3.0)
    before = m.valid_until
    task = asyncio.create_task(m.keep_alive())
    try:
        await until(lambda: m.valid_until != before, timeout=10)
        # From the refresh's send, not its (0.4 s later) reply.
        assert m.valid_until <= fake.refreshed_at[-1] + 3 + 1e-6
    finally:
        assert await ends_cancelled(task)


async def test_under_fence_a_lease_etcd_says_is_gone_is_fenced_before_lease_lost() -> None:
    """Defect (low; the old broker did the same): when etcd answers that the lease is gone
    (TTL <= 0: revoked, or expired while we were paused), keep_alive raises LeaseLost without
    fencing. The broker then stops with its replicas unfenced: `stop` skips the drain, but
    `server.stop(grace)` lets open Append streams finish for `grace` (5 s) and the service's
    replicas are stopped only after that, so appends can still be acknowledged after etcd
    said the lease is gone (other brokers may already serve our journals; of replication 1,
    nothing serializes us with the new primary). The docstring's promise ("no append is
    acknowledged here after etcd could have expired the lease") holds only for silence. Fix:
    under FENCE, set `fenced` and call `on_fence(True)` before raising LeaseLost."""
    fake = ScriptedEtcd(ttl=0)
    told: list[bool] = []
    m = member(fake, LeasePolicy.FENCE, on_fence=told.append)
    with pytest.raises(LeaseLost):
        async with asyncio.timeout(10):
            await m.keep_alive()
    assert m.fenced and told == [True], "LeaseLost left the broker's replicas unfenced"


# ---- EXIT: a paused consumer ----------------------------------------------------------------


async def test_under_exit_a_paused_process_whose_lease_etcd_expired_learns_it_at_once() -> None:
    fake = ScriptedEtcd(ttl=0)  # etcd expired the lease during the pause.
    m = member(fake, LeasePolicy.EXIT)
    m.valid_until = asyncio.get_running_loop().time() - 5
    with pytest.raises(LeaseLost, match="expired or was revoked"):
        async with asyncio.timeout(5):
            await m.keep_alive()
    assert fake.calls["refresh_lease"] == 1


async def test_under_exit_a_paused_process_that_cannot_reach_etcd_gives_up_on_the_first_failure() -> None:  # fmt: skip
    fake = ScriptedEtcd()
    fake.error = etcd_errors.ConnectionFailedError("refused (test)")
    m = member(fake, LeasePolicy.EXIT)
    m.valid_until = asyncio.get_running_loop().time() - 5
    with pytest.raises(LeaseLost, match="no etcd lease refresh answered"):
        async with asyncio.timeout(5):
            await m.keep_alive()
    assert fake.calls["refresh_lease"] == 1


@pytest.mark.parametrize("policy", [LeasePolicy.EXIT, LeasePolicy.FENCE])
async def test_internal_errors_are_retried_like_refusals(policy: LeasePolicy) -> None:
    fake = ScriptedEtcd(ttl=3600)
    fake.error = etcd_errors.InternalError("etcdserver: internal (test)")
    m = member(fake, policy)
    m.valid_until += 3600
    task = asyncio.create_task(m.keep_alive())
    await until(lambda: fake.calls.get("refresh_lease", 0) >= 3 or task.done(), timeout=10)
    assert not task.done(), task.exception()
    assert await ends_cancelled(task)


async def test_under_renew_an_unexpected_error_from_etcd_is_retried_not_fatal() -> None:
    """Defect (behaviour change of the location's keep-alive): the old `_keep_lease` caught
    every Exception of a refresh or re-registration and logged it (the endpoint is for
    discovery only); the component catches only TimeoutError, ClientError, AioRpcError and
    OSError, so anything else the client raises (a grpc UsageError on a channel closed under
    it, a RuntimeError, an AttributeError of aetcd's) ends keep_alive. In a LocationProcess
    it runs in the TaskGroup: the whole location process stops with an ExceptionGroup (not a
    WriterFailed), and `membership.revoke` after the TaskGroup is skipped (its endpoint stays
    registered, pointing at a dead process, until the lease lapses). Consumers changed too
    (their keep-alive caught Exception and retried until the TTL; now the first such error
    stops the consumer): safe, but an availability change the commit does not mention. Fix:
    under RENEW catch Exception in the refresh and in `_renew_logged` (as before); decide
    EXIT's deliberately."""
    fake = ScriptedEtcd(ttl=3600)
    fake.error = RuntimeError("unexpected (test)")
    m = member(fake, LeasePolicy.RENEW)
    task = asyncio.create_task(m.keep_alive())
    await until(lambda: fake.calls.get("refresh_lease", 0) >= 3 or task.done(), timeout=10)
    alive = not task.done()
    if alive:
        assert await ends_cancelled(task)
    else:
        task.exception()
    assert alive, "an unexpected refresh error ended the location's keep-alive"


# ---- RENEW against a real etcd --------------------------------------------------------------


async def _lost_lease(etcd: aetcd.Client, key: str, ttl: float) -> tuple[Membership, asyncio.Task[None]]:  # fmt: skip
    m = Membership(etcd, key, ttl, LeasePolicy.RENEW, take_over=True)
    await m.grant(m.start_deadline())
    await m.announce(b"mine", m.start_deadline())
    task = asyncio.create_task(m.keep_alive())
    await etcd.revoke_lease(m.lease_id)  # Lost (a pause past the TTL, say).
    return m, task


async def test_under_renew_a_renewal_whose_reply_was_lost_keeps_the_key_it_put(
    etcd: aetcd.Client, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect, now fixed (the old `_put_endpoint` had it too): `_announce_again` grants a new
    lease and puts the key if absent; when that put lands but its reply is lost (etcd killed
    as it answers, a timeout), `lease_id` stays 0 and nothing refreshes the lease the key is
    under. Every later renewal then fails its `Version == 0` compare against our own key
    (granting and revoking a lease each time) until that orphan lease lapses a whole TTL later
    and etcd deletes the endpoint; only then is it put again. `announce` handles this very case
    (the key under our own lease is ours); the renewal does not. Fix: as `announce` does, read
    the key when the compare fails, or remember the granted lease before the put and adopt a
    key under it."""
    key = f"{etcd_prefix}/endpoints/A"
    real = etcdx.txn
    lost = [False]

    async def reply_lost_once(client: Any, compare: Any, success: Any) -> Any:
        result = await real(client, compare, success)
        if compare and not lost[0]:  # The renewal's put (announce's has no compare).
            lost[0] = True
            raise etcd_errors.ConnectionTimeoutError("reply lost (test)")
        return result

    monkeypatch.setattr(membership_module.etcdx, "txn", reply_lost_once)
    m, task = await _lost_lease(etcd, key, 5.0)
    try:
        await until(lambda: lost[0], timeout=10)

        async def ours() -> bool:
            got = await etcd.get(key.encode())
            return got is not None and m.lease_id != 0 and got.lease == m.lease_id

        # Within a couple of refresh intervals (5/3 s each), well before the orphan lapses.
        await until(ours, "the renewed key under the lease it keeps alive", timeout=3.0)
    finally:
        assert await ends_cancelled(task, within=12)
        await m.revoke(2.0)


async def test_under_renew_a_renewal_cancelled_mid_put_leaves_no_endpoint_behind(
    etcd: aetcd.Client, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect, now fixed: the location stopping (its keep-alive cancelled) while a renewal's put
    is in flight: the put is uncancelled (`etcdx.uncancelled`) and lands, then the cancellation
    goes on before `_announce_again` records the new lease, so `revoke` has nothing to revoke
    and the endpoint outlives the process by a TTL (10 s by default), pointing at a dead
    endpoint. Fix: record the new lease before the put (and revoke it if the put fails or is
    cancelled)."""
    key = f"{etcd_prefix}/endpoints/A"
    real = etcdx.txn
    in_flight = asyncio.Event()

    async def flagged(client: Any, compare: Any, success: Any) -> Any:
        sending = asyncio.ensure_future(real(client, compare, success))
        if compare:
            in_flight.set()
        return await etcdx.uncancelled(sending)

    monkeypatch.setattr(membership_module.etcdx, "txn", flagged)
    m, task = await _lost_lease(etcd, key, 2.0)
    await in_flight.wait()
    assert await ends_cancelled(task, within=12)
    await m.revoke(2.0)
    got = await etcd.get(key.encode())
    if got is not None:
        await etcd.revoke_lease(got.lease)
    assert got is None, "the endpoint outlived its process (its lease was not revoked)"


async def test_under_renew_two_processes_racing_never_overwrite_each_other(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/endpoints/A"
    a = Membership(etcd, key, 1.0, LeasePolicy.RENEW, take_over=True)
    b = Membership(etcd, key, 1.0, LeasePolicy.RENEW, take_over=True)
    for m, body in ((a, b"a"), (b, b"b")):
        await m.grant(m.start_deadline())
        await m.announce(body, m.start_deadline())  # b takes the key over from a.
    tasks = [asyncio.create_task(m.keep_alive()) for m in (a, b)]
    try:
        got = await etcd.get(key.encode())
        assert got is not None and got.value == b"b"
        # Both lose their leases at once; both renew; one wins, the other keeps off.
        first = (a.lease_id, b.lease_id)
        await etcd.revoke_lease(a.lease_id)
        await etcd.revoke_lease(b.lease_id)

        async def settled() -> bool:
            got = await etcd.get(key.encode())
            ids = {a.lease_id, b.lease_id} - {0}
            return got is not None and got.lease in ids and not (ids & set(first))

        await until(settled, timeout=10)
        got = await etcd.get(key.encode())
        assert got is not None
        winner, loser = (a, b) if got.lease == a.lease_id else (b, a)
        # The loser's exit deletes nothing of the winner's.
        loser_task = tasks[0] if loser is a else tasks[1]
        assert await ends_cancelled(loser_task)
        await loser.revoke(2.0)
        again = await etcd.get(key.encode())
        assert again is not None and again.lease == winner.lease_id and again.value == got.value
    finally:
        for task in tasks:
            if not task.done():
                assert await ends_cancelled(task)
        await a.revoke(2.0)
        await b.revoke(2.0)


# ---- announce: a live holder ------------------------------------------------------------------


async def test_a_refused_announce_leaves_the_live_holders_key_on_the_way_out(
    etcd: aetcd.Client, etcd_prefix: str
) -> None:
    """Defect (severe; in the old broker and consumer too): after `AnnounceError` the lease
    stays granted (and kept alive: the owner spawned keep_alive before announcing), so the
    owner's `stop` sees `lease_id` set and no failure and calls `mark_exiting`, an
    unconditional put of our spec under OUR lease over the live holder's key, then `revoke`,
    which deletes it with our lease. The process refused for a duplicate id ("give this broker
    a different --broker.id or stop the other one") deletes the live process's member key on
    its way out. Fix: `mark_exiting` puts only while the key is ours (a txn comparing the
    key's lease with ours, or a flag set by `announce`); and/or `announce` revokes the lease
    (lease_id = 0) before raising AnnounceError."""
    key = f"{etcd_prefix}/members/z#a"
    holder = await etcd.lease(30)
    await etcd.put(key.encode(), b"theirs", lease=holder)
    m = Membership(etcd, key, 1.0, LeasePolicy.FENCE)
    loop = asyncio.get_running_loop()
    await m.grant(loop.time() + 1.0)
    try:
        with pytest.raises(AnnounceError):
            await m.announce(b"mine", loop.time() + 1.0)
        # What the broker's and the consumer's stop do next (lease_id set, no failure):
        if m.lease_id:
            await m.mark_exiting(b"mine, exiting", 2.0)
        await m.revoke(2.0)
        got = await etcd.get(key.encode())
        assert got is not None, "the live holder's key was deleted"
        assert got.value == b"theirs" and got.lease == holder.id
    finally:
        await etcd.revoke_lease(holder.id)


async def test_a_broker_refused_for_its_id_leaves_the_live_brokers_membership(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    """The defect above, as a user meets it: a second broker started with a live broker's id
    is refused (AnnounceError), and on its way out (`Broker.start`'s except calls `stop`) it
    overwrites the live broker's member key with its own spec marked exiting, then deletes it
    with its lease. Seen here: the live broker's allocator reads that exiting spec as its own,
    holds nothing, and returns ("exiting and holds no assignments; done"), not a failure; then
    the key goes. The live broker carries on with no member key and no allocator, and never
    fails (its lease is alive): a silent zombie the cluster no longer counts, and in a
    one-broker cluster nothing allocates journals any more. `Consumer.stop` has the same
    guard (`if self.lease_id and self.failure is None: mark_exiting`)."""
    live = BrokerHarness(etcd_server.endpoint, etcd_prefix, id="twin-id", lease=2.0)
    async with live:
        key = live.broker.member_key.encode()
        twin = Broker(
            BrokerConfig(
                id="twin-id",
                host="127.0.0.1",
                port=0,
                etcd_address=etcd_server.endpoint,
                etcd_prefix=etcd_prefix,
                etcd_lease=1.0,
                run_allocator=False,
            )
        )
        with pytest.raises(AnnounceError):
            await twin.start()
        got = await etcd.get(key)
        assert got is not None, "the refused twin deleted the live broker's member key"
        spec = pb.BrokerSpec.FromString(got.value)
        assert not spec.exiting and spec.process_spec.endpoint == live.endpoint
        assert got.lease == live.broker.lease_id
        await asyncio.sleep(1.0)  # A hold: the live broker must stay up, allocating.
        assert live.broker.failure is None, live.broker.failure
        assert live.broker._allocator is not None and not live.broker._allocator.done()


# ---- ProcessTasks -------------------------------------------------------------------------------


async def test_a_task_failing_as_it_is_cancelled_at_close_is_recorded_after_close() -> None:
    """Not a defect: a task that raises as `close` cancels it becomes `failure` after close;
    both processes' `_serve` read `failure` before `stop`, so no exit status changes."""
    tasks = ProcessTasks("p")

    async def raises_on_cancel() -> None:
        try:
            await forever()
        except asyncio.CancelledError:
            raise RuntimeError("teardown (test)") from None

    tasks.spawn(raises_on_cancel(), "t")
    await asyncio.sleep(0)
    await tasks.close()
    assert isinstance(tasks.failure, RuntimeError)


def test_keyboard_interrupt_in_a_task_stops_the_loop() -> None:
    """KeyboardInterrupt/SystemExit in a task propagate out of the loop (asyncio's own rule):
    the process ends; nothing swallows them into `failure` alone."""

    async def main() -> None:
        tasks = ProcessTasks("p")

        async def interrupted() -> None:
            raise KeyboardInterrupt

        tasks.spawn(interrupted(), "t")
        await asyncio.wait_for(tasks.done.wait(), 5)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())


async def test_a_translated_failure_is_the_one_kept() -> None:
    tasks = ProcessTasks("p", translate=lambda e: LeaseLost(str(e)))

    async def fails() -> None:
        raise ValueError("x")

    tasks.spawn(fails(), "t")
    async with asyncio.timeout(5):
        await tasks.done.wait()
    assert isinstance(tasks.failure, LeaseLost)
    await tasks.close()


# ---- drained ------------------------------------------------------------------------------------


class FakeKeySpace:
    def __init__(self, members: dict[str, Any]) -> None:
        self.members = members

    def get(self, key: str) -> Any:
        decoded = self.members.get(key)
        return None if decoded is None else SimpleNamespace(key=key, decoded=decoded)

    def prefixed(self, prefix: str) -> list[Any]:
        return [SimpleNamespace(key=k, decoded=v) for k, v in self.members.items() if k.startswith(prefix)]  # fmt: skip


@pytest.mark.parametrize("mine", ["vanished", "present"])
async def test_drained_waits_while_a_live_peer_could_take_the_items(mine: str) -> None:
    root = "/r"
    me = f"{root}/members/z#me"
    peer = Member("z", "peer", pb.BrokerSpec())
    members: dict[str, Any] = {f"{root}/members/z#peer": peer}
    if mine == "present":
        members[me] = Member("z", "me", pb.BrokerSpec(exiting=True))
    allocator = asyncio.create_task(forever())
    try:
        assert not await drained(allocator, FakeKeySpace(members), root, me, 0.3)  # type: ignore[arg-type]
        peer.spec.exiting = True  # No live peer left: waiting cannot help.
        assert await drained(allocator, FakeKeySpace(members), root, me, 5.0)  # type: ignore[arg-type]
    finally:
        allocator.cancel()
        await asyncio.gather(allocator, return_exceptions=True)
