"""A TCP proxy on loopback for fault injection: real sockets between a client and a broker,
which a test can make hold the broker's answers (as a network that delivers one way only),
point at another broker, and cut (every connection reset, held bytes discarded)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.holding = False  # Bytes from the upstream are kept, not delivered.
        self.held = 0  # Bytes kept while holding.
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answers: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(1 << 16):
                if answers and self.holding:
                    self.held += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, up_w}
        try:
            await asyncio.gather(
                self._pump(client_r, up_w, answers=False), self._pump(up_r, client_w, answers=True)
            )
        finally:
            self._writers -= {client_w, up_w}

    def cut(self) -> None:
        """Reset every connection (its held answers are lost) and stop holding."""
        for writer in list(self._writers):
            transport = writer.transport
            transport.abort()
        self._writers.clear()
        self.holding = False

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[TcpProxy]:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self.cut()
            self._server.close()
            await self._server.wait_closed()


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    return host, int(port)
