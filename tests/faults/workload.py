"""The fault campaign's workload, every operation recorded in the History:

* appenders of unique records, one Append RPC per record, each to a broker picked at random
  (which proxies to the primary);
* two register writers on one journal that take the register `owner` in turn and append only
  while they hold it (`check_registers`);
* a torn appender that streams part of a record and abandons the call, which must roll back;
* publishers of messages through AppendService: committed ones, and transactions that commit
  or abort across two journals;
* tailing readers of every journal, raw; on the message journals also read-committed.

Clients retry nothing themselves (AppendService excepted, as applications use it): a record
whose append failed is never sent again, so any record twice in a journal is a broker's doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

from broker.client.append_service import AppendService
from broker.client.appender import AppendError, append
from broker.client.reader import Chunk, read
from broker.message.framing import DictMessages, JSONLines
from broker.message.mapping import Partition
from broker.message.publisher import Publisher
from broker.protocol import protocol_pb2 as pb
from tests.faults.checker import CommittedReader, message_id
from tests.faults.harness import CONTENT_TYPE, Cluster, describe
from tests.faults.history import (
    CHECKED,
    FAIL,
    INFO,
    OK,
    TAKEOVER,
    TORN,
    AppendOp,
    Delivery,
    History,
    Publish,
    ReadChunk,
    Txn,
)

T = TypeVar("T")

APPEND_TIMEOUT = 5.0  # A paused or partitioned broker holds a call: give up on it (info).
READ_IDLE = 4.0  # A tailing read with nothing new for this long is re-opened elsewhere.
SETTLE_TIMEOUT = 15.0  # How long a publisher waits for its batch or commit.


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
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []  # Writers: they finish what they began.
        self._readers: list[asyncio.Task[None]] = []
        history.raw_journals = list(raw_journals)
        history.message_journals = list(message_journals)
        history.register_journal = register_journal

    def _rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}/{name}")

    def _stub(self, rng: random.Random) -> Any:
        return self.cluster.dialer.journal_stub(rng.choice(self.cluster.addresses()))

    async def _pause(self, rng: random.Random) -> None:
        await asyncio.sleep(rng.uniform(0, 2 * self.pace))

    def start(self) -> None:
        spawn = self._spawn
        for i, journal in enumerate(self.raw_journals):
            spawn(self._appender(f"w{i}", journal), f"appender w{i}")
            spawn(self._tail(f"reader-{i}", journal, committed=False), f"reader {i}", True)
        if self.register_journal:
            for name, other in (("reg-a", "reg-b"), ("reg-b", "reg-a")):
                spawn(self._register_writer(name, other), name)
        if self.torn:
            spawn(self._torn_appender("torn", self.raw_journals[-1]), "torn")
        for i in range(self.publishers):
            spawn(self._publisher(f"pub{i}"), f"publisher {i}")
        for i, journal in enumerate(self.message_journals):
            spawn(self._tail(f"rc-{i}", journal, committed=True), f"committed reader {i}", True)
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

    async def _append(self, op: AppendOp, rng: random.Random, **options: Any) -> None:
        try:
            response = await append(
                self._stub(rng), op.journal, op.payload, timeout=APPEND_TIMEOUT, **options
            )
        except AppendError as exc:
            op.outcome, op.error = FAIL, pb.Status.Name(exc.status)
        except asyncio.CancelledError:
            op.error = "cancelled"
            raise
        except Exception as exc:
            op.outcome, op.error = INFO, describe(exc)
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
