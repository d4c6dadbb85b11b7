"""The broker's Journal gRPC service: List and Apply over the etcd keyspace; Append, Replicate,
Read and ListFragments over the local replicas (see append_api, replicate_api, read_api,
fragments_api); FragmentStoreHealth over the fragment stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import transactions

from allocator import keyspace as aks
from broker.append_api import AppendFailed, serve_append
from broker.append_fsm import FLUSH_TIMEOUT, AppendFSM, BrokerExiting, Chunk
from broker.client.dialer import Dialer
from broker.client.journals import PLACEMENT
from broker.context import BrokerContext
from broker.flow_control import RateLimiter
from broker.fragment.persister import (
    FINAL_ATTEMPT_TIMEOUT,
    UNCLAIMED_CHECK_TIMEOUT,
    Persister,
    check_spec_supported,
)
from broker.fragment.stores import StoreError
from broker.fragment.stores.paths import (
    FragmentPath,
    PathError,
    PathIndex,
    PathIndexCache,
    StoreGuard,
    canonical_spec_stores,
    canonical_store_url,
    chosen_origin,
    fragment_path,
    lock_of,
    overlap,
)
from broker.fragments_api import serve_list_fragments, serve_store_health
from broker.protocol import labels, validate, wire
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.read_api import serve_read
from broker.replica import IDLE_PIPELINE_RELEASE, PULSE_INTERVAL, Replica
from broker.replicate_api import serve_replicate
from broker.resolver import Resolver
from keyspace import KeySpace, KeyValue
from plumbing import auth, logs, metrics
from plumbing import etcd as etcdx
from plumbing.backoff import Backoff
from plumbing.tasks import wait_any

log = logging.getLogger(__name__)

# How long a hole in a journal's offsets lasts before its primary warns of it (see
# JournalService._report_holes): longer than a persist usually takes.
HOLE_GRACE = 120.0
# What an exit flush leaves, of its bound, to record a journal's suspension in etcd after its
# wait for the store ends (a resolve and a transaction).
SUSPEND_MARGIN = 3.0
# Upstream's: auto-suspension waits for this many pulses on an unchanged route.
AUTO_SUSPEND_STABLE_PULSES = 15
# Pulses of one broker in flight at once. A placement or a member's loss changes the routes of
# thousands of journals together, and each primary pulses at its route change: unbounded, those
# pulses (each building a pipeline, two streams and the peers' handlers of them) were all ready
# together and held the event loop past the etcd lease's TTL. Bounded, they run in turn.
PULSES_IN_FLIGHT = 32

Context = grpc.aio.ServicerContext[Any, Any]

# Keeps each ListResponse within gRPC's 32 KiB buffer tier for typical specs (as upstream).
MAX_JOURNALS_PER_LIST_RESPONSE = 25


class JournalService(pb_grpc.JournalServicer):
    def __init__(
        self,
        ks: KeySpace,
        client: aetcd.Client,
        root: str,
        process_id: pb.ProcessSpec.ID,
        *,
        dialer: Dialer | None = None,
        spool_dir: Path | None = None,
        min_append_rate: int = 0,
        max_append_rate: int = 0,
        max_replication: int = 9,
        auto_suspend: bool = False,
        pulse_interval: float = PULSE_INTERVAL,
        idle_pipeline_release: float = IDLE_PIPELINE_RELEASE,
        persister: Persister | None = None,
        verifier: auth.Verifier | None = None,
    ) -> None:
        self.ks = ks
        # Verifies each request's authorization (upstream's capability per RPC); a journal its
        # claims do not select does not exist for that caller.
        self.verifier: auth.Verifier = verifier or auth.NoopVerifier()
        self.etcd = client
        self.root = root
        self.process_id = process_id
        self.dialer = dialer or Dialer()
        self.spool_dir = spool_dir or Path(tempfile.gettempdir())
        self.min_append_rate = min_append_rate
        self.auto_suspend = auto_suspend
        self.pulse_interval = pulse_interval
        self.idle_pipeline_release = idle_pipeline_release
        self.persister = persister
        # Every journal's fragment path, for Apply's check that none is another's, and for the
        # persister's, which keeps to each journal's own path at runtime.
        self.paths = PathIndexCache(self._journals, lambda: self.ks.revision)
        items = self.root + aks.ITEMS
        self.ks.add_observer(
            lambda update: (
                self.paths.invalidate()
                if update.reload or any(c.key.startswith(items) for c in update.changes)
                else None
            )
        )
        if persister is not None and persister.paths is None:
            persister.paths = self.paths
        self._pulse_slots = asyncio.Semaphore(PULSES_IN_FLIGHT)
        # Holes in journals this broker leads: when each was first seen (None once reported).
        self._holes: dict[str, dict[tuple[int, int], float | None]] = {}
        self.resolver = Resolver(
            ks, root, process_id, self.new_replica, max_replication=max_replication
        )
        # What the handlers and the append FSM use (they never see the service itself).
        self.ctx = BrokerContext(
            resolver=self.resolver,
            etcd=client,
            dialer=self.dialer,
            process_id=process_id,
            persister=persister,
            min_append_rate=min_append_rate,
            append_limiter=RateLimiter(max_append_rate),  # Across all of this broker's journals.
            max_replication=max_replication,
        )

    def new_replica(self, journal: str) -> Replica:
        return Replica(
            journal,
            self.spool_dir,
            pulse=self.pulse,
            pulse_interval=self.pulse_interval,
            persister=self.persister,
            idle_pipeline_release=self.idle_pipeline_release,
        )

    async def stop(self, persist_timeout: float = FINAL_ATTEMPT_TIMEOUT) -> None:
        """Stop serving local replicas, let the handlers' background work (pipeline teardowns,
        which are bounded) finish, then stop the persister (its last attempts at what the
        spools held last up to `persist_timeout` seconds) and close the peers' channels."""
        await self.resolver.stop_serving()
        await self.ctx.tasks.join()
        await self.ctx.tasks.close()
        if self.persister is not None:
            await self.persister.stop(persist_timeout)
        await self.dialer.close()

    async def pulse(self, replica: Replica) -> None:
        """A zero-byte append by the primary: synchronizes the pipeline and, through
        state_update_assignments, advertises the route the replicas agreed on. With
        auto-suspend, once the route has held for AUTO_SUSPEND_STABLE_PULSES pulses, the pulse
        asks to suspend the journal if it is flushed (as upstream's pulseDaemon)."""
        async with self._pulse_slots:
            await self._pulse(replica)

    async def _pulse(self, replica: Replica) -> None:
        suspend = pb.AppendRequest.SUSPEND_NO_RESUME
        if self.auto_suspend and replica.stable_pulses >= AUTO_SUSPEND_STABLE_PULSES:
            suspend = pb.AppendRequest.SUSPEND_IF_FLUSHED
        fsm = AppendFSM(
            self.ctx,
            pb.AppendRequest(journal=replica.journal, do_not_proxy=True, suspend=suspend),
        )
        commit = iter([Chunk(pb.AppendRequest()), Chunk(None)])

        async def receive() -> Chunk:
            return next(commit)

        await fsm.run(receive)
        if isinstance(fsm.error, BrokerExiting):
            return  # Flushed for our exit: nothing left to synchronize.
        if fsm.error is not None:
            raise fsm.error
        if fsm.status not in (pb.OK, pb.SUSPENDED, pb.NOT_JOURNAL_PRIMARY_BROKER):
            log.debug("pulse of %s: %s", replica.journal, pb.Status.Name(fsm.status))
        if replica.primary and replica.index.first_refresh.is_set():
            self._report_holes(replica)

    def _report_holes(self, replica: Replica) -> None:
        """Warn, once per hole, of offsets of the journal that no fragment covers, local or
        persisted, for HOLE_GRACE: content lost with every replica that held it, or gone from
        the store. (A younger one is usually a fragment another replica is still persisting.)
        The journal goes on past it, as the seed allows once every replica failed, and reads
        from before it stop there as upstream's do, until the fragment after it is older than
        OFFSET_JUMP_AGE; an operator reads on from its end with an explicit offset."""
        now = time.monotonic()
        seen = self._holes.setdefault(replica.journal, {})
        holes = set(replica.index.holes())
        for hole in list(seen):
            if hole not in holes:
                del seen[hole]  # Filled (listed after all) or no longer ours to report.
        for hole in sorted(holes):
            first = seen.setdefault(hole, now)
            if first is not None and now - first >= HOLE_GRACE:
                seen[hole] = None  # Reported.
                log.warning(
                    "journal %s has a hole at [%d, %d): no replica holds those offsets and no "
                    "store has them (lost with every replica that held them, or removed from "
                    "the store); reads from before it stop there: read on from offset %d",
                    replica.journal, hole[0], hole[1], hole[1],
                )  # fmt: skip

    async def flush_for_exit(self, timeout: float) -> None:
        """At a graceful exit: every journal whose members are all exiting (so no broker is
        left to take it over) is flushed and suspended at its end by its primary (see
        AppendFSM.flush_and_suspend), so that brokers started later resume it with no
        reset-head: upstream's auto-suspend, done when it is needed. Bounded by `timeout`.

        Primaries move among exiting brokers meanwhile, so each journal is followed until it
        is settled: flushed here whenever this broker is (or becomes) its primary, otherwise
        waited for (keeping our replica serving its primary's pipeline) until its spec shows
        the suspension or our replica is gone. Once flushed, this broker takes no more appends
        to it (BrokerContext.sealed).

        A journal whose stores do not take its content in time is suspended at its end all
        the same, SUSPEND_MARGIN before `timeout` at the latest: its content is lost (every
        replica is exiting), but its offsets are not handed out again (see
        AppendFSM._flush_then_suspend)."""
        self.ctx.exiting = True
        settling: dict[int, asyncio.Task[None]] = {}
        journals: dict[int, str] = {}
        deadline = asyncio.get_running_loop().time() + timeout

        def candidates() -> list[Replica]:
            return [
                r
                for r in (self.resolver.replicas or {}).values()
                if not r.stopped and id(r) not in settling and self._all_exiting(r)
            ]

        try:
            async with asyncio.timeout(timeout):
                async with asyncio.TaskGroup() as tg:
                    while True:
                        for replica in candidates():
                            journals[id(replica)] = replica.journal
                            settling[id(replica)] = tg.create_task(self._settle(replica, deadline))
                        if all(t.done() for t in settling.values()):
                            await asyncio.sleep(0.1)  # A replica started meanwhile?
                            if not candidates():
                                break
                        else:
                            await asyncio.wait(settling.values(), timeout=0.1)
        except TimeoutError:
            unsettled = sorted(journals[k] for k, t in settling.items() if not t.done())
            log.warning(
                "flushing journals before exiting took over %gs; stopping anyway, with %s "
                "neither flushed nor suspended (a restart resumes each at its stores' end, "
                "which may be below what was acknowledged)",
                timeout, ", ".join(unsettled) or "none",
            )  # fmt: skip

    async def _settle(self, replica: Replica, deadline: float) -> None:
        """Flush `replica`'s journal at our exit whenever we are its primary, until it is
        suspended (by us or by its primary) or our replica stops. A flush waits for the store
        until SUSPEND_MARGIN before `deadline` (loop time) at most, then suspends anyway."""
        backoff = Backoff(initial=0.1, factor=2.0, maximum=1.0)
        while not replica.stopped and replica.journal not in self.ctx.sealed:
            spec = replica.spec
            if spec is not None and not spec.fragment.stores:
                return  # Nothing to persist it to: its content lives only as long as a replica.
            if not replica.primary:
                if spec is not None and spec.suspend.level != pb.JournalSpec.Suspend.NONE:
                    return  # Its primary flushed and suspended it.
                index = replica.index
                if index.first_refresh.is_set() and index.end_offset() == 0:
                    # Never written: its primary has nothing to flush and suspends nothing, so
                    # no suspension will come to wait for.
                    return
                if not self._has_primary(replica):
                    return  # Its primary is gone: nobody is left to flush it.
                await wait_any(replica.spec_changed_event, replica.invalidated, timeout=0.5)
                continue
            wait = deadline - asyncio.get_running_loop().time() - SUSPEND_MARGIN
            fsm = await self._flush(replica, max(0.0, min(FLUSH_TIMEOUT, wait)))
            if fsm.status == pb.SUSPENDED and fsm.error is None and fsm.unpersisted:
                lost = ", ".join(f"[{b}, {e})" for b, e in fsm.unpersisted)
                log.error(
                    "journal %s: could not persist %s before exiting (%s), and every replica "
                    "of it is exiting: that content is lost unless the store takes it before "
                    "this broker stops (its spool goes with it). Its end is recorded: the "
                    "journal resumes at offset %d, and reads of %s report a hole",
                    replica.journal, lost, fsm.store_health_error, fsm.flush_end, lost,
                )  # fmt: skip
                return
            if fsm.status == pb.SUSPENDED and fsm.error is None:
                log.info("flushed %s and suspended it at its end for the restart", replica.journal)
                return
            if fsm.status == pb.INDEX_HAS_GREATER_OFFSET and fsm.error is None:
                # Its stores hold offsets past every replica's spool: no append goes through
                # until an operator resets its head, and waiting changes nothing.
                log.warning(
                    "cannot flush %s before exiting: its stores hold offsets past its spool "
                    "(INDEX_HAS_GREATER_OFFSET); it needs `gazctl journals reset-head`",
                    replica.journal,
                )  # fmt: skip
                return
            reason = fsm.error or fsm.store_health_error or pb.Status.Name(fsm.status)
            if fsm.status != pb.NOT_JOURNAL_PRIMARY_BROKER:
                log.warning(
                    "could not flush %s before exiting (%s); retrying", replica.journal, reason
                )
            await asyncio.sleep(backoff.next_delay())

    async def _flush(self, replica: Replica, timeout: float | None = None) -> AppendFSM:
        fsm = AppendFSM(
            self.ctx, pb.AppendRequest(journal=replica.journal, do_not_proxy=True),
            flush_and_suspend=True, flush_timeout=timeout,
        )  # fmt: skip
        commit = iter([Chunk(pb.AppendRequest()), Chunk(None)])

        async def receive() -> Chunk:
            return next(commit)

        await fsm.run(receive)
        return fsm

    @staticmethod
    def _has_primary(replica: Replica) -> bool:
        return any(
            isinstance(kv.decoded, aks.Assignment) and kv.decoded.slot == 0
            for kv in replica.assignments
        )

    def _all_exiting(self, replica: Replica) -> bool:
        """Whether every member assigned to the replica's journal is exiting (or gone)."""
        for kv in replica.assignments:
            a = kv.decoded
            if not isinstance(a, aks.Assignment):
                continue
            member = self.ks.get(aks.member_key(self.root, a.member_zone, a.member_suffix))
            spec = member.decoded.spec if member is not None else None  # type: ignore[attr-defined]
            if isinstance(spec, pb.BrokerSpec) and not spec.exiting:
                return False
        return True

    def unrouted_header(self) -> pb.Header:
        return self.ctx.unrouted_header()

    def snapshot(
        self, selector: pb.LabelSelector, claims: auth.Claims | None = None
    ) -> tuple[list[pb.ListResponse.Journal], int]:
        """Journals matching `selector` (and visible to `claims`) with their routes, and the
        max mod revision among them."""
        items_prefix = self.root + aks.ITEMS
        assign_prefix = self.root + aks.ASSIGNMENTS
        # Items and assignments are both ordered on journal name: narrow a single-name query.
        narrow = labels.values_of(selector.include, "name")
        narrow_to = narrow[0] if len(narrow) == 1 else ""
        items = self.ks.prefixed(items_prefix + narrow_to)
        assignments: dict[str, list[KeyValue]] = {}
        for kv in self.ks.prefixed(assign_prefix + narrow_to):
            if isinstance(kv.decoded, aks.Assignment):
                assignments.setdefault(kv.decoded.item_id, []).append(kv)

        matcher = labels.JournalMatcher(selector)
        out: list[pb.ListResponse.Journal] = []
        max_mod = -1
        for kv in items:
            item = kv.decoded
            if not isinstance(item, aks.Item) or not isinstance(item.spec, pb.JournalSpec):
                continue
            if not matcher.matches(item.spec):
                continue
            if claims is not None and not claims.sees_journal(item.spec):
                continue
            journal = pb.ListResponse.Journal(
                spec=item.spec,
                mod_revision=kv.mod_revision,
                create_revision=kv.create_revision,
                route=self.resolver.route_of(assignments.get(item.id, ())),
            )
            out.append(journal)
            max_mod = max(max_mod, kv.mod_revision)
        return out, max_mod

    async def List(
        self, request: pb.ListRequest, context: Context
    ) -> AsyncIterator[pb.ListResponse]:
        claims = await auth.verify_or_abort(self.verifier, context, auth.LIST)
        try:
            validate.validate_list_request(request)
        except validate.ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        selector = labels.rewrite_prefix_meta_label(request.selector)

        min_revision = 0
        if request.HasField("watch_resume"):
            min_revision = request.watch_resume.etcd.revision + 1
        last: tuple[int, int] | None = None
        while True:
            if min_revision > self.ks.revision:
                await self.ks.wait_for_revision(min_revision)
            min_revision = self.ks.revision + 1

            journals, max_mod = self.snapshot(selector, claims)
            if last == (len(journals), max_mod):
                continue  # Unchanged: creates and updates raise max_mod, deletes shrink the count.
            last = (len(journals), max_mod)

            first = pb.ListResponse(status=pb.OK, header=self.unrouted_header())
            chunk = first
            for start in range(0, max(len(journals), 1), MAX_JOURNALS_PER_LIST_RESPONSE):
                chunk.journals.extend(journals[start : start + MAX_JOURNALS_PER_LIST_RESPONSE])
                yield chunk
                chunk = pb.ListResponse()
            if not request.watch:
                # Journals without replicas: the trailer says why, where the allocator cannot
                # place them (their route alone cannot tell).
                if any(not j.route.members for j in journals) and (
                    note := self.resolver.placement_shortfall()
                ):
                    context.set_trailing_metadata(((PLACEMENT, note),))
                return
            yield pb.ListResponse()  # Marks the end of this snapshot for watching clients.

    async def Apply(self, request: pb.ApplyRequest, context: Context) -> pb.ApplyResponse:
        claims = await auth.verify_or_abort(self.verifier, context, auth.APPLY)
        try:
            validate.validate_apply_request(request)
        except validate.ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        names: list[str] = []
        for change in request.changes:
            # Upserts are authorized on the journal's labels, deletes on its name (upstream);
            # both on the labels of the spec they replace as well (below, ours).
            if change.HasField("upsert"):
                name, allowed = change.upsert.name, claims.sees_journal(change.upsert)
            else:
                name = change.delete
                allowed = claims.sees_labels(labels.label_set((labels.META_NAME, name)))
            if not allowed:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not authorized to {name}")
            names.append(name)
        for change in request.changes:
            if change.HasField("upsert"):
                try:
                    check_spec_supported(change.upsert)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            paths = _fragment_paths(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from None

        keys: list[bytes] = []
        ops: list[object] = []
        for change, name in zip(request.changes, names, strict=True):
            key = aks.item_key(self.root, name).encode()
            keys.append(key)
            if change.HasField("upsert"):
                ops.append(transactions.Put(key, change.upsert.SerializeToString()))
            else:
                ops.append(transactions.Delete(key))

        def check_replaced(index: int, value: bytes) -> None:
            # A journal the caller cannot see is neither replaced nor deleted by it, and is
            # refused as any unauthorized change, before a revision check could reveal it.
            if not claims.sees_journal(pb.JournalSpec.FromString(value)):
                raise auth.Unauthenticated(f"not authorized to {names[index]}")

        expected = [change.expect_mod_revision for change in request.changes]
        check = None if claims.unrestricted else check_replaced
        await etcdx.wait_until_ready(self.etcd)
        try:
            if paths:
                result = await self._txn_with_paths(keys, names, expected, ops, check, paths, claims)  # fmt: skip
            else:
                result = await etcdx.txn_guarded(self.etcd, keys, expected, ops, check)
        except auth.Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise AssertionError("unreachable") from None
        except _Unlisted as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise AssertionError("unreachable") from None
        except PathError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from None
        except etcdx.TxnTooLarge:
            changes = len(request.changes)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, etcdx.too_many_changes(changes))
            raise AssertionError("unreachable") from None
        except etcdx.UNREACHABLE as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, etcdx.unreachable_message(exc))
            raise AssertionError("unreachable") from None
        response = pb.ApplyResponse(status=pb.OK, header=self.unrouted_header())
        if not result.succeeded:
            response.status = pb.ETCD_TRANSACTION_FAILED
        elif ops:
            # Answer only once our own keyspace reflects the write (read-your-writes for List).
            await self.ks.wait_for_revision(result.revision)
        response.header.etcd.revision = result.revision
        return response

    def _journals(self) -> tuple[int, list[tuple[str, pb.JournalSpec, int]]]:
        """The keyspace's revision and its journals (name, spec, create revision) at it."""
        out = []
        for kv in self.ks.prefixed(self.root + aks.ITEMS):
            item = kv.decoded
            if isinstance(item, aks.Item) and isinstance(item.spec, pb.JournalSpec):
                out.append((item.id, item.spec, kv.create_revision))
        return self.ks.revision, out

    def _check_paths(
        self, index: PathIndex, paths: list[tuple[str, str, FragmentPath]], changed: set[str],
        claims: auth.Claims,
    ) -> None:  # fmt: skip
        """Raise PathError if a path of `paths` (journal, store, path: the request's upserts)
        meets that of a journal the caller sees in `index` (less the journals the request
        changes), or auth.Unauthenticated, as for any journal it may not change, if it meets
        only those of journals it cannot see."""
        hidden = ""
        for name, url, path in paths:
            for claim in index.overlapping(path, exclude=changed):
                spec = index.spec(claim.journal)  # The index holds the spec it was built of.
                if spec is not None and claims.sees_journal(spec):
                    raise PathError(
                        f"journal {name}: its fragment path {validate.quote(path.key)} in {url} "
                        f"meets journal {claim.journal}'s {validate.quote(claim.key)}: no "
                        "journal's fragments may be another's (give it another store, prefix "
                        "or name)"
                    )
                hidden = hidden or name
        if hidden:
            raise auth.Unauthenticated(f"not authorized to {hidden}")

    async def _txn_with_paths(
        self,
        keys: list[bytes],
        names: list[str],
        expected: list[int],
        ops: list[object],
        check: Any,
        paths: list[tuple[str, str, FragmentPath]],
        claims: auth.Claims,
    ) -> etcdx.TxnResult:
        """As etcdx.txn_guarded, and checking `paths` (journal, store, path: the upserts') against
        every journal's as the keyspace holds them. Only Applies whose paths could meet contend:
        each bumps the lock key of every (storage, first key segment) it claims and compares
        each with the mod revision it read before checking, so an Apply that claimed a meeting
        path meanwhile fails the compare, and this one reads and checks again (a keyspace-wide
        compare let any tenant's Applies fail every other's). With a selector, also: a store's
        endpoint and profile only as the spec replaced has them, and a path new to its journal
        only where its store holds no object (a deleted or moved journal's fragments)."""
        locks = sorted({aks.path_lock_key(self.root, *lock_of(p)).encode() for _, _, p in paths})
        changed = set(names)
        listed_empty: set[tuple[str, str]] = set()
        result = etcdx.TxnResult(False, self.ks.revision, 0, 0, 0)
        for _ in range(etcdx.GUARDED_ATTEMPTS):
            current, read_at = await etcdx.get_current(self.etcd, [*keys, *locks])
            held = current[: len(keys)]
            # Every Apply that bumped a lock by then put its journals in the same transaction:
            # once the keyspace holds that revision, the check below sees their paths.
            await self.ks.wait_for_revision(max((c.mod_revision for c in current[len(keys) :]), default=0))  # fmt: skip
            if check is not None:
                for at, now in enumerate(held):
                    if now.value is not None:
                        check(at, now.value)
            if any(e not in (-1, now.mod_revision) for e, now in zip(expected, held, strict=True)):  # fmt: skip
                return etcdx.TxnResult(False, read_at, 0, 0, 0)
            replaced: dict[str, pb.JournalSpec] = {}
            for name, now in zip(names, held, strict=True):
                if now.value is not None:
                    replaced[name] = pb.JournalSpec.FromString(now.value)
                    canonical_spec_stores(replaced[name])
            if not claims.unrestricted:
                _check_origins(paths, replaced)
            _, index = self.paths.index()
            self._check_paths(index, paths, changed, claims)
            if not claims.unrestricted:
                await self._check_unclaimed(paths, replaced, listed_empty)
            compare = [
                transactions.Mod(key) == now.mod_revision
                for key, now in zip([*keys, *locks], current, strict=True)
            ]
            bumps = [transactions.Put(lock, b"") for lock in locks]
            result = await etcdx.txn(self.etcd, compare, [*ops, *bumps])
            if result.succeeded:
                return result
        return result

    async def _check_unclaimed(
        self,
        paths: list[tuple[str, str, FragmentPath]],
        replaced: dict[str, pb.JournalSpec],
        listed_empty: set[tuple[str, str]],
    ) -> None:
        """Raise auth.Unauthenticated, as for any journal the caller may not change, if a path
        of `paths` that the journal's replaced spec does not claim already holds objects in its
        store: fragments a deleted or moved journal left there, which no token with a selector
        may take as its own. A store that cannot be listed raises _Unlisted (never accepted).
        `listed_empty` remembers paths found empty, across attempts."""
        for name, url, path in paths:
            if (name, url) in listed_empty:
                continue
            before = replaced.get(name)
            if before is not None and path in _claimed_paths(name, before):
                continue
            if self.persister is None:
                raise _Unlisted(
                    f"journal {name}: cannot check that its fragment path in {url} holds no "
                    "other journal's fragments: this broker has no fragment stores"
                )
            try:
                held = await self.persister.holds_objects(name, url)
            except (StoreError, OSError, ValueError, TimeoutError) as exc:
                reason = str(exc) or f"no answer within {UNCLAIMED_CHECK_TIMEOUT:.0f}s"
                raise _Unlisted(
                    f"journal {name}: cannot check that its fragment path in {url} holds no "
                    f"other journal's fragments ({reason}); try again"
                ) from None
            if held:
                raise auth.Unauthenticated(f"not authorized to {name}")
            listed_empty.add((name, url))

    async def Read(
        self, request: pb.ReadRequest, context: Context
    ) -> AsyncIterator[pb.ReadResponse]:
        # grpc.aio needs the handler itself to be an async generator function.
        claims = await auth.verify_or_abort(self.verifier, context, auth.READ)
        async for response in serve_read(self.ctx, request, context, claims):
            yield response

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: Context
    ) -> pb.AppendResponse:
        claims = await auth.verify_or_abort(
            self.verifier, context, auth.APPEND, unread=request_iterator
        )
        try:
            return await serve_append(self.ctx, request_iterator, context, claims)
        except AppendFailed as exc:
            await context.abort(exc.code, str(exc))
            raise AssertionError("unreachable") from None

    async def Replicate(
        self, request_iterator: AsyncIterator[pb.ReplicateRequest], context: Context
    ) -> AsyncIterator[pb.ReplicateResponse]:
        claims = await auth.verify_or_abort(self.verifier, context, auth.REPLICATE)
        async for response in serve_replicate(self.ctx, request_iterator, context, claims):
            yield response

    async def ListFragments(
        self, request: pb.FragmentsRequest, context: Context
    ) -> pb.FragmentsResponse:
        claims = await auth.verify_or_abort(self.verifier, context, auth.READ)
        return await serve_list_fragments(self.ctx, request, context, claims)

    async def FragmentStoreHealth(
        self, request: pb.FragmentStoreHealthRequest, context: Context
    ) -> pb.FragmentStoreHealthResponse:
        # Ours, stricter than upstream (READ): a check writes probe objects with the broker's
        # own credentials, so it takes APPLY, and a token with a selector may check only the
        # stores of journals it can see.
        claims = await auth.verify_or_abort(self.verifier, context, auth.APPLY)
        visible = None if claims.unrestricted else (lambda url: self._paths_seen_by(claims, url))
        return await serve_store_health(self.ctx, request, context, visible)

    def _paths_seen_by(self, claims: auth.Claims, url: str) -> list[StoreGuard]:
        """The paths in store `url` (canonical) of the journals `claims` see, by journal name;
        only those that are their journal's own."""
        journals, _ = self.snapshot(pb.LabelSelector(), claims)
        _, index = self.paths.index()
        guards = [index.guard(j.spec.name, url) for j in journals if url in j.spec.fragment.stores]
        return [g for g in guards if not g.error]


class _Unlisted(Exception):
    """A store could not say whether a journal's new fragment path holds objects (one line)."""


def _claimed_paths(journal: str, spec: pb.JournalSpec) -> set[FragmentPath]:
    """The fragment paths `spec` (of `journal`) claims, less the stores that claim none."""
    out = set()
    for url in spec.fragment.stores:
        with contextlib.suppress(ValueError):
            out.add(fragment_path(journal, url))
    return out


def _check_origins(
    paths: list[tuple[str, str, FragmentPath]], replaced: dict[str, pb.JournalSpec]
) -> None:
    """For a caller with a selector: raise auth.Unauthenticated (one line naming the journal
    and store) for a store that sets an `endpoint` or `profile` unless the spec it replaces has
    a store of the same scheme, bucket, endpoint and profile, chosen by whoever created it (an
    operator). A tenant's own choice would send requests signed with the broker's credentials
    wherever it likes, or pick which of them sign."""
    seen: dict[str, int] = {}
    for name, url, _ in paths:
        at = seen[name] = seen.get(name, -1) + 1  # Its index in the spec's stores.
        origin = chosen_origin(url)
        if origin is None:
            continue
        before = replaced.get(name)
        allowed = set()
        for other in before.fragment.stores if before is not None else ():
            with contextlib.suppress(ValueError):
                allowed.add(chosen_origin(other))
        if origin not in allowed:
            raise auth.Unauthenticated(
                f"journal {name}: fragment.stores[{at}]: a token with a selector cannot choose "
                "the store's endpoint or profile (an operator sets them)"
            )


def _fragment_paths(request: pb.ApplyRequest) -> list[tuple[str, str, FragmentPath]]:
    """The fragment paths of the request's upserts (journal, store, path), raising ValueError
    (one line naming the journal) for a store URL that is not canonical, a journal whose
    fragments would have no path of their own, or two upserts whose paths meet."""
    out: list[tuple[str, str, FragmentPath]] = []
    for change in request.changes:
        if not change.HasField("upsert"):
            continue
        spec = change.upsert
        for at, url in enumerate(spec.fragment.stores):
            try:
                canonical = canonical_store_url(url)
            except ValueError as exc:
                raise ValueError(f"journal {spec.name}: fragment.stores[{at}]: {exc}") from None
            if canonical != url:
                raise ValueError(
                    f"journal {spec.name}: fragment.stores[{at}]: fragment store "
                    f"{validate.quote(url)} is not canonical (write {validate.quote(canonical)})"
                )
            path = fragment_path(spec.name, url)
            for name, other_url, other in out:
                if name != spec.name and overlap(path, other):
                    raise PathError(
                        f"journal {spec.name}: its fragment path {validate.quote(path.key)} in "
                        f"{url} meets journal {name}'s {validate.quote(other.key)} in {other_url}: "
                        "no journal's fragments may be another's"
                    )
            out.append((spec.name, url, path))
    return out


def _counted(operation: str, handler: Any) -> Any:
    """A unary or client-streaming handler counted as upstream counts it: started, then
    completed by the response's status (`<error>` when it fails)."""
    started = metrics.journal_server_started.labels(operation)

    async def counted(request: Any, context: Context) -> Any:
        logs.bind(rpc=operation, journal=getattr(request, "journal", ""))
        started.inc()
        status = "<error>"
        try:
            response = await handler(request, context)
            status = metrics.status_name(response.status, pb.Status.Name)
            return response
        finally:
            metrics.journal_server_completed.labels(operation, status).inc()

    return counted


def _counted_stream(operation: str, handler: Any) -> Any:
    """A server-streaming handler, counted by its first response's status."""
    started = metrics.journal_server_started.labels(operation)

    async def counted(request: Any, context: Context) -> AsyncIterator[Any]:
        logs.bind(rpc=operation, journal=getattr(request, "journal", ""))
        started.inc()
        status = "<error>"
        first = True
        try:
            async for response in handler(request, context):
                if first:
                    first = False
                    if not isinstance(response, bytes):
                        status = metrics.status_name(response.status, pb.Status.Name)
                yield response
            if first:
                status = "ok"
        finally:
            metrics.journal_server_completed.labels(operation, status).inc()

    return counted


def add_journal_service(service: JournalService, server: grpc.aio.Server) -> None:
    """Register the Journal service as the generated code does, except that Read's content
    responses may be yielded already encoded (see `broker.protocol.wire`), and that each RPC
    is counted (`gazette_journal_server_*`)."""
    rpc = grpc
    handlers = {
        "List": rpc.unary_stream_rpc_method_handler(
            _counted_stream("List", service.List),
            pb.ListRequest.FromString,
            pb.ListResponse.SerializeToString,
        ),
        "Apply": rpc.unary_unary_rpc_method_handler(
            _counted("Apply", service.Apply),
            pb.ApplyRequest.FromString,
            pb.ApplyResponse.SerializeToString,
        ),
        "Read": rpc.unary_stream_rpc_method_handler(
            _counted_stream("Read", service.Read),
            pb.ReadRequest.FromString,
            wire.passing_bytes(pb.ReadResponse.SerializeToString),
        ),
        "Append": rpc.stream_unary_rpc_method_handler(
            _counted("Append", service.Append),
            pb.AppendRequest.FromString,
            pb.AppendResponse.SerializeToString,
        ),
        "Replicate": rpc.stream_stream_rpc_method_handler(
            _counted_stream("Replicate", service.Replicate),
            pb.ReplicateRequest.FromString,
            pb.ReplicateResponse.SerializeToString,
        ),
        "ListFragments": rpc.unary_unary_rpc_method_handler(
            _counted("ListFragments", service.ListFragments),
            pb.FragmentsRequest.FromString,
            pb.FragmentsResponse.SerializeToString,
        ),
        "FragmentStoreHealth": rpc.unary_unary_rpc_method_handler(
            _counted("FragmentStoreHealth", service.FragmentStoreHealth),
            pb.FragmentStoreHealthRequest.FromString,
            pb.FragmentStoreHealthResponse.SerializeToString,
        ),
    }
    # A request that is not protobuf is answered INVALID_ARGUMENT in one line (gRPC would
    # answer UNKNOWN and log a traceback).
    server.add_generic_rpc_handlers(
        (
            wire.refusing_undecodable(
                grpc.method_handlers_generic_handler("protocol.Journal", handlers)
            ),
        )
    )
