"""Shared gRPC channels to peers, keyed by their advertised endpoint (`http://host:port`).

Brokers dial each other for replication and proxying; one channel per peer is enough, since
gRPC multiplexes every stream of a channel over one HTTP/2 connection. An endpoint that cannot
be dialled as advertised is never dialled some other way: its calls fail. `https://` endpoints are
dialled with TLS (the dialer's credentials: a broker's `--broker.peer-*` files, a client's
`--broker.*` ones), and every call carries the credentials' authorization.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NoReturn

import grpc

from broker.client.journals import BrokerAddressError, JournalStub
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from plumbing import auth
from plumbing.credentials import Credentials
from plumbing.credentials import default as default_credentials

REPLICATE_METHOD = "/protocol.Journal/Replicate"

# Append and Read chunks stay well below this; replication carries the same chunks.
MAX_MESSAGE = 64 * 1024 * 1024


class EndpointRefused(grpc.aio.AioRpcError):
    """A call to an endpoint the dialer will not dial: it failed before anything was sent."""

    def __init__(self, reason: str) -> None:
        empty = grpc.aio.Metadata()
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, empty, empty, reason, None)

    def __str__(self) -> str:
        return self.details() or ""


class _RefusedCall:
    """Any call (unary or streaming) to a refused endpoint: each use raises EndpointRefused."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    async def _refuse(self) -> NoReturn:
        raise EndpointRefused(self._reason)

    def __await__(self) -> Generator[Any, None, NoReturn]:
        return self._refuse().__await__()

    def __aiter__(self) -> _RefusedCall:
        return self

    async def __anext__(self) -> NoReturn:
        await self._refuse()

    async def read(self) -> NoReturn:
        await self._refuse()

    async def write(self, request: object) -> NoReturn:
        await self._refuse()

    async def done_writing(self) -> NoReturn:
        await self._refuse()

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    async def details(self) -> str:
        return self._reason


class _RefusedChannel:
    """Stands in for the channel to a refused endpoint, so that stubs and streams on it can be
    made as usual (a pipeline makes its streams in one step with taking the spool) and fail
    where callers handle a peer's failures."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def _method(self, method: str, *_: Any, **__: Any) -> Callable[..., _RefusedCall]:
        return lambda *_, **__: _RefusedCall(self._reason)

    unary_unary = unary_stream = stream_unary = stream_stream = _method


class Dialer:
    def __init__(self, credentials: Credentials | None = None) -> None:
        self.credentials = credentials or default_credentials("broker")
        self._channels: dict[str, grpc.aio.Channel] = {}
        # One Journal stub per endpoint: what a stub learns of its broker (that it refuses the
        # one-message append form, `JournalStub.whole_appends`) holds for every later call to
        # that endpoint, though a router asks for a stub at each call.
        self._stubs: dict[str, pb_grpc.JournalStub] = {}

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        """The channel to `endpoint`; BrokerAddressError if it is not one to dial."""
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self.credentials.open_channel(
                endpoint,
                [
                    ("grpc.max_receive_message_length", MAX_MESSAGE),
                    ("grpc.max_send_message_length", MAX_MESSAGE),
                    # A restarted peer should be redialed within a second, not minutes.
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._channels[endpoint] = channel
        return channel

    def _channel_or_refused(self, endpoint: str) -> Any:
        try:
            return self.channel(endpoint)
        except BrokerAddressError as exc:
            return _RefusedChannel(str(exc))

    def journal_stub(self, endpoint: str) -> pb_grpc.JournalStub:
        """The Journal stub of `endpoint` (the same one at each call); if the endpoint is not
        one to dial, its calls fail with EndpointRefused (FAILED_PRECONDITION), having sent
        nothing."""
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = JournalStub(self._channel_or_refused(endpoint))
        return stub

    def journal_token(
        self, capability: int, journal: str, ttl: float, *, fresh_for: float | None = None
    ) -> auth.Token:
        """Authorization for a call of this process's own about one journal: `capability`
        over `name=<journal>` only, for `ttl` seconds (see auth.KeyedAuth.token)."""
        return self.credentials.auth.token(
            capability, auth.name_selector(journal), ttl, fresh_for=fresh_for
        )

    def replicate_stream(self, endpoint: str, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """A Replicate stream whose requests are written already serialized (bytes), so that
        a primary encodes each content chunk once for all of its peers, authorized by
        `metadata` (see journal_token). On an endpoint that is not one to dial, every write
        and read fails with EndpointRefused."""
        call = self._channel_or_refused(endpoint).stream_stream(
            REPLICATE_METHOD,
            request_serializer=None,  # Identity: the pipeline writes wire bytes.
            response_deserializer=pb.ReplicateResponse.FromString,
        )
        return call(metadata=metadata) if metadata else call()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        self._stubs = {}
        for channel in channels.values():
            await channel.close(None)
