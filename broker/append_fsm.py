"""The append state machine of the seed `gazette-transactional-appends.rst`, one method per state.

Every Append RPC, and every pulse of a primary, runs an `AppendFSM`. States and transitions carry
the seed's names (`state_resolve` is stateResolve, and so on); transitions to `ERROR` on a failed
precondition set `status`, and on a failure of the machinery set `error`.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aetcd import transactions

from allocator import keyspace as aks
from allocator.keyspace import route_equivalent
from broker.fragment import fragments as frag
from broker.group_commit import MAX_OFFSET, Group, Outcome, Refusal
from broker.pipeline import Pipeline
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.resolver import Resolution, ResolveError, desired_replication
from plumbing import etcd as etcdx
from plumbing import metrics
from plumbing.auth import Claims
from plumbing.tasks import Slot, first_of, take_unless, wait_any

if TYPE_CHECKING:
    from broker.context import BrokerContext
    from broker.fragment.index import Index
    from broker.fragment.spool import Spool

log = logging.getLogger(__name__)

# How long an append waits for the first listing of the journal's fragment stores before it
# fails with FRAGMENT_STORE_UNHEALTHY (upstream waits for up to five health checks).
FIRST_REFRESH_TIMEOUT = 10.0
# How long a broker at its graceful exit waits for a journal's content to reach the store.
FLUSH_TIMEOUT = 15.0


class State(enum.Enum):
    RESOLVE = "resolve"
    ACQUIRE_PIPELINE = "acquire_pipeline"
    START_PIPELINE = "start_pipeline"
    SEND_PIPELINE_SYNC = "send_pipeline_sync"
    RECV_PIPELINE_SYNC = "recv_pipeline_sync"
    UPDATE_ASSIGNMENTS = "update_assignments"
    AWAIT_DESIRED_REPLICAS = "await_desired_replicas"
    VALIDATE_PRECONDITIONS = "validate_preconditions"
    UPDATE_SUSPEND = "update_suspend"
    STREAM_CONTENT = "stream_content"  # Semi-terminal: needs client content.
    READ_ACKNOWLEDGEMENTS = "read_acknowledgements"
    ERROR = "error"  # Terminal.
    PROXY = "proxy"  # Terminal.
    FINISHED = "finished"  # Terminal.


class ClientError(Exception):
    """The client's stream failed or violated the protocol: the append rolls back."""


class BrokerExiting(RuntimeError):
    """This broker flushed the journal and suspended it for a restart: it takes no more
    appends to it (the client retries, elsewhere or after the restart)."""


class OffsetOverflow(ClientError):
    """The append would end past the largest journal offset (2^63-1, as upstream's int64)."""


@dataclass
class Chunk:
    """One receive from the client: a request, or None at EOF, or an error."""

    request: pb.AppendRequest | None
    error: BaseException | None = None


Receive = Callable[[], Awaitable[Chunk]]


class AppendFSM:
    def __init__(
        self,
        ctx: BrokerContext,
        request: pb.AppendRequest,
        *,
        flush_and_suspend: bool = False,
        flush_timeout: float | None = None,
        claims: Claims | None = None,
    ) -> None:
        self.ctx = ctx
        self.req = request
        # The client's verified authorization: a journal it does not select is not found.
        self.claims = claims
        # A broker's own run at a graceful exit (not on the wire): roll the spool, wait until
        # everything is persisted (up to `flush_timeout` seconds), then record the journal's
        # end as its suspension offset, persisted or not (see _flush_then_suspend).
        self.flush_and_suspend = flush_and_suspend
        self.flush_timeout = FLUSH_TIMEOUT if flush_timeout is None else flush_timeout
        self._flush_deadline: float | None = None  # Loop time: set as the first wait begins.
        # Of an exit flush that suspended the journal over content its stores did not take in
        # time: the ranges [begin, end) only the exiting replicas held, and the journal's end
        # (its suspension offset).
        self.unpersisted: list[tuple[int, int]] = []
        self.flush_end = 0
        self.state = State.RESOLVE
        self.resolved: Resolution | None = None
        self.pln: Pipeline | None = None
        # The queue `pln` (possibly None) was taken from, while we own it: it goes back there,
        # whatever the resolution says by then (the replica may have been replaced meanwhile).
        self.pln_return: Slot[Pipeline | None] | None = None
        self.pln_header = False  # Whether the next sync must carry the pipeline's header.
        self.read_through_rev = 0
        self.roll_to_offset = 0
        self.registers = pb.LabelSet()
        self.next_suspend: pb.JournalSpec.Suspend | None = None
        self.client_commit = False
        self.client_fragment: pb.Fragment | None = None
        self.client_summer: hashlib._Hash | None = None
        self.total_chunks = 0
        self.delayed_chunks = 0
        self.store_health_error = ""
        self.status: pb.Status = pb.OK
        self.error: BaseException | None = None
        self.proposed_at = 0.0  # When the commit (or roll-back) proposal was sent to peers.
        # Group commit (broker/group_commit.py). `whole`: the append's content, read whole
        # before it waits for the pipeline (set by the Append RPC for a small append it may
        # group). Such an append waits in the replica's `group_commit` for either the pipeline
        # or adoption by the append holding it, and then reads its group's outcome. `group`:
        # the group this append leads, holding the pipeline, which it settles.
        self.whole: bytes | None = None
        # Set when the client left (its RPC was cancelled, or its deadline passed): an append
        # waiting for the pipeline stops waiting, and none is proposed once it is set (as
        # upstream's onAcquirePipeline watches the RPC's context).
        self.client_gone: asyncio.Event | None = None
        self.group: Group | None = None
        self._group_proposed = False  # Whether the group was proposed as a commit.
        # Whether this append counted itself in its replica's `pipeline_uses` (once per append,
        # however many times it takes the pipeline: a pulse that advertises a new route takes
        # it again at the revision it wrote).
        self._counted_use = False

    # ---- driving ----------------------------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        """Run to a terminal state, streaming client content from `receive` on the way."""
        try:
            if not await self.run_to(State.STREAM_CONTENT):
                return
            while self.state == State.STREAM_CONTENT:
                await self.state_stream_content(await receive())
            await self.state_read_acknowledgements()
        except Exception as exc:
            # The machinery failed (a local spool write: ENOSPC, EMFILE; or a bug): peers may
            # hold content or a proposal our own spool did not take.
            log.exception("append to %s failed in state %s", self.req.journal, self.state.value)
            self.tear_down_pipeline()
            self._fail(error=exc)
        except BaseException:
            self.tear_down_pipeline()
            raise
        finally:
            self.return_pipeline()
            if self.group is not None:  # Failed before its acknowledgements were read.
                self.group.settle(self.error or RuntimeError("the group's commit failed"))

    async def run_to(self, target: State) -> bool:
        steps = {
            State.RESOLVE: self.state_resolve,
            State.ACQUIRE_PIPELINE: self.state_acquire_pipeline,
            State.START_PIPELINE: self.state_start_pipeline,
            State.SEND_PIPELINE_SYNC: self.state_send_pipeline_sync,
            State.RECV_PIPELINE_SYNC: self.state_recv_pipeline_sync,
            State.UPDATE_ASSIGNMENTS: self.state_update_assignments,
            State.AWAIT_DESIRED_REPLICAS: self.state_await_desired_replicas,
            State.VALIDATE_PRECONDITIONS: self.state_validate_preconditions,
            State.UPDATE_SUSPEND: self.state_update_suspend,
        }
        while self.state != target:
            step = steps.get(self.state)
            if step is None:
                return False  # ERROR, PROXY, FINISHED (or STREAM_CONTENT when not the target).
            await step()
        return True

    @property
    def owns_pipeline(self) -> bool:
        return self.pln_return is not None

    def tear_down_pipeline(self) -> None:
        """Give up a pipeline we own whose replicas may disagree: it is shut down (the local
        spool rolled back and released; each peer rolls back when its stream ends), and the
        next append builds a new one and synchronizes it, before anything else can use it."""
        if self.pln is not None and self.owns_pipeline:
            self.ctx.tasks.spawn(self.pln.shutdown(expect_err=True), "pipeline teardown")
            self.pln = None

    def return_pipeline(self) -> None:
        if self.pln_return is not None:
            self.pln_return.put_nowait(self.pln)
            self.pln_return = None

    def _fail(self, status: pb.Status = pb.OK, error: BaseException | None = None) -> None:
        if status != pb.OK:
            self.status = status
        if error is not None:
            self.error = error
        self.state = State.ERROR

    @property
    def _res(self) -> Resolution:
        assert self.resolved is not None
        return self.resolved

    @property
    def _spec(self) -> pb.JournalSpec:
        assert self.resolved is not None and self.resolved.spec is not None
        return self.resolved.spec

    @property
    def _pln(self) -> Pipeline:
        assert self.pln is not None
        return self.pln

    async def _take(self, queue: Slot[Any]) -> tuple[bool, Any]:
        """Take from a replica queue unless the resolution is invalidated first."""
        return await take_unless(queue, self._res.invalidated)

    # ---- states -----------------------------------------------------------------------------

    async def state_resolve(self) -> None:
        """Resolve (again) the journal's route, at least through `read_through_rev`."""
        try:
            self.resolved = await self.ctx.resolver.resolve(
                self.req.journal,
                may_proxy=not self.req.do_not_proxy,
                require_primary=True,
                min_etcd_revision=max(self.read_through_rev, self.req.min_etcd_revision),
                proxy_header=self.req.header if self.req.HasField("header") else None,
                claims=self.claims,
            )
        except ResolveError as exc:  # The request's header is not for this broker.
            self.return_pipeline()
            self._fail(error=exc)
            return
        res = self.resolved
        if res.status == pb.SUSPENDED and self.req.suspend == pb.AppendRequest.SUSPEND_RESUME:
            self.next_suspend = pb.JournalSpec.Suspend(
                level=pb.JournalSpec.Suspend.NONE, offset=self._spec.suspend.offset
            )
            self.state = State.UPDATE_SUSPEND
        elif res.status != pb.OK:
            self._fail(res.status)
        elif not res.is_local:
            self.return_pipeline()
            self.state = State.AWAIT_DESIRED_REPLICAS  # We must proxy.
        elif self.owns_pipeline:
            self.state = State.START_PIPELINE
        else:
            self.state = State.ACQUIRE_PIPELINE

    async def state_acquire_pipeline(self) -> None:
        """Take exclusive ownership of the replica's pipeline (send side), unless the client
        leaves first. An append read whole waits for it in the replica's group commit, and the
        append holding the pipeline may adopt it: it then ends as its group answers it."""
        replica = self._res.replica
        assert replica is not None
        gone = () if self.client_gone is None else (self.client_gone.wait(),)
        if self.whole is None:
            take, *_ = await first_of(self._take(replica.pipeline_queue), *gone)
        else:
            ticket = replica.group_commit.join(self.req, self.whole, self._res, self.client_gone)
            try:
                take, *_ = await first_of(self._take(replica.pipeline_queue), ticket.outcome, *gone)
            finally:
                replica.group_commit.leave(ticket)
            if ticket.adopted:
                if take.done() and not take.cancelled() and take.result()[0]:
                    replica.pipeline_queue.put_nowait(take.result()[1])  # Not ours to use.
                self._take_outcome(await ticket.outcome)
                return
        if not take.done() or take.cancelled():
            self._refuse(Refusal.CLIENT_GONE)  # Nothing was sent: nothing to roll back.
            return
        taken, pln = take.result()
        if taken:
            self.pln, self.pln_return = pln, replica.pipeline_queue
        if not taken or self._res.invalidated.is_set():
            self.state = State.RESOLVE
        else:
            self.state = State.START_PIPELINE

    async def state_start_pipeline(self) -> None:
        """Keep a pipeline already at the resolved route, else build one with the spool."""
        res = self._res
        assert res.replica is not None
        if not self._counted_use:
            self._counted_use = True
            res.replica.pipeline_uses += 1  # Tells the pulse loop the pipeline is not idle.
        if (
            self.pln is not None
            and route_equivalent(self.pln.route, res.route)
            and self.pln.send_err() is None
            and self.pln.recv_err() is None  # A peer out of step, or its stream broken.
            and not self.pln.stale()  # Its token near expiry: renewed before a peer ends it.
        ):
            self.registers.CopyFrom(self.pln.spool.registers)
            self.state = State.UPDATE_ASSIGNMENTS
            return
        if self.pln is not None:
            broken = (
                self.pln.send_err() is not None
                or self.pln.recv_err() is not None
                or any(stream is not None and stream.done() for stream in self.pln.streams)
            )
            self.ctx.tasks.spawn(self.pln.shutdown(expect_err=broken), "pipeline teardown")
            self.pln = None
        assert res.replica is not None
        taken, spool = await self._take(res.replica.spool_queue)
        if not taken:
            self.state = State.RESOLVE
            return
        # No await from here on: the spool passes straight into the pipeline we own.
        self.registers.CopyFrom(spool.registers)
        header = pb.Header()
        header.CopyFrom(res.header)
        try:
            self.pln = Pipeline(header, spool, res.replica.spool_queue, self.ctx.dialer)
        except BaseException:
            res.replica.spool_queue.put_nowait(spool)  # Not lost to a failed build.
            raise
        self.pln_header = True
        self.state = State.SEND_PIPELINE_SYNC

    async def state_send_pipeline_sync(self) -> None:
        """Propose the (possibly rolled) current fragment, the route and the registers."""
        pln = self._pln
        proposal = maybe_roll_fragment(pln.spool, self.roll_to_offset, self._spec.fragment)
        req = pb.ReplicateRequest(proposal=proposal, registers=self.registers, acknowledge=True)
        if self.pln_header:
            req.header.CopyFrom(pln.header)
            req.deprecated_journal = pln.spool.fragment.journal
            self.pln_header = False
        await pln.scatter(req)
        self.state = State.RECV_PIPELINE_SYNC

    async def state_recv_pipeline_sync(self) -> None:
        """Read every peer's answer to the sync: agree, roll forward, or re-resolve."""
        pln = self._pln
        # In turn: a pipeline kept from earlier appends may still carry their acknowledgements.
        roll_to, roll_registers, read_through = await pln.read_in_turn(pln.gather_sync)
        self.roll_to_offset, self.read_through_rev = roll_to, read_through
        error = pln.recv_err() or pln.send_err()
        if error is not None:
            self.ctx.tasks.spawn(pln.shutdown(expect_err=True), "pipeline teardown")
            self.pln = None
            self._fail(error=error)
        elif roll_to:
            if roll_registers is not None:
                self.registers.CopyFrom(roll_registers)  # A peer further ahead wins.
            self.state = State.SEND_PIPELINE_SYNC
        elif read_through:
            self.ctx.tasks.spawn(pln.shutdown(expect_err=False), "pipeline teardown")
            self.pln = None
            self.state = State.RESOLVE
        else:
            self.state = State.UPDATE_ASSIGNMENTS

    async def state_update_assignments(self) -> None:
        """Advertise in etcd that the replicas synchronized on this route (consistency)."""
        res = self._res
        if aks.route_matches_assignments(res.route, res.assignments):
            self.state = State.AWAIT_DESIRED_REPLICAS
            return
        try:
            self.read_through_rev = await update_assignments(
                self.ctx.etcd, res.route, res.assignments
            )
        except Exception as exc:
            self._fail(error=RuntimeError(f"updating assignments: {exc}"))
            return
        self.state = State.RESOLVE

    async def state_await_desired_replicas(self) -> None:
        """Wait out an over-subscribed route; refuse an under-replicated one."""
        res = self._res
        have = len(res.route.members)
        want = desired_replication(self._spec, self.ctx.max_replication)
        if self.flush_and_suspend and res.is_local:
            # No content is appended, and replicas are leaving: flush with whoever is left.
            self.state = State.VALIDATE_PRECONDITIONS
        elif have > want:
            self.read_through_rev = res.header.etcd.revision + 1
            self.state = State.RESOLVE
        elif have < want:
            self._fail(pb.INSUFFICIENT_JOURNAL_BROKERS)
        elif not res.is_local:
            self.state = State.PROXY
        else:
            self.state = State.VALIDATE_PRECONDITIONS

    async def state_validate_preconditions(self) -> None:
        """Registers, the append offset, and suspension, against the synchronized spool."""
        res, spec, spool = self._res, self._spec, self._pln.spool
        assert res.replica is not None
        index = res.replica.index
        suspended = spec.suspend.level != pb.JournalSpec.Suspend.NONE
        if self.req.journal in self.ctx.sealed or (
            self.ctx.exiting and suspended and not self.flush_and_suspend
        ):
            # Suspended at its end for the restart by an exiting broker's flush (this one's,
            # which may have let go of the pipeline to an append resolved before it, or
            # another's, before the primary moved here): an append now would land past the
            # suspension offset, in a spool nobody persists again, and be written over after
            # the restart. A broker that is staying resumes it.
            self._fail(
                error=BrokerExiting(
                    f"this broker is exiting and suspended {self.req.journal} for the restart; "
                    "retry the append"
                )
            )
            return
        persister = self.ctx.persister
        if persister is not None and spec.fragment.stores and not self.flush_and_suspend:
            # As upstream: refused while the journal's first store fails its health checks. (An
            # exit flush adds nothing: it waits for the store itself, and suspends an empty one.)
            problem = await persister.health.await_healthy(
                spec.fragment.stores[0], spec.name, res.invalidated
            )
            if res.invalidated.is_set():
                self.state = State.RESOLVE
                return
            if problem:
                self.store_health_error = problem
                self._fail(pb.FRAGMENT_STORE_UNHEALTHY)
                return
        if not index.first_refresh.is_set():
            # Only once the stores were listed is the index's end offset known.
            await wait_any(index.first_refresh, res.invalidated, timeout=FIRST_REFRESH_TIMEOUT)
            if res.invalidated.is_set():
                self.state = State.RESOLVE
                return
            if not index.first_refresh.is_set():
                self.store_health_error = index.refresh_error or "fragment stores not yet listed"
                self._fail(pb.FRAGMENT_STORE_UNHEALTHY)
                return
        index_max = index.end_offset()
        max_offset = max(spool.fragment.end, index_max)
        check = self.req.check_registers if self.req.HasField("check_registers") else None
        if (
            check is not None
            and self.registers.labels
            and not labels.matches(check, self.registers)
        ):
            self._fail(pb.REGISTER_MISMATCH)
            return
        if spool.fragment.end < spec.suspend.offset and (
            suspended or index_max < spec.suspend.offset
        ):
            # The journal was written up to the offset when it was suspended (persisted, or
            # lost with every replica if its stores could not take it: an exit flush records
            # the end either way), so no offset below it is handed out again. Once resumed, the
            # offset is a floor only where the stores end below it: where they reach it, a
            # crash of every replica after the resume must meet INDEX_HAS_GREATER_OFFSET, not
            # a silent roll over lost appends.
            self.roll_to_offset = spec.suspend.offset
            self.state = State.SEND_PIPELINE_SYNC
            return
        if spool.fragment.end != max_offset and self.req.offset == 0 and may_write(spec):
            self._fail(pb.INDEX_HAS_GREATER_OFFSET)
            return
        if self.req.offset != 0 and self.req.offset != max_offset:
            self._fail(pb.WRONG_APPEND_OFFSET)
            return
        if self.req.offset != 0 and spool.fragment.end != max_offset:
            self.roll_to_offset = max_offset  # An explicit offset confirms the larger head.
            self.state = State.SEND_PIPELINE_SYNC
            return
        level = spec.suspend.level
        if (
            self.req.suspend == pb.AppendRequest.SUSPEND_RESUME
            and level != pb.JournalSpec.Suspend.NONE
            and not self.flush_and_suspend  # Settled as it is: it stays suspended.
        ):
            self.next_suspend = pb.JournalSpec.Suspend(
                level=pb.JournalSpec.Suspend.NONE, offset=spool.fragment.end
            )
            self.state = State.UPDATE_SUSPEND
            return
        if (
            self.req.suspend == pb.AppendRequest.SUSPEND_NO_RESUME
            and level != pb.JournalSpec.Suspend.NONE
        ):
            self._fail(pb.SUSPENDED)
            return
        if self.flush_and_suspend:
            await self._flush_then_suspend(index)
            return
        suspending = (pb.AppendRequest.SUSPEND_IF_FLUSHED, pb.AppendRequest.SUSPEND_NOW)
        if self.req.suspend in suspending and self._validate_suspension(index):
            return
        # The spool holding the journal's first write is rolled, so that it is persisted soon
        # and a recovering cluster sees the journal was written (not a new, empty one). (A spool
        # with content is in the index, so the index is not empty here.)
        first = spool.fragment
        if first.begin == index.begin_offset() < first.end:
            self.roll_to_offset = first.end
        self.state = State.STREAM_CONTENT

    def _validate_suspension(self, index: Index) -> bool:
        """SUSPEND_IF_FLUSHED and SUSPEND_NOW, as upstream: a journal whose index is empty is
        suspended FULL (no replicas); one whose fragments are all persisted and older than its
        flush interval (24h if unset) -- or any, with NOW -- is suspended PARTIAL (one replica,
        which keeps serving reads) after its spool is rolled, so what it holds gets persisted.
        Returns whether the state was set here."""
        spec, spool = self._spec, self._pln.spool
        level = spec.suspend.level
        begin, end, mod_time = index.summary()
        flush = spec.fragment.flush_interval.seconds or 24 * 3600
        dirty = mod_time == 0 or mod_time > time.time() - flush
        if level != pb.JournalSpec.Suspend.FULL and begin == end:
            self.next_suspend = pb.JournalSpec.Suspend(
                level=pb.JournalSpec.Suspend.FULL, offset=spool.fragment.end
            )
            self.state = State.UPDATE_SUSPEND
            return True
        if level == pb.JournalSpec.Suspend.NONE and (
            not dirty or self.req.suspend == pb.AppendRequest.SUSPEND_NOW
        ):
            self.next_suspend = pb.JournalSpec.Suspend(
                level=pb.JournalSpec.Suspend.PARTIAL, offset=spool.fragment.end
            )
            self.state = State.UPDATE_SUSPEND
            return True
        if level == pb.JournalSpec.Suspend.PARTIAL:
            if spool.fragment.end > spool.fragment.begin:
                # Roll what the remaining replica holds, so the persister takes it now.
                self.roll_to_offset = spool.fragment.end
                self.state = State.SEND_PIPELINE_SYNC
                return True
            self._fail(pb.SUSPENDED)
            return True
        return False

    async def _flush_then_suspend(self, index: Index) -> None:
        """At a graceful exit, holding the pipeline (so no append slips in): roll the spool,
        wait until the persister has put every fragment up to its end in the store, then
        suspend the journal (PARTIAL) at that end offset. Brokers started later roll to the
        offset and go on, with no reset-head: nothing before it can be missing from the
        store but the journal's holes, ranges no fragment here covers (content lost before,
        or removed from the store): the stores are listed for them once, then the journal is
        suspended over them with a warning, as no wait brings them back.

        If the store does not take what this replica holds within `flush_timeout`, the
        journal is suspended at its end all the same, with `unpersisted` naming what the
        stores lack. Every replica of the journal is exiting (see JournalService.flush_for_exit)
        and its spool goes with its broker: that content is lost unless the persister, which
        keeps trying until the broker stops, gets it in. Recorded, the end keeps the promise
        that can still be kept: a restarted primary rolls to it, so no offset below it is
        written twice, and reads of the lost range meet a hole below the write head (see
        Replica.set_spec) rather than an empty journal. (Recording nothing let the next append
        land at the stores' end again, over offsets already acknowledged.) Ends in SUSPENDED
        when the suspension is recorded."""
        spec, spool = self._spec, self._pln.spool
        end = self.flush_end = spool.fragment.end
        if spool.fragment.end > spool.fragment.begin:
            self.roll_to_offset = end
            self.state = State.SEND_PIPELINE_SYNC
            return
        if end == 0:
            self.ctx.sealed.add(self.req.journal)  # Empty: nothing to flush, nor to take.
            self._fail(pb.SUSPENDED)
            return
        if not spec.fragment.stores:
            self._fail(pb.FRAGMENT_STORE_UNHEALTHY)
            return
        res = self._res
        listed = False  # Whether the stores were listed for ranges the index does not cover.
        try:
            if self._flush_deadline is None:  # Once: a resolve again does not extend it.
                self._flush_deadline = asyncio.get_running_loop().time() + self.flush_timeout
            async with asyncio.timeout_at(self._flush_deadline):
                while not index.persisted_through(end) and not res.invalidated.is_set():
                    if not index.persisted_through(end, over_holes=True):
                        # What this replica holds is on its way to the store.
                        await wait_any(index.changed, res.invalidated)
                    elif not listed:
                        # Only holes are left: ranges no fragment here covers, local or
                        # listed. A listing may find them (persisted by another broker
                        # since the last one); nothing else will, however long we wait.
                        listed = True
                        await first_of(index.listing(FLUSH_TIMEOUT), res.invalidated.wait())
                    else:
                        holes = ", ".join(f"[{b}, {e})" for b, e in index.holes() if b < end)
                        log.warning(
                            "%s: suspending it at %d over %s, which neither its stores nor this "
                            "broker hold: reads from before a hole stop there, as they did",
                            self.req.journal, end, holes,
                        )  # fmt: skip
                        break
        except TimeoutError:
            self.store_health_error = index.refresh_error or f"not persisted through {end}"
            self.unpersisted = unpersisted_ranges(index, end)
        if res.invalidated.is_set():
            self.state = State.RESOLVE  # The route changed meanwhile: decide again.
            return
        if spec.suspend.level != pb.JournalSpec.Suspend.NONE and spec.suspend.offset == end:
            self.ctx.sealed.add(self.req.journal)
            self._fail(pb.SUSPENDED)
            return
        self.next_suspend = pb.JournalSpec.Suspend(level=pb.JournalSpec.Suspend.PARTIAL, offset=end)
        self.state = State.UPDATE_SUSPEND

    async def state_update_suspend(self) -> None:
        """Write the journal's new suspension into its spec, then resolve again."""
        res = self._res
        assert res.item is not None and self.next_suspend is not None
        update = pb.JournalSpec()
        update.CopyFrom(self._spec)
        update.suspend.CopyFrom(self.next_suspend)
        key = res.item.key.encode()
        # Under the route it was decided on: had any assignment changed since, another primary
        # could have appended past the offset.
        unchanged = [transactions.Mod(key) == res.item.mod_revision] + [
            transactions.Mod(kv.key.encode()) == kv.mod_revision for kv in res.assignments
        ]
        result = await etcdx.txn(
            self.ctx.etcd, unchanged, [transactions.Put(key, update.SerializeToString())]
        )
        self.read_through_rev = result.revision
        if not result.succeeded:
            self.state = State.RESOLVE  # The spec changed meanwhile: decide again.
            return
        log.info(
            "journal %s suspension is now %s at offset %d",
            update.name,
            pb.JournalSpec.Suspend.Level.Name(update.suspend.level),
            update.suspend.offset,
        )
        if self.flush_and_suspend:
            self.ctx.sealed.add(self.req.journal)  # Before the pipeline is let go.
            self._fail(pb.SUSPENDED)  # Done: the exiting brokers' allocator need not act.
            return
        self.state = State.RESOLVE

    async def state_stream_content(self, chunk: Chunk) -> None:
        """Forward one client chunk to every replica; on the client's commit (an empty chunk,
        then EOF) propose the extended fragment, on any error propose a rollback."""
        pln, spec = self._pln, self._spec
        if self.whole is not None and self.client_fragment is None and may_write(spec):
            await self._stream_group()
            return
        if self.client_fragment is None:
            proposal = maybe_roll_fragment(pln.spool, self.roll_to_offset, spec.fragment)
            if proposal != pln.spool.fragment:
                await pln.scatter(
                    pb.ReplicateRequest(
                        proposal=proposal, registers=self.registers, acknowledge=False
                    )
                )
            self.client_fragment = pb.Fragment(
                journal=pln.spool.fragment.journal,
                begin=pln.spool.fragment.end,
                end=pln.spool.fragment.end,
                compression_codec=pln.spool.fragment.compression_codec,
            )
            self.client_summer = hashlib.sha1()

        error = chunk.error
        req = chunk.request
        if error is None and req is not None and req.journal:
            error = ClientError("expected a content chunk, not another append request")
        if error is None and req is None and not self.client_commit:
            error = ClientError(
                "append stream ended without a commit (an empty chunk); rolled back"
            )
        elif error is None and req is not None and self.client_commit:
            error = ClientError("expected EOF after the empty commit chunk")
        elif error is None and req is not None and not req.content:
            self.client_commit = True
            return
        elif (error is None and req is not None and not may_write(spec)) or (
            error is None
            and req is not None
            and self.req.suspend
            in (
                pb.AppendRequest.SUSPEND_IF_FLUSHED,
                pb.AppendRequest.SUSPEND_NOW,
                pb.AppendRequest.SUSPEND_KEEP,
            )
        ):
            self.status = pb.NOT_ALLOWED
        elif (
            error is None
            and req is not None
            and self.client_fragment.end + len(req.content) > MAX_OFFSET
        ):
            error = OffsetOverflow(
                f"append to {self.req.journal} would end past the largest offset ({MAX_OFFSET}); "
                "rolled back"
            )
        elif error is None and req is not None:
            self.total_chunks += 1
            content = req.content
            replica = self._res.replica
            assert replica is not None
            replica.append_limiter.set_rate(spec.max_append_rate)
            delayed = await replica.append_limiter.take(len(content))
            delayed = await self.ctx.append_limiter.take(len(content)) or delayed
            self.delayed_chunks += int(delayed)
            await pln.scatter_content(
                content, self.client_fragment.end - self.client_fragment.begin
            )
            assert self.client_summer is not None
            self.client_summer.update(content)
            self.client_fragment.end += len(content)
            if pln.send_err() is None:
                return

        # Here: EOF after a commit (req is None, no error), a client error, or a refusal.
        assert self.client_summer is not None
        length = self.client_fragment.end - self.client_fragment.begin
        self.client_fragment.sum.CopyFrom(
            frag.sum_from_digest(self.client_summer.digest()) if length else pb.SHA1Sum()
        )
        if (
            error is None
            and req is None
            and length == 0
            and (self.req.HasField("union_registers") or self.req.HasField("subtract_registers"))
        ):
            error = ClientError("register updates need a non-empty append")

        if error is None and req is None and pln.send_err() is None and self.status == pb.OK:
            proposal = pln.spool.next_proposal()
            if self.req.HasField("subtract_registers"):
                self.registers = labels.subtract(self.registers, self.req.subtract_registers)
            if self.req.HasField("union_registers"):
                self.registers = labels.union(self.req.union_registers, self.registers)
        else:
            proposal = pb.Fragment()
            proposal.CopyFrom(pln.spool.fragment)  # Roll back.
            if error is not None:
                self.error = error
        self.proposed_at = time.monotonic()
        await pln.scatter(
            pb.ReplicateRequest(proposal=proposal, registers=self.registers, acknowledge=True)
        )
        self.state = State.READ_ACKNOWLEDGEMENTS

    async def _stream_group(self) -> None:
        """STREAM_CONTENT of an append read whole: it leads a group (broker/group_commit.py)
        of the appends read whole that wait for this pipeline, and sends their content with its
        own, then one commit proposal. Each append of the group is checked as it would be alone
        and gets its own span; one refused is left out with its own answer. Every append of the
        group commits, or none does (`state_read_acknowledgements` settles the group)."""
        pln, spec, res = self._pln, self._spec, self._res
        replica = res.replica
        assert replica is not None and self.whole is not None
        proposal = maybe_roll_fragment(pln.spool, self.roll_to_offset, spec.fragment)
        if proposal != pln.spool.fragment:
            await pln.scatter(
                pb.ReplicateRequest(proposal=proposal, registers=self.registers, acknowledge=False)
            )
        # From here the group answers every append it adopted, however this one ends (`run`).
        group = self.group = replica.group_commit.adopt(self.req, self.whole, res, self.client_gone)
        replica.append_limiter.set_rate(spec.max_append_rate)
        delayed = await replica.append_limiter.take(group.size)
        delayed = await self.ctx.append_limiter.take(group.size) or delayed
        self.delayed_chunks += int(delayed)
        # After the limit's wait: an append whose client left meanwhile is not proposed.
        content = group.plan(pln.spool.fragment, self.registers)
        self.client_commit = True
        if group.holder.refusal is not None:
            self._refuse(group.holder.refusal)  # Kept for after the group's round.
        else:
            self.client_fragment = group.holder.span
            self.total_chunks = 1
        if content:
            await pln.scatter_content(content, 0)
        committing = pln.send_err() is None and bool(content)
        if committing:
            proposal = pln.spool.next_proposal()
            self.registers = group.registers
        else:
            proposal = pb.Fragment()
            proposal.CopyFrom(pln.spool.fragment)  # Roll back.
        self.proposed_at = time.monotonic()
        await pln.scatter(
            pb.ReplicateRequest(proposal=proposal, registers=self.registers, acknowledge=True)
        )
        self._group_proposed = committing
        self.state = State.READ_ACKNOWLEDGEMENTS

    def _refuse(self, refusal: Refusal) -> None:
        """The append is refused before anything of it was proposed."""
        if refusal is Refusal.REGISTER_MISMATCH:
            self._fail(pb.REGISTER_MISMATCH)
        elif refusal is Refusal.OFFSET_OVERFLOW:
            self._fail(
                error=OffsetOverflow(
                    f"append to {self.req.journal} would end past the largest offset "
                    f"({MAX_OFFSET}); rolled back"
                )
            )
        else:
            self._fail(error=ClientError("client went away; rolled back"))

    def _take_outcome(self, outcome: Outcome) -> None:
        """An adopted append ends as its group answered it."""
        self.resolved = outcome.resolution
        self.registers.CopyFrom(outcome.registers)
        if outcome.span is not None:
            self.client_fragment = outcome.span
            self.total_chunks = 1
            self.state = State.FINISHED
        elif outcome.refusal is not None:
            self._refuse(outcome.refusal)
        else:
            self._fail(error=outcome.failure)

    async def state_read_acknowledgements(self) -> None:
        """Release the send side, then, in turn, read every peer's acknowledgement."""
        pln = self._pln
        send_err = pln.send_err()
        assert self.pln_return is not None
        if send_err is None:
            self.pln_return.put_nowait(pln)  # The next append may send already.
        else:
            await pln.close_send()
            self.pln_return.put_nowait(None)  # A new pipeline must be built.
        self.pln_return = None

        async def read() -> None:
            await pln.gather_ok()
            if send_err is not None:
                await pln.gather_eof()

        await pln.read_in_turn(read)
        failed = pln.recv_err() or send_err
        if self.group is not None:
            committed = self._group_proposed and failed is None
            self.group.settle(
                None if committed else failed or RuntimeError("the group's commit was rolled back")
            )
        if self.error is not None or self.status != pb.OK:
            self.state = State.ERROR
        elif failed is not None:
            self._fail(error=failed)
        else:
            self.state = State.FINISHED
            metrics.replication_seconds.observe(time.monotonic() - self.proposed_at)


# ---- helpers ------------------------------------------------------------------------------


def unpersisted_ranges(index: Index, end: int) -> list[tuple[int, int]]:
    """The ranges [begin, end) below `end` that the index holds only locally (no store has
    them), merged where they meet."""
    out: list[tuple[int, int]] = []
    for entry in index.fragments():
        if entry.begin >= end:
            break
        if entry.backing_store:
            continue
        stop = min(entry.end, end)
        if out and entry.begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((entry.begin, stop))
    return out


def may_write(spec: pb.JournalSpec) -> bool:
    # NOT_SPECIFIED (0) means read-write.
    return spec.flags == 0 or bool(spec.flags & (pb.JournalSpec.O_WRONLY | pb.JournalSpec.O_RDWR))


def maybe_roll_fragment(
    spool: Spool,
    roll_to_offset: int,
    spec: pb.JournalSpec.Fragment,
    now: datetime | None = None,
) -> pb.Fragment:
    """The proposal to sync on: the spool's fragment, or a new empty one if it should roll.

    It rolls when it is empty, over the spec's target length, written with another codec than
    the spec's, in an earlier `flush_interval` bucket of UTC time than `now` (buckets are
    uniform from the Unix epoch, as upstream), or when a larger offset must be adopted. Rolls
    happen between appends, so a fragment never splits one."""
    current = spool.fragment
    length = current.end - current.begin
    codec = spec.compression_codec or pb.NONE
    flush = spec.flush_interval.seconds
    first = spool.first_append_time
    roll = (
        length == 0
        or length > spec.length
        or current.compression_codec != codec
        or (roll_to_offset != 0 and roll_to_offset != current.begin)
        or (
            flush > 0
            and first is not None
            and int(first.timestamp()) // flush
            != int((now or datetime.now(UTC)).timestamp()) // flush
        )
    )
    out = pb.Fragment()
    out.CopyFrom(current)
    if not roll:
        return out
    if roll_to_offset:
        if current.end > roll_to_offset:
            raise AssertionError(
                f"roll to {roll_to_offset} is behind the spool's end {current.end}"
            )
        out.end = roll_to_offset
    out.begin = out.end
    out.ClearField("sum")
    out.compression_codec = codec
    return out


def route_value(route: pb.Route) -> pb.Route:
    """The route as stored in assignment values: members and primary, no endpoints."""
    return pb.Route(members=route.members, primary=route.primary)


async def update_assignments(etcd: object, route: pb.Route, assignments: tuple[object, ...]) -> int:
    """Write `route` into every assignment whose value differs, keeping each key's lease and
    guarding on every assignment's mod revision. Returns the etcd revision, or 0 if no-op."""
    value = route_value(route).SerializeToString()
    compare, ops = [], []
    for kv in assignments:
        key = kv.key.encode()  # type: ignore[attr-defined]
        if not aks.assignment_holds(kv.decoded, route):  # type: ignore[attr-defined]
            ops.append(etcdx.put_keeping_lease(key, value))
        compare.append(transactions.Mod(key) == kv.mod_revision)  # type: ignore[attr-defined]
    if not ops:
        return 0
    result = await etcdx.txn(etcd, compare, ops)
    return result.revision
