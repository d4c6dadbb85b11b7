"""Authorization as upstream's: HMAC-signed JWTs carrying Claims (a capability bit mask `cap`
and a label selector `sel`), sent as `authorization: Bearer <jwt>` gRPC metadata.

Servers verify with a KeyedVerifier (`--broker.auth-keys`, `--consumer.auth-keys`): keys are
base64, separated by whitespace or commas; any key verifies, HS256 and HS384 only, `exp` is
required, `iat` and `nbf` are checked, with 5 s of leeway. The claims are decoded as upstream's
Go decodes them (see decode_claims): a claim it would refuse is refused, one it reads is read the
same way. The special key `AA==` admits requests that carry no token at all (for rolling
authorization out over a running cluster), for an hour, as upstream does. Every failure is
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
import codecs
import contextlib
import contextvars
import functools
import inspect
import json
import math
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import grpc

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
    # (Compared as seconds: a far exp is beyond what a timedelta holds.)
    return want if left >= want.total_seconds() else timedelta(seconds=left)


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


# ---- claims as upstream reads them --------------------------------------------------------------
#
# Upstream verifies with golang-jwt v5 into its Claims struct, decoded by Go's encoding/json:
# `cap` a uint32, `sel` a LabelSelector{include, exclude LabelSet{labels []Label{name, value
# string, prefix bool}}}, and jwt.RegisteredClaims (iss, sub, jti strings; aud a string or a
# list of them; exp, nbf, iat NumericDates). The payload is decoded here as Go decodes it into
# those types, rather than as a dict: a value of the wrong type fails the token (an
# UnmarshalTypeError); a key names its field in any case (bytes.EqualFold); a key given twice
# is decoded again into what the first one left (structs merge, lists are decoded into their
# existing elements); null leaves a struct or a string as it was and empties a list; unknown
# keys are ignored. PyJWT only checks the signature: its dict loses duplicate keys and order.


class _JsonNumber(NamedTuple):
    """A JSON number as written: Go decodes its text by the type it goes into."""

    text: str


class _JsonObject(NamedTuple):
    """A JSON object's pairs, in order, duplicates kept."""

    pairs: list[tuple[str, Any]]


def _refuse_constant(name: str) -> Any:
    """NaN and Infinity: Python's JSON reads them, Go's does not."""
    raise ValueError(f"{name} is not JSON")


# JSON's number grammar, as Go's isValidNumber checks a json.Number held in a string.
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_SURROGATE = re.compile("[\ud800-\udfff]")
# A NumericDate's seconds must fit Go's int64 (int64() of a float beyond it is undefined: it
# wraps or saturates by platform) with room for time.Time's own offset: refused beyond.
_DATE_LIMIT = 2.0**62


def _go_replace(exc: UnicodeError) -> tuple[str, int]:
    """Go's unquoting: each byte of invalid UTF-8 is one U+FFFD."""
    assert isinstance(exc, UnicodeDecodeError)
    return "\ufffd", exc.start + 1


codecs.register_error("gazette_go_utf8", _go_replace)


_FOLDS = {"\u017f": "S", "\u212a": "K"}


def _fold(key: str) -> str:
    """`key` folded as Go's encoding/json folds keys to find their fields (bytes.EqualFold):
    ASCII letters to upper case, and the two non-ASCII letters in an ASCII letter's simple
    fold orbit (U+017F long s, U+212A Kelvin sign) to theirs. Other runes fold to runes that
    no field name has, so they are left as they are."""
    if key.isascii():
        return key.upper()
    return "".join(c.upper() if c.isascii() else _FOLDS.get(c, c) for c in key)


class _ClaimError(Exception):
    """A claim Go's decoding would not take: `claim` names it, `problem` what is wrong."""

    def __init__(self, claim: str, problem: str) -> None:
        super().__init__(f"claim '{claim}' {problem}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, _JsonNumber):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


@dataclass
class _GoLabel:
    """A Go protocol.Label, decoded into in place."""

    name: str = ""
    value: str = ""
    prefix: bool = False


@dataclass
class _GoLabels:
    """A Go []Label as decoding leaves it: `held` is every element its backing array has held
    since it was made (Go decodes a list into the elements already there, up to what the array
    holds, so a longer list decoded after a shorter one finds the older elements again), and
    `length` the slice's length."""

    held: list[_GoLabel] = field(default_factory=list)
    length: int = 0


@dataclass
class _GoClaims:
    """Upstream's Claims as Go's decoding leaves them (exp, nbf, iat: whole seconds, or none)."""

    cap: int = 0
    include: _GoLabels = field(default_factory=_GoLabels)
    exclude: _GoLabels = field(default_factory=_GoLabels)
    exp: float | None = None
    nbf: float | None = None
    iat: float | None = None


def _fields(value: Any, claim: str, where: str, fields: dict[str, Callable[[Any], None]]) -> None:
    """Decodes an object into a struct whose fields (by folded JSON name) are `fields`: each
    pair, in order, into its field; null leaves the struct as it is."""
    if value is None:
        return
    if not isinstance(value, _JsonObject):
        raise _ClaimError(claim, f"{where}is {_kind(value)}, not an object")
    # Go prefers a field whose name matches exactly, then one that folds equal: these fields'
    # folded names are distinct, so the folded name alone finds the same field.
    for key, item in value.pairs:
        decode = fields.get(_fold(key))
        if decode is not None:
            decode(item)


def _string(value: Any, claim: str, where: str, current: str) -> str:
    if value is None:
        return current
    if not isinstance(value, str):
        raise _ClaimError(claim, f"{where}is {_kind(value)}, not a string")
    return _SURROGATE.sub("\ufffd", value)  # Go's unquoting: a lone surrogate is U+FFFD.


def _bool(value: Any, claim: str, where: str, current: bool) -> bool:
    if value is None:
        return current
    if not isinstance(value, bool):
        raise _ClaimError(claim, f"{where}is {_kind(value)}, not a boolean")
    return value


def _label(value: Any, where: str, label: _GoLabel) -> None:
    def name(v: Any) -> None:
        label.name = _string(v, "sel", f"{where}.name ", label.name)

    def value_(v: Any) -> None:
        label.value = _string(v, "sel", f"{where}.value ", label.value)

    def prefix(v: Any) -> None:
        label.prefix = _bool(v, "sel", f"{where}.prefix ", label.prefix)

    _fields(value, "sel", f"{where} ", {"NAME": name, "VALUE": value_, "PREFIX": prefix})


def _labels(value: Any, where: str, labels: _GoLabels) -> None:
    """Decodes a list into a []Label as Go's array decoding does (see _GoLabels)."""
    if value is None or (isinstance(value, list) and not value):
        # Null makes the slice nil, and an empty list a new empty one: nothing held is kept.
        labels.held, labels.length = [], 0
        return
    if not isinstance(value, list):
        raise _ClaimError("sel", f"{where} is {_kind(value)}, not a list of labels")
    for index, item in enumerate(value):
        if index == len(labels.held):
            labels.held.append(_GoLabel())
        _label(item, f"{where}[{index}]", labels.held[index])
    labels.length = len(value)


def _label_set(value: Any, where: str, labels: _GoLabels) -> None:
    def decode(v: Any) -> None:
        _labels(v, f"{where}.labels", labels)

    _fields(value, "sel", f"{where} ", {"LABELS": decode})


def _selector(value: Any, claims: _GoClaims) -> None:
    def include(v: Any) -> None:
        _label_set(v, "include", claims.include)

    def exclude(v: Any) -> None:
        _label_set(v, "exclude", claims.exclude)

    _fields(value, "sel", "", {"INCLUDE": include, "EXCLUDE": exclude})


def _capability(value: Any, current: int) -> int:
    """A uint32, as Go's ParseUint(text, 10) and its overflow check take it."""
    if value is None:
        return current
    text = value.text if isinstance(value, _JsonNumber) else None
    if text is None or not re.fullmatch("[0-9]{1,10}", text) or int(text) > ALL:
        raise _ClaimError("cap", f"is {_kind(value)}{f' ({text})' if text and len(text) < 30 else ''}, not a capability mask (an integer of 32 bits)")  # fmt: skip
    return int(text)


def _numeric_date(value: Any, claim: str) -> float | None:
    """golang-jwt's NumericDate: a json.Number (a number, or a string holding one), its
    Float64, then time.Unix(int64(whole), int64(fraction*1e9)) truncated to the second. Null
    is no date."""
    if value is None:
        return None
    text = value.text if isinstance(value, _JsonNumber) else value if isinstance(value, str) else None  # fmt: skip
    if text is None or not _JSON_NUMBER.fullmatch(text):
        raise _ClaimError(claim, f"is {_kind(value)}, not a number of seconds")
    seconds = float(text)
    fraction, whole = math.modf(seconds)  # (Python: fraction first; Go: whole first.)
    if math.isinf(seconds) or not -_DATE_LIMIT <= whole < _DATE_LIMIT:
        raise _ClaimError(claim, "is out of range")
    return float(int(whole) - (1 if int(fraction * 1e9) < 0 else 0))


def _audience(value: Any) -> None:
    """jwt.ClaimStrings: a string, a list of strings, or null (not kept: not checked)."""
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _ClaimError("aud", f"is {_kind(value)}, not a string or a list of strings")


def decode_claims(payload: bytes) -> _GoClaims:
    """The claims of a token's (verified) payload, decoded as upstream's Go decodes them into
    its Claims struct. Raises Unauthenticated (one line) for what Go would not decode."""
    try:
        doc = json.loads(
            payload.decode("utf-8", errors="gazette_go_utf8"),
            object_pairs_hook=_JsonObject,
            parse_int=_JsonNumber,
            parse_float=_JsonNumber,
            parse_constant=_refuse_constant,
        )
    except (ValueError, RecursionError):
        raise Unauthenticated(
            "verifying Authorization: token is malformed: could not JSON decode claim"
        ) from None
    claims = _GoClaims()

    def cap(v: Any) -> None:
        claims.cap = _capability(v, claims.cap)

    def sel(v: Any) -> None:
        _selector(v, claims)

    def string(name: str) -> Callable[[Any], None]:
        def check(v: Any) -> None:  # Not kept (not checked), but of its type.
            _string(v, name, "", "")

        return check

    def date(name: str) -> Callable[[Any], None]:
        return lambda v: setattr(claims, name, _numeric_date(v, name))

    fields: dict[str, Callable[[Any], None]] = {
        "CAP": cap,
        "SEL": sel,
        "ISS": string("iss"),
        "SUB": string("sub"),
        "JTI": string("jti"),
        "AUD": _audience,
        "EXP": date("exp"),
        "NBF": date("nbf"),
        "IAT": date("iat"),
    }
    try:
        if not isinstance(doc, _JsonObject | type(None)):
            raise _ClaimError("claims", f"are {_kind(doc)}, not an object")
        _fields(doc, "claims", "", fields)
    except _ClaimError as exc:
        raise Unauthenticated(
            f"verifying Authorization: token is malformed: could not JSON decode claim: {exc}"
        ) from None
    return claims


def _label_set_of(labels: _GoLabels) -> pb.LabelSet:
    out = pb.LabelSet()
    for label in labels.held[: labels.length]:
        out.labels.add(name=label.name, value=label.value, prefix=label.prefix)
    return out


def validate_times(claims: _GoClaims, now: float, leeway: float = LEEWAY) -> float:
    """golang-jwt's validation with upstream's options (exp required, iat checked, nbf always
    checked, `leeway` either way): the token's exp, or Unauthenticated."""
    if claims.exp is None:
        raise Unauthenticated("verifying Authorization: token is missing required claim: exp claim is required")  # fmt: skip
    if not now < claims.exp + leeway:
        raise Unauthenticated("verifying Authorization: token has invalid claims: token is expired")  # fmt: skip
    if claims.nbf is not None and now < claims.nbf - leeway:
        raise Unauthenticated("verifying Authorization: token has invalid claims: token is not valid yet")  # fmt: skip
    if claims.iat is not None and now < claims.iat - leeway:
        raise Unauthenticated("verifying Authorization: token has invalid claims: token used before issued")  # fmt: skip
    return claims.exp


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
    # How long a call admitted without a token (`AA==`) lasts: upstream's hour.
    missing_token_ttl = 3600.0

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
                # As upstream's: the capability asked for, over everything, expiring (whole
                # seconds, as a NumericDate) an hour on, so the call is bounded as any other.
                return Claims(require, exp=float(math.floor(time.time() + self.missing_token_ttl)))
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
        # Segments as Go's base64.RawURLEncoding takes them (no padding, no other characters:
        # PyJWT's decoding would skip what Go refuses).
        if not _COMPACT_JWS.fullmatch(token):
            raise Unauthenticated("verifying Authorization: token is malformed")
        import jwt  # Here, not at the top: PyJWT loads `cryptography`, a tenth of a second of CPU
        # that every gazctl and server process paid at its start, though most never verify.

        last: Exception | None = None
        for key in self.keys:
            try:
                # The signature only: the claims are decoded and checked below, as upstream's.
                with _short_keys_allowed():
                    verified = jwt.api_jws.decode_complete(token, key, algorithms=ALGORITHMS)
                break
            except jwt.InvalidSignatureError as exc:
                last = exc  # Another key may verify it.
            except jwt.PyJWTError as exc:
                raise Unauthenticated(f"verifying Authorization: {_jwt_problem(exc)}") from None
        else:
            raise Unauthenticated(f"verifying Authorization: {_jwt_problem(last)}")
        claims = decode_claims(verified["payload"])
        exp = validate_times(claims, time.time(), self.leeway)
        selector = pb.LabelSelector(
            include=_label_set_of(claims.include), exclude=_label_set_of(claims.exclude)
        )
        return Claims(claims.cap, selector, exp)


# A compact JWS: three segments of base64url without padding.
_COMPACT_JWS = re.compile(r"[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*")


@contextlib.contextmanager
def _short_keys_allowed() -> Iterator[None]:
    """Keys of any length work, as upstream's: PyJWT's warning on short HMAC keys is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*HMAC key.*")
        yield


def _jwt_problem(exc: Exception | None) -> str:
    import jwt

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


# A client-streaming call refused before any of its messages is read (for its token): were the
# stream ended while the client still sends, the client's send would fail, and gRPC's Python
# client reports that as INTERNAL ("Internal error from Core") in place of the refusal. What the
# refused client sends is read and dropped until its half-close first, within these bounds.
REFUSED_READ_SECONDS = 2.0
REFUSED_READ_BYTES = 16 << 20


async def _read_out(unread: AsyncIterator[Any]) -> None:
    received = 0
    # A read that fails, or the bound: the refusal goes out all the same.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSED_READ_SECONDS):
            async for message in unread:
                received += message.ByteSize()
                if received > REFUSED_READ_BYTES:
                    return


async def verify_or_abort(
    verifier: Verifier,
    context: grpc.aio.ServicerContext[Any, Any],
    require: int,
    unread: AsyncIterator[Any] | None = None,
) -> Claims:
    """The request's claims, or the RPC aborted UNAUTHENTICATED with upstream's reason. Claims
    that expire (a token's, or those of no token under `AA==`) bound the call (see CallBounds)
    to their `exp` plus the verifier's leeway. `unread`: a client-streaming call's requests, read
    out (within bounds) before a refusal, so that its client hears the refusal."""
    try:
        claims = verifier.verify(context.invocation_metadata(), require)
    except Unauthenticated as exc:
        if unread is not None:
            await _read_out(unread)
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
    cancelled where it waits, as at any other cancellation, and the call answered. A call
    admitted without a token (`AA==`) is bounded by upstream's hour (its claims expire then);
    servers without keys are not bounded. Each method's wrapped handler is made once."""

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
        import jwt

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
