"""Upstream's HTTP gateway to journals, served on a broker's HTTP port (`--broker.http-port`,
beside plumbing.debug_http's /debug routes):

- `GET|HEAD /<journal>?offset=N&block=true`: reads the journal (206 with upstream's headers
  X-Fragment-Name, X-Fragment-Location, X-Fragment-Last-Modified, X-Write-Head, Content-Range,
  X-Route-Token and Location; 404 JOURNAL_NOT_FOUND, 503 INSUFFICIENT_JOURNAL_BROKERS, 416
  OFFSET_NOT_YET_AVAILABLE, 500 otherwise), HEAD with metadata only;
- `PUT /<journal>`: appends the body (204 with X-Commit-Begin, X-Commit-End, X-Write-Head,
  X-Commit-SHA1-Sum; 404 JOURNAL_NOT_FOUND; 500 otherwise).

The gateway calls the broker's own Journal service, passing the request's `Authorization`
header on as the call's authorization: what a token may not see is not found over HTTP either.
CORS: origins given by `--broker.allow-origin` get `Access-Control-Allow-*` headers (these
headers exposed) and preflight answers. A trailer (upstream's X-Close-Error) is not sent: a read
that fails midway ends the response early.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import text_format

from broker.client.appender import append
from broker.fragment.fragments import content_name, digest_of
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import validate
from plumbing import auth

log = logging.getLogger(__name__)

MAX_INT64 = 2**63 - 1
PUT_CHUNK = 256 * 1024

_READ_STATUS = {
    pb.OK: 206,
    pb.JOURNAL_NOT_FOUND: 404,
    pb.INSUFFICIENT_JOURNAL_BROKERS: 503,
    pb.OFFSET_NOT_YET_AVAILABLE: 416,
}

EXPOSED_HEADERS = (
    "X-Fragment-Name", "X-Fragment-Location", "X-Fragment-Last-Modified", "X-Write-Head",
    "Content-Range", "X-Route-Token", "Location", "X-Commit-Begin", "X-Commit-End",
    "X-Commit-SHA1-Sum",
)  # fmt: skip


class Gateway:
    """Upstream's HTTP gateway over the broker's own Journal service (a gRPC channel to it):
    the routes a broker adds to its HTTP port (plumbing.debug_http.HTTPRoutes)."""

    exposed_headers = EXPOSED_HEADERS

    def __init__(self, channel: grpc.aio.Channel, verifier: auth.Verifier | None = None) -> None:
        self.channel = channel
        self.stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        # The broker's own verifier: a PUT whose token it refuses is answered before the body
        # streams into a call (a refusal mid-stream can end the call INTERNAL, not UNAUTHENTICATED).
        self.verifier = verifier or auth.NoopVerifier()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/{journal:.+}", self.read)  # Also HEAD.
        app.router.add_route("PUT", "/{journal:.+}", self.append)

    async def aclose(self) -> None:
        await self.channel.close(None)

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
