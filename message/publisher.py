"""Publishing messages with UUIDs, and reading them back uncommitted or read-committed.

A `Publisher` has one random ProducerID and one Clock. `publish_committed` stamps a message
OUTSIDE_TXN (committed as it is written); `publish_uncommitted` stamps it CONTINUE_TXN (pending)
and remembers its journal; `build_ack_intents` makes the ACK_TXN acknowledgements that commit
everything pending (the exactly-once seed's "intents", which a transaction writes atomically with
its checkpoint); `commit` writes them itself. Writes go through AppendService, so many small
messages become few appends. A message type that cannot carry a UUID is published as it is:
at-least-once.

One producer may publish to journals of different content types: `sharing(messages, framing)`
gives a publisher of another message type with the same ProducerID, Clock and pending set, so
one set of ACK intents (each framed as its journal's messages are) commits all of them.

`read_uncommitted` iterates a journal's messages with their UUID fields as Envelopes;
`read_committed` passes them through a Sequencer, so each committed message comes once and rolled
back ones never (ACKs themselves are delivered too, with `is_ack`, as upstream: skip them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Generic, TypeVar

from broker.client.append_service import AppendService, PendingSpan, Span
from broker.client.reader import read
from broker.protocol import protocol_pb2_grpc as pb_grpc
from message.framing import Frame, FrameError, FrameReader, Framing, JSONLines
from message.mapping import Partition
from message.sequencer import COMMITTING, Envelope, Sequencer
from message.types import MessageType, uuid_fields_of
from message.uuid import TICK, Clock, Flags, TextFormatter, build, new_producer_id

M = TypeVar("M")
N = TypeVar("N")
_NO_PRODUCER = bytes(6)
_new_tuple = tuple.__new__
# Plain ints, not IntFlag: the per-message paths compare and combine them.
_OUTSIDE_TXN, _CONTINUE_TXN, _ACK_TXN = map(
    int, (Flags.OUTSIDE_TXN, Flags.CONTINUE_TXN, Flags.ACK_TXN)
)
log = logging.getLogger(__name__)


class Publisher(Generic[M]):
    def __init__(
        self,
        service: AppendService,
        messages: MessageType[M],
        framing: Framing,
        *,
        producer: bytes | None = None,
    ) -> None:
        if producer is not None and (not isinstance(producer, bytes) or len(producer) != 6):
            raise ValueError(f"producer {producer!r} must be 6 bytes")
        self.service = service
        self.messages = messages
        self.framing = framing
        self.producer = producer or new_producer_id()
        self.clock = Clock()
        # Journals with uncommitted messages, and the Clock of the first of them in each; and
        # how each such journal's messages are encoded (its ACK is encoded the same way).
        self._pending: dict[str, int] = {}
        self._codecs: dict[str, tuple[MessageType[Any], Framing]] = {}
        # Per-message hot path: bound once. A type that takes UUID text (DictMessages) skips
        # building a uuid.UUID only to format it.
        formatter = TextFormatter(self.producer)
        self._uuid_text = formatter.text
        self._texts = formatter.texts
        self._set_uuid_text: Callable[[M, str], None] | None = getattr(
            messages, "set_uuid_text", None
        )
        self._encode = messages.encode
        self._marshal = framing.marshal
        self._service_write = service.write
        # The list paths: a type that sets many UUID texts, or encodes many JSON lines, at once.
        self._set_uuid_texts: Callable[[list[M], list[str]], None] | None = getattr(
            messages, "set_uuid_texts", None
        )
        encode_lines = getattr(messages, "encode_lines", None)
        self._encode_lines: Callable[[list[M]], bytes] | None = (
            encode_lines if isinstance(framing, JSONLines) else None
        )

    def sharing(self, messages: MessageType[N], framing: Framing) -> Publisher[N]:
        """A publisher of another message type and framing under this one's identity: the
        same ProducerID and Clock, and one set of pending journals, so that the ACK intents
        either builds commit (or abort) what both published."""
        other: Publisher[N] = Publisher(self.service, messages, framing, producer=self.producer)
        other.clock = self.clock
        other._pending = self._pending
        other._codecs = self._codecs
        return other

    def _stamp(self, msg: M, flags: int) -> int:
        # The clock follows wall time, never backwards; a tick makes each message's unique.
        clock = self.clock.advance()
        try:
            if self._set_uuid_text is not None:
                self._set_uuid_text(msg, self._uuid_text(clock, flags))
            else:
                self.messages.set_uuid(msg, build(self.producer, clock, flags))
        except (TypeError, ValueError, AttributeError):
            pass  # A message that cannot carry a UUID is published as it is: at-least-once.
        return clock

    def _framed(self, msg: M) -> bytes:
        out = bytearray()
        self._marshal(self._encode(msg), out)
        return bytes(out)

    async def publish_committed(self, mapping: Callable[[M], Partition], msg: M) -> PendingSpan:
        """Write `msg`, committed at once (OUTSIDE_TXN), to the journal `mapping` picks."""
        journal = mapping(msg).journal
        self._stamp(msg, _OUTSIDE_TXN)
        return await self._service_write(journal, self._framed(msg))

    async def publish_uncommitted(self, mapping: Callable[[M], Partition], msg: M) -> PendingSpan:
        """Write `msg` pending (CONTINUE_TXN), until an ACK of this publisher commits it."""
        journal = mapping(msg).journal
        clock = self._stamp(msg, _CONTINUE_TXN)
        if journal not in self._pending:
            self._pending[journal] = clock
            self._codecs[journal] = (self.messages, self.framing)
        return await self._service_write(journal, self._framed(msg))

    async def publish_committed_many(
        self, mapping: Callable[[M], Partition], msgs: Iterable[M]
    ) -> list[PendingSpan]:
        """`publish_committed` of each message, in one call: the same UUIDs (one Clock tick
        each, in list order) and bytes, without a call and a write per message. The messages
        `mapping` sends to one journal are written as one record, so they land together, in
        list order, and commit in one append or fail together. Returns a PendingSpan for each
        journal written, in the order of their first message (empty for no messages)."""
        return await self._publish_many(mapping, msgs, _OUTSIDE_TXN)

    async def publish_uncommitted_many(
        self, mapping: Callable[[M], Partition], msgs: Iterable[M]
    ) -> list[PendingSpan]:
        """`publish_uncommitted` of each message (CONTINUE_TXN), as `publish_committed_many`
        writes them: pending until an ACK of this publisher commits them."""
        return await self._publish_many(mapping, msgs, _CONTINUE_TXN)

    async def _publish_many(
        self, mapping: Callable[[M], Partition], msgs: Iterable[M], flags: int
    ) -> list[PendingSpan]:
        batch = msgs if type(msgs) is list else list(msgs)
        if not batch:
            return []
        # Each journal's messages, and the index of its first (whose Clock opens its pending
        # span), mapped before stamping as `publish_committed` does.
        groups: dict[str, list[M]] = {}
        firsts: dict[str, int] = {}
        for index, msg in enumerate(batch):
            journal = mapping(msg).journal
            group = groups.get(journal)
            if group is None:
                groups[journal] = [msg]
                firsts[journal] = index
            else:
                group.append(msg)
        first = self.clock.advance_many(len(batch))
        self._stamp_many(batch, first, flags)
        # Everything is framed before anything is written: a message that cannot be encoded
        # fails the call with nothing written.
        encoded = [(journal, self._framed_many(group)) for journal, group in groups.items()]
        if flags == _CONTINUE_TXN:
            for journal in groups:
                if journal not in self._pending:
                    self._pending[journal] = first + firsts[journal] * TICK
                    self._codecs[journal] = (self.messages, self.framing)
        write = self._service_write
        return [await write(journal, data) for journal, data in encoded]

    def _stamp_many(self, batch: list[M], first: int, flags: int) -> None:
        if self._set_uuid_text is None:
            for index, msg in enumerate(batch):
                # A message that cannot carry a UUID is published as it is: at-least-once.
                with contextlib.suppress(TypeError, ValueError, AttributeError):
                    self.messages.set_uuid(msg, build(self.producer, first + index * TICK, flags))
            return
        texts = self._texts(first, len(batch), flags)
        if self._set_uuid_texts is not None:
            self._set_uuid_texts(batch, texts)
            return
        set_text = self._set_uuid_text
        for msg, text in zip(batch, texts, strict=True):
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                set_text(msg, text)

    def _framed_many(self, group: list[M]) -> bytes:
        if self._encode_lines is not None:
            return self._encode_lines(group)
        out = bytearray()
        encode, marshal = self._encode, self._marshal
        for msg in group:
            marshal(encode(msg), out)
        return bytes(out)

    def build_ack_intents(self) -> list[tuple[str, bytes]]:
        """The framed ACK_TXN acknowledgement for each journal with pending messages, at the
        current clock (committing every pending message before it); pending is then reset."""
        clock = self.clock.tick()
        return self._acks({journal: clock for journal in self._pending})

    def build_abort_intents(self) -> list[tuple[str, bytes]]:
        """Acknowledgements that roll back what is pending: in each journal, an ACK_TXN whose
        Clock is just below the first pending message's, so readers commit nothing of the span
        (its messages are all above the ACK) and drop it. Pending is then reset."""
        return self._acks({journal: first - 1 for journal, first in self._pending.items()})

    def _acks(self, clocks: dict[str, int]) -> list[tuple[str, bytes]]:
        intents = []
        for journal in sorted(clocks):
            messages, framing = self._codecs.get(journal, (self.messages, self.framing))
            msg = messages.new_acknowledgement(journal)
            messages.set_uuid(msg, build(self.producer, clocks[journal], Flags.ACK_TXN))
            out = bytearray()
            framing.marshal(messages.encode(msg), out)
            intents.append((journal, bytes(out)))
        self._pending.clear()
        self._codecs.clear()
        return intents

    async def commit(self) -> list[Span]:
        """Write the ACK intents and wait for them (and so for every earlier write)."""
        return await self._write_intents(self.build_ack_intents())

    async def abort(self) -> list[Span]:
        """Roll back every pending message (`build_abort_intents`), and wait for it."""
        return await self._write_intents(self.build_abort_intents())

    async def _write_intents(self, intents: list[tuple[str, bytes]]) -> list[Span]:
        futures = [await self.service.write(j, data) for j, data in intents]
        return [await f for f in futures]


class Reader(Generic[M]):
    """Messages of one journal as Envelopes: framed, decoded, with their UUID fields."""

    def __init__(self, messages: MessageType[M], framing: Framing) -> None:
        self.messages = messages
        self.framing = framing
        self.errors: list[FrameError] = []  # Reported frames skipped (corrupt or truncated).
        self._decode = messages.decode
        self._unmarshal = framing.unmarshal
        self._uuid_fields = uuid_fields_of(messages)
        # JSON lines of dicts: decoding and UUID parsing fused (msgspec takes the newline).
        fused = getattr(messages, "decode_frame", None)
        self._fused = fused if isinstance(framing, JSONLines) else None

    def envelope(self, journal: str, frame: Frame) -> Envelope | None:
        if frame.error is not None:
            self._skip(FrameError(frame.offset, frame.error))
            return None
        try:
            msg = self._decode(self._unmarshal(frame))
            fields = self._uuid_fields(msg)
        except (ValueError, TypeError, KeyError) as exc:
            self._skip(FrameError(frame.offset, f"cannot decode the message: {exc}"))
            return None
        if fields is None:
            return Envelope(journal, frame.offset, frame.end, _NO_PRODUCER, 0, 0, msg)
        return Envelope(journal, frame.offset, frame.end, fields[0], fields[1], fields[2], msg)

    def envelopes(self, journal: str, frames: list[Frame]) -> list[Envelope]:
        """The envelopes of `frames`, bad ones reported and skipped (as `envelope`)."""
        decode, unmarshal, uuid_fields = self._decode, self._unmarshal, self._uuid_fields
        fused = self._fused
        out: list[Envelope] = []
        append = out.append
        new = _new_tuple
        for frame in frames:
            offset, end, data, error = frame
            if error is None:
                try:
                    if fused is not None:
                        msg, fields = fused(data)
                    else:
                        msg = decode(unmarshal(frame))
                        fields = uuid_fields(msg)
                except (ValueError, TypeError, KeyError):
                    pass  # envelope() below words the error.
                else:
                    if fields is None:
                        fields = (_NO_PRODUCER, 0, 0)
                    # tuple.__new__ skips NamedTuple's Python-level __new__ (per message).
                    append(new(Envelope, (journal, offset, end, *fields, msg)))
                    continue
            envelope = self.envelope(journal, frame)
            if envelope is not None:
                append(envelope)
        return out

    def envelopes_of_lines(self, journal: str, base: int, lines: list[bytes]) -> list[Envelope]:
        """As `envelopes`, for the lines of `FrameReader.feed_lines` (JSON lines of a type with
        `decode_frame`), starting at offset `base`."""
        fused = self._fused
        assert fused is not None, "envelopes_of_lines needs JSON lines of a decode_frame type"
        out: list[Envelope] = []
        append = out.append
        new = _new_tuple
        begin = base
        for line in lines:
            end = begin + len(line) + 1
            try:
                msg, fields = fused(line)
            except (ValueError, TypeError, KeyError):
                envelope = self.envelope(journal, Frame(begin, end, line + b"\n"))
                if envelope is not None:
                    append(envelope)
            else:
                if fields is None:
                    fields = (_NO_PRODUCER, 0, 0)
                append(new(Envelope, (journal, begin, end, *fields, msg)))
            begin = end
        return out

    def _skip(self, error: FrameError) -> None:
        # The documented policy: a bad frame is reported (logged and kept in `errors`) with its
        # offset and skipped; framing resumes after it, never mis-framing what follows.
        log.error("%s", error)
        self.errors.append(error)


def chunk_envelopes(
    reader: Reader[M], frames: FrameReader, journal: str, offset: int, content: bytes
) -> list[Envelope]:
    """The envelopes of the frames a read chunk of `journal` at `offset` completes (`frames`
    keeps the partial frame for the next chunk): for JSON lines, without a Frame per line."""
    if reader._fused is None:
        return reader.envelopes(journal, frames.feed(offset, content))
    errors, base, lines = frames.feed_lines(offset, content)
    envelopes = reader.envelopes_of_lines(journal, base, lines)
    if errors:  # The partial frame before a jump comes first.
        return reader.envelopes(journal, errors) + envelopes
    return envelopes


async def read_uncommitted(
    stub: pb_grpc.JournalStub,
    journal: str,
    reader: Reader[M],
    offset: int = 0,
    *,
    block: bool = False,
    **read_options: Any,
) -> AsyncIterator[Envelope]:
    async for batch in _envelope_batches(
        stub, journal, reader, offset, block=block, **read_options
    ):
        for envelope in batch:
            yield envelope


async def _envelope_batches(
    stub: pb_grpc.JournalStub,
    journal: str,
    reader: Reader[M],
    offset: int = 0,
    *,
    block: bool = False,
    **read_options: Any,
) -> AsyncIterator[list[Envelope]]:
    frames = FrameReader(reader.framing)
    async for chunk in read(stub, journal, offset, block=block, **read_options):
        yield chunk_envelopes(reader, frames, journal, chunk.offset, chunk.content)
    yield reader.envelopes(journal, frames.finish())


async def read_committed(
    stub: pb_grpc.JournalStub,
    journal: str,
    reader: Reader[M],
    sequencer: Sequencer | None = None,
    offset: int = 0,
    *,
    block: bool = False,
    **read_options: Any,
) -> AsyncIterator[Envelope]:
    """Committed messages of `journal`, each once, in order per producer (ACKs included, with
    `is_ack`). Messages a commit needs that left the sequencer's ring are re-read from the
    journal."""
    seq = sequencer or Sequencer()
    queue, step = seq.queue_uncommitted, seq.step
    async for batch in _envelope_batches(
        stub, journal, reader, offset, block=block, **read_options
    ):
        for envelope in batch:
            if queue(envelope) not in COMMITTING:
                continue
            replay = seq.replay_range()
            if replay is None:
                while (committed := step()) is not None:
                    yield committed
            else:
                async for committed in _replaying(seq, stub, reader, replay, read_options):
                    yield committed


async def read_committed_batches(
    stub: pb_grpc.JournalStub,
    journal: str,
    reader: Reader[M],
    sequencer: Sequencer | None = None,
    offset: int = 0,
    *,
    block: bool = False,
    **read_options: Any,
) -> AsyncIterator[list[Envelope]]:
    """As `read_committed`, a list at a time: the committed messages completed by each chunk
    read (ACKs left out), for consumers that process in bulk. The sequencer counts a list as
    processed once it is yielded, so checkpoint it (`checkpoint()`, `offsets`) only between
    lists, after processing the last one."""
    seq = sequencer or Sequencer()
    queue, step = seq.queue_uncommitted, seq.step
    async for batch in _envelope_batches(
        stub, journal, reader, offset, block=block, **read_options
    ):
        out: list[Envelope] = []
        append = out.append
        for envelope in batch:
            if queue(envelope) not in COMMITTING:
                continue
            replay = seq.replay_range()
            if replay is None:
                while (committed := step()) is not None:
                    if committed.flags != _ACK_TXN:
                        append(committed)
            else:
                async for committed in _replaying(seq, stub, reader, replay, read_options):
                    if committed.flags != _ACK_TXN:
                        append(committed)
        if out:
            yield out


async def _replaying(
    seq: Sequencer,
    stub: pb_grpc.JournalStub,
    reader: Reader[M],
    replay: tuple[str, int, int],
    read_options: dict[str, Any],
) -> AsyncIterator[Envelope]:
    """Dequeue a commit whose messages left the ring: re-read them from the journal."""
    journal, begin, end = replay
    seq.start_replay(_replayed(stub, journal, reader, begin, end, read_options))
    while (committed := await seq.astep()) is not None:
        yield committed


async def _replayed(
    stub: pb_grpc.JournalStub,
    journal: str,
    reader: Reader[M],
    begin: int,
    end: int,
    read_options: dict[str, Any],
) -> AsyncIterator[Envelope]:
    async for envelope in read_uncommitted(
        stub, journal, reader, begin, end_offset=end, **read_options
    ):
        yield envelope
