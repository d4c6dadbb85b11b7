"""Client-side routing: journals' routes learned from response headers, so a client sends
appends straight to the primary (saving the proxy hop) and reads to a replica.

A `Router` falls back to its default broker (which proxies) for journals it has not learned, and
forgets a route as soon as using it fails.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Iterable

import grpc

from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.retry import Backoff

# Statuses after which the same append can succeed a moment later, possibly elsewhere.
RETRYABLE = frozenset(
    {
        pb.NO_JOURNAL_PRIMARY_BROKER,
        pb.NOT_JOURNAL_PRIMARY_BROKER,
        pb.NOT_JOURNAL_BROKER,
        pb.INSUFFICIENT_JOURNAL_BROKERS,
        pb.FRAGMENT_STORE_UNHEALTHY,
    }
)
RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
# What gRPC's own client reports (as INTERNAL) when a message could not be sent on a stream the
# peer already ended or reset; the peer's answer, if it gave one, is lost.
CORE_SEND_FAILURE = "Internal error from Core"


def is_transient(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the same call can succeed a moment later: the broker was unreachable, or the
    call failed on its way to it (for an append, before its commit was sent, so nothing was
    written by it)."""
    code = exc.code()
    return code in RETRYABLE_CODES or (
        code == grpc.StatusCode.INTERNAL and exc.details() == CORE_SEND_FAILURE
    )


class RouteCache:
    """A bounded, expiring map of journal → Route (upstream's --broker.cache.size/ttl)."""

    def __init__(self, size: int = 1024, ttl: float = 60.0) -> None:
        self.size = size
        self.ttl = ttl
        self._routes: OrderedDict[str, tuple[float, pb.Route]] = OrderedDict()

    def get(self, journal: str) -> pb.Route | None:
        entry = self._routes.get(journal)
        if entry is None:
            return None
        if time.monotonic() > entry[0]:
            del self._routes[journal]
            return None
        self._routes.move_to_end(journal)
        return entry[1]

    def update(self, journal: str, route: pb.Route) -> None:
        if self.size <= 0:
            return
        self._routes[journal] = (time.monotonic() + self.ttl, route)
        self._routes.move_to_end(journal)
        while len(self._routes) > self.size:
            self._routes.popitem(last=False)

    def drop(self, journal: str) -> None:
        self._routes.pop(journal, None)


class Router:
    def __init__(
        self, address: str, *, dialer: Dialer | None = None, cache: RouteCache | None = None
    ) -> None:
        self.address = address
        self.dialer = dialer or Dialer()
        self.cache = cache if cache is not None else RouteCache()

    def stub_for(self, journal: str) -> pb_grpc.JournalStub:
        """The journal's primary if known, else the default broker."""
        route = self.cache.get(journal)
        if route is not None and route.primary != -1 and route.primary < len(route.endpoints):
            return self.dialer.journal_stub(route.endpoints[route.primary])
        return self.dialer.journal_stub(self.address)

    def observe(self, journal: str, header: pb.Header) -> None:
        if header.route.members and header.route.endpoints:
            self.cache.update(journal, header.route)

    async def close(self) -> None:
        await self.dialer.close()


async def append_routed(
    router: Router,
    journal: str,
    content: bytes | Iterable[bytes],
    *,
    attempts: int = 20,
    max_delay: float = 2.0,
    **kwargs: object,
) -> pb.AppendResponse:
    """`append` to the journal's primary, retrying (with backoff, re-routing) while the route
    changes or a broker is unreachable. Content must be re-sendable (bytes or a list)."""
    if isinstance(content, AsyncIterable):
        raise TypeError("append_routed re-sends content on retry: pass bytes or a list")
    backoff = Backoff(maximum=max_delay)
    for attempt in range(attempts):
        try:
            response = await append(router.stub_for(journal), journal, content, **kwargs)  # type: ignore[arg-type]
        except AppendError as exc:
            router.cache.drop(journal)
            if exc.status not in RETRYABLE or attempt == attempts - 1:
                raise
        except grpc.aio.AioRpcError as exc:
            router.cache.drop(journal)
            if not is_transient(exc) or attempt == attempts - 1:
                raise
        else:
            router.observe(journal, response.header)
            return response
        await backoff.sleep()
    raise AssertionError("unreachable")
