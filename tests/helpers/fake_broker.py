"""A fake broker serving one journal as upstream's does, for the client's tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc


class UpstreamLikeJournal(pb_grpc.JournalServicer):
    """Append as upstream's broker validates it: content in the first message is refused
    ("unexpected Content", status UNKNOWN as a Go error returned from the handler); the
    streamed form is taken, and committed at the next offset."""

    def __init__(self) -> None:
        self.refused = 0
        self.committed: list[bytes] = []

    async def Append(
        self, request_iterator: AsyncIterator[pb.AppendRequest], context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        first = await anext(request_iterator)
        if first.content:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNKNOWN, "unexpected Content")
        content, committed = b"", False
        async for request in request_iterator:
            if not request.content:
                committed = True
            content += request.content
        if not committed:
            await context.abort(grpc.StatusCode.ABORTED, "no commit message")
        begin = sum(len(c) for c in self.committed)
        self.committed.append(content)
        return pb.AppendResponse(
            status=pb.OK,
            commit=pb.Fragment(journal=first.journal, begin=begin, end=begin + len(content)),
        )


@contextlib.asynccontextmanager
async def fake_broker(
    servicer: pb_grpc.JournalServicer,
) -> AsyncIterator[tuple[grpc.aio.Server, str]]:
    """A gRPC server of `servicer` alone on 127.0.0.1, and its address; stopped on exit."""
    server = grpc.aio.server()
    pb_grpc.add_JournalServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop(None)
