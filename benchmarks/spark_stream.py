"""spark_stream: rows/s of a Structured Streaming query (`gazctl spark stream --once`: the gazette
source read-committed into Parquet) over four journals of 250,000 200-byte JSON messages each
(transactions of 100, four producers; 8 MiB zstd fragments in a file:// store, behind one broker),
on local[2]. Baseline in the same run: `gazctl spark replay` of the same journals into Parquet,
on the same session. Target: a ratio of at least 0.8. Small runs of both warm the session first.

Also in the same run: the floor, the same rows from a Python streaming source that does no work
(ready Arrow batches), as `floor_ratio` against the replay: the most this source could reach.

Then latency: messages published at a fixed rate (500/s) for 20 s while a query with a 1 s
trigger streams them into Parquet; a message's latency is from its UUID time (when it was
published) to when the batch that holds it was committed to the table (the batch's
`_spark_metadata` entry). p50 and p99 are reported."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster import percentile, start_broker, stop_brokers, wait_ready
from benchmarks._messages import transactions
from broker.client.journals import JournalsClient
from broker.client.reader import write_head
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer

STORE = "file:///fragments/"
FRAGMENT = 8 << 20
CORES = 2
JOURNALS = 4


def write_fragments(root: Path, prefix: str, per_journal: int) -> int:
    """Each journal's history as fragments in the store; the bytes in all."""
    from tests.helpers.fragments import put_fragment

    (root / "fragments").mkdir(exist_ok=True)
    store = open_store(STORE, file_root=root)
    data, _ = transactions(per_journal, 100)
    for j in range(JOURNALS):
        begin = 0
        while begin < len(data):
            end = (
                len(data)
                if len(data) - begin <= FRAGMENT
                else data.index(b"\n", begin + FRAGMENT) + 1
            )
            put_fragment(store, f"{prefix}/part-{j:03d}", begin, data[begin:end], pb.ZSTANDARD)
            begin = end
    return len(data) * JOURNALS


def spec(name: str, topic: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    out.labels.labels.add(name="topic", value=topic)
    out.fragment.length = 64 << 20
    out.fragment.compression_codec = pb.ZSTANDARD
    out.fragment.stores.append(STORE)
    out.fragment.refresh_interval.seconds = 1
    return out


async def placed(address: str, prefix: str, size: int) -> None:
    """The topic's journals applied, and each write head at the end of its fragments."""
    names = [f"{prefix}/part-{j:03d}" for j in range(JOURNALS)]
    async with JournalsClient(address) as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec(n, prefix)) for n in names])
        for name in names:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if await write_head(client.stub, name) >= size // JOURNALS:
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: its head never reached its fragments' end")
                await asyncio.sleep(0.1)


def stream(session: Any, address: str, root: Path, prefix: str, out: Path) -> int:
    from gazctl.spark.stream_cli import build_query

    source = {"selector": f"topic={prefix}", "broker": address, "framing": "lines",
              "file_root": str(root)}  # fmt: skip
    query = build_query(session, source, "parquet", str(out), out.with_suffix(".ckpt"),
                        trigger=1.0, once=True, key=None, broker=address)  # fmt: skip
    query.awaitTermination()
    return int(session.read.parquet(str(out)).count())


def floor(session: Any, rows: int, out: Path) -> float:
    """Seconds a streaming query takes to write `rows` rows of the stream source's schema into
    Parquet from a Python source that does no work (its executors yield ready Arrow batches of
    200-byte JSON content, four partitions): what Spark itself costs, before any reading. The
    classes are defined here, so that Spark pickles them whole to its Python workers."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    from gazctl.spark.stream_source import STREAM_SCHEMA

    class Part(InputPartition):
        pass

    class Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict[str, Any]:
            return {"v": 0}

        def latestOffset(self, start: Any = None, limit: Any = None) -> dict[str, Any]:
            return {"v": 1}

        def partitions(self, start: Any, end: Any) -> list[Any]:
            return [Part(i) for i in range(JOURNALS)]

        def read(self, partition: Any) -> Any:
            import numpy as np
            import pyarrow as pa

            from gazctl.spark.columns import with_timestamp
            from gazctl.spark.stream_source import stream_arrow_schema

            n = 8192
            text = "0b1c0a9e-8a2d-11ef-8000-0123456789ab"
            content = [f'{{"_meta":{{"uuid":"{text}"}},"i":{i},"pad":"{"x" * 130}"}}' for i in range(n)]  # fmt: skip
            offsets = np.arange(n, dtype=np.int64) * 200
            batch = with_timestamp(pa.RecordBatch.from_arrays(
                [pa.repeat("bench/part-000", n), pa.array(offsets), pa.array(offsets + 200),
                 pa.repeat("0123456789ab", n), pa.array(offsets + (1 << 59)),
                 pa.array(np.ones(n, np.int32)), pa.repeat(text, n), pa.array(content)],
                schema=stream_arrow_schema(),
            ))  # fmt: skip
            left = rows // JOURNALS
            while left > 0:
                yield batch.slice(0, min(n, left))
                left -= n

        def commit(self, end: Any) -> None:
            pass

    class Floor(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_floor"

        def schema(self) -> str:
            return STREAM_SCHEMA

        def streamReader(self, schema: Any) -> Any:
            return Reader()

    session.dataSource.register(Floor)
    start = time.perf_counter()
    query = (
        session.readStream.format("bench_floor").load().writeStream.format("parquet")
        .option("path", str(out)).option("checkpointLocation", str(out.with_suffix(".ckpt")))
        .trigger(availableNow=True).start()
    )  # fmt: skip
    query.awaitTermination()
    seconds = time.perf_counter() - start
    assert session.read.parquet(str(out)).count() == rows
    return seconds


def replay(session: Any, address: str, root: Path, prefix: str, out: Path) -> int:
    from rich.progress import Progress

    from gazctl.spark.jobs import replay_to_parquet

    options = {"selector": f"topic={prefix}", "broker": address, "file_root": str(root),
               "framing": "lines"}  # fmt: skip
    with Progress(disable=True) as progress:
        return replay_to_parquet(session, options, str(out), False, progress)


async def publish_at(address: str, journal: str, rate: float, seconds: float) -> int:
    from broker.client.append_service import AppendService
    from message.framing import JSONLines
    from message.mapping import Partition
    from message.types import DictMessages

    part = Partition(journal, "application/x-ndjson")
    sent = 0
    start = time.monotonic()
    async with JournalsClient(address) as client, AppendService(client.stub) as service:
        from message.publisher import Publisher

        publisher = Publisher(service, DictMessages(), JSONLines())
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(elapsed * rate) - sent
            for _ in range(due):
                await publisher.publish_committed(lambda _m: part, {"i": sent, "pad": "x" * 150})
                sent += 1
            await asyncio.sleep(0.005)
        await service.flush()
    return sent


def latencies(table: Path) -> list[float]:
    """Per row: its batch's commit time (when the `_spark_metadata` entry naming its file was
    written: `N`, or `N.compact` every tenth batch, which names earlier files too) less its
    UUID time."""
    import pyarrow.parquet as pq

    entries = []
    for entry in (table / "_spark_metadata").iterdir():
        number = entry.name.removesuffix(".compact")
        if number.isdigit():
            entries.append((int(number), entry))
    first_named: dict[str, float] = {}
    for _, entry in sorted(entries):
        committed = entry.stat().st_mtime
        for line in entry.read_text().splitlines()[1:]:
            path = json.loads(line)["path"].removeprefix("file://")
            first_named.setdefault(path, committed)
    out: list[float] = []
    for path, committed in first_named.items():
        for stamp in pq.read_table(path, columns=["timestamp"]).column("timestamp").to_pylist():
            out.append(committed - stamp.timestamp())
    return sorted(out)


def run(quick: bool = False) -> dict[str, Any]:
    from gazctl.spark.session import spark_session, stop_spark, use_in_this_thread

    per_journal = 25_000 if quick else 250_000
    latency_seconds = 8.0 if quick else 20.0
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-stream-") as tmp:
        root = Path(tmp)
        (root / "fragments").mkdir()
        warm_size = write_fragments(root, "warm", 5_000)
        size = write_fragments(root, "bench", per_journal)
        broker = start_broker(etcd, "broker-0", root / "broker.log", file_root=root)
        session = spark_session(f"local[{CORES}]", "spark_stream benchmark")
        try:
            asyncio.run(wait_ready([broker]))
            asyncio.run(placed(broker.address, "warm", warm_size))
            asyncio.run(placed(broker.address, "bench", size))
            use_in_this_thread(session)
            stream(session, broker.address, root, "warm", root / "warm-stream")
            replay(session, broker.address, root, "warm", root / "warm-replay")

            start = time.perf_counter()
            streamed = stream(session, broker.address, root, "bench", root / "stream")
            stream_seconds = time.perf_counter() - start
            start = time.perf_counter()
            replayed = replay(session, broker.address, root, "bench", root / "replay")
            replay_seconds = time.perf_counter() - start
            floor(session, 10_000, root / "warm-floor")
            floor_seconds = floor(session, per_journal * JOURNALS, root / "floor")

            # Latency: a query with a 1 s trigger while messages arrive at a fixed rate.
            from gazctl.spark.stream_cli import build_query

            asyncio.run(placed(broker.address, "live", 0))
            source = {"selector": "topic=live", "broker": broker.address, "framing": "lines",
                      "file_root": str(root)}  # fmt: skip
            table = root / "live"
            query = build_query(session, source, "parquet", str(table), root / "live.ckpt",
                                trigger=1.0, once=False, key=None, broker=broker.address)  # fmt: skip
            sent = asyncio.run(publish_at(broker.address, "live/part-000", 500, latency_seconds))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if table.joinpath("_spark_metadata").is_dir() and len(latencies(table)) >= sent:
                    break
                time.sleep(0.5)
            query.stop()
            lags = latencies(table)
        finally:
            stop_spark(session)
            stop_brokers([broker])
            close_stores()
    count = per_journal * JOURNALS
    assert streamed == replayed == count, (streamed, replayed, count)
    assert len(lags) == sent, (len(lags), sent)
    value, base = count / stream_seconds, count / replay_seconds
    return {
        "value": round(value),
        "unit": "rows/s",
        "baseline": round(base),
        "ratio": round(value / base, 2),
        "target": 0.8,
        "messages": count,
        "bytes": size,
        "latency_p50_s": round(percentile(lags, 0.5), 2),
        "latency_p99_s": round(percentile(lags, 0.99), 2),
        "latency_messages": sent,
        # Spark's own cost: a source that does no work, against the same replay.
        "floor_ratio": round(replay_seconds / floor_seconds, 2),
    }


if __name__ == "__main__":
    print(run())
