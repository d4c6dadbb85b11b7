"""The replication pipeline: a journal primary's long-lived Replicate streams to each peer.

Full duplex, as the seed describes: the *send* side (scatter of content and proposals) and the
*receive* side (gathering acknowledgements) are owned separately. An append releases the send
side as soon as its proposal is out, then waits at a read barrier for its turn to read its
acknowledgements in order, so many appends are in flight at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from allocator.keyspace import route_equivalent
from broker.client.dialer import Dialer
from broker.fragment.spool import Spool
from broker.protocol import protocol_pb2 as pb
from broker.protocol import wire
from plumbing import auth
from plumbing.tasks import Slot, TaskOwner

log = logging.getLogger(__name__)

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # (missing from grpc-stubs)


SHUTDOWN_TIMEOUT = 10.0

# The most content one Replicate message carries: well under the 4 MiB a peer's gRPC server
# takes by default (`--broker.max-grpc-recv-size`), with room for the message's own fields.
MAX_CONTENT_MESSAGE = 1 << 20

# A pipeline's Replicate streams are authorized by a token of the primary's own, REPLICATE over
# its journal alone, living TOKEN_TTL seconds; a peer ends a stream when its token expires, so a
# pipeline is rebuilt (a new one, with a fresh token, synchronized before any append uses it)
# once less than RENEW_BEFORE seconds are left: appends and pulses take the pipeline far more
# often than that, and no append holds it that long.
TOKEN_TTL = 600.0
RENEW_BEFORE = 300.0

T = TypeVar("T")


class PipelineError(RuntimeError):
    pass


def describe(err: BaseException) -> str:
    """An error of a peer's stream in one line: a gRPC error as its code and the first line of
    its details (its repr spans several lines, and logs read as tracebacks)."""
    if isinstance(err, grpc.aio.AioRpcError):
        detail = (err.details() or "").split("\n")[0]
        return f"{err.code().name}: {detail}" if detail else err.code().name
    return str(err) or repr(err)


class Pipeline:
    def __init__(
        self,
        header: pb.Header,
        spool: Spool,
        spool_queue: Slot[Spool],
        dialer: Dialer,
    ) -> None:
        if header.route.primary == -1:
            raise ValueError("a pipeline needs a Route with a primary")
        self.header = header
        self.spool = spool
        self._spool_queue = spool_queue
        members = list(header.route.members)
        self.members = members
        size = len(members)
        self.streams: list[Any | None] = [None] * size
        self.send_errs: list[BaseException | None] = [None] * size
        self.recv_errs: list[BaseException | None] = [None] * size
        self.recv_resp: list[pb.ReplicateResponse | None] = [None] * size
        loop = asyncio.get_running_loop()
        self._read_barrier: asyncio.Future[None] = loop.create_future()
        self._read_barrier.set_result(None)
        self._turns = TaskOwner("pipeline readers")  # Readers in turn (see read_in_turn).
        token = dialer.journal_token(
            auth.REPLICATE, spool.fragment.journal, TOKEN_TTL, fresh_for=TOKEN_TTL * 0.9
        )
        self.renew_at = token.exp - RENEW_BEFORE  # Wall-clock (inf: nothing to renew).
        primary = header.route.primary
        for i, member in enumerate(members):
            if i == primary:
                continue
            endpoint = header.route.endpoints[i] if i < len(header.route.endpoints) else ""
            if not endpoint:
                self.send_errs[i] = PipelineError(f"peer {member.suffix} has no endpoint")
                continue
            self.streams[i] = dialer.replicate_stream(endpoint, token.metadata)

    @property
    def route(self) -> pb.Route:
        return self.header.route

    async def scatter(self, request: pb.ReplicateRequest) -> None:
        """Send `request` to every healthy peer and apply it to the local spool.

        Peer writes proceed concurrently, and the local spool applies the request meanwhile
        (it hashes and writes the same bytes): the send side is held for one write's time.
        """
        encoded = None if request.HasField("header") else request.SerializeToString()

        def encode(i: int) -> bytes:
            if encoded is not None:
                return encoded
            # Each peer verifies that the request is addressed to it.
            out = pb.ReplicateRequest()
            out.CopyFrom(request)
            out.header.process_id.CopyFrom(self.members[i])
            return out.SerializeToString()

        await self._scatter(encode, lambda: self.spool.apply(request, primary=True))

    async def scatter_content(self, content: bytes, content_delta: int) -> None:
        """`scatter` of content, in messages of at most MAX_CONTENT_MESSAGE bytes of it, each
        encoded once for every peer without building a message (content is the bulk of what a
        pipeline carries). A group commit's content is up to 256 appends' together: as one
        message it would exceed what a peer takes (gRPC's 4 MiB by default), and the peer
        would end its stream."""
        at = 0
        while True:
            piece = (
                content
                if len(content) <= MAX_CONTENT_MESSAGE
                else content[at : at + MAX_CONTENT_MESSAGE]
            )
            await self._scatter_piece(piece, content_delta + at)
            at += len(piece)
            if at >= len(content):
                return

    async def _scatter_piece(self, piece: bytes, content_delta: int) -> None:
        encoded = wire.replicate_content(piece, content_delta)
        await self._scatter(
            lambda _: encoded, lambda: self.spool.apply_content(piece, content_delta)
        )

    async def _scatter(
        self, encode: Callable[[int], bytes], apply: Callable[[], pb.ReplicateResponse]
    ) -> None:
        writes = []
        for i, stream in enumerate(self.streams):
            if stream is None or self.send_errs[i] is not None:
                continue
            writes.append((i, asyncio.ensure_future(stream.write(encode(i)))))
        primary = self.header.route.primary
        try:
            if self.send_errs[primary] is None:
                response = apply()
                if response.status != pb.OK:
                    # The primary built this request from its own spool: a mismatch is a bug.
                    raise AssertionError(f"primary spool refused its own proposal: {response}")
        finally:
            if writes:
                results = await asyncio.gather(*(w for _, w in writes), return_exceptions=True)
                for (i, _), result in zip(writes, results, strict=True):
                    if isinstance(result, BaseException):
                        self.send_errs[i] = result

    async def close_send(self) -> None:
        """Roll back anything uncommitted, release the spool, and half-close every stream.

        A half-close that fails is that peer's send error, whatever it raised: gRPC's
        `done_writing`, unlike `write`, lets a failure of its batch in core escape as its own
        ExecuteBatchError (a stream reset while the loop had not yet seen it end)."""
        self.spool.rollback()
        self._spool_queue.put_nowait(self.spool)
        for i, stream in enumerate(self.streams):
            if stream is not None and self.send_errs[i] is None:
                try:
                    await stream.done_writing()
                except Exception as exc:
                    self.send_errs[i] = exc

    def stale(self) -> bool:
        """Whether to build a new pipeline rather than use this one: its token is near its
        expiry, or a peer ended its stream (a token that expired anyway, say) while it was
        idle, which no send or receive has noticed yet."""
        return time.time() >= self.renew_at or any(
            stream is not None and self.send_errs[i] is None and stream.done()
            for i, stream in enumerate(self.streams)
        )

    def send_err(self) -> BaseException | None:
        for i, err in enumerate(self.send_errs):
            if err is not None:
                return PipelineError(f"send to {self.members[i].suffix}: {describe(err)}")
        return None

    def barrier(self) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        """(wait_for, close_after): await `wait_for` before reading acknowledgements, and
        resolve `close_after` once done, handing the receive side to the next append."""
        wait_for = self._read_barrier
        self._read_barrier = asyncio.get_running_loop().create_future()
        return wait_for, self._read_barrier

    async def read_in_turn(self, read: Callable[[], Awaitable[T]]) -> T:
        """Run `read` (of the acknowledgements of what the caller just sent) in the order the
        requests went out: after every earlier reader, before every later one.

        The turn is a task of the pipeline's, and the caller's cancellation does not end it:
        responses to a request already sent are on their way, and a reader that gave up its
        turn before reading them would hand them to the next one as its own. So the read goes
        on, and the next reader's turn comes only once it is done. (Shutdown takes its own
        turn, after every reader's.)"""
        wait_for, close_after = self.barrier()

        async def turn() -> T:
            try:
                await _wait_turn(wait_for)
                return await read()
            finally:
                _pass_turn(close_after)

        return await asyncio.shield(self._turns.spawn(turn(), "acknowledgements"))

    async def _read(self, i: int, stream: Any) -> Any:
        """The next response of peer `i`'s stream, or None with its error recorded: a gRPC
        error, or the stream cancelled on this side (a teardown's `cancel`), which gRPC raises
        as CancelledError into a task nobody cancelled."""
        try:
            return await stream.read()
        except grpc.aio.AioRpcError as exc:
            self.recv_errs[i] = exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # Our own cancellation.
            self.recv_errs[i] = PipelineError("stream cancelled by a teardown of the pipeline")
        return None

    async def gather(self) -> None:
        for i, stream in enumerate(self.streams):
            if stream is None or self.recv_errs[i] is not None:
                continue
            response = await self._read(i, stream)
            if response is None:
                continue
            if response is EOF:
                self.recv_errs[i] = PipelineError("unexpected EOF")
            else:
                self.recv_resp[i] = response

    async def gather_ok(self) -> None:
        await self.gather()
        for i, stream in enumerate(self.streams):
            if stream is None or self.recv_errs[i] is not None:
                continue
            response = self.recv_resp[i]
            if response is None or response.status != pb.OK:
                self.recv_errs[i] = PipelineError(f"unexpected response: {response}")

    async def gather_sync(self) -> tuple[int, pb.LabelSet | None, int]:
        """Read synchronization acknowledgements: (roll_to_offset, registers to take,
        etcd revision to read through), each zero / None when not called for."""
        await self.gather()
        roll_to, roll_registers, read_through = 0, None, 0
        spool_end = self.spool.fragment.end
        for i, stream in enumerate(self.streams):
            if stream is None or self.recv_errs[i] is not None:
                continue
            response = self.recv_resp[i]
            assert response is not None
            if response.status == pb.OK:
                continue
            if response.status == pb.WRONG_ROUTE:
                newer = response.header.etcd.revision > self.header.etcd.revision
                if newer and not route_equivalent(response.header.route, self.header.route):
                    read_through = max(read_through, response.header.etcd.revision)
                else:
                    self.recv_errs[i] = PipelineError(f"unexpected WRONG_ROUTE: {response.header}")
            elif response.status == pb.PROPOSAL_MISMATCH:
                fragment = response.fragment
                if fragment.end > spool_end:
                    # A peer knows a larger offset: everyone rolls forward to it.
                    if fragment.end > roll_to:
                        roll_to, roll_registers = fragment.end, response.registers
                elif fragment.end == spool_end and fragment.begin == fragment.end:
                    # The peer cannot extend our fragment (it holds none): roll to a new one.
                    roll_to = max(roll_to, fragment.end)
                else:
                    self.recv_errs[i] = PipelineError(
                        f"unexpected PROPOSAL_MISMATCH: {fragment} {response.registers}"
                    )
            else:
                self.recv_errs[i] = PipelineError(f"unexpected status: {response}")
        return roll_to, roll_registers, read_through

    async def gather_eof(self) -> None:
        for i, stream in enumerate(self.streams):
            if stream is None or self.recv_errs[i] is not None:
                continue
            response = await self._read(i, stream)
            if response is None:
                continue
            if response is not EOF:
                self.recv_errs[i] = PipelineError(f"unexpected response: {response}")

    def recv_err(self) -> BaseException | None:
        for i, err in enumerate(self.recv_errs):
            if err is not None:
                return PipelineError(f"recv from {self.members[i].suffix}: {describe(err)}")
        return None

    async def shutdown(self, expect_err: bool) -> None:
        """Tear down: release the spool and close every stream in turn with other readers."""
        wait_for, close_after = self.barrier()
        try:
            await self.close_send()
            if not expect_err and (err := self.send_err()) is not None:
                log.warning("tearing down pipeline: close_send failed: %s", err)
            await _wait_turn(wait_for)
            # A peer that never answers must not wedge the replica's shutdown.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SHUTDOWN_TIMEOUT):
                    await self.gather_eof()
            if not expect_err and (err := self.recv_err()) is not None:
                log.warning("tearing down pipeline: gather_eof failed: %s", err)
        finally:
            _pass_turn(close_after)
            self.cancel()

    def cancel(self) -> None:
        for stream in self.streams:
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.cancel()


async def _wait_turn(barrier: asyncio.Future[None]) -> None:
    """Wait for the reader before us to pass the turn. The barrier is that reader's: a waiter
    cancelled here (a teardown cancelled by a stopping broker) must not cancel it, or the
    reader, passing the turn on, would find it cancelled (InvalidStateError)."""
    if not barrier.done():
        await asyncio.wait({barrier})


def _pass_turn(barrier: asyncio.Future[None]) -> None:
    if not barrier.done():
        barrier.set_result(None)
