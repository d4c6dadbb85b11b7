"""A process's membership in etcd, and the policy for its background tasks: one component that
brokers, consumers and locations share (upstream has `allocator.Announce` and the
`mainboilerplate` around it).

`Membership` holds one key under a lease:
- `announce` grants the lease and puts the key, waiting out an earlier holder, or taking it
  over, as the process asks;
- `keep_alive` refreshes the lease until it is cancelled, whatever etcd does;
- `mark_exiting` and `revoke` give the key up at a graceful exit.

How a process reacts when etcd goes quiet, or says the lease is gone, is its `LeasePolicy`:
- `FENCE`, a broker: past the TTL without an answer, its owner is told to stop taking appends,
  and it is told again when etcd answers;
- `EXIT`, a consumer: past the TTL without an answer, the lease counts as lost;
- `RENEW`, a location's endpoint, which is for discovery only: a lost lease is replaced by a
  new one, unless another process has registered meanwhile.

Under `FENCE` and `EXIT`, a lease that etcd says is gone raises `LeaseLost`.

`ProcessTasks` owns a process's background tasks. The first failure is its `failure`, and it
sets `done`, which the process's main loop waits on.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import exceptions as etcd_errors
from aetcd import transactions

from plumbing import etcd as etcdx
from plumbing import metrics
from plumbing.backoff import Backoff
from plumbing.tasks import TaskOwner

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a process's first calls to etcd may meet while etcd restarts: it waits for etcd.
ETCD_TRANSIENT = (*etcdx.UNREACHABLE, etcd_errors.InternalError)


class LeaseLost(RuntimeError):
    """etcd says the lease is gone, or (policy `EXIT`) it went unanswered past its TTL."""


class AnnounceError(RuntimeError):
    """The key is held by another live process."""


class LeasePolicy(enum.Enum):
    FENCE = "fence"
    EXIT = "exit"
    RENEW = "renew"


def lease_retry_backoff() -> Backoff:
    """Between failed refreshes of the etcd lease: soon, as etcd usually answers again within
    a second or two of a restart (and keeps every lease alive across it)."""
    return Backoff(initial=0.2, factor=1.5, maximum=0.5)


def describe_refresh_failure(error: BaseException | None, bound: float) -> str:
    """Why a lease refresh failed, never empty: its error's text, or its type's name when the
    text is empty (`str(TimeoutError())` is ""), a timeout with the bound it ran out
    ("TimeoutError after 2.0s"); a gRPC error as its code and first line of details."""
    if error is None:
        return "no answer"
    if isinstance(error, grpc.aio.AioRpcError):
        detail = (error.details() or "").split("\n")[0]
        return f"{error.code().name}: {detail}" if detail else error.code().name
    text = str(error)
    if text:
        return text
    if isinstance(error, TimeoutError):
        return f"{type(error).__name__} after {bound:.1f}s"
    return type(error).__name__


# The least time one attempt of a start is given, should it begin at or past its deadline.
ATTEMPT_FLOOR = 1.0


async def while_etcd_starts(what: str, call: Callable[[], Awaitable[T]], deadline: float) -> T:
    """`call` as a process starts, tried again (the project's backoff) while etcd is
    unreachable, until `deadline` on the loop's clock; then its error is raised. Started while
    etcd restarts, a process waits for it, as upstream's clientv3 does, rather than exiting.
    Each attempt is bounded by the deadline (or ATTEMPT_FLOOR seconds, if later): an etcd that
    takes a call and never answers fails the start then, rather than holding it for good."""
    backoff = Backoff(initial=0.1, maximum=2.0)
    loop = asyncio.get_running_loop()
    said = False
    while True:
        bound = asyncio.timeout_at(max(deadline, loop.time() + ATTEMPT_FLOOR))
        try:
            async with bound:
                return await call()
        except TimeoutError:
            if not bound.expired():
                raise  # The call's own.
            raise etcd_errors.ConnectionTimeoutError(
                f"{what}: etcd did not answer by the start's deadline"
            ) from None
        except (*ETCD_TRANSIENT, grpc.aio.AioRpcError) as exc:
            raw = isinstance(exc, grpc.aio.AioRpcError)  # A keyspace load reads etcd's stub.
            if (raw and exc.code() != grpc.StatusCode.UNAVAILABLE) or loop.time() > deadline:
                raise
            if not said:  # One line, once: the wait is bounded, and its end says why.
                said = True
                why = exc.details() if raw else str(exc)
                first = (why or type(exc).__name__).splitlines()[0]
                log.warning(
                    "starting: %s: etcd unavailable (%s): waiting for it for up to %.0fs",
                    what, first, max(0.0, deadline - loop.time()),
                )  # fmt: skip
            await backoff.sleep()


class Membership:
    """One key of this process's under an etcd lease. Nothing runs until `announce`.

    - `key`: the member key (or a location's endpoint key).
    - `ttl`: the lease's TTL asked for, in seconds (rounded, at least 1).
    - `policy`: see the module's docstring.
    - `take_over`: `announce` replaces a key another process holds (a location's endpoint: the
      newest process is the location's). Otherwise it waits for the holder's lease to expire,
      and raises `AnnounceError` if the holder stays alive (`conflict` says what to do).
    - `on_fence(fenced)`: under `FENCE`, called when the owner must stop (True) or may resume
      (False) taking appends.
    """

    def __init__(
        self,
        etcd: aetcd.Client,
        key: str,
        ttl: float,
        policy: LeasePolicy,
        *,
        take_over: bool = False,
        conflict: str = "give this process another id or stop the other one",
        on_fence: Callable[[bool], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.key = key
        self.ttl = max(1, round(ttl))
        self.policy = policy
        self.take_over = take_over
        self.conflict = conflict
        self.on_fence = on_fence
        self.value = b""
        self.announced = False  # Whether the key was put under our lease.
        # Under RENEW: a new lease is held, and the key was not yet seen put under it.
        self.renewing = False
        self.lease_id = 0
        self.granted_ttl = 0  # As etcd granted it, in seconds.
        # Until when (the loop's clock) etcd cannot have expired the lease: the send time of
        # the last refresh it answered, plus the TTL.
        self.valid_until = 0.0
        self.fenced = False

    # ---- announce ---------------------------------------------------------------------------

    def start_deadline(self) -> float:
        """How long a starting process waits for etcd, and for an earlier holder of its key to
        go (the loop's clock): two TTLs and two seconds."""
        return asyncio.get_running_loop().time() + 2 * self.ttl + 2

    async def grant(self, deadline: float) -> None:
        """Grant the lease, tried again while etcd is unreachable until `deadline` (the loop's
        clock). The owner starts `keep_alive` next, and then `announce`s."""
        sent = asyncio.get_running_loop().time()
        # A grant whose reply was lost leaves a lease nothing refreshes: it lapses.
        lease = await while_etcd_starts(
            "granting a lease", lambda: self.etcd.lease(self.ttl), deadline
        )
        self._hold(lease, sent)

    def _hold(self, lease: Any, sent: float) -> None:
        """Record a lease etcd granted to a request sent at `sent` (the loop's clock): it
        cannot expire before `sent` plus its TTL."""
        self.lease_id = int(lease.id)
        self.granted_ttl = int(lease.ttl) or self.ttl
        self.valid_until = sent + self.granted_ttl

    async def announce(
        self,
        value: bytes,
        deadline: float,
        applied: Callable[[int], Awaitable[Any]] | None = None,
    ) -> None:
        """Put `value` at the key under the lease; `applied(revision)` is awaited with the
        put's revision (a process waits for its own keyspace to show it). While etcd is
        unreachable it is tried again until `deadline`, as is waiting for another holder's
        lease to expire (then `AnnounceError`)."""
        loop = asyncio.get_running_loop()
        self.value = value
        key = self.key.encode()
        compare = [] if self.take_over else [transactions.Version(key) == 0]
        while True:
            result = await while_etcd_starts(
                f"announcing {self.key}",
                lambda: etcdx.txn(
                    self.etcd, compare, [transactions.Put(key, value, lease=self.lease_id)]
                ),
                deadline,
            )
            if result.succeeded:
                revision = result.revision
                break
            # Held: by another process, or by us (a put whose reply was lost as etcd was
            # killed: then it is under our lease).
            held = await while_etcd_starts(
                f"reading {self.key}", lambda: self.etcd.get(key), deadline
            )
            if held is not None and held.lease == self.lease_id:
                revision = held.mod_revision
                break
            if loop.time() > deadline:
                # Ours is given up before saying so: the caller's stop must neither mark the
                # holder's key exiting nor revoke anything of the holder's.
                await self.revoke(2.0)
                raise AnnounceError(f"{self.key} is held by another live process: {self.conflict}")
            log.warning("%s exists; waiting for its lease to expire", self.key)
            await asyncio.sleep(1.0)
        self.announced = True
        if applied is not None:
            await applied(revision)

    async def _announce_again(self) -> bool:
        """Under `RENEW`, after the lease was lost: the key under a new lease, if no other
        process has put it meanwhile (it took the key over: it is not overwritten).

        The new lease is recorded before the put: a put cancelled in flight (the process
        stopping) leaves its key under a lease `revoke` takes away, and a put whose reply was
        lost is found under it at the next turn (`renewing` until the key is seen there)."""
        key = self.key.encode()
        if not self.lease_id:
            sent = asyncio.get_running_loop().time()
            self._hold(await self.etcd.lease(self.ttl), sent)
            self.renewing = True
        result = await etcdx.txn(
            self.etcd,
            [transactions.Version(key) == 0],
            [transactions.Put(key, self.value, lease=self.lease_id)],
        )
        if not result.succeeded:
            held = await self.etcd.get(key)
            if held is None or held.lease != self.lease_id:
                # Another process's (or gone since the compare: put at the next turn).
                lease_id, self.lease_id, self.renewing = self.lease_id, 0, False
                await self.etcd.revoke_lease(lease_id)
                return False
        self.renewing = False
        return True

    # ---- keep-alive -------------------------------------------------------------------------

    async def keep_alive(self) -> None:
        """Refresh the lease every third of its TTL; after a failed refresh, retry soon (see
        `lease_retry_backoff`), each attempt bounded so that one hung call cannot use up the
        TTL. Returns only by cancellation, or raises `LeaseLost` (policies `FENCE`, `EXIT`).

        While etcd does not answer, the lease may still be alive: etcd keeps leases across its
        own restart (a new leader extends each by its TTL). But once our own clock passes the
        TTL since the last refresh etcd answered (counted from when we sent it, so never later
        than etcd's own expiry, less a margin), etcd may have expired it: the policy says what
        then."""
        loop = asyncio.get_running_loop()
        ttl = float(self.granted_ttl or self.ttl)
        interval = max(0.1, ttl / 3)
        attempt_bound = min(2.0, max(0.5, ttl / 5))
        margin = min(1.0, ttl / 10) if self.policy is LeasePolicy.FENCE else 0.0
        backoff = lease_retry_backoff()
        failing_since = 0.0
        failed_why = ""  # The last refresh's failure, while they fail.
        delay = interval
        # Under FENCE, silence is judged on our own clock, before asking again (no append is
        # acknowledged past the point etcd may have expired the lease); under EXIT, only once a
        # refresh failed: a process paused past its TTL asks etcd first, which may still hold
        # the lease (it counts the TTL from when it got the last refresh).
        fencing = self.policy is LeasePolicy.FENCE
        watching = self.policy is not LeasePolicy.RENEW  # Whether silence matters at all.

        def lapse_at() -> float:
            return self.valid_until - margin

        while True:
            if fencing and not self.fenced:
                delay = min(delay, max(0.0, lapse_at() - loop.time()))
            await asyncio.sleep(delay)
            if fencing:
                self._check_silence(loop.time() >= lapse_at(), ttl, failed_why)
            if not self.lease_id:
                if self.policy is not LeasePolicy.RENEW:
                    raise LeaseLost(f"{self.key} has no lease (it was given up)")
                await self._renew_logged()  # Not registered again yet: try again.
                delay = interval
                continue
            sent = loop.time()
            bound = attempt_bound
            if fencing and not self.fenced:
                bound = min(bound, max(0.05, lapse_at() - sent))
            error: BaseException | None = None
            try:
                # Not `asyncio.wait_for`: in Python 3.11 it can swallow a cancellation that
                # meets the refresh's end, and this loop would go on through its owner's stop.
                async with asyncio.timeout(bound):
                    reply = await self.etcd.refresh_lease(self.lease_id)
            except Exception as exc:  # Whatever the client raised: a refresh that failed.
                reply, error = None, exc
            if reply is not None and reply.TTL <= 0:
                if self.policy is LeasePolicy.FENCE and not self.fenced:
                    # No append is acknowledged from here, while the owner stops.
                    self.fenced = True
                    metrics.fenced.set(1)
                    if self.on_fence is not None:
                        self.on_fence(True)
                if self.policy is not LeasePolicy.RENEW:
                    raise LeaseLost(f"etcd lease of {self.key} expired or was revoked")
                log.warning("the etcd lease of %s expired", self.key)
                self.lease_id, self.renewing = 0, False
                await self._renew_logged()
                delay = interval
                continue
            if reply is None:
                metrics.lease_refresh_failures.inc()
                if not failing_since:
                    failing_since = sent
                    log.warning(
                        "refreshing the etcd lease of %s failed (retrying): %s",
                        self.key, describe_refresh_failure(error, bound),
                    )  # fmt: skip
                failed_why = describe_refresh_failure(error, bound)
                if watching:
                    self._check_silence(loop.time() >= lapse_at(), ttl, failed_why)
                delay = backoff.next_delay()
                continue
            backoff.reset()
            failed_why = ""
            self.valid_until = sent + reply.TTL
            if failing_since:
                log.info("etcd lease of %s refreshed again after %.1fs", self.key, loop.time() - failing_since)  # fmt: skip
                failing_since = 0.0
            if self.fenced:
                self.fenced = False
                metrics.fenced.set(0)
                log.warning("etcd lease of %s is alive: appends resume", self.key)
                if self.on_fence is not None:
                    self.on_fence(False)
            if self.renewing:
                await self._renew_logged()  # The put's outcome was unknown: the key is read.
            delay = interval

    async def _renew_logged(self) -> bool:
        try:
            if await self._announce_again():
                log.warning("%s is registered again under a new lease", self.key)
                return True
        except Exception as exc:  # Whatever the client raised: tried again at the next turn.
            log.warning("registering %s again failed: %s", self.key, describe_refresh_failure(exc, 0))  # fmt: skip
        return False

    def _check_silence(self, lapsed: bool, ttl: float, why: str) -> None:
        """Past the TTL since etcd last answered: fence (FENCE) or give up (EXIT). `why`: the
        last refresh's failure, if one failed."""
        if not lapsed or self.fenced:
            return
        silent = asyncio.get_running_loop().time() - self.valid_until + ttl
        if self.policy is LeasePolicy.EXIT:
            raise LeaseLost(
                f"no etcd lease refresh answered for {ttl:g}s" + (f": {why}" if why else "")
            )
        self.fenced = True
        metrics.fenced.set(1)
        log.warning(
            "etcd answered no lease refresh for %.1fs (TTL %gs): %s may have lost its lease; "
            "appends are paused until etcd answers (the process exits if etcd says the lease "
            "is gone)",
            silent, ttl, self.key,
        )  # fmt: skip
        if self.on_fence is not None:
            self.on_fence(True)

    # ---- exit -------------------------------------------------------------------------------

    async def mark_exiting(self, value: bytes, bound: float) -> None:
        """Put `value` (the process's spec, marked exiting) under the lease, within `bound`
        seconds; an error is logged, not raised (the process stops either way)."""
        if not (self.lease_id and self.announced):
            return  # Never ours: the key may be another live process's.
        try:
            async with asyncio.timeout(bound):
                await self.etcd.put(self.key.encode(), value, lease=self.lease_id)
        except Exception as exc:
            log.warning("marking %s exiting failed: %s", self.key, describe_refresh_failure(exc, bound))  # fmt: skip

    async def revoke(self, bound: float) -> None:
        """Revoke the lease (etcd deletes the key with it, if the key is still under it),
        within `bound` seconds; it expires anyway within its TTL if etcd does not answer."""
        lease_id, self.lease_id = self.lease_id, 0
        if not lease_id:
            return
        try:
            async with asyncio.timeout(bound):
                await self.etcd.revoke_lease(lease_id)
        except Exception as exc:
            log.warning("revoking the lease of %s failed: %s", self.key, describe_refresh_failure(exc, bound))  # fmt: skip


class ProcessTasks:
    """The background tasks of a process, any of whose failures stops it: the first failure
    is `failure`, and `done` is set for the process's main loop. `translate` may name a
    failure better (an allocator's missing member key is a lost lease)."""

    def __init__(
        self,
        name: str,
        translate: Callable[[BaseException], BaseException] = lambda exc: exc,
    ) -> None:
        self.name = name
        self.owner = TaskOwner(name)
        self.done = asyncio.Event()
        self.failure: BaseException | None = None
        self._translate = translate

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self.owner.spawn(coro, name)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        exc = self._translate(exc)
        log.error("%s task %r failed: %s", self.name, task.get_name(), exc)
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Stop the process for `exc` (the first failure is the one kept)."""
        self.failure = self.failure or exc
        self.done.set()

    async def close(self) -> None:
        """Cancel every task and wait for each to end (see `TaskOwner.close`)."""
        await self.owner.close()
