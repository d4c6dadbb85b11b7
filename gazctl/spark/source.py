"""`gazette`: a PySpark data source over journal fragments, read straight from their stores.

    spark.read.format("gazette")
        .option("selector", "prefix=events/")       # the journals to read (a label selector)
        .option("broker", "http://127.0.0.1:8080")  # where to list them, or:
        .option("specs", "specs.yaml")              # ... a specs file, and no broker at all
        .option("file_root", "/var/gazette")        # roots file:// stores (as --broker.file-root)
        .option("framing", "lines")                 # none (default) | lines | csv | auto
        .load()

Planning (on the driver) lists each journal's persisted fragments in its first store, keeps the
covering ones (a larger fragment wins over those it covers), skips those persisted before
`from_time` (unix seconds), and makes one input partition per fragment, or, with a framing, several
of about `split_bytes` (default 128 MiB) each for a larger fragment. A split holds the messages
whose frames begin in its byte range, so every message belongs to exactly one split. A task reads
its fragment from the store, decompresses it and checks its SHA-1 against its name (of a split
fragment, the last split checks it); a fragment that does not match fails the job, naming the
fragment, rather than yield wrong rows.

Without a framing, rows are blocks of content: ``journal, begin, end`` (the fragment's offsets),
``offset`` (the block's), ``content`` (binary). With one, rows are messages: ``journal,
offset, end`` (the message's frame), ``producer`` (12 hex digits), ``clock``, ``flags``,
``uuid`` (null, with clock 0, for a message without one), ``content`` (the JSON document or CSV
record as text, without its newline; the payload bytes for fixed protobuf, which carries no UUID
the source can see). `auto` picks the framing from each journal's content-type label.

Frames that cannot be read (corrupt or truncated) are skipped and logged, as the read-uncommitted
iterator does, unless option `bad_frames` is `fail`. Fragments are framed independently: a
message split across two fragments (only raw appends of partial frames make one) is reported as
two bad frames. Clocks are read as signed 64-bit longs, which hold every Clock until the year 3400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any, cast

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
)

from broker.fragment.content import describe
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.columns import (
    BATCH_ROWS,
    framing_of_journal,
    framing_of_kind,
    hex_ids,
    json_fields,
    uuid_columns,
    uuid_decoder,
    uuid_docs,
    uuid_texts_of,
    with_json_columns,
    with_timestamp,
)
from gazctl.spark.journals import (
    JobError,
    covering,
    listed_fragments,
    open_store_of,
    read_from,
    read_verified,
    select_journals,
)
from message.framing import Frame, FrameReader, JSONLines
from message.types import CSVMessages, DictMessages, UUIDFields, uuid_fields_of
from message.uuid import TextParser, text_of

log = logging.getLogger(__name__)

RAW_SCHEMA = "journal STRING, begin LONG, end LONG, offset LONG, content BINARY"
MESSAGE_COLUMNS = (
    "journal STRING, offset LONG, end LONG, producer STRING, clock LONG, flags INT, uuid STRING"
)
FRAMINGS = ("none", "lines", "csv", "fixed", "auto")
SPLIT_BYTES = 128 << 20  # As Spark's spark.sql.files.maxPartitionBytes.


def message_schema(binary: bool) -> str:
    return f"{MESSAGE_COLUMNS}, content {'BINARY' if binary else 'STRING'}"


@dataclass
class FragmentPartition(InputPartition):
    """A fragment, or a split of one, to read, with what reading it needs (pickled to the
    executor). A split holds the messages whose frames begin in [begin, end): it starts at the
    first frame boundary at or after `begin` and ends at the first at or after `end`."""

    fragment: bytes  # A serialized pb.Fragment.
    framing: str  # none | lines | csv | fixed
    file_root: str | None
    uuid_path: str
    bad_frames: str
    begin: int  # The split's offsets: the fragment's own when it is read whole.
    end: int

    def __init__(
        self,
        fragment: bytes,
        framing: str,
        file_root: str | None,
        uuid_path: str,
        bad_frames: str,
        begin: int,
        end: int,
    ) -> None:
        super().__init__((fragment, begin))
        self.fragment = fragment
        self.framing = framing
        self.file_root = file_root
        self.uuid_path = uuid_path
        self.bad_frames = bad_frames
        self.begin = begin
        self.end = end


def split_offsets(begin: int, end: int, split_bytes: int) -> list[int]:
    """Where the splits of content [begin, end) start, each about `split_bytes` (at most)."""
    count = max(1, -(-(end - begin) // split_bytes))
    return [begin + (end - begin) * i // count for i in range(count)]


def _option(options: Any, name: str, default: str | None = None) -> str | None:
    value = options.get(name)
    return default if value in (None, "") else str(value)


def _framing_name(options: Any) -> str:
    framing = (_option(options, "framing", "none") or "none").lower()
    if framing not in FRAMINGS:
        raise JobError(f"framing {framing!r} is not one of {', '.join(FRAMINGS)}")
    return framing


class GazetteDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "gazette"

    def schema(self) -> str:
        # Spark asks the same for a batch read and a stream (it cannot tell which).
        framing = _framing_name(self.options)
        if framing == "none":
            return RAW_SCHEMA
        out = f"{message_schema(binary=framing == 'fixed')}, timestamp TIMESTAMP"
        fields = json_fields(_option(self.options, "json_schema"))
        if fields and framing in ("csv", "fixed"):
            raise JobError(f"option json_schema parses JSON messages: framing {framing} has none")
        return out + "".join(f", {name} {kind}" for name, kind in fields)

    def reader(self, schema: Any) -> DataSourceReader:
        return GazetteReader(self.options)

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
        from gazctl.spark.stream_sink import GazetteStreamWriter

        return GazetteStreamWriter.create(self.options, schema, overwrite)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        from gazctl.spark.stream_plan import StreamOptions
        from gazctl.spark.stream_source import GazetteStreamReader

        if "timestamp" not in schema.fieldNames():
            raise JobError(
                "the gazette stream source reads messages: give option framing (auto, by each "
                "journal's content-type; lines; or csv)"
            )
        return GazetteStreamReader(StreamOptions.parse(self.options))


class GazetteReader(DataSourceReader):
    def __init__(self, options: Any) -> None:
        self.options = dict(options)

    def partitions(self) -> Sequence[InputPartition]:
        options = self.options
        selector = _option(options, "selector")
        if selector is None:
            raise JobError("the gazette data source needs option selector (a label selector)")
        specs = _option(options, "specs")
        root = _option(options, "file_root")
        framing = _framing_name(options)
        from_time = float(_option(options, "from_time", "0") or 0)
        split_bytes = int(_option(options, "split_bytes", str(SPLIT_BYTES)) or SPLIT_BYTES)
        if split_bytes <= 0:
            raise JobError(f"split_bytes must be positive, not {split_bytes}")
        journals = select_journals(
            selector,
            broker=_option(options, "broker"),
            specs=Path(specs) if specs is not None else None,
        )
        out: list[InputPartition] = []
        for spec in journals:
            kind = framing_of_journal(spec) if framing == "auto" else framing
            if framing == "auto" and kind == "fixed":
                raise JobError(
                    f"journal {spec.name} holds fixed-framed protobuf, whose content is binary: "
                    "read it with framing fixed, apart from text journals"
                )
            fragments, _ = covering(listed_fragments(spec, Path(root) if root else None))
            for fragment in fragments:
                if from_time and fragment.mod_time < from_time:
                    continue
                # Raw blocks have no message boundaries to split at.
                size = split_bytes if kind != "none" else fragment.end - fragment.begin + 1
                starts = split_offsets(fragment.begin, fragment.end, size)
                for begin, end in zip(starts, [*starts[1:], fragment.end], strict=True):
                    out.append(
                        FragmentPartition(
                            fragment.SerializeToString(),
                            kind,
                            root,
                            _option(options, "uuid_path", "_meta.uuid") or "_meta.uuid",
                            (_option(options, "bad_frames", "skip") or "skip").lower(),
                            begin,
                            end,
                        )
                    )
        return out

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if not isinstance(partition, FragmentPartition):
            return  # No fragments planned: Spark still reads one (empty) partition.
        batches = self._read(partition)
        if partition.framing == "none":
            yield from batches
            return
        fields = json_fields(_option(self.options, "json_schema"))
        for batch in batches:
            yield with_json_columns(with_timestamp(batch), fields)

    def _read(self, partition: FragmentPartition) -> Iterator[Any]:
        import pyarrow as pa

        fragment = pb.Fragment.FromString(partition.fragment)
        root = Path(partition.file_root) if partition.file_root else None
        store = open_store_of(fragment.backing_store, root)
        if partition.begin > fragment.begin or partition.end < fragment.end:
            yield from _split_batches(store, fragment, partition)
            return
        blocks = read_verified(store, fragment)
        if partition.framing == "none":
            at = fragment.begin
            for block in blocks:
                yield pa.RecordBatch.from_pydict(
                    {
                        "journal": [fragment.journal],
                        "begin": [fragment.begin],
                        "end": [fragment.end],
                        "offset": [at],
                        "content": [block],
                    },
                    schema=_arrow_schema(RAW_SCHEMA),
                )
                at += len(block)
            return
        if partition.framing == "lines":
            yield from _json_line_batches(fragment, blocks, partition, fragment.begin)
        else:
            frames = _frames_of(blocks, partition.framing, fragment.begin)
            yield from _message_batches(fragment, frames, partition)


def _split_batches(
    store: Any, fragment: pb.Fragment, partition: FragmentPartition
) -> Iterator[Any]:
    """The messages of a split: those whose frames begin in [partition.begin, partition.end).
    The last split reads the fragment whole, to check its SHA-1 (the others stop at their end
    and are not checked on their own: the job fails with the last). JSON lines start reading
    just before the split (a boundary follows a newline); other framings are framed from the
    fragment's begin, their frames before the split read and dropped."""
    last = partition.end >= fragment.end
    if partition.framing == "lines":
        start = fragment.begin if last else max(fragment.begin, partition.begin - 1)
        blocks = read_from(store, fragment, start, verify=last)
        span = _line_span(blocks, start, partition.begin, partition.end, fragment)
        at = next(span, None)
        if at is not None:
            yield from _json_line_batches(fragment, span, partition, at)
        return
    blocks = read_from(store, fragment, fragment.begin, verify=last)
    frames = _frames_of(blocks, partition.framing, fragment.begin)
    inside: Iterator[Frame] = (f for f in frames if f.offset >= partition.begin)
    if not last:  # Frames are read no further than the split.
        inside = takewhile(lambda f: f.offset < partition.end, inside)
    yield from _message_batches(fragment, inside, partition)


def _line_span(
    blocks: Iterator[bytes], at: int, begin: int, end: int, fragment: pb.Fragment
) -> Iterator[Any]:
    """Content of JSON lines (read from offset `at`) from the first line boundary at or after
    `begin` to the first at or after `end`: first that boundary's offset (nothing for an empty
    span), then the content's blocks. A boundary is the fragment's begin or end, or follows a
    newline."""
    start: int | None = begin if begin <= fragment.begin else None
    started = False
    for block in blocks:
        block_at, at = at, at + len(block)
        if start is None:
            found = block.find(b"\n", max(0, begin - 1 - block_at))
            if found < 0:
                continue
            start = block_at + found + 1
            if start >= end:
                return  # No frame begins in the split.
        if not started:
            started = True
            yield start
        first = max(0, start - block_at)
        # The end boundary follows the first newline at or after end - 1 (start <= end - 1).
        found = block.find(b"\n", max(0, end - 1 - block_at)) if end < fragment.end else -1
        if found >= 0:
            if found + 1 > first:
                yield block[first : found + 1]
            return
        if first < len(block):
            yield block[first:] if first else block


def _arrow_schema(ddl: str) -> Any:
    import pyarrow as pa

    types = {"STRING": pa.string(), "LONG": pa.int64(), "INT": pa.int32(), "BINARY": pa.binary()}
    fields = []
    for column in ddl.split(","):
        name, kind = column.split()
        fields.append(pa.field(name, types[kind]))
    return pa.schema(fields)


def _json_line_batches(
    fragment: pb.Fragment, blocks: Iterator[bytes], partition: FragmentPartition, at: int
) -> Iterator[Any]:
    """JSON lines a batch of lines at a time: lines cut in C, their UUIDs decoded by msgspec in
    one call per batch (nothing else of the documents), columns built by Arrow. A batch holding
    anything unusual (a bad line, an odd UUID) goes through the per-frame path instead."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = _arrow_schema(message_schema(False))
    decoder = uuid_decoder(partition.uuid_path)
    depth = len(partition.uuid_path.split(".")) - 1
    parse = TextParser().fields
    reader = FrameReader(JSONLines())
    for block in blocks:
        errors, base, lines = reader.feed_lines(at, block)
        at += len(block)
        if errors:
            yield from _message_batches(fragment, errors, partition)
        if not lines:
            continue
        docs = uuid_docs(decoder, lines)
        fields = _fast_fields(docs, depth, parse) if docs is not None else None
        if fields is None:  # The per-frame path finds and reports what is unusual.
            frames = []
            begin = base
            for line in lines:
                frames.append(Frame(begin, begin + len(line) + 1, line + b"\n"))
                begin += len(line) + 1
            yield from _message_batches(fragment, frames, partition)
            continue
        producers, clocks, flags, texts = fields
        content = pa.array(lines, pa.binary())
        sizes = pc.add(pc.binary_length(content), 1)
        ends = pc.add(pc.cumulative_sum(sizes), base)
        yield pa.RecordBatch.from_arrays(
            [
                pa.array([fragment.journal] * len(lines), pa.string()),
                pc.subtract(ends, sizes),
                ends,
                pa.array(producers, pa.string()),
                pa.array(clocks, pa.int64()),
                pa.array(flags, pa.int32()),
                pa.array(texts, pa.string()),
                content.cast(pa.string()),
            ],
            schema=schema,
        )
    frames = reader.finish()
    if frames:
        yield from _message_batches(fragment, frames, partition)


def _fast_fields(
    docs: list[Any], depth: int, parse: Callable[[str], tuple[bytes, int, int]]
) -> tuple[Any, Any, Any, list[str | None]] | None:
    """Producer (hex), clock, flags and UUID text of each document, or None if any UUID is not
    a canonical message UUID (the per-frame path then decides). UUIDs are parsed all at once
    (`uuid_columns`) when every document has one."""
    if depth == 1:
        texts = [None if (doc := d.child) is None else doc.value for d in docs]
    else:
        texts = uuid_texts_of(docs, depth)
    if None not in texts:
        parsed = uuid_columns(cast("list[str]", texts))
        if parsed is None:
            return None
        nodes, clocks, flags = parsed
        return hex_ids(nodes), clocks, flags, texts
    producers: list[str | None] = []
    clock_list: list[int] = []
    flag_list: list[int] = []
    for text in texts:
        if text is None:
            producers.append(None)
            clock_list.append(0)
            flag_list.append(0)
            continue
        try:
            producer, clock, flag = parse(text)
        except ValueError:
            return None
        producers.append(producer.hex())
        clock_list.append(clock)
        flag_list.append(flag)
    return producers, clock_list, flag_list, texts


def _frames_of(blocks: Iterator[bytes], kind: str, begin: int) -> Iterator[Frame]:
    """The frames (error frames included) of a fragment's content blocks from offset `begin`."""
    reader = FrameReader(framing_of_kind(kind))
    at = begin
    for block in blocks:
        yield from reader.feed(at, block)
        at += len(block)
    yield from reader.finish()


def _message_batches(
    fragment: pb.Fragment, frames: Iterable[Frame], partition: FragmentPartition
) -> Iterator[Any]:
    """Messages a frame at a time (every framing; JSON lines fall back here), as Arrow
    batches of up to BATCH_ROWS rows."""
    import pyarrow as pa

    kind = partition.framing
    framing = framing_of_kind(kind)
    binary = kind == "fixed"
    schema = _arrow_schema(message_schema(binary))
    messages: Any = (
        DictMessages(tuple(partition.uuid_path.split("."))) if kind == "lines" else CSVMessages()
    )
    uuid_fields = uuid_fields_of(messages)
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}

    def add(frame: Frame) -> None:
        if frame.error is not None:
            _bad(fragment, frame.offset, frame.error, partition.bad_frames)
            return
        payload = framing.unmarshal(frame)
        fields: UUIDFields | None = None
        try:
            if kind == "lines":
                fields = messages.decode_frame(payload)[1]
            elif kind == "csv":
                fields = uuid_fields(messages.decode(payload))
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            _bad(fragment, frame.offset, f"cannot decode the message: {exc}", partition.bad_frames)
            return
        producer: str | None = None
        clock = flags = 0
        uuid_text: str | None = None
        if fields is not None:
            producer, clock, flags = fields[0].hex(), fields[1], fields[2]
            uuid_text = text_of(producer, clock, flags)
        columns["journal"].append(fragment.journal)
        columns["offset"].append(frame.offset)
        columns["end"].append(frame.end)
        columns["producer"].append(producer)
        columns["clock"].append(clock)
        columns["flags"].append(flags)
        columns["uuid"].append(uuid_text)
        columns["content"].append(payload if binary else payload.decode("utf-8", "replace"))

    def batch() -> Any:
        out = pa.RecordBatch.from_pydict(columns, schema=schema)
        for values in columns.values():
            values.clear()
        return out

    for frame in frames:
        add(frame)
        if len(columns["journal"]) >= BATCH_ROWS:
            yield batch()
    if columns["journal"]:
        yield batch()


def _bad(fragment: pb.Fragment, offset: int, reason: str, policy: str) -> None:
    message = f"{describe(fragment)}: bad frame at offset {offset}: {reason}"
    if policy == "fail":
        raise JobError(message)
    log.warning("%s (skipped)", message)
