"""The Read RPC: journal content from a replica's local fragments, from an offset (or the write
head at -1), blocking at the head until new content commits. Non-replicas proxy to a replica.

Only committed content is ever read: the spool serves committed bytes, never pending ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import grpc

from broker.append_api import peer_error, relayed_code
from broker.fragment.content import (
    Buffers,
    FragmentCorrupt,
    describe,
    open_in_store,
    stream_blocks,
)
from broker.fragment.stores import StoreError
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate, wire
from broker.resolver import ResolveError
from plumbing import metrics
from plumbing.auth import Claims, signature_ttl
from plumbing.tasks import wait_any

if TYPE_CHECKING:
    from broker.context import BrokerContext
    from broker.fragment.index import Index
    from broker.fragment.persister import Persister

log = logging.getLogger(__name__)

# Content bytes per Read response. Upstream's Go broker sends 32 KiB; Python pays per message
# (a 1 GiB read is 32,768 of them at that size), so we send 256 KiB, well within the 4 MiB that
# gRPC clients (ours and Go's) accept by default (read_broker in docs/benchmarks-history.md has
# figures).
CHUNK = 1 << 18
# Lifetime of the fragment URLs returned with persisted fragments, as upstream.
SIGNED_URL_TTL = timedelta(minutes=1)


async def serve_read(
    ctx: BrokerContext, req: pb.ReadRequest, context: Any, claims: Claims | None = None
) -> AsyncIterator[pb.ReadResponse]:
    try:
        validate.validate_read_request(req)
    except validate.ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    try:
        res = await ctx.resolver.resolve(
            req.journal,
            may_proxy=not req.do_not_proxy,
            require_primary=False,
            min_etcd_revision=req.min_etcd_revision,
            proxy_header=req.header if req.HasField("header") else None,
            claims=claims,
        )
    except ResolveError as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return
    if res.status != pb.OK:
        yield pb.ReadResponse(status=res.status, header=res.header)
        return
    if not res.is_local:
        # The replica signs fragment URLs for this broker's token: one that would outlive the
        # client's is signed again here for what the client's token has left, or dropped.
        ttl = SIGNED_URL_TTL if claims is None else signature_ttl(claims, SIGNED_URL_TTL)
        try:
            async for response in proxy_read(ctx, req, res.header):
                if (
                    not isinstance(response, bytes)  # Content, relayed as it came.
                    and response.fragment_url
                    and ttl != SIGNED_URL_TTL
                ):
                    await _sign_shorter(ctx, response, ttl)
                yield response  # type: ignore[misc]
        except grpc.aio.AioRpcError as exc:
            # The replica's own status (UNAVAILABLE when it is down), not UNKNOWN.
            await context.abort(relayed_code(exc), peer_error(res.header.process_id, exc))
        return

    replica = res.replica
    assert replica is not None
    index = replica.index
    offset = req.offset if req.offset != -1 else index.write_head
    header: pb.Header | None = res.header
    # Set when the journal's assignments change. A route change does not end the read (this
    # broker may still be a replica); the read re-arms on the replica's current event, so a
    # blocked read wakes once per change, not again and again on an event already set.
    invalidated = res.invalidated
    stalled = False  # The last local read made no progress: wait for a change first.
    listed_at = -1  # The offset of a hole the stores were listed for (once per hole).
    waited_listing = False  # Waited for the replica's first listing of the stores.
    buffers: Buffers | None = None  # What persisted fragments are read into.
    while True:
        if replica.stopped:
            return  # No longer a replica here: the client re-resolves and reads elsewhere.
        if req.end_offset and offset >= req.end_offset:
            return
        found = index.query(offset, req.begin_mod_time)
        offset = found.offset
        entry = found.fragment
        if entry is None and not index.first_refresh.is_set() and not waited_listing:
            # Before its first listing of the stores, this replica knows nothing they hold (a
            # journal its brokers restarted under, a suspended one): "not yet available at a
            # write head of 0" would read as an empty journal. Wait for that listing, once.
            # The journal's route changing meanwhile (its first pulse advertises it) does not
            # end the wait: the replica stays, and so does what it has yet to list.
            waited_listing = True
            await index.first_listing(HOLE_LISTING_WAIT)
            if req.offset == -1:
                offset = index.write_head
            continue
        if entry is None and offset < index.write_head and listed_at != offset:
            # A range below this replica's write head that nothing here covers: committed
            # content that another replica persisted after this one last listed its stores
            # (this broker restarted with an empty spool, say). List them now, rather than
            # answer as if the journal ended here until the next periodic listing.
            listed_at = offset
            if replica.spec is not None and replica.spec.fragment.stores:
                await index.listing(HOLE_LISTING_WAIT)
                continue
        if entry is None and not req.block:
            response = pb.ReadResponse(
                status=pb.OFFSET_NOT_YET_AVAILABLE, offset=offset, write_head=index.write_head
            )
            if header is not None:
                response.header.CopyFrom(header)
            yield response
            return
        if entry is None or stalled:
            await _wait_for_change(index, invalidated)
            if invalidated.is_set():
                invalidated = replica.invalidated
            stalled = False
            continue

        fragment = entry.spec
        metadata = pb.ReadResponse(
            status=pb.OK, offset=offset, write_head=index.write_head, fragment=fragment
        )
        # A signed URL lives no longer than the reader's token (none once it has no life left).
        ttl = SIGNED_URL_TTL if claims is None else signature_ttl(claims, SIGNED_URL_TTL)
        if fragment.backing_store and fragment.mod_time and ctx.persister is not None and ttl:
            try:
                metadata.fragment_url = await asyncio.to_thread(ctx.persister.sign, fragment, ttl)
            except Exception as exc:  # The broker still serves the content itself.
                log.warning("signing a URL for %s failed: %s", describe(fragment), exc)
        if header is not None:
            metadata.header.CopyFrom(header)
            header = None
        yield metadata
        if req.metadata_only or (entry.file is None and req.do_not_proxy):
            return  # The client reads a persisted fragment through its URL.
        end = fragment.end if not req.end_offset else min(fragment.end, req.end_offset)
        if entry.file is not None:
            began = offset
            while offset < end:
                try:
                    content = entry.file.read(offset, min(CHUNK, end - offset))
                except (OSError, ValueError):
                    break  # The spool rolled, or the fragment was dropped: query again.
                if not content:
                    break
                yield wire.read_content(offset, content)  # type: ignore[misc]
                offset += len(content)
                metrics.read_bytes.inc(len(content))
            stalled = offset == began
            continue
        assert ctx.persister is not None
        try:
            if buffers is None:
                buffers = Buffers()
            async for block in read_persisted(ctx.persister, fragment, offset, end, buffers):
                # Each piece is copied once, into its response. The block is a view of one of
                # `buffers`, read into again once no view of it is left.
                size = len(block)
                with memoryview(block) as view:
                    for at in range(0, size, CHUNK):
                        yield wire.read_content(offset, view[at : at + CHUNK])  # type: ignore[misc]
                        offset += min(CHUNK, size - at)
                metrics.read_bytes.inc(size)
        except FragmentCorrupt as exc:
            log.error("%s", exc)
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        except (StoreError, OSError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"reading {describe(fragment)}: {exc}")


# Seconds a read waits for a listing of the stores, asked for by a range it met that nothing
# covers (a listing that takes longer is in trouble; the read answers with what it has).
HOLE_LISTING_WAIT = 10.0


async def _wait_for_change(index: Index, invalidated: asyncio.Event) -> None:
    """Until the index changes (a commit, a roll, a listing, the replica closing it) or the
    journal's assignments do."""
    await wait_any(index.changed, invalidated)


async def read_persisted(
    persister: Persister,
    fragment: pb.Fragment,
    offset: int,
    end: int,
    buffers: Buffers | None = None,
) -> AsyncIterator[bytes | memoryview]:
    """Content of a persisted fragment from `offset` to `end`, read from its store on a worker
    thread a block at a time (into `buffers`, when given: see content.Buffers)."""
    store = persister.store(fragment.backing_store)
    # The client checks the SHA-1 of what it reads whole (end to end); the broker does not.
    blocks = stream_blocks(
        lambda: open_in_store(store, fragment, offset, verify=False, buffers=buffers)
    )
    try:
        async for block in blocks:
            block = block[: end - offset]
            offset += len(block)
            yield block
            if offset >= end:
                return
    finally:
        await blocks.aclose()


async def _sign_shorter(ctx: BrokerContext, response: pb.ReadResponse, ttl: timedelta | None) -> None:  # fmt: skip
    """Replace a relayed `fragment_url` by one living `ttl` (none when `ttl` is None or this
    broker cannot sign for the fragment's store)."""
    url = ""
    if ttl is not None and ctx.persister is not None:
        try:
            url = await asyncio.to_thread(ctx.persister.sign, response.fragment, ttl)
        except Exception as exc:  # The content still comes through this broker.
            log.warning("signing a URL for %s failed: %s", describe(response.fragment), exc)
    response.fragment_url = url


async def proxy_read(
    ctx: BrokerContext, req: pb.ReadRequest, header: pb.Header
) -> AsyncIterator[pb.ReadResponse | bytes]:
    """The replica's responses to `req`; content responses as the replica encoded them."""
    route = header.route
    target = header.process_id
    index = list(route.members).index(target)
    endpoint = route.endpoints[index] if index < len(route.endpoints) else ""
    if not endpoint:
        yield pb.ReadResponse(status=pb.NOT_JOURNAL_BROKER, header=header)
        return
    out = pb.ReadRequest()
    out.CopyFrom(req)
    out.header.CopyFrom(header)
    call = ctx.dialer.journal_stub(endpoint).Read(out)
    try:
        async for response in call:
            # Content parsed by hand is relayed as it came (its bytes are the response).
            yield response.raw if isinstance(response, wire.ReadContent) else response
    finally:
        call.cancel()
