"""Hand-encoded wire forms of the two messages that carry journal content in bulk, so that a chunk
is copied once into its message instead of into a protobuf object and again when serialized. The
bytes are exactly what protobuf serializes (fields in number order, zero values omitted); the
tests compare them with protobuf's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# ReplicateRequest: content = 4 (bytes), content_delta = 5 (int64).
_REPLICATE_CONTENT = b"\x22"
_REPLICATE_DELTA = b"\x28"
# ReadResponse: offset = 3 (int64), content = 7 (bytes).
_READ_OFFSET = b"\x18"
_READ_CONTENT = b"\x3a"


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def replicate_content(content: bytes, content_delta: int) -> bytes:
    """ReplicateRequest(content=content, content_delta=content_delta), serialized."""
    if content_delta < 0:
        raise ValueError(f"negative content_delta {content_delta}")
    parts = [_REPLICATE_CONTENT, varint(len(content)), content] if content else []
    if content_delta:
        parts += [_REPLICATE_DELTA, varint(content_delta)]
    return b"".join(parts)


def read_content(offset: int, content: bytes) -> bytes:
    """ReadResponse(offset=offset, content=content), serialized."""
    if offset < 0:
        raise ValueError(f"negative offset {offset}")
    parts = [_READ_OFFSET, varint(offset)] if offset else []
    if content:
        parts += [_READ_CONTENT, varint(len(content)), content]
    return b"".join(parts)


def passing_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer which sends already-encoded bytes as they are."""

    def out(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return out
