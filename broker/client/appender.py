"""Appending to a journal: one all-or-nothing Append RPC streaming its content in chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from plumbing.tasks import first_of

# Content chunk size of appends: large enough to amortize per-message costs, small enough to
# keep gRPC's buffers and a replica's memory modest.
CHUNK = 1 << 17


class AppendError(RuntimeError):
    """An append the broker refused (a status other than OK); nothing was appended."""

    def __init__(self, journal: str, response: pb.AppendResponse, why: str = "") -> None:
        self.response = response
        self.status = response.status
        # Why, where the broker said (a refusal for want of brokers: see PLACEMENT; the store
        # and its failed health check, for FRAGMENT_STORE_UNHEALTHY).
        self.why = why or response.store_health_error
        why = self.why
        said = (
            f"{pb.Status.Name(response.status)}: {why}" if why else pb.Status.Name(response.status)
        )
        super().__init__(f"append to {journal}: {said}")


def _chunks(data: bytes, size: int) -> Iterable[bytes]:
    if not data:
        return  # An empty message would be read as the commit.
    if len(data) <= size:
        yield data
        return
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])


async def outcome(call: Any) -> Any:
    """`await call`, for a call that may be cancelled under its caller: grpc.aio raises
    asyncio.CancelledError from a call cancelled locally (its channel closed), which would read
    as the caller's own cancellation. That is the call's failure, CANCELLED, unless the caller
    is being cancelled itself."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        empty = grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED, empty, empty,
            "the call was cancelled (its channel closed)", None,
        ) from None  # fmt: skip


async def first_write(call: Any, message: object) -> None:
    """`call.write(message)` of a client-streaming call's first message, which ends when the
    call does: grpc.aio's write waits for the call's metadata to be sent, and waits for good
    when the call ended before that (its channel closed as it started). Then it raises
    InvalidStateError, as a write after the call finished does; the call's outcome is its
    status."""
    if call.done():
        raise asyncio.InvalidStateError("the call ended before its first message was sent")
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def end(_call: object) -> None:
        if not ended.done():
            ended.set_result(None)

    call.add_done_callback(end)
    # The write is first_of's own: cancelled and awaited if the call ends first.
    write, _ = await first_of(call.write(message), ended)
    if not write.done() or write.cancelled():
        raise asyncio.InvalidStateError("the call ended before its first message was sent")
    write.result()


async def _send(
    call: object,
    first: pb.AppendRequest,
    content: bytes | Iterable[bytes] | AsyncIterable[bytes],
    chunk_size: int,
    sent: list[bool],
    written: list[int],
) -> None:
    write = call.write  # type: ignore[attr-defined]
    await first_write(call, first)
    if isinstance(content, bytes | bytearray | memoryview):
        for chunk in _chunks(bytes(content), chunk_size):
            await write(pb.AppendRequest(content=chunk))
            written[0] += len(chunk)
    elif isinstance(content, AsyncIterable):
        async for piece in content:
            for chunk in _chunks(piece, chunk_size):
                await write(pb.AppendRequest(content=chunk))
                written[0] += len(chunk)
    else:
        for piece in content:
            for chunk in _chunks(piece, chunk_size):
                await write(pb.AppendRequest(content=chunk))
                written[0] += len(chunk)
    sent.append(True)  # From here the append may commit: its outcome is the broker's to say.
    await write(pb.AppendRequest())  # Commit.
    # grpc.aio's half-close fails so (ExecuteBatchError) when the call ended, by its deadline
    # or the broker's answer, just before it: the call's outcome, awaited next, is the append's.
    with contextlib.suppress(grpc.aio.InternalError):
        await call.done_writing()  # type: ignore[attr-defined]


async def append(
    stub: pb_grpc.JournalStub,
    journal: str,
    content: bytes | Iterable[bytes] | AsyncIterable[bytes],
    *,
    offset: int = 0,
    check_registers: pb.LabelSelector | None = None,
    union_registers: pb.LabelSet | None = None,
    subtract_registers: pb.LabelSet | None = None,
    do_not_proxy: bool = False,
    suspend: pb.AppendRequest.Suspend = pb.AppendRequest.SUSPEND_RESUME,
    timeout: float | None = None,
    check: bool = True,
    chunk_size: int = CHUNK,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> pb.AppendResponse:
    """Append `content` to `journal` as one transaction, and return the broker's response.

    With `check` (the default), a non-OK status raises AppendError. Content is streamed in
    messages of at most `chunk_size` bytes; the append commits only once all of it is sent
    (with the final empty chunk). Content given as one piece of at most `chunk_size` bytes
    goes in one unary call instead, with the parameters (`JournalStub.AppendWhole`), where
    the stub has it. `metadata` goes with the call (the HTTP gateway passes on its request's
    authorization).
    """
    first = pb.AppendRequest(
        journal=journal, offset=offset, do_not_proxy=do_not_proxy, suspend=suspend
    )
    if check_registers is not None:
        first.check_registers.CopyFrom(check_registers)
    if union_registers is not None:
        first.union_registers.CopyFrom(union_registers)
    if subtract_registers is not None:
        first.subtract_registers.CopyFrom(subtract_registers)
    if (
        getattr(stub, "whole_appends", False)
        and isinstance(content, bytes | bytearray | memoryview)
        and 0 < len(content) <= chunk_size
    ):
        first.content = bytes(content)
        whole = await _append_whole(stub, first, timeout, metadata)
        if whole is not None:
            return await _answer(journal, *whole, check)
        first.content = b""  # Refused as a form this broker does not know: streamed instead.
    call = stub.Append(timeout=timeout, metadata=metadata)
    sent: list[bool] = []
    written = [0]  # Content bytes sent.
    try:
        # A write fails when the broker already answered (a refusal before the content, or an
        # abort): its answer, or its error, is the call's outcome, awaited just below.
        # (grpc.aio raises InvalidStateError for a write after the call finished.)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await _send(call, first, content, chunk_size, sent, written)
        response: pb.AppendResponse = await outcome(call)
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        # The commit was on its way when the call failed: the append may have landed.
        exc.commit_sent = bool(sent)  # type: ignore[attr-defined]
        exc.repeatable = _repeatable(written[0], first)  # type: ignore[attr-defined]
        raise
    except BaseException:
        call.cancel()  # Without its commit chunk, the append rolls back everywhere.
        raise
    return await _answer(journal, call, response, check)


# How a broker that does not know the one-message form refuses it, before anything is appended:
# upstream's validation, and ours before we took the form.
_WHOLE_REFUSALS = ("unexpected Content", "must not carry content")


async def _append_whole(
    stub: pb_grpc.JournalStub,
    first: pb.AppendRequest,
    timeout: float | None,
    metadata: Sequence[tuple[str, str]] | None,
) -> tuple[Any, pb.AppendResponse] | None:
    """The append as one unary call whose message carries its parameters and whole content:
    the call and its response, or None when the broker refused the form itself (then the
    stub streams its appends from now on, and nothing was appended)."""
    call = stub.AppendWhole(first, timeout=timeout, metadata=metadata)  # type: ignore[attr-defined]
    try:
        response: pb.AppendResponse = await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT) and any(
            refusal in (exc.details() or "") for refusal in _WHOLE_REFUSALS
        ):
            stub.whole_appends = False  # type: ignore[attr-defined]
            return None
        call.cancel()
        # The commit went with the content, unless the call never left this process.
        exc.commit_sent = not _never_sent(exc)  # type: ignore[attr-defined]
        exc.repeatable = _repeatable(len(first.content), first)  # type: ignore[attr-defined]
        raise
    except BaseException:
        call.cancel()
        raise
    return call, response


def _repeatable(content: int, first: pb.AppendRequest) -> bool:
    """Whether an append may be sent again even though its commit may have landed: it wrote
    nothing (no content, no register change), so landing twice is landing once. A zero-byte
    append only checks registers, resumes or suspends the journal (`gazctl journals suspend`),
    or resets its head at an offset (`reset-head`): repeated, it finds that done already."""
    return (
        content == 0
        and not first.HasField("union_registers")
        and not first.HasField("subtract_registers")
    )


def _never_sent(exc: grpc.aio.AioRpcError) -> bool:
    """A unary call that failed before it had a connection to go on: an endpoint the dialer
    refuses, or gRPC's failure to pick a connection (every address refused it, or the name did
    not resolve). Anything else may have reached the broker."""
    from broker.client.dialer import EndpointRefused

    details = exc.details() or ""
    return isinstance(exc, EndpointRefused) or (
        exc.code() == grpc.StatusCode.UNAVAILABLE
        and details.startswith(("failed to connect to all addresses", "DNS resolution failed"))
    )


async def _answer(
    journal: str, call: Any, response: pb.AppendResponse, check: bool
) -> pb.AppendResponse:
    """The broker's response, or with `check` its refusal raised as AppendError (saying why,
    where the broker did: a refusal for want of brokers, see PLACEMENT)."""
    if check and response.status != pb.OK:
        from broker.client.journals import PLACEMENT

        why = ""
        for item in await call.initial_metadata() or ():
            if item[0] == PLACEMENT:
                why = str(item[1])
        raise AppendError(journal, response, why)
    return response


async def reset_head(stub: pb_grpc.JournalStub, journal: str) -> pb.AppendResponse:
    """Disaster recovery (`gazctl journals reset-head`): a zero-byte append at the journal's
    largest known offset. It tells the brokers that appends may continue there, which clears
    INDEX_HAS_GREATER_OFFSET: the operator confirms every earlier writer is gone."""
    from broker.client.reader import write_head

    head = await write_head(stub, journal)
    return await append(stub, journal, b"", offset=head, suspend=pb.AppendRequest.SUSPEND_KEEP)
