"""A local, decoded, key-sorted mirror of an etcd key prefix, kept current by a long-lived watch.

Brokers (and the allocator) read journal specs, members and assignments from it instead of etcd.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from aetcd import rpc

from plumbing import metrics
from plumbing.backoff import Backoff

log = logging.getLogger(__name__)

# A batch of at most 1/IN_PLACE_RATIO of the mirror's entries is merged in place when nothing
# else holds the mirror's list (an insertion or deletion moves the entries after it, in C); a
# larger one builds a new list in one pass.
IN_PLACE_RATIO = 16

# Raises on a value that cannot be decoded.
Decoder = Callable[[str, bytes], object]

# A page of the initial range. Pages keep each response well under gRPC's default 4 MiB
# receive limit, which a whole Gazette keyspace can exceed.
_RANGE_PAGE = 1000

# Failures after which retrying the same request can succeed: etcd restarting or unreachable,
# a lost leader (the watch is opened with require-leader), or a stream reset by the server.
_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

# grpc-stubs does not declare the end-of-stream sentinel that StreamStreamCall.read() returns.
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]

# etcd's rpctypes.MetadataRequireLeaderKey: a member partitioned from the majority then fails
# the watch instead of silently stalling it, and the retry can reach a healthy member.
_REQUIRE_LEADER = ("hasleader", "true")


class EtcdClusterChanged(RuntimeError):
    """etcd answered with a different cluster ID than the mirror was built from.

    Revisions of two clusters are unrelated, so the mirror cannot continue from its revision.
    """


@dataclass(frozen=True, slots=True)
class EtcdHeader:
    """The etcd ResponseHeader the mirror is current with.

    `revision` is the mirror's effective revision (as upstream Gazette does), not the store
    revision at which the last response happened to be sent.
    """

    cluster_id: int = 0
    member_id: int = 0
    revision: int = 0
    raft_term: int = 0


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    raw: bytes
    decoded: object
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class Change:
    """Net effect of one applied batch on one key; `None` means absent."""

    key: str
    before: KeyValue | None
    after: KeyValue | None


@dataclass(frozen=True, slots=True)
class Update:
    """One applied batch, as given to observers and returned by `wait_for_update`."""

    revision: int
    # Key-ordered; a key created and deleted within the batch does not appear.
    changes: tuple[Change, ...]
    # Watch events applied (0 for a progress notification or a load).
    events: int
    # True when the whole mirror was replaced by a range read (initial load or after compaction).
    reload: bool


Observer = Callable[[Update], None]


class _StreamBroken(Exception):
    def __init__(self, reason: str, established: bool) -> None:
        super().__init__(reason)
        self.established = established


class _Compacted(Exception):
    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch revision compacted (etcd compacted through {compact_revision})")
        self.compact_revision = compact_revision


def _range_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    # etcd reads "\0" as "no upper bound": the prefix is empty or all 0xff bytes.
    return b"\0"


def _describe(exc: BaseException) -> str:
    # An AioRpcError's str() is a multi-line dump; code and details say it all.
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _last_revision(batch: list[Any]) -> int:
    """The etcd revision a batch of watch responses brings the mirror to."""
    last = batch[-1]
    return int(last.events[-1].kv.mod_revision if last.events else last.header.revision)


def _key(kv: KeyValue) -> str:
    return kv.key


class KeySpace:
    """Mirror of every key under `prefix` (a literal key prefix, as in etcd's WithPrefix).

    `decode(key, value)` turns a raw value into the mirrored representation. A key whose value
    (or UTF-8 key) fails to decode is logged and left out of the mirror, and an update that fails
    to decode removes the key's previous value. Upstream Gazette instead keeps the last good
    value; leaving it out keeps the mirror a pure function of etcd's state at `revision`, so a
    fresh `load()` and a long-running `watch()` always agree.

    Reads (`get`, `prefixed`, `items`) are plain synchronous calls: the mirror is only replaced
    between awaits, so a reader never observes a half-applied batch. The list behind `items` is
    never mutated after it is installed, so holding on to it is a consistent snapshot.
    """

    def __init__(
        self,
        prefix: str,
        decode: Decoder,
        *,
        apply_delay: float = 0.03,
        max_retry_delay: float = 5.0,
        rpc_timeout: float = 10.0,
        unmirrored: str = "",
    ) -> None:
        if apply_delay < 0:
            raise ValueError(f"apply_delay must be >= 0 (got {apply_delay})")
        self.prefix = prefix
        self.apply_delay = apply_delay
        self.max_retry_delay = max_retry_delay
        self.rpc_timeout = rpc_timeout
        self.header = EtcdHeader()
        self._decode = decode
        # Keys under this prefix (inside `prefix`) are left out of the mirror, quietly: values
        # others read from etcd where they need them (a consumer's shard hints), which would
        # otherwise be held in memory and wake every observer each time one is written.
        self._unmirrored = unmirrored
        self._prefix_b = prefix.encode()
        self._end_b = _range_end(self._prefix_b)
        self._kvs: list[KeyValue] = []
        self._revision = 0
        self._observers: list[Observer] = []
        # Created lazily, inside the running loop, by the first waiter of each generation.
        self._next_update: asyncio.Future[Update] | None = None
        # The largest revision a wait_for_revision() caller awaits. A batch reaching it is
        # applied at once instead of after apply_delay: read-your-writes callers (Apply) should
        # not pay the Nagle delay meant for unsolicited changes.
        self._wanted = 0
        # Resolved to wake the watch loop when a new waiter arrives during a pending batch.
        self._wake: asyncio.Future[None] | None = None
        # wait_for_revision() callers, by the revision each awaits (a heap), each woken once,
        # when the mirror reaches it: thousands wait while journals are placed (pulses, peers'
        # Replicate streams), and waking each at every batch was quadratic (issue 26).
        self._revision_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_order = itertools.count()
        self._waiters_gone = 0  # Cancelled waiters still in the heap.

    # ---- reading the mirror -------------------------------------------------------------

    @property
    def revision(self) -> int:
        """Every etcd change under the prefix up to this revision is reflected (0: not loaded)."""
        return self._revision

    @property
    def items(self) -> Sequence[KeyValue]:
        return self._kvs

    def __len__(self) -> int:
        return len(self._kvs)

    def get(self, key: str) -> KeyValue | None:
        i = bisect_left(self._kvs, key, key=_key)
        if i < len(self._kvs) and self._kvs[i].key == key:
            return self._kvs[i]
        return None

    def range(self, start: str, end: str) -> Sequence[KeyValue]:
        """Entries with start <= key < end."""
        lo = bisect_left(self._kvs, start, key=_key)
        return self._kvs[lo : bisect_left(self._kvs, end, lo=lo, key=_key)]

    def prefixed(self, prefix: str) -> Sequence[KeyValue]:
        """Entries whose key starts with `prefix`, in key order."""
        lo = bisect_left(self._kvs, prefix, key=_key)
        n = len(prefix)
        # Truncating sorted keys to n characters keeps them sorted, so the prefixed run ends
        # where truncated keys pass `prefix`.
        hi = bisect_right(self._kvs, prefix, lo=lo, key=lambda kv: kv.key[:n])
        return self._kvs[lo:hi]

    # ---- notification -------------------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Call `observer(update)` after every applied batch.

        Observers run synchronously, after the mirror changed and before any waiter resumes,
        so state derived from the mirror (e.g. routes) is never seen out of step with it. An
        exception from an observer is logged and does not stop the mirror.
        """
        self._observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        self._observers.remove(observer)

    async def wait_for_update(self, timeout: float | None = None) -> Update:
        """Wait for the next batch applied after this call; TimeoutError after `timeout`."""
        if self._next_update is None:
            self._next_update = asyncio.get_running_loop().create_future()
        # shield: a cancelled waiter must not cancel the future other waiters share.
        async with asyncio.timeout(timeout):
            return await asyncio.shield(self._next_update)

    async def wait_for_revision(self, revision: int, timeout: float | None = None) -> None:
        """Return once the mirror reflects etcd through `revision`; TimeoutError after `timeout`.

        Cancelling one waiter does not disturb others.
        """
        if self._revision >= revision:
            return
        if revision > self._wanted:
            self._wanted = revision
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)
        reached = asyncio.get_running_loop().create_future()
        heapq.heappush(self._revision_waiters, (revision, next(self._waiter_order), reached))
        try:
            async with asyncio.timeout(timeout):
                await reached
        finally:
            if not reached.done():
                reached.cancel()
                self._waiters_gone += 1
                if self._waiters_gone > 64 and self._waiters_gone * 2 > len(self._revision_waiters):
                    self._revision_waiters = [w for w in self._revision_waiters if not w[2].done()]
                    heapq.heapify(self._revision_waiters)
                    self._waiters_gone = 0

    def _publish(self, update: Update) -> None:
        for observer in list(self._observers):
            try:
                observer(update)
            except Exception:
                log.exception("keyspace %s: observer %r failed", self.prefix, observer)
        fut, self._next_update = self._next_update, None
        if fut is not None and not fut.done():
            fut.set_result(update)
        waiters = self._revision_waiters
        while waiters and waiters[0][0] <= self._revision:
            reached = heapq.heappop(waiters)[2]
            if reached.done():
                self._waiters_gone = max(0, self._waiters_gone - 1)
            else:
                reached.set_result(None)

    # ---- loading ------------------------------------------------------------------------

    async def load(self, client: Any) -> None:
        """Replace the mirror with a range read of the whole prefix at a single revision.

        `client` is a connected (or connectable) `aetcd.Client`.
        """
        await client.connect()
        while True:
            try:
                header, kvs = await self._range(client)
                break
            except grpc.aio.AioRpcError as exc:
                # Later pages read at the first page's revision; if etcd compacted past it
                # meanwhile, start over at a new revision.
                if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                    raise
                log.info("keyspace %s: range revision compacted mid-load; restarting", self.prefix)
        self._install(header, kvs)

    async def _range(self, client: Any) -> tuple[EtcdHeader, list[KeyValue]]:
        kvs: list[KeyValue] = []
        start, revision = self._prefix_b, 0
        header = EtcdHeader()
        while True:
            rsp = await client.kvstub.Range(
                rpc.RangeRequest(
                    key=start, range_end=self._end_b, revision=revision, limit=_RANGE_PAGE
                ),
                timeout=self.rpc_timeout,
                metadata=client.metadata,
            )
            if revision == 0:
                revision = rsp.header.revision
                header = self._adopt_header(rsp.header, revision)
            for raw in rsp.kvs:
                kv = self._decode_kv(raw)
                if kv is not None:
                    kvs.append(kv)
            if not rsp.more or not rsp.kvs:
                return header, kvs
            # Smallest key after the last one returned.
            start = rsp.kvs[-1].key + b"\0"

    def _install(self, header: EtcdHeader, kvs: list[KeyValue]) -> None:
        old = self._kvs
        changes: list[Change] = []
        i = j = 0
        while i < len(old) or j < len(kvs):
            a = old[i] if i < len(old) else None
            b = kvs[j] if j < len(kvs) else None
            if b is None or (a is not None and a.key < b.key):
                assert a is not None
                changes.append(Change(a.key, a, None))
                i += 1
            elif a is None or b.key < a.key:
                changes.append(Change(b.key, None, b))
                j += 1
            else:
                if a.mod_revision != b.mod_revision:
                    changes.append(Change(a.key, a, b))
                i += 1
                j += 1
        self._kvs = kvs
        self._revision = header.revision
        self.header = header
        self._publish(Update(header.revision, tuple(changes), 0, reload=True))

    # ---- watching -----------------------------------------------------------------------

    async def watch(self, client: Any) -> NoReturn:
        """Keep the mirror current until cancelled; loads first if `load()` was never called.

        Run it in a task you own and cancel that task to stop; the watch stream is closed on
        the way out. A broken stream is re-opened at `revision + 1` after a capped backoff, so
        no event is lost or applied twice. If etcd compacted past that revision meanwhile, the
        whole prefix is re-read instead (deletions while disconnected included). Raises only
        for what retrying cannot fix: a gRPC status outside the transient set (say
        UNAUTHENTICATED), `EtcdClusterChanged`, or the client being closed underneath it.
        """
        await client.connect()
        # First retry is immediate: most breaks are a single blip (a restarted member).
        backoff = Backoff(maximum=self.max_retry_delay, immediate_first=True)
        need_load = self._revision == 0
        while True:
            try:
                if need_load:
                    await self._range_and_install(client)
                    need_load = False
                await self._watch_stream(client)
            except _Compacted as exc:
                log.warning("keyspace %s: %s; reloading the whole prefix", self.prefix, exc)
                need_load = True
                continue
            except _StreamBroken as exc:
                if exc.established:
                    backoff.reset()
                reason = _describe(exc.__cause__ or exc)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _TRANSIENT:
                    raise
                reason = _describe(exc)
            delay = backoff.next_delay()
            metrics.watch_restarts.inc()
            log.warning(
                "keyspace %s: watch failed at revision %d (attempt %d, retrying in %.2fs): %s",
                self.prefix, self._revision, backoff.attempt, delay, reason,
            )  # fmt: skip
            await asyncio.sleep(delay)

    async def _range_and_install(self, client: Any) -> None:
        if client.channel is None:
            raise RuntimeError(f"keyspace {self.prefix}: etcd client was closed while watching")
        await self.load(client)

    async def _watch_stream(self, client: Any) -> NoReturn:
        """Run one watch stream; always ends by raising."""
        if client.channel is None:
            raise RuntimeError(f"keyspace {self.prefix}: etcd client was closed while watching")
        metadata = (*(client.metadata or ()), _REQUIRE_LEADER)
        # wait_for_ready: while etcd is unreachable the call waits for the channel to reconnect
        # rather than failing at once, so the watch resumes as soon as etcd is back instead of
        # at our next backoff tick.
        call = rpc.WatchStub(client.channel).Watch(metadata=metadata, wait_for_ready=True)
        loop = asyncio.get_running_loop()
        batch: list[Any] = []
        deadline = 0.0
        established = False
        read: asyncio.Task[Any] | None = None
        try:
            await call.write(
                rpc.WatchRequest(
                    create_request=rpc.WatchCreateRequest(
                        key=self._prefix_b,
                        range_end=self._end_b,
                        start_revision=self._revision + 1,
                        # Keeps our resume revision recent across long idle periods, so a
                        # retry after a break is less likely to land on a compacted revision.
                        progress_notify=True,
                    )
                )
            )
            while True:
                if read is None:
                    # A read is never cancelled by a timeout (that would cancel the whole
                    # call), so it lives in its own task that outlasts apply_delay waits.
                    read = asyncio.ensure_future(call.read())
                timeout = max(0.0, deadline - loop.time()) if batch else None
                if batch and self._wake is None:
                    self._wake = loop.create_future()
                waits = (read, self._wake) if batch and self._wake is not None else (read,)
                done, _ = await asyncio.wait(waits, timeout=timeout)
                if not done or (read not in done and _last_revision(batch) >= self._wanted):
                    applying, batch, self._wake = batch, [], None
                    self._apply(applying)
                    continue
                if read not in done:
                    self._wake = None  # Woken for a revision this batch does not reach yet.
                    continue
                if read.cancelled():
                    # We did not cancel it (our own cancellation lands in asyncio.wait), so
                    # grpc did: the client's channel was closed.
                    raise RuntimeError(
                        f"keyspace {self.prefix}: etcd client was closed while watching"
                    )
                rsp, read = read.result(), None
                if rsp is _EOF:
                    raise _StreamBroken("watch stream closed by etcd", established)
                self._check_cluster(rsp.header)
                if rsp.compact_revision:
                    raise _Compacted(rsp.compact_revision)
                if rsp.canceled:
                    raise _StreamBroken(f"watch canceled by etcd: {rsp.cancel_reason}", established)
                if rsp.created:
                    established = True
                    continue
                batch.append(rsp)
                if self.apply_delay == 0 or _last_revision(batch) >= self._wanted > self._revision:
                    applying, batch, self._wake = batch, [], None
                    self._apply(applying)
                elif len(batch) == 1:
                    deadline = loop.time() + self.apply_delay
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _TRANSIENT:
                raise
            raise _StreamBroken("watch stream failed", established) from exc
        finally:
            if read is not None:
                read.cancel()
                await asyncio.wait((read,))
                if not read.cancelled():
                    read.exception()  # Retrieved, so asyncio does not log it as lost.
            call.cancel()
            # grpc finishes a cancelled call in a task of its own; waiting for the final status
            # (immediate after cancel) means stopping the watch leaves nothing behind.
            await call.code()
            # Fully received responses are valid whatever ended the stream; applying them
            # now lets the retry resume after them. Not when cancelled: stopping must not
            # run observers.
            task = asyncio.current_task()
            if batch and not (task is not None and task.cancelling()):
                applying, batch = batch, []
                self._apply(applying)

    def _apply(self, responses: list[Any]) -> None:
        revision = self._revision
        pending: dict[str, KeyValue | None] = {}
        events = 0
        for rsp in responses:
            if not rsp.events:
                # A progress notification: etcd sends these only to a watcher that has caught
                # up, and promises every later event is above its revision.
                revision = max(revision, rsp.header.revision)
                continue
            # The response header is not a safe mark here: while catching up etcd stamps
            # partial batches with its current revision. The events' revisions are.
            floor = revision
            for ev in rsp.events:
                if ev.kv.mod_revision <= floor:
                    log.error("keyspace %s: ignoring replayed event %s", self.prefix, ev.kv)
                    continue
                revision = max(revision, ev.kv.mod_revision)
                events += 1
                try:
                    key = ev.kv.key.decode()
                except UnicodeDecodeError:
                    log.error("keyspace %s: ignoring non-UTF-8 key %r", self.prefix, ev.kv.key)
                    continue
                if ev.type == rpc.Event.EventType.PUT:
                    pending[key] = self._decode_kv(ev.kv, key)
                else:
                    pending[key] = None
        header = self._adopt_header(responses[-1].header, revision)
        changes = self._merge(pending)
        self._revision = revision
        self.header = header
        self._publish(Update(revision, changes, events, reload=False))

    def _merge(self, pending: dict[str, KeyValue | None]) -> tuple[Change, ...]:
        # A list handed out by `items` (to the allocator's solver, or an iteration across an
        # await) must stay a consistent snapshot: while anyone holds it, the batch goes into
        # a new list. Held by the mirror alone (its attribute and getrefcount's argument), it
        # is changed in place: a batch of a few keys then costs a few bisects, not a copy of
        # every entry (at 50,000 journals, 200,000 entries copied per batch of pulses'
        # assignment writes took a third of each broker's time).
        if sys.getrefcount(self._kvs) <= 2 and len(pending) * IN_PLACE_RATIO < len(self._kvs):
            return self._merge_in_place(pending)
        old, new = self._kvs, []
        changes: list[Change] = []
        i = 0
        for key in sorted(pending):
            j = bisect_left(old, key, lo=i, key=_key)
            new.extend(old[i:j])
            before: KeyValue | None = None
            if j < len(old) and old[j].key == key:
                before, j = old[j], j + 1
            i = j
            after = pending[key]
            if after is not None:
                new.append(after)
            if before is not None or after is not None:
                changes.append(Change(key, before, after))
        new.extend(old[i:])
        self._kvs = new
        return tuple(changes)

    def _merge_in_place(self, pending: dict[str, KeyValue | None]) -> tuple[Change, ...]:
        kvs = self._kvs
        changes: list[Change] = []
        for key in sorted(pending):
            j = bisect_left(kvs, key, key=_key)
            before = kvs[j] if j < len(kvs) and kvs[j].key == key else None
            after = pending[key]
            if before is not None and after is not None:
                kvs[j] = after
            elif before is not None:
                del kvs[j]
            elif after is not None:
                kvs.insert(j, after)
            if before is not None or after is not None:
                changes.append(Change(key, before, after))
        return tuple(changes)

    def _decode_kv(self, raw: Any, key: str | None = None) -> KeyValue | None:
        try:
            if key is None:
                key = raw.key.decode()
            if self._unmirrored and key.startswith(self._unmirrored):
                return None
            decoded = self._decode(key, raw.value)
        except Exception as exc:
            log.error(
                "keyspace %s: key %r (mod_revision %d) failed to decode and is left out: %s",
                self.prefix, raw.key, raw.mod_revision, exc,
            )  # fmt: skip
            return None
        assert key is not None
        return KeyValue(
            key=key,
            raw=raw.value,
            decoded=decoded,
            create_revision=raw.create_revision,
            mod_revision=raw.mod_revision,
            version=raw.version,
            lease=raw.lease,
        )

    def _check_cluster(self, header: Any) -> None:
        if self.header.cluster_id and header.cluster_id != self.header.cluster_id:
            raise EtcdClusterChanged(
                f"keyspace {self.prefix}: etcd cluster ID changed from "
                f"{self.header.cluster_id} to {header.cluster_id}"
            )

    def _adopt_header(self, header: Any, revision: int) -> EtcdHeader:
        """`header` as the mirror's header at `revision`, once checked against the current one."""
        self._check_cluster(header)
        if self.header.cluster_id and (
            header.member_id != self.header.member_id or header.raft_term != self.header.raft_term
        ):
            log.info(
                "keyspace %s: etcd member/raft term now %d/%d (was %d/%d)",
                self.prefix, header.member_id, header.raft_term,
                self.header.member_id, self.header.raft_term,
            )  # fmt: skip
        return EtcdHeader(header.cluster_id, header.member_id, revision, header.raft_term)
