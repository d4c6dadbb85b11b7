"""The stream source's planning, in the driver: its options and offsets, reading journals'
messages as columns, and deciding each micro-batch (`Planner.scan`, `choose_cuts`): where it ends
in each journal, and which messages it delivers (a `Plan` per journal, for the executors). Free of
PySpark: `gazctl.spark.stream_source` adapts it to Spark's calls.

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

**The driver plans, executors take.** End offsets must be in Spark's offset log before a batch
runs, and the limits count messages delivered, so the driver reads each journal from its offset
(UUIDs and frame sizes; content is not kept), decides what commits with a Tally restored from
the start states (the Sequencer's decisions over the range it holds, a run of in-order messages
at once), and cuts it. What the batch delivers of each journal rides to the executors as a
`Plan`: each row's frame, producer, Clock and flags, in delivery order. A driver restarted after
writing an offset plans the batch again from its start offset: the same bytes, the same states,
so the same plan.

**Limits, exactly.** With `maxMessagesPerTrigger` and/or `maxBytesPerTrigger` (the sum of the
delivered messages' frame sizes), a batch never holds more, unless it holds a single commit (one
transaction, or one message) that alone is larger: a transaction is never split. Commits are
taken across journals in the order of their Clocks.
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
from typing import Any, TypeVar

import grpc

from broker.client.journals import JournalsClient
from broker.client.reader import Chunk, ReadError, read_retrying, write_head
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.columns import (
    framing_of_journal,
    framing_of_kind,
    json_fields,
    uuid_columns,
    uuid_decoder,
    uuid_docs,
    uuid_text_of,
    uuid_texts_of,
)
from gazctl.spark.journals import JobError, known_options, size_in_bytes
from message.framing import Frame, FrameReader
from message.sequencer import Envelope, JournalProducer, ProducerState
from message.tally import REPLAY, Tally
from message.types import CSVMessages, DictMessages, uuid_fields_of
from message.uuid import TextParser, from_time
from spec.durations import DurationError, parse_duration, seconds_from_duration

T = TypeVar("T")

log = logging.getLogger(__name__)


OFFSET_VERSION = 1


NO_PRODUCER = bytes(6)


MAX_CLOCK = (1 << 63) - 1  # A row's `clock` is a LONG.


_new_tuple = tuple.__new__


_new_envelope = functools.partial(tuple.__new__, Envelope)  # Envelope._make, in C.


OPTIONS = (
    "selector", "broker", "file_root", "framing", "uuid_path", "bad_frames", "startingOffsets",
    "maxMessagesPerTrigger", "maxBytesPerTrigger", "readUncommitted", "failOnDataLoss",
    "maxReadAhead", "producerHorizon", "json_schema", "planningProcesses",
)  # fmt: skip


DEFAULT_READ_AHEAD = 64 << 20  # Content a planning read goes past a journal's offset, at most.


DEFAULT_HORIZON = 24 * 3600.0  # Producers idle this long are forgotten, as a consumer's are.


PARALLEL_JOURNALS = 16


# Options --------------------------------------------------------------------------------------


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
    planning_processes: int = 1

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
            planning_processes=_count(given, "planningProcesses", "processes")
            or min(os.cpu_count() or 1, 8),
        )

    @property
    def limited(self) -> bool:
        return self.max_messages is not None or self.max_bytes is not None


def _count(given: dict[str, str], name: str, what: str = "messages") -> int | None:
    text = given.get(name)
    if text is None:
        return None
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) <= 0:
        raise JobError(f"option {name} {text!r} is not a positive number of {what}")
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


# Offsets --------------------------------------------------------------------------------------


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


# Reading: frames to messages ------------------------------------------------------------------


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
        self.framing = framing_of_kind(kind)
        self.dicts = DictMessages(tuple(uuid_path.split(".")))
        self.csv = CSVMessages()
        self.csv_fields = uuid_fields_of(self.csv)
        # JSON lines, a chunk's lines at once: msgspec decodes only their UUIDs, in C.
        self.uuids = uuid_decoder(uuid_path) if kind == "lines" else None
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
                    text = uuid_text_of(doc, depth)
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
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
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
    async with contextlib.aclosing(chunks):
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


def envelopes(
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
    return _decoded(client, reading, journal, decoder, begin, end, bad, first, decoder.lines,
                    _as_they_are)  # fmt: skip


def _as_they_are(envs: list[Envelope]) -> list[Envelope]:
    return envs


def columns(
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
    return _decoded(client, reading, journal, decoder, begin, end, bad, first, decoder.columns,
                    Columns.of)  # fmt: skip


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


# Planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanJob:
    """One journal to scan: `Planner.scan`'s arguments."""

    journal: str
    kind: str
    start: Position
    bound: int
    first: bool
    exact: bool = False
    limited: bool = True  # False: Spark asked for all there is (Trigger.Once): no limits.


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

    @classmethod
    def nothing(cls, journal: str, start: Position, head: int) -> Scan:
        """A journal the batch takes nothing of: it stays at `start`."""
        return cls(journal, start, [], start.at, head, start, Plan.of([], []))


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
        kind = framing_of_journal(spec)
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
        limited: bool = True,
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
        limited = limited and o.limited and not exact
        rows = Rows()
        held = 0  # Messages read so far: the next chunk's first index.
        sizes: list[int] | None = [] if limited else None  # Of those messages, for the limits.
        taken = taken_bytes = 0  # The rows delivered, and their frames' bytes.
        stop = False
        async for cols, head, through in columns(
            client, reading, journal, decoder, start.at, bound,
            bad=lambda offset, why: bad.append((offset, why)), first=first,
        ):  # fmt: skip
            out.head = max(out.head, head)
            first_index, held = held, held + len(cols)
            rows.hold(cols)
            if sizes is not None:
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
        sizes: list[int] | None,
        client: JournalsClient,
        reading: Reading,
        kind: str,
    ) -> tuple[int, int]:
        """Add one message to the Tally, and what it commits to `rows`: how many, and their
        frames' bytes (0 without `sizes`: no limit counts them)."""
        found = tally.add(index, node.to_bytes(6, "big"), clock, flags, begin)
        if found is REPLAY:  # A span restored from the start position: read again first.
            _, b, e = tally.replay_range()
            again = Decoder(kind, self.options.uuid_path, keep=False)
            envs = [env async for env in _range_of(client, reading, tally.journal, again, b, e,
                                                   _ignore)]  # fmt: skip
            before, indices = tally.replayed(envs)
            rows.add_columns(Columns.of(before))
            rows.add(indices)
            size = 0
            if sizes is not None:
                size = sum(e.end - e.begin for e in before) + sum(map(sizes.__getitem__, indices))
            return len(before) + len(indices), size
        if not found:
            return 0, 0  # Nothing, or an ACK alone, committed.
        rows.add(found)
        return len(found), sum(map(sizes.__getitem__, found)) if sizes is not None else 0

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


async def gathered(coros: list[Any]) -> list[Any]:
    limit = asyncio.Semaphore(PARALLEL_JOURNALS)

    async def one(coro: Any) -> Any:
        async with limit:
            return await coro

    return list(await asyncio.gather(*(one(c) for c in coros)))


# What a batch delivers ------------------------------------------------------------------------


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
