"""A journal replica on this broker: its spool, its replication pipeline and its index.

Ownership follows the seed: exactly one RPC owns the spool at a time, and exactly one append
owns the pipeline's send side; each sits in a one-slot queue, taken to own and put back to
release. The primary's replica also runs the pulse daemon.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from broker.flow_control import RateLimiter
from broker.fragment.index import Index
from broker.fragment.spool import CompletedFragment, Spool
from broker.keyspace import KeyValue
from broker.protocol import protocol_pb2 as pb
from broker.retry import Backoff
from broker.tasks import TaskOwner, wait_any

if TYPE_CHECKING:
    from broker.fragment.persister import Persister
    from broker.pipeline import Pipeline

log = logging.getLogger(__name__)

# The pulse re-synchronizes the pipeline at least this often, as upstream's health check.
PULSE_INTERVAL = 60.0
PULSE_STOP_TIMEOUT = 10.0


class Replica:
    def __init__(
        self,
        journal: str,
        spool_dir: Path,
        pulse: Callable[[Replica], Awaitable[None]] | None = None,
        persister: Persister | None = None,
    ) -> None:
        self.journal = journal
        self.spool_dir = spool_dir
        self.index = Index(journal)
        self.spec: pb.JournalSpec | None = None
        self._spec_changed = asyncio.Event()
        self.persister = persister
        self.spool_queue: asyncio.Queue[Spool] = asyncio.Queue(maxsize=1)
        observer = _IndexObserver(self)
        spool = Spool(journal, observer=observer, directory=spool_dir)
        observer.spool = spool
        self.spool_queue.put_nowait(spool)
        # The refresh daemon and the pulse loop: started by `start` and `on_route_change`,
        # stopped by `shutdown`.
        self.tasks = TaskOwner(f"replica of {journal}")
        self._refresh_task: asyncio.Task[None] | None = None
        self.pipeline_queue: asyncio.Queue[Pipeline | None] = asyncio.Queue(maxsize=1)
        self.pipeline_queue.put_nowait(None)
        self.append_limiter = RateLimiter(0)  # The spec's max_append_rate (0: unlimited).
        self.primary = False
        self.create_revision = 0
        self.assignments: tuple[KeyValue, ...] = ()
        self.invalidated = asyncio.Event()
        self._pulse = pulse
        self._pulse_task: asyncio.Task[None] | None = None
        self._pulse_now = asyncio.Event()
        self.stopped = False

    def start(self) -> None:
        """Start the fragment refresh daemon (listing the journal's stores)."""
        if self.persister is not None:
            self._refresh_task = self.tasks.spawn(self.persister.refresh_loop(self), "refresh")
        else:
            self.index.first_refresh.set()  # No stores to list.

    def set_spec(self, spec: pb.JournalSpec) -> None:
        """The journal's current specification (the fragment refresh daemon and the persister
        read its stores and intervals)."""
        if self.spec is None or self.spec != spec:
            self.spec = spec
            self._spec_changed.set()
            self._spec_changed = asyncio.Event()

    @property
    def spec_changed_event(self) -> asyncio.Event:
        """Set at the next change of the spec (or when the replica stops)."""
        return self._spec_changed

    def signal(self) -> None:
        """Invalidate resolutions of this journal: its assignments changed."""
        self.invalidated.set()
        self.invalidated = asyncio.Event()

    def on_route_change(self) -> None:
        if not self.primary or self._pulse is None or self.stopped:
            return
        if self._pulse_task is None:
            self._pulse_task = self.tasks.spawn(self._pulse_loop(), "pulse")
        self._pulse_now.set()

    async def _pulse_loop(self) -> None:
        assert self._pulse is not None
        # A failed pulse is retried soon: the route may still be settling.
        backoff = Backoff(initial=0.25, maximum=5.0)
        try:
            while self.primary and not self.stopped:
                await wait_any(self._pulse_now, timeout=PULSE_INTERVAL)
                self._pulse_now.clear()
                if not self.primary or self.stopped:
                    return
                try:
                    await self._pulse(self)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    delay = backoff.next_delay()
                    log.warning(
                        "pulse of %s failed (retrying in %.2fs): %r", self.journal, delay, exc
                    )
                    await asyncio.sleep(delay)
                    self._pulse_now.set()
                else:
                    backoff.reset()
        finally:
            if self._pulse_task is asyncio.current_task():
                self._pulse_task = None

    async def demote(self) -> None:
        """No longer the primary: stop pulsing and tear down the pipeline, which releases the
        spool for the new primary's Replicate stream. The spool and the index stay: this
        replica's content remains readable here."""
        self.primary = False
        self._pulse_now.set()
        if self._pulse_task is not None:
            await asyncio.wait({self._pulse_task}, timeout=PULSE_STOP_TIMEOUT)
        pipeline = await self.pipeline_queue.get()
        try:
            if pipeline is not None:
                await pipeline.shutdown(expect_err=False)
        finally:
            self.pipeline_queue.put_nowait(None)

    async def shutdown(self) -> None:
        """Stop the pulse and the refresh daemon, tear down the pipeline, and release the
        spool's files (completed fragments still being persisted stay with the persister)."""
        self.stopped = True
        self._spec_changed.set()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        # Let a pulse in flight finish (it is bounded), then the loop sees `stopped`.
        self._pulse_now.set()
        await self.tasks.close(grace=PULSE_STOP_TIMEOUT)
        pipeline = await self.pipeline_queue.get()
        if pipeline is not None:
            await pipeline.shutdown(expect_err=False)
        spool = await self.spool_queue.get()
        spool.close()
        self.index.close()


class _IndexObserver:
    """Feeds spool commits and completions to the index readers query, and completed fragments
    to the persister."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.spool: Spool | None = None

    def on_commit(self, fragment: pb.Fragment) -> None:
        assert self.spool is not None
        self.replica.index.on_commit(fragment, self.spool)

    def on_complete(self, completed: CompletedFragment) -> None:
        self.replica.index.on_complete(completed.fragment, completed)
        if self.replica.persister is not None:
            self.replica.persister.on_complete(self.replica, completed)
