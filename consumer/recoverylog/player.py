"""The player (upstream's `recoverylog.Player`): a recovery log played into a local directory.

`play(hints, directory, ...)` empties the directory, learns each hinted log's write head with a
barrier, and reads the log segment by segment as the hints direct (skipping what they say is
dead), applying each operation the FSM takes: files are staged under `.fnodes/` by fnode, written
as the log says, and removed when their last link goes. Operations the FSM does not take (another
author's branch, out of sequence, of files the hints know to be dead) are skipped, their write
payloads read past. Once the hints are used up it reads on to the write head, and then tails the
log (`tailing` is set): a hot standby. Playback ends on request:

* `finish_at_write_head()`: at the write head, the files are made live (linked at their paths)
  and `play` returns the FSM (`gazctl shards recover`, a backup);
* `inject_handoff(author)`: at the write head, a no-op of `author`, sequenced after the last
  applied operation, is appended with `union_registers` of the author (fencing out the previous
  recorder, whose appends check its own); the player reads until it sees it. Applied, the log is
  ours: the files are made live. Not applied (the old recorder appended first), it reads on and
  injects again.

The loop only decodes: what operations do to files (creates, writes, removes, making them live,
emptying the directory) is done by a worker thread, in order, in batches, one batch written while
the next is decoded, so a large playback never stalls the other shards of the process. A
cancelled playback waits for the thread to finish before the directory is removed.

Nothing is written outside the directory (a shard's directory is a tenant's, and its log and
hints are written by whoever holds the shard): the FSM refuses paths that are not rooted in it and
cleanly spelled, and files are made live relative to it, opening each directory on the way from
the one above without following a symlink, so no entry on disk leads a path out either. A path
that would fails playback naming it. Files and directories made are private to the consumer's
user (0600, 0700), as fragments are.

Bytes between frames that are not a frame (a stray append to the log) are read past to the next
frame's marker, with a warning naming where and how many, as upstream's player does. Any
inconsistency it cannot skip (a frame whose body is not an operation, a hinted segment that is
not there, an offset jump over a hinted segment) raises PlaybackError, and the directory is
removed: nothing half played is left to be mistaken for a store.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO

from google.protobuf.message import DecodeError

from broker.client.append_service import AppendService, Registers
from broker.client.reader import Chunk, read_retrying
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import quote
from consumer.recoverylog.fsm import (
    FRAME_MAGIC,
    FSM,
    HEADER,
    STAGING,
    Applied,
    FSMError,
    UnsafePath,
    author_fence,
    decode_header,
    encode_frame,
)
from plumbing.tasks import first_of, in_thread, start_in_thread, wait_out

__all__ = ["FNODE_STAGING", "PlaybackError", "Player"]

log = logging.getLogger(__name__)

FNODE_STAGING = STAGING


class PlaybackError(Exception):
    """The log cannot be played as its hints say (the directory was removed)."""


class _State(enum.Enum):
    BACKFILL = "backfill"
    TAIL = "tail"
    EXIT_AT_HEAD = "exit at head"
    INJECT_AT_HEAD = "inject hand-off at head"
    READ_HANDOFF = "read hand-off"


class _LogReader:
    """Bytes of a log from an offset, buffered, read blocking or not; cancellation of a read
    loses nothing already buffered (the next read resumes after it)."""

    def __init__(self, stubs: Callable[[], pb_grpc.JournalStub]) -> None:
        self.stubs = stubs
        self.log = ""
        self.offset = 0  # Of the first buffered byte: the next to consume.
        self.buffer = bytearray()
        self.jumped_to: int | None = None
        self._chunks: AsyncIterator[Chunk] | None = None
        self._block = True
        self._skipped, self._skipped_at = 0, 0  # A run of bytes that are not a frame.

    def skip_to_frame(self) -> bool:
        """Drop buffered bytes that cannot begin a frame, up to the next frame's marker buffered
        (keeping a tail that may be the start of one); whether the buffer now begins with a
        frame's marker."""
        if self.buffer.startswith(FRAME_MAGIC):
            return True
        found = self.buffer.find(FRAME_MAGIC)
        if found < 0:  # Keep a tail that may begin a marker whose rest is not read yet.
            tail = next((n for n in range(len(FRAME_MAGIC) - 1, 0, -1) if self.buffer.endswith(FRAME_MAGIC[:n])), 0)  # fmt: skip
            found_or_tail = len(self.buffer) - tail
        self._skip(found if found >= 0 else found_or_tail)
        if found >= 0:
            self.report_skipped(f"skipped to the next frame at {self.offset}")
        return found >= 0

    def skip_rest(self) -> None:
        """At the write head: what is buffered is not a frame (appends are whole frames)."""
        self._skip(len(self.buffer))
        self.report_skipped(f"read past them to the write head at {self.offset}")

    def _skip(self, size: int) -> None:
        if size > 0:
            if not self._skipped:
                self._skipped_at = self.offset
            self._skipped += size
            self.take(size)

    def report_skipped(self, what: str) -> None:
        if self._skipped:
            log.warning(
                "recovery log %s: %d bytes at offset %d are not a frame: %s",
                self.log, self._skipped, self._skipped_at, what,
            )  # fmt: skip
            self._skipped = 0

    def seek(self, log_name: str, offset: int) -> None:
        if log_name == self.log and self.offset <= offset <= self.offset + len(self.buffer):
            del self.buffer[: offset - self.offset]
        else:
            self._drop_reads()
            self.buffer.clear()
        self.log, self.offset = log_name, offset

    def _drop_reads(self) -> None:
        chunks, self._chunks = self._chunks, None
        if chunks is not None:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                asyncio.ensure_future(aclose()).add_done_callback(_retrieve)

    async def fill(self, size: int, block: bool) -> bool:
        """Buffer at least `size` bytes; False if a non-blocking read reached the write head
        first. An offset jump (a hole in the journal) is taken only with nothing buffered, and
        noted in `jumped_to` for the caller to judge."""
        while len(self.buffer) < size:
            if self._chunks is None or self._block != block:
                self._drop_reads()
                end = self.offset + len(self.buffer)
                self._chunks = read_retrying(self.stubs, self.log, end, block=block).__aiter__()
                self._block = block
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._chunks = None
                return False
            except BaseException:
                self._chunks = None  # Cancelled, or failed: the next fill reads afresh.
                raise
            end = self.offset + len(self.buffer)
            if chunk.offset > end:
                if self.buffer:
                    raise PlaybackError(
                        f"{self.log}: content jumps from {end} to {chunk.offset} inside a frame"
                    )
                self.jumped_to, self.offset = chunk.offset, chunk.offset
                end = chunk.offset
            skip = end - chunk.offset
            if skip < len(chunk.content):
                self.buffer += chunk.content[skip:] if skip > 0 else chunk.content
        return True

    def take(self, size: int) -> bytes:
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.offset += size
        return out

    def close(self) -> None:
        self._drop_reads()


def _retrieve(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


# Staged-file work goes to the thread once this many operations, or bytes of writes, are queued
# (or sooner, when the player is about to wait for the log).
_BATCH_OPS = 128
_BATCH_BYTES = 1 << 20

_CREATE, _WRITE, _REMOVE = range(3)

# Opens that never follow a symlink at the name opened (O_EXCL: nor create through one).
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _parent_of(root: int, path: str) -> Iterator[tuple[int, str]]:
    """The directory (an open descriptor) that holds `path` of the played directory `root`,
    and the name in it, its directories made as needed: each is opened from the one above
    it without following a symlink, so whatever is on disk (a symlink, a file where a
    directory should be) cannot lead the path out; PlaybackError naming the path if one is
    not a directory. The path's spelling was checked by the FSM already."""
    *directories, name = path.removeprefix("/").split("/")
    fd = os.dup(root)
    try:
        for directory in directories:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700, dir_fd=fd)
            try:
                child = os.open(directory, _DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise PlaybackError(
                    f"recorded path {quote(path)}: {quote(directory)} is not a directory (a "
                    "symlink or a file): refusing to follow it out of the shard's directory"
                ) from None
            os.close(fd)
            fd = child
        try:
            yield fd, name
        except FileExistsError:
            raise PlaybackError(
                f"recorded path {quote(path)} exists already (a file, a directory or a symlink)"
            ) from None
    finally:
        os.close(fd)


class _StagedFiles:
    """The files of one playback, changed only by a worker thread. The loop queues what applied
    operations do (`create`, `write`, `remove`); `submit` hands the queue to the thread as one
    batch once the batch before it is done, so one batch is written while the next is decoded,
    in order. `settle` waits until all of it is done; `discard` removes the directory once the
    thread is done with it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.queued: list[tuple[int, int, int, bytes]] = []  # (what, fnode, offset, data)
        self._queued_bytes = 0
        self._running: asyncio.Future[None] | None = None
        self._files: dict[int, IO[bytes]] = {}  # The thread's.

    def create(self, fnode: int) -> None:
        self.queued.append((_CREATE, fnode, 0, b""))

    def write(self, fnode: int, offset: int, data: bytes) -> None:
        self.queued.append((_WRITE, fnode, offset, data))
        self._queued_bytes += len(data)

    def remove(self, fnode: int) -> None:
        self.queued.append((_REMOVE, fnode, 0, b""))

    @property
    def full(self) -> bool:
        return len(self.queued) >= _BATCH_OPS or self._queued_bytes >= _BATCH_BYTES

    async def reset(self) -> None:
        """Empty the directory, and make the staging in it."""
        await in_thread(self._reset)

    async def submit(self) -> None:
        """Once the batch in flight is done (its error raised here), hand it what is queued."""
        running, self._running = self._running, None
        if running is not None:
            await wait_out(running)
        if self.queued:
            batch, self.queued, self._queued_bytes = self.queued, [], 0
            self._running = start_in_thread(self._apply, batch)
        await asyncio.sleep(0)  # Decoding a long run of buffered frames lets others run too.

    async def settle(self) -> None:
        """Until everything queued is done."""
        await self.submit()
        running, self._running = self._running, None
        if running is not None:
            await wait_out(running)

    async def make_live(self, fsm: FSM) -> None:
        """Link each staged file at its paths, write the properties, remove the staging."""
        await self.settle()
        live = [(fnode, sorted(node.links)) for fnode, node in fsm.live_nodes.items()]
        await in_thread(self._make_live, live, dict(fsm.properties))

    async def discard(self) -> None:
        """Close the files and remove the directory, once the batch in flight is done (however
        it ends, cancelled meanwhile included)."""
        running, self._running = self._running, None
        self.queued.clear()
        try:
            if running is not None:
                with contextlib.suppress(Exception):
                    await wait_out(running)
        finally:
            await in_thread(self._remove)

    # ---- on the thread -------------------------------------------------------------------------

    def _staged(self, fnode: int) -> Path:
        return self.directory / FNODE_STAGING / str(fnode)

    def _reset(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(0o700, parents=True, exist_ok=True)
        (self.directory / FNODE_STAGING).mkdir(0o700)

    def _apply(self, batch: list[tuple[int, int, int, bytes]]) -> None:
        files = self._files
        for what, fnode, offset, data in batch:
            if what == _WRITE:
                f = files[fnode]
                f.seek(offset)
                f.write(data)
            elif what == _CREATE:
                # Private to the consumer's user, as fragments are: a shard's files are a tenant's.
                fd = os.open(self._staged(fnode), _NEW_FILE, 0o600)
                files[fnode] = os.fdopen(fd, "wb")  # Closed at make-live or remove.
            else:
                files.pop(fnode).close()
                os.unlink(self._staged(fnode))

    def _make_live(self, live: list[tuple[int, list[str]]], properties: dict[str, str]) -> None:
        files = self._files
        root = os.open(self.directory, _DIRECTORY)
        try:
            staging = os.open(FNODE_STAGING, _DIRECTORY, dir_fd=root)
            try:
                for fnode, links in live:
                    files.pop(fnode).close()
                    for path in links:
                        with _parent_of(root, path) as (parent, name):
                            os.link(str(fnode), name, src_dir_fd=staging, dst_dir_fd=parent,
                                    follow_symlinks=False)  # fmt: skip
                    os.unlink(str(fnode), dir_fd=staging)
            finally:
                os.close(staging)
            if files:
                raise PlaybackError(f"staged files the FSM does not know: {sorted(files)}")
            os.rmdir(FNODE_STAGING, dir_fd=root)
            for path, content in properties.items():
                with _parent_of(root, path) as (parent, name):
                    fd = os.open(name, _NEW_FILE, 0o600, dir_fd=parent)
                    with os.fdopen(fd, "w", encoding="utf-8") as out:
                        out.write(content)
        finally:
            os.close(root)

    def _remove(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


class Player:
    """Plays a recovery log into a directory (see the module's doc); `tailing` is set once it
    reached the write head; `fsm` is the recovered state once `play` returned."""

    def __init__(self) -> None:
        self.tailing = asyncio.Event()
        self._requested = asyncio.Event()
        self._handoff: int | None = None
        self.fsm: FSM | None = None

    def finish_at_write_head(self) -> None:
        self._request(0)

    def inject_handoff(self, author: int) -> None:
        if author == 0:
            raise ValueError("a hand-off needs a non-zero author")
        self._request(author)

    def _request(self, author: int) -> None:
        if self._handoff is not None:
            raise RuntimeError("playback's end was requested already")
        self._handoff = author
        self._requested.set()

    async def play(
        self,
        hints: rpb.FSMHints,
        directory: str | Path,
        stubs: Callable[[], pb_grpc.JournalStub],
        service: AppendService,
    ) -> FSM:
        staged = _StagedFiles(Path(directory))
        try:
            fsm = await self._play(hints, stubs, service, staged)
        except BaseException:
            await staged.discard()
            raise
        self.fsm = fsm
        return fsm

    async def _play(
        self,
        hints: rpb.FSMHints,
        stubs: Callable[[], pb_grpc.JournalStub],
        service: AppendService,
        staged: _StagedFiles,
    ) -> FSM:
        try:
            # Off the loop too: hints of many thousands of files take a while to take in.
            fsm = await in_thread(FSM, hints)
        except ValueError as exc:
            raise PlaybackError(f"hints of {hints.log}: {exc}") from None
        await staged.reset()

        # The write heads of every log the hints name: reading past them is tailing.
        heads: dict[str, int] = {}
        for name in [hints.log, *(s.log for s in fsm.hinted_segments)]:
            if name not in heads:
                heads[name] = (await service.barrier(name)).end
        for s in fsm.hinted_segments:
            if s.first_offset >= heads[s.log] or s.last_offset > heads[s.log]:
                raise PlaybackError(
                    f"{s.log} ends at {heads[s.log]}, before the hinted segment of seq_no "
                    f"{s.first_seq_no}-{s.last_seq_no} at {s.first_offset}-{s.last_offset}: "
                    "possible data loss"
                )

        reader = _LogReader(stubs)
        state = _State.BACKFILL
        read_through = 0
        handoff = 0
        try:
            while True:
                if fsm.hinted_segments:
                    segment = fsm.hinted_segments[0]
                    if reader.log != segment.log or reader.offset < segment.first_offset:
                        reader.seek(segment.log, segment.first_offset)
                        read_through = heads[segment.log]
                    elif reader.offset >= read_through:
                        raise PlaybackError(
                            f"{reader.log} read through its head {read_through} with hints "
                            f"unused (next: seq_no {segment.first_seq_no}): possible data loss"
                        )
                elif not reader.log:
                    reader.seek(hints.log, 0)
                    read_through = heads[hints.log]
                elif reader.log != hints.log:
                    raise PlaybackError(f"read {reader.log} after the hints, not {hints.log}")

                if self._requested.is_set() and state in (_State.BACKFILL, _State.TAIL):
                    handoff = self._handoff or 0
                    state = _State.INJECT_AT_HEAD if handoff else _State.EXIT_AT_HEAD

                if staged.queued and (staged.full or len(reader.buffer) < HEADER):
                    await staged.submit()  # A batch's worth, or the log is to be waited for.

                # Blocking while the head is not buffered yet (a frame is whole by the head).
                buffered_to = reader.offset + len(reader.buffer)
                block = state in (_State.TAIL, _State.READ_HANDOFF) or buffered_to < read_through
                if state == _State.TAIL:
                    ready = await self._fill_or_request(reader)
                    if ready is None:
                        continue  # Asked to end: decide how, above.
                else:
                    ready = await reader.fill(HEADER, block)
                if reader.jumped_to is not None:
                    self._check_jump(reader, fsm)
                if ready and not reader.skip_to_frame():
                    continue  # Not a frame (a stray append): read on to the next one.
                if not ready and not block:
                    reader.skip_rest()  # What is buffered at the head is no frame, if anything.
                if not ready:  # A non-blocking read reached the write head.
                    await staged.settle()  # The files are as the log says, up to its head.
                    self.tailing.set()
                    if state == _State.BACKFILL:
                        state = _State.TAIL
                    elif state == _State.EXIT_AT_HEAD:
                        await _make_live(staged, fsm)
                        return fsm
                    elif state == _State.INJECT_AT_HEAD:
                        noop = rpb.RecordedOp(
                            seq_no=fsm.next_seq_no, checksum=fsm.next_checksum, author=handoff
                        )
                        span = await service.write(
                            hints.log, encode_frame(noop), Registers(union=author_fence(handoff))
                        )
                        read_through = (await span).end
                        state = _State.READ_HANDOFF
                    continue

                op, applied = await _play_operation(reader, fsm, staged)
                if handoff and op.author == handoff:
                    if applied:
                        await _make_live(staged, fsm)
                        return fsm
                    state = _State.INJECT_AT_HEAD  # Lost a race: inject again.
        finally:
            reader.close()

    async def _fill_or_request(self, reader: _LogReader) -> bool | None:
        """While tailing: the next frame's header buffered (True), or None if playback's end was
        requested first (a partly buffered frame stays buffered)."""
        filling, _ = await first_of(reader.fill(HEADER, True), self._requested.wait())
        if filling.cancelled():
            return None
        buffered: bool = filling.result()
        return buffered

    @staticmethod
    def _check_jump(reader: _LogReader, fsm: FSM) -> None:
        to, reader.jumped_to = reader.jumped_to, None
        assert to is not None
        if fsm.hinted_segments:
            s = fsm.hinted_segments[0]
            if s.last_offset != 0 and s.last_offset < to:
                raise PlaybackError(
                    f"{reader.log}: content jumps to {to}, over the hinted segment at "
                    f"{s.first_offset}-{s.last_offset}: possible data loss"
                )
        log.warning("recovery log %s: content jumps to offset %d", reader.log, to)


async def _play_operation(
    reader: _LogReader, fsm: FSM, staged: _StagedFiles
) -> tuple[rpb.RecordedOp, bool]:
    """Decode the next operation, apply it to the FSM and, if applied, queue what it does to
    the files."""
    first = reader.offset
    try:
        length = decode_header(bytes(reader.buffer[:HEADER]))
    except ValueError as exc:
        raise PlaybackError(f"{reader.log}@{first}: {exc}") from None
    if not await reader.fill(HEADER + length, True):
        raise PlaybackError(f"{reader.log}@{first}: a frame ends past the write head")
    frame = reader.take(HEADER + length)
    body = frame[HEADER:]
    try:
        op = rpb.RecordedOp.FromString(body)
    except DecodeError as exc:
        raise PlaybackError(f"{reader.log}@{first}: not a RecordedOp ({exc})") from None
    payload = op.write.length if op.HasField("write") else 0
    if payload < 0:
        raise PlaybackError(f"{reader.log}@{first}: a write of {payload} bytes")
    op.first_offset, op.last_offset, op.log = first, first + HEADER + length + payload, reader.log

    try:
        outcome: Applied | None = fsm.apply(op, body)
    except UnsafePath as exc:
        raise PlaybackError(f"{reader.log}@{first}: {exc}") from None
    except FSMError as exc:
        outcome = None
        log.debug("recovery log %s@%d: skipped op %d: %s", reader.log, first, op.seq_no, exc)
    if payload and not await reader.fill(payload, True):
        raise PlaybackError(f"{reader.log}@{first}: a write's data ends past the write head")
    data = reader.take(payload) if payload else b""
    if outcome is Applied.APPLIED:
        _reenact(op, data, fsm, staged)
    return op, outcome is not None


def _reenact(op: rpb.RecordedOp, data: bytes, fsm: FSM, staged: _StagedFiles) -> None:
    if op.HasField("create"):
        staged.create(op.seq_no)
    elif op.HasField("unlink"):
        if op.unlink.fnode not in fsm.live_nodes:
            staged.remove(op.unlink.fnode)
    elif op.HasField("write"):
        staged.write(op.write.fnode, op.write.offset, data)


async def _make_live(staged: _StagedFiles, fsm: FSM) -> None:
    """The files at their paths, the properties written, the staging removed."""
    if fsm.has_remaining_hints():
        raise PlaybackError("playback ended with hints unused")
    await staged.make_live(fsm)
    log.info(
        "played %s into %s: %d files, next seq_no %d",
        fsm.last_log, staged.directory, len(fsm.live_nodes), fsm.next_seq_no,
    )  # fmt: skip
