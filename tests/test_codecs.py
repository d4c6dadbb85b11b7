"""Tests of broker.fragment.codecs: round trips under every codec, compatibility with the
reference libraries' readers and writers, errors on corrupt or truncated streams, and bounded
memory when streaming large fragments."""

from __future__ import annotations

import array
import gzip
import hashlib
import io
import os
import random
import tracemalloc
import zlib
from pathlib import Path
from typing import BinaryIO, cast

import cramjam
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.fragment import codecs
from broker.fragment.codecs import CodecError
from broker.protocol import protocol_pb2 as pb

ALL_CODECS = [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION]
COMPRESSING = [pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION]
SNAPPY_STREAM_ID = b"\xff\x06\x00\x00sNaPpY"


def codec_id(codec: pb.CompressionCodec) -> str:
    return pb.CompressionCodec.Name(codec)


def compress_writes(
    codec: pb.CompressionCodec, writes: list[tuple[bytes, bool]]
) -> tuple[bytes, int, int]:
    """Compress `writes` (content, end the batch after it?), returning the stream and counters."""
    sink = io.BytesIO()
    c = codecs.compressor(codec, sink)
    for data, end_batch in writes:
        c.write(data)
        if end_batch:
            c.end_batch()
    c.close()
    return sink.getvalue(), c.bytes_in, c.bytes_out


def read_in_pieces(codec: pb.CompressionCodec, stream: bytes, size: int) -> bytes:
    d = codecs.decompressor(codec, io.BytesIO(stream))
    parts = []
    while piece := d.read(size):
        assert len(piece) <= size
        parts.append(piece)
    assert d.read(size) == b""
    d.close()
    return b"".join(parts)


def gzip_members(stream: bytes) -> list[bytes]:
    """The content of each member of a gzip stream, decoded member by member with zlib."""
    members = []
    while stream:
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        members.append(inflate.decompress(stream))
        assert inflate.eof
        stream = inflate.unused_data
    return members


def snappy_chunks(stream: bytes) -> list[tuple[int, int]]:
    """(chunk type, chunk length) of each chunk of a snappy framed stream."""
    chunks, at = [], 0
    while at < len(stream):
        kind, length = stream[at], int.from_bytes(stream[at + 1 : at + 4], "little")
        chunks.append((kind, length))
        at += 4 + length
    assert at == len(stream)
    return chunks


# Content mixing incompressible bytes with long runs, so that writes cross snappy's 64 KiB
# chunks and zstd's 128 KiB blocks.
segments = st.one_of(
    st.binary(max_size=3000),
    st.builds(lambda unit, n: unit * n, st.binary(min_size=1, max_size=8), st.integers(1, 20_000)),
)
writes_strategy = st.lists(st.tuples(segments, st.booleans()), max_size=20)


# --- Round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes=writes_strategy, piece=st.integers(1, 70_000))
def test_round_trip(
    codec: pb.CompressionCodec, writes: list[tuple[bytes, bool]], piece: int
) -> None:
    content = b"".join(data for data, _ in writes)
    stream, bytes_in, bytes_out = compress_writes(codec, writes)

    assert bytes_in == len(content)
    assert bytes_out == len(stream)
    assert codecs.decompress(codec, stream) == content
    assert read_in_pieces(codec, stream, piece) == content
    if codec == pb.NONE:
        assert stream == content


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_small_reads(codec: pb.CompressionCodec, size: int) -> None:
    content = os.urandom(5000) + b"gazette " * 20_000 + os.urandom(70_000)
    stream, _, _ = compress_writes(codec, [(content[:100_000], True), (content[100_000:], False)])
    assert read_in_pieces(codec, stream, size) == content


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
def test_empty_content(codec: pb.CompressionCodec) -> None:
    stream = codecs.compress(codec, b"")
    assert codecs.decompress(codec, stream) == b""
    assert codecs.decompress(codec, b"") == b""


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
def test_write_accepts_buffers(codec: pb.CompressionCodec) -> None:
    words = array.array("I", range(50_000))
    sink = io.BytesIO()
    c = codecs.compressor(codec, sink)
    c.write(memoryview(words))  # A non-byte format is written as its bytes.
    c.write(bytearray(b"tail"))
    c.write(memoryview(b"xyz")[1:])
    c.write(b"")
    c.close()
    content = words.tobytes() + b"tailyz"
    assert c.bytes_in == len(content)
    assert codecs.decompress(codec, sink.getvalue()) == content


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
def test_compressor_lifecycle(codec: pb.CompressionCodec) -> None:
    sink = io.BytesIO()
    with codecs.compressor(codec, sink) as c:
        c.write(b"hello")
    assert c.closed
    assert not sink.closed  # The sink is the caller's.
    c.close()  # Idempotent.
    assert codecs.decompress(codec, sink.getvalue()) == b"hello"
    with pytest.raises(ValueError, match="compressor is closed"):
        c.write(b"more")
    with pytest.raises(ValueError, match="compressor is closed"):
        c.end_batch()


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
def test_decompressor_is_a_readable_stream(codec: pb.CompressionCodec) -> None:
    content = b"0123456789" * 10_000
    source = io.BytesIO(codecs.compress(codec, content))
    with codecs.decompressor(codec, source) as d:
        assert d.readable()
        buf = bytearray(4096)
        assert d.readinto(buf) == 4096
        assert bytes(buf) == content[:4096]
        assert d.read(0) == b""
        assert d.read() == content[4096:]
        assert d.readinto(buf) == 0
    assert d.closed
    assert not source.closed  # The source is the caller's.
    with pytest.raises(ValueError, match="decompressor is closed"):
        d.read(1)
    # It also composes with io's buffered reader.
    buffered = io.BufferedReader(codecs.decompressor(codec, io.BytesIO(source.getvalue())))
    assert buffered.read() == content


@pytest.mark.parametrize("codec", [pb.INVALID, 99], ids=["INVALID", "99"])
def test_unknown_codec(codec: pb.CompressionCodec) -> None:
    with pytest.raises(ValueError, match=r"unsupported compression codec .*expected one of"):
        codecs.compressor(codec, io.BytesIO())
    with pytest.raises(ValueError, match="unsupported compression codec"):
        codecs.decompressor(codec, io.BytesIO())
    with pytest.raises(ValueError, match="unsupported compression codec"):
        codecs.content_encoding(codec)


def test_content_encoding() -> None:
    assert codecs.content_encoding(pb.GZIP_OFFLOAD_DECOMPRESSION) == "gzip"
    for codec in (pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY):
        assert codecs.content_encoding(codec) == ""


# --- Formats -------------------------------------------------------------------------------------


def test_gzip_member_per_batch() -> None:
    batches = [os.urandom(1000) + b"a" * 50_000, b"b" * 70_000, os.urandom(10)]
    writes: list[tuple[bytes, bool]] = []
    for batch in batches:
        writes += [(batch[:500], False), (batch[500:], True)]
    writes.append((b"", True))  # An empty batch adds no member.
    stream, _, _ = compress_writes(pb.GZIP, writes)

    assert stream.startswith(b"\x1f\x8b\x08")
    assert gzip_members(stream) == batches
    assert gzip.decompress(stream) == b"".join(batches)


def test_gzip_offload_is_one_member() -> None:
    writes = [(b"first batch " * 1000, True), (b"second batch " * 1000, True), (b"end", False)]
    stream, _, _ = compress_writes(pb.GZIP_OFFLOAD_DECOMPRESSION, writes)
    content = b"".join(data for data, _ in writes)
    assert gzip_members(stream) == [content]
    assert gzip.decompress(stream) == content


def test_gzip_reads_members_of_other_writers() -> None:
    parts = [b"one " * 100, b"", os.urandom(300_000), b"three"]
    stream = b"".join(
        gzip.compress(part, compresslevel=level)
        for part, level in zip(parts, (1, 9, 6, 0), strict=True)
    )
    assert codecs.decompress(pb.GZIP, stream) == b"".join(parts)
    assert read_in_pieces(pb.GZIP, stream, 13) == b"".join(parts)


def test_gzip_offload_passes_through_decompressed_content() -> None:
    content = b"already decompressed by the store\n" * 1000
    assert codecs.decompress(pb.GZIP_OFFLOAD_DECOMPRESSION, content) == content
    assert read_in_pieces(pb.GZIP_OFFLOAD_DECOMPRESSION, content, 5) == content
    assert codecs.decompress(pb.GZIP_OFFLOAD_DECOMPRESSION, b"\x1f") == b"\x1f"
    # Content still gzipped (the store served it as is) is gunzipped, whoever wrote it.
    assert codecs.decompress(pb.GZIP_OFFLOAD_DECOMPRESSION, gzip.compress(content)) == content


def test_snappy_framing() -> None:
    content = os.urandom(70_000) + b"snappy " * 30_000
    stream, _, _ = compress_writes(pb.SNAPPY, [(content[:1000], True), (content[1000:], False)])

    assert stream.startswith(SNAPPY_STREAM_ID)
    assert bytes(cramjam.snappy.decompress(stream)) == content
    chunks = snappy_chunks(stream)
    assert chunks[0] == (0xFF, 6)
    assert chunks.count((0xFF, 6)) == 1
    # Full 64 KiB blocks, then the rest: random bytes stored uncompressed, text compressed.
    assert chunks[1] == (0x01, 4 + 65536)
    assert all(kind == 0x00 for kind, _ in chunks[3:])
    assert len(chunks) == 1 + -(-len(content) // 65536)


def test_snappy_reads_other_writers() -> None:
    content = b"abc" * 100_000 + os.urandom(1000)
    other = bytes(cramjam.snappy.compress(content))
    assert codecs.decompress(pb.SNAPPY, other) == content
    # Concatenated streams, padding (0xfe) and reserved skippable (0x80) chunks are allowed.
    padding = b"\xfe\x03\x00\x00pad" + b"\x80\x00\x00\x00"
    stream = other + padding + bytes(cramjam.snappy.compress(b"more"))
    assert codecs.decompress(pb.SNAPPY, stream) == content + b"more"


def test_zstd_is_standard() -> None:
    content = b"zstandard " * 50_000 + os.urandom(200_000)
    stream, _, _ = compress_writes(
        pb.ZSTANDARD, [(content[:300_000], True), (content[300_000:], True)]
    )
    assert stream.startswith(b"\x28\xb5\x2f\xfd")
    decoder = zstandard.ZstdDecompressor().decompressobj()
    assert decoder.decompress(stream) == content
    assert decoder.eof


def test_zstd_reads_other_writers() -> None:
    one_shot = zstandard.ZstdCompressor(level=19).compress(b"one shot " * 1000)  # Sized frame.
    rle = zstandard.ZstdCompressor().compress(b"\x00" * 1_000_000)  # RLE blocks.
    empty = zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    skippable = (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!"
    chunked = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    streamed = chunked.compress(os.urandom(300_000)) + chunked.flush()

    stream = one_shot + skippable + rle + empty + streamed
    expected = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
    want = expected.decompress(stream)
    assert len(want) == 9000 + 1_000_000 + 300_000
    assert codecs.decompress(pb.ZSTANDARD, stream) == want
    assert read_in_pieces(pb.ZSTANDARD, stream, 4099) == want


# --- Corrupt and truncated streams ---------------------------------------------------------------


def assert_codec_error(codec: pb.CompressionCodec, stream: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match) as info:
        codecs.decompress(codec, stream)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(codec_id(codec))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("codec", COMPRESSING, ids=codec_id)
def test_every_truncation_is_an_error(codec: pb.CompressionCodec) -> None:
    content = b"truncate me " * 300 + os.urandom(300)
    stream = codecs.compress(codec, content)
    # A snappy stream of just its identifier is a valid empty stream, and a lone 0x1f is not the
    # gzip magic, so GZIP_OFFLOAD_DECOMPRESSION passes it through.
    first = {pb.SNAPPY: len(SNAPPY_STREAM_ID) + 1, pb.GZIP_OFFLOAD_DECOMPRESSION: 2}.get(codec, 1)
    for cut in range(first, len(stream)):
        assert_codec_error(codec, stream[:cut], "truncated")


@pytest.mark.parametrize("codec", COMPRESSING, ids=codec_id)
def test_truncated_later_batch(codec: pb.CompressionCodec) -> None:
    writes = [(b"batch one " * 20_000, True), (b"batch two " * 20_000, True), (b"end", False)]
    stream, _, _ = compress_writes(codec, writes)
    d = codecs.decompressor(codec, io.BytesIO(stream[:-5]))
    assert d.read(200_000) == writes[0][0]  # Content before the cut is readable...
    with pytest.raises(CodecError, match="truncated"):
        d.read()
    with pytest.raises(CodecError, match="truncated"):  # ... and the error sticks.
        d.read(1)


@pytest.mark.parametrize("codec", [pb.GZIP, pb.ZSTANDARD, pb.SNAPPY], ids=codec_id)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_flipped_byte_is_never_silent(codec: pb.CompressionCodec, data: st.DataObject) -> None:
    content = semi_compressible(10_000, seed=data.draw(st.integers(0, 2**32), label="seed"))
    stream = bytearray(codecs.compress(codec, content))
    # Past the headers, whose fields (gzip mtime and OS, zstd window size) are not all checked.
    at = data.draw(st.integers(20, len(stream) - 1), label="at")
    stream[at] ^= data.draw(st.integers(1, 255), label="xor")
    try:
        got = codecs.decompress(codec, bytes(stream))
    except CodecError as e:
        assert str(e).startswith(codec_id(codec))
        assert "corrupt" in str(e) or "truncated" in str(e)
    else:
        # Only a flip that leaves the content as it was (say, a copy from an equal earlier
        # stretch) may go unnoticed: checksums cover the content.
        assert got == content


@pytest.mark.parametrize(
    ("codec", "stream", "match"),
    [
        (pb.GZIP, b"not gzip at all", "corrupt in member 1: .*header"),
        (pb.GZIP, gzip.compress(b"ok") + b"trailing junk", "corrupt in member 2"),
        (pb.ZSTANDARD, b"not zstd at all", "corrupt: frame 1 has bad magic"),
        (
            pb.ZSTANDARD,
            zstandard.ZstdCompressor().compress(b"ok") + b"junk",
            "frame 2 has bad magic",
        ),
        (pb.ZSTANDARD, b"\x28\xb5\x2f\xfd\x00\x58" + b"\xff\xff\xff", "bad block header"),
        (pb.SNAPPY, bytes(cramjam.snappy.compress(b"ok"))[10:], "does not begin with a stream id"),
        (pb.SNAPPY, b"\xff\x06\x00\x00SnApPy", "bad stream identifier"),
        (pb.SNAPPY, SNAPPY_STREAM_ID + b"\x02\x00\x00\x00", "reserved unskippable chunk type 0x02"),
        (pb.SNAPPY, SNAPPY_STREAM_ID + b"\x00\xff\xff\xff", "bad chunk length"),
        (pb.GZIP_OFFLOAD_DECOMPRESSION, b"\x1f\x8b" + b"\x00" * 30, "corrupt in member 1"),
    ],
    ids=[
        "gzip-magic",
        "gzip-trailing",
        "zstd-magic",
        "zstd-trailing",
        "zstd-block",
        "snappy-no-id",
        "snappy-bad-id",
        "snappy-reserved",
        "snappy-length",
        "offload-corrupt",
    ],
)
def test_corrupt_streams(codec: pb.CompressionCodec, stream: bytes, match: str) -> None:
    assert_codec_error(codec, stream, match)


# --- Bounded memory ------------------------------------------------------------------------------


class RecordingSource(io.RawIOBase):
    """A file whose reads are recorded, to check that none asks for the whole source."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        self.largest_read = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise AssertionError("the decompressor read the whole source at once")
        self.largest_read = max(self.largest_read, size)
        return self._file.read(size)

    def close(self) -> None:
        self._file.close()
        super().close()


def semi_compressible(size: int, seed: int = 0) -> bytes:
    """Lines of a word from a small vocabulary and a random token: compresses to 1/4 (zlib, zstd)
    or 1/2 (snappy)."""
    rng = random.Random(seed)
    vocabulary = [rng.randbytes(3 + n % 10).hex().encode() for n in rng.randbytes(256)]
    tokens = rng.randbytes(size // 2).hex().encode()
    lines = (
        vocabulary[n] + tokens[6 * i : 6 * i + 6] for i, n in enumerate(rng.randbytes(size // 8))
    )
    content = b"\n".join(lines)
    assert len(content) >= size
    return content[:size]


def stream_to_file(codec: pb.CompressionCodec, path: Path, content: bytes) -> int:
    """Compress `content` into `path` in spool-sized batches, returning the peak traced memory."""
    view = memoryview(content)
    tracemalloc.start()
    try:
        with path.open("wb") as sink, codecs.compressor(codec, sink) as c:
            for at in range(0, len(view), 64 * 1024):
                c.write(view[at : at + 64 * 1024])
                if (at + 64 * 1024) % codecs.BATCH_SIZE == 0:
                    c.end_batch()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def stream_from_file(codec: pb.CompressionCodec, path: Path) -> tuple[bytes, int, int]:
    """Read `path` back in 64 KiB pieces: (SHA-256 of the content, its length, peak memory)."""
    source = RecordingSource(path)
    digest, length = hashlib.sha256(), 0
    tracemalloc.start()
    try:
        with codecs.decompressor(codec, cast(BinaryIO, source)) as d:
            while piece := d.read(64 * 1024):
                digest.update(piece)
                length += len(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        source.close()
    assert source.largest_read <= 1 << 20
    return digest.digest(), length, peak


@pytest.fixture(scope="module")
def large_content() -> bytes:
    return semi_compressible(20 << 20)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=codec_id)
def test_large_content_streams_in_bounded_memory(
    codec: pb.CompressionCodec, large_content: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "fragment"
    write_peak = stream_to_file(codec, path, large_content)
    if codec != pb.NONE:
        assert path.stat().st_size < len(large_content) * 0.7
    digest, length, read_peak = stream_from_file(codec, path)

    assert length == len(large_content)
    assert digest == hashlib.sha256(large_content).digest()
    assert write_peak < 4 << 20, write_peak
    assert read_peak < 4 << 20, read_peak


@pytest.mark.parametrize("codec", [pb.GZIP, pb.ZSTANDARD, pb.SNAPPY], ids=codec_id)
def test_highly_compressed_content_streams_in_bounded_memory(
    codec: pb.CompressionCodec, tmp_path: Path
) -> None:
    # 64 MiB of zeros compresses to almost nothing; output is still produced in bounded pieces.
    zeros = bytes(64 << 20)
    path = tmp_path / "zeros"
    stream_to_file(codec, path, zeros)
    assert path.stat().st_size < 4 << 20
    digest, length, read_peak = stream_from_file(codec, path)
    assert length == len(zeros)
    assert digest == hashlib.sha256(zeros).digest()
    assert read_peak < 4 << 20, read_peak
