"""Hand-encoded wire forms of the two messages that carry journal content in bulk, so that a chunk
is copied once into its message instead of into a protobuf object and again when serialized. The
bytes are exactly what protobuf serializes (fields in number order, zero values omitted); the
tests compare them with protobuf's own. And `refusing_undecodable`: request bytes that are not
protobuf answered INVALID_ARGUMENT, not UNKNOWN."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from broker.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _Generic = grpc.GenericRpcHandler[Any, Any]

# ReplicateRequest: content = 4 (bytes), content_delta = 5 (int64).
_REPLICATE_CONTENT = b"\x22"
_REPLICATE_DELTA = b"\x28"
# ReadResponse: offset = 3 (int64), content = 7 (bytes).
_READ_OFFSET = b"\x18"
_READ_CONTENT = b"\x3a"
_READ_OFFSET_TAG = _READ_OFFSET[0]
_READ_CONTENT_TAG = _READ_CONTENT[0]
_INT64_SIGN = 1 << 63


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


def read_content(offset: int, content: bytes | memoryview) -> bytes:
    """ReadResponse(offset=offset, content=content), serialized."""
    if offset < 0:
        raise ValueError(f"negative offset {offset}")
    parts: list[bytes | memoryview] = [_READ_OFFSET, varint(offset)] if offset else []
    if content:
        parts += [_READ_CONTENT, varint(len(content)), content]
    return b"".join(parts)


class ReadContent:
    """A Read response carrying content at an offset and nothing else (what a broker streams a
    fragment's content in), parsed by hand by `parse_read_response`: `content` is copied once
    out of the message's bytes (protobuf's parse copies it into the message, and every access of
    its field copies it again). `raw` is the message as received, which a proxy relays as it is.
    It reads as the protobuf message would: status OK and every other field unset."""

    __slots__ = ("content", "offset", "raw")

    status = 0  # pb.OK
    write_head = 0
    fragment_url = ""

    def __init__(self, raw: bytes, offset: int, content: bytes) -> None:
        self.raw = raw
        self.offset = offset
        self.content = content

    @property
    def header(self) -> pb.Header:
        return pb.Header()

    @property
    def fragment(self) -> pb.Fragment:
        return pb.Fragment()

    def HasField(self, name: str) -> bool:
        if name not in ("header", "fragment"):
            raise ValueError(f'ReadResponse has no message field "{name}"')
        return False

    def SerializeToString(self) -> bytes:
        return self.raw

    def __repr__(self) -> str:
        return f"ReadContent(offset={self.offset}, content=<{len(self.content)} bytes>)"


def _varint_at(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `data[at]` and the position after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def parse_read_response(data: bytes) -> Any:
    """A serialized ReadResponse: a `ReadContent` when it is exactly what `read_content`
    encodes (an offset, then content reaching to its end), else the protobuf message."""
    try:
        offset = 0
        at = 0
        if data[0] == _READ_OFFSET_TAG:
            offset, at = _varint_at(data, 1)
        if data[at] == _READ_CONTENT_TAG and offset < _INT64_SIGN:
            length, at = _varint_at(data, at + 1)
            if at + length == len(data):
                return ReadContent(data, offset, data[at:])
    except IndexError:
        pass
    return pb.ReadResponse.FromString(data)


def passing_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer which sends already-encoded bytes as they are."""

    def out(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return out


# --- Requests that are not protobuf ---------------------------------------------------------------


class Undecodable:
    """What a request that does not parse is deserialized to (see `refusing_undecodable`)."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _lenient(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def out(data: bytes) -> Any:
        if parse is None:
            return data
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or any other refusal of these bytes.
            return Undecodable(
                f"the request is not a valid protobuf message ({len(data)} bytes): {exc}"
            )

    return out


class _CheckedRequests:
    """A handler's request stream, which aborts the RPC with INVALID_ARGUMENT at a message that
    did not parse, and remembers the abort so that it is what the RPC ends with."""

    def __init__(self, requests: AsyncIterator[Any], context: Any) -> None:
        self._requests = requests
        self._context = context
        self.aborted: BaseException | None = None

    def __aiter__(self) -> _CheckedRequests:
        return self

    async def __anext__(self) -> Any:
        request = await anext(self._requests)
        if isinstance(request, Undecodable):
            try:
                await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            except BaseException as exc:
                self.aborted = exc
                raise
        return request

    def reraise(self) -> None:
        """The handler ended (perhaps by trying to abort again, which gRPC refuses): end the
        RPC with the abort that answered the client."""
        if self.aborted is not None:
            raise self.aborted


def _refusing(handler: _Handler) -> _Handler:
    parse = _lenient(handler.request_deserializer)
    serialize = handler.response_serializer
    # The stubs type these for synchronous gRPC; here they are grpc.aio coroutines.
    unary_unary: Any = handler.unary_unary
    unary_stream: Any = handler.unary_stream
    stream_unary: Any = handler.stream_unary
    stream_stream: Any = handler.stream_stream
    if unary_unary is not None:

        async def checked_unary_unary(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(checked_unary_unary, parse, serialize)
    if unary_stream is not None:

        async def checked_unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            async for response in unary_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(checked_unary_stream, parse, serialize)
    if stream_unary is not None:

        async def checked_stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            checked = _CheckedRequests(requests, context)
            try:
                response = await stream_unary(checked, context)
            except Exception:
                checked.reraise()
                raise
            checked.reraise()
            return response

        return grpc.stream_unary_rpc_method_handler(checked_stream_unary, parse, serialize)
    assert stream_stream is not None

    async def checked_stream_stream(
        requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        checked = _CheckedRequests(requests, context)
        try:
            async for response in stream_stream(checked, context):
                yield response
        except Exception:
            checked.reraise()
            raise
        checked.reraise()

    return grpc.stream_stream_rpc_method_handler(checked_stream_stream, parse, serialize)


class _RefusingUndecodable(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, handler: _Generic) -> None:
        self._handler = handler
        self._wrapped: dict[str, _Handler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> _Handler | None:
        method = handler_call_details.method
        if method not in self._wrapped:
            found = self._handler.service(handler_call_details)
            if found is None:
                return None
            self._wrapped[method] = _refusing(found)
        return self._wrapped[method]


def refusing_undecodable(handler: _Generic) -> _Generic:
    """`handler` (grpc.aio methods), answering a request message that is not valid protobuf
    with INVALID_ARGUMENT and one line, rather than gRPC's UNKNOWN and a logged traceback. A
    stream ends at its first such message, which the handler sees as its client going away."""
    return _RefusingUndecodable(handler)
