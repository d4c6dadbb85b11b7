"""Appending to a journal: one all-or-nothing Append RPC streaming its content in chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Iterable, Sequence

import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc

# Content chunk size of appends: large enough to amortize per-message costs, small enough to
# keep gRPC's buffers and a replica's memory modest.
CHUNK = 1 << 17


class AppendError(RuntimeError):
    """An append the broker refused (a status other than OK); nothing was appended."""

    def __init__(self, journal: str, response: pb.AppendResponse, why: str = "") -> None:
        self.response = response
        self.status = response.status
        # Why, where the broker said (a refusal for want of brokers: see PLACEMENT).
        self.why = why
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


async def _send(
    call: object,
    first: pb.AppendRequest,
    content: bytes | Iterable[bytes] | AsyncIterable[bytes],
    chunk_size: int,
    sent: list[bool],
) -> None:
    write = call.write  # type: ignore[attr-defined]
    await write(first)
    if isinstance(content, bytes | bytearray | memoryview):
        for chunk in _chunks(bytes(content), chunk_size):
            await write(pb.AppendRequest(content=chunk))
    elif isinstance(content, AsyncIterable):
        async for piece in content:
            for chunk in _chunks(piece, chunk_size):
                await write(pb.AppendRequest(content=chunk))
    else:
        for piece in content:
            for chunk in _chunks(piece, chunk_size):
                await write(pb.AppendRequest(content=chunk))
    sent.append(True)  # From here the append may commit: its outcome is the broker's to say.
    await write(pb.AppendRequest())  # Commit.
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
    (with the final empty chunk). `metadata` goes with the call (the HTTP gateway passes on
    its request's authorization).
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
    call = stub.Append(timeout=timeout, metadata=metadata)
    sent: list[bool] = []
    try:
        # A write fails when the broker already answered (a refusal before the content, or an
        # abort): its answer, or its error, is the call's outcome, awaited just below.
        # (grpc.aio raises InvalidStateError for a write after the call finished.)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await _send(call, first, content, chunk_size, sent)
        response: pb.AppendResponse = await call
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        # The commit was on its way when the call failed: the append may have landed.
        exc.commit_sent = bool(sent)  # type: ignore[attr-defined]
        raise
    except BaseException:
        call.cancel()  # Without its commit chunk, the append rolls back everywhere.
        raise
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
