"""A consumer process's shard replicas: for each shard assigned to it, a primary (the
transaction loop, or the application's own `run_primary`) or a standby (playing the shard's
recovery log), started and stopped as the assignments in etcd change (`Replicas.run`), and
the status each reports in its assignment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aetcd import transactions

from allocator import keyspace as aks
from broker.client.append_service import AppendService
from broker.client.journals import BrokerUnavailable, JournalsClient
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from consumer.hooks import StoreHooks
from consumer.keyspace import replica_status
from consumer.protocol import cpb, recovery_log, truncate_error
from consumer.recovery import Playback, fetch_hints, rotate_hints, store_hints
from consumer.store import Store
from consumer.transaction import Progress, Shard, Source, run_shard
from keyspace import KeyValue
from message.framing import JSONLines, framing_for
from message.publisher import Publisher
from message.types import DictMessages, MessageType
from plumbing import etcd as etcdx
from plumbing import logs
from plumbing.backoff import Backoff
from plumbing.membership import (
    ETCD_TRANSIENT,
)
from plumbing.tasks import TaskOwner

if TYPE_CHECKING:
    from consumer.runtime import Consumer

log = logging.getLogger("consumer.runtime")

T = TypeVar("T")


@dataclass
class Replica:
    """A shard's replica in this process: its assignment, its task (primary or standby), its
    shard and store once it runs, its progress, and whether it stopped."""

    shard_id: str
    assignment: KeyValue
    task: asyncio.Task[None] | None = None
    shard: Shard | None = None
    store: Store | None = None
    progress: Progress = field(default_factory=Progress)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    playback: Playback | None = None
    standby: asyncio.Task[None] | None = None

    @property
    def slot(self) -> int:
        a = self.assignment.decoded
        assert isinstance(a, aks.Assignment)
        return a.slot


class Replicas:
    """The shard replicas of one consumer process (`consumer`): its assignments' replicas,
    their tasks (owned by `tasks`, closed before the process's other tasks), and the loop that
    reconciles them with the keyspace whenever it changes (`changed`)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.config, self.app, self.hooks = consumer.config, consumer.app, consumer.hooks
        self.ks, self.etcd, self.root = consumer.ks, consumer.etcd, consumer.root
        self.state, self.router = consumer.state, consumer.router
        self.tasks = TaskOwner("shards")
        self.replicas: dict[str, Replica] = {}
        self.changed = asyncio.Event()

    def _spawn_shard(self, coro: Coroutine[Any, Any, None], shard_id: str) -> asyncio.Task[None]:
        """A shard's task, whose records (and its tasks') carry the shard's id."""
        with logs.bound(shard=shard_id):
            return self.tasks.spawn(coro, shard_id)

    # ---- replicas ------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            await self._reconcile()

    def _local_assignments(self) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {}
        for kv in self.ks.prefixed(self.root + aks.ASSIGNMENTS):
            a = kv.decoded
            if (
                isinstance(a, aks.Assignment)
                and a.member_zone == self.config.zone
                and a.member_suffix == self.config.id
            ):
                out[a.item_id] = kv
        return out

    async def _reconcile(self) -> None:
        if self.tasks.closed:
            # Stopping: every replica is being stopped, and none may start (the allocator still
            # moves shards while every process exits; a replica started now would fail the
            # process on its way out).
            return
        wanted = self._local_assignments()
        for shard_id in list(self.replicas):
            replica = self.replicas[shard_id]
            kv = wanted.get(shard_id)
            was_primary = replica.slot == 0
            if kv is not None and not was_primary and aks_slot(kv) == 0 and replica.playback:
                # A standby promoted: it completes its playback by a hand-off, no replay.
                replica.assignment = kv
                replica.task = self._spawn_shard(self._run_primary(replica), shard_id)
            elif kv is None or was_primary != (aks_slot(kv) == 0):
                # Unassigned, or demoted, or a standby with nothing played: stop this replica
                # (one promoted starts afresh as primary below).
                await self._stop_replica(replica)
                del self.replicas[shard_id]
            else:
                replica.assignment = kv
        for shard_id, kv in wanted.items():
            if shard_id in self.replicas:
                continue
            replica = Replica(shard_id, kv)
            self.replicas[shard_id] = replica
            if aks_slot(kv) == 0:
                replica.task = self._spawn_shard(self._run_primary(replica), shard_id)
            else:
                replica.standby = self._spawn_shard(self._run_standby(replica), shard_id)

    async def _stop_replica(self, replica: Replica) -> None:
        for task in (replica.task, replica.standby):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if replica.playback is not None:
            await replica.playback.stop()
            replica.playback = None
        replica.stopped.set()

    def _replica_dir(self, shard_id: str) -> Path:
        assert self.consumer.local_dir is not None
        return self.consumer.local_dir / urllib.parse.quote(shard_id, safe="")

    async def _run_standby(self, replica: Replica) -> None:
        """A hot standby: with a recovery log, play it (BACKFILL) and tail it (STANDBY) until
        promoted (the primary completes the playback) or stopped."""
        assignment = replica.assignment
        spec = self._spec_of(replica.shard_id)
        if spec is None or not recovery_log(spec):
            await self._set_status(
                replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.STANDBY), assignment
            )
            follow = self.hooks.run_standby
            if spec is not None and follow is not None:
                try:
                    await follow(self.consumer, spec)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    await self._failed(replica, "standby of shard", exc, assignment)
            return
        try:
            async with AppendService(self.router) as service:
                playback = await self._start_playback(replica, spec, service, assignment)
                await playback.wait_tailing()
                await self._set_status(
                    replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.STANDBY), assignment
                )
                assert playback.task is not None
                await asyncio.shield(playback.task)  # Until a hand-off completes it.
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._failed(replica, "standby of shard", exc, assignment)

    async def _failed(
        self, replica: Replica, what: str, exc: BaseException, assignment: KeyValue | None = None
    ) -> None:
        """Log a replica's failure and report it, one line, as FAILED in its assignment."""
        error = _first_error(exc)
        text = truncate_error(f"{type(error).__name__}: {error}")
        log.error("%s %s failed: %s", what, replica.shard_id, text)
        await self._set_status(
            replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.FAILED, errors=[text]), assignment
        )

    async def _set_status(
        self, replica: Replica, status: cpb.ReplicaStatus, assignment: KeyValue | None = None
    ) -> None:
        """Write `status` into the replica's assignment (`assignment`, else its current one), if
        it is still that assignment; through etcd's transient errors (a replica never ends
        without its status saying so)."""
        assignment = assignment or replica.assignment
        backoff = Backoff(initial=0.1, maximum=2.0)
        while True:
            kv = self.ks.get(assignment.key)
            if kv is None or kv.create_revision != assignment.create_revision:
                return
            if replica_status(kv.decoded) == status:
                return
            try:
                result = await etcdx.txn(
                    self.etcd,
                    [transactions.Mod(kv.key.encode()) == kv.mod_revision],
                    [etcdx.put_keeping_lease(kv.key.encode(), status.SerializeToString())],
                )
            except ETCD_TRANSIENT as exc:
                code = cpb.ReplicaStatus.Code.Name(status.code)
                log.warning("shard %s: writing its status %s: etcd unavailable (%s): trying again", replica.shard_id, code, exc)  # fmt: skip
                await backoff.sleep()
                continue
            await self.ks.wait_for_revision(result.revision)
            if result.succeeded:
                replica.assignment = self.ks.get(kv.key) or kv
                return
            # The mirror was behind etcd: a write of ours whose reply was lost (etcd killed
            # after it committed), or one the watch had not delivered yet after etcd's restart.
            # Compared again once the mirror caught up (it then shows what we wrote, or the
            # assignment gone), rather than leaving the status unwritten.

    async def _through_etcd(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call`, tried again (the project's backoff) while etcd is unavailable: a shard
        fails only for its own errors."""
        backoff = Backoff(initial=0.1, maximum=2.0)
        while True:
            try:
                return await call()
            except ETCD_TRANSIENT as exc:
                log.warning("%s: etcd unavailable (%s): trying again", what, exc)
                await backoff.sleep()

    async def _through_brokers(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call`, tried again (the project's backoff) while the brokers are unreachable or do
        not answer in time: a shard fails only for its own errors, not for a broker that is busy
        (thousands of shards starting at once) or restarting."""
        backoff = Backoff(initial=0.1, maximum=2.0)
        while True:
            try:
                return await call()
            except BrokerUnavailable as exc:
                log.warning("%s: %s: trying again", what, exc)
                await backoff.sleep()

    async def _sources(self, spec: cpb.ShardSpec) -> list[Source]:
        # Each source's spec by its name, as upstream's fetchJournalSpec: a broker answers a
        # List of one name from its index, where a List of every journal, once per shard
        # started, made starting N shards O(N x journals) (shard_scale,
        # docs/benchmarks-history.md).
        names = sorted({source.journal.partition(";")[0] for source in spec.sources})
        specs: dict[str, pb.JournalSpec] = {}
        async with JournalsClient(
            self.config.broker_address, credentials=self.config.broker_credentials
        ) as client:
            for name in names:
                snapshot = await client.list(labels.selector(labels.label_set(("name", name))))
                specs.update((j.spec.name, j.spec) for j in snapshot.journals)
        out = []
        for source in spec.sources:
            name = source.journal.partition(";")[0]
            journal = specs.get(name)
            if journal is None:
                raise ValueError(f"source journal {name} of shard {spec.id} does not exist")
            content_type = labels.value_of(journal.labels, "content-type")
            chooser = self.hooks.message_type
            messages: MessageType[Any] = chooser(journal) if chooser else DictMessages()
            out.append(
                Source(source.journal, messages, framing_for(content_type), source.min_offset)
            )
        return out

    async def _run_primary(self, replica: Replica) -> None:
        spec = self._spec_of(replica.shard_id)
        serve = self.hooks.run_primary
        if serve is not None:
            await self._serve_primary(replica, spec, serve)
            return
        try:
            if spec is None:
                raise ValueError(f"shard {replica.shard_id} has no spec")
            sources = await self._through_brokers(
                f"shard {spec.id}: reading its sources' specs", lambda: self._sources(spec)
            )
            log_name = recovery_log(spec)
            async with AppendService(self.router) as service:
                recorder = await self._recover(replica, spec, service) if log_name else None
                # The hints of the state reached at hand-off: into the backups once restored.
                recovered = await recorder.build_hints() if recorder is not None else None
                shard = Shard(
                    spec,
                    service,
                    Publisher(service, DictMessages(), JSONLines()),
                    replica.progress,
                    fqn=aks.item_key(self.root, replica.shard_id),
                    recorder=recorder,
                )
                replica.shard = shard
                store = await self.app.new_store(shard)
                replica.store = store

                async def advertise() -> None:  # Once the store is fenced and restored.
                    if recorder is not None and recovered is not None:
                        await self._store_recovered_hints(replica, spec, recorder, recovered, store)
                    await self._set_status(
                        replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.PRIMARY)
                    )

                try:
                    async with asyncio.TaskGroup() as tasks:
                        if recorder is not None:
                            tasks.create_task(self._store_hints_periodically(replica, spec, store))
                        await run_shard(
                            shard, self.app, store, sources, lambda: self.router.stub_for(""),
                            recovery_log=log_name, restored=advertise,
                        )  # fmt: skip
                finally:
                    replica.store = None
                    await store.close()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._failed(replica, "shard", exc)

    async def _serve_primary(
        self, replica: Replica, spec: cpb.ShardSpec | None, serve: Any
    ) -> None:
        """The primary of an application that serves (`run_primary`)."""

        async def ready() -> None:
            await self._set_status(replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.PRIMARY))

        try:
            if spec is None:
                raise ValueError(f"shard {replica.shard_id} has no spec")
            await serve(self.consumer, spec, ready)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._failed(replica, "shard", exc)

    async def _recover(self, replica: Replica, spec: cpb.ShardSpec, service: AppendService) -> Any:
        """The shard's local files, played from its recovery log (or taken over from this
        replica's standby playback) and handed off to a new recorder. Hints are stored only
        once the store restored from them (`_store_recovered_hints`)."""
        playback = replica.playback
        if playback is not None and playback.task is not None and not playback.task.done():
            log.info(
                "shard %s: its standby takes over the log it %s", spec.id,
                "tails" if playback.tailing else "plays",
            )  # fmt: skip
        else:
            if playback is not None:
                await playback.stop()
            log.info("shard %s: playing its recovery log from its hints", spec.id)
            playback = await self._start_playback(replica, spec, service)
        return await playback.hand_off(service)

    async def _store_recovered_hints(
        self, replica: Replica, spec: cpb.ShardSpec, recorder: Any, recovered: Any, store: Store
    ) -> None:
        """As upstream, once the store opened and restored its checkpoint: the hints of the
        state reached at hand-off rotated into the backups, and the recorder's stored as the
        primary's (taken as `_current_hints` takes them)."""
        rotated = await self._through_etcd(
            f"shard {spec.id}: rotating its hints",
            lambda: rotate_hints(self.etcd, spec, recovered, replica.assignment),
        )
        if not rotated:
            raise RuntimeError(f"shard {spec.id}: assignment lost while recovering")
        hints = await _current_hints(store, recorder)
        await self._through_etcd(
            f"shard {spec.id}: storing its hints",
            lambda: store_hints(self.etcd, spec, hints, replica.assignment),
        )

    async def _start_playback(
        self,
        replica: Replica,
        spec: cpb.ShardSpec,
        service: AppendService,
        assignment: KeyValue | None = None,
    ) -> Playback:
        """Play the shard's log from its hints into the replica's directory (BACKFILL)."""
        playback = Playback(spec, self._replica_dir(replica.shard_id))
        # A killed etcd refuses at once (aetcd does not wait as Go's clientv3 does): one
        # refused read must not fail the shard until an operator unassigns it.
        hints = await self._through_etcd(
            f"shard {spec.id}: reading its hints", lambda: fetch_hints(self.state, spec)
        )
        playback.start(hints, lambda: self.router.stub_for(""), service)
        replica.playback = playback
        await self._set_status(
            replica, cpb.ReplicaStatus(code=cpb.ReplicaStatus.BACKFILL), assignment
        )
        return playback

    async def _store_hints_periodically(
        self, replica: Replica, spec: cpb.ShardSpec, store: Store
    ) -> None:
        shard = replica.shard
        assert shard is not None and shard.recorder is not None
        while True:
            await asyncio.sleep(self.config.hints_interval)
            hints = await _current_hints(store, shard.recorder)
            try:
                await store_hints(self.etcd, spec, hints, replica.assignment)
            except ETCD_TRANSIENT as exc:  # As upstream: said, and tried at the next interval.
                log.warning("shard %s: storing its hints: etcd unavailable (%s)", spec.id, exc)

    def _spec_of(self, shard_id: str) -> cpb.ShardSpec | None:
        found = self.state.spec_of(shard_id)
        return found[0] if found is not None else None

    # ---- Stat --------------------------------------------------------------------------------


async def _current_hints(store: Store, recorder: Any) -> Any:
    """The primary's hints now, naming only operations its log holds. A store that records
    from its own thread (SQLite) takes them there (`build_hints`): what it recorded and has not
    handed to the loop yet (a WAL created at open, before any sync) is in the recorder's FSM but
    not in the log, and hints read on the loop would name it, failing every player of them
    with "possible data loss" until the store next syncs."""
    build = StoreHooks.of(store).build_hints
    if build is not None:
        return await build()
    return await recorder.build_hints()


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def aks_slot(kv: KeyValue) -> int:
    a = kv.decoded
    assert isinstance(a, aks.Assignment)
    return a.slot
