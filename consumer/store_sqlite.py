"""A SQLite store recorded into the shard's recovery log (upstream's `store-sqlite`).

The database lives in the shard's local directory and is opened through a VFS of our own (apsw's
VFS classes can be written in Python; the stdlib `sqlite3` cannot register one): every write to
the database file and to its rollback journal, each creation, truncation and deletion, is recorded
as it happens, in order, and each `xSync` sends everything recorded so far to the log. A commit
completes (`start_commit`'s awaitable) only once its operations are durable in the log, as
upstream's stores do: meanwhile the next transaction may run on the local database (a commit that
never reaches the log fails the store, and the next primary recovers from the log without it).
A player rebuilds the files as they were at any point (a rollback journal left by a transaction cut short is played too, and
SQLite rolls it back when it opens the database). A truncation to zero is a new file (fnode), as
upstream records it; to another size, the remaining content is recorded as a new file.

The checkpoint is a row of `gazette_checkpoint` (rowid 0), written in the same SQLite transaction
as the application's changes.

The playback horizon is bounded: once the log holds `compact_after` bytes recorded since the
database was last written whole (and at least four times the database's size), the store writes
a compacted copy (`VACUUM INTO`, recorded as a new file) and renames it over the database, between
transactions. The old database file is then dead: hints no longer name the log before the copy,
so a new replica plays only from there, and `gazctl shards prune` can remove the rest. Fencing is the recovery log's: a zombie primary's recorder finds
its author register gone, its appends fail, and its SQLite commits with them (xSync raises).

All SQLite work runs on one thread of the store's own, never on the event loop: the application
runs its statements with `await store.run(fn)` (`fn(connection)` on that thread, inside the
consumer transaction's SQLite transaction, begun on first use).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import apsw

from consumer.protocol import cpb
from consumer.recoverylog.recorder import Recorder

__all__ = ["DATABASE", "SQLiteStore", "wants_sqlite"]

T = TypeVar("T")
DATABASE = "store.db"
_MAIN_DB: int = apsw.SQLITE_OPEN_MAIN_DB
_MAIN_JOURNAL: int = apsw.SQLITE_OPEN_MAIN_JOURNAL
_WAL: int = apsw.SQLITE_OPEN_WAL
_RECORDED = _MAIN_DB | _MAIN_JOURNAL | _WAL
_names = itertools.count()


class _RecordingVFS(apsw.VFS):
    """The default VFS, recording what changes files under the recorder's directory."""

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.recorder = recorder
        self.base = apsw.vfs_names()[0]
        # SQLite names files by their resolved path (a directory reached through a symlink,
        # as macOS's temporary directory is, resolves elsewhere): recognised by that.
        self.resolved = os.path.realpath(recorder.directory)
        super().__init__(name, self.base)

    def xFullPathname(self, name: str) -> str:
        # The default VFS answers SQLITE_OK_SYMLINK for a path through a symlink, which a
        # Python VFS takes for an error ("not an error"): resolved here instead.
        return os.path.realpath(name)

    def recorded(self, filename: str | None) -> str | None:
        """The recorder's name of `filename` (under its directory as it was given), or None
        if the file is not under it."""
        if filename is None or not filename.startswith(self.resolved + "/"):
            return None
        return self.recorder.directory + filename[len(self.resolved) :]

    def xOpen(self, name: Any, flags: list[int]) -> _RecordingFile:
        filename = name.filename() if isinstance(name, apsw.URIFilename) else name
        recorded = self.recorded(filename) if flags[0] & _RECORDED else None
        return _RecordingFile(self, name, flags, recorded, wal=bool(flags[0] & _WAL))

    def xDelete(self, filename: str, syncdir: bool) -> None:
        super().xDelete(filename, syncdir)
        recorded = self.recorded(filename)
        if recorded is not None and self.recorder.fsm.links.get(self._path(recorded)) is not None:
            self.recorder.record_remove(recorded)

    def _path(self, filename: str) -> str:
        return "/" + os.path.relpath(filename, self.recorder.directory)


class _RecordingFile(apsw.VFSFile):
    def __init__(
        self, vfs: _RecordingVFS, name: Any, flags: list[int], recorded: str | None, wal: bool
    ) -> None:
        super().__init__(vfs.base, name, flags)
        self.recorder = vfs.recorder
        self.path = recorded
        self.wal = wal
        self.written = False
        self.fnode = self.recorder.record_open(recorded) if recorded is not None else 0

    def xWrite(self, data: bytes, offset: int) -> None:
        super().xWrite(data, offset)
        if self.path is None:
            return
        if self.wal and offset == 0 and self.written:
            # The WAL starts over (after a checkpoint): a new file, so that the log of the
            # frames before it is dead (its stale tail, left in place locally, has other salts
            # and SQLite ignores it).
            self.fnode = self.recorder.record_create(self.path)
        self.written = True
        self.recorder.record_write(self.fnode, bytes(data), offset)

    def xTruncate(self, size: int) -> None:
        super().xTruncate(size)
        if self.path is None:
            return
        # A new fnode: truncation is not an operation of recovery logs.
        self.fnode = self.recorder.record_create(self.path)
        if size:
            with open(self.path, "rb") as f:
                content = f.read(size)
            self.recorder.record_write(self.fnode, content, 0)

    def xSync(self, flags: int) -> None:
        if self.path is None:
            super().xSync(flags)
            return
        # Sent to the log now; the store's commit completes once it is durable there. The log
        # is what makes a recorded file durable: the local copy is never trusted after a crash
        # (a replica plays the log back into its directory), so it is not fsynced.
        self.recorder.flush()


class SQLiteStore:
    """A store on SQLite in the recorder's directory (see the module's doc). Made once the
    directory holds what the recovery log recorded (playback), with the recorder started."""

    # Commits that may be in flight at once (consumer.transaction): each commits locally once
    # the one before did, and becomes durable with its log writes, so commits queued behind an
    # append in flight go out together in the next one.
    pipelined_commits = 8

    def __init__(
        self, recorder: Recorder, *, compact_after: int = 64 << 20, journal_mode: str = "WAL"
    ) -> None:
        if journal_mode not in ("WAL", "DELETE"):
            raise ValueError(f"journal_mode {journal_mode!r}: WAL or DELETE")
        self.recorder = recorder
        self.journal_mode = journal_mode
        self.compact_after = compact_after
        self.compactions = 0
        self._recorded_at_compaction = 0
        self.path = str(Path(recorder.directory) / DATABASE)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqlite-store")
        self._vfs_name = f"gazette-recorded-{os.getpid()}-{next(_names)}"
        self._vfs: _RecordingVFS | None = None
        self.db: apsw.Connection | None = None
        self._in_txn = False
        self._committing: asyncio.Future[None] | None = None
        self._local: asyncio.Future[None] | None = None  # The last commit, done locally.

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ---- on the store's thread ---------------------------------------------------------------

    def _connect(self) -> apsw.Connection:
        db = apsw.Connection(self.path, vfs=self._vfs_name)
        # Exclusive first: WAL then needs no shared memory (which a Python VFS cannot map).
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute(f"PRAGMA journal_mode={self.journal_mode}")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _open(self) -> cpb.Checkpoint:
        self._vfs = _RecordingVFS(self._vfs_name, self.recorder)
        self.db = self._connect()
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS gazette_checkpoint (id INTEGER PRIMARY KEY, checkpoint BLOB)"
        )
        row = self.db.execute("SELECT checkpoint FROM gazette_checkpoint WHERE id = 0").fetchone()
        return cpb.Checkpoint.FromString(bytes(row[0])) if row and row[0] else cpb.Checkpoint()

    def _begin(self) -> None:
        assert self.db is not None
        if not self._in_txn:
            self.db.execute("BEGIN")
            self._in_txn = True

    def _commit(self, checkpoint: bytes) -> None:
        assert self.db is not None
        self._begin()
        try:
            self.db.execute(
                "INSERT OR REPLACE INTO gazette_checkpoint (id, checkpoint) VALUES (0, ?)",
                (checkpoint,),
            )
            self.db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(apsw.Error):
                self.db.execute("ROLLBACK")
            raise
        finally:
            self._in_txn = False
        since = self.recorder.recorded_bytes - self._recorded_at_compaction
        if since >= self.compact_after and since >= 4 * os.path.getsize(self.path):
            self._compact()

    def _compact(self) -> None:
        """Write the database whole, compacted, as a new file, and rename it over the old one
        (whose recorded history is then dead)."""
        assert self.db is not None
        copy = self.path + ".compact"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(copy)
        self.db.execute("VACUUM INTO ?", (copy,))
        self.db.close()
        self.db = None
        os.replace(copy, self.path)
        self.recorder.record_rename(copy, self.path)
        self.db = self._connect()
        self.compactions += 1
        self._recorded_at_compaction = self.recorder.recorded_bytes

    def _run(self, fn: Callable[[apsw.Connection], T]) -> T:
        assert self.db is not None
        self._begin()
        return fn(self.db)

    def _close(self) -> None:
        try:
            if self.db is not None:
                with contextlib.suppress(apsw.Error):
                    if self._in_txn:
                        self.db.execute("ROLLBACK")
                self.db.close()
                self.db = None
            if self._vfs is not None:
                self._vfs.unregister()
                self._vfs = None
        finally:
            self.recorder.flush()  # What closing recorded (the WAL's checkpoint) goes out too.

    # ---- the Store protocol -------------------------------------------------------------------

    async def restore_checkpoint(self) -> cpb.Checkpoint:
        return await self._call(self._open)

    async def run(self, fn: Callable[[apsw.Connection], T]) -> T:
        """`fn(connection)` on the store's thread, in the consumer transaction's SQLite
        transaction (after the previous transaction's local commit)."""
        if self._local is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._local)
        return await self._call(self._run, fn)

    def start_commit(
        self, checkpoint: cpb.Checkpoint, wait_for: Sequence[Awaitable[object]] = ()
    ) -> Awaitable[None]:
        if self.db is None and self._vfs is None:
            raise RuntimeError("commit before restore_checkpoint: the store is not open")
        previous = self._local
        local: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._local = local
        committing = asyncio.ensure_future(
            self._finish_commit(previous, local, checkpoint.SerializeToString(), wait_for)
        )
        self._committing = committing
        return committing

    async def _finish_commit(
        self,
        previous: asyncio.Future[None] | None,
        local: asyncio.Future[None],
        checkpoint: bytes,
        wait_for: Sequence[Awaitable[object]],
    ) -> None:
        try:
            if previous is not None:
                await asyncio.shield(previous)
            for awaitable in wait_for:
                await awaitable
            await self._call(self._commit, checkpoint)
        except BaseException as exc:
            if not local.done():
                local.set_exception(exc)
                local.exception()  # Retrieved: the commit's own awaitable reports it.
            raise
        local.set_result(None)
        await self.recorder.durable()  # Durable once its operations are in the log.

    def _hints(self) -> Any:
        self.recorder.flush()
        return self.recorder.fsm.build_hints(self.recorder.log)

    async def build_hints(self) -> Any:
        """The recorder's hints, taken on the store's thread (which records), once durable."""
        hints = await self._call(self._hints)
        await self.recorder.durable()
        return hints

    async def close(self) -> None:
        if self._committing is not None:
            with contextlib.suppress(BaseException):
                await self._committing
        with contextlib.suppress(Exception):
            await self._call(self._close)
        self._thread.shutdown(wait=False)


def wants_sqlite(shard: Any) -> bool:
    """Whether the shard's spec asks for the SQLite store (label `store: sqlite`), which needs
    its recovery log; ValueError, naming the shard, if it has none."""
    from broker.protocol import labels

    if labels.value_of(shard.spec.labels, "store") != "sqlite":
        return False
    if shard.recorder is None:
        raise ValueError(
            f"shard {shard.spec.id}: store=sqlite needs a recovery log (set recovery_log_prefix)"
        )
    return True
