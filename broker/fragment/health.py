"""The health of the fragment stores a broker persists to, checked as upstream checks them.

Each store a replica of this broker uses is checked on its own schedule: the check writes a probe
object, reads it back, lists it and signs (and, over http, fetches) a URL of it
(`FragmentStore.health_check`), the operations persisting and serving fragments rely on. Unlike
upstream, whose probe is `.test/health-check` at the store's root, the probe goes under the
fragment path of a journal this broker checks the store for (`<journal>/.gazette~health/`, as a
restricted FragmentStoreHealth puts it): a store may be shared by tenants whose journals have
disjoint paths under it, and its root may be another tenant's directory (issue 37). A store is
checked once however many journals use it, under the path of the first that watched it while that
one still uses it, then of another. A store
that passes is checked again after HEALTHY_INTERVAL; one that fails, sooner and sooner less often
(RETRY_INTERVALS), each interval jittered. A store operation that fails elsewhere (a persist, a
listing) brings the next check of a healthy store forward, so that a store gone after its last
check is found out at its first failed persist, not half an hour later.

Appends wait for the first check of their journal's first store, and are refused with
FRAGMENT_STORE_UNHEALTHY while it fails (`await_healthy`): content the store cannot take would
live only in the replicas' spools, and be lost when they all stop. An append to an unhealthy store
brings a check forward (at most one a second per store), so a store that recovers (the operator
made its directory, its bucket) takes appends again at once, with no restart.

A store is dropped, and its checks stop, when no journal uses it any longer (`unwatch`), or when no
replica has asked about it for a sweep interval (an hour).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from broker.fragment.stores import FragmentStore
from broker.fragment.stores.base import JOURNAL_HEALTH_DIR
from plumbing import metrics
from plumbing.tasks import Event, TaskOwner, first_of, wait_any

log = logging.getLogger(__name__)

# Upstream's schedule: a healthy store is checked again after half an hour; a failing one at
# once, then after 0.1 s, 1 s, 1 s, 10 s, 10 s, and every 100 s from then on. Each interval is
# jittered by up to a fifth either way, so brokers do not check a store in step.
HEALTHY_INTERVAL = 30 * 60.0
RETRY_INTERVALS = (0.0, 0.1, 1.0, 1.0, 10.0, 10.0, 100.0)
JITTER = 0.2
_RNG = random.Random()  # Its own: the global state is the application's.
# A check brought forward (by an append, or a failed store operation) starts no sooner than this
# after the last one began: appends to a store that is down do not become a storm of checks.
MIN_CHECK_GAP = 1.0
# A check that has not answered in this long fails ("no answer"), as upstream bounds its checks.
CHECK_TIMEOUT = 60.0
# Store clients retry within a call, for long (GCS: up to two minutes), so a check begun in an
# outage may end well after the store is back. A check out for CHECK_PATIENCE gets another
# beside it, while fewer than CHECKS_OUT younger than CHECK_AGE are out; the first to answer
# decides (as the first listing of a replica does, see the persister).
CHECK_PATIENCE = 1.5
CHECKS_OUT = 4
CHECK_AGE = 6.0
# How long an append waits for the first check of its store to complete, and then, while the
# store is unhealthy, for a check (brought forward) to find it healthy again.
FIRST_CHECK_TIMEOUT = 10.0
UNHEALTHY_WAIT = 3.0
# Stores not asked about for this long are dropped (upstream sweeps hourly).
SWEEP_INTERVAL = 3600.0

# Checks run on threads of their own: one held in a store client's retries must hold neither the
# loop's default executor nor the persister's.
_CHECKERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="store-health")


class _Store:
    """The health of one store: its last check's error ("" when it passed), and the events that
    waiters and the checking loop meet on."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.checked_once = False
        self.error = ""
        self.checked = Event()  # Set (and replaced) as each check completes.
        self.wake = Event()  # Set to bring the next check forward.
        self.marked = True  # Asked about since the last sweep.
        # The journals using the store, in the order they first did, each with whether it was
        # asked about since the last sweep: checks probe under the first one's path.
        self.journals: dict[str, bool] = {}
        self.began = 0.0  # Loop time at which the last check began.
        self.task: asyncio.Task[None] | None = None  # The checking loop.
        # Checks still out on threads (a thread cannot be stopped), by when each began.
        self.calls: dict[asyncio.Future[None], float] = {}

    def problem(self) -> str:
        if not self.checked_once:
            return f"the first health check of fragment store {self.url} has not completed"
        return self.error


class StoreHealth:
    """The health of every store this broker's replicas use, each checked by a task of its own
    (started by the first `watch` or `await_healthy` of it, owned here, stopped by `close`)."""

    def __init__(self, open_store: Callable[[str], FragmentStore]) -> None:
        self._open_store = open_store
        self._stores: dict[str, _Store] = {}
        self._tasks = TaskOwner("store health")
        self._sweeper: asyncio.Task[None] | None = None

    # ---- what replicas and appends ask ------------------------------------------------------

    def watch(self, url: str, journal: str) -> None:
        """`url` is in use (the first store of `journal`, a replica's): check it, if it is not
        checked yet, and keep it from being swept. Called on the event loop."""
        self._entry(url, journal)

    def unwatch(self, url: str, journal: str) -> None:
        """`journal` no longer uses store `url` (its replica stopped, or its spec names another
        store): checks probe under another journal's path, and stop when none is left."""
        entry = self._stores.get(url)
        if entry is None or entry.journals.pop(journal, None) is None or entry.journals:
            return
        self._drop(entry)

    def problem(self, url: str) -> str:
        """Why store `url` is unhealthy, as of its last check ("" if it passed, or if it is not
        checked here)."""
        entry = self._stores.get(url)
        return entry.problem() if entry is not None else ""

    def suspect(self, url: str) -> None:
        """A call to store `url` failed: if its last check passed, check it again now (no sooner
        than MIN_CHECK_GAP after the last began). A failing store is checked on its schedule."""
        entry = self._stores.get(url)
        if entry is not None and entry.checked_once and not entry.error:
            entry.wake.set()

    async def await_healthy(
        self,
        url: str,
        journal: str,
        invalidated: asyncio.Event,
        *,
        first_timeout: float = FIRST_CHECK_TIMEOUT,
        timeout: float = UNHEALTHY_WAIT,
    ) -> str:
        """Why an append to `journal`, whose first store is `url`, must be refused ("" if it may
        go on): wait (up to `first_timeout`) for the store's first check, and while the store is
        unhealthy, bring a check forward and wait up to `timeout` for one that passes. Returns
        "" at once when `invalidated` is set (the caller resolves again)."""
        entry = self._entry(url, journal)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + first_timeout
        while not entry.checked_once and not invalidated.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return (
                    f"fragment store {url} did not answer its first health check within "
                    f"{first_timeout:g}s"
                )
            await wait_any(entry.checked, invalidated, timeout=remaining)
        deadline = loop.time() + timeout
        while entry.error and not invalidated.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            entry.wake.set()
            await wait_any(entry.checked, invalidated, timeout=remaining)
        return "" if invalidated.is_set() else entry.problem()

    # ---- lifetime ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every check; waiters are released with the last known health."""
        await self._tasks.close()
        for entry in self._stores.values():
            _release(entry)
        self._stores.clear()

    def _entry(self, url: str, journal: str) -> _Store:
        entry = self._stores.get(url)
        if entry is None:
            entry = _Store(url)
            if not self._tasks.closed:
                self._stores[url] = entry
                entry.task = self._tasks.spawn(self._run(entry), f"checking {url}")
                if self._sweeper is None:
                    self._sweeper = self._tasks.spawn(self._sweep(), "sweeping")
            else:
                entry.checked_once, entry.error = True, "the broker is stopping"
        entry.marked = True
        entry.journals[journal] = True
        return entry

    def _drop(self, entry: _Store) -> None:
        """Stop checking `entry`'s store; waiters are released with its last known health."""
        if self._stores.get(entry.url) is entry:
            del self._stores[entry.url]
        if entry.task is not None:
            entry.task.cancel()  # Its owner (self._tasks) awaits it at `close`.
        _release(entry)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            for url, entry in list(self._stores.items()):
                # A journal not asked about since the last sweep (its replica went without an
                # `unwatch`) no longer names where the store's probes go.
                entry.journals = {j: False for j, marked in entry.journals.items() if marked}
                if entry.marked and entry.journals:
                    entry.marked = False
                    continue
                log.info("fragment store %s is no longer used: its health checks stop", url)
                self._drop(entry)

    # ---- checking ---------------------------------------------------------------------------

    async def _run(self, entry: _Store) -> None:
        loop = asyncio.get_running_loop()
        attempt = 0
        try:
            while self._stores.get(entry.url) is entry:
                entry.wake.clear()
                entry.began = loop.time()
                error = await self._check(entry)
                was = entry.error if entry.checked_once else None
                entry.checked_once, entry.error = True, error
                metrics.store_operations.labels(
                    metrics.store_label(entry.url), "health_check", "error" if error else "ok"
                ).inc()
                _release(entry)
                if error:
                    interval = RETRY_INTERVALS[min(attempt, len(RETRY_INTERVALS) - 1)]
                    attempt += 1
                    log.warning(
                        "fragment store %s is unhealthy (check %d; next in %.1fs): %s",
                        entry.url, attempt, interval, error,
                    )  # fmt: skip
                else:
                    interval, attempt = HEALTHY_INTERVAL, 0
                    if was:
                        log.info("fragment store %s is healthy again", entry.url)
                interval *= 1 + _RNG.uniform(-JITTER, JITTER)
                await wait_any(entry.wake, timeout=interval)
                gap = entry.began + MIN_CHECK_GAP - loop.time()
                if gap > 0:
                    await asyncio.sleep(gap)
        finally:
            for call in entry.calls:
                call.cancel()  # One not started yet never runs.

    async def _check(self, entry: _Store) -> str:
        """One health check of `entry`'s store: "" if it passed, else why not (one line naming
        the store). A call held in the store client's retries gets others beside it."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        mine: dict[asyncio.Future[None], float] = {}
        while True:
            now = loop.time()
            young = sum(1 for at in entry.calls.values() if now - at < CHECK_AGE)
            if young < CHECKS_OUT and all(now - at >= CHECK_PATIENCE for at in mine.values()):
                if mine:
                    log.warning(
                        "fragment store %s: no answer to its health check for %.1fs; checking "
                        "again beside it", entry.url, now - min(mine.values()),
                    )  # fmt: skip
                if not entry.journals:  # Not reached: the last `unwatch` drops the store.
                    return f"fragment store {entry.url}: no journal uses it here"
                # Under the path of a journal using the store, never at its root (see above).
                probe_dir = f"{next(iter(entry.journals))}/{JOURNAL_HEALTH_DIR}/"
                call = loop.run_in_executor(_CHECKERS, self._check_blocking, entry.url, probe_dir)
                call.add_done_callback(lambda done: _forget(entry, done))
                entry.calls[call] = mine[call] = now
            remaining = began + CHECK_TIMEOUT - now
            if remaining <= 0:
                return (
                    f"health check of {entry.url}: no answer from the store within "
                    f"{CHECK_TIMEOUT:g}s"
                )
            await first_of(*mine, timeout=min(CHECK_PATIENCE, remaining))
            for call in [call for call in mine if call.done()]:
                del mine[call]
                exc = None if call.cancelled() else call.exception()
                if exc is None and not call.cancelled():
                    return ""
                return _named(entry.url, str(exc) or type(exc).__name__)

    def _check_blocking(self, url: str, probe_dir: str) -> None:
        self._open_store(url).health_check(probe_dir=probe_dir)


def _named(url: str, error: str) -> str:
    """`error`, naming the store if it does not already."""
    return error if url in error else f"fragment store {url}: {error}"


def _forget(entry: _Store, call: asyncio.Future[None]) -> None:
    entry.calls.pop(call, None)
    if not call.cancelled():
        call.exception()  # Retrieved: a call let go is never "unretrieved".


def _release(entry: _Store) -> None:
    """Wake those waiting for `entry`'s next check."""
    checked, entry.checked = entry.checked, Event()
    checked.set()
