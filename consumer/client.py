"""A Shard service client bound to one consumer process's address (`--consumer.address`), as
gazctl and applications use it: List, Apply in batches, Stat, Unassign, GetHints."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from broker.client.journals import ApplyConflict, ApplyTooLarge, BrokerUnavailable
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from consumer.protocol import cpb
from plumbing.credentials import Credentials
from plumbing.credentials import default as default_credentials

__all__ = ["ConsumerUnavailable", "PrimaryUnreachable", "ShardsClient"]


class ConsumerUnavailable(BrokerUnavailable):
    """The consumer process could not be reached (or went away mid-call)."""


class PrimaryUnreachable(ConsumerUnavailable):
    """The consumer answering could not reach the process holding the shard's primary, to
    proxy a call there: that process died (its shards stay its own until its lease expires)
    or is partitioned away."""

    # The trailing metadata naming the unreachable process, from the server to its clients.
    METADATA = "gazette-unreachable-primary"

    def __init__(self, shard: str, member: str, endpoint: str = "") -> None:
        at = f" at {endpoint}" if endpoint else ""
        super().__init__(f"shard {shard}: its primary {member}{at} is unreachable")
        self.shard, self.member = shard, member


_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ShardsClient:
    def __init__(
        self, address: str, *, timeout: float | None = 30.0, credentials: Credentials | None = None
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.credentials = credentials or default_credentials("consumer")
        self.channel = self.credentials.open_channel(address, what="consumer address")
        self.stub = cpb_grpc.ShardStub(self.channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> ShardsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> ConsumerUnavailable:
        detail = self.credentials.explain(self.address, (exc.details() or "").split("\n")[0])
        return ConsumerUnavailable(f"cannot reach the consumer at {self.address}: {detail}")

    async def list(self, selector: pb.LabelSelector | None = None) -> cpb.ListResponse:
        try:
            response: cpb.ListResponse = await self.stub.List(
                cpb.ListRequest(selector=selector or pb.LabelSelector()), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                raise self._unavailable(exc) from None
            raise
        return response

    async def apply(
        self, changes: Sequence[cpb.ApplyRequest.Change], max_txn_size: int = 0
    ) -> builtins.list[cpb.ApplyResponse]:
        """Apply in one transaction, or in batches of `max_txn_size`: each batch all or nothing,
        a failed batch stopping the run (earlier batches stay applied, as upstream's)."""
        size = max_txn_size if max_txn_size > 0 else max(len(changes), 1)
        responses = []
        for number, start in enumerate(range(0, len(changes), size)):
            request = cpb.ApplyRequest(changes=changes[start : start + size])
            try:
                response = await self.stub.Apply(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _TRANSIENT:
                    raise self._unavailable(exc) from None
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    detail = (exc.details() or "").split("\n")[0]
                    raise ApplyTooLarge(detail, number, len(request.changes)) from None
                raise
            if response.status == cpb.ETCD_TRANSACTION_FAILED:
                raise ApplyConflict("a shard's revision changed since it was read", number)
            if response.status != cpb.OK:
                raise RuntimeError(f"Apply failed: {cpb.Status.Name(response.status)}")
            responses.append(response)
        return responses

    async def stat(
        self, shard: str, read_through: Mapping[str, int] | None = None
    ) -> cpb.StatResponse:
        request = cpb.StatRequest(shard=shard, read_through=dict(read_through or {}))
        try:
            response: cpb.StatResponse = await self.stub.Stat(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            trailing: Any = exc.trailing_metadata()  # grpc.aio.Metadata (typed as a tuple).
            member = trailing.get(PrimaryUnreachable.METADATA) if trailing else None
            if exc.code() == grpc.StatusCode.UNAVAILABLE and member is not None:
                raise PrimaryUnreachable(shard, str(member)) from None
            if exc.code() in _TRANSIENT:
                raise self._unavailable(exc) from None
            raise
        return response

    async def get_hints(self, shard: str) -> cpb.GetHintsResponse:
        """The shard's primary and backup hints, as stored in etcd."""
        try:
            response: cpb.GetHintsResponse = await self.stub.GetHints(
                cpb.GetHintsRequest(shard=shard), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                raise self._unavailable(exc) from None
            raise
        return response

    async def unassign(
        self, shards: Sequence[str], *, only_failed: bool = False, dry_run: bool = False
    ) -> cpb.UnassignResponse:
        request = cpb.UnassignRequest(shards=shards, only_failed=only_failed, dry_run=dry_run)
        try:
            response: cpb.UnassignResponse = await self.stub.Unassign(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSIENT:
                raise self._unavailable(exc) from None
            raise
        return response
