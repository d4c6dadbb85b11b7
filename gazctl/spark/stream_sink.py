"""`df.writeStream.format("gazette")`: a Structured Streaming sink into journals, exactly-once.

    df.writeStream.format("gazette")
        .option("journal", "derived/all")          # one journal, or a partitioned topic:
        .option("selector", "topic=derived")       #   the journals it matches, and a key
        .option("key", "key")                      #   column to map rows by (as a Publisher)
        .option("checkpointLocation", "/ckpt")     # required: the sink keeps its log there
        .start()

Rows hold a `content` column (a JSON document, as text or bytes) and, for a topic, the key
column. Each micro-batch is one Gazette transaction:

* **Tasks** append their rows as uncommitted messages (CONTINUE_TXN). The producer of partition
  p is derived from the query's id and p, so it is the same in every attempt and every batch.
  Rows are sorted by (journal, content) and row i gets Clock `base + i·TICK`, where `base` is
  the batch's, from the sink's log: every attempt of a batch (a retried task, a speculative or
  zombie one, a batch re-run after the driver died) writes byte-identical messages under the
  same UUIDs, so readers keep one copy of each (their Sequencer drops a Clock it has seen).
* **The driver's commit** records the acknowledgements in the sink's log first, then appends
  them, one append per journal: one ACK per (journal, producer), at Clock `base + n·TICK`,
  above the producer's n messages. A commit re-run after a crash writes the recorded ACKs
  again: an ACK equal to the producer's last is a no-op for readers.
* **Abort** appends ACKs at `base - 1`, rolling back whatever of the batch was written: below
  every message of the batch and at or above the producer's previous ACK.

Each batch's `base` is above the previous batch's acknowledgements (and at least the wall
clock), so a producer's Clocks only grow. The sink's log lives in the query's checkpoint
directory (`gazette-sink/<batch>.json`); the batch being written is the newest in Spark's own
offset log there. The query must be deterministic between source and sink (Spark's own rule
for exactly-once sinks): a re-run batch must hold the same rows.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage

from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.journals import JobError, known_options
from message.framing import JSONLines, framing_for
from message.mapping import fnv1a32
from message.types import DictMessages
from message.uuid import TICK, Flags, build, from_time, text_of

SINK_OPTIONS = ("journal", "selector", "key", "broker", "uuid_path", "checkpointLocation")
SINK_DIR = "gazette-sink"
KEEP_RECORDS = 100  # Records of older batches are removed.
WRITE_BYTES = 1 << 20  # Messages go to the append service in writes of about this much.


@dataclass(frozen=True)
class SinkOptions:
    journal: str | None
    selector: str | None
    key: str
    broker: str
    uuid_path: str
    checkpoint: Path

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> SinkOptions:
        given = known_options(options, SINK_OPTIONS, "the gazette sink")
        journal, selector = given.get("journal"), given.get("selector")
        if (journal is None) == (selector is None):
            raise JobError(
                "the gazette sink needs option journal (one journal) or selector (a topic's "
                "journals, with option key naming the column to map rows by), not both"
            )
        if selector is not None:
            labels.parse_selector(selector)
        broker = given.get("broker") or os.environ.get("BROKER_ADDRESS", "")
        if not broker:
            raise JobError("the gazette sink needs option broker (or $BROKER_ADDRESS)")
        checkpoint = given.get("checkpointLocation")
        if checkpoint is None:
            raise JobError(
                "the gazette sink needs option checkpointLocation: it keeps its log of "
                "transactions beside the query's"
            )
        path = Path(checkpoint.removeprefix("file://").removeprefix("file:"))
        return cls(journal, selector, given.get("key", "key"), broker,
                   given.get("uuid_path", "_meta.uuid"), path)  # fmt: skip


# The sink's log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkRecord:
    """What every attempt of a batch shares: its Clock base, the journals rows map to, and
    (once the commit began) the acknowledgements: (journal, producer hex, Clock)."""

    batch: int
    base: int
    journals: tuple[str, ...]
    intents: tuple[tuple[str, str, int], ...] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "base": self.base,
                "batch": self.batch,
                "intents": self.intents,
                "journals": list(self.journals),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> SinkRecord:
        found = json.loads(text)
        intents = found.get("intents")
        return cls(
            int(found["batch"]),
            int(found["base"]),
            tuple(found["journals"]),
            None if intents is None else tuple((j, p, int(c)) for j, p, c in intents),
        )

    def top(self) -> int:
        """The largest Clock the batch used (its acknowledgements'), or its base."""
        return max([self.base, *(c for _, _, c in self.intents or ())])


class SinkLog:
    """`<checkpoint>/gazette-sink/<batch>.json`, written atomically."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.dir = checkpoint / SINK_DIR

    def current_batch(self) -> int:
        """The batch Spark is running: the newest in its offset log."""
        found = [int(p.name) for p in (self.checkpoint / "offsets").glob("*") if p.name.isdigit()]
        if not found:
            raise JobError(
                f"the query's checkpoint {self.checkpoint} has no offset log: the gazette sink "
                "runs in a streaming query with this checkpointLocation"
            )
        return max(found)

    def batches(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(p.stem) for p in self.dir.glob("*.json") if p.stem.isdigit())

    def read(self, batch: int) -> SinkRecord | None:
        try:
            return SinkRecord.from_json((self.dir / f"{batch}.json").read_text())
        except FileNotFoundError:
            return None

    def write(self, record: SinkRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{record.batch}.json"
        temp = path.with_suffix(f".tmp-{os.getpid()}")
        with open(temp, "w") as f:
            f.write(record.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def prepare(self, batch: int, journals: Sequence[str]) -> SinkRecord:
        """Batch `batch`'s record: the one written already (an attempt before this one, or the
        run before a crash), or a new one whose base is above every earlier batch's Clocks."""
        found = self.read(batch)
        if found is not None:
            return found
        earlier = [r for b in self.batches() if b < batch and (r := self.read(b)) is not None]
        base = from_time(time.time())
        if earlier:
            base = max(base, max(r.top() for r in earlier) + TICK)
        record = SinkRecord(batch, base, tuple(sorted(journals)))
        self.write(record)
        for old in self.batches():
            if old < batch - KEEP_RECORDS:
                (self.dir / f"{old}.json").unlink(missing_ok=True)
        return record


def producer_of(query: str, partition: int) -> bytes:
    """The ProducerID of the query's partition: 6 bytes of a hash, multicast bit set (as a
    random ProducerID has it), the same in every attempt and batch."""
    raw = bytearray(
        hashlib.sha256(f"gazette-spark-sink\0{query}\0{partition}".encode()).digest()[:6]
    )
    raw[0] |= 0x01
    return bytes(raw)


def query_id(checkpoint: Path) -> str:
    """The query's id, from its checkpoint's metadata (the same across restarts)."""
    try:
        found = json.loads((checkpoint / "metadata").read_text().splitlines()[0])
        return str(found["id"])
    except (OSError, ValueError, KeyError, IndexError):
        raise JobError(
            f"cannot read the query's id from {checkpoint / 'metadata'}: the gazette sink "
            "runs in a streaming query with this checkpointLocation"
        ) from None


def sink_id(checkpoint: Path) -> str:
    """The sink's own id, made at its first batch and kept in `gazette-sink/identity.json`
    with the checkpoint's path; its producers derive from it. Spark keeps a query's id in the
    checkpoint, so a copy of it, started as a second query, would write under the first's
    producers: Clocks of one below the other's acknowledgements, dropped as duplicates. A
    checkpoint found at another path than it was made at is refused."""
    folder = checkpoint / SINK_DIR
    path = folder / "identity.json"
    here = str(checkpoint.resolve())
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        found = None
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read the gazette sink's identity {path}: {exc}") from None
    if found is None:
        folder.mkdir(parents=True, exist_ok=True)
        made = {"id": f"{query_id(checkpoint)}/{os.urandom(8).hex()}", "checkpoint": here}
        temp = path.with_suffix(f".tmp-{os.getpid()}")
        temp.write_text(json.dumps(made))
        os.replace(temp, path)
        return str(made["id"])
    if found.get("checkpoint") != here:
        raise JobError(
            f"this checkpoint was made at {found.get('checkpoint')} and is now at {here}: a "
            "copy would write under the first query's producers, and readers would drop one "
            "query's rows as the other's duplicates; start a new query with a new "
            f"checkpointLocation (or, for a checkpoint moved on purpose, remove {path})"
        )
    return str(found["id"])


# The writer -------------------------------------------------------------------------------


@dataclass
class SinkCommit(WriterCommitMessage):
    """What a task wrote: its producer, its row count, the journals it wrote to."""

    batch: int
    partition: int
    producer: str
    count: int
    journals: tuple[str, ...]


class GazetteStreamWriter(DataSourceStreamWriter):
    """One per batch, made on the driver; pickled to the tasks."""

    def __init__(self, options: SinkOptions, query: str, record: SinkRecord) -> None:
        self.options = options
        self.query = query
        self.record = record

    @classmethod
    def create(
        cls, options: Mapping[str, Any], schema: Any, overwrite: bool
    ) -> GazetteStreamWriter:
        parsed = SinkOptions.parse(options)
        if overwrite:
            raise JobError(
                "the gazette sink appends: it cannot overwrite (complete output mode); use "
                "append or update"
            )
        names = {f.name: f.dataType.simpleString() for f in schema.fields}
        if names.get("content") not in ("string", "binary"):
            raise JobError(
                "the gazette sink writes column content (a JSON document, string or binary): "
                f"the rows have {', '.join(names) or 'no columns'}"
            )
        if parsed.selector is not None and parsed.key not in names:
            raise JobError(
                f"the gazette sink maps rows to the topic's journals by column {parsed.key!r} "
                f"(option key), which the rows lack: they have {', '.join(names)}"
            )
        log = SinkLog(parsed.checkpoint)
        batch = log.current_batch()
        found = log.read(batch)
        journals = found.journals if found is not None else asyncio.run(_targets(parsed))
        return cls(parsed, sink_id(parsed.checkpoint), log.prepare(batch, journals))

    def write(self, iterator: Iterator[Any]) -> SinkCommit:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is None:
            return self.write_partition(iterator, 0)
        running = context.getLocalProperty("streaming.sql.batchId")
        if running is not None and int(running) != self.record.batch:
            raise JobError(
                f"the gazette sink's writer was made for batch {self.record.batch} but runs in "
                f"batch {running}"
            )
        return self.write_partition(iterator, context.partitionId())

    def write_partition(self, iterator: Iterator[Any], partition: int) -> SinkCommit:
        """Append the partition's rows as the batch's uncommitted messages of its producer."""
        producer = producer_of(self.query, partition)
        rows = sorted(self._routed(iterator))
        framed = _framed(rows, producer, self.record.base, self.options.uuid_path)
        if framed:
            asyncio.run(_append(self.options.broker, framed))
        journals = tuple(sorted({j for j, _ in rows}))
        return SinkCommit(self.record.batch, partition, producer.hex(), len(rows), journals)

    def _routed(self, iterator: Iterator[Any]) -> Iterator[tuple[str, bytes]]:
        journals = self.record.journals
        key = self.options.key
        for row in iterator:
            content = row["content"]
            if content is None:
                raise JobError(
                    "the gazette sink writes column content, and a row's is null: filter such "
                    "rows out (or give them a JSON document) before the sink"
                )
            data = content.encode() if isinstance(content, str) else bytes(content)
            if len(journals) == 1:
                yield journals[0], data
                continue
            value = row[key]
            raw = value if isinstance(value, bytes | bytearray) else str(value).encode()
            yield journals[fnv1a32(bytes(raw)) % len(journals)], data

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log = SinkLog(self.options.checkpoint)
        record = log.read(batchId) or self.record
        if record.intents is None:
            intents = sorted(
                (journal, m.producer, record.base + m.count * TICK)
                for m in messages
                if isinstance(m, SinkCommit) and m.count
                for journal in m.journals
            )
            record = replace(record, intents=tuple(intents))
            log.write(record)  # First recorded, then written: a re-run writes the same.
        assert record.intents is not None
        acks = _acks(record.intents, self.options.uuid_path)
        if acks:
            asyncio.run(_append(self.options.broker, acks))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        record = SinkLog(self.options.checkpoint).read(batchId) or self.record
        if record.intents is not None:
            return  # The commit began: its acknowledgements stand (a re-run writes them).
        rollback = sorted(
            (journal, m.producer, record.base - 1)
            for m in messages
            if isinstance(m, SinkCommit) and m.count
            for journal in m.journals
        )
        acks = _acks(tuple(rollback), self.options.uuid_path)
        if acks:
            asyncio.run(_append(self.options.broker, acks))


async def _targets(options: SinkOptions) -> list[str]:
    """The journals rows map to, checked to take JSON lines."""
    async with JournalsClient(options.broker) as client:
        if options.journal is not None:
            selector = pb.LabelSelector(
                include=pb.LabelSet(labels=[pb.Label(name="name", value=options.journal)])
            )
        else:
            assert options.selector is not None
            selector = labels.rewrite_prefix_meta_label(labels.parse_selector(options.selector))
        listed = (await client.list(selector)).journals
    if not listed:
        what = (
            f"journal {options.journal}"
            if options.journal
            else f"the selector {options.selector!r}"
        )
        raise JobError(f"the gazette sink's {what} matches no journal (asked {options.broker})")
    for journal in listed:
        content_type = next(
            (x.value for x in journal.spec.labels.labels if x.name == "content-type"), ""
        )
        try:
            framing = framing_for(content_type)
        except ValueError:
            framing = None
        if not isinstance(framing, JSONLines):
            raise JobError(
                f"journal {journal.spec.name} has content-type {content_type or '(none)'!r}: "
                "the gazette sink writes JSON lines (application/x-ndjson)"
            )
    return sorted(j.spec.name for j in listed)


def _framed(
    rows: list[tuple[str, bytes]], producer: bytes, base: int, uuid_path: str
) -> dict[str, list[bytes]]:
    """Each row as a framed CONTINUE_TXN message, its UUID set, grouped by journal."""
    messages = DictMessages(tuple(uuid_path.split(".")))
    hexed = producer.hex()
    out: dict[str, list[bytes]] = {}
    for i, (journal, data) in enumerate(rows):
        try:
            doc = messages.decode(data)
        except ValueError as exc:
            raise JobError(
                f"the gazette sink writes JSON documents: row {data[:60]!r} is not one ({exc})"
            ) from None
        try:
            messages.set_uuid_text(doc, text_of(hexed, base + i * TICK, int(Flags.CONTINUE_TXN)))
        except ValueError as exc:
            raise JobError(
                f"the gazette sink cannot give row {data[:60]!r} its UUID: {exc}"
            ) from None
        out.setdefault(journal, []).append(messages.encode(doc) + b"\n")
    return out


def _acks(intents: Sequence[tuple[str, str, int]], uuid_path: str) -> dict[str, list[bytes]]:
    messages = DictMessages(tuple(uuid_path.split(".")))
    out: dict[str, list[bytes]] = {}
    for journal, producer, clock in intents:
        doc = messages.new_acknowledgement(journal)
        messages.set_uuid(doc, build(bytes.fromhex(producer), clock, Flags.ACK_TXN))
        out.setdefault(journal, []).append(messages.encode(doc) + b"\n")
    return out


async def _append(broker: str, framed: dict[str, list[bytes]]) -> None:
    """Append each journal's frames in order, in writes of about WRITE_BYTES, and wait for all:
    every write retried through broker failures (a re-sent write is a duplicate to readers)."""
    async with JournalsClient(broker) as client, AppendService(client.stub) as service:
        pending = []
        for journal in sorted(framed):
            chunk = bytearray()
            for frame in framed[journal]:
                chunk += frame
                if len(chunk) >= WRITE_BYTES:
                    pending.append(await service.write(journal, bytes(chunk)))
                    chunk = bytearray()
            if chunk:
                pending.append(await service.write(journal, bytes(chunk)))
        for future in pending:
            await future
