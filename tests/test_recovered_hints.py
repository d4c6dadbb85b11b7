"""Hints a primary stores name only operations its recovery log holds: a standby (or a later
primary) that reads them at once, before the primary commits anything, plays them without a
"possible data loss". The primary's store records off the event loop (SQLite, recorded from its
own thread): what it records while opening (its WAL created) is in the FSM before it is in the
log, and must not be named by hints until it is."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aetcd
import pytest
from google.protobuf import duration_pb2

from broker.client.append_service import AppendService
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness, EtcdServer
from consumer.protocol import cpb, hint_primary_key
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.hints import decode_hints
from consumer.recoverylog.player import Player
from consumer.recoverylog.recorder import Recorder
from consumer.runtime import Consumer, ConsumerConfig
from gazctl.shards import RECOVERY_LOG_CONTENT_TYPE
from tests.helpers.consumers import (
    INPUT,
    RecordedSummer,
    _consumed,
    _equals,
    publish_inputs,
    shard_stub,
    statuses,
)
from tests.helpers.consumers import spec as journal_spec
from tests.helpers.journals import routed
from tests.helpers.recoverylog import new_log
from tests.helpers.waiting import until


async def test_a_new_primarys_hints_play_at_once_before_it_commits_anything(
    etcd_server: EtcdServer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
    tmp_path: Path,
) -> None:
    """consumer-0 sums a few inputs into SQLite and exits; consumer-1 takes the shard over. As
    soon as it is PRIMARY (its hints stored) and before any input arrives (so nothing of its
    store was synced yet), its hints are played to the log's write head, as a standby or a
    `gazctl shards recover` would: every operation they name must be in the log."""
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    log_name = f"recovery/{root.rsplit('/', 1)[1]}/sum-h"
    async with sums_broker.client() as client:
        log_spec = journal_spec(log_name)
        log_spec.labels.Clear()
        log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
        await client.apply([pb.ApplyRequest.Change(upsert=log_spec)])
        await routed(client, log_name, 1)
    shard = cpb.ShardSpec(
        id="sum-h", sources=[cpb.ShardSpec.Source(journal=INPUT)],
        recovery_log_prefix=log_name.rsplit("/", 1)[0], hint_prefix=f"{root}/hints",
        hint_backups=1, max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
    )  # fmt: skip
    app = RecordedSummer()
    etcd = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)

    async def serve(n: int) -> None:
        config = ConsumerConfig(
            id=f"consumer-{n}", broker_address=sums_broker.endpoint,
            etcd_address=etcd_server.endpoint, etcd_prefix=root, etcd_lease=5.0,
        )  # fmt: skip
        consumer = Consumer(config, app)
        await consumer.start()
        try:
            shards, channel = shard_stub(consumer)
            if n == 0:
                await shards.Apply(
                    cpb.ApplyRequest(changes=[cpb.ApplyRequest.Change(upsert=shard)])
                )
            primary = [(f"consumer-{n}:primary", cpb.ReplicaStatus.PRIMARY)]
            await until(lambda: _equals(statuses(shards), primary))
            await channel.close()
            if n == 0:  # A database, with a WAL, in the log for the next primary to open.
                await publish_inputs(sums_stub, 10, seed=3)
                await until(lambda: _consumed(app, 10))
                return
            # PRIMARY: its hints are stored. Nothing was consumed since, so nothing committed.
            stored = await etcd.get(hint_primary_key(shard).encode())
            assert stored is not None
            hints = decode_hints(stored.value)
            player = Player()
            player.finish_at_write_head()
            async with AppendService(sums_stub) as service:
                await player.play(hints, tmp_path / "played", lambda: sums_stub, service)
            assert app.consumed == 10  # Still nothing new: the hints were played as stored.
        finally:
            await consumer.stop()

    try:
        await serve(0)
        await serve(1)
    finally:
        await etcd.delete_prefix(root.encode())
        await etcd.delete_prefix(shard.hint_prefix.encode())
        await etcd.close()


async def test_a_recorders_hints_never_name_what_its_thread_has_not_handed_to_the_log(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """A file created from a store's thread is in the recorder's FSM at once, and in the log
    only once the thread flushes it. Hints taken on the loop meanwhile are refused with one
    line naming the operation and what to do, rather than returned to be stored, naming what
    the log does not hold; once flushed, the hints name it and play."""
    log = await new_log(recovery_broker)
    source = tmp_path / "source"
    source.mkdir()
    async with AppendService(recovery_stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await recorder.start()
        (source / "db-wal").write_bytes(b"")
        fnode = await asyncio.to_thread(recorder.record_create, str(source / "db-wal"))
        with pytest.raises(
            RuntimeError, match=f"seq_no {fnode}, recorded off the event loop and not handed"
        ):
            await recorder.build_hints()

        await asyncio.to_thread(recorder.flush)
        await recorder.durable()
        hints = await recorder.build_hints()
        assert [n.fnode for n in hints.live_nodes] == [fnode]
        player = Player()
        player.finish_at_write_head()
        await player.play(hints, tmp_path / "played", lambda: recovery_stub, service)
    assert (tmp_path / "played" / "db-wal").read_bytes() == b""
