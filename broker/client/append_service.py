"""AppendService: many small, asynchronous appends become few large ones.

Records written to a journal are buffered in memory, each batch's first `SPILL_AT` bytes and
more while the service's budget (`max_memory`, across journals) lasts, and past that in a local
temporary file that a worker thread writes and reads (disk I/O never blocks the loop), and sent
as one Append RPC per batch, in order: while one batch is in flight, the next accumulates. A
writer that never has to wait gives the loop a turn every `YIELD_EVERY` bytes, so the senders
keep sending while it writes. Each write
returns a `PendingSpan`, awaited for the record's own span once its batch commits. Writers wait when a
journal has too much pending (back-pressure); transient failures are retried, and a record, once
acknowledged, is exactly where its PendingSpan says. A batch whose call failed after its commit
was sent may have landed: by default (`at_least_once`, as upstream's AppendService) it is sent
again, so its records are appended at least once, which suits messages (readers de-duplicate them
by UUID) and recovery logs. Writers of raw records pass `at_least_once=False`: such a batch is
never sent again, and its records fail with AppendOutcomeUnknown (`gazctl journals append
--mapping` does so).

A write may carry `Registers` (check, union, subtract): it goes in order with the others, in a
batch of writes with the same registers (upstream's appends with equal requests); a
REGISTER_MISMATCH fails the batch (AppendError), never retried, and what waits on it with
`write_after` fails with DependencyFailed. `barrier` is a zero-byte append in that
order: it resolves once everything written to the journal before it has committed, and with
`Registers(check=...)` it checks them (brokers change registers only with content, as upstream).

A batch that fails fails every record in it, for whoever awaits them; writers may have stopped
waiting, so a failure nobody awaits is not logged. Every batch ends: one whose call gRPC
cancelled on this side (its channel closed) fails with CANCELLED, and those a cancelled `close`
leaves unsent are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import grpc

from broker.client.appender import AppendError, append
from broker.client.routes import RETRYABLE, Router, is_transient, uncertain
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from plumbing.backoff import Backoff
from plumbing.tasks import wait_out

log = logging.getLogger(__name__)

# Batches stream in larger chunks than interactive appends: per-message costs dominate in
# Python, and a batch is all there is to send (no client waits on each chunk).
BATCH_CHUNK = 1 << 20

# A batch keeps this much in memory; past it, its records go to its temporary file on the disk
# thread, in pieces of about this size (a record this large goes alone, never copied), unless
# the service's memory budget (`max_memory`) still has room for them.
SPILL_AT = 1 << 20

# `write` gives the event loop a turn after this many bytes written without one.
YIELD_EVERY = 1 << 18


@dataclass(frozen=True)
class Span:
    """Where a record landed: [begin, end) of `journal`."""

    journal: str
    begin: int
    end: int


@dataclass(frozen=True)
class Registers:
    """The journal registers an append checks (`check`: a selector they must match) and
    changes once it commits (`union` adds labels, `subtract` removes them)."""

    check: pb.LabelSelector | None = None
    union: pb.LabelSet | None = None
    subtract: pb.LabelSet | None = None


def _batch_file() -> IO[bytes]:
    return tempfile.TemporaryFile(prefix="gazette-append-")


class _DiskThread:
    """The one worker thread of an AppendService's batch files: jobs run one at a time, in the
    order given, so a batch's writes, reads and close never overtake each other. Started at
    the first job, ended by `close` once every job given before is done."""

    def __init__(self, memory: int = 0) -> None:
        self._executor: ThreadPoolExecutor | None = None
        # Bytes batches may still keep in memory past their first SPILL_AT (`max_memory`):
        # a file round trip costs the loop a thread hop per chunk, memory only the copy.
        self.memory_left = memory

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gazette-append-disk")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            try:
                await wait_out(asyncio.get_running_loop().run_in_executor(executor, _nothing))
            finally:
                executor.shutdown(wait=True)  # Idle by now: every job before the last is done.


def _nothing() -> None:
    pass


class _BatchFileError(Exception):
    """A batch's file could not be written or read back (its cause says why): the batch fails
    with that cause, as a write to a full disk did when it was written on the loop."""


class _Batch:
    """Records buffered for one Append RPC; `done` resolves with the offset where the batch
    began once it commits (one future per batch, not per record: the publish path's cost).
    The first `spilled` bytes are in `file`, which only the disk thread touches; the rest, `held`
    bytes, are in memory: the `full` pieces of BATCH_CHUNK bytes, then `buffer`. Pieces, not one
    growing buffer: a bytearray grown to tens of MiB costs more a record (reallocations, fresh
    pages) than the record's copy, and the pieces are what is sent."""

    __slots__ = (
        "borrowed", "buffer", "count", "dependency", "disk", "done", "error", "file", "full",
        "held", "registers", "size", "spilled",
    )  # fmt: skip

    def __init__(
        self,
        disk: _DiskThread,
        dependency: Awaitable[object] | None = None,
        registers: Registers | None = None,
    ) -> None:
        self.disk = disk
        self.buffer = bytearray()
        self.full: list[bytearray] = []
        self.held = 0
        self.spilled = 0
        self.borrowed = 0  # Bytes held past SPILL_AT, taken from disk.memory_left.
        self.file: IO[bytes] | None = None  # Made by the disk thread at the first spill.
        self.error: Exception | None = None  # The disk thread's: the file cannot be sent.
        self.size = 0
        self.count = 0
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # Sent only once this completes (its failure is the batch's): `write_after`.
        self.dependency = dependency
        self.registers = registers

    def add(self, journal: str, data: bytes) -> PendingSpan:
        size = self.size
        length = len(data)
        self.size = size + length
        self.count += 1
        held = self.held + length
        if held < SPILL_AT or (length < SPILL_AT and self._borrow(held - SPILL_AT)):
            self.held = held
            buffer = self.buffer
            room = BATCH_CHUNK - len(buffer)
            if length <= room:
                buffer += data
            else:  # The piece fills; the rest (less than a piece: length < SPILL_AT) begins one.
                with memoryview(data) as view:
                    buffer += view[:room]
                    self.full.append(buffer)
                    self.buffer = bytearray(view[room:])
        else:
            self._spill(data)
        return _new_tuple(PendingSpan, (journal, self.done, size, length))

    def _borrow(self, extra: int) -> bool:
        """Whether the memory budget lets the batch hold `extra` bytes past SPILL_AT (taken)."""
        more = extra - self.borrowed
        if more > self.disk.memory_left:
            return False
        self.disk.memory_left -= more
        self.borrowed = extra
        return True

    def _give_back(self) -> None:
        self.disk.memory_left += self.borrowed
        self.borrowed = 0

    def _spill(self, data: bytes) -> None:
        """What is buffered, and `data`, to the file on the disk thread (a large record by
        reference: it is not copied on the loop)."""
        pieces: list[bytes | bytearray] = [*self.full]
        if len(data) >= SPILL_AT:
            if type(data) is not bytes:
                data = bytes(data)  # The writer's to change once `write` returns.
            if self.buffer:
                pieces.append(self.buffer)
            pieces.append(data)
        else:
            self.buffer += data
            pieces.append(self.buffer)
        self.buffer = bytearray()
        self.full = []
        self.held = 0
        self._give_back()
        self.spilled += sum(map(len, pieces))
        self.disk.run(self._write, pieces).add_done_callback(_retrieve)

    def _write(self, pieces: list[bytes | bytearray]) -> None:
        """On the disk thread."""
        if self.error is not None:
            return  # The file lacks an earlier piece: reads raise the error.
        try:
            if self.file is None:
                self.file = _batch_file()
            for piece in pieces:
                self.file.write(piece)
        except Exception as exc:
            self.error = exc

    def _read(self, offset: int, end: int) -> bytes:
        """On the disk thread: up to BATCH_CHUNK bytes of the file, from `offset`."""
        if self.error is not None:
            raise self.error
        assert self.file is not None
        self.file.seek(offset)  # Flushes what was written before.
        return self.file.read(min(BATCH_CHUNK, end - offset))

    def whole(self) -> bytes | None:
        """The batch's content as one piece, when it is one MiB or less, all in memory (an
        append sends it in one message with its parameters); else None (it streams)."""
        if self.spilled or self.full or not self.buffer or len(self.buffer) > BATCH_CHUNK:
            return None
        return bytes(self.buffer)

    async def chunks(self) -> AsyncIterator[bytes]:
        offset = 0
        while offset < self.spilled:
            try:
                chunk = await self.disk.run(self._read, offset, self.spilled)
                if not chunk:
                    raise OSError(f"the batch file ends at {offset} of {self.spilled} bytes")
            except Exception as exc:
                raise _BatchFileError from exc
            offset += len(chunk)
            yield chunk
        for piece in self.full:
            yield bytes(piece)  # Bytes, as gRPC takes them.
        if self.buffer:
            yield bytes(self.buffer)

    def discard(self) -> None:
        """Its file is closed (removed) on the disk thread, after every job given before."""
        self.buffer = bytearray()
        self.full = []
        self.held = 0
        self._give_back()
        if self.spilled:
            self.disk.run(self._close).add_done_callback(_retrieve)

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _locally_cancelled(journal: str) -> grpc.aio.AioRpcError:
    """What a batch fails with when gRPC cancelled its call on this side (a closed channel
    ends its calls so, raising CancelledError into a task nobody cancelled)."""
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED,
        empty,
        empty,
        details=f"append to {journal} cancelled on the client's side (its channel closed)",
        debug_error_string="",
    )


class ServiceClosed(RuntimeError):
    """A write to an AppendService that is closing or closed: nothing was queued."""


class AppendOutcomeUnknown(RuntimeError):
    """A batch whose call failed after its commit was sent (the connection dropped, the broker
    died): it may have landed, or not. It is not sent again, as that could append its records
    twice; read the journal to learn which. Its `__cause__` is the call's failure."""

    def __init__(self, journal: str, size: int, count: int, cause: grpc.aio.AioRpcError) -> None:
        detail = (cause.details() or "").split("\n")[0]
        super().__init__(
            f"append to {journal}: the call failed after its commit was sent "
            f"({cause.code().name}: {detail}): its {count} record(s), {size} bytes, may have "
            "been appended or not, so they were not sent again"
        )
        self.journal = journal
        self.size = size
        self.count = count


class DependencyFailed(RuntimeError):
    """A `write_after` record not appended, because its dependency failed or was cancelled."""


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # Marks it retrieved: no "never retrieved" warning at collection.


class PendingSpan(NamedTuple):
    """Where a written record will land: await it for its `Span` once its batch commits (or
    for the batch's error). `done()` says whether it is settled. It is awaitable any number of
    times, and `asyncio.gather` and `asyncio.wait_for` take it; cancelling a waiter cancels the
    wait, never the batch."""

    journal: str
    batch: asyncio.Future[int]
    offset: int  # Within the batch.
    length: int

    def __await__(self) -> Generator[Any, None, Span]:
        # Shielded: the batch is every writer's in it, so a waiter cancelled (a client gone, a
        # connection stopped) must not cancel it for the others, whose records it appends.
        begin = yield from asyncio.shield(self.batch).__await__()
        at = begin + self.offset
        return Span(self.journal, at, at + self.length)

    def done(self) -> bool:
        return self.batch.done()


_new_tuple = tuple.__new__


_NO_REGISTERS = Registers()


class _Journal:
    """The ordered queue of batches of one journal, and the task sending them."""

    def __init__(self, service: AppendService, name: str) -> None:
        self.service = service
        self.name = name
        self.disk = service.disk
        self.open = _Batch(self.disk)
        self.closed: list[_Batch] = []
        self.sending: _Batch | None = None
        self.pending = 0  # Bytes written and not yet committed (or failed).
        self.room = asyncio.Event()
        self.room.set()
        self.wake = asyncio.Event()
        self.task: asyncio.Future[None] | None = None  # Its sender, owned by the service.

    def write(self, data: bytes, registers: Registers | None = None) -> PendingSpan:
        if registers is not self.open.registers and (
            registers != self.open.registers or self.open.dependency is not None
        ):
            # Another batch: these registers apply to the whole of it.
            if self.open.count:
                self.closed.append(self.open)
            self.open = _Batch(self.disk, registers=registers)
        pending = self.open.add(self.name, data)
        self.pending += len(data)
        if self.open.size >= self.service.max_batch:
            self.closed.append(self.open)
            self.open = _Batch(self.disk, registers=registers)
        if self.pending >= self.service.max_pending:
            self.room.clear()
        self.wake.set()
        return pending

    def write_alone(
        self,
        data: bytes,
        dependency: Awaitable[object] | None = None,
        registers: Registers | None = None,
    ) -> PendingSpan:
        # Its own batch, queued after what was written before it: what is written after it
        # waits behind it.
        if self.open.count:
            self.closed.append(self.open)
            self.open = _Batch(self.disk)
        batch = _Batch(self.disk, dependency, registers)
        pending = batch.add(self.name, data)
        self.closed.append(batch)
        self.pending += len(data)
        if self.pending >= self.service.max_pending:
            self.room.clear()
        self.wake.set()
        return pending

    def _next(self) -> _Batch | None:
        if self.closed:
            return self.closed.pop(0)
        if self.open.count:
            batch, self.open = self.open, _Batch(self.disk)
            return batch
        return None

    async def _serve(self) -> None:
        while True:
            batch = self._next()
            if batch is None:
                if self.service.closing:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            self.sending = batch
            try:
                if batch.dependency is not None:
                    try:
                        await batch.dependency
                    except (Exception, asyncio.CancelledError) as exc:
                        task = asyncio.current_task()
                        if isinstance(exc, asyncio.CancelledError) and (
                            task is not None and task.cancelling()
                        ):
                            raise  # We are cancelled, not the dependency.
                        self._fail_dependent(batch, exc)
                        continue
                await self._send(batch)
            except asyncio.CancelledError:
                batch.done.cancel()  # With its sender (`close` cancelled): none waits for good.
                raise
            finally:
                self.sending = None
                batch.discard()
                self.pending -= batch.size
                if self.pending < self.service.max_pending:
                    self.room.set()

    async def _send(self, batch: _Batch) -> None:
        backoff = Backoff(maximum=self.service.max_retry_delay)
        started = time.monotonic()
        while True:
            try:
                registers = batch.registers or _NO_REGISTERS
                response = await append(
                    self.service.stub_for(self.name),
                    self.name,
                    batch.whole() or batch.chunks(),
                    chunk_size=BATCH_CHUNK,
                    check_registers=registers.check,
                    union_registers=registers.union,
                    subtract_registers=registers.subtract,
                )
            except AppendError as exc:
                if self.service.router is not None:
                    self.service.router.cache.drop(self.name)
                if exc.status not in RETRYABLE:
                    self._fail(batch, exc)
                    return
                error: BaseException = exc
            except grpc.aio.AioRpcError as exc:
                if not is_transient(exc):
                    self._fail(batch, exc)
                    return
                if (
                    uncertain(exc)
                    and not getattr(exc, "repeatable", False)
                    and not self.service.at_least_once
                ):
                    # Its commit may have landed: sent again, its records could land twice.
                    unknown = AppendOutcomeUnknown(self.name, batch.size, batch.count, exc)
                    unknown.__cause__ = exc
                    self._fail(batch, unknown)
                    return
                error = exc
            except _BatchFileError as exc:
                self._fail(batch, exc.__cause__ or exc)
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # We are cancelled (the service closes): `close` settles the batch.
                # gRPC cancelled the call on this side (its channel was closed): it is not
                # retried, as a call the broker cancelled is not (the commit may have landed).
                self._fail(batch, _locally_cancelled(self.name))
                return
            except Exception as exc:  # A closed channel refuses new calls (UsageError), say.
                self._fail(batch, exc)
                return
            else:
                self.service.appends += 1
                if self.service.router is not None:
                    self.service.router.observe(self.name, response.header)
                if not batch.done.done():
                    batch.done.set_result(response.commit.begin)
                return
            reason = (
                f"{error.code().name}: {error.details()}"  # Its str() is a multi-line dump.
                if isinstance(error, grpc.aio.AioRpcError)
                else str(error)
            )
            delay = backoff.next_delay()
            limit = self.service.max_wait
            if limit is not None and time.monotonic() - started + delay > limit:
                self._fail(batch, error)
                return
            log.warning("append to %s failed (retrying in %.2fs): %s", self.name, delay, reason)
            await asyncio.sleep(delay)

    @staticmethod
    def _fail(batch: _Batch, error: BaseException) -> None:
        """The batch failed: every writer that awaits one of its records gets `error`. The
        batch is every writer's in it, and each may have stopped waiting (given up, been
        cancelled, closed its client): nobody need await it, so its failure is marked
        retrieved ("Future exception was never retrieved" would otherwise be logged for a
        failure that those who wait for it were told of)."""
        if not batch.done.done():
            batch.done.set_exception(error)
            batch.done.exception()

    def _fail_dependent(self, batch: _Batch, cause: BaseException) -> None:
        """A `write_after` whose dependency failed: it fails too, with DependencyFailed. The
        dependency's failure is its owner's to report, so nobody need await this one."""
        error = DependencyFailed(
            f"append to {self.name} was not made: what it waited for "
            + ("was cancelled" if isinstance(cause, asyncio.CancelledError) else f"failed: {cause}")
        )
        error.__cause__ = cause
        self._fail(batch, error)


class AppendService:
    """Asynchronous, batched appends across journals (one ordered stream per journal)."""

    def __init__(
        self,
        stub_for: Router | Callable[[str], pb_grpc.JournalStub] | pb_grpc.JournalStub,
        *,
        max_batch: int = 32 << 20,
        max_pending: int = 64 << 20,
        max_memory: int = 64 << 20,
        max_retry_delay: float = 2.0,
        max_wait: float | None = None,
        at_least_once: bool = True,
    ) -> None:
        self.router = stub_for if isinstance(stub_for, Router) else None
        if isinstance(stub_for, Router):
            self.stub_for: Callable[[str], pb_grpc.JournalStub] = stub_for.stub_for
        elif isinstance(stub_for, pb_grpc.JournalStub):
            stub = stub_for
            self.stub_for = lambda _journal: stub
        else:
            self.stub_for = stub_for
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.max_retry_delay = max_retry_delay
        # Seconds a batch waits through transient failures before it fails with the last one
        # (None: for as long as it takes, as upstream's AppendService does).
        self.max_wait = max_wait
        # Whether a batch whose commit may have landed is sent again (its records may then be
        # appended twice: for records de-duplicated downstream, messages by their UUIDs), or
        # fails with AppendOutcomeUnknown (raw records: each is appended at most once).
        self.at_least_once = at_least_once
        self.closing = False
        self.disk = _DiskThread(max_memory)
        self.appends = 0  # Append RPCs committed: records / appends is the batching factor.
        self._journals: dict[str, _Journal] = {}
        self._unyielded = 0  # Bytes `write` queued since it last gave the loop a turn.

    def _journal(self, name: str) -> _Journal:
        if self.closing:
            raise ServiceClosed(f"the AppendService is closed: nothing more is written to {name}")
        journal = self._journals.get(name)
        if journal is None:
            journal = self._journals[name] = _Journal(self, name)
            # The service owns each journal's sender: `close` awaits it.
            journal.task = asyncio.ensure_future(journal._serve())
        return journal

    async def write(
        self, journal: str, data: bytes, registers: Registers | None = None
    ) -> PendingSpan:
        """Queue `data` as one record of `journal`, waiting while too much is pending; the
        future resolves with where the record was committed. With `registers`, it goes in a
        batch of writes with the same registers, which checks and changes them
        (REGISTER_MISMATCH: AppendError)."""
        j = self._journal(journal)
        if not j.room.is_set():
            await j.room.wait()
        elif self._unyielded >= YIELD_EVERY:
            # A writer that never has to wait would keep the loop from the senders (and from
            # gRPC) until room ran out: it gives them a turn, before queueing, so that a
            # write cancelled here queued nothing.
            self._unyielded = 0
            await asyncio.sleep(0)
            if not j.room.is_set():
                await j.room.wait()
        self._unyielded += len(data)
        return j.write(data, registers)

    async def room(self, journal: str) -> None:
        """Wait while too much is pending for `journal` (the back-pressure `write` applies)."""
        j = self._journal(journal)
        if not j.room.is_set():
            await j.room.wait()

    def write_now(
        self, journal: str, data: bytes, registers: Registers | None = None
    ) -> PendingSpan:
        """`write` without waiting for room: for a caller that waited with `room` and must
        queue in the same step as it changes its own state (no write may overtake it)."""
        return self._journal(journal).write(data, registers)

    def barrier(
        self,
        journal: str,
        dependency: Awaitable[object] | None = None,
        registers: Registers | None = None,
    ) -> PendingSpan:
        """A zero-byte append of `journal`, after everything written to it so far (and after
        `dependency`, if given): it resolves, at the journal's write head, once they committed.
        With `registers`, it also checks them (only: brokers refuse register changes without
        content)."""
        if registers is not None and (
            registers.union is not None or registers.subtract is not None
        ):
            raise ValueError(
                f"a barrier of {journal} cannot change registers: brokers change them only "
                "with content (give the union or subtraction to a write)"
            )
        return self._journal(journal).write_alone(b"", dependency, registers)

    def write_after(self, journal: str, data: bytes, dependency: Awaitable[object]) -> PendingSpan:
        """Queue `data` as one record of `journal` that is appended only once `dependency`
        completes (failing with its error if it fails), with the records written to the journal
        after it waiting behind it: upstream's appends with dependencies. A consumer queues its
        transaction's ACK intents this way as it starts to commit, ahead of the next
        transaction's messages to the same journals."""
        return self._journal(journal).write_alone(data, dependency)

    def write_nowait(
        self, journal: str, data: bytes, registers: Registers | None = None
    ) -> PendingSpan:
        """As `write`, without back-pressure (for callers that bound their own pending)."""
        return self._journal(journal).write(data, registers)

    async def append(self, journal: str, data: bytes) -> Span:
        """Queue and wait for the commit."""
        return await (await self.write(journal, data))

    def pending_except(self, *journals: str) -> list[asyncio.Future[int]]:
        """The batches written so far of every journal but `journals`, to await: each resolves
        once committed, and raises if its append failed (upstream's PendingExcept). A consumer
        transaction commits only once every write it made has."""
        return [
            batch.done
            for name, j in self._journals.items()
            if name not in journals
            for batch in [j.sending, *j.closed, j.open]
            if batch is not None and batch.count
        ]

    async def flush(self) -> None:
        """Wait until everything written so far has committed (or failed)."""
        futures = [
            batch.done
            for j in self._journals.values()
            for batch in [j.sending, *j.closed, j.open]
            if batch is not None and batch.count
        ]
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)

    async def close(self) -> None:
        """Send everything written, then stop. If `close` is cancelled (a caller's timeout),
        the batches not yet committed or failed are cancelled with their senders: nothing
        waits on them for good."""
        self.closing = True
        for j in self._journals.values():
            j.wake.set()
        tasks = [j.task for j in self._journals.values() if j.task is not None]
        try:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for j in self._journals.values():
                for batch in [j.sending, *j.closed, j.open]:
                    if batch is not None and not batch.done.done():
                        batch.done.cancel()
                j.open.discard()
        await self.disk.close()

    async def __aenter__(self) -> AppendService:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
