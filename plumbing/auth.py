"""Authorization as upstream's: HMAC-signed JWTs carrying Claims (a capability bit mask `cap`
and a label selector `sel`), sent as `authorization: Bearer <jwt>` gRPC metadata.

Servers verify with a KeyedVerifier (`--broker.auth-keys`, `--consumer.auth-keys`): keys are
base64, separated by whitespace or commas; any key verifies, HS256 and HS384 only, `exp` is
required, `iat` is checked, with 5 s of leeway. The special key `AA==` admits requests that carry
no token at all (for rolling authorization out over a running cluster). Every failure is
UNAUTHENTICATED, as upstream answers it. What a token's selector does not match does not exist
for its bearer: the servers treat such journals and shards as not found. A call lasts no longer
than the token it was admitted with: `CallBounds`, a server interceptor, ends it UNAUTHENTICATED
(EXPIRED_DURING_CALL) once the token's `exp` plus the leeway passes, streaming or not.

Clients authorize with a KeyedAuth (signs short-lived claims with the first key; brokers and
consumers sign their own when they proxy or replicate, brokers narrowed to the one journal), a
BearerAuth (a pre-shared token, `--broker.auth-token`) or NoopAuth. `authorized_channel` attaches
the token a method needs to every call of a gRPC channel, so stubs and callers need not know of
authorization.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import functools
import inspect
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import grpc
import jwt

from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb

# Capabilities (upstream's bit mask); applications may use bits from 1 << 16.
LIST = 1 << 1
APPLY = 1 << 2
READ = 1 << 3
APPEND = 1 << 4
REPLICATE = 1 << 5
ALL = 0xFFFFFFFF

CAPABILITY_NAMES = {LIST: "LIST", APPLY: "APPLY", READ: "READ", APPEND: "APPEND", REPLICATE: "REPLICATE"}  # fmt: skip

LEEWAY = 5.0  # Seconds of clock skew tolerated on `exp` and `iat`.
ALGORITHMS = ["HS256", "HS384"]
ALLOW_MISSING_KEY = "AA=="

# Which capability each RPC requires (upstream's table, but FragmentStoreHealth), by full method
# name: what servers require and what clients sign for.
METHOD_CAPABILITY: dict[str, int] = {
    "/protocol.Journal/List": LIST,
    "/protocol.Journal/Apply": APPLY,
    "/protocol.Journal/Read": READ,
    "/protocol.Journal/Append": APPEND,
    "/protocol.Journal/Replicate": REPLICATE,
    "/protocol.Journal/ListFragments": READ,
    "/protocol.Journal/FragmentStoreHealth": APPLY,  # Upstream: READ. Ours writes probes: APPLY.
    "/consumer.Shard/Stat": READ,
    "/consumer.Shard/List": LIST,
    "/consumer.Shard/Apply": APPLY,
    "/consumer.Shard/GetHints": READ,
    "/consumer.Shard/Unassign": APPLY,
    # Replication networks' Location service (ours): reading, emitting, changing the network.
    "/gazette_py.replication.Location/Status": READ,
    "/gazette_py.replication.Location/Read": READ,
    "/gazette_py.replication.Location/Emit": APPEND,
    "/gazette_py.replication.Location/Change": APPLY,
    "/gazette_py.replication.Location/Delete": APPLY,
    "/gazette_py.replication.Location/ResetProgress": APPLY,
    "/gazette_py.replication.Location/Recover": APPLY,
    "/gazette_py.replication.Location/Join": APPLY,
    "/gazette_py.replication.Location/TrustClock": APPLY,
}

# How long a client's own signed claims live, as upstream's: an hour for the Journal calls that
# stream or may last (a call ends when its token does), a minute otherwise.
BLOCKING_METHODS = frozenset(
    {
        "/protocol.Journal/Read",
        "/protocol.Journal/Replicate",
        "/protocol.Journal/List",
        "/protocol.Journal/Append",
        "/protocol.Journal/ListFragments",
    }
)


class AuthConfigError(ValueError):
    """Keys that cannot be used (not base64, or none given)."""


class Unauthenticated(Exception):
    """A request whose authorization does not verify: answered UNAUTHENTICATED."""


@dataclass(frozen=True)
class Claims:
    """What a verified token grants: `capability` over what `selector` matches, until `exp`."""

    capability: int
    selector: pb.LabelSelector = field(default_factory=pb.LabelSelector)
    exp: float = 0.0

    @property
    def unrestricted(self) -> bool:
        return not self.selector.include.labels and not self.selector.exclude.labels

    @functools.cached_property
    def _selector(self) -> pb.LabelSelector:
        """The selector with upstream's `prefix` meta-label as a prefix match of `name`."""
        return labels.rewrite_prefix_meta_label(self.selector)

    @functools.cached_property
    def journal_matcher(self) -> labels.JournalMatcher:
        return labels.JournalMatcher(self._selector)

    def sees_journal(self, spec: pb.JournalSpec) -> bool:
        return self.unrestricted or self.journal_matcher.matches(spec)

    def sees_labels(self, meta_labels: pb.LabelSet) -> bool:
        """Whether the selector matches a resource's labels with its meta-labels (a shard's
        `id`, a journal's `name`): how Apply authorizes upserts and deletes."""
        if self.unrestricted:
            return True
        return labels.matches(self._selector, meta_labels)


def signature_ttl(claims: Claims, want: timedelta, now: float | None = None) -> timedelta | None:
    """How long a signed URL handed to the bearer of `claims` may live: `want`, but never past
    the token's `exp` (a URL outliving its token would extend its reach). None when the token
    has no life left (it verified within the leeway). Claims of no token sign for `want`."""
    if not claims.exp:
        return want
    left = claims.exp - (time.time() if now is None else now)
    if left <= 0:
        return None
    return min(want, timedelta(seconds=left))


UNRESTRICTED = Claims(ALL)

# ---- claims as JSON (upstream's encoding of the Claims struct) --------------------------------


def _label_set_json(ls: pb.LabelSet) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for label in ls.labels:
        item: dict[str, Any] = {"name": label.name}
        if label.value:
            item["value"] = label.value
        if label.prefix:
            item["prefix"] = True
        out.append(item)
    return {"labels": out} if out else {}


def selector_json(sel: pb.LabelSelector) -> dict[str, Any]:
    return {"include": _label_set_json(sel.include), "exclude": _label_set_json(sel.exclude)}


def _label_set_of(doc: Any) -> pb.LabelSet:
    if doc is None:
        return pb.LabelSet()
    if not isinstance(doc, dict):
        raise Unauthenticated("verifying Authorization: claim 'sel' is not a label selector")
    out = pb.LabelSet()
    items = doc.get("labels") or []
    if not isinstance(items, list):
        raise Unauthenticated("verifying Authorization: claim 'sel' has labels that are not a list")
    for item in items:
        # Each field of its type, as upstream's decoding requires: never coerced (a string
        # "false" read as a prefix match would widen what the token sees).
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("name", ""), str)
            or not isinstance(item.get("value", ""), str)
            or not isinstance(item.get("prefix", False), bool)
        ):
            raise Unauthenticated("verifying Authorization: claim 'sel' has a malformed label")
        out.labels.add(
            name=item.get("name", ""), value=item.get("value", ""), prefix=item.get("prefix", False)
        )
    return out


def selector_of(doc: Any) -> pb.LabelSelector:
    if doc is None:
        return pb.LabelSelector()
    if not isinstance(doc, dict):
        raise Unauthenticated("verifying Authorization: claim 'sel' is not a label selector")
    return pb.LabelSelector(
        include=_label_set_of(doc.get("include")), exclude=_label_set_of(doc.get("exclude"))
    )


# ---- keys --------------------------------------------------------------------------------------


def parse_keys(text: str, flag: str = "auth keys") -> tuple[list[bytes], bool]:
    """Keys as upstream parses them: base64, separated by whitespace and/or commas; `AA==`
    allows requests without a token. Returns (keys, allow_missing)."""
    keys: list[bytes] = []
    allow_missing = False
    for index, item in enumerate(text.replace(",", " ").split()):
        if item == ALLOW_MISSING_KEY:
            allow_missing = True
            continue
        try:
            keys.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError):
            raise AuthConfigError(
                f"{flag}: the key at index {index} is not base64 (give base64-encoded keys, "
                "separated by spaces or commas)"
            ) from None
    if not keys:
        raise AuthConfigError(f"{flag}: at least one key must be given (besides {ALLOW_MISSING_KEY})")  # fmt: skip
    return keys, allow_missing


def _capability_problem(have: int, require: int) -> str | None:
    if have & require == require:
        return None
    for bit, name in CAPABILITY_NAMES.items():
        if require & bit and not have & bit:
            return f"authorization is missing required {name} capability"
    return f"authorization is missing required capability (have {have:b}, but require {require:b})"


# ---- verifying (servers) -----------------------------------------------------------------------


class Verifier(Protocol):
    def verify(self, metadata: Iterable[tuple[str, Any]] | None, require: int) -> Claims: ...


class NoopVerifier:
    """No keys configured: every request has every capability over everything."""

    def verify(self, metadata: Iterable[tuple[str, Any]] | None, require: int) -> Claims:
        return UNRESTRICTED


class KeyedVerifier:
    """Verifies bearer tokens with pre-shared keys. A verified token is cached (its claims and
    expiry), so that a client sending the same token over many calls costs one dict lookup
    after the first."""

    # Seconds past a token's `exp` it still verifies, and a call it admitted goes on.
    leeway = LEEWAY

    def __init__(self, keys: list[bytes], allow_missing: bool, *, cache_size: int = 4096) -> None:
        self.keys = keys
        self.allow_missing = allow_missing
        self._cache: OrderedDict[str, Claims] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_text(cls, text: str, flag: str = "auth keys") -> KeyedVerifier:
        keys, allow_missing = parse_keys(text, flag)
        return cls(keys, allow_missing)

    def verify(self, metadata: Iterable[tuple[str, Any]] | None, require: int) -> Claims:
        header = None
        for key, value in metadata or ():
            if key == "authorization":
                header = value.decode() if isinstance(value, bytes) else value
                break
        if header is None:
            if self.allow_missing:
                return Claims(require)  # No token, no expiry: the call is not bounded.
            raise Unauthenticated("missing or empty Authorization token")
        if not header.startswith("Bearer "):
            raise Unauthenticated("invalid or unsupported Authorization header (expected 'Bearer')")
        token = header[len("Bearer ") :]
        claims = self._cache.get(token)
        now = time.time()
        if claims is None or now > claims.exp + LEEWAY:
            claims = self._decode(token)
            self._cache[token] = claims
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        problem = _capability_problem(claims.capability, require)
        if problem is not None:
            raise Unauthenticated(problem)
        return claims

    def _decode(self, token: str) -> Claims:
        last: Exception | None = None
        for key in self.keys:
            try:
                with _short_keys_allowed():
                    doc = jwt.decode(
                        token,
                        key,
                        algorithms=ALGORITHMS,
                        leeway=LEEWAY,
                        # An `aud` claim (external issuers set one) is not checked, as
                        # upstream does not check it.
                        options={"require": ["exp"], "verify_iat": True, "verify_aud": False},
                    )
                break
            except jwt.InvalidSignatureError as exc:
                last = exc  # Another key may verify it.
            except jwt.PyJWTError as exc:
                raise Unauthenticated(f"verifying Authorization: {_jwt_problem(exc)}") from None
        else:
            raise Unauthenticated(f"verifying Authorization: {_jwt_problem(last)}")
        cap = doc.get("cap", 0)
        if not isinstance(cap, int) or isinstance(cap, bool) or not 0 <= cap <= ALL:
            raise Unauthenticated("verifying Authorization: claim 'cap' is not a capability mask")
        return Claims(cap, selector_of(doc.get("sel")), float(doc["exp"]))


@contextlib.contextmanager
def _short_keys_allowed() -> Iterator[None]:
    """Keys of any length work, as upstream's: PyJWT's warning on short HMAC keys is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*HMAC key.*")
        yield


def _jwt_problem(exc: Exception | None) -> str:
    if isinstance(exc, jwt.InvalidSignatureError):
        return "token signature is invalid"
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "token has invalid claims: token is expired"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "token has invalid claims: token used before issued"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"token is missing required claim: {exc.claim} claim is required"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return "token signature is invalid: signing method is invalid"
    if isinstance(exc, jwt.DecodeError):
        return "token is malformed"
    return str(exc) or type(exc).__name__


def verifier_of(keys_text: str, flag: str) -> NoopVerifier | KeyedVerifier:
    """The verifier for a server's `--*.auth-keys` value: none when it is empty."""
    if not keys_text.strip():
        return NoopVerifier()
    return KeyedVerifier.from_text(keys_text, flag)


async def verify_or_abort(
    verifier: Verifier, context: grpc.aio.ServicerContext[Any, Any], require: int
) -> Claims:
    """The request's claims, or the RPC aborted UNAUTHENTICATED with upstream's reason. Claims
    of a token bound the call (see CallBounds) to its `exp` plus the verifier's leeway."""
    try:
        claims = verifier.verify(context.invocation_metadata(), require)
    except Unauthenticated as exc:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise AssertionError("unreachable") from None
    if claims.exp:
        bound = _CALL_BOUND.get()
        if bound is not None:
            bound.arm(claims.exp + getattr(verifier, "leeway", LEEWAY))
    return claims


# ---- a call bounded by its token (servers) ---------------------------------------------------

# How a call that outlived its token ends (UNAUTHENTICATED): clients that renew their tokens
# (KeyedAuth) call again; a read resumes where it was.
EXPIRED_DURING_CALL = "token expired during the call"
# A streaming call whose token ran out while its response was being sent is ended at its next
# response; one whose client does not take that response within this grace is cut off.
SEND_GRACE = 1.0

_CALL_BOUND: contextvars.ContextVar[_CallBound | None] = contextvars.ContextVar(
    "gazette_call_bound", default=None
)


def expired_during_call(exc: BaseException) -> bool:
    """Whether `exc` is a call ended because its token expired while it ran (possibly relayed
    by a proxying broker), rather than a token refused at the call's start."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    return (
        isinstance(exc, grpc.RpcError)
        and callable(code)
        and callable(details)
        and code() == grpc.StatusCode.UNAUTHENTICATED
        and EXPIRED_DURING_CALL in (details() or "")
    )


class _CallBound:
    """The bound of one call, in its handler's task: nothing until a token verified (`arm`);
    then, at its deadline, the handler's work is cancelled where it waits, and the call ends
    UNAUTHENTICATED. While a streaming handler's response is with gRPC (`inside` False) the
    cancellation would land in gRPC's own code: the call ends at its next response instead."""

    __slots__ = ("_handle", "_task", "deadline", "fired", "inside")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self.deadline = 0.0
        self.fired = False
        self.inside = True

    def arm(self, deadline: float) -> None:
        self.disarm()
        self.deadline = deadline
        self._handle = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.time()), self._fire
        )

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self.fired = True
        if self.inside:
            self._handle = None
            self._task.cancel()
        else:
            self._handle = asyncio.get_running_loop().call_later(SEND_GRACE, self._cut_off)

    def _cut_off(self) -> None:
        self._handle = None
        if not self.inside:
            self._task.cancel()  # The client does not read: no status could reach it anyway.

    def caught(self) -> bool:
        """Whether a cancellation that ended the handler was this bound's (then undone, for the
        call to be answered)."""
        if not self.fired:
            return False
        self._task.uncancel()
        return True

    def message(self) -> str:
        return (
            f"{EXPIRED_DURING_CALL}: authorization ends at the token's exp plus "
            f"{LEEWAY:g}s of leeway; call again with a fresh token"
        )


def _unary_bounded(behavior: Any) -> Any:
    async def bounded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        task = asyncio.current_task()
        assert task is not None
        bound = _CallBound(task)
        _CALL_BOUND.set(bound)
        try:
            response = await behavior(request, context)
        except asyncio.CancelledError:
            if not bound.caught():
                raise
        else:
            bound.caught()  # (Its cancellation swallowed by a handler that answered anyway.)
            return response
        finally:
            bound.disarm()
            _CALL_BOUND.set(None)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, bound.message())

    return bounded


def _stream_bounded(behavior: Any) -> Any:
    async def bounded(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        task = asyncio.current_task()
        assert task is not None
        bound = _CallBound(task)
        _CALL_BOUND.set(bound)
        responses = behavior(request, context).__aiter__()
        try:
            while True:
                bound.inside = True
                try:
                    response = await anext(responses)
                except StopAsyncIteration:
                    if bound.fired:  # The handler swallowed the cancellation: still over.
                        bound.caught()
                        break
                    return
                except asyncio.CancelledError:
                    if not bound.caught():
                        raise
                    break
                bound.inside = False
                if bound.fired:
                    break
                yield response
        finally:
            bound.disarm()
            _CALL_BOUND.set(None)
            with contextlib.suppress(Exception):
                await responses.aclose()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, bound.message())

    return bounded


def _bounded(handler: Any) -> Any:
    """`handler` (a grpc.aio method handler) with its behaviour bounded by its token."""
    replaced: dict[str, Any] = {}
    for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        if inspect.isasyncgenfunction(behavior):
            replaced[kind] = _stream_bounded(behavior)
        elif inspect.iscoroutinefunction(behavior):
            # A unary response, or a stream written with context.write.
            replaced[kind] = _unary_bounded(behavior)
    if not replaced or not hasattr(handler, "_replace"):
        return handler  # Synchronous behaviour: not ours to bound.
    return handler._replace(**replaced)


class CallBounds(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Ends every call of a server when the token it was admitted with expires (its `exp`
    plus the verifier's leeway), with UNAUTHENTICATED (EXPIRED_DURING_CALL): its handler is
    cancelled where it waits, as at any other cancellation, and the call answered. Calls
    admitted without a token (`AA==`) and servers without keys are not bounded. Each method's
    wrapped handler is made once."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, _bounded(handler))
        return cached[1]


def call_bounds(verifier: Verifier) -> tuple[grpc.aio.ServerInterceptor[Any, Any], ...]:
    """The interceptors of a server verifying with `verifier`: none without keys."""
    return (CallBounds(),) if isinstance(verifier, KeyedVerifier) else ()


# ---- authorizing (clients) ---------------------------------------------------------------------


class Token(NamedTuple):
    """A call's authorization metadata, and when its token expires (inf: no token, or one
    whose expiry the authorizer does not know, such as a pre-shared one)."""

    metadata: tuple[tuple[str, str], ...]
    exp: float


NO_TOKEN = Token((), math.inf)


def name_selector(journal: str) -> pb.LabelSelector:
    """The selector of one journal by name (`name=<journal>`), as upstream narrows the claims
    of a call about one journal."""
    return labels.selector(include=labels.label_set(("name", journal)))


class Authorizer(Protocol):
    enabled: bool

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]: ...

    def token(
        self,
        capability: int,
        selector: pb.LabelSelector | None,
        ttl: float,
        *,
        fresh_for: float | None = None,
    ) -> Token: ...


class NoopAuth:
    enabled = False

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        return ()

    def token(
        self,
        capability: int,
        selector: pb.LabelSelector | None,
        ttl: float,
        *,
        fresh_for: float | None = None,
    ) -> Token:
        return NO_TOKEN


class BearerAuth:
    """Sends a pre-shared token (`--broker.auth-token`) with every call."""

    enabled = True

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token.strip()}"),)

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def token(
        self,
        capability: int,
        selector: pb.LabelSelector | None,
        ttl: float,
        *,
        fresh_for: float | None = None,
    ) -> Token:
        return Token(self._metadata, math.inf)


class KeyedAuth:
    """Signs claims with the first of its keys (HS256). A token is reused while more than a
    quarter of its life is left (or `fresh_for` seconds, where the caller needs that long),
    so steady traffic signs rarely."""

    enabled = True

    def __init__(self, keys: list[bytes], *, cache_size: int = 1024) -> None:
        self.key = keys[0]
        # (capability, selector, ttl): the token last signed for them.
        self._cache: OrderedDict[tuple[int, bytes, float], Token] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_text(cls, text: str, flag: str = "auth keys") -> KeyedAuth:
        keys, _ = parse_keys(text, flag)
        return cls(keys)

    def sign(self, claims_capability: int, selector: pb.LabelSelector | None, ttl: float) -> str:
        return self._signed(claims_capability, selector, ttl)[0]

    def _signed(
        self, claims_capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[str, int]:
        now = int(time.time())
        exp = now + max(1, int(ttl))
        doc: dict[str, Any] = {
            "cap": claims_capability,
            "sel": selector_json(selector or pb.LabelSelector()),
            "iat": now,
            "exp": exp,
        }
        with _short_keys_allowed():
            return jwt.encode(doc, self.key, algorithm="HS256"), exp

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        return self.token(capability, selector, ttl).metadata

    def token(
        self,
        capability: int,
        selector: pb.LabelSelector | None,
        ttl: float,
        *,
        fresh_for: float | None = None,
    ) -> Token:
        """A token for these claims with more than `fresh_for` seconds (a quarter of `ttl` by
        default) of life left: the last one signed for them, or a new one."""
        key = (capability, selector.SerializeToString() if selector else b"", ttl)
        hit = self._cache.get(key)
        left = ttl * 0.25 if fresh_for is None else fresh_for
        if hit is not None and hit.exp - time.time() > left:
            return hit
        signed, exp = self._signed(capability, selector, ttl)
        made = self._cache[key] = Token((("authorization", f"Bearer {signed}"),), float(exp))
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return made


NOOP_AUTH = NoopAuth()


def authorizer_of(keys_text: str = "", token: str = "", flag: str = "auth keys") -> Authorizer:
    """A client's authorizer from its `--*.auth-keys` or `--*.auth-token` value."""
    if keys_text.strip():
        return KeyedAuth.from_text(keys_text, flag)
    if token.strip():
        return BearerAuth(token)
    return NOOP_AUTH


def _request_selector(method: str, request: Any) -> pb.LabelSelector | None:
    """Upstream's default claims narrow a Read or ListFragments to its journal, a List to its
    selector; ours narrow a Stat or GetHints to its shard (`id=<shard>`) as well. Other calls
    ask for the capability over everything the key may grant."""
    if method in ("/protocol.Journal/Read", "/protocol.Journal/ListFragments"):
        journal = getattr(request, "journal", "")
        if journal:
            return name_selector(journal.split(";", 1)[0])
    elif method in ("/consumer.Shard/Stat", "/consumer.Shard/GetHints"):
        shard = getattr(request, "shard", "")
        if shard:
            return labels.selector(include=labels.label_set((labels.META_ID, shard)))
    elif method == "/protocol.Journal/List":
        sel = getattr(request, "selector", None)
        if isinstance(sel, pb.LabelSelector):
            return sel
    return None


class _AuthorizedCall:
    """A multi-callable that adds the method's authorization to each call's metadata, unless
    the caller gave one."""

    __slots__ = ("_auth", "_capability", "_inner", "_method", "_ttl")

    def __init__(self, inner: Any, method: str, auth: Authorizer) -> None:
        self._inner = inner
        self._method = method
        self._auth = auth
        self._capability = METHOD_CAPABILITY.get(method, ALL)
        self._ttl = 3600.0 if method in BLOCKING_METHODS else 60.0

    def __call__(self, request: Any = None, *args: Any, **kwargs: Any) -> Any:
        metadata = kwargs.get("metadata")
        if not metadata or not any(k == "authorization" for k, _ in metadata):
            selector = _request_selector(self._method, request)
            extra = self._auth.metadata(self._capability, selector, self._ttl)
            kwargs["metadata"] = tuple(metadata or ()) + extra
        if request is None and not args:
            return self._inner(**kwargs)
        return self._inner(request, *args, **kwargs)


class AuthorizedChannel:
    """A gRPC channel whose calls carry authorization from `auth` (see module doc)."""

    def __init__(self, channel: grpc.aio.Channel, auth: Authorizer) -> None:
        self._channel = channel
        self._auth = auth

    def _wrap(self, make: Callable[..., Any]) -> Callable[..., Any]:
        def multi_callable(method: str, *args: Any, **kwargs: Any) -> Any:
            return _AuthorizedCall(make(method, *args, **kwargs), method, self._auth)

        return multi_callable

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._channel, name)
        if name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._wrap(attr)
        return attr

    async def __aenter__(self) -> AuthorizedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close(None)


def authorized_channel(channel: grpc.aio.Channel, auth: Authorizer) -> grpc.aio.Channel:
    """`channel`, or a wrapper attaching `auth`'s tokens when it has any to attach."""
    if not auth.enabled:
        return channel
    return AuthorizedChannel(channel, auth)  # type: ignore[return-value]


def sees_shard(claims: Claims, spec: Any) -> bool:
    """Whether a shard (its labels plus the `id` meta-label) is visible to `claims`."""
    return claims.unrestricted or claims.sees_labels(labels.shard_meta_labels(spec))
