"""`gazctl shards prune`: the decision, property-tested over generated hints and fragment sets
(a fragment any current or backup hint needs is never removed; every other persisted one is;
an unneeded unpersisted one stops everything), and end to end on a broker persisting a recovery
log to a file:// store: the fragments of dead files go, and the shard still recovers the same
files from what is left."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.client.append_service import AppendService
from broker.client.journals import dial
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness, EtcdServer
from consumer.client import ShardsClient
from consumer.protocol import cpb
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.prune import LogSegments, PruneRefused, prunable
from consumer.recoverylog.recorder import Recorder
from consumer.runtime import Consumer, ConsumerConfig
from gazctl.shards import RECOVERY_LOG_CONTENT_TYPE
from tests.conftest import run_cli
from tests.helpers.consumers import StoredSummer
from tests.helpers.journals import routed, started_brokers
from tests.helpers.waiting import until

LOG = "recovery/logs/shard-p"


@st.composite
def log_hints(draw: st.DrawFn, size: int) -> rpb.FSMHints:
    """Hints of live files, one segment each, in order through a log of `size` bytes."""
    hints = rpb.FSMHints(log=LOG)
    count = draw(st.integers(1, 6))
    cuts = sorted(
        draw(
            st.lists(st.integers(0, size - 1), min_size=count * 2, max_size=count * 2, unique=True)
        )
    )
    seq = 1
    for i in range(count):
        begin, end = cuts[2 * i], cuts[2 * i + 1]
        ops = draw(st.integers(1, 5))
        seq += draw(st.integers(0, 3))
        node = hints.live_nodes.add(fnode=seq)
        node.segments.add(
            author=draw(st.integers(1, 3)), first_seq_no=seq, first_offset=begin,
            first_checksum=draw(st.integers(0, 2**32 - 1)), last_seq_no=seq + ops - 1,
            last_offset=end,
        )  # fmt: skip
        seq += ops + 1
    return hints


@st.composite
def fragments_of(draw: st.DrawFn, size: int) -> list[pb.Fragment]:
    """A partition of [0, size) into fragments; the last may be unpersisted (still local)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, size - 1), max_size=12))))
    bounds = [0, *cuts, size]
    out = []
    for begin, end in itertools.pairwise(bounds):
        out.append(
            pb.Fragment(journal=LOG, begin=begin, end=end, backing_store="file:///s/", mod_time=1)
        )
    if draw(st.booleans()):
        out[-1].backing_store, out[-1].mod_time = "", 0
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_prune_never_removes_what_any_hints_need(data: st.DataObject) -> None:
    size = data.draw(st.integers(20, 5000))
    hint_sets = data.draw(st.lists(log_hints(size), min_size=1, max_size=3))
    fragments = data.draw(fragments_of(size))
    folded = LogSegments()
    folded.add_hints(LOG, hint_sets, "shard-p")
    segments = folded.segments[LOG]
    # What each hint set needs: its segments' offsets, and from its last segment on, the rest.
    needed: set[int] = set()
    for hints in hint_sets:
        spans = [(s.first_offset, s.last_offset) for n in hints.live_nodes for s in n.segments]
        for begin, end in spans[:-1]:
            needed.update(range(begin, end))
        needed.update(range(spans[-1][0], size))
    try:
        doomed = prunable(fragments, segments)
    except PruneRefused:
        unpersisted = [f for f in fragments if not f.backing_store]
        assert unpersisted and not needed & set(range(unpersisted[0].begin, unpersisted[0].end))
        return
    removed = {(f.begin, f.end) for f in doomed}
    for f in fragments:
        holds_needed = bool(needed & set(range(f.begin, f.end)))
        if (f.begin, f.end) in removed:
            assert not holds_needed and f.backing_store  # Safe: nothing needed, persisted.
        else:
            assert holds_needed or not f.backing_store  # Complete: only what is needed stays.


def test_missing_or_empty_hints_skip_the_log() -> None:
    folded = LogSegments()
    hints = rpb.FSMHints(log=LOG)
    hints.live_nodes.add(fnode=1).segments.add(
        author=1, first_seq_no=1, last_seq_no=1, last_offset=10
    )
    folded.add_hints(LOG, [hints, None], "shard-a")
    why = folded.skipped[LOG]
    assert "shard-a has not written all its hints" in why, why
    assert "prune again once" in why and "hints_interval" in why, why  # What to do.
    other = LogSegments()
    other.add_hints(LOG, [rpb.FSMHints(log=LOG)], "shard-b")
    why = other.skipped[LOG]
    assert "shard-b's hints name no live files" in why, why
    assert "nothing of the log is removed" in why and "prune again once" in why, why


@pytest.fixture
async def cluster(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[BrokerHarness, Consumer, Path]]:
    store_root = tmp_path / "store"
    (store_root / "rl").mkdir(parents=True)
    async with started_brokers(
        etcd_server.endpoint,
        etcd_prefix,
        ["bk-prune"],
        run_allocator=True,
        file_root=str(store_root),
    ) as (broker,):
        root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
        config = ConsumerConfig(
            id="consumer-0", broker_address=broker.endpoint, etcd_address=etcd_server.endpoint,
            etcd_prefix=root, etcd_lease=5.0,
        )  # fmt: skip
        consumer = Consumer(config, StoredSummer(tmp_path / "stores"))
        await consumer.start()
        try:
            yield broker, consumer, store_root
        finally:
            await consumer.stop()
            async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
                await client.delete_prefix(root.encode())


def spans(fragments: list[pb.Fragment]) -> set[tuple[int, int]]:
    return {(f.begin, f.end) for f in fragments}


async def test_prune_removes_dead_fragments_and_the_shard_still_recovers(
    cluster: tuple[BrokerHarness, Consumer, Path], tmp_path: Path
) -> None:
    broker, consumer, store_root = cluster
    log_spec = pb.JournalSpec(name=LOG, replication=1)
    log_spec.fragment.length = 2048
    log_spec.fragment.compression_codec = pb.NONE
    log_spec.fragment.stores.append("file:///rl/")
    log_spec.fragment.refresh_interval.seconds = 1
    log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
    source_spec = pb.JournalSpec(name="prune/source", replication=1)
    source_spec.fragment.length = 1 << 20
    source_spec.fragment.compression_codec = pb.NONE
    source_spec.fragment.refresh_interval.seconds = 60
    source_spec.labels.labels.add(name="content-type", value="application/x-ndjson")
    async with broker.client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=s) for s in (log_spec, source_spec)])
        await routed(client, LOG, 1)

    # A store's life: scratch files written and deleted, one file kept, rewritten at the end.
    directory = tmp_path / "db"
    directory.mkdir()
    channel = dial(broker.endpoint)
    stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    async with AppendService(stub) as service:
        recorder = Recorder(LOG, FSM(rpb.FSMHints(log=LOG)), new_author(), str(directory), service)
        await recorder.start()
        for i in range(6):
            scratch = recorder.record_create(str(directory / f"scratch-{i}"))
            for j in range(4):
                recorder.record_write(scratch, bytes([65 + i]) * 700, j * 700)
                await recorder.sync()  # One append each: fragments roll at 2 KiB.
            recorder.record_remove(str(directory / f"scratch-{i}"))
        kept = recorder.record_create(str(directory / "kept"))
        recorder.record_write(kept, b"live data", 0)
        await recorder.sync()
        tail = recorder.record_create(str(directory / "tail"))  # Rolls kept's ops out of the spool.
        for j in range(4):
            recorder.record_write(tail, b"t" * 700, j * 700)
            await recorder.sync()
        hints = await recorder.build_hints()
    await channel.close()

    async with ShardsClient(consumer.endpoint) as shards:
        spec = cpb.ShardSpec(
            id="shard-p", sources=[cpb.ShardSpec.Source(journal="prune/source")],
            recovery_log_prefix="recovery/logs",  # Hints under the consumer's hint root.
        )  # fmt: skip
        spec.max_txn_duration.FromSeconds(1)
        await shards.apply([cpb.ApplyRequest.Change(upsert=spec)])
        listed = (await shards.list()).shards[0]
        await shards.apply(
            [
                cpb.ApplyRequest.Change(
                    upsert=spec, expect_mod_revision=listed.mod_revision, primary_hints=hints
                )
            ]
        )

    env = {"CONSUMER_ADDRESS": consumer.endpoint, "BROKER_ADDRESS": broker.endpoint}
    before = open_store("file:///rl/", file_root=store_root).list_fragments(LOG)
    assert len(before) >= 6
    dry = await asyncio.to_thread(
        run_cli, "gazctl", "shards", "prune", "-l", "id=shard-p", "--dry-run", env=env
    )
    assert dry.code == 0, dry.err
    assert "dry run: would remove" in dry.err
    planned = [line.split("\t") for line in dry.out.splitlines()]
    assert planned and all(p[0] == LOG for p in planned)
    # The dry run removed nothing (the recorder's broker may persist more meanwhile).
    assert spans(before) <= spans(
        open_store("file:///rl/", file_root=store_root).list_fragments(LOG)
    )

    done = await asyncio.to_thread(
        run_cli,
        "gazctl",
        "shards",
        "prune",
        "-l",
        "id=shard-p",
        "--file-root",
        str(store_root),
        env=env,
    )
    assert done.code == 0, done.err
    after = open_store("file:///rl/", file_root=store_root).list_fragments(LOG)
    removed = spans(before) - spans(after)
    assert removed == {(int(p[1]), int(p[2])) for p in planned} and len(planned) >= 3
    kept_segment = hints.live_nodes[-2].segments[0]
    assert all(f.end > kept_segment.first_offset for f in after)  # Only dead files' went.

    # The brokers list the store again (refresh 1 s): their index no longer holds what was
    # removed. And the shard recovers all the same.
    async def unlisted(gone: set[tuple[int, int]]) -> bool:
        channel = dial(broker.endpoint)
        try:
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            response = await stub.ListFragments(pb.FragmentsRequest(journal=LOG))
        finally:
            await channel.close()
        return not gone & spans([f.spec for f in response.fragments if f.spec.backing_store])

    await until(lambda: unlisted(removed), "the broker listed its store again")
    out = await asyncio.to_thread(
        run_cli,
        "gazctl",
        "shards",
        "recover",
        "--id",
        "shard-p",
        "--dir",
        str(tmp_path / "again"),
        env=env,
    )
    assert out.code == 0, out.err
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["kept", "tail"]
    assert (tmp_path / "again" / "kept").read_bytes() == b"live data"

    # A fragment the hints need goes missing: recovery refuses in one line, leaves nothing.
    store = open_store("file:///rl/", file_root=store_root)
    needed = [f for f in after if f.begin <= kept_segment.first_offset < f.end]
    assert needed, "the fragment holding the kept file's ops is persisted"
    from broker.fragment.content import fragment_path

    store.remove(fragment_path(needed[0]))
    await until(
        lambda: unlisted(spans(needed[:1])), "the broker listed its store without the fragment"
    )
    lost = await asyncio.to_thread(
        run_cli, "gazctl", "shards", "recover", "--id", "shard-p", "--dir", str(tmp_path / "lost"),
        env=env,
    )  # fmt: skip
    assert lost.code == 1 and "Traceback" not in lost.err
    *warnings, error = lost.err.strip().splitlines()
    assert "content jumps to offset" in " ".join(warnings)  # Where the log has a hole.
    assert error.startswith("Error: cannot recover shard shard-p") and "possible data loss" in error
    assert not (tmp_path / "lost").exists()
