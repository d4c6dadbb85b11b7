"""A shard's transactions, as upstream runs them (the exactly-once design's consumer loop).

`run_shard` restores the store's checkpoint, appends again the ACK intents it recorded (their
appends may not have happened before the last primary stopped), reads every source journal
read-uncommitted from the checkpoint's offsets (or `min_offset`) and sequences what it reads, so
that the application sees each committed message once. Messages go to the application in
transactions:

* A transaction begins with its first message and goes on while there is input, until the
  shard's `min_txn_duration` has passed, the previous transaction has committed and its ACKs
  are written, and, unless `disable_wait_for_ack`, no span of pending messages read in it still
  waits for its ACK (waiting is bounded by `max_txn_duration`). It then closes at the first
  stall of its input. At `max_txn_duration` it stops reading and closes as soon as it may.
* Closing it: the application's `finalize_txn`; a checkpoint of the offsets read through, the
  producers' states (pruned after 24 h) and the publisher's ACK intents; the store's commit of
  that checkpoint with the application's state, made durable only once every append the
  transaction made has committed. Only after the commit are the ACK intents appended: readers
  then see the transaction's messages committed.
* Transactions overlap: the next consumes while the previous commits. A store that chains its
  commits (`pipelined_commits` above 1, as the recorded SQLite store) may have that many commits
  in flight: a transaction then closes and starts its commit without waiting for the previous
  one to be durable, and commits that queue behind a slow one reach the log in one append. A
  transaction's ACKs and progress still follow every earlier transaction's, and its commit is
  durable only after theirs.

A message the application defers (`DeferToNextTransaction`) ends the transaction and begins
the next. Progress (`read_through`, `publish_at`) is what Stat reports.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker.client.append_service import AppendService
from broker.client.appender import AppendError
from broker.client.reader import ReadError, read_retrying
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from consumer.checkpoint import build_checkpoint, producer_states_of, read_through_of
from consumer.hooks import AppHooks, StoreHooks
from consumer.protocol import cpb
from consumer.store import Store
from message.framing import FrameReader, Framing
from message.publisher import Publisher, Reader, chunk_envelopes
from message.sequencer import COMMITTING, Envelope, QueueOutcome, Sequencer
from message.types import MessageType
from plumbing import metrics
from plumbing.tasks import first_of

__all__ = [
    "Application",
    "DeferToNextTransaction",
    "Progress",
    "Shard",
    "Source",
    "run_shard",
]

log = logging.getLogger(__name__)

# Producers not seen for this long are pruned from checkpoints (upstream's horizon).
PRUNE_HORIZON = 24 * 3600.0
DEFAULT_READ_CHANNEL_SIZE = 8192
DEFAULT_RING_BUFFER_SIZE = 8192


class DeferToNextTransaction(Exception):
    """Raised by `consume_message`: this message belongs to the next transaction."""


@dataclass
class Progress:
    """What the shard has committed: per source the offset read through, per journal it
    published to the offset its last ACK ended at. `changed` is set at each update."""

    read_through: dict[str, int] = field(default_factory=dict)
    # The last write head of each source its reader saw (for the lag metric).
    write_heads: dict[str, int] = field(default_factory=dict)
    publish_at: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The offsets the commit in flight will report once its ACKs are written; what is read
    # meanwhile and belongs to no transaction (duplicates, rollbacks) is added there, so it is
    # not reported read before the messages ahead of it are committed.
    committing: dict[str, int] | None = None

    def read_past(self, journal: str, offset: int) -> None:
        """Report `journal` read through `offset` by a message no transaction takes."""
        if self.committing is not None:
            self.committing[journal] = max(self.committing.get(journal, 0), offset)
        else:
            self.update({journal: offset}, {})

    def update(self, read_through: Mapping[str, int], publish_at: Mapping[str, int]) -> None:
        # Never backwards: a duplicate read past a commit in flight is reported before it.
        for journal, offset in read_through.items():
            self.read_through[journal] = max(self.read_through.get(journal, 0), offset)
        for journal, offset in publish_at.items():
            self.publish_at[journal] = max(self.publish_at.get(journal, 0), offset)
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_for(self, read_through: Mapping[str, int]) -> None:
        """Return once every given source was read through its offset."""
        while any(self.read_through.get(j, 0) < o for j, o in read_through.items()):
            await self.changed.wait()


@dataclass
class Source:
    """A source journal as the shard reads it: its name, its message type and framing, and
    the offset to start from when the checkpoint has none (`min_offset`)."""

    journal: str
    messages: MessageType[Any]
    framing: Framing
    min_offset: int = 0


@dataclass
class Shard:
    """What the application sees of a shard: its spec and the means to publish; `fqn`, its
    fully-qualified name (its etcd item key, as upstream's), names its state in a shared store;
    with a recovery log, `recorder` records its local directory (`recorder.directory`), where
    a store such as SQLiteStore keeps its files."""

    spec: cpb.ShardSpec
    service: AppendService
    publisher: Publisher[Any]
    progress: Progress = field(default_factory=Progress)
    fqn: str = ""
    recorder: Any = None


class Application(Protocol):
    """A consumer application. `consume_message` may change the store and publish through the
    publisher (uncommitted: the transaction's ACK intents commit what it published);
    `finalize_txn` is the last chance to do both before the commit. Optional hooks:
    `begin_txn(shard, store)` as a transaction begins, `finished_txn(shard, store, committed)`
    once it starts to commit (`committed` resolves with its commit)."""

    async def consume_message(
        self, shard: Shard, store: Any, envelope: Envelope, publisher: Publisher[Any]
    ) -> None: ...

    async def finalize_txn(self, shard: Shard, store: Any, publisher: Publisher[Any]) -> None: ...


def _duration(d: Any) -> float:  # A google.protobuf.Duration.
    seconds: float = float(d.seconds) + d.nanos / 1e9
    return seconds


# ---- reading ----------------------------------------------------------------------------------


def _count(shard: Shard, txn: _Txn, read_through: Mapping[str, int], seconds: float) -> None:
    """A transaction in the shard's metrics: its messages, bytes, read heads and lag."""
    shard_id = shard.spec.id
    metrics.shard_transactions.labels(shard_id).inc()
    metrics.shard_read_messages.labels(shard_id).inc(txn.consumed)
    metrics.shard_read_bytes.labels(shard_id).inc(txn.consumed_bytes)
    metrics.shard_transaction_seconds.labels(shard_id).observe(max(0.0, seconds))
    for journal, offset in read_through.items():
        metrics.shard_read_head.labels(shard_id, journal).set(offset)
        head = shard.progress.write_heads.get(journal, 0)
        metrics.shard_lag_bytes.labels(shard_id, journal).set(max(0, head - offset))


async def _read_source(
    stubs: Callable[[], pb_grpc.JournalStub],
    source: Source,
    offset: int,
    into: asyncio.Queue[list[Envelope] | BaseException],
    write_heads: dict[str, int] | None = None,
) -> None:
    """Read `source` from `offset` for good (retrying), putting batches of envelopes on `into`;
    a failure is put there too, for the transaction loop to raise."""
    reader = Reader(source.messages, source.framing)
    frames = FrameReader(source.framing)
    try:
        async for chunk in read_retrying(stubs, source.journal, offset, block=True):
            if write_heads is not None and chunk.write_head:
                write_heads[source.journal] = chunk.write_head
            batch = chunk_envelopes(reader, frames, source.journal, chunk.offset, chunk.content)
            if batch:
                await into.put(batch)
    except asyncio.CancelledError:
        raise
    except (ReadError, Exception) as exc:
        await into.put(exc)


async def _replay(
    stubs: Callable[[], pb_grpc.JournalStub], source: Source, begin: int, end: int
) -> list[Envelope]:
    """Envelopes of [begin, end) of a source, read again for a commit that left the ring."""
    reader = Reader(source.messages, source.framing)
    frames = FrameReader(source.framing)
    out: list[Envelope] = []
    async for chunk in read_retrying(stubs, source.journal, begin, block=True):
        out.extend(chunk_envelopes(reader, frames, source.journal, chunk.offset, chunk.content))
        if chunk.offset + len(chunk.content) >= end:
            break
    return [e for e in out if e.begin < end]


# ---- the loop --------------------------------------------------------------------------------


class _Input:
    """What the readers put on the queue, and the envelopes taken from it but not yet
    sequenced (a transaction may close in the middle of a batch; the next goes on from there)."""

    def __init__(self, queue: asyncio.Queue[list[Envelope] | BaseException]) -> None:
        self.queue = queue
        self.pending: collections.deque[Envelope] = collections.deque()

    def take(self, item: list[Envelope] | BaseException) -> None:
        if isinstance(item, BaseException):
            raise item  # A source that cannot be read fails the shard.
        self.pending.extend(item)


@dataclass
class _Txn:
    """The state of one transaction."""

    consumed: int = 0
    consumed_bytes: int = 0
    began_at: float = 0.0
    reading: bool = True
    min_done: bool = False
    max_done: bool = False


async def run_shard(
    shard: Shard,
    app: Application,
    store: Store,
    sources: Sequence[Source],
    stubs: Callable[[], pb_grpc.JournalStub],
    *,
    recovery_log: str = "",
    now: Callable[[], float] = time.monotonic,
    restored: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run the shard's transactions until cancelled (or until a failure, which it raises: the
    shard is then FAILED). Cancellation abandons the open transaction; a commit in flight is
    awaited only if already durable-bound (its store write), never half-applied. `restored`
    runs once the store is fenced and its checkpoint restored (the runtime advertises PRIMARY
    then, as upstream does)."""
    spec = shard.spec
    hooks, store_hooks = AppHooks.of(app), StoreHooks.of(store)
    checkpoint = await store.restore_checkpoint()
    if restored is not None:
        await restored()
    offsets = read_through_of(checkpoint)
    for source in sources:
        offsets[source.journal] = max(offsets.get(source.journal, 0), source.min_offset)
    sequencer = Sequencer(
        producer_states_of(checkpoint),
        offsets=offsets,
        ring_size=spec.ring_buffer_size or DEFAULT_RING_BUFFER_SIZE,
    )
    shard.progress.update(read_through_of(checkpoint), {})
    queue: asyncio.Queue[list[Envelope] | BaseException] = asyncio.Queue(
        maxsize=max(1, (spec.read_channel_size or DEFAULT_READ_CHANNEL_SIZE) // 64)
    )

    async with asyncio.TaskGroup() as tasks:
        # ACK intents of the recovered checkpoint: written again (idempotent for readers).
        acks = [
            shard.service.write_nowait(journal, intent)
            for journal, intent in checkpoint.ack_intents.items()
        ]
        loop = _TransactionLoop(
            shard, app, hooks, store, sequencer, _Input(queue), sources, stubs, tasks,
            depth=store_hooks.pipelined_commits, recovery_log=recovery_log, now=now,
        )  # fmt: skip
        loop.inflight.append(tasks.create_task(_await_acks(shard, acks, {}, recovered=True)))
        for source in sources:
            tasks.create_task(
                _read_source(
                    stubs, source, offsets[source.journal], queue, shard.progress.write_heads
                ),
                name=source.journal,
            )
        # Runs until cancelled or failed; either way the group cancels the readers and commits.
        while True:
            await loop.transaction()


async def _await_acks(
    shard: Shard,
    acks: Sequence[Awaitable[Any]],
    read_through: dict[str, int],
    *,
    recovered: bool = False,
    committed: Awaitable[None] | None = None,
    after: asyncio.Task[None] | None = None,
) -> None:
    """Wait for the commit (if any), then for each ACK append; then signal progress. With
    `after` (the commit in flight before this one), its own progress comes only after that one's:
    if that one fails, the shard fails with its error, and this one reports nothing."""
    if after is not None:
        try:
            await asyncio.shield(after)
        except BaseException:
            return  # The shard fails (or stops) for that one's reason.
    if committed is not None:
        await committed
    publish_at: dict[str, int] = {}
    for ack in acks:
        try:
            span = await ack
        except AppendError as exc:
            if recovered and exc.status == pb.JOURNAL_NOT_FOUND:
                log.warning("discarding the recovered ACK intent of %s: no such journal", exc)
                continue
            raise
        publish_at[span.journal] = span.end
    if shard.progress.committing is read_through:
        shard.progress.committing = None
    shard.progress.update(read_through, publish_at)


class _TransactionLoop:
    """A shard's transactions, one after another (`transaction`), with the commits in flight
    (`inflight`, oldest first, at most `depth` once a transaction starts its commit). Each
    commit's task, and its ACKs', belong to the shard's task group (`tasks`)."""

    def __init__(
        self,
        shard: Shard,
        app: Application,
        hooks: AppHooks,
        store: Store,
        sequencer: Sequencer,
        source_input: _Input,
        sources: Sequence[Source],
        stubs: Callable[[], pb_grpc.JournalStub],
        tasks: asyncio.TaskGroup,
        *,
        depth: int,
        recovery_log: str,
        now: Callable[[], float],
    ) -> None:
        self.shard, self.app, self.hooks, self.store = shard, app, hooks, store
        self.sequencer, self.input, self.stubs, self.tasks = sequencer, source_input, stubs, tasks
        self.sources = {s.journal: s for s in sources}
        self.inflight: collections.deque[asyncio.Task[None]] = collections.deque()
        self.depth, self.recovery_log, self.now = depth, recovery_log, now
        spec = shard.spec
        self.min_dur = _duration(spec.min_txn_duration)
        self.max_dur = _duration(spec.max_txn_duration)
        self.wait_for_ack = not spec.disable_wait_for_ack
        self.txn = _Txn()

    # ---- one transaction ----------------------------------------------------------------

    async def transaction(self) -> None:
        """Run one transaction, and add the task that commits it and appends its ACKs to
        `inflight`."""
        txn = self.txn = _Txn()
        sequencer, pending, queue = self.sequencer, self.input.pending, self.input.queue
        if sequencer.dequeued is not None:
            # The last transaction ended on a deferred message: it begins this one.
            await self._consume(sequencer.dequeued)
            await _dequeue_rest(sequencer, self._consume)

        while True:
            self._reap()  # A failed commit (or an ACK that failed) fails the shard.
            self._tick()
            if txn.reading and pending:
                envelope = pending.popleft()
                outcome = sequencer.queue_uncommitted(envelope)
                if outcome in COMMITTING:
                    if not await _dequeue(sequencer, self._consume, self.sources, self.stubs):
                        break  # Deferred: the next transaction begins with it.
                    if txn.consumed == 0:
                        # An ACK that committed nothing to consume (an aborted transaction's,
                        # say): read, and no transaction's to report.
                        self.shard.progress.read_past(envelope.journal, envelope.end)
                elif txn.consumed == 0 and outcome in _DUPLICATES:
                    # Read, and never to be part of a transaction: report it read, so that a
                    # Stat waiting for it does not wait for good.
                    self.shard.progress.read_past(envelope.journal, envelope.end)
                continue
            if txn.reading and not pending:
                try:
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    item = None
                if item is not None:
                    self.input.take(item)
                    continue
            if not self._blocks():
                break  # Input stalled (or reading is over): commit.
            # Wait for input, the next deadline, or the oldest commit in flight.
            getting = txn.reading and not pending
            waits: list[Awaitable[Any]] = [queue.get()] if getting else []
            if running := self._unfinished():
                waits.append(running[0])
            until = self._deadline()
            timeout = None if until is None else max(0.0, until - self.now())
            if waits or timeout is not None:
                done = await first_of(*waits, timeout=timeout)
                if getting and done[0].done() and not done[0].cancelled():
                    self.input.take(done[0].result())

        if txn.consumed:
            await self._commit()

    def _deadline(self) -> float | None:
        txn = self.txn
        if txn.consumed == 0:
            return None
        if not txn.min_done:
            return txn.began_at + self.min_dur
        if not txn.max_done:
            return txn.began_at + self.max_dur
        return None

    def _tick(self) -> None:
        txn = self.txn
        if txn.consumed == 0:
            return
        t = self.now()
        if not txn.min_done and t >= txn.began_at + self.min_dur:
            txn.min_done = True
        if not txn.max_done and t >= txn.began_at + self.max_dur:
            txn.max_done = True
            txn.reading = False

    def _unfinished(self) -> list[asyncio.Task[None]]:
        return [task for task in self.inflight if not task.done()]

    def _reap(self) -> None:
        """Drop the commits done, oldest first; the failure of one fails the shard."""
        while self.inflight and self.inflight[0].done():
            self.inflight.popleft().result()

    def _blocks(self) -> bool:
        """Whether the transaction waits (for input, its minimum duration, its ACKs' commit,
        or room among the commits in flight) rather than commit now."""
        txn = self.txn
        if len(self._unfinished()) >= self.depth:
            return True
        if not txn.reading and txn.consumed == 0:
            return False
        return (
            txn.consumed == 0
            or not txn.min_done
            or (
                self.wait_for_ack
                and txn.reading
                and not txn.max_done
                and self.sequencer.has_pending()
            )
        )

    async def _consume(self, envelope: Envelope) -> bool:
        """The application consumes one committed message; False if it deferred it."""
        txn, shard = self.txn, self.shard
        if txn.consumed == 0:
            if self.hooks.begin_txn is not None:
                await self.hooks.begin_txn(shard, self.store)
            txn.began_at = self.now()
            shard.publisher.clock.update()  # The message clock follows wall time.
        try:
            await self.app.consume_message(shard, self.store, envelope, shard.publisher)
        except DeferToNextTransaction:
            if txn.consumed == 0:
                raise RuntimeError(
                    "the application deferred the first message of a transaction"
                ) from None
            txn.reading = False
            return False
        txn.consumed += 1
        txn.consumed_bytes += envelope.end - envelope.begin
        return True

    async def _commit(self) -> None:
        """Finalize the transaction and start its commit, then its ACKs after it."""
        shard, store, txn = self.shard, self.store, self.txn
        # Room for this commit: the oldest ones first (their failure is ours).
        while len(running := self._unfinished()) >= self.depth:
            await running[0]
        self._reap()
        await self.app.finalize_txn(shard, store, shard.publisher)
        states = self.sequencer.checkpoint(PRUNE_HORIZON)
        read_through = self.sequencer.offsets
        shard.progress.committing = read_through
        _count(shard, txn, read_through, self.now() - txn.began_at)
        intents = shard.publisher.build_ack_intents()
        checkpoint = build_checkpoint(read_through, states, intents)
        log_ = self.recovery_log
        wait_for = shard.service.pending_except(*([log_] if log_ else []))
        # The snapshot is taken now; the commit's completion belongs to the shard's task group,
        # so a shard that stops (cancelled anywhere from here on) has no commit still running.
        committed = self.tasks.create_task(
            _durable(store.start_commit(checkpoint, wait_for)), name="store commit"
        )
        if self.hooks.finished_txn is not None:
            await self.hooks.finished_txn(shard, store, committed)
        # Queued now, ahead of the next transaction's messages to the same journals (an ACK
        # must precede them: readers roll back what a producer wrote past its ACK's clock
        # before the ACK), and appended once the commit is durable.
        acks = [shard.service.write_after(journal, intent, committed) for journal, intent in intents]  # fmt: skip
        after = self.inflight[-1] if self.inflight else None
        self.inflight.append(
            self.tasks.create_task(
                _await_acks(shard, acks, read_through, committed=committed, after=after),
                name="commit",
            )
        )


async def _durable(commit: Awaitable[None]) -> None:
    await commit


_DUPLICATES = frozenset(
    {
        QueueOutcome.ACK_ROLLBACK,
        QueueOutcome.CONTINUE_ALREADY_ACKED,
        QueueOutcome.CONTINUE_TXN_CLOCK_LARGER,
        QueueOutcome.OUTSIDE_ALREADY_ACKED,
    }
)


async def _dequeue(
    sequencer: Sequencer,
    consume: Callable[[Envelope], Awaitable[bool]],
    sources: Mapping[str, Source],
    stubs: Callable[[], pb_grpc.JournalStub],
) -> bool:
    """Hand every committed message to `consume` (ACKs skipped); False if one was deferred
    (it stays `dequeued` for the next transaction)."""
    replay = sequencer.replay_range()
    if replay is not None:
        journal, begin, end = replay
        sequencer.start_replay(await _replay(stubs, sources[journal], begin, end))
    return await _dequeue_rest(sequencer, consume)


async def _dequeue_rest(
    sequencer: Sequencer, consume: Callable[[Envelope], Awaitable[bool]]
) -> bool:
    """As `_dequeue`, once any replay has started (or for the rest after a deferral)."""
    while (envelope := sequencer.step()) is not None:
        if envelope.is_ack:
            continue
        if not await consume(envelope):
            return False
    return True
