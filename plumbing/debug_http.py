"""The HTTP side of every process (brokers, consumers, locations): Prometheus metrics, readiness
and a dump of every thread's and task's stack, with room for a process's own routes (a broker's
journal gateway, broker.gateway).

Upstream serves HTTP on the gRPC port (cmux); gRPC servers of Python cannot share theirs, so
HTTP has a port of its own (`--broker.http-port`, `--consumer.http-port`), served with the same
TLS settings as gRPC. It answers:

- `GET /debug/metrics`: Prometheus text format (unless `--debug.private`);
- `GET /debug/ready`: 200 once the process serves;
- the process's own routes (`HTTPRoutes`), with CORS headers for the origins of
  `--broker.allow-origin`.

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
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from plumbing import metrics
from plumbing.http_config import HTTPConfig as HTTPConfig
from plumbing.tls import ServerTLS

log = logging.getLogger(__name__)

# Seconds that requests still open at stop get to finish before they are cancelled.
HANDLER_STOP_TIMEOUT = 2.0


class HTTPRoutes(Protocol):
    """A process's own routes on its HTTP port (a broker's journal gateway)."""

    @property
    def exposed_headers(self) -> Sequence[str]:
        """Response headers a browser's script may read (CORS)."""

    def add_routes(self, app: web.Application) -> None: ...

    async def aclose(self) -> None:
        """Release what the routes hold, once the port stopped serving them."""


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


def _cors(origins: Sequence[str], exposed: Sequence[str]) -> Any:
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
            response.headers["Access-Control-Expose-Headers"] = ", ".join(exposed)
            response.headers["Vary"] = "Origin"
        return response

    return middleware


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
        routes: HTTPRoutes | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.host = host
        self.tls = tls or ServerTLS()
        self.routes = routes
        self._runners: list[web.AppRunner] = []
        self.port = 0
        self.debug_port = 0

    def _exposed(self) -> Sequence[str]:
        return self.routes.exposed_headers if self.routes is not None else ()

    def _app(self, *, main: bool) -> web.Application:
        app = web.Application(
            middlewares=[_cors(self.config.allow_origins, self._exposed())]
            if main and self.config.allow_origins
            else []
        )
        if not main or not self.config.private:
            app.router.add_get("/debug/metrics", _metrics)
            app.router.add_get("/debug/ready", _ready)
        if not main:
            app.router.add_get("/debug/stacks", _stacks)
        if main and self.routes is not None:
            self.routes.add_routes(app)
        return app

    async def _serve(self, app: web.Application, host: str, port: int) -> int:
        # At stop, requests still open get HANDLER_STOP_TIMEOUT to finish, then are cancelled:
        # a blocking read of a broker's gateway ends only with new content, and aiohttp's default (60 s)
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
        if self.routes is not None:
            await self.routes.aclose()
