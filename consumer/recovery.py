"""A shard's recovery log in a consumer process (upstream's `consumer/recovery.go`): the hints in
etcd, playback into the replica's local directory, and the hand-off to a recorder.

* A **standby** plays the log from the primary's hints into its directory and tails it (its
  status is BACKFILL while it plays, STANDBY once it tails); it mirrors files and never opens the
  store.
* A **primary** completes playback with a hand-off: its player injects a no-op under the new
  author, which fences out the previous recorder, and makes the files live. A standby promoted to
  primary does this on the log it already tails, so it takes over without replaying it. It
  records into the log from there (a `Recorder`). Once its store opened and restored its
  checkpoint, it rotates the hints of the state reached at hand-off into the backups
  (`hint_backups` of them) and writes its hints to the primary key, then periodically, each
  write guarded by its assignment (a primary that lost the shard cannot overwrite its
  successor's hints). A store that fails to open leaves every hint as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import aetcd
from aetcd import transactions

from broker.client.append_service import AppendService
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from consumer.protocol import cpb, hint_backup_keys, hint_primary_key, recovery_log
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.hints import encode_hints, pick_first_hints
from consumer.recoverylog.player import Player
from consumer.recoverylog.recorder import Recorder
from consumer.shard_api import ShardState, get_hints
from keyspace import KeyValue
from plumbing import etcd as etcdx
from plumbing.tasks import first_of, in_thread

__all__ = ["HINTS_INTERVAL", "Playback", "rotate_hints", "store_hints"]

log = logging.getLogger(__name__)

# Upstream stores a primary's hints every 5 minutes between transactions.
HINTS_INTERVAL = 300.0


async def fetch_hints(state: ShardState, spec: cpb.ShardSpec) -> rpb.FSMHints:
    """The hints to play from: the primary's, else the first backup's, else the log's start."""
    response = await get_hints(state, cpb.GetHintsRequest(shard=spec.id))
    return pick_first_hints(response, recovery_log(spec))


class Playback:
    """One replica's player of the shard's log into its directory, owned by the replica: started
    by `start`, completed by `hand_off` (a primary) or cancelled by `stop`."""

    def __init__(self, spec: cpb.ShardSpec, directory: Path) -> None:
        self.spec = spec
        self.log = recovery_log(spec)
        self.directory = directory
        self.player = Player()
        self.hints = rpb.FSMHints(log=self.log)
        self.task: asyncio.Task[FSM] | None = None

    def start(
        self,
        hints: rpb.FSMHints,
        stubs: Callable[[], pb_grpc.JournalStub],
        service: AppendService,
    ) -> None:
        self.hints = hints
        self.task = asyncio.ensure_future(self.player.play(hints, self.directory, stubs, service))

    @property
    def tailing(self) -> bool:
        return self.player.tailing.is_set()

    async def wait_tailing(self) -> None:
        """Until the player reached the write head (or failed: its error is raised)."""
        assert self.task is not None
        await first_of(self.player.tailing.wait(), self.task)
        if self.task.done() and not self.player.tailing.is_set():
            self.task.result()

    async def hand_off(self, service: AppendService) -> Recorder:
        """Complete playback by a hand-off to a new author, and return its started recorder."""
        assert self.task is not None
        author = new_author()
        self.player.inject_handoff(author)
        fsm = await self.task
        recorder = Recorder(self.log, fsm, author, str(self.directory), service)
        await recorder.start()
        return recorder

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await in_thread(shutil.rmtree, self.directory, True)  # A whole store: off the loop.


def _guard(assignment: KeyValue) -> list[transactions.Compare]:
    """The assignment is still ours: the same key, created at the same revision."""
    return [transactions.Create(assignment.key.encode()) == assignment.create_revision]


async def rotate_hints(
    etcd: aetcd.Client, spec: cpb.ShardSpec, recovered: rpb.FSMHints, assignment: KeyValue
) -> bool:
    """Shift the backups down one and put `recovered` in the first (upstream's
    storeRecoveredHints): the hints of the state playback reached at hand-off, stored once the
    store opened and restored its checkpoint from it, so that a later disaster can go back to a
    state known to open. The backups are read in one transaction. Done again (a retry whose
    first attempt committed and lost its reply, etcd killed meanwhile), it changes nothing: the
    first backup holds these very hints already (each hand-off's are its own, by its author)."""
    keys = hint_backup_keys(spec)
    if not keys:
        return True
    values = await etcdx.get_many(etcd, [key.encode() for key in keys])
    encoded = encode_hints(recovered)
    if values[0] == encoded:
        rotated = await etcdx.txn(etcd, _guard(assignment), [])
        return bool(rotated.succeeded)
    puts = [transactions.Put(keys[0].encode(), encoded)]
    for key, value in zip(keys[1:], values[:-1], strict=True):
        if value is not None:
            puts.append(transactions.Put(key.encode(), value))
    result = await etcdx.txn(etcd, _guard(assignment), puts)
    return bool(result.succeeded)


async def store_hints(
    etcd: aetcd.Client, spec: cpb.ShardSpec, hints: rpb.FSMHints, assignment: KeyValue
) -> bool:
    """Write the primary's hints, if its assignment still holds; whether it did."""
    put = transactions.Put(hint_primary_key(spec).encode(), encode_hints(hints))
    result = await etcdx.txn(etcd, _guard(assignment), [put])
    return bool(result.succeeded)
