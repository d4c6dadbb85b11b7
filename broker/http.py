"""The HTTP side of a broker or consumer process: Prometheus metrics, readiness, upstream's
HTTP gateway to journals (brokers), and a dump of every thread's and task's stack.

Upstream serves HTTP on the gRPC port (cmux); gRPC servers of Python cannot share theirs, so
HTTP has a port of its own (`--broker.http-port`, `--consumer.http-port`), served with the same
TLS settings as gRPC. It answers:

- `GET /debug/metrics`: Prometheus text format (unless `--debug.private`);
- `GET /debug/ready`: 200 once the process serves;
- `GET|HEAD /<journal>?offset=N&block=true`: reads the journal (206 with upstream's headers
  X-Fragment-Name, X-Fragment-Location, X-Fragment-Last-Modified, X-Write-Head, Content-Range,
  X-Route-Token and Location; 404 JOURNAL_NOT_FOUND, 503 INSUFFICIENT_JOURNAL_BROKERS, 416
  OFFSET_NOT_YET_AVAILABLE, 500 otherwise), HEAD with metadata only;
- `PUT /<journal>`: appends the body (204 with X-Commit-Begin, X-Commit-End, X-Write-Head,
  X-Commit-SHA1-Sum; 404 JOURNAL_NOT_FOUND; 500 otherwise).

The gateway calls the broker's own Journal service, passing the request's `Authorization`
header on as the call's authorization: what a token may not see is not found over HTTP either.
CORS: origins given by `--broker.allow-origin` get `Access-Control-Allow-*` headers and
preflight answers. A trailer (upstream's X-Close-Error) is not sent: a read that fails midway
ends the response early.

The stack dump (`GET /debug/stacks`) is served only on `--debug.port`, a diagnostics port
that listens on loopback (with /debug/metrics and /debug/ready as well): private unless asked for.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import text_format
from prometheus_client import CONTENT_TYPE_LATEST

from broker import auth, metrics
from broker.client.appender import append
from broker.fragment.fragments import content_name, digest_of
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import validate
from broker.tls import ServerTLS

log = logging.getLogger(__name__)

MAX_INT64 = 2**63 - 1
PUT_CHUNK = 256 * 1024
# Seconds that requests still open at stop get to finish before they are cancelled.
HANDLER_STOP_TIMEOUT = 2.0

_READ_STATUS = {
    pb.OK: 206,
    pb.JOURNAL_NOT_FOUND: 404,
    pb.INSUFFICIENT_JOURNAL_BROKERS: 503,
    pb.OFFSET_NOT_YET_AVAILABLE: 416,
}


def stacks_text() -> str:
    """Every thread's stack, then every asyncio task's of the running loop."""
    out = io.StringIO()
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        out.write(f"Thread {thread.name} (id {thread.ident}, daemon={thread.daemon}):\n")
        if frame is not None:
            out.write("".join(traceback.format_stack(frame)))
        out.write("\n")
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:
        tasks = set()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"Task {task.get_name()} ({task.get_coro()!r}):\n")
        for frame in task.get_stack():
            code = frame.f_code
            out.write(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
        out.write("\n")
    return out.getvalue()


@dataclass
class HTTPConfig:
    """What a process serves over HTTP (its flags)."""

    port: int | None = None  # None: no HTTP port. 0: a free one.
    debug_port: int | None = None  # The diagnostics port (stack dumps), on loopback.
    private: bool = False  # --debug.private: no /debug/* on the HTTP port.
    allow_origins: Sequence[str] = field(default_factory=tuple)

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.debug_port is not None


class Gateway:
    """Upstream's HTTP gateway over the broker's own Journal service (a gRPC channel to it)."""

    def __init__(self, channel: grpc.aio.Channel, verifier: auth.Verifier | None = None) -> None:
        self.channel = channel
        self.stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        # The broker's own verifier: a PUT whose token it refuses is answered before the body
        # streams into a call (a refusal mid-stream can end the call INTERNAL, not UNAUTHENTICATED).
        self.verifier = verifier or auth.NoopVerifier()

    @staticmethod
    def _metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
        token = request.headers.get("Authorization", "")
        return (("authorization", token),) if token else ()

    @staticmethod
    def _route_headers(request: web.Request, header: pb.Header, out: dict[str, str]) -> None:
        route = header.route
        if route.members:
            out["X-Route-Token"] = text_format.MessageToString(route, as_one_line=True)
            if route.primary != -1 and route.primary < len(route.endpoints):
                out["Location"] = route.endpoints[route.primary].rstrip("/") + request.path

    async def read(self, request: web.Request) -> web.StreamResponse:
        journal = request.match_info["journal"]
        try:
            offset = int(request.query.get("offset", "0") or 0)
            block = _bool(request.query.get("block", "false"))
            unknown = set(request.query) - {"offset", "block"}
            if unknown:
                raise ValueError(f'schema: invalid path "{sorted(unknown)[0]}"')
            req = pb.ReadRequest(
                journal=journal, offset=offset, block=block, metadata_only=request.method == "HEAD"
            )
            validate.validate_read_request(req)
        except (ValueError, validate.ValidationError) as exc:
            return web.Response(status=400, text=f"{exc}\n")
        call = self.stub.Read(req, metadata=self._metadata(request))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            return _rpc_error(exc)
        if first is grpc.aio.EOF:  # type: ignore[attr-defined]
            return web.Response(status=500, text="broker terminated RPC\n")
        headers: dict[str, str] = {}
        self._route_headers(request, first.header, headers)
        if first.HasField("fragment"):
            headers["X-Fragment-Name"] = content_name(first.fragment)
            if first.fragment.mod_time:
                headers["X-Fragment-Last-Modified"] = formatdate(first.fragment.mod_time, usegmt=True)  # fmt: skip
            if first.fragment_url:
                headers["X-Fragment-Location"] = first.fragment_url
            headers["Content-Range"] = f"bytes {first.offset}-{MAX_INT64}/{MAX_INT64}"
        if first.write_head:
            headers["X-Write-Head"] = str(first.write_head)
        status = _READ_STATUS.get(first.status, 500)
        if first.status != pb.OK:
            call.cancel()
            return web.Response(status=status, headers=headers, text=f"{pb.Status.Name(first.status)}\n")  # fmt: skip
        response = web.StreamResponse(status=206, headers=headers)
        response.content_type = "application/octet-stream"
        await response.prepare(request)
        if request.method == "HEAD":
            call.cancel()
            return response
        try:
            async for chunk in _contents(call):
                await response.write(chunk)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning("http gateway: read of %s ended: %s", journal, exc.details())
        except (ConnectionResetError, asyncio.CancelledError):
            call.cancel()
            raise
        finally:
            call.cancel()
        return response

    async def append(self, request: web.Request) -> web.Response:
        journal = request.match_info["journal"]
        first = pb.AppendRequest(journal=journal)
        try:
            if request.query:
                raise ValueError(f'schema: invalid path "{sorted(request.query)[0]}"')
            validate.validate_append_request(first)
        except (ValueError, validate.ValidationError) as exc:
            return web.Response(status=400, text=f"{exc}\n")

        try:
            self.verifier.verify(self._metadata(request), auth.APPEND)
        except auth.Unauthenticated as exc:
            return web.Response(status=401, text=f"{exc}\n")

        async def body() -> AsyncIterator[bytes]:
            while chunk := await request.content.read(PUT_CHUNK):
                yield chunk

        try:
            # As any client's append: a refusal may come while the body still streams, and the
            # answer is then the refusal, not the failed write after it.
            answer = await append(
                self.stub, journal, body(), check=False, chunk_size=PUT_CHUNK,
                metadata=self._metadata(request),
            )  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            return _rpc_error(exc)
        headers: dict[str, str] = {}
        self._route_headers(request, answer.header, headers)
        if answer.HasField("commit"):
            headers["X-Commit-Begin"] = str(answer.commit.begin)
            headers["X-Commit-End"] = str(answer.commit.end)
            headers["X-Write-Head"] = str(answer.commit.end)
            headers["X-Commit-SHA1-Sum"] = digest_of(answer.commit.sum).hex()
        if answer.status == pb.OK:
            return web.Response(status=204, headers=headers)
        if answer.status == pb.JOURNAL_NOT_FOUND:
            return web.Response(status=404, headers=headers)
        return web.Response(status=500, headers=headers, text=f"{pb.Status.Name(answer.status)}\n")  # fmt: skip


async def _contents(call: Any) -> AsyncIterator[bytes]:
    while True:
        response = await call.read()
        if response is grpc.aio.EOF:  # type: ignore[attr-defined]
            return
        if response.content:
            yield response.content
        elif response.status != pb.OK:
            return  # OFFSET_NOT_YET_AVAILABLE of a non-blocking read: its end.


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("", "0", "f", "false"):
        return False
    if lowered in ("1", "t", "true"):
        return True
    raise ValueError(f'schema: error converting value for "block": {text!r} is not a bool')


def _rpc_error(exc: grpc.aio.AioRpcError) -> web.Response:
    """A refused call as HTTP: 401 for authorization, 400 for a bad request, else 500."""
    code = exc.code()
    status = {
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403,
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAVAILABLE: 503,
    }.get(code, 500)
    return web.Response(status=status, text=f"{exc.details() or code.name}\n")


def _cors(origins: Sequence[str]) -> Any:
    allowed = set(origins)

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin", "")
        ok = origin and ("*" in allowed or origin in allowed)
        if request.method == "OPTIONS" and ok:
            response: web.StreamResponse = web.Response(status=204)
        else:
            response = await handler(request)
        if ok:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Methods"] = "GET, HEAD, PUT, POST, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Expose-Headers"] = ", ".join(_EXPOSED)
            response.headers["Vary"] = "Origin"
        return response

    return middleware


_EXPOSED = (
    "X-Fragment-Name", "X-Fragment-Location", "X-Fragment-Last-Modified", "X-Write-Head",
    "Content-Range", "X-Route-Token", "Location", "X-Commit-Begin", "X-Commit-End",
    "X-Commit-SHA1-Sum",
)  # fmt: skip


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _ready(_: web.Request) -> web.Response:
    return web.Response(text="ready\n")


async def _stacks(_: web.Request) -> web.Response:
    return web.Response(text=stacks_text())


class HTTPServers:
    """The HTTP port and the diagnostics port of one process (`name`, for its log), started
    and stopped together; both serve TLS when `tls` is on. The HTTP port listens on `host`,
    the diagnostics port on loopback."""

    def __init__(
        self,
        config: HTTPConfig,
        *,
        name: str = "",
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        gateway: Gateway | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.host = host
        self.tls = tls or ServerTLS()
        self.gateway = gateway
        self._runners: list[web.AppRunner] = []
        self.port = 0
        self.debug_port = 0

    def _app(self, *, main: bool) -> web.Application:
        app = web.Application(
            middlewares=[_cors(self.config.allow_origins)]
            if main and self.config.allow_origins
            else []
        )
        if not main or not self.config.private:
            app.router.add_get("/debug/metrics", _metrics)
            app.router.add_get("/debug/ready", _ready)
        if not main:
            app.router.add_get("/debug/stacks", _stacks)
        if main and self.gateway is not None:
            gateway = self.gateway
            app.router.add_get("/{journal:.+}", gateway.read)  # Also HEAD.
            app.router.add_route("PUT", "/{journal:.+}", gateway.append)
        return app

    async def _serve(self, app: web.Application, host: str, port: int) -> int:
        # At stop, requests still open get HANDLER_STOP_TIMEOUT to finish, then are cancelled:
        # a blocking gateway read ends only with new content, and aiohttp's default (60 s)
        # outlasts any supervisor's patience, which then kills the broker mid-flush.
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=HANDLER_STOP_TIMEOUT
        )
        await runner.setup()
        self._runners.append(runner)
        context = self.tls.ssl_context() if self.tls.enabled else None
        site = web.TCPSite(runner, host, port, ssl_context=context, reuse_port=False)
        await site.start()
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def start(self) -> None:
        c = self.config
        try:
            if c.port is not None:
                self.port = await self._serve(self._app(main=True), self.host, c.port)
                log.info("%s serves HTTP on port %d", self.name, self.port)
            if c.debug_port is not None:
                self.debug_port = await self._serve(self._app(main=False), "127.0.0.1", c.debug_port)  # fmt: skip
                log.info("%s serves diagnostics on 127.0.0.1:%d", self.name, self.debug_port)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
        if self.gateway is not None:
            await self.gateway.channel.close(None)
