"""Streaming compression codecs of fragment files.

A fragment persisted to a store is compressed with its journal's codec. The formats match
upstream Gazette's, so either implementation reads fragments written by the other:

- NONE: the content as is.
- GZIP: a sequence of gzip members (RFC 1952). Spools compress in batches of `BATCH_SIZE`, and
  each batch is its own member.
- GZIP_OFFLOAD_DECOMPRESSION: a single gzip member across all batches (as upstream writes it),
  stored with ``Content-Encoding: gzip`` so that the store may decompress it on download.
- ZSTANDARD: a stream of standard zstd frames.
- SNAPPY: the snappy framing format (stream identifier chunk, then CRC-32C checked chunks of at
  most 64 KiB), as Go's ``snappy.NewBufferedWriter`` writes it.

Compressors write to a sink as they go, with bounded internal buffering. Decompressors are
readable streams over a source that pull input in bounded pieces and yield bounded pieces of
output, so memory stays bounded whatever the fragment size; a corrupt or truncated stream raises
`CodecError`.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Generator
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeAlias

import cramjam
import zstandard

from broker.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BATCH_SIZE",
    "GZIP_LEVEL",
    "ZSTD_LEVEL",
    "CodecError",
    "Compressor",
    "Decompressor",
    "compress",
    "compressor",
    "content_encoding",
    "decompress",
    "decompressor",
]

BATCH_SIZE = 1 << 20
"""Uncompressed bytes that a spool accumulates before compressing them as one batch."""

GZIP_LEVEL = 6
"""Default deflate level: zlib's default. Upstream also uses its gzip library's default level.
Level 1 compresses about three times faster for a slightly larger file."""

ZSTD_LEVEL = 3
"""Default zstd level: the zstd library's own default, a good balance of speed and ratio."""

_Chunks: TypeAlias = Generator[bytes, None, None]

_CODECS = (pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION)

# Bytes requested from a source per read, and the most output a gzip step produces.
_READ_SIZE = 128 * 1024
_GZIP_OUT_SIZE = 256 * 1024

_GZIP_MAGIC = b"\x1f\x8b"
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # A gzip header and trailer around a deflate stream.

_SNAPPY_STREAM_ID = b"\xff\x06\x00\x00sNaPpY"
_SNAPPY_BLOCK = 1 << 16  # Most uncompressed bytes in one chunk.
_SNAPPY_MAX_ENCODED = 32 + _SNAPPY_BLOCK + _SNAPPY_BLOCK // 6  # Worst case of a 64 KiB block.

_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE_MASK = 0xFFFFFFF0
_ZSTD_SKIPPABLE_MAGIC = 0x184D2A50
_ZSTD_MAX_BLOCK = 1 << 17
_U32 = struct.Struct("<I")


class CodecError(ValueError):
    """A compressed stream is corrupt or truncated."""


def _codec_name(codec: int) -> str:
    try:
        return pb.CompressionCodec.Name(codec)
    except ValueError:
        return str(codec)


def _check_codec(codec: int) -> None:
    if codec not in _CODECS:
        raise ValueError(
            f"unsupported compression codec {_codec_name(codec)} ({codec}); expected one of "
            "NONE, GZIP, ZSTANDARD, SNAPPY, GZIP_OFFLOAD_DECOMPRESSION"
        )


def content_encoding(codec: pb.CompressionCodec) -> str:
    """The Content-Encoding a store sets on a fragment of `codec`: "gzip" when the store may
    decompress it on download (GZIP_OFFLOAD_DECOMPRESSION), else ""."""
    _check_codec(codec)
    return "gzip" if codec == pb.GZIP_OFFLOAD_DECOMPRESSION else ""


# --- Compression ---------------------------------------------------------------------------------


class _Sink(Protocol):
    def write(self, data: Buffer, /) -> object: ...


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Compressor:
    """Compresses written content into a sink under one codec (NONE writes it through).

    `bytes_in` counts content written and `bytes_out` the compressed bytes given to the sink.
    `close` finishes the stream but does not close the sink.
    """

    def __init__(self, codec: pb.CompressionCodec, sink: BinaryIO | _Sink) -> None:
        self.codec = codec
        self.bytes_in = 0
        self.bytes_out = 0
        self._sink = sink
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, data: Buffer) -> None:
        """Compress `data` and write what is ready of it to the sink."""
        if self._closed:
            raise ValueError(f"{_codec_name(self.codec)} compressor is closed; cannot write")
        view = _byte_view(data)
        if view.nbytes:
            self.bytes_in += view.nbytes
            self._write(view)

    def end_batch(self) -> None:
        """End a batch of content. GZIP closes its current member (the next write starts a new
        one); other codecs do nothing, as upstream does, rather than flush partial blocks."""
        if self._closed:
            raise ValueError(f"{_codec_name(self.codec)} compressor is closed; cannot end a batch")
        self._end_batch()

    def close(self) -> None:
        """Write out buffered content and the stream's trailer. Idempotent."""
        if not self._closed:
            self._close()
            self._closed = True

    def __enter__(self) -> Compressor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _emit(self, out: Buffer) -> None:
        n = memoryview(out).nbytes
        if n:
            self._sink.write(out)
            self.bytes_out += n

    def _write(self, view: memoryview) -> None:
        self._emit(view)

    def _end_batch(self) -> None:
        pass

    def _close(self) -> None:
        pass


class _GzipCompressor(Compressor):
    def __init__(
        self, codec: pb.CompressionCodec, sink: BinaryIO | _Sink, level: int, members: bool
    ) -> None:
        super().__init__(codec, sink)
        self._level = level
        self._members = members  # Whether each batch is its own member.
        self._deflate: zlib._Compress | None = None

    def _write(self, view: memoryview) -> None:
        if self._deflate is None:
            self._deflate = zlib.compressobj(self._level, zlib.DEFLATED, _GZIP_WBITS)
        self._emit(self._deflate.compress(view))

    def _finish_member(self) -> None:
        if self._deflate is not None:
            self._emit(self._deflate.flush(zlib.Z_FINISH))
            self._deflate = None

    def _end_batch(self) -> None:
        if self._members:
            self._finish_member()

    def _close(self) -> None:
        self._finish_member()


class _ZstdCompressor(Compressor):
    def __init__(self, codec: pb.CompressionCodec, sink: BinaryIO | _Sink, level: int) -> None:
        super().__init__(codec, sink)
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self._zobj: zstandard.ZstdCompressionObj | None = None

    def _write(self, view: memoryview) -> None:
        if self._zobj is None:
            self._zobj = self._cctx.compressobj()
        self._emit(self._zobj.compress(view))

    def _close(self) -> None:
        if self._zobj is not None:
            self._emit(self._zobj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
            self._zobj = None


class _SnappyCompressor(Compressor):
    """Buffers content into 64 KiB blocks, and frames each as a chunk as soon as it is full."""

    def __init__(self, codec: pb.CompressionCodec, sink: BinaryIO | _Sink) -> None:
        super().__init__(codec, sink)
        self._pending = bytearray()
        self._started = False

    def _frame(self, blocks: Buffer) -> None:
        # cramjam frames its input in 64 KiB chunks behind a stream identifier; the identifier
        # is kept only at the start of our stream.
        framed = memoryview(cramjam.snappy.compress(blocks))
        self._emit(framed if not self._started else framed[len(_SNAPPY_STREAM_ID) :])
        self._started = True

    def _write(self, view: memoryview) -> None:
        pending = self._pending
        if pending:
            take = min(_SNAPPY_BLOCK - len(pending), view.nbytes)
            pending += view[:take]
            view = view[take:]
            if len(pending) < _SNAPPY_BLOCK:
                return
            self._frame(pending)
            pending.clear()
        whole = view.nbytes - view.nbytes % _SNAPPY_BLOCK
        if whole:
            self._frame(view[:whole])
        pending += view[whole:]

    def _close(self) -> None:
        if self._pending:
            self._frame(self._pending)
            self._pending = bytearray()


def compressor(
    codec: pb.CompressionCodec, sink: BinaryIO | _Sink, *, level: int | None = None
) -> Compressor:
    """A Compressor of `codec` writing into `sink`. `level` overrides the codec's default level
    (GZIP_LEVEL or ZSTD_LEVEL); other codecs have none."""
    _check_codec(codec)
    if codec == pb.GZIP or codec == pb.GZIP_OFFLOAD_DECOMPRESSION:
        return _GzipCompressor(
            codec, sink, GZIP_LEVEL if level is None else level, members=codec == pb.GZIP
        )
    if codec == pb.ZSTANDARD:
        return _ZstdCompressor(codec, sink, ZSTD_LEVEL if level is None else level)
    if codec == pb.SNAPPY:
        return _SnappyCompressor(codec, sink)
    return Compressor(codec, sink)


def compress(codec: pb.CompressionCodec, data: Buffer) -> bytes:
    """`data` compressed under `codec`, as a single batch."""
    out = io.BytesIO()
    with compressor(codec, out) as c:
        c.write(data)
    return out.getvalue()


# --- Decompression -------------------------------------------------------------------------------


class _Input:
    """Buffered reads of a source, in pieces of bounded size."""

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self._buf = b""
        self._pos = 0
        self._eof = False
        self.consumed = 0

    def take(self, n: int) -> bytes:
        """The next `n` bytes; fewer only at the end of the source."""
        buf, pos = self._buf, self._pos
        have = len(buf) - pos
        if have >= n:
            self._pos = pos + n
            self.consumed += n
            return buf if pos == 0 and n == len(buf) else buf[pos : pos + n]

        parts = [buf[pos:]] if have else []
        self._buf, self._pos = b"", 0
        while have < n and not self._eof:
            chunk = self._source.read(max(n - have, _READ_SIZE))
            if not chunk:
                self._eof = True
                break
            parts.append(bytes(chunk))
            have += len(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) > n:
            self._buf, self._pos = data, n
            data = data[:n]
        self.consumed += len(data)
        return data

    def unread(self, data: bytes) -> None:
        """Push `data` back in front of the unread input."""
        if data:
            self._buf = data + self._buf[self._pos :]
            self._pos = 0
            self.consumed -= len(data)


def _raw_chunks(inp: _Input) -> _Chunks:
    while chunk := inp.take(_READ_SIZE):
        yield chunk


def _gzip_chunks(inp: _Input, name: str) -> _Chunks:
    member = 0
    inflate: zlib._Decompress | None = None
    while True:
        try:
            if inflate is not None and inflate.eof:
                inp.unread(inflate.unused_data)
                inflate = None
                continue
            if inflate is not None and inflate.unconsumed_tail:
                out = inflate.decompress(inflate.unconsumed_tail, _GZIP_OUT_SIZE)
            else:
                data = inp.take(_READ_SIZE)
                if not data:
                    if inflate is None:
                        return
                    # Drain output zlib may hold back, before judging the member cut short.
                    out = inflate.decompress(b"", _GZIP_OUT_SIZE)
                    if out:
                        yield out
                        continue
                    if inflate.eof:
                        continue
                    raise CodecError(
                        f"{name} stream is truncated: member {member} ends before its trailer"
                    )
                if inflate is None:
                    inflate = zlib.decompressobj(_GZIP_WBITS)
                    member += 1
                out = inflate.decompress(data, _GZIP_OUT_SIZE)
        except zlib.error as e:
            raise CodecError(f"{name} stream is corrupt in member {member}: {e}") from None
        if out:
            yield out


def _gzip_offload_chunks(inp: _Input) -> _Chunks:
    # The store may have decompressed the content already, in which case it is not gzip.
    head = inp.take(len(_GZIP_MAGIC))
    inp.unread(head)
    if head == _GZIP_MAGIC:
        yield from _gzip_chunks(inp, _codec_name(pb.GZIP_OFFLOAD_DECOMPRESSION))
    else:
        yield from _raw_chunks(inp)


def _snappy_chunks(inp: _Input) -> _Chunks:
    name = _codec_name(pb.SNAPPY)

    def need(n: int, what: str) -> bytes:
        data = inp.take(n)
        if len(data) < n:
            raise CodecError(f"{name} stream is truncated: it ends within {what}")
        return data

    started = False
    while header := inp.take(4):
        if len(header) < 4:
            raise CodecError(f"{name} stream is truncated: it ends within a chunk header")
        (word,) = _U32.unpack(header)
        kind, length = word & 0xFF, word >> 8
        at = inp.consumed - 4
        if kind == 0xFF:
            if length != 6 or header + need(length, "the stream identifier") != _SNAPPY_STREAM_ID:
                raise CodecError(f"{name} stream is corrupt: bad stream identifier at byte {at}")
            started = True
        elif not started:
            raise CodecError(
                f"{name} stream is corrupt: it does not begin with a stream identifier"
            )
        elif kind <= 0x01:
            limit = _SNAPPY_MAX_ENCODED if kind == 0x00 else _SNAPPY_BLOCK
            if not 4 <= length <= 4 + limit:
                raise CodecError(
                    f"{name} stream is corrupt: bad chunk length {length} at byte {at}"
                )
            body = need(length, "a data chunk")
            try:
                out = cramjam.snappy.decompress(b"".join((_SNAPPY_STREAM_ID, header, body)))
            except cramjam.DecompressionError as e:
                raise CodecError(f"{name} stream is corrupt at byte {at}: {e}") from None
            if len(out) > _SNAPPY_BLOCK:
                raise CodecError(f"{name} stream is corrupt: chunk at byte {at} is over 64 KiB")
            yield bytes(out)
        elif kind >= 0x80:  # Padding and reserved skippable chunks.
            while length:
                length -= len(need(min(length, _READ_SIZE), "a skippable chunk"))
        else:
            raise CodecError(
                f"{name} stream is corrupt: reserved unskippable chunk type {kind:#04x} at byte {at}"
            )


def _zstd_chunks(inp: _Input) -> _Chunks:
    """Walks frames and blocks, feeding the decompressor one block at a time: a block holds at
    most 128 KiB of content, which bounds each output, and a stream cut short is noticed (zstd's
    own stream reader silently ends at a truncated frame)."""
    name = _codec_name(pb.ZSTANDARD)
    dctx = zstandard.ZstdDecompressor()
    frame = 0

    def need(n: int, what: str) -> bytes:
        data = inp.take(n)
        if len(data) < n:
            raise CodecError(f"{name} stream is truncated: it ends within {what} of frame {frame}")
        return data

    while magic := inp.take(4):
        frame += 1
        if len(magic) < 4:
            raise CodecError(
                f"{name} stream is truncated: it ends within the magic of frame {frame}"
            )
        (number,) = _U32.unpack(magic)
        if number & _ZSTD_SKIPPABLE_MASK == _ZSTD_SKIPPABLE_MAGIC:
            (length,) = _U32.unpack(need(4, "the skippable frame size"))
            while length:
                length -= len(need(min(length, _READ_SIZE), "the skippable frame"))
            continue
        if number != _ZSTD_MAGIC:
            raise CodecError(
                f"{name} stream is corrupt: frame {frame} has bad magic {number:#010x}"
            )

        descriptor = need(1, "the frame header")
        flags = descriptor[0]
        single_segment = flags >> 5 & 1
        header_len = (
            (1 - single_segment)  # Window descriptor.
            + (0, 1, 2, 4)[flags & 3]  # Dictionary ID.
            + (single_segment, 2, 4, 8)[flags >> 6]  # Frame content size.
        )
        decoder = dctx.decompressobj()
        try:
            decoder.decompress(magic + descriptor + need(header_len, "the frame header"))
            while True:
                block_header = need(3, "a block header")
                word = int.from_bytes(block_header, "little")
                block_type, block_size = word >> 1 & 3, word >> 3
                if block_type == 3 or block_size > _ZSTD_MAX_BLOCK:
                    raise CodecError(f"{name} stream is corrupt: bad block header in frame {frame}")
                # An RLE block holds one byte, repeated block_size times.
                body = need(1 if block_type == 1 else block_size, "a block")
                out = decoder.decompress(block_header + body)
                if out:
                    yield out
                if word & 1:  # Last block of the frame.
                    break
            if flags & 0x04:
                out = decoder.decompress(need(4, "the checksum"))
                if out:
                    yield out
        except zstandard.ZstdError as e:
            raise CodecError(f"{name} stream is corrupt in frame {frame}: {e}") from None
        if not decoder.eof:
            raise CodecError(
                f"{name} stream is corrupt: frame {frame} does not end after its last block"
            )


class Decompressor(io.RawIOBase):
    """A readable stream of the content of a compressed source.

    `read(n)` returns exactly `n` bytes unless the content ends first. `close` releases the
    decompressor but does not close the source. An error reading a corrupt or truncated stream
    is raised again by every later read.
    """

    def __init__(self, codec: pb.CompressionCodec, chunks: _Chunks) -> None:
        super().__init__()
        self.codec = codec
        self._chunks = chunks
        self._pending = b""
        self._pos = 0
        self._error: CodecError | None = None

    def readable(self) -> bool:
        return True

    def _next(self) -> bytes:
        """The next piece of content, or b"" at its end."""
        if self._error is not None:
            raise self._error
        try:
            return next(self._chunks, b"")
        except CodecError as e:
            self._error = e
            raise

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{_codec_name(self.codec)} decompressor is closed; cannot read")

    def read(self, size: int | None = -1) -> bytes:
        """Up to `size` bytes of content (all the rest if `size` < 0); b"" at its end."""
        self._check_open()
        if size is None or size < 0:
            return self.readall()
        pending, pos = self._pending, self._pos
        have = len(pending) - pos
        if have >= size:
            self._pos = pos + size
            return pending if pos == 0 and size == len(pending) else pending[pos : pos + size]

        parts = [pending[pos:]] if have else []
        self._pending, self._pos = b"", 0
        while have < size:
            chunk = self._next()
            if not chunk:
                break
            want = size - have
            if len(chunk) > want:
                parts.append(chunk[:want])
                self._pending, self._pos = chunk, want
                break
            parts.append(chunk)
            have += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readall(self) -> bytes:
        """All the rest of the content."""
        self._check_open()
        parts = [self._pending[self._pos :]]
        self._pending, self._pos = b"", 0
        while chunk := self._next():
            parts.append(chunk)
        return b"".join(parts)

    def readinto(self, buffer: Buffer) -> int:
        """Fill `buffer` with content, returning the count of bytes read (0 at its end)."""
        view = _byte_view(buffer)
        data = self.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._chunks.close()
            self._pending, self._pos = b"", 0
        super().close()


def decompressor(codec: pb.CompressionCodec, source: BinaryIO) -> Decompressor:
    """A readable stream of `source`'s content, compressed under `codec`.

    GZIP reads any number of concatenated members. GZIP_OFFLOAD_DECOMPRESSION gunzips a source
    beginning with the gzip magic, and passes any other through as already decompressed by the
    store.
    """
    _check_codec(codec)
    inp = _Input(source)
    chunks: _Chunks
    if codec == pb.GZIP:
        chunks = _gzip_chunks(inp, _codec_name(codec))
    elif codec == pb.GZIP_OFFLOAD_DECOMPRESSION:
        chunks = _gzip_offload_chunks(inp)
    elif codec == pb.ZSTANDARD:
        chunks = _zstd_chunks(inp)
    elif codec == pb.SNAPPY:
        chunks = _snappy_chunks(inp)
    else:
        chunks = _raw_chunks(inp)
    return Decompressor(codec, chunks)


def decompress(codec: pb.CompressionCodec, data: Buffer) -> bytes:
    """The content of `data`, compressed under `codec`."""
    with decompressor(codec, io.BytesIO(data)) as d:
        return d.readall()
