"""`spark.readStream.format("gazette")`: journals as a Structured Streaming source, read-committed
and exact across micro-batches, restarts and retries.

    spark.readStream.format("gazette")
        .option("selector", "topic=events")        # the journals (new ones join as they appear)
        .option("broker", "http://127.0.0.1:8080") # else $BROKER_ADDRESS, as gazctl takes it
        .option("startingOffsets", "earliest")     # latest | {"journal": offset} | a time
        .option("maxMessagesPerTrigger", "10000")  # and/or maxBytesPerTrigger: never exceeded
        .load()

**Offsets are consumer checkpoints.** A micro-batch's end offset holds, per journal, the offset
read through (`at`, always a frame boundary), the journal's etcd create revision (`rev`: a
journal deleted and made anew is another journal) and the Sequencer's state of each producer
seen in it (`p`: its last acknowledged Clock and where its pending span begins, or -1): what a
consumer shard's checkpoint holds. A batch delivers what a Sequencer restored from the batch's
start offset dequeues while reading [start.at, end.at): a consumer restarting from its
checkpoint, which the Sequencer makes exact. So the batches, one after another, deliver what one
read-committed pass delivers: each committed message once, rolled-back ones never, duplicates of
retried appends dropped by (producer, Clock), and a transaction whole, in the batch that reads
its acknowledgement (its messages read by earlier batches are read again then: a pending span's
`begin` says from where).

**The driver plans, executors deliver.** End offsets must be in Spark's offset log before a
batch runs, and the limits count messages delivered, so the driver (`latestOffset`) reads each
journal from its offset (UUIDs and frame sizes; content is not kept) and cuts it. Executors
(`read`) read [start.at, end.at) again, content and all, straight from the fragment stores
where it is persisted and through a broker past that (one byte range, wherever it is read from:
no gap, no overlap). Both decide what commits with a Tally restored from the start states: the
Sequencer's decisions over the range they hold, without its ring or its replays.

**Limits, exactly.** With `maxMessagesPerTrigger` and/or `maxBytesPerTrigger` (the sum of the
delivered messages' frame sizes), a batch never holds more, unless it holds a single commit (one
transaction, or one message) that alone is larger: a transaction is never split. Commits are
taken across journals in the order of their Clocks. `Trigger.Once` reads everything available,
as Spark's API asks; `Trigger.AvailableNow` reads what was there when the query started, in
batches within the limits.

Rows: `journal, offset, end, producer, clock, flags, uuid, content, timestamp` (the UUID's
time). `readUncommitted=true` delivers every frame as written (acknowledgements and duplicates
included) and keeps only `at` per journal. Content lost from under the query (pruned, or a
journal reset) fails it with one line naming the range, unless `failOnDataLoss=false`, which
logs the range and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import heapq
import itertools
import json
import logging
import os
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from broker.client.journals import JournalsClient
from broker.client.reader import Chunk, ReadError, read_retrying, write_head
from broker.message.framing import CSVMessages, DictMessages, Frame, FrameReader, uuid_fields_of
from broker.message.sequencer import Envelope, JournalProducer, ProducerState
from broker.message.tally import REPLAY, Tally
from broker.message.uuid import TextParser, from_time
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.journals import JobError, known_options, size_in_bytes
from gazctl.spark.source import (
    BATCH_ROWS,
    _framing,
    _framing_of_journal,
    _uuid_decoder,
    _uuid_text_of,
    json_fields,
    uuid_columns,
    uuid_docs,
    uuid_texts,
    uuid_texts_of,
    with_json_columns,
    with_timestamp,
)
from spec.durations import DurationError, parse_duration, seconds_from_duration

log = logging.getLogger(__name__)

T = TypeVar("T")
OFFSET_VERSION = 1
NO_PRODUCER = bytes(6)
MAX_CLOCK = (1 << 63) - 1  # A row's `clock` is a LONG.
_new_tuple = tuple.__new__
_new_envelope = functools.partial(tuple.__new__, Envelope)  # Envelope._make, in C.
STREAM_SCHEMA = (
    "journal STRING, offset LONG, end LONG, producer STRING, clock LONG, flags INT, "
    "uuid STRING, content STRING, timestamp TIMESTAMP"
)
OPTIONS = (
    "selector", "broker", "file_root", "framing", "uuid_path", "bad_frames", "startingOffsets",
    "maxMessagesPerTrigger", "maxBytesPerTrigger", "readUncommitted", "failOnDataLoss",
    "maxReadAhead", "producerHorizon", "json_schema",
)  # fmt: skip
DEFAULT_READ_AHEAD = 64 << 20  # Content a planning read goes past a journal's offset, at most.
DEFAULT_HORIZON = 24 * 3600.0  # Producers idle this long are forgotten, as a consumer's are.
PARALLEL_JOURNALS = 16


# Options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Starting:
    """Where a query without a checkpoint starts: `earliest`, `latest`, per journal offsets
    (-2 earliest, -1 latest), or a time (unix seconds)."""

    kind: str  # earliest | latest | offsets | time
    offsets: tuple[tuple[str, int], ...] = ()
    time: float = 0.0


@dataclass(frozen=True)
class StreamOptions:
    selector: str
    broker: str
    file_root: str | None
    framing: str  # auto | lines | csv
    uuid_path: str
    bad_frames: str
    starting: Starting
    max_messages: int | None
    max_bytes: int | None
    read_uncommitted: bool
    fail_on_data_loss: bool
    read_ahead: int
    horizon: float
    json_schema: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> StreamOptions:
        """The options, checked: each problem is one JobError line naming the option."""
        given = known_options(options, OPTIONS, "the gazette stream source")
        selector = given.get("selector")
        if selector is None:
            raise JobError("the gazette stream source needs option selector (a label selector)")
        labels.parse_selector(selector)  # SelectorError (one line) if malformed.
        broker = given.get("broker") or os.environ.get("BROKER_ADDRESS", "")
        if not broker:
            raise JobError(
                "the gazette stream source needs option broker (or $BROKER_ADDRESS): a stream "
                "reads write heads and unpersisted content through brokers"
            )
        framing = given.get("framing", "none").lower()
        if framing not in ("auto", "lines", "csv"):
            raise JobError(
                f"option framing {framing!r}: the gazette stream source reads messages; give "
                "auto (by each journal's content-type), lines or csv"
            )
        json_fields(given.get("json_schema"))  # Checked now: one line, before Spark runs.
        bad_frames = given.get("bad_frames", "skip").lower()
        if bad_frames not in ("skip", "fail"):
            raise JobError(f"option bad_frames {bad_frames!r} is not skip or fail")
        return cls(
            selector=selector,
            broker=broker,
            file_root=given.get("file_root"),
            framing=framing,
            uuid_path=given.get("uuid_path", "_meta.uuid"),
            bad_frames=bad_frames,
            starting=parse_starting(given.get("startingOffsets", "earliest")),
            max_messages=_count(given, "maxMessagesPerTrigger"),
            max_bytes=_size(given, "maxBytesPerTrigger"),
            read_uncommitted=_flag(given, "readUncommitted", False),
            fail_on_data_loss=_flag(given, "failOnDataLoss", True),
            read_ahead=_size(given, "maxReadAhead") or DEFAULT_READ_AHEAD,
            horizon=_duration(given, "producerHorizon", DEFAULT_HORIZON),
            json_schema=given.get("json_schema"),
        )

    @property
    def limited(self) -> bool:
        return self.max_messages is not None or self.max_bytes is not None


def _count(given: dict[str, str], name: str) -> int | None:
    text = given.get(name)
    if text is None:
        return None
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) <= 0:
        raise JobError(f"option {name} {text!r} is not a positive number of messages")
    return int(text)


def _size(given: dict[str, str], name: str) -> int | None:
    text = given.get(name)
    if text is None:
        return None
    size = size_in_bytes(text)
    if size is None:
        raise JobError(f"option {name} {text!r} is not a size: give e.g. 4MiB, 1GiB or 1048576")
    return size


def _flag(given: dict[str, str], name: str, default: bool) -> bool:
    text = given.get(name)
    if text is None:
        return default
    if text.lower() not in ("true", "false"):
        raise JobError(f"option {name} {text!r} is not true or false")
    return text.lower() == "true"


def _duration(given: dict[str, str], name: str, default: float) -> float:
    text = given.get(name)
    if text is None:
        return default
    try:
        seconds = seconds_from_duration(parse_duration(text))
    except DurationError as exc:
        raise JobError(f"option {name} {text!r}: {exc}") from None
    if seconds < 0:
        raise JobError(f"option {name} {text!r} is negative: give a duration such as 24h")
    return seconds


def parse_starting(text: str) -> Starting:
    """`earliest`, `latest`, a JSON object of journal offsets, or a time: ISO 8601 with a zone
    (`2026-11-29T10:00:00Z`) or unix seconds."""
    word = text.strip()
    if word.lower() in ("earliest", "latest"):
        return Starting(word.lower())
    if word.startswith("{"):
        try:
            found = json.loads(word)
        except json.JSONDecodeError as exc:
            raise JobError(
                f"option startingOffsets is not valid JSON ({exc.msg} at character {exc.pos}): "
                'give e.g. {"events/part-000": 1024, "events/part-001": -2}'
            ) from None
        if not isinstance(found, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= -2 for v in found.values()
        ):
            raise JobError(
                "option startingOffsets: give a JSON object of journal names to offsets (an "
                "offset, -2 for the earliest or -1 for the latest)"
            )
        return Starting("offsets", tuple(sorted(found.items())))
    try:
        seconds = float(word)
    except ValueError:
        pass
    else:
        return Starting("time", time=_checked_time(text, seconds))
    try:
        when = datetime.fromisoformat(word.replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise JobError(
            f"option startingOffsets {text!r} is not earliest, latest, a JSON object of "
            "offsets, unix seconds, or an ISO 8601 time with a zone (2026-11-29T10:00:00Z)"
        )
    return Starting("time", time=_checked_time(text, when.timestamp()))


def _checked_time(text: str, seconds: float) -> float:
    try:
        from_time(seconds)
    except (ValueError, OverflowError) as exc:
        raise JobError(
            f"option startingOffsets {text!r} is not a time a UUID holds: {exc}"
        ) from None
    return seconds


# Offsets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """Where a journal is read through, and its producers' states there."""

    at: int
    rev: int
    states: tuple[tuple[bytes, int, int], ...] = ()  # (producer, last_ack, begin), sorted.

    def to_json(self) -> dict[str, Any]:
        # Keys in sorted order: Spark compares offsets as the JSON text Python writes.
        return {"at": self.at, "p": {p.hex(): [a, b] for p, a, b in self.states}, "rev": self.rev}

    @classmethod
    def from_json(cls, journal: str, found: Any) -> Position:
        try:
            states = tuple(
                sorted((bytes.fromhex(p), int(a), int(b)) for p, (a, b) in found["p"].items())
            )
            return cls(int(found["at"]), int(found["rev"]), states)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise JobError(
                f"the checkpoint's offset of journal {journal} is not one this source wrote: "
                "start the query with a new checkpoint location"
            ) from None

    def checkpoint(self, journal: str) -> dict[JournalProducer, ProducerState]:
        return {JournalProducer(journal, p): ProducerState(a, b) for p, a, b in self.states}

    @classmethod
    def of(cls, at: int, rev: int, states: Mapping[JournalProducer, ProducerState]) -> Position:
        return cls(
            at, rev, tuple(sorted((k.producer, s.last_ack, s.begin) for k, s in states.items()))
        )


@dataclass(frozen=True)
class StreamOffset:
    journals: dict[str, Position]
    # Journals deleted, or no longer selected, while read: where each was. One selected again
    # under the same create revision goes on from there (it was read that far).
    ended: dict[str, Position] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "ended": {name: self.ended[name].to_json() for name in sorted(self.ended)},
            "journals": {name: self.journals[name].to_json() for name in sorted(self.journals)},
            "v": OFFSET_VERSION,
        }

    @classmethod
    def from_json(cls, found: Mapping[str, Any]) -> StreamOffset:
        if not isinstance(found, Mapping) or found.get("v") != OFFSET_VERSION:
            raise JobError(
                "the checkpoint's offsets are not ones this gazette source writes (version "
                f"{found.get('v') if isinstance(found, Mapping) else None!r}, expected "
                f"{OFFSET_VERSION}): start the query with a new checkpoint location"
            )
        journals = {n: Position.from_json(n, p) for n, p in dict(found["journals"]).items()}
        ended = {n: Position.from_json(n, p) for n, p in dict(found.get("ended") or {}).items()}
        return cls(journals, ended)


# Reading: frames to envelopes -------------------------------------------------------------


@dataclass(frozen=True)
class Columns:
    """Messages as numpy columns: each one's frame [begin, end), producer (its 6-byte id as an
    integer, 0 without a UUID), Clock and flags."""

    begins: Any
    ends: Any
    nodes: Any
    clocks: Any
    flags: Any

    @classmethod
    def of(cls, envs: list[Envelope]) -> Columns:
        import numpy as np

        if not envs:
            return cls.joined([])
        _, begins, ends, producers, clocks, flags, _ = zip(*envs, strict=True)
        nodes = [int.from_bytes(p, "big") for p in producers]
        return cls(
            np.array(begins, np.int64), np.array(ends, np.int64), np.array(nodes, np.uint64),
            np.array(clocks, np.int64), np.array(flags, np.int32),
        )  # fmt: skip

    @classmethod
    def joined(cls, parts: list[Columns]) -> Columns:
        import numpy as np

        if len(parts) == 1:
            return parts[0]
        types = (np.int64, np.int64, np.uint64, np.int64, np.int32)
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts]).astype(t, copy=False)
                if parts
                else np.zeros(0, t)
                for f, t in zip(("begins", "ends", "nodes", "clocks", "flags"), types, strict=True)
            )
        )

    def take(self, index: Any) -> Columns:
        return Columns(
            self.begins[index], self.ends[index], self.nodes[index], self.clocks[index],
            self.flags[index],
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.begins)


class Decoder:
    """A frame's envelope: its UUID fields, and its content if `keep` (executors) or None (the
    planner, which only counts)."""

    def __init__(self, kind: str, uuid_path: str, keep: bool) -> None:
        self.kind = kind
        self.keep = keep
        self.framing = _framing(kind)
        self.dicts = DictMessages(tuple(uuid_path.split(".")))
        self.csv = CSVMessages()
        self.csv_fields = uuid_fields_of(self.csv)
        # JSON lines, a chunk's lines at once: msgspec decodes only their UUIDs, in C.
        self.uuids = _uuid_decoder(uuid_path) if kind == "lines" else None
        self.depth = len(uuid_path.split(".")) - 1
        self.parse = TextParser().fields

    def lines(
        self, journal: str, base: int, lines: list[bytes], bad: Callable[[int, str], None]
    ) -> list[Envelope]:
        """The envelopes of complete JSON lines (without their newlines) from offset `base`:
        all at once, or, when any is unusual (not JSON, an odd UUID), one at a time, which
        says why."""
        fast, docs = self._at_once(base, lines)
        if fast is None:
            return self._one_at_a_time(journal, base, lines, bad, docs)
        node_list = fast.nodes.tolist()
        ids = {node: node.to_bytes(6, "big") for node in set(node_list)}
        return list(
            map(
                _new_envelope,
                zip(
                    itertools.repeat(journal),
                    fast.begins.tolist(),
                    fast.ends.tolist(),
                    map(ids.__getitem__, node_list),
                    fast.clocks.tolist(),
                    fast.flags.tolist(),
                    lines if self.keep else itertools.repeat(None),
                ),
            )
        )

    def columns(
        self, journal: str, base: int, lines: list[bytes], bad: Callable[[int, str], None]
    ) -> Columns:
        """As `lines`, as columns (no envelope is made when all are decoded at once)."""
        fast, docs = self._at_once(base, lines)
        if fast is None:
            return Columns.of(self._one_at_a_time(journal, base, lines, bad, docs))
        return fast

    def _at_once(self, base: int, lines: list[bytes]) -> tuple[Columns | None, list[Any] | None]:
        """The lines' columns decoded all at once (msgspec, numpy), or None if any line is
        unusual; and their UUID documents, if each line is one."""
        import numpy as np

        assert self.uuids is not None
        docs = uuid_docs(self.uuids, lines)
        if docs is None:
            return None, None
        texts = uuid_texts_of(docs, self.depth)
        parsed = uuid_columns(texts) if None not in texts else None
        if parsed is None or (parsed[1] < 0).any():
            return None, docs  # (A Clock past a row's int64 is said one at a time.)
        nodes, clocks, flags = parsed
        sizes = np.fromiter(map(len, lines), np.int64, len(lines)) + 1
        ends = base + np.cumsum(sizes)
        return Columns(ends - sizes, ends, nodes, clocks, flags), docs

    def _one_at_a_time(
        self,
        journal: str,
        base: int,
        lines: list[bytes],
        bad: Callable[[int, str], None],
        docs: list[Any] | None,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        begin = base
        if docs is not None:
            keep, parse, depth, new = self.keep, self.parse, self.depth, _new_tuple
            try:
                for line, doc in zip(lines, docs, strict=True):
                    end = begin + len(line) + 1
                    text = _uuid_text_of(doc, depth)
                    if text is None:
                        fields: tuple[bytes, int, int] = (NO_PRODUCER, 0, 0)
                    else:
                        fields = parse(text)
                        if fields[1] > MAX_CLOCK:
                            raise ValueError(text)  # Said one frame at a time, below.
                    out.append(
                        new(Envelope, (journal, begin, end, *fields, line if keep else None))
                    )
                    begin = end
                return out
            except ValueError:
                out.clear()
                begin = base
        for line in lines:  # The one-frame-at-a-time path words what is wrong.
            end = begin + len(line) + 1
            env = self.envelope(journal, Frame(begin, end, line + b"\n"))
            if isinstance(env, str):
                bad(begin, env)
            else:
                out.append(env)
            begin = end
        return out

    def envelope(self, journal: str, frame: Frame) -> Envelope | str:
        """The frame's envelope, or why it cannot be read (a bad frame)."""
        if frame.error is not None:
            return frame.error
        payload = self.framing.unmarshal(frame)
        try:
            if self.kind == "lines":
                fields = self.dicts.decode_frame(payload)[1]
            else:
                fields = self.csv_fields(self.csv.decode(payload))
        except (ValueError, TypeError, KeyError) as exc:
            return f"cannot decode the message: {exc}"
        message = payload if self.keep else None
        if fields is not None and fields[1] > MAX_CLOCK:
            return (
                f"its UUID's Clock {fields[1]} is past what a row holds (a 64-bit signed "
                "integer: a time after the year 3400)"
            )
        if fields is None:
            return Envelope(journal, frame.offset, frame.end, NO_PRODUCER, 0, 0, message)
        return Envelope(journal, frame.offset, frame.end, *fields, message)


@dataclass
class Reading:
    """What a read of one journal needs: a broker, the store root, the data-loss rule."""

    broker: str
    file_root: str | None
    fail_on_data_loss: bool
    losses: list[tuple[int, int]] = field(default_factory=list)

    def hole(self, journal: str, begin: int, end: int) -> None:
        if self.fail_on_data_loss:
            raise JobError(
                f"journal {journal}: offsets [{begin}, {end}) are no longer held (pruned or "
                "lost); restart the query with option failOnDataLoss=false (gazctl: "
                "--no-fail-on-data-loss) to skip them"
            )
        if (begin, end) not in self.losses:
            log.warning("journal %s: offsets [%d, %d) are no longer held; skipped", journal,
                        begin, end)  # fmt: skip
            self.losses.append((begin, end))


async def chunks_of(
    client: JournalsClient,
    reading: Reading,
    journal: str,
    begin: int,
    end: int,
    *,
    first: bool = False,
) -> AsyncGenerator[Chunk, None]:
    """The journal's content [begin, end) (`end` 0: to the write head), a read chunk at a time.
    Persisted content is read from its store (the broker names the fragment), the rest through
    the broker; a broker that goes away mid-read is retried at the next offset. Content no
    longer held is a hole (`reading.hole`: a failure, or skipped), except with `first` (a
    journal read from its earliest) the content beginning past offset 0: the journal begins
    there. A fully suspended journal, or one deleted, ends the read."""
    root = None if reading.file_root is None else Path(reading.file_root)
    at = begin

    def on_hole(a: int, b: int) -> None:
        if not (first and a == begin == 0):
            reading.hole(journal, a, b)

    chunks = read_retrying(
        lambda: client.stub, journal, begin, block=False, end_offset=end, direct=True,
        file_root=root, on_hole=on_hole, wait=60.0,
    )  # fmt: skip
    # Closed here, whatever ends the read (a bad frame failing it, a consumer that stops):
    # left to the event loop's finalizer, a store read's generator was closed while running.
    async with contextlib.aclosing(cast(AsyncGenerator[Chunk, None], chunks)):
        try:
            async for chunk in chunks:
                at = chunk.offset + len(chunk.content)
                yield chunk
        except ReadError as exc:
            if exc.status == pb.SUSPENDED:
                return  # Fully suspended: its brokers hold nothing past its stores. Its end.
            if exc.status != pb.JOURNAL_NOT_FOUND:
                raise
            if end:  # A planned range of a journal deleted since: what it held is gone.
                reading.hole(journal, at, end)
            # (Planning: the journal is gone; the next listing ends its stream.)


async def envelopes(
    client: JournalsClient,
    reading: Reading,
    journal: str,
    decoder: Decoder,
    begin: int,
    end: int,
    *,
    bad: Callable[[int, str], None],
    first: bool = False,
) -> AsyncGenerator[tuple[list[Envelope], int, int], None]:
    """The envelopes of the frames in [begin, end) (`end` 0: to the write head), read as
    `chunks_of` reads, a chunk at a time: each list with the write head the chunk's response
    carried and the offset its frames end at (bad ones included)."""
    decoded = _decoded(client, reading, journal, decoder, begin, end, bad, first,
                       decoder.lines, _as_they_are)  # fmt: skip
    async with contextlib.aclosing(decoded):
        async for item in decoded:
            yield item


def _as_they_are(envs: list[Envelope]) -> list[Envelope]:
    return envs


async def columns(
    client: JournalsClient,
    reading: Reading,
    journal: str,
    decoder: Decoder,
    begin: int,
    end: int,
    *,
    bad: Callable[[int, str], None],
    first: bool = False,
) -> AsyncGenerator[tuple[Columns, int, int], None]:
    """As `envelopes`, each chunk's messages as columns."""
    decoded = _decoded(client, reading, journal, decoder, begin, end, bad, first,
                       decoder.columns, Columns.of)  # fmt: skip
    async with contextlib.aclosing(decoded):
        async for item in decoded:
            yield item


async def _decoded(
    client: JournalsClient,
    reading: Reading,
    journal: str,
    decoder: Decoder,
    begin: int,
    end: int,
    bad: Callable[[int, str], None],
    first: bool,
    lines_of: Callable[[str, int, list[bytes], Callable[[int, str], None]], T],
    framed: Callable[[list[Envelope]], T],
) -> AsyncGenerator[tuple[T, int, int], None]:
    frames = FrameReader(decoder.framing, begin)
    head, read_to = 0, begin
    read = chunks_of(client, reading, journal, begin, end, first=first)
    async with contextlib.aclosing(read):
        async for chunk in read:
            head = max(head, chunk.write_head)
            read_to = chunk.offset + len(chunk.content)
            if decoder.uuids is not None:
                errors, base, lines = frames.feed_lines(chunk.offset, chunk.content)
                for frame in errors:
                    bad(frame.offset, frame.error or "a partial frame")
                out = lines_of(journal, base, lines, bad) if lines else framed([])
            else:
                envs: list[Envelope] = []
                for frame in frames.feed(chunk.offset, chunk.content):
                    env = decoder.envelope(journal, frame)
                    if isinstance(env, str):
                        bad(frame.offset, env)
                    else:
                        envs.append(env)
                out = framed(envs)
            through = frames.offset if frames.offset is not None else begin
            yield out, head, through
    if end and read_to >= end:
        # A range the planner ended at a frame boundary, read whole: nothing is left over.
        for frame in frames.finish():
            bad(frame.offset, frame.error or "a partial frame at the end of the range")


async def head_of(client: JournalsClient, spec: pb.JournalSpec) -> int:
    """The journal's write head; a fully suspended journal's is where it was suspended."""
    try:
        return await write_head(client.stub, spec.name)
    except ReadError as exc:
        if exc.status != pb.SUSPENDED:
            raise
        return int(spec.suspend.offset)


# Planning (the driver) --------------------------------------------------------------------


@dataclass
class Event:
    """An envelope that committed rows: its Clock, the rows and frame bytes it delivered."""

    clock: int
    rows: int
    size: int
    at: int  # Where its envelope begins: a batch that leaves it out ends there.


@dataclass
class Scan:
    """A journal read from its position as far as planning needs: its commits, and what a
    batch ending at `through` delivers of it."""

    journal: str
    start: Position
    events: list[Event] = field(default_factory=list)
    through: int = 0  # Where the envelopes read end (a frame boundary).
    head: int = 0
    final: Position | None = None  # The state at `through`.
    plan: Plan | None = None  # The rows of [start.at, through).


def _past_newline(offset: int, length: int) -> int:
    return offset + length + 1


def tally_of(journal: str, start: Position) -> Tally:
    """What a Sequencer restored at `start` commits, for the envelopes read from there."""
    return Tally(journal, start.checkpoint(journal), start.at)


class Rows:
    """The rows a scan delivers, in delivery order: indices of the range's messages (held as
    columns, a chunk at a time), and messages read again from before the range."""

    def __init__(self) -> None:
        self.held: list[Columns] = []
        self.parts: list[Any] = []  # numpy arrays of indices, and Columns, in order.
        self._indices: list[int] = []  # The next part, while it grows.

    def hold(self, cols: Columns) -> None:
        self.held.append(cols)

    def add(self, indices: Any) -> None:
        """Rows by their indices (a list, or a numpy array)."""
        if isinstance(indices, list):
            self._indices += indices
        else:
            self._flush()
            self.parts.append(indices)

    def add_columns(self, cols: Columns) -> None:
        if len(cols):
            self._flush()
            self.parts.append(cols)

    def columns(self) -> Columns:
        self._flush()
        held = Columns.joined(self.held)
        return Columns.joined(
            [part if isinstance(part, Columns) else held.take(part) for part in self.parts]
        )

    def _flush(self) -> None:
        import numpy as np

        if self._indices:
            self.parts.append(np.array(self._indices, np.int64))
            self._indices = []


def position_of(tally: Tally, at: int, rev: int, horizon: float) -> Position:
    return Position.of(at, rev, pruned(tally.checkpoint(), horizon))


class Planner:
    """The driver's reads: journals listed, heads, scans and cuts (async; each call of the
    stream reader runs one in an event loop of its own)."""

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        self.selector = labels.rewrite_prefix_meta_label(labels.parse_selector(options.selector))

    async def listed(self, client: JournalsClient) -> dict[str, tuple[pb.JournalSpec, int]]:
        """The journals the selector matches now: name -> (spec, create revision)."""
        snapshot = await client.list(self.selector)
        out = {j.spec.name: (j.spec, int(j.create_revision)) for j in snapshot.journals}
        return dict(sorted(out.items()))

    def kind_of(self, spec: pb.JournalSpec) -> str:
        if self.options.framing != "auto":
            return self.options.framing
        kind = _framing_of_journal(spec)
        if kind == "fixed":
            raise JobError(
                f"journal {spec.name} holds fixed-framed protobuf, whose content is binary and "
                "carries no UUID: the gazette stream source reads JSON lines or CSV"
            )
        return kind

    def reading(self) -> Reading:
        o = self.options
        return Reading(o.broker, o.file_root, o.fail_on_data_loss)

    async def scan(
        self,
        client: JournalsClient,
        journal: str,
        kind: str,
        start: Position,
        bound: int,
        *,
        first: bool,
        exact: bool = False,
    ) -> Scan:
        """Read the journal from `start` (to `bound`, or its head if 0), deciding what commits
        with a Tally and recording each commit and the rows it delivers; stop past the limits
        or the read-ahead, unless `exact` (a range planned anew: read to `bound`)."""
        import numpy as np

        o = self.options
        out = Scan(journal, start, through=start.at, head=start.at)
        decoder = Decoder(kind, o.uuid_path, keep=False)
        reading = self.reading()
        bad: list[tuple[int, str]] = []  # Executors report them (or fail on them).
        tally = None if o.read_uncommitted else tally_of(journal, start)
        limited = o.limited and not exact
        rows = Rows()
        sizes: list[int] = []  # Of the range's messages, by index.
        taken = taken_bytes = 0  # The rows delivered, and their frames' bytes.
        stop = False
        async for cols, head, through in columns(
            client, reading, journal, decoder, start.at, bound,
            bad=lambda offset, why: bad.append((offset, why)), first=first,
        ):  # fmt: skip
            out.head = max(out.head, head)
            first_index = len(sizes)
            rows.hold(cols)
            sizes += (cols.ends - cols.begins).tolist()
            if not limited and tally is None:
                rows.add(np.arange(first_index, first_index + len(cols)))
                continue_at = len(cols)
            elif not limited and tally is not None and len(cols):
                # A run in order goes to the Tally at once.
                unique, which = np.unique(cols.nodes, return_inverse=True)
                producers = [node.to_bytes(6, "big") for node in unique.tolist()]
                found = tally.add_run(
                    first_index, producers, which, cols.clocks, cols.flags, cols.begins
                )
                if found is not None:
                    rows.add(found)
                continue_at = len(cols) if found is not None else 0
            else:
                continue_at = 0
            for index, (begin, end, node, clock, flags) in enumerate(
                zip(cols.begins[continue_at:].tolist(), cols.ends[continue_at:].tolist(),
                    cols.nodes[continue_at:].tolist(), cols.clocks[continue_at:].tolist(),
                    cols.flags[continue_at:].tolist(), strict=True),
                first_index + continue_at,
            ):  # fmt: skip
                out.through = end
                if tally is None:
                    rows.add([index])
                    n, size = 1, end - begin
                else:
                    n, size = await self._add(
                        tally, index, node, clock, flags, begin, rows, sizes, client, reading,
                        kind,
                    )  # fmt: skip
                    if not n:
                        continue
                if not limited:
                    continue
                out.events.append(Event(clock, n, size, begin))
                taken, taken_bytes = taken + n, taken_bytes + size
                if (o.max_messages is not None and taken > o.max_messages) or (
                    o.max_bytes is not None and taken_bytes > o.max_bytes
                ):
                    stop = True  # Nothing after this commit can join the batch.
                    break
            if stop:
                break
            out.through = through  # Bad frames after the last envelope included.
            if not exact and out.through - start.at >= o.read_ahead:
                break
        out.head = max(out.head, out.through)
        if tally is None:
            out.final = Position(out.through, start.rev)
        else:
            out.final = position_of(tally, out.through, start.rev, o.horizon)
        out.plan = Plan.of_columns(rows.columns(), [b for b in bad if b[0] < out.through])
        return out

    async def _add(
        self,
        tally: Tally,
        index: int,
        node: int,
        clock: int,
        flags: int,
        begin: int,
        rows: Rows,
        sizes: list[int],
        client: JournalsClient,
        reading: Reading,
        kind: str,
    ) -> tuple[int, int]:
        """Add one message to the Tally, and what it commits to `rows`: how many, and their
        frames' bytes."""
        found = tally.add(index, node.to_bytes(6, "big"), clock, flags, begin)
        if found is REPLAY:  # A span restored from the start position: read again first.
            _, b, e = tally.replay_range()
            again = Decoder(kind, self.options.uuid_path, keep=False)
            envs = [env async for env in _range_of(client, reading, tally.journal, again, b, e,
                                                   _ignore)]  # fmt: skip
            before, indices = tally.replayed(envs)
            rows.add_columns(Columns.of(before))
            rows.add(indices)
            size = sum(e.end - e.begin for e in before) + sum(map(sizes.__getitem__, indices))
            return len(before) + len(indices), size
        if not found:
            return 0, 0  # Nothing, or an ACK alone, committed.
        rows.add(found)
        return len(found), sum(map(sizes.__getitem__, found))

    async def boundary(
        self, client: JournalsClient, spec: pb.JournalSpec, at: int, head: int
    ) -> int:
        """The first message boundary at or after `at` (an offset inside a message would read
        its tail as a bad frame, and a CSV record's quotes the wrong way round): found by
        framing from the start of the fragment that holds `at`, a boundary of appends."""
        if at in (0, head):
            return at
        begin = 0
        try:
            listed = await client.stub.ListFragments(pb.FragmentsRequest(journal=spec.name))
            begin = max(
                (f.spec.begin for f in listed.fragments if f.spec.begin <= at < f.spec.end),
                default=0,
            )
        except grpc.aio.AioRpcError:
            pass  # From the journal's start, then: slower, as right.
        decoder = Decoder(self.kind_of(spec), self.options.uuid_path, keep=False)
        reading = Reading(self.options.broker, self.options.file_root, False)
        async for batch, _, through in envelopes(
            client, reading, spec.name, decoder, begin, head, bad=lambda o, r: None,
            first=begin == 0,
        ):  # fmt: skip
            for env in batch:
                if env.begin >= at:
                    return env.begin
            if through >= head:
                break
        return head

    async def start_of(
        self, client: JournalsClient, spec: pb.JournalSpec, rev: int, how: str, at: int = 0,
        when: float = 0.0,
    ) -> Position:  # fmt: skip
        """A journal's first position: at the earliest, at the write head, at an offset, or
        at the first message stamped at or after `when`."""
        if how == "earliest":
            return Position(0, rev)
        if how == "latest":
            return Position(await head_of(client, spec), rev)
        if how == "offset":
            head = await head_of(client, spec)
            if at > head:
                raise JobError(
                    f"option startingOffsets: journal {spec.name} offset {at} is past its write "
                    f"head {head}"
                )
            return Position(await self.boundary(client, spec, at, head), rev)
        # A time: the first message whose UUID time is at or after it.
        clock = from_time(when)
        decoder = Decoder(self.kind_of(spec), self.options.uuid_path, keep=False)
        reading = Reading(self.options.broker, self.options.file_root, False)
        head = 0
        async for batch, _, through in envelopes(
            client, reading, spec.name, decoder, 0, 0, bad=lambda o, r: None, first=True
        ):
            for env in batch:
                if env.clock >= clock:
                    return Position(env.begin, rev)
            head = through
        return Position(head, rev)


def pruned(
    states: Mapping[JournalProducer, ProducerState], horizon: float
) -> dict[JournalProducer, ProducerState]:
    """`states` without producers whose last ACK is more than `horizon` seconds older than the
    journal's newest, and which have no pending transaction (a pending one is kept, however
    old: forgetting it would drop the transaction its ACK commits later). A function of the
    states alone, so planning the same offset twice prunes the same way."""
    if not horizon:
        return dict(states)
    units = (round(horizon * 1e9) // 100) << 4  # Clock units: 100 ns ticks over 4 counter bits.
    newest: dict[str, int] = {}
    for key, state in states.items():
        newest[key.journal] = max(newest.get(key.journal, 0), state.last_ack)
    return {
        key: state
        for key, state in states.items()
        if state.begin != -1 or state.last_ack >= newest[key.journal] - units
    }


def choose_cuts(
    scans: list[Scan], max_rows: int | None, max_bytes: int | None
) -> dict[str, Event | None]:
    """Per journal, the first commit left out of the batch (None: none is):
    commits are taken across journals in Clock order while the batch stays within both
    limits; the first that does not fit ends the batch, unless the batch is empty, when it
    is taken alone."""
    rows_left = max_rows if max_rows is not None else 1 << 62
    bytes_left = max_bytes if max_bytes is not None else 1 << 62
    heap = [(scan.events[0].clock, i, 0) for i, scan in enumerate(scans) if scan.events]
    heapq.heapify(heap)
    taken: dict[int, int] = {}  # Scan -> events taken.
    empty = True
    while heap:
        _, i, k = heapq.heappop(heap)
        event = scans[i].events[k]
        fits = event.rows <= rows_left and event.size <= bytes_left
        if not fits and not empty:
            break
        taken[i] = k + 1
        rows_left -= event.rows
        bytes_left -= event.size
        empty = False
        if not fits:
            break  # An oversized commit, alone.
        if k + 1 < len(scans[i].events):
            heapq.heappush(heap, (scans[i].events[k + 1].clock, i, k + 1))
    out: dict[str, Event | None] = {}
    for i, scan in enumerate(scans):
        k = taken.get(i, 0)
        out[scan.journal] = scan.events[k] if k < len(scan.events) else None
    return out


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a while (then as it was): a range's
    envelopes are many young objects that live until the range is read, which the collector
    would traverse again and again (half an executor's time, measured); they hold no cycles,
    and what cycles the reading leaves are collected afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_async(coro: Any) -> Any:
    """Run a coroutine to completion in a fresh event loop (each call of Spark's is sync)."""
    return asyncio.run(coro)


# The stream reader ------------------------------------------------------------------------


@dataclass
class StreamPartition(InputPartition):
    """One journal's bytes [begin, end) and the rows the driver planned of them (pickled to the
    executor)."""

    journal: str
    begin: int
    end: int
    options: StreamOptions
    plan: Plan

    def __init__(
        self, journal: str, begin: int, end: int, options: StreamOptions, plan: Plan
    ) -> None:
        super().__init__((journal, begin, end))
        self.journal, self.begin, self.end, self.options, self.plan = (
            journal, begin, end, options, plan,
        )  # fmt: skip


class GazetteStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's driver-side calls, each sync: one instance serves a query's run."""

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        self.planner = Planner(options)
        self._initial: dict[str, Any] | None = None
        self._target: dict[str, int] | None = None  # AvailableNow: heads when it started.
        self._heads: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        self._told_ended: set[str] = set()
        # The last batch planned: journal -> (start, end offset, plan).
        self._planned: dict[str, tuple[Position, int, Plan]] = {}

    # Spark's calls.

    def initialOffset(self) -> dict[str, Any]:
        # Spark asks more than once; the answer must not move (a `latest` or a new journal).
        if self._initial is None:
            self._initial = run_async(self._initial_offset()).to_json()
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_messages is not None:
            return ReadMaxRows(self.options.max_messages)
        if self.options.max_bytes is not None:
            return ReadMaxBytes(self.options.max_bytes)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = run_async(self._heads_now())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begun = StreamOffset.from_json(start)
        with collection_paused():
            end = run_async(self._latest(begun, not isinstance(limit, ReadAllAvailable)))
        return start if end == begun else end.to_json()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return {"heads": dict(sorted(self._heads.items()))}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        begun, ended = StreamOffset.from_json(start), StreamOffset.from_json(end)
        ranges: dict[str, tuple[Position, int]] = {}
        for journal, to in ended.journals.items():
            s = begun.journals.get(journal) or begun.ended.get(journal)  # (Selected again.)
            if s is None or s.rev != to.rev:
                s = Position(0, to.rev)  # New, or made anew: from its earliest.
            if to.at > s.at:
                ranges[journal] = (s, to.at)
        plans = {
            journal: self._planned[journal][2]
            for journal, (s, at) in ranges.items()
            if self._planned.get(journal, (None, 0))[:2] == (s, at)
        }
        missing = sorted(set(ranges) - set(plans))
        if missing:  # Planned by a driver before this one (restarted): plan them again.
            kinds = {j: self._kinds.get(j) or self._kind(j) for j in missing}
            with collection_paused():
                plans.update(run_async(self._plans_again({j: ranges[j] for j in missing}, kinds)))
        return [
            StreamPartition(journal, s.at, at, self.options, plans[journal])
            for journal, (s, at) in ranges.items()
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, StreamPartition)
        with collection_paused():
            yield from drive(lambda: deliver(partition))

    def commit(self, end: dict[str, Any]) -> None:
        pass  # Nothing is held between batches: each call reads afresh.

    # The work.

    def _kind(self, journal: str) -> str:
        async def find() -> str:
            async with JournalsClient(self.options.broker) as client:
                listed = await self.planner.listed(client)
            if journal not in listed:
                return self.options.framing if self.options.framing != "auto" else "lines"
            return self.planner.kind_of(listed[journal][0])

        self._kinds[journal] = run_async(find())
        return self._kinds[journal]

    async def _plans_again(
        self, ranges: dict[str, tuple[Position, int]], kinds: dict[str, str]
    ) -> dict[str, Plan]:
        """The plans of ranges planned before: each read again from its start position to its
        end, which delivers what it did then (the same bytes, from the same states)."""
        async with JournalsClient(self.options.broker) as client:

            async def one(journal: str) -> tuple[str, Plan]:
                start, at = ranges[journal]
                scan = await self.planner.scan(
                    client, journal, kinds[journal], start, at, first=start.at == 0, exact=True
                )
                if scan.through < at:  # (failOnDataLoss=false: what was left of it.)
                    log.warning("journal %s: planning [%d, %d) again read to %d only", journal,
                                start.at, at, scan.through)  # fmt: skip
                assert scan.plan is not None
                return journal, scan.plan

            return dict(await _gathered([one(journal) for journal in sorted(ranges)]))

    async def _initial_offset(self) -> StreamOffset:
        starting = self.options.starting
        async with JournalsClient(self.options.broker) as client:
            listed = await self._listed(client, require=True)
            given = dict(starting.offsets)
            unknown = sorted(set(given) - set(listed))
            if unknown:
                raise JobError(
                    f"option startingOffsets names {unknown[0]}, which the selector "
                    f"{self.options.selector!r} does not match"
                )

            async def one(name: str) -> tuple[str, Position]:
                spec, rev = listed[name]
                if starting.kind == "offsets":
                    at = given.get(name, -2)
                    how = {-2: "earliest", -1: "latest"}.get(at, "offset")
                    return name, await self.planner.start_of(client, spec, rev, how, at)
                return name, await self.planner.start_of(
                    client, spec, rev, starting.kind, when=starting.time
                )

            found = await _gathered([one(name) for name in listed])
        return StreamOffset(dict(found))

    async def _listed(
        self, client: JournalsClient, require: bool = False
    ) -> dict[str, tuple[pb.JournalSpec, int]]:
        listed = await self.planner.listed(client)
        if require and not listed:
            raise JobError(
                f"no journals match the selector {self.options.selector!r} (asked broker "
                f"{self.options.broker})"
            )
        for name, (spec, _) in listed.items():
            self._kinds[name] = self.planner.kind_of(spec)
        return listed

    async def _heads_now(self) -> dict[str, int]:
        async with JournalsClient(self.options.broker) as client:
            listed = await self._listed(client)

            async def one(name: str) -> tuple[str, int]:
                return name, await head_of(client, listed[name][0])

            return dict(await _gathered([one(name) for name in listed]))

    async def _latest(self, begun: StreamOffset, limited: bool) -> StreamOffset:
        o = self.options
        async with JournalsClient(o.broker) as client:
            listed = await self._listed(client)
            ended = dict(begun.ended)
            starts: dict[str, tuple[Position, bool]] = {}  # -> (position, read from earliest)
            for name, pos in begun.journals.items():
                if name not in listed:
                    ended[name] = pos
                    if name not in self._told_ended:
                        self._told_ended.add(name)
                        log.warning("journal %s is gone (deleted, or no longer selected): its "
                                    "stream ends at offset %d", name, pos.at)  # fmt: skip
                    continue
                rev = listed[name][1]
                if rev != pos.rev:
                    if o.fail_on_data_loss:
                        raise JobError(
                            f"journal {name} was deleted and made anew (create revision {rev}, "
                            f"was {pos.rev}): offsets [0, {pos.at}) of the journal read are "
                            "gone; restart the query with option failOnDataLoss=false (gazctl: "
                            "--no-fail-on-data-loss) to read "
                            "the new journal from its earliest"
                        )
                    log.warning("journal %s was made anew: reading it from its earliest", name)
                    starts[name] = (Position(0, rev), True)
                else:
                    starts[name] = (pos, pos.at == 0)
            for name, (_, rev) in listed.items():
                if name not in begun.journals and (self._target is None or name in self._target):
                    was = ended.pop(name, None)
                    if was is not None and was.rev == rev:  # Selected again: on from there.
                        starts[name] = (was, was.at == 0)
                    else:
                        starts[name] = (Position(0, rev), True)  # New: from its earliest.

            async def one(name: str) -> Scan:
                pos, first = starts[name]
                bound = 0
                if self._target is not None:
                    bound = self._target.get(name, pos.at)
                    if bound <= pos.at:
                        return Scan(name, pos, [], pos.at, pos.at, pos, Plan.of([], []))
                return await self.planner.scan(
                    client, name, self._kinds[name], pos, bound, first=first
                )

            scans = await _gathered([one(name) for name in sorted(starts)])
            for scan in scans:
                self._heads[scan.journal] = scan.head
            cuts = choose_cuts(scans, o.max_messages, o.max_bytes) if limited and o.limited else {}

            async def cut(scan: Scan) -> Scan:
                """The scan, or, if the batch ends inside it, its range to there read again."""
                event = cuts.get(scan.journal)
                if event is None:
                    return scan
                return await self.planner.scan(
                    client, scan.journal, self._kinds[scan.journal], scan.start, event.at,
                    first=starts[scan.journal][1], exact=True,
                )  # fmt: skip

            scans = await _gathered([cut(scan) for scan in scans])
        positions: dict[str, Position] = {}
        self._planned = {}
        for scan in scans:
            assert scan.final is not None and scan.plan is not None
            positions[scan.journal] = scan.final
            if scan.final.at > scan.start.at:
                self._planned[scan.journal] = (scan.start, scan.final.at, scan.plan)
        return StreamOffset(positions, ended)


async def _gathered(coros: list[Any]) -> list[Any]:
    limit = asyncio.Semaphore(PARALLEL_JOURNALS)

    async def one(coro: Any) -> Any:
        async with limit:
            return await coro

    return list(await asyncio.gather(*(one(c) for c in coros)))


# Delivering (executors) -------------------------------------------------------------------


def drive(make: Callable[[], AsyncGenerator[T, None]]) -> Iterator[T]:
    """An async generator's items, synchronously, in an event loop of its own."""
    loop = asyncio.new_event_loop()
    agen = make()
    try:
        while True:
            try:
                item = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        loop.run_until_complete(agen.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@dataclass(frozen=True)
class Plan:
    """The rows a batch delivers of one journal, in delivery order, as the driver decided them
    (the executors only take their content): each row's frame [begin, end), its producer (an
    index into `ids`, the producers' 6-byte ids end to end), Clock and flags; and the bad
    frames the range holds (offset, why), which executors report, or fail on."""

    begins: Any  # numpy int64
    ends: Any  # numpy int64
    producers: Any  # numpy uint32
    ids: bytes
    clocks: Any  # numpy int64
    flags: Any  # numpy int32
    bad: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(cls, rows: list[Envelope], bad: list[tuple[int, str]]) -> Plan:
        return cls.of_columns(Columns.of(rows), bad)

    @classmethod
    def of_columns(cls, rows: Columns, bad: list[tuple[int, str]]) -> Plan:
        import numpy as np

        unique, which = np.unique(rows.nodes, return_inverse=True)
        ids = b"".join(node.to_bytes(6, "big") for node in unique.tolist())
        return cls(
            rows.begins, rows.ends, which.astype(np.uint32), ids, rows.clocks, rows.flags,
            tuple(bad),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.begins)


Special = tuple[list[int], list[bytes]]  # Rows around a hole, and their contents.


class Taker:
    """A plan's rows out of its range's bytes as they are read: each row once all the bytes up
    to its frame's end are read, in the plan's order; bytes kept only from the first frame a
    row not yet taken begins at (so a range costs the memory of its longest pending
    transaction, not its own)."""

    def __init__(self, plan: Plan, base: int) -> None:
        import numpy as np

        self.plan = plan
        self.reach = np.maximum.accumulate(plan.ends) if len(plan) else plan.ends
        self.need = np.minimum.accumulate(plan.begins[::-1])[::-1] if len(plan) else plan.begins
        self.buf = bytearray()
        self.base = base  # The offset of buf[0].
        self.next = 0  # The first row not yet taken.
        # Rows around a hole (failOnDataLoss=false): taken before it, or lost in it.
        self.early: dict[int, bytes] = {}
        self.lost: set[int] = set()

    @property
    def top(self) -> int:
        return self.base + len(self.buf)

    def feed(self, offset: int, content: bytes) -> Iterator[tuple[int, int, Special | None]]:
        """Hold the content read at `offset`; yield the rows it completes, at most BATCH_ROWS
        at a time: (first, stop, special), where special is None when the rows' frames are
        all held, and otherwise the rows a hole leaves and their contents."""
        import numpy as np

        if offset > self.top:
            self._skip(offset)
        elif offset < self.top:
            content = content[self.top - offset :]  # (Read again: a retried read.)
        self.buf += content
        stop = int(np.searchsorted(self.reach, self.top, side="right"))
        while self.next < stop:
            first = self.next
            self.next = min(stop, first + BATCH_ROWS)
            yield first, self.next, self._special(first, self.next)
        self._release()

    def rest(self) -> range:
        """The rows not yet taken (when the read is over: it ended short of them)."""
        return range(self.next, len(self.plan))

    def finish(self, end: int) -> Iterator[tuple[int, int, Special | None]]:
        """The read ended short of `end`, past the bytes read: the rows it leaves that are
        whole, as `feed` gives rows (those touching the bytes not read lost)."""
        if self.rest():
            self._skip(end)
            stop = len(self.plan)
            while self.next < stop:
                first = self.next
                self.next = min(stop, first + BATCH_ROWS)
                yield first, self.next, self._special(first, self.next)

    def contents(self, first: int, stop: int) -> Any:
        """The contents of rows [first, stop), all held, as an Arrow array: each frame without
        its trailing newline (as the framings unmarshal it), cut out in C."""
        import numpy as np
        import pyarrow as pa

        begins = self.plan.begins[first:stop] - self.base
        ends = self.plan.ends[first:stop] - self.base
        order = np.argsort(begins, kind="stable")
        begins, ends = begins[order], ends[order]
        low, high = int(begins[0]), int(ends.max())
        data = bytes(self.buf[low:high])
        chars = np.frombuffer(data, np.uint8)
        ends = ends - (chars[ends - low - 1] == ord("\n"))
        # Values alternate: a row's content, then what lies between it and the next row's.
        bounds = np.empty(2 * len(order), np.int64)
        bounds[0::2], bounds[1::2] = begins - low, ends - low
        spans = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), len(bounds) - 1, [None, pa.py_buffer(bounds), pa.py_buffer(data)]
        )
        where = np.empty(len(order), np.int64)
        where[order] = np.arange(0, 2 * len(order), 2)
        return spans.take(pa.array(where)).cast(pa.binary())

    def _special(self, first: int, stop: int) -> Special | None:
        if not (self.early or self.lost):
            return None
        rows: list[int] = []
        out: list[bytes] = []
        for row in range(first, stop):
            if row in self.lost:
                self.lost.discard(row)
                continue
            found = self.early.pop(row, None)
            if found is None:
                b, e = int(self.plan.begins[row]) - self.base, int(self.plan.ends[row]) - self.base
                found = bytes(self.buf[b:e])
            rows.append(row)
            out.append(found[:-1] if found.endswith(b"\n") else found)
        return rows, out

    def _skip(self, offset: int) -> None:
        """Bytes [top, offset) are a hole: rows whose frames it touches are lost, and rows
        already whole are taken now, before the bytes they need are let go."""
        top = self.top
        for row in range(self.next, len(self.plan)):
            b, e = int(self.plan.begins[row]), int(self.plan.ends[row])
            if b < offset and e > top:
                self.lost.add(row)
            elif e <= top and row not in self.lost and row not in self.early:
                self.early[row] = bytes(self.buf[b - self.base : e - self.base])
        self.buf = bytearray()
        self.base = offset

    def _release(self) -> None:
        """Let go of the bytes no row still to take needs, once they are at least half of
        those held (so each byte is moved at most a few times)."""
        cut = int(self.need[self.next]) if self.next < len(self.plan) else self.top
        drop = min(cut, self.top) - self.base
        if drop > 0 and drop * 2 >= len(self.buf):
            del self.buf[:drop]
            self.base += drop


async def deliver(part: StreamPartition) -> AsyncGenerator[Any, None]:
    """The partition's rows as Arrow batches: its plan's rows, their content read from the
    range (and, for a transaction begun before it, from where the transaction begins)."""
    o, plan = part.options, part.plan
    for offset, reason in plan.bad:
        message = f"journal {part.journal}: bad frame at offset {offset}: {reason}"
        if o.bad_frames == "fail":
            raise JobError(message)
        log.warning("%s (skipped)", message)
    if not len(plan):
        return
    reading = Reading(o.broker, o.file_root, o.fail_on_data_loss)
    schema, fields = stream_arrow_schema(), json_fields(o.json_schema)
    begin = min(part.begin, int(plan.begins.min()))
    taker = Taker(plan, begin)
    async with JournalsClient(o.broker) as client:
        read = chunks_of(client, reading, part.journal, begin, part.end, first=begin == 0)
        async with contextlib.aclosing(read):
            async for chunk in read:
                for first, stop, special in taker.feed(chunk.offset, chunk.content):
                    yield planned_batch(part.journal, taker, first, stop, special, schema, fields)
    if taker.rest():  # The range was planned, so it was there: now it is not.
        reading.hole(part.journal, taker.top, part.end)
        for first, stop, special in taker.finish(part.end):
            yield planned_batch(part.journal, taker, first, stop, special, schema, fields)


def planned_batch(
    journal: str,
    taker: Taker,
    first: int,
    stop: int,
    special: Special | None,
    schema: Any,
    fields: Any,
) -> Any:
    """Rows [first, stop) of the taker's plan as an Arrow batch of the stream schema, a column
    at a time (the UUID texts and producers formatted all at once, null where a message has no
    UUID); `special`, when given, names the rows a hole leaves, and their contents."""
    import numpy as np
    import pyarrow as pa

    plan = taker.plan
    if special is None:
        rows, content = np.arange(first, stop), taker.contents(first, stop)
    else:
        rows, content = np.array(special[0], np.int64), pa.array(special[1], pa.binary())
    table = np.frombuffer(plan.ids, np.uint8).reshape(-1, 6)
    clock, flag = plan.clocks[rows], plan.flags[rows]
    texts, hexes = uuid_texts(table[plan.producers[rows]].tobytes(), clock, flag)
    none = clock == 0
    mask = none if none.any() else None
    out = pa.RecordBatch.from_arrays(
        [
            pa.repeat(journal, len(rows)),
            pa.array(plan.begins[rows], pa.int64()),
            pa.array(plan.ends[rows], pa.int64()),
            pa.array(hexes, pa.binary(), mask=mask).cast(pa.string()),
            pa.array(clock, pa.int64()),
            pa.array(flag, pa.int32()),
            pa.array(texts, pa.binary(), mask=mask).cast(pa.string()),
            content.cast(pa.string()),
        ],
        schema=schema,
    )
    return with_json_columns(with_timestamp(out), fields)


def _ignore(offset: int, reason: str) -> None:
    """Bad frames the planner meets: executors report them (and fail on them when told)."""


async def _range_of(
    client: JournalsClient,
    reading: Reading,
    journal: str,
    decoder: Decoder,
    begin: int,
    end: int,
    bad: Callable[[int, str], None],
) -> AsyncIterator[Envelope]:
    async for envs, _, _ in envelopes(client, reading, journal, decoder, begin, end, bad=bad):
        for env in envs:
            yield env


def stream_arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("journal", pa.string()),
            pa.field("offset", pa.int64()),
            pa.field("end", pa.int64()),
            pa.field("producer", pa.string()),
            pa.field("clock", pa.int64()),
            pa.field("flags", pa.int32()),
            pa.field("uuid", pa.string()),
            pa.field("content", pa.string()),
        ]
    )
