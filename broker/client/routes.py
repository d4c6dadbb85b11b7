"""Client-side routing: journals' routes learned from response headers, so a client sends
appends straight to the primary (saving the proxy hop) and reads to a replica.

A `Router` falls back to its default broker (which proxies) for journals it has not learned, and
forgets a route as soon as using it fails.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc

from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.client.reader import ReadError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from plumbing.backoff import Backoff

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
# Trailing metadata of a proxied append that failed before the primary was sent its commit:
# it cannot have landed, whatever the client had sent.
NOT_APPENDED = "gazette-not-appended"


T = TypeVar("T")

# A wait longer than this tells the caller once (`on_wait`) what it is waiting through.
PROGRESS_AFTER = 2.0
# How long clients wait through transient refusals by default (gazctl's --wait).
DEFAULT_WAIT = 30.0


def is_transient(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the same call can succeed a moment later: the broker was unreachable, or the
    call failed on its way to it (for an append, before its commit was sent, so nothing was
    written by it)."""
    code = exc.code()
    return code in RETRYABLE_CODES or (
        code == grpc.StatusCode.INTERNAL and exc.details() == CORE_SEND_FAILURE
    )


def transient_reason(exc: BaseException) -> str | None:
    """Why a call failed, if the same call can succeed a moment later: a refusal while the
    journal's route forms or moves, or a broker that could not be reached. None for anything
    else, and for an append whose commit was already sent (it may have landed: sending it again
    could store it twice), unless it writes nothing (a zero-byte append, `repeatable`)."""
    if isinstance(exc, AppendError | ReadError):
        return pb.Status.Name(exc.status) if exc.status in RETRYABLE else None
    if isinstance(exc, grpc.aio.AioRpcError):
        if not is_transient(exc) or (uncertain(exc) and not getattr(exc, "repeatable", False)):
            return None
        return exc.code().name
    return None


def uncertain(exc: grpc.aio.AioRpcError) -> bool:
    """An append that failed after its commit was sent, with no proxy's word that it never
    reached the primary: it may have landed, or not (its outcome is unknown)."""
    return bool(getattr(exc, "commit_sent", False)) and not _not_appended(exc)


def _not_appended(exc: grpc.aio.AioRpcError) -> bool:
    """A proxying broker said the append never reached the primary with its commit."""
    trailer: Any = exc.trailing_metadata() or ()
    return any(item[0] == NOT_APPENDED for item in trailer)


async def waiting(
    attempt: Callable[[], Awaitable[T]],
    what: str,
    *,
    wait: float = DEFAULT_WAIT,
    max_delay: float = 2.0,
    on_wait: Callable[[str], None] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
) -> T:
    """`attempt()` until it succeeds, fails other than transiently (`transient_reason`), or
    `wait` seconds have passed: then its last failure is raised. Upstream's clients wait the
    same way through a journal's route forming (after an apply, a restart, a failover).
    `on_wait` hears once, when the wait grows long, what it is waiting through; `on_failure`
    hears each transient failure (to drop a cached route, say). Cancellable at every wait; a
    deadline of the caller's (asyncio.timeout) bounds it too."""
    backoff = Backoff(maximum=max_delay)
    start = time.monotonic()
    told = False
    while True:
        try:
            return await attempt()
        except (AppendError, ReadError, grpc.aio.AioRpcError) as exc:
            reason = transient_reason(exc)
            if reason is None:
                raise
            if on_failure is not None:
                on_failure(exc)
            waited = time.monotonic() - start
            delay = min(backoff.next_delay(), wait - waited)  # A last try at the deadline.
            if delay <= 0:
                raise
            if on_wait is not None and not told and waited + delay >= PROGRESS_AFTER:
                told = True
                on_wait(f"{what}: {reason}; waiting up to {wait:g}s for it to be served")
        await asyncio.sleep(delay)


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
    router: Router | pb_grpc.JournalStub,
    journal: str,
    content: bytes | Iterable[bytes],
    *,
    wait: float = DEFAULT_WAIT,
    max_delay: float = 2.0,
    on_wait: Callable[[str], None] | None = None,
    **kwargs: object,
) -> pb.AppendResponse:
    """`append`, waiting (`waiting`: with backoff, up to `wait` seconds) through refusals while
    the journal's route forms or moves and through unreachable brokers: the library's one-shot
    appender. With a Router, it goes to the journal's primary and re-routes on failure. Content
    must be re-sendable (bytes or a list). An append whose commit was sent when the call failed
    is not sent again (its outcome is unknown: it may have landed)."""
    if isinstance(content, AsyncIterable) or not isinstance(
        content, bytes | bytearray | memoryview | list | tuple
    ):
        raise TypeError("append_routed re-sends content on retry: pass bytes or a list")

    def attempt() -> Awaitable[pb.AppendResponse]:
        stub = router.stub_for(journal) if isinstance(router, Router) else router
        return append(stub, journal, content, **kwargs)  # type: ignore[arg-type]

    def forget(_exc: BaseException) -> None:
        if isinstance(router, Router):
            router.cache.drop(journal)

    response = await waiting(
        attempt, f"append to {journal}", wait=wait, max_delay=max_delay, on_wait=on_wait,
        on_failure=forget,
    )  # fmt: skip
    if isinstance(router, Router):
        router.observe(journal, response.header)
    return response
