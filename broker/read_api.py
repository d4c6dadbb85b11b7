"""The Read RPC: journal content from a replica's local fragments, from an offset (or the write
head at -1), blocking at the head until new content commits. Non-replicas proxy to a replica.

Only committed content is ever read: the spool serves committed bytes, never pending ones.
"""

from __future__ import annotations

import asyncio
import enum
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
    from broker.fragment.cover_set import IndexedFragment, Readable
    from broker.fragment.index import Index
    from broker.fragment.persister import Persister
    from broker.replica import Replica

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
    """The Read RPC's responses to `req` (see `ReadSession`)."""
    async for response in ReadSession(ctx, req, context, claims).serve():
        yield response


class _End(enum.Enum):
    """Why `ReadSession._next_fragment` found no fragment to serve."""

    READ_ENDS = "the read ends here"
    NOT_YET_AVAILABLE = "nothing at the offset yet, and the read does not block"


class ReadSession:
    """One Read call, in named steps:

    - `serve`: validate and resolve the journal, then proxy to a replica (`proxied`) or read
      here (`local`);
    - `local`: again and again, the fragment covering the offset (`next_fragment`, which waits
      as it must: for the replica's first listing of its stores, for a listing of a hole
      below the write head, for new content or a change of the journal's assignments), its
      metadata (`metadata`), then its content from the spool or a local file (`from_file`) or
      from its store (`persisted`).

    What a read remembers between fragments is named here: whether it waited for the first
    listing, which hole it had the stores listed for, whether the last local read made no
    progress, and the assignment change it watches for."""

    def __init__(
        self, ctx: BrokerContext, req: pb.ReadRequest, context: Any, claims: Claims | None
    ) -> None:
        self.ctx, self.req, self.context, self.claims = ctx, req, context, claims
        self.offset = req.offset
        # The resolution's header, sent with the first response only.
        self.header: pb.Header | None = None
        self.waited_first_listing = False  # For the replica's first listing of its stores.
        self.listed_hole_at = -1  # The offset of a hole the stores were listed for (once).
        self.stalled = False  # The last local read made no progress: wait for a change first.
        self.buffers: Buffers | None = None  # What persisted fragments are read into.

    def _signature_ttl(self) -> timedelta | None:
        """How long a signed URL may live: no longer than the reader's token."""
        return SIGNED_URL_TTL if self.claims is None else signature_ttl(self.claims, SIGNED_URL_TTL)

    async def serve(self) -> AsyncIterator[pb.ReadResponse]:
        req, context = self.req, self.context
        try:
            validate.validate_read_request(req)
        except validate.ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            res = await self.ctx.resolver.resolve(
                req.journal,
                may_proxy=not req.do_not_proxy,
                require_primary=False,
                min_etcd_revision=req.min_etcd_revision,
                proxy_header=req.header if req.HasField("header") else None,
                claims=self.claims,
            )
        except ResolveError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        if res.status != pb.OK:
            yield pb.ReadResponse(status=res.status, header=res.header)
            return
        if not res.is_local:
            async for response in self.proxied(res.header):
                yield response
            return
        assert res.replica is not None
        self.header = res.header
        async for response in self.local(res.replica, res.invalidated):
            yield response

    async def proxied(self, header: pb.Header) -> AsyncIterator[pb.ReadResponse]:
        """The replica's responses, relayed. The replica signs fragment URLs for this broker's
        token: one that would outlive the client's is signed again here for what the client's
        token has left, or dropped."""
        ttl = self._signature_ttl()
        try:
            async for response in proxy_read(self.ctx, self.req, header):
                if (
                    not isinstance(response, bytes)  # Content, relayed as it came.
                    and response.fragment_url
                    and ttl != SIGNED_URL_TTL
                ):
                    await _sign_shorter(self.ctx, response, ttl)
                yield response  # type: ignore[misc]
        except grpc.aio.AioRpcError as exc:
            # The replica's own status (UNAVAILABLE when it is down), not UNKNOWN.
            await self.context.abort(relayed_code(exc), peer_error(header.process_id, exc))

    async def local(
        self, replica: Replica, invalidated: asyncio.Event
    ) -> AsyncIterator[pb.ReadResponse]:
        """The read served from this broker's replica: fragment after fragment, until the
        read's end, the replica's stop, or (not blocking) the write head."""
        req, index = self.req, replica.index
        if req.offset == -1:
            self.offset = index.write_head
        # Set when the journal's assignments change. A route change does not end the read (this
        # broker may still be a replica); the read re-arms on the replica's current event, so a
        # blocked read wakes once per change, not again and again on an event already set.
        self.invalidated = invalidated
        while True:
            entry = await self.next_fragment(replica)
            if entry is _End.READ_ENDS:
                return
            if entry is _End.NOT_YET_AVAILABLE:
                response = pb.ReadResponse(
                    status=pb.OFFSET_NOT_YET_AVAILABLE,
                    offset=self.offset,
                    write_head=index.write_head,
                )
                if self.header is not None:
                    response.header.CopyFrom(self.header)
                yield response
                return
            yield await self.metadata(entry, index.write_head)
            if req.metadata_only or (entry.file is None and req.do_not_proxy):
                return  # The client reads a persisted fragment through its URL.
            fragment = entry.spec
            end = fragment.end if not req.end_offset else min(fragment.end, req.end_offset)
            if entry.file is not None:
                async for content in self.from_file(entry.file, end):
                    yield content
            else:
                async for content in self.persisted(fragment, end):
                    yield content

    async def next_fragment(self, replica: Replica) -> IndexedFragment | _End:
        """The fragment covering the read's offset (moving the offset to where it begins, past
        a gap), after whatever wait it takes; or why there is none to serve."""
        req, index = self.req, replica.index
        while True:
            if replica.stopped:
                return _End.READ_ENDS  # No longer a replica here: the client reads elsewhere.
            if req.end_offset and self.offset >= req.end_offset:
                return _End.READ_ENDS
            found = index.query(self.offset, req.begin_mod_time)
            self.offset = found.offset
            entry = found.fragment
            if entry is None and not index.first_refresh.is_set() and not self.waited_first_listing:
                # Before its first listing of the stores, this replica knows nothing they hold
                # (a journal its brokers restarted under, a suspended one): "not yet available
                # at a write head of 0" would read as an empty journal. Wait for that listing,
                # once. The journal's route changing meanwhile (its first pulse advertises it)
                # does not end the wait: the replica stays, and so does what it has to list.
                self.waited_first_listing = True
                await index.first_listing(HOLE_LISTING_WAIT)
                if req.offset == -1:
                    self.offset = index.write_head
                continue
            if entry is None and self.offset < index.write_head and self.listed_hole_at != self.offset:  # fmt: skip
                # A range below this replica's write head that nothing here covers: committed
                # content that another replica persisted after this one last listed its stores
                # (this broker restarted with an empty spool, say). List them now, rather than
                # answer as if the journal ended here until the next periodic listing.
                self.listed_hole_at = self.offset
                if replica.spec is not None and replica.spec.fragment.stores:
                    await index.listing(HOLE_LISTING_WAIT)
                    continue
            if entry is None and not req.block:
                return _End.NOT_YET_AVAILABLE
            if entry is None or self.stalled:
                await _wait_for_change(index, self.invalidated)
                if self.invalidated.is_set():
                    self.invalidated = replica.invalidated
                self.stalled = False
                continue
            return entry

    async def metadata(self, entry: IndexedFragment, write_head: int) -> pb.ReadResponse:
        """The response that precedes a fragment's content: the fragment, and a signed URL
        for it when it is persisted (living no longer than the reader's token, none once it
        has no life left)."""
        fragment = entry.spec
        metadata = pb.ReadResponse(
            status=pb.OK, offset=self.offset, write_head=write_head, fragment=fragment
        )
        ttl = self._signature_ttl()
        persister = self.ctx.persister
        if fragment.backing_store and fragment.mod_time and persister is not None and ttl:
            try:
                metadata.fragment_url = await asyncio.to_thread(persister.sign, fragment, ttl)
            except Exception as exc:  # The broker still serves the content itself.
                log.warning("signing a URL for %s failed: %s", describe(fragment), exc)
        if self.header is not None:
            metadata.header.CopyFrom(self.header)
            self.header = None
        return metadata

    async def from_file(self, file: Readable, end: int) -> AsyncIterator[pb.ReadResponse]:
        """Content from the spool or a local fragment file up to `end`, or until it rolls or
        is dropped (then the next fragment is queried again)."""
        began = self.offset
        while self.offset < end:
            try:
                content = file.read(self.offset, min(CHUNK, end - self.offset))
            except (OSError, ValueError):
                break  # The spool rolled, or the fragment was dropped: query again.
            if not content:
                break
            yield wire.read_content(self.offset, content)  # type: ignore[misc]
            self.offset += len(content)
            metrics.read_bytes.inc(len(content))
        self.stalled = self.offset == began

    async def persisted(self, fragment: pb.Fragment, end: int) -> AsyncIterator[pb.ReadResponse]:
        """Content of a persisted fragment read from its store, up to `end`."""
        assert self.ctx.persister is not None
        try:
            if self.buffers is None:
                self.buffers = Buffers()
            blocks = read_persisted(self.ctx.persister, fragment, self.offset, end, self.buffers)
            async for block in blocks:
                # Each piece is copied once, into its response. The block is a view of one of
                # `buffers`, read into again once no view of it is left.
                size = len(block)
                with memoryview(block) as view:
                    for at in range(0, size, CHUNK):
                        yield wire.read_content(self.offset, view[at : at + CHUNK])  # type: ignore[misc]
                        self.offset += min(CHUNK, size - at)
                metrics.read_bytes.inc(size)
        except FragmentCorrupt as exc:
            log.error("%s", exc)
            await self.context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        except (StoreError, OSError) as exc:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE, f"reading {describe(fragment)}: {exc}"
            )


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
