"""Persisting completed fragments to the journal's first fragment store, and listing the stores.

As upstream: the journal's primary persists a fragment as soon as the spool completes it; the other
replicas wait `persist_interval` and then usually find it already persisted (an `exists` check).
Fragments are content-addressed, so persisting is idempotent: a fragment already in the store is
never written again, and a put never overwrites. Failures retry with backoff until the fragment is
persisted, the journal is deleted, or the broker stops (when it makes one last attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from broker.fragment import codecs
from broker.fragment.content import fragment_path
from broker.fragment.fragments import content_name, content_path
from broker.fragment.postfix import PostfixTemplate, compile_template, validate_template
from broker.fragment.spool import CompletedFragment
from broker.fragment.stores import FragmentStore, check_store_url, open_store
from broker.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from broker.replica import Replica

log = logging.getLogger(__name__)

# Upstream's replicas check their completed fragments once a minute.
PERSIST_INTERVAL = 60.0
# Backoff between failed attempts, in seconds; the last repeats.
BACKOFF = (0.1, 1.0, 5.0, 10.0, 30.0, 60.0)
# How long a stopping broker keeps trying to persist what it still holds.
FINAL_ATTEMPT_TIMEOUT = 30.0


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
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self.persisted = 0  # Fragments this broker wrote to a store.
        self.bytes_persisted = 0

    def store(self, url: str) -> FragmentStore:
        return open_store(url, file_root=self.file_root)

    def sign(self, fragment: pb.Fragment, ttl: timedelta) -> str:
        """A signed GET URL of a persisted fragment (blocking)."""
        return self.store(fragment.backing_store).sign_get(fragment_path(fragment), ttl)

    # ---- persisting ---------------------------------------------------------------------------

    def on_complete(self, replica: Replica, completed: CompletedFragment) -> None:
        """Take a fragment the spool of `replica` completed, and persist it."""
        completed.retain()
        task = asyncio.ensure_future(self._persist(replica, completed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _persist(self, replica: Replica, completed: CompletedFragment) -> None:
        try:
            if not completed.primary:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.persist_interval):
                        await self._stopping.wait()
            attempt = 0
            while True:
                spec = replica.spec
                if spec is None or not spec.fragment.stores:
                    return  # No stores: the journal works, but never persists (as upstream).
                try:
                    fragment = await asyncio.to_thread(self._persist_blocking, spec, completed)
                except Exception as exc:
                    if self._stopping.is_set():
                        log.error("could not persist %r before stopping: %s", completed, exc)
                        return
                    delay = BACKOFF[min(attempt, len(BACKOFF) - 1)]
                    attempt += 1
                    log.warning(
                        "persisting %r failed (attempt %d, retrying in %.1fs): %s",
                        completed, attempt, delay, exc,
                    )  # fmt: skip
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stopping.wait()
                    continue
                if not replica.stopped:
                    replica.index.add_remote(fragment)
                return
        finally:
            completed.close()

    def _persist_blocking(self, spec: pb.JournalSpec, completed: CompletedFragment) -> pb.Fragment:
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
        if not store.exists(path):
            spool_dir = None if self.spool_dir is None else str(self.spool_dir)
            file, length = completed.compressed(spool_dir)
            file.seek(0)
            encoding = codecs.content_encoding(fragment.compression_codec)
            if store.put(path, file, length, encoding):
                self.persisted += 1
                self.bytes_persisted += length
                log.info("persisted %s to %s (%d bytes)", path, url, length)
        fragment.backing_store = url
        fragment.path_postfix = postfix
        fragment.mod_time = int(self._clock())
        return fragment

    # ---- listing ------------------------------------------------------------------------------

    def list_blocking(self, journal: str, spec: pb.JournalSpec) -> list[pb.Fragment]:
        """Every fragment of `journal` in every store of its spec (blocking)."""
        out: list[pb.Fragment] = []
        for url in spec.fragment.stores:
            out.extend(self.store(url).list_fragments(journal))
        return out

    async def refresh_loop(self, replica: Replica) -> None:
        """The fragment refresh daemon of a replica: list its stores every refresh_interval (or
        sooner when the index asks, after a persist) and replace the index's remote fragments.
        The first listing releases waiting appends."""
        failures = 0
        while not replica.stopped:
            spec = replica.spec
            if spec is None:
                await replica.spec_changed()
                continue
            try:
                listed = await asyncio.to_thread(self.list_blocking, replica.journal, spec)
            except Exception as exc:
                failures += 1
                delay = BACKOFF[min(failures - 1, len(BACKOFF) - 1)]
                replica.index.refresh_error = f"listing fragments: {exc}"
                log.warning("listing fragments of %s failed: %s", replica.journal, exc)
            else:
                failures = 0
                replica.index.refresh_error = ""
                if replica.stopped:
                    return
                replica.index.replace_remote(listed)
                delay = spec.fragment.refresh_interval.seconds or 60
            requested = replica.index.refresh_requested
            if not requested.is_set():
                spec_changed = asyncio.ensure_future(replica.spec_changed())
                refresh = asyncio.ensure_future(requested.wait())
                try:
                    await asyncio.wait(
                        {spec_changed, refresh}, timeout=delay, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    spec_changed.cancel()
                    refresh.cancel()
            requested.clear()

    # ---- lifetime -----------------------------------------------------------------------------

    async def stop(self, timeout: float = FINAL_ATTEMPT_TIMEOUT) -> None:
        """Persist what is still held at once (the last attempt for each), then stop."""
        self._stopping.set()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
