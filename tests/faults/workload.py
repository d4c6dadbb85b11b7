"""The fault campaign's workload, every operation recorded in the History:

* appenders of unique records, one Append RPC per record, each to a broker picked at random
  (which proxies to the primary);
* two register writers on one journal that take the register `owner` in turn and append only
  while they hold it (`check_registers`);
* a torn appender that streams part of a record and abandons the call, which must roll back;
* publishers of messages through AppendService: committed ones, and transactions that commit
  or abort across two journals;
* tailing readers of every journal, raw; on the message journals also read-committed;
* crowds on a journal with `max_append_rate`: waves of 32 to 100 clients at once, each making
  one to three appends of 1 to 64 KiB (what brokers commit in groups), half of the waves queued
  behind a held append (a slow round), after which every replica of the journal is asked its
  write head (they must agree: nothing else appends to it);
* rounds of leavers on another rate-limited journal: a held append (streamed, larger than what
  brokers group) takes the journal's pipeline and holds it for seconds before its commit, and
  meanwhile small appends give up (a short deadline; a streamed call cancelled after its
  commit, as an upstream Go client's; or cancelled before it) and are written again through
  AppendService.

Clients retry nothing themselves (AppendService excepted, as applications use it, and the
leavers' records, which go once more through it): any other record twice in a journal is a
broker's doing, and a leaver's record is in the journal once, at its retry's offsets, unless its
first attempt was proposed before its client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

import grpc

from broker.client.append_service import AppendService
from broker.client.appender import AppendError, append
from broker.client.reader import Chunk, read
from broker.protocol import protocol_pb2 as pb
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher
from message.types import DictMessages
from tests.faults.checker import CommittedReader, message_id
from tests.faults.harness import CONTENT_TYPE, Cluster, describe
from tests.faults.history import (
    CHECKED,
    CROWD,
    FAIL,
    HELD,
    INFO,
    LEFT,
    OK,
    RETRY,
    TAKEOVER,
    TORN,
    AppendOp,
    Delivery,
    HeadSample,
    History,
    Publish,
    ReadChunk,
    Txn,
)

T = TypeVar("T")

APPEND_TIMEOUT = 5.0  # A paused or partitioned broker holds a call: give up on it (info).
READ_IDLE = 4.0  # A tailing read with nothing new for this long is re-opened elsewhere.
SETTLE_TIMEOUT = 15.0  # How long a publisher waits for its batch or commit.
CROWD_TIMEOUT = 15.0  # A crowd's append waits its turn behind groups of 6 MiB at 2 MiB/s.
# Brokers read an append whole, and may commit it in a group, below this size (WHOLE_APPEND).
SMALL = 64 << 10
# How long a held append holds the pipeline, and the largest patience of a leaver, which
# starts 0.3 s after it: every leaver has given up at least 1 s (the checker's margin) before
# the held append sends its commit.
HOLD = (2.4, 3.0)
PATIENCE = (0.1, 0.6)
CROWD_BYTES = 16 << 20  # What the crowds write in a run, at most (and one wave more).


async def settle(awaitable: Awaitable[T], timeout: float) -> T:
    """Await `awaitable` for at most `timeout`, without cancelling it on timeout (an
    AppendService batch must not be cancelled by one waiter giving up)."""

    async def wait() -> T:
        return await awaitable

    task = asyncio.ensure_future(wait())
    # Its outcome is retrieved even when nobody waits any more.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.wait_for(asyncio.shield(task), timeout)


class Workload:
    def __init__(
        self,
        cluster: Cluster,
        history: History,
        seed: int,
        *,
        raw_journals: list[str],
        message_journals: list[str],
        register_journal: str = "",
        publishers: int = 2,
        torn: bool = True,
        pace: float = 0.03,
        crowd_journal: str = "",
        leave_journal: str = "",
        crowd: tuple[int, int] = (32, 100),
    ) -> None:
        self.cluster = cluster
        self.history = history
        self.seed = seed
        self.raw_journals = raw_journals
        self.message_journals = message_journals
        self.register_journal = register_journal
        self.publishers = publishers
        self.torn = torn
        self.pace = pace  # Mean pause between one client's operations.
        self.crowd_journal = crowd_journal
        self.leave_journal = leave_journal
        self.crowd = crowd  # How many clients a crowd's wave has at once (least, most).
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []  # Writers: they finish what they began.
        self._readers: list[asyncio.Task[None]] = []
        history.raw_journals = list(raw_journals)
        history.message_journals = list(message_journals)
        history.register_journal = register_journal
        history.round_journals = [j for j in (crowd_journal, leave_journal) if j]

    def _rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}/{name}")

    def _stub(self, rng: random.Random) -> Any:
        return self.cluster.dialer.journal_stub(rng.choice(self.cluster.addresses()))

    async def _pause(self, rng: random.Random) -> None:
        await asyncio.sleep(rng.uniform(0, 2 * self.pace))

    def start(self) -> None:
        spawn = self._spawn
        rounds = self.history.round_journals
        steady = [j for j in self.raw_journals if j not in rounds]
        for i, journal in enumerate(steady):
            spawn(self._appender(f"w{i}", journal), f"appender w{i}")
            spawn(self._tail(f"reader-{i}", journal, committed=False), f"reader {i}", True)
        if self.register_journal:
            for name, other in (("reg-a", "reg-b"), ("reg-b", "reg-a")):
                spawn(self._register_writer(name, other), name)
        if self.torn:
            spawn(self._torn_appender("torn", steady[-1]), "torn")
        for i in range(self.publishers):
            spawn(self._publisher(f"pub{i}"), f"publisher {i}")
        for i, journal in enumerate(self.message_journals):
            spawn(self._tail(f"rc-{i}", journal, committed=True), f"committed reader {i}", True)
        if self.crowd_journal:
            spawn(self._crowds(self.crowd_journal), "crowds")
            spawn(self._tail("reader-crowd", self.crowd_journal, committed=False), "reader crowd", True)  # fmt: skip
        if self.leave_journal:
            spawn(self._leavers(self.leave_journal), "leavers")
            spawn(self._tail("reader-leave", self.leave_journal, committed=False), "reader leave", True)  # fmt: skip
        self.history.workload_began = self.history.now()

    def _spawn(self, coro: Any, name: str, reader: bool = False) -> None:
        (self._readers if reader else self._tasks).append(asyncio.create_task(coro, name=name))

    async def stop(self, timeout: float = 20) -> None:
        """Stop every client: writers finish their current operation (bounded), readers are
        cancelled. Anything unsettled is left `info`."""
        self.stopping.set()
        self.history.workload_ended = self.history.now()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        done, pending = (
            await asyncio.wait(self._tasks, timeout=timeout) if self._tasks else (set(), set())
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                self.history.note(f"workload task {task.get_name()} failed: {task.exception()!r}")

    # ---- raw appends ----------------------------------------------------------------------

    def _record(self, op: AppendOp) -> AppendOp:
        op.invoked = self.history.now()
        self.history.appends.append(op)
        return op

    async def _append(
        self,
        op: AppendOp,
        rng: random.Random,
        timeout: float = APPEND_TIMEOUT,
        stub: Any = None,
        **options: Any,
    ) -> None:
        try:
            response = await append(
                stub or self._stub(rng), op.journal, op.payload, timeout=timeout, **options
            )
        except AppendError as exc:
            op.outcome, op.error = FAIL, pb.Status.Name(exc.status)
        except asyncio.CancelledError:
            op.error = "cancelled"
            raise
        except Exception as exc:
            op.outcome, op.error = INFO, describe(exc)
            if _deadline(exc):
                op.left = self.history.now()  # The client gave up: see AppendOp.left.
        else:
            op.outcome, op.begin, op.end = OK, response.commit.begin, response.commit.end
        finally:
            op.completed = self.history.now()

    @staticmethod
    def _payload(rng: random.Random, client: str, kind: str, seq: int) -> bytes:
        pad = rng.randrange(0, 300)
        return f"{kind} {client} {seq} {rng.getrandbits(48):012x} {'.' * pad}\n".encode()

    async def _appender(self, client: str, journal: str) -> None:
        rng = self._rng(client)
        seq = 0
        while not self.stopping.is_set():
            op = self._record(AppendOp(journal, client, self._payload(rng, client, "p", seq)))
            seq += 1
            await self._append(op, rng)
            if op.outcome != OK:
                await asyncio.sleep(0.1)
            await self._pause(rng)

    async def _register_writer(self, client: str, other: str) -> None:
        rng = self._rng(client)
        journal = self.register_journal
        mine = pb.LabelSet(labels=[pb.Label(name="owner", value=client)])
        theirs = pb.LabelSet(labels=[pb.Label(name="owner", value=other)])
        selector = pb.LabelSelector(include=mine)
        seq = 0
        while not self.stopping.is_set():
            if rng.random() < 0.15:
                payload = self._payload(rng, client, "T", seq)
                op = self._record(AppendOp(journal, client, payload, TAKEOVER))
                await self._append(op, rng, union_registers=mine, subtract_registers=theirs)
            else:
                payload = self._payload(rng, client, "C", seq)
                op = self._record(AppendOp(journal, client, payload, CHECKED))
                await self._append(op, rng, check_registers=selector)
            seq += 1
            await asyncio.sleep(rng.uniform(0, 6 * self.pace))

    async def _torn_appender(self, client: str, journal: str) -> None:
        """Appends abandoned mid-stream: part of the record reaches the brokers (and their
        peers), then the client goes away, which must roll the append back everywhere."""
        rng = self._rng(client)
        seq = 0
        while not self.stopping.is_set():
            payload = self._payload(rng, client, "X", seq)
            seq += 1
            op = self._record(AppendOp(journal, client, payload, TORN))
            cut = rng.randrange(1, len(payload))
            hold = rng.uniform(0.02, 0.3)

            async def content(
                payload: bytes = payload, cut: int = cut, hold: float = hold
            ) -> AsyncIterator[bytes]:
                yield payload[:cut]
                await asyncio.sleep(hold)
                raise _Abandoned()

            try:
                response = await append(self._stub(rng), journal, content(), timeout=APPEND_TIMEOUT)
            except _Abandoned:
                op.outcome, op.error = FAIL, "abandoned before its commit"
            except AppendError as exc:
                op.outcome, op.error = FAIL, pb.Status.Name(exc.status)
            except Exception as exc:
                # The call failed before the client abandoned it: still never committed (the
                # commit chunk was never sent).
                op.outcome, op.error = FAIL, f"abandoned: {describe(exc)}"
            else:
                op.outcome, op.error = INFO, f"committed without its commit chunk?! {response}"
            op.completed = self.history.now()
            await asyncio.sleep(rng.uniform(0.1, 0.5))

    # ---- crowds and leavers on rate-limited journals ---------------------------------------

    @staticmethod
    def _sized(rng: random.Random, client: str, kind: str, seq: int, size: int) -> bytes:
        """A unique record of exactly `size` bytes (one line)."""
        head = f"{kind} {client} {seq} {rng.getrandbits(48):012x} ".encode()
        return head + b"." * max(0, size - len(head) - 1) + b"\n"

    @staticmethod
    def _small_size(rng: random.Random) -> int:
        """1 to 64 KiB, mostly large: a hundred at once make groups past 4 MiB."""
        if rng.random() < 0.75:
            return rng.randrange(48 << 10, SMALL)
        return rng.randrange(1 << 10, SMALL)

    async def _crowds(self, journal: str) -> None:
        """Waves of many clients at once, each making one to three small appends (to brokers
        picked at random); once a wave's appends have all returned, each replica's write head."""
        rng = self._rng("crowds")
        low, high = self.crowd
        wave = written = 0
        # Until CROWD_BYTES are written: what the run keeps and the checker reads back stays
        # bounded (a journal of tens of MiB takes long to read through brokers).
        while not self.stopping.is_set() and written < CROWD_BYTES:
            n = high if rng.random() < 0.5 else rng.randint(low, high)
            since = self.history.now()
            primary = await self.cluster.primary_of(journal)
            direct = self.cluster.brokers[primary].address if primary is not None else None
            clients = [self._crowd_client(journal, f"k{wave}.{i}", direct) for i in range(n)]
            if rng.random() < 0.5:
                # A slow round first: the crowd queues up behind it, all in the next group.
                holding = asyncio.ensure_future(
                    self._held(journal, f"K{wave}", rng.uniform(1.0, 1.5), rng)
                )
                await asyncio.sleep(0.2)
                sizes = await asyncio.gather(*clients, holding)
            else:
                sizes = await asyncio.gather(*clients)
            written += sum(size for size in sizes if size)
            await self._sample_heads(journal, since)
            wave += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), rng.uniform(2.0, 5.0))

    async def _crowd_client(self, journal: str, client: str, primary: str | None) -> int:
        """Up to three appends one after the other (the clients of a group are answered
        together, and come back together for the next one), half of the clients to the
        journal's primary, the others through brokers picked at random; the bytes sent."""
        rng = self._rng(f"crowd/{client}")
        direct = primary is not None and rng.random() < 0.5
        sent = 0
        for seq in range(rng.randint(1, 3)):
            payload = self._sized(rng, client, "K", seq, self._small_size(rng))
            op = self._record(AppendOp(journal, client, payload, CROWD))
            sent += len(payload)
            if direct and primary is not None:
                stub = self.cluster.dialer.journal_stub(primary)
                await self._append(op, rng, timeout=CROWD_TIMEOUT, stub=stub)
            else:
                await self._append(op, rng, timeout=CROWD_TIMEOUT)
        return sent

    async def _sample_heads(self, journal: str, since: float) -> None:
        """Every replica's write head, asked again (up to three times, 0.4 s apart) while
        they differ; recorded when they agree, or when they differ the same way throughout
        (a commit still in flight moves them)."""
        first: dict[str, int] | None = None
        heads: dict[str, int] = {}
        for attempt in range(3):
            try:
                heads = await asyncio.wait_for(self.cluster.replica_heads(journal), 10)
            except Exception as exc:
                self.history.note(f"write heads of {journal}: {describe(exc)}")
                return
            if len(heads) < 2 or len(set(heads.values())) == 1:
                break
            first = heads if first is None else first
            if attempt < 2:
                await asyncio.sleep(0.4)
        if first is not None and heads != first:
            self.history.note(f"write heads of {journal} moved: {first} then {heads}")
            return
        self.history.head_samples.append(HeadSample(journal, since, self.history.now(), heads))

    async def _leavers(self, journal: str) -> None:
        rng = self._rng("leavers")
        cluster = self.cluster
        # Raw records, written at most once: a batch whose commit may have landed is not sent
        # again (its records fail, in doubt). Code from before that option (the campaign's
        # run on issue 38's unfixed tree) sends it again: a duplicate there is its doing.
        once = {"at_least_once": False} if "at_least_once" in _parameters(AppendService) else {}
        service = AppendService(
            lambda _journal: cluster.dialer.journal_stub(rng.choice(cluster.addresses())),
            max_retry_delay=0.5,
            **once,
        )
        round_ = 0
        try:
            while not self.stopping.is_set():
                await self._leave_round(journal, round_, service)
                round_ += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), rng.uniform(0.5, 2.0))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(service.close(), 5)

    async def _leave_round(self, journal: str, round_: int, service: AppendService) -> None:
        """A held append takes the pipeline; small appends arrive behind it and give up; then
        the held one commits, and the leavers write their records again through AppendService."""
        rng = self._rng(f"leave/{round_}")
        holding = asyncio.ensure_future(self._held(journal, f"H{round_}", rng.uniform(*HOLD), rng))
        try:
            await asyncio.sleep(0.3)
            await asyncio.gather(
                *(
                    self._leaver(journal, f"l{round_}.{i}", service)
                    for i in range(rng.randint(3, 8))
                )
            )
        finally:
            await holding

    async def _held(self, journal: str, name: str, hold: float, rng: random.Random) -> None:
        """An append streamed past what brokers read whole: it takes the pipeline with its
        first content and keeps it `hold` seconds until its commit (well above
        --broker.min-append-rate), as a slow round does; small appends queue up behind it."""
        payload = self._sized(rng, "held", name, 0, rng.randrange(160 << 10, 200 << 10))
        held = self._record(AppendOp(journal, "held", payload, HELD))

        async def content() -> AsyncIterator[bytes]:
            yield payload[:-1]
            await asyncio.sleep(hold)
            held.committing = self.history.now()
            yield payload[-1:]

        try:
            response = await append(
                self._stub(rng), journal, content(), timeout=hold + APPEND_TIMEOUT
            )
        except AppendError as exc:
            held.outcome, held.error = FAIL, pb.Status.Name(exc.status)
        except Exception as exc:
            held.outcome, held.error = INFO, describe(exc)
        else:
            held.outcome, held.begin, held.end = OK, response.commit.begin, response.commit.end
        held.completed = self.history.now()

    async def _leaver(self, journal: str, client: str, service: AppendService) -> None:
        rng = self._rng(f"leaver/{client}")
        payload = self._sized(rng, client, "L", 0, self._small_size(rng))
        op = self._record(AppendOp(journal, client, payload, LEFT))
        patience = rng.uniform(*PATIENCE)
        how = rng.choice(["deadline", "cancel", "cancel-uncommitted"])
        if how == "deadline":
            # The one-message form, as our clients send a small append.
            await self._append(op, rng, timeout=patience)
        else:
            await self._cancelled(op, rng, patience, commit=how == "cancel")
        op.completed = self.history.now()
        if op.outcome == OK:
            return
        retry = self._record(AppendOp(journal, client, payload, RETRY))
        try:
            span = await settle(await service.write(journal, payload), SETTLE_TIMEOUT)
        except AppendError as exc:
            retry.outcome, retry.error = FAIL, pb.Status.Name(exc.status)
        except Exception as exc:
            retry.outcome, retry.error = INFO, describe(exc)
        else:
            retry.outcome, retry.begin, retry.end = OK, span.begin, span.end
        retry.completed = self.history.now()

    async def _cancelled(
        self, op: AppendOp, rng: random.Random, patience: float, *, commit: bool
    ) -> None:
        """The streamed form, as an upstream Go client sends a small append, cancelled after
        `patience`: once its commit is sent (`commit`: the append is in doubt, and must be
        aborted unless the broker proposed it already), or before (it must roll back)."""
        sent: list[bool] = []
        never = asyncio.Event()

        async def content() -> AsyncIterator[bytes]:
            yield op.payload
            if not commit:
                await never.wait()
            sent.append(True)  # From here the commit may go: the outcome is in doubt.

        call = asyncio.ensure_future(append(self._stub(rng), op.journal, content()))
        done, _ = await asyncio.wait({call}, timeout=patience)
        if not done:
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
            op.left = self.history.now()
            if sent:
                op.outcome, op.error = INFO, "left: cancelled after its commit was sent"
            else:
                op.outcome, op.error = FAIL, "left: cancelled before its commit"
            return
        try:
            response = call.result()
        except AppendError as exc:
            op.outcome, op.error = FAIL, pb.Status.Name(exc.status)
        except Exception as exc:
            op.outcome, op.error = INFO, describe(exc)
        else:
            op.outcome, op.begin, op.end = OK, response.commit.begin, response.commit.end

    # ---- messages -------------------------------------------------------------------------

    async def _publisher(self, name: str) -> None:
        rng = self._rng(name)
        cluster = self.cluster
        service = AppendService(
            lambda _journal: cluster.dialer.journal_stub(rng.choice(cluster.addresses())),
            max_retry_delay=0.5,
        )
        messages, framing = DictMessages(), JSONLines()
        partitions = [Partition(j, CONTENT_TYPE) for j in self.message_journals]
        publisher: Publisher[dict[str, Any]] = Publisher(service, messages, framing)
        n = txn_n = 0
        try:
            while not self.stopping.is_set():
                producer = publisher.producer.hex()
                mode = rng.choice(["committed", "commit", "abort"])
                txn = Txn(f"{name}-t{txn_n}", producer, mode) if mode != "committed" else None
                txn_n += txn is not None
                records: list[tuple[Publish, Any]] = []
                for _ in range(rng.randint(1, 6)):
                    partition = rng.choice(partitions)
                    mid = f"{name}-{n}"
                    n += 1
                    msg = {"id": mid, "pad": "." * rng.randrange(60)}
                    record = Publish(mid, producer, partition.journal, txn.id if txn else "")
                    record.invoked = self.history.now()
                    self.history.publishes.append(record)

                    def mapping(_m: Any, p: Partition = partition) -> Partition:
                        return p

                    if txn is None:
                        pending = await publisher.publish_committed(mapping, msg)
                    else:
                        pending = await publisher.publish_uncommitted(mapping, msg)
                    records.append((record, pending))
                    # A batch's failure is this loop's to judge, awaited or not.
                    pending.batch.add_done_callback(lambda f: f.cancelled() or f.exception())
                healthy = True
                for record, pending in records:
                    try:
                        await settle(pending, SETTLE_TIMEOUT)
                        record.outcome = OK
                    except Exception as exc:
                        record.error = describe(exc)
                        healthy = False
                    record.completed = self.history.now()
                if txn is not None:
                    self.history.txns.append(txn)
                    txn.invoked = self.history.now()
                    try:
                        if not healthy:
                            raise RuntimeError("a message of the transaction was not acknowledged")
                        done = publisher.commit() if mode == "commit" else publisher.abort()
                        await settle(done, SETTLE_TIMEOUT)
                        txn.outcome = "committed" if mode == "commit" else "aborted"
                    except Exception as exc:
                        txn.error = describe(exc)
                        healthy = False
                    txn.completed = self.history.now()
                if not healthy:
                    # Its pending messages are in doubt: a new producer starts afresh.
                    publisher = Publisher(service, messages, framing)
                await asyncio.sleep(rng.uniform(0, 4 * self.pace))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(service.close(), 5)

    # ---- readers --------------------------------------------------------------------------

    async def _tail(self, name: str, journal: str, *, committed: bool) -> None:
        """Read `journal` from 0 as it grows, re-opening the read on another broker when it
        fails or stays idle, and recording every chunk (and, read-committed, each message)."""
        rng = self._rng(name)
        offset = 0
        sequencing = CommittedReader(journal) if committed else None
        while True:
            stream = cast(
                AsyncGenerator[Chunk, None], read(self._stub(rng), journal, offset, block=True)
            )
            try:
                while True:
                    async with asyncio.timeout(READ_IDLE):
                        chunk = await anext(stream)
                    at = self.history.now()
                    self.history.reads.append(
                        ReadChunk(name, journal, chunk.offset, chunk.content, at)
                    )
                    if chunk.offset < offset:
                        return  # Went back: recorded for the checker; nothing sane follows.
                    offset = chunk.offset + len(chunk.content)
                    if sequencing is not None:
                        for envelope in sequencing.feed(chunk.offset, chunk.content):
                            self.history.deliveries.append(
                                Delivery(name, journal, message_id(envelope), envelope.begin, at)
                            )
            except (StopAsyncIteration, TimeoutError):
                pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.history.note(f"{name}: read failed at {offset} ({describe(exc)})")
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(BaseException):
                    await stream.aclose()


class _Abandoned(Exception):
    pass


def _parameters(cls: type[Any]) -> set[str]:
    return set(inspect.signature(cls).parameters)


def _deadline(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
