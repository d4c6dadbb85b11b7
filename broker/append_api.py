"""The Append RPC: runs the append FSM, polices the client's flow rate, and proxies to the
primary when this broker is not it.

The FSM runs in a task of its own so that a client cancelling its RPC cannot interrupt the
machinery half-way: the client's departure becomes a client error, which rolls the append back
on every replica before the pipeline is released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from broker.append_fsm import (
    AppendFSM,
    BrokerExiting,
    Chunk,
    ClientError,
    OffsetOverflow,
    State,
)
from broker.client.appender import first_write, outcome
from broker.client.journals import PLACEMENT
from broker.client.routes import CORE_SEND_FAILURE, NOT_APPENDED
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate
from broker.resolver import ResolveError
from plumbing import auth, logs, metrics
from plumbing.auth import Claims

if TYPE_CHECKING:
    from broker.context import BrokerContext

log = logging.getLogger(__name__)

# A client may pause this long before its flow rate is judged (upstream's burst credit).
FLOW_GRACE = 1.0
# Appends of less content than this are read whole before they wait for the journal's pipeline,
# so that the append holding it can commit them with its own (group commit).
WHOLE_APPEND = 64 * 1024
# A proxied append is authorized at the primary by a token of this broker's own: APPEND over the
# journal alone, living PROXY_TOKEN_TTL seconds, with at least PROXY_TOKEN_FRESH of them left.
PROXY_TOKEN_TTL = 600.0
PROXY_TOKEN_FRESH = 300.0


class ClientStream:
    """Reads the client's remaining AppendRequests for the FSM, as Chunks.

    A client must deliver content at `min_rate` bytes per second on average after a grace
    period, else the append is aborted: appends hold the journal's pipeline, and a stalled
    client would block every other writer of the journal. Only the time spent waiting for the
    client counts: not the wait for the pipeline (behind other appends), nor peer syncs, store
    listings or the broker's own rate limits.
    """

    def __init__(self, requests: AsyncIterator[pb.AppendRequest], min_rate: int) -> None:
        self._it = requests
        self.min_rate = min_rate
        self.gone = asyncio.Event()
        self._waited = 0.0  # Seconds spent in receive(), waiting for the client.
        self._bytes = 0
        # The FSM's task while it waits for the client's next message, and why that wait was
        # cut short (the client left, or streamed too slowly), if it was.
        self._waiting: asyncio.Task[Any] | None = None
        self._cut: str | None = None
        self._ahead: collections.deque[Chunk] = collections.deque()  # Read by `prefetch`.

    def _timeout(self) -> float | None:
        if self.min_rate <= 0:
            return None
        return max(0.0, FLOW_GRACE + self._bytes / self.min_rate - self._waited)

    @property
    def bytes_received(self) -> int:
        return self._bytes

    def leave(self) -> None:
        """The client went away: a read in flight ends, and so does every later one."""
        self.gone.set()
        self._cut_short("client went away; rolled back")

    def _too_slow(self) -> None:
        self._cut_short(
            f"client streamed slower than --broker.min-append-rate ({self.min_rate} bytes/s); "
            "aborted and rolled back"
        )

    def _cut_short(self, why: str) -> None:
        # The FSM's task is suspended at its read of the client (nowhere else while `_waiting`
        # is set): cancelling it raises there, and only there, where `_receive` takes it back.
        task, self._waiting = self._waiting, None
        if task is not None:
            self._cut = why
            task.cancel()

    async def preload(self, content: bytes) -> Chunk:
        """The whole append came in its first message (the one-message form): the stream must
        end there. If it does, what `receive` hands out is that content, the commit and the end
        of the stream; if not, the chunk read instead (a message, or the client's failure) is
        returned, and the append is refused (a message) or rolled back (a failure) whole."""
        ended = await self._receive()
        if ended.error is not None:
            self._ahead.append(ended)  # The state machine rolls back, as for any client error.
        elif ended.request is None:
            self._bytes += len(content)
            self._ahead.extend(
                (Chunk(pb.AppendRequest(content=content)), Chunk(pb.AppendRequest()), Chunk(None))
            )
        return ended

    async def prefetch(self, limit: int) -> bytes | None:
        """Read the client's messages ahead while their content totals less than `limit`: the
        append's whole content if it ended within that (content chunks, the empty commit
        chunk, then EOF), else None. What was read is handed out first by `receive` (and by
        `remaining`), either way."""
        total = 0
        pieces: list[bytes] = []
        committed = False
        while True:
            chunk = await self._receive()
            self._ahead.append(chunk)
            request = chunk.request
            if chunk.error is not None:
                return None
            if request is None:  # EOF.
                return b"".join(pieces) if committed and total else None
            if request.journal or committed:
                return None  # Not a content stream: the FSM refuses it as it reads it.
            if not request.content:
                committed = True
                continue
            total += len(request.content)
            pieces.append(request.content)
            if total >= limit:
                return None  # A larger append streams as it comes.

    async def remaining(self) -> AsyncIterator[pb.AppendRequest]:
        """The client's messages not yet handed out: those read ahead, then the rest."""
        while self._ahead:
            chunk = self._ahead.popleft()
            if chunk.request is None:
                return
            yield chunk.request
        async for request in self._it:
            yield request

    async def receive(self) -> Chunk:
        if self.gone.is_set():
            # What was read ahead is not handed out once the client left: a one-message append
            # (read whole at once) that waited for the pipeline meanwhile is rolled back, as a
            # streamed one is at its next read.
            return Chunk(None, ClientError("client went away; rolled back"))
        if self._ahead:
            return self._ahead.popleft()
        return await self._receive()

    async def _receive(self) -> Chunk:
        if self.gone.is_set():
            return Chunk(None, ClientError("client went away; rolled back"))
        # Read in the FSM's own task (no task per message): `leave` and the flow-rate timer
        # cancel it only while it waits here, and the cancellation is taken back below, so the
        # machinery around the read is never interrupted.
        task = asyncio.current_task()
        assert task is not None
        timeout = self._timeout()
        timer = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(timeout, self._too_slow)
        )
        began = time.monotonic()
        self._waiting = task
        try:
            request = await anext(self._it)
        except asyncio.CancelledError:
            why, self._cut = self._cut, None
            # Ours if we cut the wait short and nobody else cancelled the task meanwhile.
            if why is None or task.uncancel() > 0:
                raise
            return Chunk(None, ClientError(why))
        except StopAsyncIteration:
            ended: Chunk | None = Chunk(None)
        except Exception as exc:  # The RPC failed under the read: the client is gone.
            ended = Chunk(None, ClientError(f"client stream failed: {exc!r}"))
        else:
            ended = None
        finally:
            self._waiting = None
            if timer is not None:
                timer.cancel()
            self._waited += time.monotonic() - began
        if self._cut is not None:
            # Cut short, and the read ended another way (gRPC took the cancellation in): it is
            # taken back from the task, and the append ends as cut.
            why, self._cut = self._cut, None
            task.uncancel()
            return Chunk(None, ClientError(why))
        if ended is not None:
            return ended
        self._bytes += len(request.content)
        return Chunk(request)


async def serve_append(
    ctx: BrokerContext,
    requests: AsyncIterator[pb.AppendRequest],
    context: Any,
    claims: Claims | None = None,
) -> pb.AppendResponse:
    iterator = requests.__aiter__()
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty Append stream")
        raise AssertionError("unreachable") from None
    try:
        validate.validate_append_request(first)
    except validate.ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    timer = metrics.Timer()
    logs.bind(journal=first.journal)
    # The one-message form (this project's clients): a first message with content, then the
    # end of the stream, is the whole append. Upstream's clients never send it (upstream's
    # brokers refuse it), so they see no difference.
    whole, first.content = first.content, b""
    fsm = AppendFSM(ctx, first, claims=claims)
    stream = ClientStream(iterator, ctx.min_append_rate)
    fsm.client_gone = stream.gone

    async def run() -> None:
        if whole:
            ended = await stream.preload(whole)
            if ended.request is not None:
                raise validate.ValidationError(
                    "content", len(ended.request.content),
                    "a first Append message with content is the whole append: the stream must "
                    "end after it",
                )  # fmt: skip
            if ended.error is None:
                fsm.whole = whole if groupable(first) and len(whole) < WHOLE_APPEND else None
        elif groupable(first):
            fsm.whole = await stream.prefetch(WHOLE_APPEND)
        await fsm.run(stream.receive)

    task = asyncio.ensure_future(run())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        stream.leave()
        with contextlib.suppress(Exception):
            await task
        raise
    except validate.ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    if fsm.state == State.PROXY:
        return await proxy_append(ctx, fsm, first, stream.remaining(), context)
    response = response_of(fsm)
    await explain_unplaced(ctx, response.status, context)
    status = metrics.status_name(response.status, pb.Status.Name)
    metrics.append_bytes.labels(status).inc(stream.bytes_received)
    metrics.append_seconds.labels(status).observe(timer.elapsed())
    if response.status == pb.OK and response.HasField("commit"):
        metrics.record_write_head(response.commit.journal, response.commit.end)
    return response


async def explain_unplaced(ctx: BrokerContext, status: int, context: Any) -> None:
    """A refusal for want of brokers says why, where the allocator cannot place replicas
    (metadata PLACEMENT: the status stays upstream's). In the initial metadata, which goes
    ahead of the response: a trailer can be lost when the client is still sending content."""
    if status not in (pb.NO_JOURNAL_PRIMARY_BROKER, pb.INSUFFICIENT_JOURNAL_BROKERS):
        return
    note = ctx.resolver.placement_shortfall()
    if note is not None:
        await context.send_initial_metadata(((PLACEMENT, note),))


def groupable(first: pb.AppendRequest) -> bool:
    """Whether an append may be committed in a group, once read whole: one at the journal's
    head (no explicit offset), neither suspending nor resuming, not proxied to us."""
    return (
        first.offset == 0
        and first.suspend == pb.AppendRequest.SUSPEND_RESUME
        and not first.HasField("header")
    )


def response_of(fsm: AppendFSM) -> pb.AppendResponse:
    response = pb.AppendResponse(
        status=fsm.status,
        total_chunks=fsm.total_chunks,
        delayed_chunks=fsm.delayed_chunks,
        store_health_error=fsm.store_health_error,
    )
    if fsm.resolved is not None:
        response.header.CopyFrom(fsm.resolved.header)
    if fsm.state == State.FINISHED and fsm.client_fragment is not None:
        response.commit.CopyFrom(fsm.client_fragment)
        response.registers.CopyFrom(fsm.registers)
    elif fsm.status == pb.OK and fsm.error is not None:
        raise_error(fsm.error)
    if fsm.status == pb.REGISTER_MISMATCH:
        response.registers.CopyFrom(fsm.registers)
    return response


class AppendFailed(Exception):
    """An append that failed or was refused outside of a status: its gRPC code and one line."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> None:
        super().__init__(message)
        self.code = code


def raise_error(error: BaseException) -> None:
    if isinstance(error, ResolveError):
        raise AppendFailed(str(error), grpc.StatusCode.FAILED_PRECONDITION)
    if isinstance(error, BrokerExiting):
        raise AppendFailed(str(error), grpc.StatusCode.UNAVAILABLE)
    if isinstance(error, OffsetOverflow):
        raise AppendFailed(str(error), grpc.StatusCode.OUT_OF_RANGE)
    if isinstance(error, ClientError):
        raise AppendFailed(str(error))
    raise AppendFailed(f"append failed: {error}")


def peer_error(member: pb.ProcessSpec.ID, exc: grpc.aio.AioRpcError) -> str:
    """One line for a proxied call that failed at its peer."""
    return f"proxying to broker {member.zone}/{member.suffix}: {exc.code().name}: {exc.details()}"


def relayed_code(exc: grpc.aio.AioRpcError) -> grpc.StatusCode:
    """The status a proxying broker answers for a call to a peer that failed: the peer's own,
    except where the call failed on the way rather than at the peer (a stream it reset, its
    server stopping under us): the peer is unavailable, which every client retries, not
    INTERNAL or CANCELLED, which none does."""
    code = exc.code()
    if code == grpc.StatusCode.CANCELLED or (
        code == grpc.StatusCode.INTERNAL and exc.details() == CORE_SEND_FAILURE
    ):
        return grpc.StatusCode.UNAVAILABLE
    return code


async def proxy_append(
    ctx: BrokerContext,
    fsm: AppendFSM,
    first: pb.AppendRequest,
    iterator: AsyncIterator[pb.AppendRequest],
    context: Any,
) -> pb.AppendResponse:
    """Forward the whole append to the primary the FSM resolved, and relay its answer."""
    res = fsm.resolved
    assert res is not None
    route = res.route
    endpoint = route.endpoints[route.primary] if route.primary < len(route.endpoints) else ""
    if not endpoint:
        await explain_unplaced(ctx, pb.NO_JOURNAL_PRIMARY_BROKER, context)
        return pb.AppendResponse(status=pb.NO_JOURNAL_PRIMARY_BROKER, header=res.header)
    out = pb.AppendRequest()
    out.CopyFrom(first)
    out.header.CopyFrom(res.header)
    token = ctx.dialer.journal_token(
        auth.APPEND, first.journal, PROXY_TOKEN_TTL, fresh_for=PROXY_TOKEN_FRESH
    )
    stub = ctx.dialer.journal_stub(endpoint)
    call = stub.Append(metadata=token.metadata) if token.metadata else stub.Append()
    forwarded_commit = False
    try:
        try:
            await first_write(call, out)
            async for request in iterator:
                if call.done():
                    break  # The primary answered before the stream's end; it reads no more.
                await call.write(request)
                # Sent (a write that failed, the peer having answered already, sent nothing).
                forwarded_commit = forwarded_commit or not request.content
            else:
                await call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.InternalError, asyncio.InvalidStateError):
            # A write (or the half-close) failed: the primary answered already and reads no
            # more, or the stream to it broke. gRPC's client marks such a write INTERNAL
            # ("Internal error from Core") at once, and replaces that with the status the
            # primary sent when it arrives: the call's own outcome, awaited below, is what we
            # relay, never the failed write's (which hid a suspension that was applied, and
            # turned a REGISTER_MISMATCH into UNAVAILABLE).
            pass
        response: pb.AppendResponse = await outcome(call)
        return response
    except grpc.aio.AioRpcError as exc:
        call.cancel()  # The primary rolls back a stream that ends without its commit.
        # The client sees the primary's own status (UNAVAILABLE when it is down), which it
        # knows to retry, rather than UNKNOWN.
        # Before the commit went on, the append cannot have landed: the client may send it
        # again (its own commit may have been sent to us already, so it cannot tell alone).
        trailer = () if forwarded_commit else ((NOT_APPENDED, "true"),)
        await context.abort(
            relayed_code(exc), peer_error(route.members[route.primary], exc), trailer
        )
        raise  # (abort raises)
    except BaseException:
        call.cancel()
        raise
