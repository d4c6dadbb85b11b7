"""The Replicate RPC, served by a journal's non-primary replicas.

The first request carries the primary's Header (route and etcd revision). Once the route
matches ours, the RPC owns the replica's spool until the primary closes the stream, applying
each request to the spool and acknowledging where asked. Whatever ends the stream, anything
uncommitted is rolled back before the spool is released.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from allocator.keyspace import route_equivalent
from broker.fragment.spool import Spool, SpoolError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate
from broker.resolver import ResolveError
from plumbing import logs
from plumbing.auth import Claims
from plumbing.tasks import take_unless

if TYPE_CHECKING:
    from broker.context import BrokerContext

log = logging.getLogger(__name__)


async def serve_replicate(
    ctx: BrokerContext,
    requests: AsyncIterator[pb.ReplicateRequest],
    context: Any,
    claims: Claims | None = None,
) -> AsyncIterator[pb.ReplicateResponse]:
    iterator = requests.__aiter__()
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        return
    if not first.HasField("header") or not first.HasField("proposal"):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the first ReplicateRequest needs a header and a proposal",
        )
    try:  # As upstream's ReplicateRequest.Validate, for what this handler reads of it.
        validate.validate_header(first.header, field="header")
        validate.validate_journal_name(first.proposal.journal, field="proposal.journal")
        validate.validate_label_set(first.registers, field="registers")
    except validate.ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    logs.bind(journal=first.proposal.journal)
    spool: Spool | None = None
    while spool is None:
        try:
            res = await ctx.resolver.resolve(
                first.proposal.journal,
                may_proxy=False,
                require_primary=False,
                proxy_header=first.header,
                claims=claims,
            )
        except ResolveError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        if res.status != pb.OK:
            yield pb.ReplicateResponse(status=res.status, header=res.header)
            return
        if not route_equivalent(res.route, first.header.route):
            yield pb.ReplicateResponse(status=pb.WRONG_ROUTE, header=res.header)
            return
        assert res.replica is not None
        # Cancelled in the instant the spool is taken, it goes back (not astray).
        spool_queue = res.replica.spool_queue
        taken = await take_unless(spool_queue, res.invalidated)
        spool = taken[1]
    header: pb.Header | None = res.header
    # Until the stream's first content, it synchronizes a new pipeline (a new route): what it
    # rolls may exist nowhere else once the old primary is gone, so it is persisted at once.
    synchronizing = True
    try:
        request: pb.ReplicateRequest | None = first
        while request is not None:
            synchronizing = synchronizing and not request.content
            try:
                response = spool.apply(request, primary=False, persist_at_once=synchronizing)
            except SpoolError as exc:
                # An invalid transition: the stream is unusable, the primary must rebuild.
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replicate: {exc}")
                return
            if request.acknowledge:
                if header is not None:
                    response.header.CopyFrom(header)
                    header = None
                yield response
            elif response.status != pb.OK:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"replicate: {pb.Status.Name(response.status)} without an acknowledgement",
                )
                return
            try:
                request = await anext(iterator)
            except StopAsyncIteration:
                request = None
    finally:
        spool.rollback()  # Whatever ended the stream, nothing uncommitted survives it.
        spool_queue.put_nowait(spool)
