"""`gazctl spark replay` on real Spark (local[2]): a topic written by several publishers through a
real broker, with committed messages, a committed transaction, an aborted one and a batch
appended twice, persisted to a file:// store. The Parquet replay equals the read-committed
iterator row for row; replaying into a journal twice still reads each message once."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from benchmarks._messages import transactions
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.reader import read, write_head
from broker.fragment.content import fragment_path
from broker.fragment.stores import FragmentStore, open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from gazctl.cli import cli
from gazctl.spark.replay import resolve, summary_of
from gazctl.spark.source import FragmentPartition, GazetteReader
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import Publisher, Reader, read_committed
from message.types import DictMessages
from tests.conftest import run_cli
from tests.helpers.fragments import put_pieces
from tests.helpers.journals import routed, started_brokers
from tests.helpers.spark import local_events, sequenced_offline
from tests.helpers.spark_stream import persisted
from tests.helpers.store_servers import GCSServer, S3Server

TOPIC = ["replay/part-000", "replay/part-001"]
TARGET = "replayed/all"


def spec(name: str, store: str | None) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    if name in TOPIC:
        out.labels.labels.add(name="topic", value="replay")
    out.fragment.length = 2048  # Several fragments per journal.
    out.fragment.compression_codec = pb.GZIP
    out.fragment.refresh_interval.seconds = 1
    if store:
        out.fragment.stores.append(store)
    return out


async def write_history(stub: pb_grpc.JournalStub) -> None:
    partitions = [Partition(j, "application/x-ndjson") for j in TOPIC]
    mapping = modulo_mapping(lambda m: str(m["key"]).encode(), lambda: partitions)
    messages, framing = DictMessages(), JSONLines()
    async with AppendService(stub) as service:
        committed = Publisher(service, messages, framing)
        txn = Publisher(service, messages, framing)
        aborted = Publisher(service, messages, framing)
        for i in range(12):
            await committed.publish_committed(mapping, {"key": i, "kind": "committed"})
            await txn.publish_uncommitted(mapping, {"key": i, "kind": "txn"})
            if i < 5:
                await aborted.publish_uncommitted(mapping, {"key": i, "kind": "aborted"})
        await txn.commit()
        await aborted.abort()
        await service.flush()
    # A retried append: the first partition's bytes so far, appended again.
    copy = b"".join([c.content async for c in read(stub, TOPIC[0], 0)])
    await append(stub, TOPIC[0], copy)
    async with AppendService(stub) as service:
        late = Publisher(service, messages, framing)
        for i in range(6):
            await late.publish_uncommitted(mapping, {"key": i, "kind": "late"})
        await late.commit()


async def committed_by_iterator(stub: pb_grpc.JournalStub, journal: str) -> list[tuple[Any, ...]]:
    reader = Reader(DictMessages(), JSONLines())
    return [
        (e.journal, e.begin, e.message)
        async for e in read_committed(stub, journal, reader)
        if not e.is_ack
    ]


def replay(*args: str) -> Any:
    return CliRunner().invoke(cli, ["spark", "replay", *args])


@pytest.mark.slow
async def test_replay_equals_the_read_committed_iterator_and_dedupes_into_a_journal(
    spark: object, etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True, file_root=str(root),
        persist_interval=0.2,
    ) as (broker,):  # fmt: skip
        async with broker.client() as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=spec(j, "file:///store/")) for j in TOPIC]
                + [pb.ApplyRequest.Change(upsert=spec(TARGET, None))]
            )
            for journal in [*TOPIC, TARGET]:
                await routed(client, journal, 1)
        channel = dial(broker.endpoint)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            await write_history(stub)
            expected = []
            for journal in TOPIC:
                expected += await committed_by_iterator(stub, journal)
            kinds = sorted((m["kind"], m["key"]) for _, _, m in expected)
            assert kinds == sorted(
                [("committed", i) for i in range(12)]
                + [("txn", i) for i in range(12)]
                + [("late", i) for i in range(6)]
            )
            # Everything to the store: suspend each journal (its spool rolls and persists), and
            # wait until it is persisted: the replay reads the stores, and leaves out what is
            # not in them yet (a run under load replayed before the last fragments were).
            for journal in TOPIC:
                await persisted(stub, journal, await write_head(stub, journal))

            base = ["-l", "topic=replay", "--file-root", str(root),
                    "--broker.address", broker.endpoint]  # fmt: skip
            out = tmp_path / "replayed.parquet"
            result = await asyncio.to_thread(replay, *base, "--to", f"parquet:{out}", "--flatten")
            assert result.exit_code == 0, result.output
            table = pq.read_table(out).to_pylist()
            rows = sorted(table, key=lambda r: (r["journal"], r["commit_offset"], r["offset"]))
            got = [(r["journal"], r["offset"], r["content"]) for r in rows]
            want = [(j, o, m) for j, o, m in expected]
            assert [(j, o) for j, o, _ in got] == [(j, o) for j, o, _ in want]
            assert [DictMessages().decode(c.encode()) for _, _, c in got] == [m for _, _, m in want]
            assert {r["kind"] for r in rows} == {"committed", "txn", "late"}  # --flatten
            assert all(r["uuid"] and len(r["producer"]) == 12 for r in rows)

            again = await asyncio.to_thread(replay, *base, "--to", f"parquet:{out}")
            assert again.exit_code == 1 and "already exists" in again.output

            # Into a journal, twice: the second copy is all duplicates to a reader.
            for _ in range(2):
                result = await asyncio.to_thread(replay, *base, "--to", f"journal:{TARGET}")
                assert result.exit_code == 0, result.output
            raw = b"".join([c.content async for c in read(stub, TARGET, 0)])
            assert raw.count(b'"kind":"txn"') == 2 * 12
            seen = [m for _, _, m in await committed_by_iterator(stub, TARGET)]
            assert sorted((m["kind"], m["key"]) for m in seen) == kinds
        finally:
            await channel.close(None)


@pytest.mark.slow
async def test_spark_replay_notes_unpersisted_content(
    spark: object, etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    store = open_store("file:///store/", file_root=root)
    journal = "notes/events"
    first = b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"p" * 80) for i in range(24))
    second = b"".join(b'{"n": %d}\n' % i for i in range(24, 30))
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True, file_root=str(root),
        persist_interval=0.2,
    ) as (broker,):  # fmt: skip
        async with broker.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(journal, "file:///store/"))])
            await routed(client, journal, 1)
        channel = dial(broker.endpoint)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            # The first append passes the fragment length, so the second rolls it: the first
            # is persisted, and the second is in the broker only.
            await append(stub, journal, first)
            await append(stub, journal, second)
            head = len(first) + len(second)
            await stored_through(store, journal, len(first))

            base = ["-l", f"name={journal}", "--file-root", str(root),
                    "--broker.address", broker.endpoint]  # fmt: skip
            out = tmp_path / "first.parquet"
            result = await asyncio.to_thread(replay, *base, "--to", f"parquet:{out}")
            assert result.exit_code == 0, result.output
            notes = [line for line in result.output.splitlines() if "not persisted yet" in line]
            assert len(notes) == 1, result.output
            assert journal in notes[0] and str(len(first)) in notes[0] and str(head) in notes[0]
            flush = f"gazctl journals suspend -l name={journal} --force"
            assert flush in notes[0]
            assert pq.read_table(out).num_rows == 24  # What the store holds, and no more.

            done = await asyncio.to_thread(
                run_cli, *shlex.split(flush), env={"BROKER_ADDRESS": broker.endpoint}
            )
            assert done.code == 0, done.err
            await stored_through(store, journal, head)
            out = tmp_path / "all.parquet"
            result = await asyncio.to_thread(replay, *base, "--to", f"parquet:{out}")
            assert result.exit_code == 0, result.output
            assert "not persisted" not in result.output
            assert pq.read_table(out).num_rows == 30
        finally:
            await channel.close(None)


async def stored_through(store: FragmentStore, journal: str, end: int) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while max((f.end for f in store.list_fragments(journal)), default=0) < end:
        assert asyncio.get_running_loop().time() < deadline, f"{journal} never persisted to {end}"
        await asyncio.sleep(0.1)


def test_replay_bad_input_is_one_line(tmp_path: Path) -> None:
    specs = tmp_path / "specs.yaml"
    specs.write_text('name: a/journal\nreplication: 1\nfragment:\n  stores: ["file:///s/"]\n')
    out = tmp_path / "out"  # Not there: the selector's error is the one to see.
    result = replay("-l", "name=nothing/here", "--specs", str(specs), "--to", f"parquet:{out}")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: no journals match the selector 'name=nothing/here' (asked the specs in {specs})\n"
    )
    result = replay("-l", "name=a/journal", "--specs", str(specs), "--to", f"csv:{out}")
    assert result.exit_code == 2 and "give parquet:PATH" in result.output
    result = replay("-l", "name=a/journal", "--specs", str(specs), "--to", f"parquet:{out}",
                    "--from-time", "yesterday")  # fmt: skip
    assert result.exit_code == 2 and "is not a time" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gs", "s3"])
def test_replay_from_cloud_stores_without_a_broker(
    spark: object, gcs_server: GCSServer, s3_server: S3Server, tmp_path: Path, which: str
) -> None:
    if which == "gs":
        url = f"gs://{gcs_server.create_bucket()}/journals/"
    else:
        url = f"s3://{s3_server.create_bucket()}/journals/?endpoint={s3_server.endpoint}"
    data, _ = transactions(2_000, 50, producers=3)
    # A retried batch: the first 30 lines appended again, mid-history.
    lines = data.splitlines(keepends=True)
    data = b"".join(lines[:500] + lines[:30] + lines[500:])
    cuts = [i + 1 for i in range(len(data)) if data[i : i + 1] == b"\n"][::97]
    put_pieces(open_store(url), "cloud/events", data, cuts[:-1], codec=pb.ZSTANDARD)
    specs = tmp_path / "specs.yaml"
    specs.write_text(
        "name: cloud/events\nreplication: 1\nlabels:\n  - name: content-type\n"
        f'    value: application/x-ndjson\nfragment:\n  stores: ["{url}"]\n'
    )
    out = tmp_path / "out.parquet"
    result = replay("-l", "name=cloud/events", "--specs", str(specs), "--to", f"parquet:{out}")
    assert result.exit_code == 0, result.output
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: (r["commit_offset"], r["offset"]))
    got = [(r["journal"], r["offset"], json.loads(r["content"])["id"]) for r in rows]
    assert got == sequenced_offline(data, "cloud/events")
    assert len(got) == 2_000


def test_replay_withdraws_duplicates_a_fragment_cannot_see_and_restarts_cleanly(
    spark: object, tmp_path: Path
) -> None:
    data, _, specs = local_events(tmp_path, pb.ZSTANDARD)
    # The history does what it is meant to: the fragment cut inside the retry has provisional
    # deliveries to withdraw.
    partitions = GazetteReader(
        {
            "selector": "name=local/events",
            "specs": str(specs),
            "file_root": str(tmp_path),
            "framing": "lines",
        }
    ).partitions()
    resolutions = resolve(summary_of(i, p) for i, p in enumerate(partitions))
    assert [i for i, r in resolutions.items() if r.withdraw] == [2]
    out = tmp_path / "out.parquet"
    staging = tmp_path / ".out.parquet.replaying"
    staging.mkdir()
    (staging / "part-00007.parquet").write_bytes(b"left by a killed replay")
    result = replay("-l", "name=local/events", "--specs", str(specs), "--file-root",
                    str(tmp_path), "--to", f"parquet:{out}")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not staging.exists()
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: (r["commit_offset"], r["offset"]))
    got = [(r["journal"], r["offset"], json.loads(r["content"])["id"]) for r in rows]
    want = sequenced_offline(data, "local/events")
    assert got == want
    ids = [i for _, _, i in got]
    assert len(ids) == len(set(ids)) == 300 + 6 + 120  # Each once: no retried duplicate.


def test_replay_of_a_corrupt_fragment_fails_in_one_line_leaving_nothing(
    spark: object, tmp_path: Path
) -> None:
    _, fragments, specs = local_events(tmp_path, pb.NONE)
    path = tmp_path / "store" / fragment_path(fragments[2])
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")
    out = tmp_path / "out.parquet"
    result = replay("-l", "name=local/events", "--specs", str(specs), "--file-root",
                    str(tmp_path), "--to", f"parquet:{out}")  # fmt: skip
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
    assert fragment_path(fragments[2]) in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specs.yaml", "store"]
    # Split, the fragment's last split reads it whole and checks it: the job fails the same.
    result = replay("-l", "name=local/events", "--specs", str(specs), "--file-root",
                    str(tmp_path), "--split-size", "700", "--to", f"parquet:{out}")  # fmt: skip
    assert result.exit_code == 1
    assert "does not match its SHA-1" in result.output and result.output.count("\n") == 1
    assert fragment_path(fragments[2]) in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specs.yaml", "store"]


def planned(options: dict[str, str]) -> list[FragmentPartition]:
    return [p for p in GazetteReader(options).partitions() if isinstance(p, FragmentPartition)]


def split_rows(partitions: list[FragmentPartition]) -> list[list[tuple[int, int, int]]]:
    """Each partition's messages: (offset, end, id), read on the driver."""
    import pyarrow as pa

    out = []
    reader = GazetteReader({})
    for partition in partitions:
        batches = list(reader.read(partition))
        rows = pa.Table.from_batches(batches).to_pylist() if batches else []
        out.append([(r["offset"], r["end"], json.loads(r["content"])["id"]) for r in rows])
    return out


@pytest.mark.parametrize("codec", [pb.NONE, pb.ZSTANDARD])
def test_a_fragment_splits_at_message_boundaries_each_message_in_one_split(
    tmp_path: Path, codec: int
) -> None:
    data, fragments, specs = local_events(tmp_path, codec)
    options = {"selector": "name=local/events", "specs": str(specs),
               "file_root": str(tmp_path), "framing": "lines"}  # fmt: skip
    whole = planned(options)
    split = planned({**options, "split_bytes": "1000"})
    assert len(whole) == len(fragments) and len(split) > 3 * len(fragments)
    boundaries = {0} | {i + 1 for i in range(len(data)) if data[i : i + 1] == b"\n"}
    assert any(p.begin not in boundaries for p in split)  # Cut points fall inside messages.
    by_split = split_rows(split)
    messages = [row for rows in by_split for row in rows]
    assert messages == [row for rows in split_rows(whole) for row in rows]  # Each once, in order.
    assert len(messages) == len(data.splitlines())
    for partition, rows in zip(split, by_split, strict=True):
        assert all(partition.begin <= offset < partition.end for offset, _, _ in rows)


def test_a_split_replay_writes_the_rows_of_an_unsplit_one(spark: object, tmp_path: Path) -> None:
    data, _, specs = local_events(tmp_path, pb.GZIP)
    base = ["-l", "name=local/events", "--specs", str(specs), "--file-root", str(tmp_path)]
    # 700 bytes: several splits per fragment, cut inside the retried append and all through
    # the transaction, which spans fragments and is acknowledged in the last one.
    options = {"selector": "name=local/events", "specs": str(specs),
               "file_root": str(tmp_path), "framing": "lines", "split_bytes": "700"}  # fmt: skip
    partitions = planned(options)
    txn = [json.loads(line)["id"] for line in data.splitlines()].index(1_000)
    txn_at = sum(len(line) + 1 for line in data.splitlines()[:txn])
    assert sum(1 for p in partitions if p.begin > txn_at) > 10
    tables = {}
    for name, extra in (("whole", []), ("split", ["--split-size", "700"])):
        out = tmp_path / f"{name}.parquet"
        result = replay(*base, *extra, "--to", f"parquet:{out}")
        assert result.exit_code == 0, result.output
        tables[name] = sorted(
            pq.read_table(out).to_pylist(), key=lambda r: (r["commit_offset"], r["offset"])
        )
    assert tables["split"] == tables["whole"]
    got = [(r["journal"], r["offset"], json.loads(r["content"])["id"]) for r in tables["split"]]
    assert got == sequenced_offline(data, "local/events")
    assert len(got) == 300 + 6 + 120
