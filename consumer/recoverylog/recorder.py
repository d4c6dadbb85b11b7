"""The recorder (upstream's `recoverylog.Recorder`): file operations, as they happen in a local
directory, appended to a recovery log in sequence.

`start()` learns the log's write head with a barrier (a zero-byte append): it lower-bounds the
offsets of every operation recorded afterwards, which the hints carry so a player can skip what
precedes them. Recording into a log other than the one the FSM was recovered from first appends
a no-op that takes the log (`union_registers` of this author); from then on every append checks
that register (`check_registers`), so once another author took the log (a hand-off), this
recorder's appends fail with REGISTER_MISMATCH and it records nothing more: it is fenced.

Operations are queued in order on the AppendService as they are recorded (the call does not
wait); `barrier()` resolves once everything recorded before it is durable, and `build_hints()`
returns hints only once every operation they name is.

A recorder is used from one thread: the event loop's, or another (a store's database thread, whose
file callbacks record as they happen). Off the loop, appends are handed to the loop in order
(`call_soon_threadsafe`) by `flush()`, a sync's worth at a time (so a database commit is one
append); the loop then awaits `durable()`."""

from __future__ import annotations

import asyncio
import posixpath
from pathlib import PurePosixPath

from broker.client.append_service import AppendService, PendingSpan, Registers
from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from consumer.recoverylog.fsm import FSM, HEADER, author_fence, encode_frame

__all__ = ["Fenced", "Recorder"]


# Ops recorded off the loop are handed to it once this many bytes are buffered (or at a sync).
_FLUSH_AT = 1 << 20


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Fenced(Exception):
    """The recorder's appends were refused: another author took the log, or an append failed
    (its operations are not in the log, so nothing may be recorded after them)."""


class Recorder:
    def __init__(
        self, log: str, fsm: FSM, author: int, directory: str, service: AppendService
    ) -> None:
        root = PurePosixPath(directory)
        if not root.is_absolute() or posixpath.normpath(directory) != directory:
            raise ValueError(f"recorder directory {directory!r} is not an absolute, clean path")
        self.log, self.fsm, self.author, self.directory = log, fsm, author, directory
        self.service = service
        self.write_head = 0
        self.recorded_bytes = 0  # Of every op and its data, since this recorder began.
        self.failure: BaseException | None = None
        self._registers: Registers | None = None
        self._last: PendingSpan | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Off the loop: ops recorded and not yet handed to it (sent at a sync, or once large).
        self._buffer: list[bytes] = []
        self._buffered = 0
        # The last seq_no handed to the AppendService (on the loop): hints name none after it.
        # Everything before this recorder began was played from the log, so is in it.
        self._handed_seq_no = fsm.next_seq_no - 1
        self._buffered_seq_no = self._handed_seq_no  # Of the last op in `_buffer` (the thread's).

    async def start(self) -> None:
        """Learn the write head; take the log if it is not the one recovered from; from then on
        check this author's register with every append."""
        self._loop = asyncio.get_running_loop()
        self.write_head = (await self.service.barrier(self.log)).end
        if self.log != self.fsm.last_log:
            self._append(rpb.RecordedOp(), b"", Registers(union=author_fence(self.author)))
            await self.durable()
        self._registers = Registers(check=pb.LabelSelector(include=author_fence(self.author)))

    # ---- recording ---------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        relative = posixpath.relpath(path, self.directory)
        if relative == "." or relative.startswith("../") or relative == "..":
            raise ValueError(f"{path} is not under the recorder's directory {self.directory}")
        return "/" + relative

    def record_create(self, path: str) -> int:
        """A file created or truncated at `path` (a truncated one is a new fnode); its fnode."""
        path = self._path(path)
        existing = self.fsm.links.get(path)
        if existing is not None:
            self._record(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=existing, path=path)))
        self._record(rpb.RecordedOp(create=rpb.RecordedOp.Create(path=path)))
        return self.fsm.links[path]

    def record_open(self, path: str) -> int:
        """The fnode of an existing file, or of a new one created at `path`."""
        existing = self.fsm.links.get(self._path(path))
        return existing if existing is not None else self.record_create(path)

    def record_write(self, fnode: int, data: bytes, offset: int) -> None:
        """`data` written at `offset` of the file `fnode`."""
        op = rpb.RecordedOp(
            write=rpb.RecordedOp.Write(fnode=fnode, offset=offset, length=len(data))
        )
        self._record(op, data)

    def record_remove(self, path: str) -> None:
        path = self._path(path)
        fnode = self.fsm.links.get(path)
        if fnode is None:
            raise KeyError(f"remove of {path}, which the recorder does not know")
        self._record(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=fnode, path=path)))

    def record_link(self, source: str, target: str) -> None:
        source, target = self._path(source), self._path(target)
        fnode = self.fsm.links.get(source)
        if fnode is None:
            raise KeyError(f"link of {source}, which the recorder does not know")
        self._record(rpb.RecordedOp(link=rpb.RecordedOp.Link(fnode=fnode, path=target)))

    def record_rename(self, source: str, target: str) -> None:
        """A rename, as upstream records it: the target's old file unlinked, the file linked at
        the target, then unlinked at the source."""
        source, target = self._path(source), self._path(target)
        fnode = self.fsm.links.get(source)
        if fnode is None:
            raise KeyError(f"rename of {source}, which the recorder does not know")
        previous = self.fsm.links.get(target)
        if previous is not None:
            self._record(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=previous, path=target)))
        self._record(rpb.RecordedOp(link=rpb.RecordedOp.Link(fnode=fnode, path=target)))
        self._record(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=fnode, path=source)))

    def _record(self, op: rpb.RecordedOp, data: bytes = b"") -> None:
        if self._registers is None:
            raise RuntimeError("record before start(): the recorder does not know the log yet")
        self._append(op, data, self._registers)

    def _append(self, op: rpb.RecordedOp, data: bytes, registers: Registers) -> None:
        if self.failure is not None:
            raise Fenced(f"recording into {self.log} stopped: {self.failure}") from self.failure
        op.author = self.author
        op.seq_no, op.checksum = self.fsm.next_seq_no, self.fsm.next_checksum
        frame = encode_frame(op)
        # Meta-fields, for the hints only: the write head lower-bounds where the op landed;
        # its end is unknown (0: unbounded).
        op.first_offset, op.last_offset, op.log = self.write_head, 0, self.log
        self.fsm.apply(op, frame[HEADER:])
        content = frame + data if data else frame
        self.recorded_bytes += len(content)
        loop = self._loop
        assert loop is not None
        if _on_loop(loop):
            self._write(content, registers, op.seq_no)
        else:
            self._buffer.append(content)
            self._buffered += len(content)
            self._buffered_seq_no = op.seq_no
            if self._buffered >= _FLUSH_AT:
                self.flush()

    def flush(self) -> None:
        """Off the loop: hand the ops recorded so far to the loop, as one append (a sync does
        this first; a store's thread calls it before hints are taken)."""
        if not self._buffer:
            return
        content = b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        assert self._loop is not None and self._registers is not None
        self._loop.call_soon_threadsafe(
            self._write, content, self._registers, self._buffered_seq_no
        )

    def _write(self, content: bytes, registers: Registers, through_seq_no: int) -> None:
        """On the loop: queue the bytes of ops up to `through_seq_no`, in order."""
        span = self.service.write_nowait(self.log, content, registers)
        self._handed_seq_no = through_seq_no
        if self._last is None or span.batch is not self._last.batch:
            span.batch.add_done_callback(self._landed)
        self._last = span

    def _landed(self, batch: asyncio.Future[int]) -> None:
        if batch.cancelled():
            self.failure = self.failure or asyncio.CancelledError("an append was cancelled")
        elif batch.exception() is not None:
            self.failure = self.failure or batch.exception()
        else:
            # Its commit began here: a tighter lower bound for what is recorded next.
            self.write_head = max(self.write_head, batch.result())

    # ---- barriers and hints -------------------------------------------------------------------

    def barrier(self) -> PendingSpan:
        """A zero-byte append after everything recorded so far (checking the author's register):
        it resolves once all of it is durable, or raises if any of it failed."""
        return self.service.barrier(self.log, registers=self._registers)

    async def _settled(self, span: PendingSpan) -> None:
        try:
            await span
        except Exception as exc:
            self.failure = self.failure or exc
            raise Fenced(f"recording into {self.log} stopped: {exc}") from exc
        if self.failure is not None:
            raise Fenced(f"recording into {self.log} stopped: {self.failure}") from self.failure

    async def durable(self) -> None:
        """On the loop: wait until everything recorded so far is in the log (no append of its
        own: it waits for the last op's); Fenced if it cannot be."""
        if self._last is not None:
            await self._settled(self._last)
        elif self.failure is not None:
            raise Fenced(f"recording into {self.log} stopped: {self.failure}") from self.failure

    async def sync(self) -> None:
        """Wait until everything recorded so far is durable, by a barrier that also checks the
        author's register; Fenced if it cannot be."""
        await self._settled(self.barrier())

    async def build_hints(self) -> rpb.FSMHints:
        """On the loop: hints for a player to rebuild what was recorded so far, returned once
        all of it is durable (hints must never name operations the log does not hold).
        RuntimeError if they would name an operation recorded off the loop and not yet handed
        to it (`flush`): take such a recorder's hints on its own thread."""
        hints = self.fsm.build_hints(self.log)
        named = max((s.last_seq_no for n in hints.live_nodes for s in n.segments), default=0)
        if named > self._handed_seq_no:
            # Returned, these hints would be stored and fail every player of them ("possible
            # data loss") until the thread next flushes, or for good if it never does.
            raise RuntimeError(
                f"hints of {self.log} name seq_no {named}, recorded off the event loop and not "
                f"handed to the log yet (through seq_no {self._handed_seq_no}): take them on "
                "the recording thread after flush() (the store's build_hints)"
            )
        await self.sync()
        return hints
