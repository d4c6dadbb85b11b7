"""Persisting completed fragments to the journal's first fragment store, and listing the stores.

As upstream: the journal's primary persists a fragment as soon as the spool completes it; the other
replicas wait `persist_interval` and then usually find it already persisted (an `exists` check).
Fragments are content-addressed, so persisting is idempotent: a fragment already in the store is
never written again, and a put never overwrites. Failures retry with backoff until the fragment is
persisted, the journal is deleted, or the broker stops (when it keeps trying, for a bounded time).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from broker.fragment import codecs
from broker.fragment.content import fragment_path
from broker.fragment.fragments import content_name, content_path
from broker.fragment.health import StoreHealth
from broker.fragment.index import Index
from broker.fragment.postfix import PostfixTemplate, compile_template, validate_template
from broker.fragment.spool import CompletedFragment
from broker.fragment.stores import FragmentStore, StoreError, check_store_url, open_store
from broker.fragment.stores.paths import PathIndexCache, StoreGuard
from broker.protocol import protocol_pb2 as pb
from plumbing import metrics
from plumbing.backoff import Backoff
from plumbing.tasks import TaskOwner, first_of, wait_any

log = logging.getLogger(__name__)

# Upstream's replicas check their completed fragments once a minute.
PERSIST_INTERVAL = 60.0


# Between failed persists or listings: 0.1 s, doubling to STORE_RETRY_MAX, so that once a store
# is back, what waits for it goes on within seconds. (A cap of a minute let a series of short
# store outages hold a journal for half a minute: fault campaign finding 6.)
STORE_RETRY_MAX = 5.0
# Until a replica's first listing succeeds, appends to it wait for one: retried sooner.
FIRST_LISTING_RETRY_MAX = 1.0
# A store client may also retry a failed call within itself, for long: the GCS client backs off
# up to a minute, for up to two, so a listing begun in an outage may end well after the store is
# back. Until a replica's first listing succeeds, a listing still out after this long does not
# hold its appends: another starts beside it, while fewer than FIRST_LISTINGS younger than
# FIRST_LISTING_AGE are out, and the first to succeed is taken.
FIRST_LISTING_PATIENCE = 1.5
FIRST_LISTINGS = 4
FIRST_LISTING_AGE = 6.0

# Store calls run on threads of their own: calls held in a store client's retries must not hold
# the event loop's default executor (reads and the allocator use it), nor listings wait behind
# persists.
_LISTERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="store-list")
_PERSISTERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="store-persist")


def store_backoff(maximum: float = STORE_RETRY_MAX) -> Backoff:
    """Between failed persists or listings: 0.1 s, doubling to `maximum`."""
    return Backoff(initial=0.1, factor=2.0, maximum=maximum)


# How long an Apply waits for a store to say whether a journal's new path holds objects.
UNCLAIMED_CHECK_TIMEOUT = 30.0

# How long a stopping broker keeps trying to persist what it still holds (its spools' content,
# the open fragments included: see Replica.shutdown), and how soon it tries again meanwhile.
FINAL_ATTEMPT_TIMEOUT = 30.0
STOPPING_RETRY_DELAY = 0.5


@functools.lru_cache(maxsize=256)
def _template(template: str) -> PostfixTemplate:
    """A compiled path postfix template (a cluster has few distinct ones)."""
    return compile_template(template)


def check_spec_supported(spec: pb.JournalSpec) -> None:
    """Beyond the protocol's validation: the spec's stores and path postfix template are ones
    this broker can persist to, checked when the spec is applied rather than at persist time.
    Raises ValueError with one line naming the journal and the problem."""
    for index, url in enumerate(spec.fragment.stores):
        try:
            check_store_url(url)
        except ValueError as exc:
            raise ValueError(f"journal {spec.name}: fragment.stores[{index}]: {exc}") from None
    try:
        validate_template(spec.fragment.path_postfix_template)
    except ValueError as exc:
        raise ValueError(f"journal {spec.name}: fragment.path_postfix_template: {exc}") from None


class JournalReplica(Protocol):
    """What the persister and the refresh daemon use of a journal's replica (the fragment
    layer knows nothing else of replicas)."""

    journal: str
    spec: pb.JournalSpec | None
    # The create revision of the journal's item this replica serves (0: unknown): a journal
    # deleted and created again under its name is another journal.
    create_revision: int
    stopped: bool
    index: Index

    @property
    def spec_changed_event(self) -> asyncio.Event: ...


class Persister:
    def __init__(
        self,
        *,
        file_root: Path | None = None,
        spool_dir: Path | None = None,
        persist_interval: float = PERSIST_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.file_root = file_root
        self.spool_dir = spool_dir
        self.persist_interval = persist_interval
        self._clock = clock
        self.tasks = TaskOwner("persister")  # One per fragment being persisted.
        self._stopping = asyncio.Event()
        self.persisted = 0  # Fragments this broker wrote to a store.
        self.bytes_persisted = 0
        # Every journal's fragment path (set by the journal service): each journal's fragments
        # are listed and persisted only within its own. None: no such check (tools, tests).
        self.paths: PathIndexCache | None = None
        # The health of the stores replicas here persist to: appends wait on it.
        self.health = StoreHealth(self.store)

    def guards(self, journal: str, spec: pb.JournalSpec) -> list[StoreGuard | None]:
        """The guard of each of `spec`'s stores, or None each without `paths` (on the loop)."""
        if self.paths is None:
            return [None] * len(spec.fragment.stores)
        return list(self.paths.guards(journal, spec))

    def store(self, url: str) -> FragmentStore:
        return open_store(url, file_root=self.file_root)

    def sign(self, fragment: pb.Fragment, ttl: timedelta) -> str:
        """A signed GET URL of a persisted fragment (blocking)."""
        return self.store(fragment.backing_store).sign_get(fragment_path(fragment), ttl)

    # ---- persisting ---------------------------------------------------------------------------

    def on_complete(self, replica: JournalReplica, completed: CompletedFragment) -> None:
        """Take a fragment the spool of `replica` completed, and persist it."""
        completed.retain()
        try:
            self.tasks.spawn(self._persist(replica, completed), f"persisting {completed!r}")
        except RuntimeError:
            # Stopped (the broker is exiting): the fragment stays in the spool's files only.
            log.error("persister stopped: %r is not persisted", completed)
            completed.close()

    async def _persist(self, replica: JournalReplica, completed: CompletedFragment) -> None:
        try:
            if not completed.primary:
                await wait_any(self._stopping, timeout=self.persist_interval)
            backoff = store_backoff()
            while True:
                spec = replica.spec
                if self.paths is not None:
                    # As upstream, the journal's spec as it stands: a stopped replica's may be
                    # stale, and a deleted journal's last fragment is dropped, not written
                    # into a path its deletion freed (which another journal may now claim),
                    # nor by the spec of a journal created under its name since: that one may
                    # be another tenant's, with its own stores.
                    spec = self.paths.spec(completed.fragment.journal, replica.create_revision)
                    if spec is None:
                        log.info("dropping %r: its journal was deleted", completed)
                        return
                if spec is None or not spec.fragment.stores:
                    return  # No stores: the journal works, but never persists (as upstream).
                try:
                    guard = self.guards(completed.fragment.journal, spec)[0]
                    fragment = await asyncio.get_running_loop().run_in_executor(
                        _PERSISTERS, self._persist_blocking, spec, completed, guard
                    )
                except Exception as exc:
                    if self._stopping.is_set():
                        # The broker is exiting, and this may be the last copy: try again
                        # until `stop` gives up on it.
                        log.warning(
                            "persisting %r before stopping failed (retrying): %s", completed, exc
                        )
                        await asyncio.sleep(STOPPING_RETRY_DELAY)
                        continue
                    self.health.suspect(spec.fragment.stores[0])
                    delay = backoff.next_delay()
                    log.warning(
                        "persisting %r failed (attempt %d, retrying in %.1fs): %s",
                        completed, backoff.attempt, delay, exc,
                    )  # fmt: skip
                    await wait_any(self._stopping, timeout=delay)
                    continue
                if not replica.stopped:
                    replica.index.add_remote(fragment)
                return
        except asyncio.CancelledError:
            if self._stopping.is_set():
                log.error("could not persist %r before stopping", completed)
            raise
        finally:
            completed.close()

    def _persist_blocking(
        self, spec: pb.JournalSpec, completed: CompletedFragment, guard: StoreGuard | None = None
    ) -> pb.Fragment:
        fragment = completed.fragment
        url = spec.fragment.stores[0]
        store = self.store(url)
        postfix = _template(spec.fragment.path_postfix_template).render(
            spec=spec,
            fragment=fragment,
            first_append_time=completed.first_append_time,
            registers=completed.registers,
        )
        path = content_path(fragment.journal, postfix, content_name(fragment))
        if guard is not None and (problem := guard.key_problem(store.key(path))):
            raise StoreError(problem)  # Never written where another journal's fragments are.
        with _store_operation(url, "exists"):
            exists = store.exists(path)
        if not exists:
            spool_dir = None if self.spool_dir is None else str(self.spool_dir)
            file, length = completed.compressed(spool_dir)
            file.seek(0)
            encoding = codecs.content_encoding(fragment.compression_codec)
            with _store_operation(url, "put"):
                put = store.put(path, file, length, encoding)
            if put:
                self.persisted += 1
                self.bytes_persisted += length
                metrics.store_put_bytes.labels(
                    metrics.store_label(url), encoding or "identity"
                ).inc(length)
                log.info("persisted %s to %s (%d bytes)", path, url, length)
        metrics.spool_persisted.inc()
        fragment.backing_store = url
        fragment.path_postfix = postfix
        fragment.mod_time = int(self._clock())
        return fragment

    # ---- listing ------------------------------------------------------------------------------

    async def holds_objects(self, journal: str, url: str) -> bool:
        """Whether store `url` holds any object under `journal`'s fragment path (listed with
        the broker's own credentials, as fragments are, stopping at the first). Raises
        StoreError (or TimeoutError after UNCLAIMED_CHECK_TIMEOUT) when it cannot say."""

        def first() -> bool:
            with _store_operation(url, "list"):
                return next(iter(self.store(url).list(journal + "/")), None) is not None

        async with asyncio.timeout(UNCLAIMED_CHECK_TIMEOUT):
            return await asyncio.get_running_loop().run_in_executor(_LISTERS, first)

    def list_blocking(
        self,
        journal: str,
        spec: pb.JournalSpec,
        guards: list[StoreGuard | None] | None = None,
    ) -> list[pb.Fragment]:
        """Every fragment of `journal` in every store of its spec (blocking). With `guards`
        (`self.guards`), a store whose path is not the journal's own fails the listing, and
        objects under other journals' paths nested in its own are left out."""
        out: list[pb.Fragment] = []
        for url, guard in zip(spec.fragment.stores, guards or [None] * len(spec.fragment.stores), strict=True):  # fmt: skip
            if guard is not None and guard.error:
                raise StoreError(guard.error)
            with _store_operation(url, "list"):
                excluded = guard.excluded if guard is not None else ()
                out.extend(self.store(url).list_fragments(journal, excluded=excluded))
        return out

    async def refresh_loop(self, replica: JournalReplica) -> None:
        """The fragment refresh daemon of a replica: list its stores every refresh_interval (or
        sooner when the index asks, after a persist) and replace the index's remote fragments.
        The first listing releases waiting appends: until it succeeds, failures are retried
        within FIRST_LISTING_RETRY_MAX, and a listing held in the store client's own retries
        does not hold the appends (see `_first_listing`)."""
        backoff = store_backoff(FIRST_LISTING_RETRY_MAX)
        loop = asyncio.get_running_loop()
        # The store this journal is watched as using, let go of when the replica stops or its
        # spec names another first store (so that the store's probes move to another journal).
        watched = ""
        try:
            while not replica.stopped:
                spec = replica.spec
                if spec is None:
                    await replica.spec_changed_event.wait()
                    continue
                first_store = spec.fragment.stores[0] if spec.fragment.stores else ""
                if first_store:
                    # Checked while a replica uses it (perhaps probed under its path).
                    self.health.watch(first_store, replica.journal)
                if watched and watched != first_store:
                    self.health.unwatch(watched, replica.journal)
                watched = first_store
                first = not replica.index.first_refresh.is_set()
                interval = spec.fragment.refresh_interval.seconds or 60
                try:
                    if not spec.fragment.stores:
                        listed = []  # Nothing to list: no thread, no wait.
                    elif first:
                        listed = await self._first_listing(replica, spec)
                    else:
                        listed = await loop.run_in_executor(
                            _LISTERS,
                            self.list_blocking,
                            replica.journal,
                            spec,
                            self.guards(replica.journal, spec),
                        )
                except Exception as exc:
                    delay = min(backoff.next_delay(), interval)
                    replica.index.refresh_error = f"listing fragments: {exc}"
                    for url in spec.fragment.stores:
                        self.health.suspect(url)
                    log.warning("listing fragments of %s failed: %s", replica.journal, exc)
                else:
                    backoff = store_backoff()  # Reset; and past the first listing, capped higher.
                    replica.index.refresh_error = ""
                    if replica.stopped:
                        return
                    replica.index.replace_remote(listed)
                    delay = interval
                requested = replica.index.refresh_requested
                await wait_any(requested, replica.spec_changed_event, timeout=delay)
                requested.clear()
        finally:
            if watched:
                self.health.unwatch(watched, replica.journal)

    async def _first_listing(
        self, replica: JournalReplica, spec: pb.JournalSpec
    ) -> list[pb.Fragment]:
        """A listing of `spec`'s stores for a replica whose appends wait for its first one. A
        call out for FIRST_LISTING_PATIENCE (held in the store client's retries, typically) is
        not waited for alone: another starts beside it, so that one begins soon after the store
        is back. Raises the error of the first call to fail (the caller retries); calls still out
        then are let go (a thread cannot be stopped: each ends with its client's retries, and
        its result is dropped)."""
        loop = asyncio.get_running_loop()
        calls: dict[asyncio.Future[list[pb.Fragment]], float] = {}  # -> when it started
        try:
            while True:
                now = loop.time()
                young = sum(1 for at in calls.values() if now - at < FIRST_LISTING_AGE)
                if young < FIRST_LISTINGS:
                    if len(calls) == 1:
                        log.warning(
                            "listing fragments of %s: no answer from its store for %.1fs; "
                            "listing again beside it", replica.journal, now - min(calls.values()),
                        )  # fmt: skip
                    spec = replica.spec or spec
                    guards = self.guards(replica.journal, spec)
                    call = loop.run_in_executor(
                        _LISTERS, self.list_blocking, replica.journal, spec, guards
                    )
                    calls[call] = now
                await first_of(*calls, timeout=FIRST_LISTING_PATIENCE)
                error: BaseException | None = None
                for call in [call for call in calls if call.done()]:
                    del calls[call]
                    if call.exception() is None:
                        return call.result()
                    error = call.exception()
                if error is not None:
                    raise error
        finally:
            for call in calls:
                call.cancel()  # One not started yet never runs.

    # ---- lifetime -----------------------------------------------------------------------------

    async def stop(self, timeout: float = FINAL_ATTEMPT_TIMEOUT) -> None:
        """Persist what is still held at once, trying again after a failure, for up to
        `timeout` seconds (what is not persisted by then is given up, and logged), then stop."""
        self._stopping.set()
        await self.tasks.close(grace=timeout)
        await self.health.close()


@contextlib.contextmanager
def _store_operation(url: str, operation: str) -> Iterator[None]:
    """Count and time one store operation, by the store's URL and whether it failed."""
    timer = metrics.Timer()
    store = metrics.store_label(url)
    status = "error"
    try:
        yield
        status = "ok"
    finally:
        metrics.store_operations.labels(store, operation, status).inc()
        metrics.store_operation_seconds.labels(store, operation, status).observe(timer.elapsed())
