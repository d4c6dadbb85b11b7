"""Framings (JSON lines, fixed protobuf, CSV) and message types: exact frames and offsets across
arbitrary chunkings, desync recovery, and UUID handling of each message type."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import re
import uuid
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from message import uuid as mu
from message.framing import (
    CSV,
    FIXED_FRAME_MAGIC,
    FixedProtobuf,
    Frame,
    FrameError,
    FrameReader,
    Framing,
    JSONLines,
    framing_for,
    known_content_types,
)
from message.types import (
    CSVMessages,
    DataclassMessages,
    DictMessages,
    ProtobufMessages,
    decode_message,
    encode_message,
)
from tests.helpers.messages import _proto_class

MAGIC = FIXED_FRAME_MAGIC


def fixed(payload: bytes) -> bytes:
    return MAGIC + len(payload).to_bytes(4, "little") + payload


def chunk(stream: bytes, cuts: list[int], base: int) -> list[tuple[int, bytes]]:
    points = sorted({0, len(stream), *(c for c in cuts if 0 < c < len(stream))})
    return [(base + a, stream[a:b]) for a, b in itertools.pairwise(points)]


def read(framing: Framing, stream: bytes, cuts: list[int] = [], base: int = 0) -> list[Frame]:  # noqa: B006
    return list(framing.frames(chunk(stream, cuts, base)))


def assert_tiles(frames: list[Frame], stream: bytes, base: int) -> None:
    """Frames cover the stream exactly: contiguous, in order, their bytes concatenating to it."""
    at = base
    for f in frames:
        assert f.offset == at
        assert f.end == f.offset + len(f.data) > f.offset
        at = f.end
    assert at == base + len(stream)
    assert b"".join(f.data for f in frames) == stream


cuts_st = st.lists(st.integers(min_value=0, max_value=4000), max_size=12)
bases = st.integers(min_value=0, max_value=2**40)


# --- JSON lines ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
json_docs = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@settings(max_examples=75)
@given(st.lists(json_docs, max_size=8), cuts_st, bases)
def test_json_lines_round_trip_across_chunkings(
    docs: list[dict[str, Any]], cuts: list[int], base: int
) -> None:
    framing, messages = JSONLines(), DictMessages()
    encoded = []
    for doc in docs:
        out = bytearray()
        encode_message(framing, messages, doc, out)
        encoded.append(bytes(out))
    stream = b"".join(encoded)
    frames = read(framing, stream, cuts, base)
    assert [f.data for f in frames] == encoded
    assert all(f.error is None for f in frames)
    assert_tiles(frames, stream, base)
    assert [decode_message(framing, messages, f) for f in frames] == docs


def test_json_strings_with_newlines_are_escaped_on_one_line() -> None:
    framing, messages = JSONLines(), DictMessages()
    out = bytearray()
    docs: list[dict[str, Any]] = [{"text": "line one\nline two\r\n", "n": 1}, {"text": "\n\n"}]
    for doc in docs:
        encode_message(framing, messages, doc, out)
    assert bytes(out).count(b"\n") == 2
    frames = read(framing, bytes(out), [3, 20, 21])
    assert [decode_message(framing, messages, f) for f in frames] == docs
    with pytest.raises(ValueError, match="raw newline"):
        framing.marshal(b'{"a":\n1}', bytearray())


def test_json_truncated_line_and_undecodable_document() -> None:
    framing, messages = JSONLines(), DictMessages()
    stream = b'{"a":1}\nnot json\n{"b":'
    frames = read(framing, stream, [9])
    assert_tiles(frames, stream, 0)
    assert decode_message(framing, messages, frames[0]) == {"a": 1}
    with pytest.raises(FrameError) as err:
        decode_message(framing, messages, frames[1])
    assert err.value.offset == 8 and "invalid JSON" in str(err.value)
    assert frames[2] == Frame(17, 22, b'{"b":', "truncated frame: content ends without a newline")
    with pytest.raises(FrameError, match="offset 17: truncated"):
        decode_message(framing, messages, frames[2])


# --- Fixed protobuf -----------------------------------------------------------------------------


def test_fixed_framing_matches_upstream_fixtures() -> None:
    framing = framing_for("application/x-protobuf-fixed")
    out = bytearray()
    framing.marshal(b"test message content", out)
    assert bytes(out) == bytes([0x66, 0x33, 0x93, 0x36, 0x14, 0, 0, 0]) + b"test message content"
    framing.marshal(b"foo message", out)
    assert bytes(out[28:]) == bytes([0x66, 0x33, 0x93, 0x36, 0x0B, 0, 0, 0]) + b"foo message"
    frames = read(framing, bytes(out))
    assert [framing.unmarshal(f) for f in frames] == [b"test message content", b"foo message"]
    assert [(f.offset, f.end) for f in frames] == [(0, 28), (28, 47)]


@settings(max_examples=75)
@given(
    st.lists(
        st.one_of(st.binary(max_size=40), st.just(MAGIC), st.just(fixed(b"inner"))), max_size=8
    ),
    cuts_st,
    bases,
)
def test_fixed_round_trip_across_chunkings(
    payloads: list[bytes], cuts: list[int], base: int
) -> None:
    # Payloads may themselves contain magic words and whole frames: lengths decide.
    framing = FixedProtobuf()
    stream = b"".join(fixed(p) for p in payloads)
    frames = read(framing, stream, cuts, base)
    assert [framing.unmarshal(f) for f in frames] == payloads
    assert_tiles(frames, stream, base)


@given(cuts_st)
def test_fixed_leading_garbage_is_reported_then_the_frame_recovered(cuts: list[int]) -> None:
    # Upstream's TestFixedFramingDesyncDetection fixture.
    stream = b"foobar" + fixed(b"test message content")
    frames = read(FixedProtobuf(), stream, cuts, 1000)
    assert frames[0].offset == 1000 and frames[0].end == 1006 and frames[0].data == b"foobar"
    assert frames[0].error is not None and "no magic word" in frames[0].error
    assert frames[1] == Frame(1006, 1034, fixed(b"test message content"))
    assert len(frames) == 2


@settings(max_examples=50)
@given(cuts_st, st.integers(min_value=0, max_value=3))
def test_fixed_corrupt_magic_mid_stream_resyncs_at_next_frame(cuts: list[int], byte: int) -> None:
    framing = FixedProtobuf()
    parts = [fixed(b"alpha"), fixed(b"bravo" * 10), fixed(b"charlie"), fixed(b"delta")]
    stream = bytearray(b"".join(parts))
    b_at = len(parts[0])
    stream[b_at + byte] ^= 0xFF
    frames = read(framing, bytes(stream), cuts, 500)
    c_at = b_at + len(parts[1])
    assert frames[0] == Frame(500, 500 + b_at, parts[0])
    assert frames[1].offset == 500 + b_at and frames[1].end == 500 + c_at
    assert frames[1].error is not None and frames[1].error.startswith("desynchronized")
    with pytest.raises(FrameError) as err:
        framing.unmarshal(frames[1])
    assert err.value.offset == 500 + b_at
    assert [framing.unmarshal(f) for f in frames[2:]] == [b"charlie", b"delta"]
    assert frames[2].offset == 500 + c_at
    assert_tiles(frames, bytes(stream), 500)


def test_fixed_garbage_between_frames_and_a_stray_newline() -> None:
    framing = FixedProtobuf()
    stream = fixed(b"one") + b"\n" + fixed(b"two") + b"\x66\x33junk" + fixed(b"three") + b"\n"
    frames = read(framing, stream, [12, 13, 30])
    errors = [(f.offset, f.data) for f in frames if f.error]
    assert errors == [(11, b"\n"), (23, b"\x66\x33junk")]
    assert [framing.unmarshal(f) for f in frames if not f.error] == [b"one", b"two", b"three"]
    # The lone trailing newline is tolerated (as upstream), so it is the only byte not covered.
    assert frames[-1].end == len(stream) - 1


@pytest.mark.parametrize(
    ("tail", "reason"),
    [
        (fixed(b"test message content")[:5], "truncated frame: 5 of 8 header bytes"),
        (fixed(b"test message content")[:8], "truncated frame: 0 of 20 payload bytes"),
        (fixed(b"test message content")[:19], "truncated frame: 11 of 20 payload bytes"),
        (b"\x66\x33\x93", "truncated frame: 3 of 8 header bytes"),
    ],
)
def test_fixed_truncated_frame_at_the_end(tail: bytes, reason: str) -> None:
    framing = FixedProtobuf()
    head = fixed(b"whole")
    reader = FrameReader(framing)
    assert reader.feed(40, head + tail) == [Frame(40, 40 + len(head), head)]
    assert reader.pending == tail
    assert reader.finish() == [Frame(40 + len(head), 40 + len(head) + len(tail), tail, reason)]
    assert reader.pending == b""


def test_fixed_oversized_length_is_a_desync_not_a_wait() -> None:
    framing = FixedProtobuf(max_size=1000)
    bad = MAGIC + (5000).to_bytes(4, "little") + b"xyz"
    stream = fixed(b"a") + bad + fixed(b"b")
    reader = FrameReader(framing)
    frames = reader.feed(0, stream)  # all resolved without finish(): nothing waits for 5000 bytes
    assert [f.data for f in frames] == [fixed(b"a"), bad, fixed(b"b")]
    assert frames[1].error is not None and "more than the 1000 byte limit" in frames[1].error
    assert reader.pending == b""
    with pytest.raises(ValueError, match="exceeds the 1000 byte frame limit"):
        framing.marshal(bytes(1001), bytearray())


def test_fixed_long_garbage_is_reported_in_pieces_and_frames_recovered() -> None:
    framing = FixedProtobuf()
    garbage = bytes(range(7, 200)) * 12_000  # ~2.3 MB without a magic word
    stream = garbage + fixed(b"after")
    reader = FrameReader(framing)
    frames: list[Frame] = []
    for at in range(0, len(stream), 65_536):
        frames.extend(reader.feed(at, stream[at : at + 65_536]))
    frames.extend(reader.finish())
    assert all(f.error for f in frames[:-1]) and len(frames) >= 3
    assert frames[-1].data == fixed(b"after") and frames[-1].offset == len(garbage)
    assert_tiles(frames, stream, 0)


# --- CSV ----------------------------------------------------------------------------------------

csv_fields = st.text(alphabet=st.sampled_from('ab ,"\n\r\t\\.é€x'), max_size=8) | st.text(
    max_size=6
)
csv_rows = st.lists(csv_fields, min_size=1, max_size=5)


@settings(max_examples=75)
@given(st.lists(csv_rows, max_size=8), cuts_st, bases)
def test_csv_round_trip_across_chunkings(rows: list[list[str]], cuts: list[int], base: int) -> None:
    framing, messages = CSV(), CSVMessages()
    encoded = []
    for row in rows:
        out = bytearray()
        encode_message(framing, messages, row, out)
        encoded.append(bytes(out))
    stream = b"".join(encoded)
    frames = read(framing, stream, cuts, base)
    assert [f.data for f in frames] == encoded
    assert_tiles(frames, stream, base)
    assert [decode_message(framing, messages, f) for f in frames] == rows


def test_csv_quoting_matches_upstream_and_respects_quoted_newlines() -> None:
    framing, messages = CSV(), CSVMessages()
    u = "9f2a3c1e-0000-1000-8000-010203040506"
    out = bytearray()
    encode_message(framing, messages, [u, "123", 'qu"ote'], out)
    encode_message(framing, messages, [u, "567,891"], out)
    encode_message(framing, messages, [u, "multi\nline,\n", " lead"], out)
    assert bytes(out) == (
        f'{u},123,"qu""ote"\n{u},"567,891"\n{u},"multi\nline,\n"," lead"\n'.encode()
    )
    frames = read(framing, bytes(out), [45, 90, 95])
    assert [decode_message(framing, messages, f) for f in frames] == [
        [u, "123", 'qu"ote'],
        [u, "567,891"],
        [u, "multi\nline,\n", " lead"],
    ]


def test_csv_stray_quote_in_unquoted_field_does_not_swallow_lines() -> None:
    stream = b'a,b"c,d\ne,f\n"quoted,g\nh",i\n'
    frames = read(CSV(), stream, [3, 10])
    assert [f.data for f in frames] == [b'a,b"c,d\n', b"e,f\n", b'"quoted,g\nh",i\n']
    assert all(f.error is None for f in frames)
    assert CSVMessages().decode(frames[0].data[:-1]) == ["a", 'b"c', "d"]
    assert read(CSV(), b'x\n"open\n')[1].error == (
        "truncated frame: content ends inside a quoted field"
    )
    with pytest.raises(ValueError, match="not exactly one record"):
        CSV().marshal(b"a\nb", bytearray())
    with pytest.raises(ValueError, match="not exactly one record"):
        CSV().marshal(b'"unterminated', bytearray())


# --- Any bytes: chunking never changes the result -----------------------------------------------

soup = st.lists(
    st.one_of(
        st.binary(max_size=12),
        st.sampled_from([MAGIC, b"\n", b'"', b",", b"\r\n", fixed(b"ok"), MAGIC + b"\x05\x00"]),
    ),
    max_size=25,
).map(b"".join)


@settings(max_examples=120)
@given(st.sampled_from(["application/x-ndjson", "text/csv", "application/x-protobuf-fixed"]),
       soup, cuts_st, bases)  # fmt: skip
def test_any_bytes_frame_the_same_however_chunked(
    content_type: str, stream: bytes, cuts: list[int], base: int
) -> None:
    framing = framing_for(content_type)
    whole = read(framing, stream, [], base)
    assert read(framing, stream, cuts, base) == whole
    fixed_framing = content_type == "application/x-protobuf-fixed"
    covered = whole[-1].end if whole else base
    if fixed_framing and covered == base + len(stream) - 1:
        assert stream.endswith(b"\n")
        stream = stream[:-1]  # the tolerated lone trailing newline
    assert_tiles(whole, stream, base)


# --- FrameReader --------------------------------------------------------------------------------


def test_reader_flushes_a_partial_frame_on_an_offset_jump() -> None:
    reader = FrameReader(JSONLines())
    assert reader.feed(10, b'{"a":1}\n{"b"') == [Frame(10, 18, b'{"a":1}\n')]
    assert reader.pending == b'{"b"' and reader.offset == 18
    frames = reader.feed(100, b'{"c":3}\n')
    assert frames[0].offset == 18 and frames[0].end == 22 and frames[0].data == b'{"b"'
    assert frames[0].error == (
        "truncated frame: content ends without a newline; content then jumps to offset 100"
    )
    assert frames[1] == Frame(100, 108, b'{"c":3}\n')


def test_reader_rejects_overlapping_chunks_and_resets_on_finish() -> None:
    reader = FrameReader(CSV())
    reader.feed(0, b"a,b\nc")
    with pytest.raises(ValueError, match="overlaps content already read through 5") as err:
        reader.feed(4, b"c,d\n")
    assert "\n" not in str(err.value)
    assert reader.feed(5, b"") == []
    assert reader.finish() == [Frame(4, 5, b"c", "truncated frame: content ends without a newline")]
    assert reader.offset is None
    assert reader.feed(0, b"x\n") == [Frame(0, 2, b"x\n")]


def test_long_frame_fed_byte_by_byte() -> None:
    doc = json.dumps({"k": "v" * 5000}).encode() + b"\n"
    reader = FrameReader(JSONLines())
    got: list[Frame] = []
    for i in range(len(doc)):
        got.extend(reader.feed(7 + i, doc[i : i + 1]))
    assert got == [Frame(7, 7 + len(doc), doc)]


# --- Registry -----------------------------------------------------------------------------------


def test_framing_for_content_types() -> None:
    assert isinstance(framing_for("application/x-ndjson"), JSONLines)
    assert isinstance(framing_for("text/csv"), CSV)
    assert isinstance(framing_for("application/x-protobuf-fixed"), FixedProtobuf)
    assert known_content_types() == [
        "application/x-ndjson",
        "application/x-protobuf-fixed",
        "text/csv",
    ]
    with pytest.raises(ValueError) as err:
        framing_for("application/json")
    assert str(err.value) == (
        "unknown content-type 'application/json': known framings are "
        "application/x-ndjson, application/x-protobuf-fixed, text/csv"
    )


# --- Message types ------------------------------------------------------------------------------

U = mu.build(bytes.fromhex("0123456789ab"), 12345 << 4, mu.Flags.CONTINUE_TXN)


def test_dict_messages_uuid_at_meta_uuid() -> None:
    m = DictMessages()
    doc: dict[str, Any] = {"x": 1}
    assert m.get_uuid(doc) is None
    m.set_uuid(doc, U)
    assert doc == {"x": 1, "_meta": {"uuid": str(U)}}
    assert m.get_uuid(m.decode(m.encode(doc))) == U
    ack = m.new_acknowledgement("a/journal")
    m.set_uuid(ack, U)
    assert json.loads(m.encode(ack)) == {"_meta": {"ack": True, "uuid": str(U)}}
    assert m.get_uuid({"_meta": {"uuid": ""}}) is None
    assert m.get_uuid({"_meta": {"uuid": str(uuid.UUID(int=0))}}) is None
    with pytest.raises(ValueError, match=re.escape("_meta.uuid holds 'nope', which is not a UUID")):
        m.get_uuid({"_meta": {"uuid": "nope"}})
    with pytest.raises(ValueError, match=re.escape("cannot set _meta.uuid: '_meta' holds a list")):
        m.set_uuid({"_meta": []}, U)
    with pytest.raises(ValueError, match="not an object"):
        m.decode(b"[1,2]")


def test_dict_messages_configurable_path_as_upstream_go_structs() -> None:
    m = DictMessages(uuid_path=("UUID",))
    doc = m.decode(b'{"UUID":"' + str(U).encode() + b'","Key":"k"}')
    assert m.get_uuid(doc) == U
    assert m.new_acknowledgement("j") == {}
    templated = DictMessages(ack_template={"kind": "ack"})
    ack = templated.new_acknowledgement("j")
    templated.set_uuid(ack, U)
    assert ack == {"kind": "ack", "_meta": {"uuid": str(U)}}
    assert templated.new_acknowledgement("j") == {"kind": "ack"}


@dataclasses.dataclass
class Event:
    key: str = ""
    count: int = 0
    uuid: uuid.UUID | None = None


@dataclasses.dataclass
class TextEvent:
    key: str
    uuid: str = ""


@dataclasses.dataclass(frozen=True)
class Frozen:
    key: str = ""
    uuid: str = ""


def test_dataclass_messages() -> None:
    m = DataclassMessages(Event)
    ev = Event("k", 3)
    assert m.get_uuid(ev) is None
    m.set_uuid(ev, U)
    assert ev.uuid == U
    data = m.encode(ev)
    assert json.loads(data) == {"key": "k", "count": 3, "uuid": str(U)}
    back = m.decode(data[:-1] + b',"unknown":1}')  # unknown keys are ignored
    assert back == ev and m.get_uuid(back) == U
    assert m.new_acknowledgement("j") == Event()

    t = DataclassMessages(TextEvent)
    te = TextEvent("k")
    t.set_uuid(te, U)
    assert te.uuid == str(U) and t.get_uuid(te) == U
    assert t.decode(t.encode(te)) == te
    with pytest.raises(ValueError, match=r"TextEvent\(\) needs arguments"):
        t.new_acknowledgement("j")
    assert DataclassMessages(TextEvent, ack_factory=lambda j: TextEvent(j)).new_acknowledgement(
        "jrnl"
    ) == TextEvent("jrnl")
    with pytest.raises(ValueError, match="cannot build TextEvent"):
        t.decode(b"{}")

    with pytest.raises(ValueError, match="Frozen is frozen"):
        DataclassMessages(Frozen)
    at_least_once = DataclassMessages(Frozen, uuid_field=None)
    fr = Frozen("k")
    at_least_once.set_uuid(fr, U)
    assert at_least_once.get_uuid(fr) is None
    with pytest.raises(ValueError, match="Event has no field 'id'"):
        DataclassMessages(Event, uuid_field="id")


@pytest.mark.parametrize(
    "uuid_type",
    [
        descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    ],
)
def test_protobuf_messages_in_fixed_frames(uuid_type: int) -> None:
    cls = _proto_class(uuid_type)
    m = ProtobufMessages(cls)
    framing = framing_for("application/x-protobuf-fixed")
    msg = cls(ngram="the quick", count=7)
    assert m.get_uuid(msg) is None
    m.set_uuid(msg, U)
    is_bytes = uuid_type == descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    assert msg.uuid == (U.bytes if is_bytes else str(U))  # type: ignore[attr-defined]
    out = bytearray()
    encode_message(framing, m, msg, out)
    ack = m.new_acknowledgement("j")
    m.set_uuid(ack, mu.build(bytes(6), 99 << 4, mu.Flags.ACK_TXN))
    encode_message(framing, m, ack, out)
    frames = read(framing, bytes(out), [5, 30])
    decoded = [decode_message(framing, m, f) for f in frames]
    assert decoded == [msg, ack]
    assert m.get_uuid(decoded[0]) == U
    assert mu.flags_of(m.get_uuid(decoded[1]) or U) == mu.Flags.ACK_TXN
    bad = Frame(64, 64 + 10, fixed(b"\xff\xff"))
    with pytest.raises(
        FrameError, match=re.escape("offset 64: cannot decode message: invalid t.Count")
    ):
        decode_message(framing, m, bad)


def test_protobuf_messages_field_checks() -> None:
    cls = _proto_class(descriptor_pb2.FieldDescriptorProto.TYPE_BYTES)
    with pytest.raises(
        ValueError, match=re.escape("t.Count.count must be a bytes or string field")
    ):
        ProtobufMessages(cls, uuid_field="count")
    with pytest.raises(ValueError, match=re.escape("t.Count has no field 'id'")):
        ProtobufMessages(cls, uuid_field="id")
    m = ProtobufMessages(cls)
    with pytest.raises(ValueError, match="holds 3 bytes: a UUID is 16"):
        m.get_uuid(cls(uuid=b"abc"))
    assert ProtobufMessages(cls, uuid_field=None).get_uuid(cls(uuid=U.bytes)) is None


def test_csv_messages() -> None:
    m = CSVMessages()
    row = ["", "a", "b"]
    assert m.get_uuid(row) is None
    m.set_uuid(row, U)
    assert row == [str(U), "a", "b"] and m.get_uuid(row) == U
    assert m.new_acknowledgement("j") == [""]
    assert CSVMessages(width=3).new_acknowledgement("j") == ["", "", ""]
    last = CSVMessages(uuid_column=2)
    short = ["x"]
    last.set_uuid(short, U)
    assert short == ["x", "", str(U)]
    assert last.get_uuid(["x"]) is None
    assert m.decode(m.encode([""])) == [""]
    with pytest.raises(ValueError, match="not exactly one record"):
        m.decode(b"")
    with pytest.raises(ValueError, match="CSV column 0 holds 'zz'"):
        m.get_uuid(["zz"])
    with pytest.raises(ValueError, match="at least one field"):
        m.encode([])


# --- The JSON reading fast path ------------------------------------------------------------------


def _slow_fields(messages: DictMessages, doc: dict[str, Any]) -> tuple[bytes, int, int] | None:
    u = messages.get_uuid(doc)
    if u is None:
        return None
    producer, clock, flags = mu.parse(u)
    return producer, clock, int(flags)


_V1 = mu.build(b"\x03\x01\x02\x03\x04\x05", 0x1234_5678_9ABC_DEF0, mu.Flags.ACK_TXN)


@pytest.mark.parametrize(
    "doc",
    [
        {"a": 1, "_meta": {"uuid": str(_V1)}},
        {"_meta": {"uuid": str(_V1).upper()}},  # Not canonical: the slow path, same answer.
        {"_meta": {"uuid": "{" + str(_V1) + "}"}},
        {"_meta": {"uuid": _V1.hex}},
        {"_meta": {"uuid": ""}},
        {"_meta": {"uuid": None}},
        {"_meta": {"uuid": str(uuid.UUID(int=0))}},
        {"_meta": {}},
        {"_meta": ["uuid"]},
        {"_meta": "uuid"},
        {"other": True},
        {"big": 2**70, "_meta": {"uuid": str(_V1)}},  # Past msgspec's integers: the json module.
        {"f": 1.5e300, "nested": [{"_meta": {"uuid": "x"}}], "_meta": {"uuid": str(_V1)}},
    ],
)
def test_fused_json_decode_equals_decode_then_uuid(doc: dict[str, Any]) -> None:
    messages = DictMessages()
    line = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    decoded, fields = messages.decode_frame(line)
    assert decoded == doc == messages.decode(line[:-1])
    assert fields == messages.uuid_fields(decoded) == _slow_fields(messages, decoded)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (
            b'{"_meta":{"uuid":"6f1c2a3e-9d4b-4c7e-8a1f-2b3c4d5e6f70"}}\n',
            "not a message UUID",
        ),  # v4
        (b'{"_meta":{"uuid":"nonsense"}}\n', "not a UUID"),
        (b'{"_meta":{"uuid":7}}\n', "not a UUID string"),
        (b"[1, 2]\n", "not an object"),
        (b'{"a": }\n', "invalid JSON"),
    ],
)
def test_fused_json_decode_errors_are_worded_as_the_slow_path(line: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        DictMessages().decode_frame(line)
    assert "\n" not in str(err.value)


@settings(max_examples=75)
@given(json_docs, st.one_of(st.none(), st.builds(mu.build, st.binary(min_size=6, max_size=6),
       st.integers(0, 2**64 - 1), st.integers(0, 0x3FF))))  # fmt: skip
def test_fused_json_decode_equals_the_slow_path_on_any_document(
    doc: dict[str, Any], u: uuid.UUID | None
) -> None:
    messages = DictMessages()
    if u is not None:
        messages.set_uuid(doc, u)
    line = messages.encode(doc) + b"\n"
    decoded, fields = messages.decode_frame(line)
    assert decoded == json.loads(line)
    assert fields == _slow_fields(messages, decoded)


def test_json_encoding_falls_back_for_what_msgspec_refuses() -> None:
    messages = DictMessages()
    doc = {"big": -(2**80), "u": uuid.UUID(int=5), "s": "caf\u00e9 \u2028"}
    encoded = messages.encode(doc)
    assert json.loads(encoded) == {
        "big": -(2**80),
        "u": str(uuid.UUID(int=5)),
        "s": "caf\u00e9 \u2028",
    }
    assert b"\n" not in encoded and "caf\u00e9".encode() in encoded  # UTF-8, not \\u escapes


@settings(max_examples=75)
@given(st.lists(st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")), max_size=12),
       st.binary(max_size=5).map(lambda b: b.replace(b"\n", b"")), cuts_st, bases)  # fmt: skip
def test_feed_lines_cuts_the_same_lines_as_feed(
    lines: list[bytes], tail: bytes, cuts: list[int], base: int
) -> None:
    stream = b"".join(line + b"\n" for line in lines) + tail
    by_frames, by_lines = FrameReader(JSONLines()), FrameReader(JSONLines())
    frames: list[Frame] = []
    cut: list[tuple[int, int, bytes]] = []
    for offset, content in chunk(stream, cuts, base):
        frames += by_frames.feed(offset, content)
        errors, begin, got = by_lines.feed_lines(offset, content)
        assert errors == []
        for line in got:
            cut.append((begin, begin + len(line) + 1, line + b"\n"))
            begin += len(line) + 1
    assert cut == [(f.offset, f.end, f.data) for f in frames]
    assert by_lines.finish() == by_frames.finish()  # The tail: one truncated-frame error.


def test_feed_lines_reports_a_partial_line_cut_by_an_offset_jump() -> None:
    reader = FrameReader(JSONLines())
    assert reader.feed_lines(100, b'{"a":1}\n{"b"') == ([], 100, [b'{"a":1}'])
    errors, begin, lines = reader.feed_lines(500, b'{"c":3}\n')
    (error,) = errors
    assert (error.offset, error.data) == (108, b'{"b"') and "jumps to offset 500" in error.error
    assert (begin, lines) == (500, [b'{"c":3}'])


def test_fused_json_decode_memo_across_messages_of_producers() -> None:
    # Consecutive messages share all but the first 8 hex digits of their UUID text; the memo of
    # that tail must never leak into a message whose tail differs.
    messages = DictMessages()
    a, b = b"\x01\x02\x03\x04\x05\x06", b"\x07\x08\x09\x0a\x0b\x0c"
    start = (0xFFFF_FFFF - 3) << 4  # Ticks cross a time_low wrap (time_mid changes).
    stamps = [
        (producer, start + i * mu.TICK, flags)
        for i in range(8)
        for producer, flags in ((a, 1), (a, 1), (b, 1), (a, 2), (a, 0))
    ]
    for producer, clock, flags in stamps:
        line = b'{"_meta":{"uuid":"%s"}}\n' % str(mu.build(producer, clock, flags)).encode()
        assert messages.decode_frame(line)[1] == (producer, clock, flags)
    # With the memo primed, odd first parts get what the slow path (uuid.UUID) makes of them:
    # it takes signs, spaces, underscores and non-ASCII digits, and refuses other letters.
    text = str(mu.build(a, start, 1))
    messages.decode_frame(b'{"_meta":{"uuid":"%s"}}' % text.encode())
    for head in ("+0000001", " 0000001", "0000_001", "zzzzzzzz", "\u0663" * 8):
        doc = {"_meta": {"uuid": head + text[8:]}}
        line = json.dumps(doc).encode()
        try:
            expected: object = _slow_fields(DictMessages(), doc)
        except ValueError:
            expected = ValueError
        try:
            got: object = messages.decode_frame(line)[1]
        except ValueError:
            got = ValueError
        assert got == expected, head


@pytest.mark.parametrize("uuid_path", [("_meta", "uuid"), ("uuid",), ("a", "b", "c")])
def test_set_uuid_texts_sets_what_set_uuid_text_sets_message_by_message(
    uuid_path: tuple[str, ...],
) -> None:
    """The publisher's list path: each message ends as `set_uuid_text` leaves it, and one that
    cannot carry the UUID (set_uuid_text raises) is left as it was."""

    def messages() -> list[Any]:
        return [
            {"n": 1},
            {"n": 2, "_meta": {"other": True}},
            {"_meta": {"uuid": "old"}, "a": {"b": {}}},
            {"_meta": 5, "a": 5, "uuid": None},
            {"a": {"b": 7}},
            [1, 2],
            "text",
        ]

    dicts = DictMessages(uuid_path)
    texts = [f"text-{i}" for i in range(len(messages()))]
    one_by_one = messages()
    for msg, text in zip(one_by_one, texts, strict=True):
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            dicts.set_uuid_text(msg, text)
    together = messages()
    dicts.set_uuid_texts(together, texts)
    assert together == one_by_one
    assert together != messages()
    assert dicts.encode_lines(together) == b"".join(dicts.encode(m) + b"\n" for m in together)
