"""A zombie primary, with real processes: a shard runs in one process (the zombie, which holds
no lease and so never learns it lost the shard) while a consumer process is assigned the same
shard and restores its store. The zombie's next commit is refused by the store's fence, it
stops, and nothing of its refused transaction is visible: every stream's sum, read committed,
arrives exactly once and exactly right."""

from __future__ import annotations

import asyncio
import base64
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.client.reader import write_head
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, stop_process
from consumer.client import ShardsClient
from consumer.examples.stream_sum import SUMS, journal_spec
from consumer.protocol import cpb
from consumer.store import JSONFileStore
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Sequencer
from message.types import DictMessages
from tests.conftest import BrokerProcess
from tests.helpers.consumers import ConsumerProcesses
from tests.helpers.journals import routed
from tests.helpers.waiting import until

SHARD = "stream-sum-zombie"


class Streams:
    """Chunks of streams of this run, and the sums they must add up to."""

    def __init__(self, run: str, rng: random.Random) -> None:
        self.run, self.rng = run, rng
        self.next_seq: dict[str, int] = {}
        self.sums: dict[str, int] = {}

    async def publish(
        self, publisher: Publisher[dict], journal: str, streams: range, chunks: int, last: bool
    ) -> None:  # type: ignore[type-arg]
        to = Partition(journal, "application/x-ndjson")
        for _ in range(chunks):
            for s in streams:
                stream = f"{self.run}-{s:03d}"
                seq = self.next_seq.get(stream, 0) + 1
                value = self.rng.randint(-100, 100)
                self.next_seq[stream], self.sums[stream] = seq, self.sums.get(stream, 0) + value
                final = last and _ == chunks - 1
                await publisher.publish_committed(
                    lambda _m: to, {"stream": stream, "seq": seq, "value": value, "last": final}
                )


def read_through(store_root: Path, journal: str) -> int:
    """How far the shard's committed checkpoint (its JSON-file store's document) reads
    `journal` (0 before its first commit)."""
    document = JSONFileStore(store_root, SHARD)._read()
    if document is None:
        return 0
    checkpoint = cpb.Checkpoint.FromString(base64.b64decode(document.get("checkpoint", "")))
    return max(
        (s.read_through for key, s in checkpoint.sources.items() if key.split(";")[0] == journal),
        default=0,
    )


@pytest.fixture
def summer(
    etcd_server: EtcdServer, broker_process: BrokerProcess, tmp_path: Path
) -> Iterator[ConsumerProcesses]:
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    (tmp_path / "stores").mkdir()
    group = ConsumerProcesses(
        [sys.executable, "-m", "consumer.examples.stream_sum"],
        ["--summer.store-root", str(tmp_path / "stores")],
        etcd_server, broker_process, root, tmp_path,
    )  # fmt: skip
    try:
        yield group
    finally:
        group.stop_all()


@pytest.mark.slow
async def test_a_zombie_primarys_commit_is_fenced_out_and_invisible(
    summer: ConsumerProcesses, broker_process: BrokerProcess, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    chunks = f"test/zombie/{run}/chunks"
    async with JournalsClient(broker_process.address) as journals:
        have = {j.spec.name for j in (await journals.list()).journals}
        await journals.apply(
            [
                pb.ApplyRequest.Change(upsert=journal_spec(name, 1))
                for name in (chunks, SUMS)
                if name not in have
            ]
        )
        for name in (chunks, SUMS):
            await routed(journals, name, replicas=1)
        start = await write_head(journals.stub, SUMS)

        zombie = subprocess.Popen(
            [sys.executable, "-m", "tests.zombie_shard", "--broker", broker_process.address,
             "--store-root", str(tmp_path / "stores"), "--shard", SHARD, "--source", chunks],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert zombie.stdout is not None
            assert await asyncio.to_thread(zombie.stdout.readline) == "restored\n"
            streams = Streams(run, random.Random(5))
            async with AppendService(journals.stub) as service:
                publisher = Publisher(service, DictMessages(), JSONLines())
                # The zombie sums the first half of every stream, and commits it: its store's
                # checkpoint reads the chunks through their head.
                await streams.publish(publisher, chunks, range(20), 5, last=False)
                await service.flush()
                head = await write_head(journals.stub, chunks)
                await until(
                    lambda: read_through(tmp_path / "stores", chunks) >= head,
                    "the zombie committed the first half",
                )

                # A consumer process is assigned the shard and restores its store: the zombie,
                # still running, is fenced out from now on.
                summer.start("summer-0")
                async with ShardsClient(summer.address("summer-0")) as shards:
                    spec = cpb.ShardSpec(id=SHARD, sources=[cpb.ShardSpec.Source(journal=chunks)])
                    spec.max_txn_duration.FromMilliseconds(200)
                    await shards.apply([cpb.ApplyRequest.Change(upsert=spec)])

                    async def primary() -> bool:
                        listed = (await shards.list()).shards
                        return bool(
                            listed
                            and listed[0].status
                            and listed[0].status[0].code == cpb.ReplicaStatus.PRIMARY
                        )

                    await until(primary, f"{SHARD} has a primary")

                # Both read the rest; only the consumer process may commit it.
                await streams.publish(publisher, chunks, range(20), 5, last=True)
                await service.flush()
            code = await asyncio.to_thread(zombie.wait, 30)
            said = zombie.stdout.read()
            assert code == 3 and "fenced out" in said, said
        finally:
            if zombie.poll() is None:
                stop_process(zombie)  # type: ignore[arg-type]
            if zombie.stdout is not None:
                zombie.stdout.close()

        got: dict[str, int] = {}
        reader = Reader(DictMessages(), JSONLines())
        async with asyncio.timeout(60):
            async for envelope in read_committed(
                journals.stub, SUMS, reader, Sequencer(), start, block=True
            ):
                stream = envelope.message.get("stream", "")
                if envelope.is_ack or not stream.startswith(run):
                    continue
                assert stream not in got, f"a second sum of {stream}"
                got[stream] = envelope.message["sum"]
                if len(got) == len(streams.sums):
                    break
        assert got == streams.sums
    assert "OutOfSequence" not in summer.log("summer-0")
