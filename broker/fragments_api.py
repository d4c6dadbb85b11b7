"""The ListFragments and FragmentStoreHealth RPCs.

ListFragments pages through a replica's fragment index (local and persisted fragments, in offset
order) within a modification-time range, optionally with signed GET URLs; a broker that is not a
replica of the journal proxies to one. FragmentStoreHealth checks a store as the persister uses it.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import duration_pb2

from broker.fragment.content import describe
from broker.fragment.stores import HEALTH_CHECK_PATH, StoreError, check_store_url
from broker.fragment.stores.base import DELETE_PROBE_NAME, JOURNAL_HEALTH_DIR, parse_store_url
from broker.fragment.stores.paths import StoreGuard, canonical_store_url, key_problem
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import quote
from broker.resolver import ResolveError
from plumbing.auth import Claims, signature_ttl

if TYPE_CHECKING:
    from broker.context import BrokerContext

DEFAULT_PAGE_LIMIT = 1000
MAX_PAGE_LIMIT = 10_000
HEALTH_CHECK_TIMEOUT = 30.0
# The range of a google.protobuf.Duration (about 10,000 years), well within a timedelta's.
MAX_DURATION_SECONDS = 315_576_000_000


def _validate(req: pb.FragmentsRequest) -> str | None:
    from broker.protocol import validate

    try:
        if req.HasField("header"):  # As upstream's FragmentsRequest.Validate.
            validate.validate_header(req.header, field="header")
        validate.validate_journal_name(req.journal.split(";")[0], field="journal")
    except validate.ValidationError as exc:
        return str(exc)
    if req.end_mod_time and req.end_mod_time < req.begin_mod_time:
        return (
            f"end_mod_time {req.end_mod_time} is before begin_mod_time {req.begin_mod_time}: "
            "give a range that is not empty"
        )
    if req.page_limit < 0 or req.page_limit > MAX_PAGE_LIMIT:
        return f"page_limit {req.page_limit} is outside of 0 to {MAX_PAGE_LIMIT}"
    if req.next_page_token < 0:
        return f"next_page_token {req.next_page_token} is negative"
    if req.HasField("signatureTTL"):
        return _ttl_problem(req.signatureTTL)
    return None


def _ttl_problem(ttl: duration_pb2.Duration) -> str | None:
    """Why `ttl` is not a signature lifetime: a google.protobuf.Duration (its documented range,
    nanos of the seconds' sign) longer than zero, as upstream requires."""
    seconds, nanos = ttl.seconds, ttl.nanos
    if not -MAX_DURATION_SECONDS <= seconds <= MAX_DURATION_SECONDS:
        return (
            f"signatureTTL of {seconds}s is not a duration: give more than 0s and at most "
            f"{MAX_DURATION_SECONDS}s"
        )
    if not -1_000_000_000 < nanos < 1_000_000_000 or (
        seconds and nanos and (seconds < 0) != (nanos < 0)
    ):
        return (
            f"signatureTTL nanos {nanos} do not fit its {seconds} seconds (expected 0 to 999999999)"
        )
    if seconds < 0 or (seconds == 0 and nanos <= 0):
        return f"signatureTTL {seconds}s {nanos}ns is not positive: give more than 0s"
    return None


async def serve_list_fragments(
    ctx: BrokerContext, req: pb.FragmentsRequest, context: Any, claims: Claims | None = None
) -> pb.FragmentsResponse:
    problem = _validate(req)
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    if req.HasField("signatureTTL") and claims is not None:
        # Signed URLs live no longer than the caller's token: the TTL is cut here, before a
        # proxy forwards it, so the replica that signs honours the client's token, not ours.
        asked = req.signatureTTL.ToTimedelta()
        allowed = signature_ttl(claims, asked)
        if allowed is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "token has expired: no URL is signed for it")  # fmt: skip
            raise AssertionError("unreachable")
        if allowed < asked:
            req = _with_ttl(req, allowed)
    try:
        res = await ctx.resolver.resolve(
            req.journal,
            may_proxy=not req.do_not_proxy,
            require_primary=False,
            proxy_header=req.header if req.HasField("header") else None,
            claims=claims,
        )
    except ResolveError as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        raise AssertionError("unreachable") from None
    if res.status != pb.OK:
        return pb.FragmentsResponse(status=res.status, header=res.header)
    if not res.is_local:
        return await _proxy(ctx, req, res.header)

    assert res.replica is not None
    index = res.replica.index
    # As appends, listings wait for the first listing of the stores.
    await index.first_refresh.wait()
    fragments = index.fragments()
    limit = req.page_limit or DEFAULT_PAGE_LIMIT
    ttl = req.signatureTTL.ToTimedelta() if req.HasField("signatureTTL") else None
    response = pb.FragmentsResponse(status=pb.OK, header=res.header)
    at = bisect.bisect_left([f.begin for f in fragments], req.next_page_token)
    taken = 0
    while at < len(fragments) and taken < limit:
        entry = fragments[at]
        at += 1
        mod_time = entry.mod_time
        # Local fragments (mod_time 0) are listed only when no end bound is given, as upstream.
        if (mod_time and mod_time < req.begin_mod_time) or (
            req.end_mod_time and (not mod_time or mod_time > req.end_mod_time)
        ):
            continue
        out = response.fragments.add()
        out.spec.CopyFrom(entry.spec)
        if ttl is not None and entry.spec.backing_store and ctx.persister is not None:
            try:
                out.signed_url = await asyncio.to_thread(ctx.persister.sign, entry.spec, ttl)
            except (StoreError, OSError, ValueError) as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"signing {describe(entry.spec)}: {exc}"
                )
        taken += 1
    if at < len(fragments):
        response.next_page_token = fragments[at].begin
    return response


def _with_ttl(req: pb.FragmentsRequest, ttl: timedelta) -> pb.FragmentsRequest:
    out = pb.FragmentsRequest()
    out.CopyFrom(req)
    # A positive Duration, as required.
    out.signatureTTL.FromTimedelta(max(ttl, timedelta(microseconds=1)))
    return out


async def _proxy(
    ctx: BrokerContext, req: pb.FragmentsRequest, header: pb.Header
) -> pb.FragmentsResponse:
    route = header.route
    index = list(route.members).index(header.process_id)
    endpoint = route.endpoints[index] if index < len(route.endpoints) else ""
    if not endpoint:
        return pb.FragmentsResponse(status=pb.NOT_JOURNAL_BROKER, header=header)
    out = pb.FragmentsRequest()
    out.CopyFrom(req)
    out.header.CopyFrom(header)
    response: pb.FragmentsResponse = await ctx.dialer.journal_stub(endpoint).ListFragments(out)
    return response


async def serve_store_health(
    ctx: BrokerContext,
    req: pb.FragmentStoreHealthRequest,
    context: Any,
    visible_paths: Callable[[str], list[StoreGuard]] | None = None,
) -> pb.FragmentStoreHealthResponse:
    """Check a store as the persister uses it (writing, and with `check_delete` removing, probe
    objects with the broker's own credentials). `visible_paths`, for a caller whose token has a
    selector: the fragment paths in a (canonical) store of the journals it can see. Such a
    caller may check only those stores, and its probes go under the first of those paths (a
    directory listings skip), never at the store's root, which may be other journals' paths."""
    try:
        check_store_url(req.fragment_store)
        url = canonical_store_url(req.fragment_store)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable") from None
    prefix = req.check_delete_prefix if req.check_delete else None
    if prefix and (problem := key_problem(prefix)):
        # For every caller: an object store takes a key as written, while a file store would
        # resolve '..' out of the directory named (and make directories on the way).
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"check_delete_prefix {quote(prefix)} {problem}: give a clean key directory "
            "relative to the store, ending in '/' (or nothing, for the store's root)",
        )
    probe_dir = HEALTH_CHECK_PATH.rpartition("/")[0] + "/"
    if visible_paths is not None:
        # The probes' object keys, after the store's rewrite, must lie inside a visible
        # journal's own path (a rewrite can send a clean name elsewhere).
        store_url = parse_store_url(url)
        probe_name = HEALTH_CHECK_PATH.rpartition("/")[2]
        paths = [
            p
            for p in visible_paths(url)
            if p.key_problem(store_url.key(f"{p.journal}/{JOURNAL_HEALTH_DIR}/{probe_name}"))
            is None
        ]
        if not paths:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"not authorized to {req.fragment_store}: no journal your token selects names it",
            )
        probe_dir = f"{paths[0].journal}/{JOURNAL_HEALTH_DIR}/"
        if prefix is not None:
            if not prefix:
                prefix = probe_dir  # The store's root is not the caller's: its own path is.
            key = store_url.key(prefix + DELETE_PROBE_NAME)
            if not any(prefix.startswith(p.journal + "/") and p.key_problem(key) is None for p in paths):  # fmt: skip
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"not authorized to {req.fragment_store}: check_delete_prefix {quote(prefix)} "
                    "is not under a journal your token selects",
                )
    response = pb.FragmentStoreHealthResponse(status=pb.OK, header=ctx.unrouted_header())
    if ctx.persister is None:
        response.status = pb.FRAGMENT_STORE_UNHEALTHY
        response.store_health_error = "this broker does not persist fragments"
        return response
    try:
        async with asyncio.timeout(HEALTH_CHECK_TIMEOUT):
            await asyncio.to_thread(_check, ctx, url, prefix, probe_dir)
    except TimeoutError:
        response.status = pb.FRAGMENT_STORE_UNHEALTHY
        response.store_health_error = f"no answer within {HEALTH_CHECK_TIMEOUT:.0f}s"
    except (StoreError, OSError, ValueError) as exc:
        response.status = pb.FRAGMENT_STORE_UNHEALTHY
        response.store_health_error = str(exc)
    return response


def _check(ctx: BrokerContext, url: str, prefix: str | None, probe_dir: str) -> None:
    assert ctx.persister is not None
    ctx.persister.store(url).health_check(prefix, probe_dir=probe_dir)
