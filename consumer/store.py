"""Stores: where a shard keeps its state, committed atomically with its checkpoint.

A `Store` restores the last committed checkpoint when a shard becomes primary and commits each
transaction's checkpoint together with the application's changes, or not at all. Restoring
*fences* the store: a commit by an older instance of the same shard (a zombie primary that has
not noticed it lost the shard) fails with `FencedOut` rather than overwriting the new primary's
state. Upstream's SQL store does this with a fence column; the JSON-file store here with a fence
number in the file, checked under a lock.

`JSONFileStore` keeps a JSON document (`state`, any JSON-encodable value the application
changes in place) in `{root}/{shard id}/state.json`, replaced by an atomic rename at each commit;
`committed` is the state as last committed (None until restored), for queries that must not see
a transaction in progress. Its files are the consumer's user's only (0600), as fragments are.
Until recovery logs carry it between processes, the root must be shared by the processes that
may host the shard (one machine, as `gazctl dev` runs them). File I/O runs on a thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import urllib.parse
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from consumer.protocol import cpb

__all__ = ["FencedOut", "JSONFileStore", "Store"]


class FencedOut(Exception):
    """A commit by a store instance that a newer one (another primary) has fenced out."""


class Store(Protocol):
    async def restore_checkpoint(self) -> cpb.Checkpoint:
        """The last committed checkpoint (empty for a new shard); fences out older instances."""
        ...

    def start_commit(
        self, checkpoint: cpb.Checkpoint, wait_for: Sequence[Awaitable[object]] = ()
    ) -> Awaitable[None]:
        """Take the application's changes so far, with `checkpoint`, as one commit, now (the
        next transaction may change the state as soon as this returns); the returned awaitable
        completes once it is durable, which is only after everything in `wait_for` (the
        transaction's own appends) completed, and raises FencedOut if a newer instance
        restored since this one did. Nothing of it is committed if it fails."""
        ...

    async def close(self) -> None:
        """Release what the store holds (the shard stopped here)."""
        ...

    # Optional: how many commits may be in flight at once (default 1: a transaction starts its
    # commit only once the previous one is durable). A store whose commits chain, each durable
    # only after those before it, may allow more (consumer.transaction).


_STATE = "state.json"
_LOCK = ".lock"
# A shard's state is its tenant's: readable by the consumer's user only, as fragments are.
_MODE = 0o600


class JSONFileStore:
    """A JSON document per shard in a directory, replaced atomically at each commit."""

    def __init__(self, root: str | Path, shard_id: str, initial: Any = None) -> None:
        self.directory = Path(root) / urllib.parse.quote(shard_id, safe="")
        self.state: Any = {} if initial is None else initial
        self.committed: Any = None
        self._fence: int | None = None

    async def restore_checkpoint(self) -> cpb.Checkpoint:
        checkpoint = await asyncio.to_thread(self._restore)
        self.committed = json.loads(json.dumps(self.state))
        return checkpoint

    def start_commit(
        self, checkpoint: cpb.Checkpoint, wait_for: Sequence[Awaitable[object]] = ()
    ) -> Awaitable[None]:
        if self._fence is None:
            raise RuntimeError("commit before restore_checkpoint: the store is not fenced yet")
        # The snapshot is taken now; the application may change `state` once we return.
        text = json.dumps(self.state, separators=(",", ":"), sort_keys=True)
        return self._finish_commit(self._fence, checkpoint.SerializeToString(), text, wait_for)

    async def commit(self, checkpoint: cpb.Checkpoint) -> None:
        """`start_commit` and wait for it."""
        await self.start_commit(checkpoint)

    async def _finish_commit(
        self, fence: int, checkpoint: bytes, text: str, wait_for: Sequence[Awaitable[object]]
    ) -> None:
        for awaitable in wait_for:
            await awaitable
        work = asyncio.get_running_loop().run_in_executor(None, self._commit, fence, checkpoint, text)  # fmt: skip
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            # A write under way cannot be stopped: it completes before the commit says it
            # stopped, so nothing is written once the shard has.
            await asyncio.wait([work])
            raise
        self.committed = json.loads(text)

    @property
    def fence(self) -> int | None:
        """The fence this instance restored with (None before `restore_checkpoint`): each
        restore of the shard's state takes a greater one."""
        return self._fence

    async def close(self) -> None:
        self._fence = None

    # ---- on a thread -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _MODE)
        with os.fdopen(fd, "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = (self.directory / _STATE).read_bytes()
        except FileNotFoundError:
            return None
        try:
            document = json.loads(raw)
            if not isinstance(document, dict) or not isinstance(document.get("fence"), int):
                raise ValueError("not a store document")
            return document
        except ValueError as exc:
            raise ValueError(
                f"{self.directory / _STATE} is not a store's state ({exc}): move it away to "
                "start the shard afresh"
            ) from None

    def _write(self, document: dict[str, Any]) -> None:
        path = self.directory / _STATE
        temporary = path.with_name(f".{_STATE}.{os.getpid()}.tmp")
        # Created afresh (a leftover of a crashed writer is replaced), private from the start:
        # it becomes the state file by the rename, mode included.
        temporary.unlink(missing_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _MODE)
        with os.fdopen(fd, "wb") as out:
            out.write(json.dumps(document, separators=(",", ":")).encode())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)  # The rename itself is durable.
        finally:
            os.close(directory)

    def _restore(self) -> cpb.Checkpoint:
        with self._locked():
            document = self._read()
            checkpoint = cpb.Checkpoint()
            if document is None:
                document = {"fence": 0, "checkpoint": "", "state": self.state}
            else:
                checkpoint.ParseFromString(base64.b64decode(document.get("checkpoint", "")))
                self.state = document.get("state")
            document["fence"] += 1
            self._write(document)
            self._fence = document["fence"]
            return checkpoint

    def _commit(self, fence: int, checkpoint: bytes, state_text: str) -> None:
        with self._locked():
            document = self._read()
            current = document["fence"] if document is not None else None
            if current != fence:
                raise FencedOut(
                    f"{self.directory}: another instance restored this shard (fence {current}, "
                    f"ours {fence}); this one must stop"
                )
            self._write(
                {
                    "fence": fence,
                    "checkpoint": base64.b64encode(checkpoint).decode(),
                    "state": json.loads(state_text),
                }
            )
