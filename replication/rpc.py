"""The Location service: a location process's gRPC service, its messages JSON documents (one
unary method each; the service is this project's own, so it has no .proto to match).

Methods: `Status`, `Emit`, `Read` (a replication batch, filtered at the source by the target's
CVV and the connection's filter), `Change` (check, and record, a topology change), `Delete`,
`ResetProgress` and `Recover`. A rule the change would break is FAILED_PRECONDITION, a bad
argument INVALID_ARGUMENT, an unknown location NOT_FOUND; each with one line that says why."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from broker.client.journals import dial
from replication.location import Stored

__all__ = ["SERVICE", "LocationClient", "LocationError", "generic_handler"]

SERVICE = "gazette_py.replication.Location"

Document = dict[str, Any]
Method = Callable[[Document, grpc.aio.ServicerContext[Any, Any]], Awaitable[Document | bytes]]


def _encode(document: Mapping[str, Any] | bytes) -> bytes:
    """A reply's bytes: a JSON document, or bytes a method made itself (Read's)."""
    if isinstance(document, bytes):
        return document
    return json.dumps(document, separators=(",", ":")).encode()


def generic_handler(methods: Mapping[str, Method]) -> grpc.GenericRpcHandler[Any, Any]:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            name: grpc.unary_unary_rpc_method_handler(
                method, request_deserializer=json.loads, response_serializer=_encode
            )
            for name, method in methods.items()
        },
    )


class LocationError(RuntimeError):
    """A Location service call that failed: its status code and one line."""

    def __init__(self, location: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(location, code, detail)
        self.location, self.code, self.detail = location, code, detail

    def __str__(self) -> str:
        if self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"location {self.location} is unreachable ({self.code.name}): {self.detail}"
        return self.detail


class LocationClient:
    """Calls to one location's process: `emit`, `events` and `status` for applications, `call`
    for any method of the Location service."""

    def __init__(self, location: str, endpoint: str, *, timeout: float = 30.0) -> None:
        self.location, self.endpoint, self.timeout = location, endpoint, timeout
        self.channel = dial(endpoint)

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> LocationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def emit(self, *payloads: Mapping[str, Any]) -> list[tuple[str, int]]:
        """Emit events at the location (each payload a JSON object); their ids, (emitter,
        time)."""
        reply = await self.call("Emit", payloads=[dict(p) for p in payloads])
        return [(e["emitter"], e["ts"][e["emitter"]]) for e in reply["events"]]

    async def events(self, after: int = 0, limit: int = 1000, wait: float = 0.0) -> list[Stored]:
        """The location's stored events after sequence number `after`, in storage order
        (read-committed; deleted ones left out), waiting up to `wait` seconds for some."""
        from replication.records import split_records

        reply = await self.call_raw("Read", after=after, limit=limit, wait=wait)
        body = reply[reply.index(b"\n") + 1 :]
        return [raw.stored() for _, _, raw in split_records(body)[0] if raw is not None]

    async def status(self) -> Document:
        return await self.call("Status")

    async def call(self, method: str, timeout: float | None = None, **body: Any) -> Document:
        reply: Document = json.loads(await self.call_raw(method, timeout, **body))
        return reply

    async def call_raw(self, method: str, timeout: float | None = None, **body: Any) -> bytes:
        """The reply's bytes (Read's are not one JSON document)."""
        stub = self.channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=bytes
        )
        try:
            reply: bytes = await stub(body, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            task = asyncio.current_task()
            if exc.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
                raise asyncio.CancelledError() from None  # Ours, not the peer's: a cancellation.
            detail = (exc.details() or "").split("\n")[0]
            raise LocationError(self.location, exc.code(), detail) from None
        return reply
