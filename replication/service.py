"""The Location service over gRPC: each call's token verified (the capability its method needs;
a selector must select the location's log), its request parsed only then (an unauthenticated
caller costs no parse), a restricted caller refused any location it may not see, and the
method's errors mapped to statuses, narrowly: a request's bad value is INVALID_ARGUMENT, a
defect of ours INTERNAL (and logged). The methods themselves are the location process's
(`replication.process.LocationProcess`).
"""

from __future__ import annotations

import contextvars
import logging
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
from google.protobuf.message import DecodeError

from broker.client.append_service import ServiceClosed
from broker.client.appender import AppendError
from plumbing import auth
from replication import location_pb2 as lpb
from replication import registry
from replication.rpc import SERVICE, LocationError, named_locations
from replication.topology import RuleViolation

if TYPE_CHECKING:
    from replication.process import LocationProcess

log = logging.getLogger("replication")

# The claims of the Location service call being served (unrestricted outside one): what the
# registry's names in an answer are filtered by.
CALLER: contextvars.ContextVar[auth.Claims] = contextvars.ContextVar("caller", default=auth.UNRESTRICTED)  # fmt: skip


class LocationService:
    """The gRPC adapter of one location process's service."""

    def __init__(self, server: LocationProcess) -> None:
        self.server = server

    def handlers(self) -> Any:
        """The Location service's methods, each taking its request as bytes, parsed only once
        the caller's token checked out (`_guard`): an unauthenticated caller costs no parse."""
        service = lpb.DESCRIPTOR.services_by_name["Location"]
        handlers = {}
        for name, method in self._methods().items():
            described = service.methods_by_name[name]
            request_type = getattr(lpb, described.input_type.name)
            response_type = getattr(lpb, described.output_type.name)
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._guard(name, method, request_type),
                request_deserializer=None,
                response_serializer=response_type.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _methods(self) -> dict[str, Any]:
        return {
            "Status": self.server.status,
            "Emit": self.server.emit,
            "Read": self.server.read,
            "Change": self.server.change,
            "Delete": self.server.delete,
            "ResetProgress": self.server.reset_progress,
            "Recover": self.server.recover,
            "Join": self.server.join,
            "TrustClock": self.server.trust_clock,
        }

    def _guard(self, name: str, method: Any, request_type: Any) -> Any:
        """A method of the Location service: its caller's token verified (the capability the
        method needs; a selector must select the location's log), then its request parsed
        (`request_type` from bytes), its errors as statuses."""
        capability = auth.METHOD_CAPABILITY[f"/{SERVICE}/{name}"]

        async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            claims = await auth.verify_or_abort(self.server.verifier, context, capability)
            # The log journal's labels and meta-labels, matched as the brokers match them.
            if not claims.sees_journal(self.server.log_spec):
                # A location whose log the caller may not see does not exist for it.
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no location {self.server.name}")
            try:
                request = request_type.FromString(raw)
            except DecodeError as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self.server.name}: not a {name} request: {exc}",
                )
            if not claims.unrestricted:
                try:
                    refusal = await self._refusal(claims, name, request)
                except aetcd.exceptions.ClientError as exc:
                    refusal = (
                        grpc.StatusCode.UNAVAILABLE,
                        (
                            f"location {self.server.name}: cannot read the registry to authorize the "
                            f"locations this call reaches: {str(exc).splitlines()[0]}"
                        ),
                    )
                if refusal is not None:
                    await context.abort(*refusal)
            caller = CALLER.set(claims)
            try:
                return await method(request)
            except RuleViolation as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except registry.UnknownLocation as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except ValueError as exc:  # The request's: a bad name, filter or vector.
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.server.name}: {exc}")
            except LocationError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except ServiceClosed:
                # This process is stopping the location (a zombie that found its lease gone,
                # say): its writer closed while the server still took the call.
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"location {self.server.name} is stopping in this process (its log's writer is "
                    "closed): call the process that serves it now",
                )
            except AppendError as exc:
                failure = self.server.writer_failed(exc)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, failure)
            except aetcd.exceptions.ClientError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"location {self.server.name}: cannot reach etcd: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                )
            except (
                Exception
            ) as exc:  # A defect of ours (a KeyError, a TypeError): not the caller's.
                log.exception("%s: %s failed", self.server.name, name)
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"location {self.server.name}: {name} failed on an internal error ({type(exc).__name__}: {exc}); "
                    "the process logged it",
                )
            finally:
                CALLER.reset(caller)
            raise AssertionError("unreachable")

        return handle

    async def _refusal(
        self, claims: auth.Claims, method: str, request: Any
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why a restricted caller may not make this call beyond this location (None: it may).
        Every location the request names must be one whose log journal the caller's claims
        select, as this location's must: one it cannot be shown to select (hidden, unknown,
        its brokers unreachable) does not exist for it, the answer being the one a location
        gives for itself. Delete asks its neighbours' vectors (its rule's refusal names them),
        so they must be selected too. Recover asks every registered location and may reset
        their progress: refused unless all are selected, in a line that names none of them."""
        names = named_locations(request)
        if method == "Delete":
            names += self.server.neighbour_names()
        if not names and method != "Recover":
            return None  # Most calls (Read, Emit, Status) name none: no registry read.
        known = await registry.read_locations(self.server.etcd_client(), self.server.config.prefix)
        if method == "Recover":
            for entry in known.values():
                if not await self.server.selects(claims, entry):
                    return grpc.StatusCode.PERMISSION_DENIED, (
                        f"location {self.server.name}: recover asks every registered location and may "
                        "reset their progress; this token does not select all their logs (use "
                        "one that does)"
                    )
            return None
        for name in names:
            named = known.get(name)
            if named is None or not await self.server.selects(claims, named):
                return grpc.StatusCode.NOT_FOUND, f"no location {name}"
        return None
