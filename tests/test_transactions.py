"""A shard's transactions against a real broker: every committed input message affects the store
exactly once, across a shard stopped at any point and started again from its store (a new
primary), with its outputs read-committed exactly once; an aborted input transaction is never
applied; a fenced-out instance commits nothing."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import duration_pb2

from broker.client.append_service import AppendService
from broker.protocol import protocol_pb2_grpc as pb_grpc
from consumer.protocol import cpb
from consumer.store import FencedOut, JSONFileStore
from consumer.transaction import Shard, Source, run_shard
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Envelope, Sequencer
from message.types import DictMessages
from tests.helpers.consumers import (
    INPUT,
    KEYS,
    OUTPUT,
    Summer,
    check_outputs,
    committed_outputs,
    publish_inputs,
    write_head,
)
from tests.helpers.waiting import until


def shard_spec(**fields: Any) -> cpb.ShardSpec:
    out = cpb.ShardSpec(
        id="summer-0",
        sources=[cpb.ShardSpec.Source(journal=INPUT)],
        max_txn_duration=duration_pb2.Duration(nanos=200_000_000),
    )
    for name, value in fields.items():
        if isinstance(value, duration_pb2.Duration):
            getattr(out, name).CopyFrom(value)
        else:
            setattr(out, name, value)
    return out


def source() -> Source:
    return Source(INPUT, DictMessages(), JSONLines())


async def run_until(
    stub: pb_grpc.JournalStub,
    store: JSONFileStore,
    app: Summer,
    *,
    stop_after: int | None = None,
    through: int | None = None,
    spec_fields: dict[str, Any] | None = None,
) -> Shard:
    """Run the shard until `app` consumed `stop_after` more messages (then cancel it at that
    point, mid-transaction or mid-commit as it happens), or until it committed `through`."""
    async with AppendService(stub) as service:
        shard = Shard(
            shard_spec(**(spec_fields or {})),
            service,
            Publisher(service, DictMessages(), JSONLines()),
        )
        task = asyncio.create_task(run_shard(shard, app, store, [source()], lambda: stub))
        try:
            if stop_after is not None:
                start = app.consumed
                await until(
                    lambda: app.consumed >= start + stop_after or task.done(),
                    f"{stop_after} more messages consumed",
                    timeout=60,
                    interval=0.001,  # Cancelled as soon as it is there: mid-transaction or commit.
                )
            else:
                assert through is not None
                async with asyncio.timeout(60):
                    await shard.progress.wait_for({INPUT: through})
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return shard


async def test_every_input_is_applied_once(sums_stub: pb_grpc.JournalStub, tmp_path: Path) -> None:
    stub = sums_stub
    expected = await publish_inputs(stub, 300, seed=1)
    head = await write_head(stub, INPUT)
    app = Summer()
    shard = await run_until(stub, JSONFileStore(tmp_path, "summer-0"), app, through=head)
    assert app.consumed == 300
    restored = JSONFileStore(tmp_path, "summer-0")
    await restored.restore_checkpoint()
    assert restored.state == dict(expected)
    assert shard.progress.publish_at[OUTPUT] > 0
    check_outputs(await committed_outputs(stub), expected)


async def test_a_shard_stopped_anywhere_resumes_exactly_once(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    stub = sums_stub
    """Stopped after a random number of messages, again and again (each time a new instance,
    as a new primary would be): the store's sums are exact and no output repeats."""
    expected = await publish_inputs(stub, 400, seed=2)
    head = await write_head(stub, INPUT)
    rng = random.Random(3)
    for _ in range(8):
        await run_until(
            stub,
            JSONFileStore(tmp_path, "summer-0"),
            Summer(),
            stop_after=rng.randint(1, 80),
            spec_fields={
                "min_txn_duration": duration_pb2.Duration(nanos=rng.choice([0, 5_000_000]))
            },
        )
    await run_until(stub, JSONFileStore(tmp_path, "summer-0"), Summer(), through=head)
    restored = JSONFileStore(tmp_path, "summer-0")
    await restored.restore_checkpoint()
    assert restored.state == dict(expected)
    check_outputs(await committed_outputs(stub), expected)


async def test_a_fenced_out_instance_fails_and_commits_nothing(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    stub = sums_stub
    """A zombie primary: another instance restored the shard's store meanwhile. The zombie's
    next commit fails (the shard fails), and what it consumed is not in the store."""
    await publish_inputs(stub, 20, seed=4)
    zombie_store = JSONFileStore(tmp_path, "summer-0")

    class Usurped(Summer):
        async def finalize_txn(
            self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
        ) -> None:
            await JSONFileStore(tmp_path, "summer-0").restore_checkpoint()  # A new primary.

    async with AppendService(stub) as service:
        shard = Shard(shard_spec(), service, Publisher(service, DictMessages(), JSONLines()))
        app = Usurped()
        with pytest.raises(ExceptionGroup) as failed:
            async with asyncio.timeout(30):
                await run_shard(shard, app, zombie_store, [source()], lambda: stub)
    assert failed.group_contains(FencedOut)
    fresh = JSONFileStore(tmp_path, "summer-0")
    await fresh.restore_checkpoint()
    assert app.consumed > 0 and fresh.state == {}
    assert await committed_outputs(stub) == []


class SlowStore(JSONFileStore):
    """A store whose commits take a while on their thread, saying when one began and when it
    is done."""

    def __init__(self, root: Path, shard_id: str) -> None:
        super().__init__(root, shard_id)
        import threading

        self.began = threading.Event()
        self.done = threading.Event()

    def _commit(self, fence: int, checkpoint: bytes, state_text: str) -> None:
        import time

        self.began.set()
        time.sleep(0.3)  # A slow write: the commit is still writing when the shard moves on.
        super()._commit(fence, checkpoint, state_text)
        self.done.set()


async def test_acks_of_a_commit_cut_short_are_appended_by_the_next_primary(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    stub = sums_stub
    """The shard stops while its store commits: the commit still becomes durable, but its ACK
    intents are never appended. The next instance restores the checkpoint and appends them
    first, so the outputs of that transaction are committed for readers all the same."""
    expected = await publish_inputs(stub, 50, seed=5)
    head = await write_head(stub, INPUT)
    store = SlowStore(tmp_path, "summer-0")
    async with AppendService(stub) as service:
        shard = Shard(shard_spec(), service, Publisher(service, DictMessages(), JSONLines()))
        task = asyncio.create_task(run_shard(shard, Summer(), store, [source()], lambda: stub))
        await until(store.began.is_set, "the store began a commit", interval=0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await until(store.done.is_set, "the commit's thread finished it")
    committed = JSONFileStore(tmp_path, "summer-0")
    checkpoint = await committed.restore_checkpoint()
    assert checkpoint.ack_intents, "the cut-short commit is durable, with its intents"
    assert await committed_outputs(stub) == []  # Its ACKs were never appended.

    await run_until(stub, JSONFileStore(tmp_path, "summer-0"), Summer(), through=head)
    check_outputs(await committed_outputs(stub), expected)


async def test_a_source_that_ends_with_an_aborted_transaction_is_read_through(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """The shard is idle at the write head when an aborted transaction is appended: its ACK
    commits nothing to consume, and no transaction of the shard follows to report it read.
    Progress (what Stat waits on) must still reach the new write head."""
    stub = sums_stub
    to_input = lambda _m: Partition(INPUT, "application/x-ndjson")  # noqa: E731
    async with AppendService(stub) as service:
        # One producer: a committed transaction, then (once the shard read it) an aborted one,
        # whose ACK is above the last: it commits, but nothing of its span is delivered.
        producer = Publisher(service, DictMessages(), JSONLines())
        await producer.publish_uncommitted(to_input, {"key": KEYS[1], "n": 5})
        await producer.commit()
        head = await write_head(stub, INPUT)
        shard = Shard(shard_spec(), service, Publisher(service, DictMessages(), JSONLines()))
        store = JSONFileStore(tmp_path, "summer-0")
        task = asyncio.create_task(run_shard(shard, Summer(), store, [source()], lambda: stub))
        try:
            async with asyncio.timeout(20):
                await shard.progress.wait_for({INPUT: head})
            for n in (1, 2):
                await producer.publish_uncommitted(to_input, {"key": KEYS[1], "n": n})
            await producer.abort()
            head = await write_head(stub, INPUT)
            async with asyncio.timeout(20):
                await shard.progress.wait_for({INPUT: head})
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_shard_publishes_two_content_types_under_one_producer(
    sums_broker: Any, sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """Each input's sum goes out as JSON (the shard's publisher) and as fixed-frame protobuf
    (`publisher.sharing`) to a journal of that content type: one producer, one set of ACK
    intents per transaction, and across a shard stopped anywhere, each output of both once."""
    from google.protobuf import descriptor_pb2

    from broker.protocol import protocol_pb2 as pb
    from message.framing import FixedProtobuf
    from message.types import ProtobufMessages
    from tests.helpers.consumers import spec as journal_spec
    from tests.helpers.journals import routed
    from tests.helpers.messages import _proto_class

    protos = "sums/protos"
    async with sums_broker.client() as client:
        proto_spec = journal_spec(protos)
        del proto_spec.labels.labels[:]
        proto_spec.labels.labels.add(name="content-type", value="application/x-protobuf-fixed")
        await client.apply([pb.ApplyRequest.Change(upsert=proto_spec)])
        await routed(client, protos, 1)
    count = _proto_class(descriptor_pb2.FieldDescriptorProto.TYPE_BYTES)
    to_protos = lambda _m: Partition(protos, "application/x-protobuf-fixed")  # noqa: E731

    class TwoTypes(Summer):
        async def consume_message(
            self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
        ) -> None:
            await super().consume_message(shard, store, envelope, publisher)
            key = envelope.message["key"]
            counts = publisher.sharing(ProtobufMessages(count), FixedProtobuf())
            await counts.publish_uncommitted(to_protos, count(ngram=key, count=store.state[key]))

    expected = await publish_inputs(sums_stub, 200, seed=9)
    head = await write_head(sums_stub, INPUT)
    rng = random.Random(10)
    for _ in range(4):
        app = TwoTypes()
        await run_until(
            sums_stub, JSONFileStore(tmp_path, "summer-0"), app, stop_after=rng.randint(1, 60)
        )  # type: ignore[arg-type]
    await run_until(sums_stub, JSONFileStore(tmp_path, "summer-0"), TwoTypes(), through=head)  # type: ignore[arg-type]
    outputs = await committed_outputs(sums_stub)
    check_outputs(outputs, expected)

    # Both journals' messages of each instance carry its one producer id.
    json_producers = [
        e.producer
        async for e in read_committed(
            sums_stub, OUTPUT, Reader(DictMessages(), JSONLines()), Sequencer()
        )
        if not e.is_ack
    ]
    proto_producers = []
    as_protos = []
    reader = Reader(ProtobufMessages(count), FixedProtobuf())
    async for envelope in read_committed(sums_stub, protos, reader, Sequencer()):
        if not envelope.is_ack:
            proto_producers.append(envelope.producer)
            as_protos.append((envelope.message.ngram, envelope.message.count))
    assert as_protos == outputs  # The same outputs, in the same order, each once.
    assert proto_producers == json_producers


class HoldsAfterCommitStarts(Summer):
    """Its `finished_txn` hook (called once a commit has started, before the transaction loop
    owns the commit's completion) never returns: the shard is cancelled there."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = asyncio.Event()

    async def finished_txn(self, shard: Shard, store: Any, committed: Any) -> None:
        self.holding.set()
        await asyncio.Event().wait()


class CommitsLater(JSONFileStore):
    """A store whose commit waits a moment before it writes (as one waiting for its
    transaction's appends would), counting the writes it makes."""

    def __init__(self, root: Path, shard_id: str) -> None:
        super().__init__(root, shard_id)
        self.writes = 0

    async def _finish_commit(self, *args: Any) -> None:
        await asyncio.sleep(0.3)  # The moment the commit waits (as for its appends).
        await super()._finish_commit(*args)

    def _commit(self, fence: int, checkpoint: bytes, state_text: str) -> None:
        self.writes += 1
        super()._commit(fence, checkpoint, state_text)


async def test_a_shard_cancelled_as_its_commit_starts_writes_nothing_after_it_stopped(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """The commit belongs to the shard's task group: once run_shard has returned (cancelled),
    no commit of it is still running, and the store is not written any more."""
    stub = sums_stub
    await publish_inputs(stub, 20, seed=7)
    store = CommitsLater(tmp_path, "summer-0")
    app = HoldsAfterCommitStarts()
    async with AppendService(stub) as service:
        shard = Shard(shard_spec(), service, Publisher(service, DictMessages(), JSONLines()))
        task = asyncio.create_task(run_shard(shard, app, store, [source()], lambda: stub))
        async with asyncio.timeout(30):
            await app.holding.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        writes = store.writes
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.sleep(0.6)  # A hold past the commit's 0.3 s: a leftover one would write.
    assert store.writes == writes, "the store was written after the shard stopped"
    assert not [t for t in leftover if "_finish_commit" in repr(t.get_coro())], leftover


class PipelinedStore(JSONFileStore):
    """A JSON store whose commits chain, each taking at least `DELAY` (a slow log) and written
    only once the one before it is, so that a shard's commits queue: up to `pipelined_commits`
    in flight."""

    pipelined_commits = 3
    DELAY = 0.3
    most_in_flight = 0  # Across instances: the most commits this test saw in flight at once.

    def __init__(self, root: Path, shard_id: str) -> None:
        super().__init__(root, shard_id)
        self._last: asyncio.Future[None] | None = None
        self._in_flight = 0

    def start_commit(self, checkpoint: cpb.Checkpoint, wait_for: Any = ()) -> Any:
        write = super().start_commit(checkpoint, wait_for)  # The snapshot, taken now.
        previous = self._last

        async def chained() -> None:
            self._in_flight += 1
            PipelinedStore.most_in_flight = max(PipelinedStore.most_in_flight, self._in_flight)
            started = False
            try:
                await asyncio.sleep(self.DELAY)  # The slow log under test: commits overlap.
                if previous is not None:
                    await asyncio.shield(previous)  # Its failure is this one's too.
                started = True
                await write
            finally:
                self._in_flight -= 1
                if not started:
                    write.close()  # type: ignore[attr-defined]

        self._last = asyncio.ensure_future(chained())
        return self._last


class SlowSummer(Summer):
    """A Summer taking 5 ms a message: transactions end at max_txn_duration (0.1 s), well
    within a commit's 0.3 s, so commits overlap however loaded the machine is."""

    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        await asyncio.sleep(0.005)
        await super().consume_message(shard, store, envelope, publisher)


async def test_commits_pipelined_deeper_stay_exactly_once(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """A store that chains its commits has several in flight (never more than it allows), and a
    shard stopped anywhere, commits in flight included, still applies each input once and
    publishes each output once."""
    stub = sums_stub
    expected = await publish_inputs(stub, 300, seed=7)
    head = await write_head(stub, INPUT)
    rng = random.Random(8)
    PipelinedStore.most_in_flight = 0
    fields = {"max_txn_duration": duration_pb2.Duration(nanos=100_000_000)}
    for _ in range(3):
        await run_until(stub, PipelinedStore(tmp_path, "summer-0"), SlowSummer(), stop_after=rng.randint(20, 80), spec_fields=fields)  # fmt: skip
    await run_until(stub, PipelinedStore(tmp_path, "summer-0"), SlowSummer(), through=head, spec_fields=fields)  # fmt: skip
    assert 1 < PipelinedStore.most_in_flight <= PipelinedStore.pipelined_commits
    restored = JSONFileStore(tmp_path, "summer-0")
    await restored.restore_checkpoint()
    assert restored.state == dict(expected)
    check_outputs(await committed_outputs(stub), expected)


async def test_a_corrupt_input_line_is_skipped_and_the_rest_applied(
    sums_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """The shard frames JSON lines a read chunk at a time: a line that is not JSON, between
    committed inputs, is skipped (reported, never consumed), and every committed input around
    it is applied once."""
    from broker.client.appender import append

    stub = sums_stub
    first = await publish_inputs(stub, 30, seed=5)
    await append(stub, INPUT, b'{"key": "key-0", "n": \n')  # Not a JSON document.
    second = await publish_inputs(stub, 30, seed=6)
    head = await write_head(stub, INPUT)
    app = Summer()
    await run_until(stub, JSONFileStore(tmp_path, "summer-0"), app, through=head)
    assert app.consumed == 60
    restored = JSONFileStore(tmp_path, "summer-0")
    await restored.restore_checkpoint()
    assert restored.state == dict(first + second)
