"""List, watch and apply journal specs through any broker's Journal service.

These are the library calls `gazctl journals list|apply|edit` are thin wrappers of.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import wire
from plumbing import auth
from plumbing.credentials import Credentials
from plumbing.credentials import default as default_credentials
from plumbing.tls import AddressError, split_address


class BrokerUnavailable(ConnectionError):
    """The broker could not be reached (or went away mid-call)."""


class ApplyConflict(RuntimeError):
    """An Apply's etcd transaction failed: an expected revision did not match."""

    def __init__(self, message: str, batch: int) -> None:
        super().__init__(message)
        self.batch = batch


class ApplyTooLarge(RuntimeError):
    """An Apply's batch held more changes than one etcd transaction (or one message) takes:
    nothing of that batch was applied; batches before it (`batch` of them) were."""

    def __init__(self, message: str, batch: int, size: int) -> None:
        super().__init__(message)
        self.batch = batch
        self.size = size


# Metadata of a List (its trailer), or of an append refused for want of brokers (its initial
# metadata): why journals have no replicas (broker.resolver.Resolver.placement_shortfall). Upstream's clients ignore it.
PLACEMENT = "gazette-placement"

BrokerAddressError = AddressError  # A broker address the client will not dial.


def grpc_target(address: str) -> str:
    """`http(s)://host:port` (upstream's --broker.address form) or a bare `host:port` to a gRPC
    target `host:port`; BrokerAddressError for anything else."""
    return split_address(address)[0]


async def _trailer(call: Any, key: str) -> str:
    """The value of `key` in a finished call's trailing metadata ("" if absent)."""
    for item in await call.trailing_metadata() or ():
        if item[0] == key:
            return str(item[1])
    return ""


def dial(address: str, credentials: Credentials | None = None) -> grpc.aio.Channel:
    """A channel to a broker: TLS for `https://`, with the credentials given or the process's
    defaults (see plumbing.credentials)."""
    creds = credentials or default_credentials("broker")
    return creds.open_channel(address, [("grpc.max_receive_message_length", 64 * 1024 * 1024)])


class JournalStub(pb_grpc.JournalStub):
    """The generated Journal stub, except that Read's content responses are parsed by hand
    (`wire.parse_read_response`: a `wire.ReadContent` whose content is copied once out of the
    message, where protobuf copies it in parsing and again at each access). Readers take either
    stub; this one is what the dialer and JournalsClient hand out.

    `AppendWhole` is Append as a unary call: one message that carries the parameters and the
    whole content, and the end of the stream, in one operation (`appender.append` sends small
    appends so). Our brokers take it as the whole append; upstream's refuse it ("unexpected
    Content"), and then `whole_appends` is cleared and this stub's appends stream as usual."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)  # type: ignore[no-untyped-call]
        self.Read = channel.unary_stream(
            "/protocol.Journal/Read",
            request_serializer=pb.ReadRequest.SerializeToString,
            response_deserializer=wire.parse_read_response,
        )
        self.AppendWhole = channel.unary_unary(
            "/protocol.Journal/Append",
            request_serializer=pb.AppendRequest.SerializeToString,
            response_deserializer=pb.AppendResponse.FromString,
        )
        self.whole_appends = True


def _unavailable(
    address: str, exc: grpc.aio.AioRpcError, credentials: Credentials | None = None
) -> BrokerUnavailable:
    detail = (exc.details() or "").split("\n")[0]
    detail = (credentials or default_credentials("broker")).explain(address, detail)
    return BrokerUnavailable(f"cannot reach broker at {address}: {detail}")


@dataclass
class ListSnapshot:
    header: pb.Header
    journals: list[pb.ListResponse.Journal] = field(default_factory=list)
    # Why journals of it have no replicas, as the broker's allocator sees it (a List's
    # trailing metadata: see broker.resolver.Resolver.placement_shortfall); "" if it did not say.
    placement: str = ""

    def as_response(self) -> pb.ListResponse:
        return pb.ListResponse(status=pb.OK, header=self.header, journals=self.journals)


class JournalsClient:
    """A Journal service client bound to one broker address."""

    def __init__(
        self, address: str, *, timeout: float | None = 30.0, credentials: Credentials | None = None
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.credentials = credentials or default_credentials("broker")
        self.channel = dial(address, self.credentials)
        self.stub: pb_grpc.JournalStub = JournalStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> JournalsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _snapshots(
        self, selector: pb.LabelSelector, watch: bool
    ) -> AsyncIterator[ListSnapshot]:
        request = pb.ListRequest(selector=selector, watch=watch)
        while True:
            call = self.stub.List(request, timeout=None if watch else self.timeout)
            current: ListSnapshot | None = None
            try:
                async for response in call:
                    if response.HasField("header"):
                        if response.status != pb.OK:
                            raise RuntimeError(f"List failed: {pb.Status.Name(response.status)}")
                        current = ListSnapshot(header=response.header)
                        current.journals.extend(response.journals)
                    elif current is not None and response.journals:
                        current.journals.extend(response.journals)
                    elif current is not None:
                        # An empty message closes a snapshot of a watch.
                        request.watch_resume.CopyFrom(current.header)
                        yield current
                        current = None
            except grpc.aio.AioRpcError as exc:
                if watch and auth.expired_during_call(exc):
                    continue  # The watch outlived its token: on, with a fresh one.
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _unavailable(self.address, exc, self.credentials) from None
                raise
            break
        if current is not None and not watch:
            current.placement = await _trailer(call, PLACEMENT)
            yield current

    async def list(self, selector: pb.LabelSelector | None = None) -> ListSnapshot:
        async for snapshot in self._snapshots(selector or pb.LabelSelector(), watch=False):
            return snapshot
        raise RuntimeError("List returned no response")

    def watch(self, selector: pb.LabelSelector | None = None) -> AsyncIterator[ListSnapshot]:
        """Each complete snapshot of the selected journals, now and whenever it changes."""
        return self._snapshots(selector or pb.LabelSelector(), watch=True)

    async def apply(
        self, changes: Sequence[pb.ApplyRequest.Change], max_txn_size: int = 0
    ) -> builtins.list[pb.ApplyResponse]:
        """Apply changes in one transaction, or in batches of `max_txn_size` (0: one batch).

        Each batch is all-or-nothing; a failed batch stops the run, and earlier batches stay
        applied (as upstream's batched apply does).
        """
        size = max_txn_size if max_txn_size > 0 else max(len(changes), 1)
        responses = []
        for number, start in enumerate(range(0, len(changes), size)):
            request = pb.ApplyRequest(changes=changes[start : start + size])
            try:
                response = await self.stub.Apply(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _unavailable(self.address, exc, self.credentials) from None
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    detail = (exc.details() or "").split("\n")[0]
                    raise ApplyTooLarge(detail, number, len(request.changes)) from None
                raise
            if response.status == pb.ETCD_TRANSACTION_FAILED:
                raise ApplyConflict("a journal's revision changed since it was read", number)
            if response.status != pb.OK:
                raise RuntimeError(f"Apply failed: {pb.Status.Name(response.status)}")
            responses.append(response)
        return responses
