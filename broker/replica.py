"""A journal replica on this broker: its spool, its replication pipeline and its index.

Ownership follows the seed: exactly one RPC owns the spool at a time, and exactly one append
owns the pipeline's send side; each sits in a one-slot queue, taken to own and put back to
release. The primary's replica also runs the pulse daemon.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from broker.flow_control import RateLimiter
from broker.fragment.index import Index
from broker.fragment.spool import CompletedFragment, Spool
from broker.group_commit import GroupCommit
from broker.pipeline import describe
from broker.protocol import protocol_pb2 as pb
from keyspace import KeyValue
from plumbing.backoff import Backoff
from plumbing.tasks import Event, Slot, TaskOwner, take_unless, wait_any

if TYPE_CHECKING:
    from broker.fragment.persister import Persister
    from broker.pipeline import Pipeline

log = logging.getLogger(__name__)

# The pulse re-synchronizes the pipeline at least this often, as upstream's health check. Each
# wait between pulses is drawn from [PULSE_JITTER, 1] times the interval, so that the pulses of
# journals placed together (a broker's start, an Apply of many) spread over the interval rather
# than firing together each time.
PULSE_INTERVAL = 60.0
PULSE_JITTER = 0.5
_JITTER = random.Random()  # Its own: the global state is the application's (and Hypothesis's).
PULSE_STOP_TIMEOUT = 10.0
# A primary whose pipeline no append has taken for this long releases it after a pulse (its
# Replicate streams, and the peers' handlers of them): the next append or pulse builds and
# synchronizes a new one, as after a route change. 0 keeps pipelines until the route changes.
IDLE_PIPELINE_RELEASE = 30.0


class Replica:
    def __init__(
        self,
        journal: str,
        spool_dir: Path,
        pulse: Callable[[Replica], Awaitable[None]] | None = None,
        pulse_interval: float = PULSE_INTERVAL,
        persister: Persister | None = None,
        idle_pipeline_release: float = IDLE_PIPELINE_RELEASE,
    ) -> None:
        self.journal = journal
        self.spool_dir = spool_dir
        self.index = Index(journal)
        self.spec: pb.JournalSpec | None = None
        self._spec_changed = Event()
        self.persister = persister
        self.spool_queue: Slot[Spool] = Slot()
        observer = _IndexObserver(self)
        spool = Spool(journal, observer=observer, directory=spool_dir)
        observer.spool = spool
        self.spool_queue.put_nowait(spool)
        # The refresh daemon and the pulse loop: started by `start` and `on_route_change`,
        # stopped by `shutdown`.
        self.tasks = TaskOwner(f"replica of {journal}")
        self._refresh_task: asyncio.Task[None] | None = None
        self.pipeline_queue: Slot[Pipeline | None] = Slot()
        # Appends received whole, waiting for the pipeline in arrival order: the append holding
        # it commits them with its own, in one replication round (group commit).
        self.group_commit = GroupCommit()
        self.pipeline_queue.put_nowait(None)
        self.append_limiter = RateLimiter(0)  # The spec's max_append_rate (0: unlimited).
        self.primary = False
        self.create_revision = 0
        self.assignments: tuple[KeyValue, ...] = ()
        self.invalidated = Event()
        self._pulse = pulse
        self._pulse_interval = pulse_interval
        # Pulses in a row, up to the one about to run, that found the route (the assignments
        # and their revisions) as the previous pulse left it: auto-suspension waits for these.
        self.stable_pulses = 0
        self._pulse_task: asyncio.Task[None] | None = None
        self._pulse_now = Event()
        self._idle_pipeline_release = idle_pipeline_release
        # Appends and pulses that took the pipeline (counted by the append FSM): the pulse
        # loop tells from it whether anything but its own pulses used the pipeline.
        self.pipeline_uses = 0
        self.pipelines_released = 0
        self.stopped = False
        # While the broker cannot show that its etcd lease is alive (see `fence`): the token of
        # the current fence, and whether the fence holds the pipeline slot (its pipeline torn
        # down) rather than the queue.
        self._fence: object | None = None
        self._fence_holds = False
        self._stopping = Event()  # Set when `shutdown` begins.

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
            # A suspension's offset (kept once resumed) is where the journal was written up to
            # when it was suspended: its write head is never below it, even where no fragment
            # reaches it (an exit flush whose store failed records it over the lost content).
            self.index.raise_head_floor(spec.suspend.offset)
            self._spec_changed.set()
            self._spec_changed = Event()

    @property
    def spec_changed_event(self) -> asyncio.Event:
        """Set at the next change of the spec (or when the replica stops)."""
        return self._spec_changed

    def signal(self) -> None:
        """Invalidate resolutions of this journal: its assignments changed."""
        self.invalidated.set()
        self.invalidated = Event()

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
        last_route: list[tuple[str, int]] | None = None
        loop = asyncio.get_running_loop()
        # When the pipeline was last taken by anything but a pulse (as far as pulses can tell:
        # uses between two pulses are dated at the second), and the count after the last pulse.
        # A new primary's pipeline has served no append: its first pulse releases it unless an
        # append takes it meanwhile. (A placement or a member's loss makes thousands of
        # primaries at once; keeping each one's streams open until a second pulse held them all
        # open together, and the memory they left freed but fragmented stayed with the broker.)
        quiet_since = loop.time() - self._idle_pipeline_release
        uses_after_pulse = self.pipeline_uses
        try:
            while self.primary and not self.stopped:
                delay = self._pulse_interval * _JITTER.uniform(PULSE_JITTER, 1.0)
                await wait_any(self._pulse_now, timeout=delay)
                self._pulse_now.clear()
                if not self.primary or self.stopped:
                    return
                route = [(kv.key, kv.mod_revision) for kv in self.assignments]
                self.stable_pulses = self.stable_pulses + 1 if route == last_route else 0
                uses_before = self.pipeline_uses
                if uses_before != uses_after_pulse:
                    quiet_since = loop.time()  # An append took the pipeline since.
                try:
                    await self._pulse(self)
                    # The route as this pulse left it (its assignments' values may be updated).
                    last_route = [(kv.key, kv.mod_revision) for kv in self.assignments]
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    last_route = None
                    delay = backoff.next_delay()
                    log.warning(
                        "pulse of %s failed (retrying in %.2fs): %s",
                        self.journal,
                        delay,
                        describe(exc),
                    )
                    await asyncio.sleep(delay)
                    self._pulse_now.set()
                else:
                    backoff.reset()
                    if self.pipeline_uses - uses_before > 1:
                        quiet_since = loop.time()  # An append ran beside the pulse.
                    elif (
                        self._idle_pipeline_release > 0
                        and loop.time() - quiet_since >= self._idle_pipeline_release
                    ):
                        await self._release_idle_pipeline()
                uses_after_pulse = self.pipeline_uses
        finally:
            if self._pulse_task is asyncio.current_task():
                self._pulse_task = None

    async def _release_idle_pipeline(self) -> None:
        """Tear down the pipeline of a primary no append has used for a while (its Replicate
        streams are the bulk of an idle replica's memory, here and on each peer): the next
        append or pulse builds a new one, synchronized before any content, as after a route
        change. Skipped if an append holds the pipeline now. As a demotion's teardown, the spool
        goes back to its queue at once (nothing uncommitted is pending: an append returns the
        pipeline only after its commit or rollback went out), and acknowledgements still on
        their way are read first, in turn."""
        try:
            pipeline = self.pipeline_queue.get_nowait()
        except asyncio.QueueEmpty:
            return  # Taken by an append (or held by a fence).
        try:
            if pipeline is not None:
                self.pipelines_released += 1
                await pipeline.shutdown(expect_err=False)
        finally:
            self.pipeline_queue.put_nowait(None)

    # ---- fencing ------------------------------------------------------------------------------

    @property
    def fenced(self) -> bool:
        return self._fence is not None

    def fence(self) -> None:
        """Take no more appends (and pulses) until `unfence`: the broker can no longer show that
        its etcd lease is alive, so another broker may soon lead this journal (see
        `Broker._on_fence`). The pipeline slot is taken from appends: at once if it is
        free, else as soon as the append that owns it returns it; the pipeline is torn down,
        which releases this replica's peers to whichever primary comes next. Appends wait for
        the slot meanwhile. Serving Replicate streams and reads goes on."""
        if self._fence is not None or self.stopped:
            return
        token = self._fence = object()
        try:
            pipeline = self.pipeline_queue.get_nowait()
        except asyncio.QueueEmpty:
            self.tasks.spawn(self._fence_when_free(token), "fence")
            return
        self._fence_holds = True
        if pipeline is not None:
            self.tasks.spawn(_tear_down(pipeline), "fence: pipeline teardown")

    def unfence(self) -> None:
        """Take appends again (the lease was refreshed)."""
        if self._fence is None:
            return
        self._fence = None
        if self._fence_holds:
            self._fence_holds = False
            self.pipeline_queue.put_nowait(None)

    async def _fence_when_free(self, token: object) -> None:
        pipeline = await self.pipeline_queue.get()
        if self._fence is not token or self._fence_holds:
            self.pipeline_queue.put_nowait(pipeline)  # Lifted meanwhile.
            return
        self._fence_holds = True
        if pipeline is not None:
            await _tear_down(pipeline)

    # ---- lifetime -----------------------------------------------------------------------------

    async def demote(self) -> None:
        """No longer the primary: stop pulsing and tear down the pipeline, which releases the
        spool for the new primary's Replicate stream. The spool and the index stay: this
        replica's content remains readable here."""
        self.primary = False
        self._pulse_now.set()
        if self._pulse_task is not None:
            await asyncio.wait({self._pulse_task}, timeout=PULSE_STOP_TIMEOUT)
        if self._fence_holds:
            return  # The fence tore the pipeline down already.
        # A shutdown meanwhile takes the slot from the fence directly: stop waiting then.
        taken, pipeline = await take_unless(self.pipeline_queue, self._stopping)
        if not taken:
            return
        try:
            if pipeline is not None:
                await pipeline.shutdown(expect_err=False)
        finally:
            self.pipeline_queue.put_nowait(None)

    async def shutdown(self) -> None:
        """Stop the pulse and the refresh daemon, tear down the pipeline, complete the open
        fragment and hand it to the persister, and release the spool's files (completed
        fragments still being persisted stay with the persister).

        Completing the open fragment is what upstream's shutDownReplica does: the spool's
        committed content may exist nowhere else once this replica is gone (every replica of
        the journal may be going at once: a lapsed lease, a stop of every broker). Persisting it
        is idempotent: committed bytes are the same on every replica that holds them, a store
        never overwrites a path, and the index covers overlapping fragments. The persist itself
        is the persister's (at a broker's exit, bounded by `Persister.stop`)."""
        self.stopped = True
        self._stopping.set()
        self._spec_changed.set()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        # Let a pulse in flight finish (it is bounded), then the loop sees `stopped`. A fenced
        # replica's pulse waits for the pipeline the fence holds: it is cancelled at once.
        fenced, self._fence = self._fence is not None, None
        self._pulse_now.set()
        await self.tasks.close(grace=0.0 if fenced else PULSE_STOP_TIMEOUT)
        if self._fence_holds:
            self._fence_holds = False  # Its pipeline was torn down: the slot passes to us.
        else:
            pipeline = await self.pipeline_queue.get()
            if pipeline is not None:
                await pipeline.shutdown(expect_err=False)
        spool = await self.spool_queue.get()
        self._complete_open_fragment(spool)
        spool.close()
        self.index.close()

    def _complete_open_fragment(self, spool: Spool) -> None:
        """Roll the spool to an empty fragment at its end, as a primary's sync would: its
        committed content becomes a completed fragment, which the observer hands to the index
        and the persister (at once if this replica is the primary, else after the persist
        interval, or at once when the broker is stopping). Uncommitted content was rolled back
        by whoever released the spool."""
        fragment = spool.fragment
        if fragment.end == fragment.begin:
            return
        proposal = pb.Fragment(
            journal=fragment.journal,
            begin=fragment.end,
            end=fragment.end,
            compression_codec=fragment.compression_codec,
        )
        try:
            spool.apply(
                pb.ReplicateRequest(proposal=proposal, registers=spool.registers),
                primary=self.primary,
            )
        except Exception as exc:
            log.error(
                "could not complete the open fragment of %s [%d, %d) at its shutdown: %r",
                self.journal, fragment.begin, fragment.end, exc,
            )  # fmt: skip


async def _tear_down(pipeline: Pipeline) -> None:
    try:
        await pipeline.shutdown(expect_err=False)
    except Exception as exc:
        log.warning("tearing down a fenced pipeline failed: %s", describe(exc))


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
