"""The Spool: a replica's transactional memory of one journal, driven by ReplicateRequests.

It holds the Fragment being built (content in an unlinked temporary file, never in memory), the
journal registers, and uncommitted content that a later proposal either commits or rolls back.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast

from broker.fragment import codecs
from broker.fragment.fragments import ZERO_DIGEST, digest_of, sum_from_digest
from broker.protocol import protocol_pb2 as pb
from plumbing import metrics

if TYPE_CHECKING:
    from hashlib import _Hash


__all__ = ["CompletedFragment", "Spool", "SpoolError", "SpoolObserver"]


class SpoolError(Exception):
    """A ReplicateRequest which is not a valid transition of the Spool: the replication stream
    that carried it must be aborted (the primary and this replica disagree on the journal)."""


class SpoolObserver(Protocol):
    """Told of the Spool's lifecycle; the way readers of a replica learn of new content."""

    def on_commit(self, fragment: pb.Fragment) -> None:
        """The Spool's fragment was extended to `fragment` by a commit."""

    def on_complete(self, completed: CompletedFragment) -> None:
        """A non-empty fragment was completed by a roll. The observer now owns `completed` (its
        content file) and must close it once the fragment is persisted or no longer needed."""


_LIVE_FILES: weakref.WeakSet[_SpoolFile] = weakref.WeakSet()


def disk_bytes() -> int:
    """Disk space of this process's spool files (unlinked, so only their descriptors know)."""
    total = 0
    for file in list(_LIVE_FILES):
        total += file.disk_bytes()
    return total


class _SpoolFile:
    """An unlinked temporary file, read and written by position.

    One owner writes while any thread may read. Closing waits for reads in flight, so a reader
    never reaches a file descriptor number that was closed and reused for another file.
    """

    __slots__ = ("__weakref__", "_closing", "_fd", "_finalize", "_lock", "_readers")

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        fd, path = tempfile.mkstemp(prefix="spool-", dir=directory)
        try:
            os.unlink(path)  # The file lives only as long as its descriptor.
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._lock = threading.Lock()
        self._readers = 0
        self._closing = False
        _LIVE_FILES.add(self)
        # Also closes the descriptor if an owner drops the file without closing it.
        self._finalize = weakref.finalize(self, os.close, fd)

    def disk_bytes(self) -> int:
        with self._lock:
            if self._closing:
                return 0
            try:
                return os.fstat(self._fd).st_blocks * 512
            except OSError:
                return 0

    def write(self, data: bytes, offset: int) -> None:
        written = os.pwrite(self._fd, data, offset)
        if written == len(data):
            return
        view = memoryview(data)
        while written < len(view):
            written += os.pwrite(self._fd, view[written:], offset + written)

    def read(self, offset: int, size: int) -> bytes:
        with self._lock:
            if self._closing:
                raise ValueError("read of a closed fragment file")
            self._readers += 1
        try:
            data = os.pread(self._fd, size, offset)
            if len(data) == size:
                return data
            parts = [data]
            got = len(data)
            while got < size:
                more = os.pread(self._fd, size - got, offset + got)
                if not more:
                    raise OSError(f"fragment file ends {size - got} bytes before {offset + size}")
                parts.append(more)
                got += len(more)
            return b"".join(parts)
        finally:
            with self._lock:
                self._readers -= 1
                last = self._closing and self._readers == 0
            if last:
                self._finalize()

    def truncate(self, length: int) -> None:
        os.ftruncate(self._fd, length)

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self) -> None:
        with self._lock:
            self._closing = True
            if self._readers:
                return  # The last reader closes it.
        self._finalize()


# Compression runs off the event loop: zlib, zstd and snappy release the GIL while they work.
_COMPRESSORS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="spool-compress")


class _Compression:
    """A fragment's content compressed with its codec into a second unlinked file, built in
    batches of `codecs.BATCH_SIZE` as content commits (upstream compresses the same way, so a
    GZIP fragment is a gzip member per batch), and finished when the fragment is persisted.

    Batches run on worker threads, reading committed content from the spool file (which never
    changes once committed); a lock orders them, so any number may be scheduled."""

    def __init__(self, codec: pb.CompressionCodec, raw: _SpoolFile, directory: str | None) -> None:
        self.codec = codec
        self._raw = raw
        self._directory = directory
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._compressor: codecs.Compressor | None = None
        self._through = 0  # Content bytes compressed so far.
        self._scheduled = 0  # Content length the last scheduled batch compresses through.
        self._length = -1  # Compressed length, once finished.
        self._closed = False

    def schedule(self, length: int) -> None:
        """Compress committed content through `length`, in the background, once a batch of it
        is pending."""
        if length - self._scheduled >= codecs.BATCH_SIZE:
            self._scheduled = length
            _COMPRESSORS.submit(self._batches, length, False)

    def _batches(self, length: int, final: bool) -> None:
        with self._lock:
            if self._closed or self._length >= 0:
                return
            try:
                if self._file is None:
                    # Owned by this object: closed by `_discard`.
                    self._file = tempfile.TemporaryFile(  # noqa: SIM115
                        prefix="spool-z-", dir=self._directory
                    )
                    self._compressor = codecs.compressor(self.codec, self._file)
                assert self._compressor is not None
                while self._through < length and (
                    final or length - self._through >= codecs.BATCH_SIZE
                ):
                    size = min(codecs.BATCH_SIZE, length - self._through)
                    self._compressor.write(self._raw.read(self._through, size))
                    self._compressor.end_batch()
                    self._through += size
                if final:
                    self._compressor.close()
                    self._file.flush()
                    self._length = self._file.tell()
            except BaseException:
                # Start over on the next call: a partial compressed file is useless.
                self._discard()
                if final:
                    raise

    def finish(self, length: int) -> tuple[BinaryIO, int]:
        """(file, compressed length) of all `length` bytes of content; blocks while compressing
        what is left (call it off the event loop). The file stays owned by this object."""
        self._batches(length, True)
        assert self._file is not None
        return self._file, self._length

    def _discard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._compressor, self._through, self._length = None, None, 0, -1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._discard()


class CompletedFragment:
    """A fragment which a roll completed: its metadata, and its content still readable from the
    spool file until `close()`. This is what gets persisted to the fragment store.

    `primary` tells whether this broker was the journal's primary when the fragment completed:
    upstream's primary persists at once, while replicas queue the fragment and usually find it
    already persisted. A replica also persists at once what a synchronization rolled (a new
    pipeline, so a new route: the primary that held the fragment may be gone, and the replicas
    joining now never held it); `primary` is set for it too.
    """

    __slots__ = (
        "_compression",
        "_file",
        "_fragment",
        "_refs",
        "_registers",
        "first_append_time",
        "primary",
    )

    def __init__(
        self,
        file: _SpoolFile,
        fragment: pb.Fragment,
        registers: pb.LabelSet,
        first_append_time: datetime | None,
        primary: bool,
        compression: _Compression | None = None,
    ) -> None:
        self._file = file
        self._fragment = fragment
        self._registers = registers
        self.first_append_time = first_append_time
        self.primary = primary
        self._compression = compression
        self._refs = 1

    @property
    def fragment(self) -> pb.Fragment:
        return _copy_fragment(self._fragment)

    @property
    def registers(self) -> pb.LabelSet:
        """The journal registers at completion."""
        return _copy_labels(self._registers)

    @property
    def content_length(self) -> int:
        return self._fragment.end - self._fragment.begin

    @property
    def closed(self) -> bool:
        return self._file.closed

    def read(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes of content from journal `offset` (fewer only at the fragment end)."""
        return _read_range(self._file, self._fragment.begin, self._fragment.end, offset, size)

    def compressed(self, directory: str | None = None) -> tuple[BinaryIO, int]:
        """(file, length) of the content compressed with the fragment's codec: what is
        persisted. Blocking (call it off the event loop); the file belongs to this fragment.
        NONE is the content itself: a reader of the spool file."""
        codec = self._fragment.compression_codec
        if codec == pb.NONE:
            reader = cast(BinaryIO, _SpoolFileReader(self._file, self.content_length))
            return reader, self.content_length
        if self._compression is None:
            # A replica does not compress as content commits: it compresses only if it
            # ever has to persist the fragment itself.
            self._compression = _Compression(codec, self._file, directory)
        return self._compression.finish(self.content_length)

    def retain(self) -> None:
        """Take another reference: `close` releases the files once every holder closed."""
        self._refs += 1

    def close(self) -> None:
        """Release this holder's reference; the last one releases the content files (reads in
        flight on other threads finish first)."""
        if self._refs <= 0:
            return
        self._refs -= 1
        if self._refs:
            return
        if self._compression is not None:
            self._compression.close()
        self._file.close()

    def __enter__(self) -> CompletedFragment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        f = self._fragment
        return f"CompletedFragment<{f.journal} [{f.begin}, {f.end})>"


class _SpoolFileReader(io.RawIOBase):
    """A file-like reader of a spool file's first `length` bytes (what stores upload)."""

    def __init__(self, file: _SpoolFile, length: int) -> None:
        self._spool_file = file
        self._length = length
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._length - self._at)
        if size <= 0:
            return 0
        data = self._spool_file.read(self._at, size)
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._length - self._at
        size = min(size, self._length - self._at)
        if size <= 0:
            return b""
        data = self._spool_file.read(self._at, size)
        self._at += len(data)
        return data


def _read_range(file: _SpoolFile | None, begin: int, end: int, offset: int, size: int) -> bytes:
    if not begin <= offset <= end:
        raise ValueError(f"offset {offset} is outside of the fragment [{begin}, {end})")
    size = min(size, end - offset)
    if size <= 0:
        return b""
    assert file is not None, "a fragment with content has a file"
    return file.read(offset - begin, size)


def _copy_fragment(fragment: pb.Fragment) -> pb.Fragment:
    out = pb.Fragment()
    out.CopyFrom(fragment)
    return out


def _copy_labels(labels: pb.LabelSet) -> pb.LabelSet:
    out = pb.LabelSet()
    out.CopyFrom(labels)
    return out


def _labels_key(labels: pb.LabelSet) -> tuple[tuple[str, str, bool], ...]:
    return tuple((label.name, label.value, label.prefix) for label in labels.labels)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Spool:
    """A replica's fragment under construction, plus registers and uncommitted content.

    `apply` runs the transitions. A content chunk appends pending bytes at `content_delta`. A
    proposal is matched, in order, against:

    - a roll: a proposal ending beyond the spool's end plus pending bytes, or an empty proposal
      at exactly the spool's end, first restarts the spool empty at the proposal's end (handing a
      non-empty fragment to `on_complete`) and takes the proposal's registers if it moved forward;
    - a rollback: the current fragment and registers exactly, which discards pending bytes;
    - a commit: the current fragment extended by all pending bytes, which adopts it and its
      registers.

    Anything else answers PROPOSAL_MISMATCH with the spool's fragment and registers, so the
    primary can roll everyone to the furthest offset. Only the owner of the spool calls `apply`;
    `read` may be called from any thread.
    """

    def __init__(
        self,
        journal: str,
        observer: SpoolObserver,
        *,
        directory: str | os.PathLike[str] | None = None,
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        self._journal = journal
        self._observer = observer
        self._directory = directory
        self._clock = clock
        self._closed = False
        self._file: _SpoolFile | None = None
        self._registers = pb.LabelSet()
        self._registers_key: tuple[tuple[str, str, bool], ...] = ()
        self._restart(0, pb.NONE)

    def _restart(self, offset: int, codec: pb.CompressionCodec) -> None:
        self._begin = self._end = offset
        self._codec = codec
        self._digest = ZERO_DIGEST  # Of committed content; all zeros while there is none.
        self._delta = 0
        self._committed_sha: _Hash = hashlib.sha1()
        # Pending content is summed on a copy of the committed state, so a rollback is free.
        self._pending_sha: _Hash | None = None
        self._first_append_time: datetime | None = None
        self._compression: _Compression | None = None
        # What readers on other threads see: replaced as one value, never mutated.
        self._view: tuple[_SpoolFile | None, int, int] = (self._file, offset, offset)

    # --- State -----------------------------------------------------------------------------------

    @property
    def journal(self) -> str:
        return self._journal

    @property
    def begin(self) -> int:
        return self._begin

    @property
    def end(self) -> int:
        """End of committed content (pending bytes follow it)."""
        return self._end

    @property
    def delta(self) -> int:
        """Bytes of pending, uncommitted content."""
        return self._delta

    @property
    def content_length(self) -> int:
        """Bytes of committed content in the fragment."""
        return self._end - self._begin

    @property
    def first_append_time(self) -> datetime | None:
        """When the fragment's first commit was applied (None while it has no content)."""
        return self._first_append_time

    @property
    def fragment(self) -> pb.Fragment:
        """The fragment as of the last commit."""
        return self._make_fragment(self._end, self._digest)

    @property
    def registers(self) -> pb.LabelSet:
        """The journal registers as of the last commit or roll."""
        return _copy_labels(self._registers)

    def next_proposal(self) -> pb.Fragment:
        """The fragment which a commit of all pending content proposes."""
        if self._pending_sha is None:
            return self.fragment
        return self._make_fragment(self._end + self._delta, self._pending_sha.digest())

    def _make_fragment(self, end: int, digest: bytes) -> pb.Fragment:
        return pb.Fragment(
            journal=self._journal,
            begin=self._begin,
            end=end,
            sum=sum_from_digest(digest) if end != self._begin else None,
            compression_codec=self._codec,
        )

    def read(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes of committed content from journal `offset` (fewer only at the end;
        pending bytes are never returned). Raises ValueError for an offset outside the fragment,
        which happens when a roll moved the spool on: the completed fragment has the bytes."""
        file, begin, end = self._view
        if self._closed:
            raise ValueError(f"read of the closed spool of {self._journal}")
        return _read_range(file, begin, end, offset, size)

    # --- Transitions -----------------------------------------------------------------------------

    def apply(
        self, request: pb.ReplicateRequest, primary: bool = False, persist_at_once: bool = False
    ) -> pb.ReplicateResponse:
        """Apply a content chunk or a proposal. A chunk answers an empty (OK) response or raises
        SpoolError; a proposal answers OK or PROPOSAL_MISMATCH. OSErrors of the spool file
        propagate and leave the spool as it was. `primary` is recorded on a fragment that this
        request completes, for the persister, which persists it at once (`persist_at_once`
        asks the same of a replica: see CompletedFragment)."""
        if self._closed:
            raise SpoolError(f"the spool of {self._journal} is closed")
        if request.HasField("proposal"):
            if persist_at_once and not primary:
                return self._apply_proposal(request.proposal, request.registers, False, True)
            return self._apply_proposal(request.proposal, request.registers, primary)
        self._apply_content(request.content, request.content_delta)
        return pb.ReplicateResponse()

    def apply_content(self, content: bytes, content_delta: int) -> pb.ReplicateResponse:
        """`apply` of a content chunk, without its message."""
        if self._closed:
            raise SpoolError(f"the spool of {self._journal} is closed")
        self._apply_content(content, content_delta)
        return pb.ReplicateResponse()

    def rollback(self) -> None:
        """Discard pending content (what a replica does when its replication stream ends)."""
        if self._delta:
            metrics.spool_rollbacks.inc()
            metrics.spool_rollback_bytes.inc(self._delta)
        self._delta = 0
        self._pending_sha = None

    def _apply_content(self, content: bytes, content_delta: int) -> None:
        if content_delta != self._delta:
            raise SpoolError(
                f"invalid content_delta of {self._journal} ({content_delta}; expected {self._delta})"
            )
        if not content:
            return
        if self._file is None:
            self._file = _SpoolFile(self._directory)
            self._view = (self._file, self._begin, self._end)
        self._file.write(content, self._end - self._begin + self._delta)
        if self._pending_sha is None:
            self._pending_sha = self._committed_sha.copy()
        self._pending_sha.update(content)
        self._delta += len(content)

    def _apply_proposal(
        self,
        proposal: pb.Fragment,
        registers: pb.LabelSet,
        primary: bool,
        persist_at_once: bool = False,
    ) -> pb.ReplicateResponse:
        # Upstream rolls before noticing a foreign journal; a spool must never move for another
        # journal's proposal, so that one is refused first.
        if proposal.journal != self._journal:
            return self._mismatch()

        end = proposal.end
        if end > self._end + self._delta or (end == self._end and proposal.begin == end):
            # A peer knows a later offset (or the primary asks to start a new fragment here).
            # This happens even if the proposal then mismatches: answering with the rolled
            # fragment is how the primary learns the offset to roll everyone to.
            self._roll(proposal, registers if end > self._end else None, primary or persist_at_once)

        if self._is_fragment(proposal, self._end, self._digest):
            if _labels_key(registers) == self._registers_key:
                self.rollback()
                return pb.ReplicateResponse()
            return self._mismatch()

        if self._pending_sha is not None:
            digest = self._pending_sha.digest()
            if self._is_fragment(proposal, self._end + self._delta, digest):
                self._commit(digest, registers, primary)
                return pb.ReplicateResponse()
        return self._mismatch()

    def _is_fragment(self, proposal: pb.Fragment, end: int, digest: bytes) -> bool:
        # Field by field: protobuf equality would tell an unset `sum` from a zero one.
        return (
            proposal.begin == self._begin
            and proposal.end == end
            and proposal.compression_codec == self._codec
            and digest_of(proposal.sum) == digest
            and not proposal.backing_store
            and not proposal.mod_time
            and not proposal.path_postfix
        )

    def _commit(self, digest: bytes, registers: pb.LabelSet, primary: bool) -> None:
        assert self._pending_sha is not None
        metrics.spool_commits.inc()
        metrics.spool_commit_bytes.inc(self._delta)
        self._end += self._delta
        self._delta = 0
        self._committed_sha, self._pending_sha = self._pending_sha, None
        self._digest = digest
        self._set_registers(registers)
        if self._first_append_time is None:
            self._first_append_time = self._clock()
        self._view = (self._file, self._begin, self._end)
        if primary and self._codec != pb.NONE:
            # The primary persists the fragment when it completes: compress as we go.
            if self._compression is None:
                assert self._file is not None
                directory = None if self._directory is None else os.fspath(self._directory)
                self._compression = _Compression(self._codec, self._file, directory)
            self._compression.schedule(self._end - self._begin)
        self._observer.on_commit(self.fragment)

    def _roll(self, proposal: pb.Fragment, registers: pb.LabelSet | None, primary: bool) -> None:
        completed: CompletedFragment | None = None
        if self._end > self._begin:
            assert self._file is not None
            # Drop discarded pending bytes, so the file holds exactly the fragment's content.
            self._file.truncate(self._end - self._begin)
            completed = CompletedFragment(
                self._file,
                self.fragment,
                self.registers,
                self._first_append_time,
                primary,
                self._compression,
            )
            self._file, self._compression = None, None
        # Else any file holds only discarded pending bytes: it is reused.
        if registers is not None:
            self._set_registers(registers)
        self._restart(proposal.end, proposal.compression_codec)
        if completed is not None:
            metrics.spool_completed.inc()
            self._observer.on_complete(completed)

    def _set_registers(self, registers: pb.LabelSet) -> None:
        key = _labels_key(registers)
        if key != self._registers_key:
            self._registers = _copy_labels(registers)
            self._registers_key = key

    def _mismatch(self) -> pb.ReplicateResponse:
        return pb.ReplicateResponse(
            status=pb.PROPOSAL_MISMATCH, fragment=self.fragment, registers=self.registers
        )

    # --- Lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the spool's file. Completed fragments are unaffected: their owners close them."""
        self._closed = True
        if self._compression is not None:
            self._compression.close()
            self._compression = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Spool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        registers = ",".join(f"{label.name}={label.value}" for label in self._registers.labels)
        return (
            f"Spool<{self._journal} [{self._begin}, {self._end}) +{self._delta} pending, "
            f"registers: {registers or '-'}>"
        )
