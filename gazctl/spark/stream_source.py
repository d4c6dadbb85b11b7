"""`spark.readStream.format("gazette")`: journals as a Structured Streaming source, read-committed
and exact across micro-batches, restarts and retries.

    spark.readStream.format("gazette")
        .option("selector", "topic=events")        # the journals (new ones join as they appear)
        .option("broker", "http://127.0.0.1:8080") # else $BROKER_ADDRESS, as gazctl takes it
        .option("startingOffsets", "earliest")     # latest | {"journal": offset} | a time
        .option("maxMessagesPerTrigger", "10000")  # and/or maxBytesPerTrigger: never exceeded
        .load()

**Planned in the driver, taken in the executors.** Each micro-batch's end offset is a consumer
checkpoint per journal, and which messages it delivers is decided by the driver
(`gazctl.spark.stream_plan`, which says how and why it is exact). A partition is one journal's
byte range and its `Plan`: an executor reads the range, straight from the fragment stores where
it is persisted and through a broker past that (one byte range, wherever it is read from: no
gap, no overlap), and a `Taker` cuts each planned row's content out of the bytes, in the plan's
order.

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
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.columns import (
    BATCH_ROWS,
    json_fields,
    uuid_texts,
    with_json_columns,
    with_timestamp,
)
from gazctl.spark.journals import JobError
from gazctl.spark.planners import Scanners
from gazctl.spark.stream_plan import (
    Plan,
    Planner,
    Position,
    Reading,
    Scan,
    ScanJob,
    StreamOffset,
    StreamOptions,
    choose_cuts,
    chunks_of,
    collection_paused,
    gathered,
    head_of,
    log,
    run_async,
)

T = TypeVar("T")
STREAM_SCHEMA = (
    "journal STRING, offset LONG, end LONG, producer STRING, clock LONG, flags INT, "
    "uuid STRING, content STRING, timestamp TIMESTAMP"
)


# (Planning: the journal is gone; the next listing ends its stream.)


# The stream reader ------------------------------------------------------------------------


@dataclass
class StreamPartition(InputPartition):
    """One journal's bytes [begin, end), its create revision, and the rows the driver planned
    of them (pickled to the executor)."""

    journal: str
    begin: int
    end: int
    options: StreamOptions
    plan: Plan
    rev: int

    def __init__(
        self, journal: str, begin: int, end: int, options: StreamOptions, plan: Plan, rev: int
    ) -> None:
        super().__init__((journal, begin, end))
        self.journal, self.begin, self.end, self.options, self.plan, self.rev = (
            journal, begin, end, options, plan, rev,
        )  # fmt: skip


class GazetteStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's driver-side calls, each sync: one instance serves a query's run."""

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        self.planner = Planner(options)
        self.scanners = Scanners(self.planner)  # (Processes start when a batch needs them.)
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
            StreamPartition(journal, s.at, at, self.options, plans[journal], s.rev)
            for journal, (s, at) in ranges.items()
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, StreamPartition)
        with collection_paused():
            yield from drive(lambda: deliver(partition))

    def commit(self, end: dict[str, Any]) -> None:
        pass  # Nothing is held between batches: each call reads afresh.

    def stop(self) -> None:
        self.scanners.close()

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
        jobs = [
            ScanJob(journal, kinds[journal], start, at, start.at == 0, exact=True)
            for journal, (start, at) in sorted(ranges.items())
        ]
        async with JournalsClient(self.options.broker) as client:
            scans = await self.scanners.run(client, jobs, sum(j.bound - j.start.at for j in jobs))
        plans: dict[str, Plan] = {}
        for scan in scans:
            start, at = ranges[scan.journal]
            if scan.through < at:  # (failOnDataLoss=false: what was left of it.)
                log.warning("journal %s: planning [%d, %d) again read to %d only", scan.journal,
                            start.at, at, scan.through)  # fmt: skip
            assert scan.plan is not None
            plans[scan.journal] = scan.plan
        return plans

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

            found = await gathered([one(name) for name in listed])
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

            return dict(await gathered([one(name) for name in listed]))

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

            done: dict[str, Scan] = {}  # AvailableNow: journals already at their target.
            jobs: list[ScanJob] = []
            for name in sorted(starts):
                pos, first = starts[name]
                bound = 0
                if self._target is not None:
                    bound = self._target.get(name, pos.at)
                    if bound <= pos.at:
                        done[name] = Scan.nothing(name, pos, pos.at)
                        continue
                jobs.append(ScanJob(name, self._kinds[name], pos, bound, first, limited=limited))
            pending = 0
            if self.scanners.may_run_apart(jobs):  # Enough to read to pay for it? Ask.
                heads = await gathered([head_of(client, listed[j.journal][0]) for j in jobs])
                pending = sum(
                    min(o.read_ahead, max(0, (j.bound or head) - j.start.at))
                    for j, head in zip(jobs, heads, strict=True)
                )
            for scan in await self.scanners.run(client, jobs, pending):
                done[scan.journal] = scan
            scans = [done[name] for name in sorted(done)]
            for scan in scans:
                self._heads[scan.journal] = scan.head
            cuts = choose_cuts(scans, o.max_messages, o.max_bytes) if limited and o.limited else {}
            # A batch that ends inside a journal: its range to there, read again; one that ends
            # at its start holds nothing of it (a bound of 0 would read to the write head).
            again = []
            for scan in scans:
                event = cuts.get(scan.journal)
                if event is None:
                    continue
                if event.at <= scan.start.at:
                    done[scan.journal] = Scan.nothing(scan.journal, scan.start, scan.head)
                    continue
                again.append(ScanJob(scan.journal, self._kinds[scan.journal], scan.start,
                                     event.at, starts[scan.journal][1], exact=True))  # fmt: skip
            pending = sum(j.bound - j.start.at for j in again)
            for scan in await self.scanners.run(client, again, pending):
                done[scan.journal] = scan
            scans = [done[name] for name in sorted(done)]
        positions: dict[str, Position] = {}
        self._planned = {}
        for scan in scans:
            assert scan.final is not None and scan.plan is not None
            positions[scan.journal] = scan.final
            if scan.final.at > scan.start.at:
                self._planned[scan.journal] = (scan.start, scan.final.at, scan.plan)
        return StreamOffset(positions, ended)


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
    # From the first planned row's frame: every byte read was there when the batch was planned,
    # so any hole is a loss (a journal that begins past offset 0 included).
    begin = int(plan.begins.min())
    taker = Taker(plan, begin)
    async with JournalsClient(o.broker) as client:
        if not await _planned_journal(client, part, reading, begin):
            return  # Gone, or made anew: skipped (failOnDataLoss=false).
        read = chunks_of(client, reading, part.journal, begin, part.end)
        async with contextlib.aclosing(read):
            async for chunk in read:
                for first, stop, special in taker.feed(chunk.offset, chunk.content):
                    yield planned_batch(part.journal, taker, first, stop, special, schema, fields)
        await _planned_journal(client, part, reading, begin, after=True)
    if taker.rest():  # The range was planned, so it was there: now it is not.
        reading.hole(part.journal, taker.top, part.end)
        for first, stop, special in taker.finish(part.end):
            yield planned_batch(part.journal, taker, first, stop, special, schema, fields)


async def _planned_journal(
    client: JournalsClient, part: StreamPartition, reading: Reading, begin: int, after: bool = False
) -> bool:
    """Whether the journal is the one the batch was planned on (its create revision): a journal
    deleted, or made anew under its name, holds none of the planned bytes. Before reading: a
    loss (`reading.hole`: a failure, or False to skip the rows). After reading: the rows given
    may be pieces of the new journal's, so the task fails, and its retry finds it before."""
    name = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=part.journal)]))
    listed = await client.list(name)
    rev = next((int(j.create_revision) for j in listed.journals if j.spec.name == part.journal), 0)
    if rev == part.rev:
        return True
    if after:
        raise JobError(
            f"journal {part.journal} was deleted or made anew while offsets [{begin}, "
            f"{part.end}) of it were read: the task fails, and its retry skips or fails them"
        )
    reading.hole(part.journal, begin, part.end)
    return False


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
