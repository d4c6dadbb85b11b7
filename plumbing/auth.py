"""Authorization as upstream's: HMAC-signed JWTs carrying Claims (a capability bit mask `cap`
and a label selector `sel`), sent as `authorization: Bearer <jwt>` gRPC metadata.

Servers verify with a KeyedVerifier (`--broker.auth-keys`, `--consumer.auth-keys`): keys are
base64, separated by whitespace or commas; any key verifies, HS256 and HS384 only, `exp` is
required, `iat` is checked, with 5 s of leeway. The special key `AA==` admits requests that carry
no token at all (for rolling authorization out over a running cluster). Every failure is
UNAUTHENTICATED, as upstream answers it. What a token's selector does not match does not exist
for its bearer: the servers treat such journals and shards as not found.

Clients authorize with a KeyedAuth (signs short-lived claims with the first key; brokers and
consumers sign their own when they proxy or replicate), a BearerAuth (a pre-shared token,
`--broker.auth-token`) or NoopAuth. `authorized_channel` attaches the token a method needs to
every call of a gRPC channel, so stubs and callers need not know of authorization.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

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

# Which capability each RPC requires (upstream's table), by full method name.
METHOD_CAPABILITY: dict[str, int] = {
    "/protocol.Journal/List": LIST,
    "/protocol.Journal/Apply": APPLY,
    "/protocol.Journal/Read": READ,
    "/protocol.Journal/Append": APPEND,
    "/protocol.Journal/Replicate": REPLICATE,
    "/protocol.Journal/ListFragments": READ,
    "/protocol.Journal/FragmentStoreHealth": READ,
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

# How long a client's own signed claims live: an hour for blocking RPCs, a minute otherwise.
BLOCKING_METHODS = frozenset(
    {"/protocol.Journal/Read", "/protocol.Journal/Replicate", "/protocol.Journal/List"}
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
                return Claims(require, exp=time.time() + 3600)
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
    """The request's claims, or the RPC aborted UNAUTHENTICATED with upstream's reason."""
    try:
        return verifier.verify(context.invocation_metadata(), require)
    except Unauthenticated as exc:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise AssertionError("unreachable") from None


# ---- authorizing (clients) ---------------------------------------------------------------------


class Authorizer(Protocol):
    enabled: bool

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]: ...


class NoopAuth:
    enabled = False

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        return ()


class BearerAuth:
    """Sends a pre-shared token (`--broker.auth-token`) with every call."""

    enabled = True

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token.strip()}"),)

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        return self._metadata


class KeyedAuth:
    """Signs claims with the first of its keys (HS256). A token is reused while more than a
    quarter of its life is left, so steady traffic signs rarely."""

    enabled = True

    def __init__(self, keys: list[bytes], *, cache_size: int = 1024) -> None:
        self.key = keys[0]
        # (capability, selector, ttl): (reuse until, metadata).
        self._cache: OrderedDict[tuple[int, bytes, float], tuple[float, tuple[tuple[str, str], ...]]] = OrderedDict()  # fmt: skip
        self._cache_size = cache_size

    @classmethod
    def from_text(cls, text: str, flag: str = "auth keys") -> KeyedAuth:
        keys, _ = parse_keys(text, flag)
        return cls(keys)

    def sign(self, claims_capability: int, selector: pb.LabelSelector | None, ttl: float) -> str:
        now = int(time.time())
        doc: dict[str, Any] = {
            "cap": claims_capability,
            "sel": selector_json(selector or pb.LabelSelector()),
            "iat": now,
            "exp": now + max(1, int(ttl)),
        }
        with _short_keys_allowed():
            return jwt.encode(doc, self.key, algorithm="HS256")

    def metadata(
        self, capability: int, selector: pb.LabelSelector | None, ttl: float
    ) -> tuple[tuple[str, str], ...]:
        key = (capability, selector.SerializeToString() if selector else b"", ttl)
        now = time.time()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        md = (("authorization", f"Bearer {self.sign(capability, selector, ttl)}"),)
        self._cache[key] = (now + ttl * 0.75, md)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return md


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
    selector; other calls ask for the capability over everything the key may grant."""
    if method in ("/protocol.Journal/Read", "/protocol.Journal/ListFragments"):
        journal = getattr(request, "journal", "")
        if journal:
            return labels.selector(include=labels.label_set(("name", journal.split(";", 1)[0])))
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
