"""Where a journal's fragments live in a store, and the rule that no journal's are another's.

A fragment of journal J persisted to store S has the object key `S.prefix + rewrite(J/postfix/
name)` (for file://, the path under the broker's file root), as upstream. Two things let one
journal's fragments be another's: store URLs which spell one location many ways (`file:///./y/`,
`file:///x/../y/`, `file:///y//`, `file:///%79/`), and journals whose keys meet (journal `secret`
in `file:///y/` and journal `y/secret` in `file:///`; or a rewrite `?find=&replace=` onto another
journal's name; or a journal `y` in `file:///`, which lists `y/secret/...` as its own fragments
under a postfix). So:

- Store URLs are canonical (`canonical_store_url`): Apply refuses any other spelling, naming the
  canonical one, and brokers canonicalise the specs they read from etcd.
- A journal's *fragment path* in a store (`fragment_path`) is its storage (the bucket, or the
  brokers' shared file root) and the key prefix `S.prefix + rewrite(J/)` under which every one of
  its fragments lies. A path which is not a clean directory (`.`, `..` or empty segments), or a
  rewrite which could match across the end of the journal's name, is refused: nothing could be
  said of where such fragments land.
- No two journals' fragment paths in one storage are equal or nested (`PathIndex`). Apply checks
  it against every journal in the keyspace; at runtime a journal whose path meets an older
  journal's is neither listed nor persisted there, and a listing leaves out what lies under a
  younger journal's path nested in its own.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, quote_plus, unquote, unquote_to_bytes, urlsplit

from broker.fragment.stores.base import (
    JOURNAL_HEALTH_DIR,
    StoreURLError,
    _parse_query,
    parse_store_url,
)
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import quote as show

__all__ = [
    "JOURNAL_HEALTH_DIR",
    "FragmentPath",
    "PathError",
    "PathIndex",
    "PathIndexCache",
    "StoreGuard",
    "canonical_spec_stores",
    "canonical_store_url",
    "chosen_origin",
    "fragment_path",
    "key_problem",
    "lock_of",
    "overlap",
]

# Characters a canonical path segment leaves unescaped (RFC 3986 pchar, as Go's url package).
_SEGMENT_SAFE = "-._~!$&'()*+,;=:@"
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._:[]")


class PathError(ValueError):
    """A journal's fragments in a store would have no path of their own (one line)."""


# --- Canonical store URLs --------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def canonical_store_url(url: str) -> str:
    """The one spelling of fragment store `url`: scheme lowercased; no user info, fragment or
    empty query; the bucket with its escapes decoded; the path with its escapes decoded and '.',
    '..' and empty segments resolved, each segment escaped once (RFC 3986), ending in exactly one
    '/'; query arguments under their canonical names, once each (the last value, as upstream),
    empty ones dropped, each value escaped as Go's url.QueryEscape does. Arguments stay in the
    order written: their order changes nothing a store does (and upstream's own examples put
    `profile` before `endpoint`), while every other difference could name another location.

    Raises StoreURLError (one line naming the URL) for an unusable URL, a path that climbs above
    the store's root with '..', or one whose escapes decode to something no key can hold.
    """
    parsed = parse_store_url(url)  # Scheme, escapes and query arguments, as stores read them.

    def fail(reason: str) -> StoreURLError:
        return StoreURLError(f"{show(url)} is not a valid fragment store: {reason}")

    parts = urlsplit(url)
    host = unquote(parsed.bucket)
    if any(char not in _HOST_CHARS for char in host):
        raise fail(f"its bucket {show(host)} has characters no bucket name holds")
    try:
        path = unquote_to_bytes(parts.path).decode("utf-8")
    except UnicodeDecodeError:
        raise fail("its path's escapes do not decode to UTF-8") from None
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        raise fail("its path holds a control character once decoded")
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if not segments:
                raise fail("its path climbs above the store's root with '..'")
            segments.pop()
            continue
        segments.append(segment)
    canonical_path = "/" + "".join(quote(s, safe=_SEGMENT_SAFE) + "/" for s in segments)
    args = _parse_query(parts.query, parsed.scheme, url)  # In the order written: see above.
    if args.get("endpoint"):
        # A bare origin (parse_store_url checked it): one spelling, without its trailing '/'.
        origin_scheme, _, origin = args["endpoint"].partition("://")
        args["endpoint"] = f"{origin_scheme.lower()}://{origin.rstrip('/').lower()}"
    query = "&".join(
        f"{name}={quote_plus(value, safe='')}" for name, value in args.items() if value
    )
    return f"{parsed.scheme}://{host}{canonical_path}" + (f"?{query}" if query else "")


def canonical_spec_stores(spec: pb.JournalSpec) -> None:
    """Rewrite `spec`'s stores in their canonical spelling, in place; a store that has none
    (unusable) is left as written (it fails where it is used, and claims no path)."""
    for at, url in enumerate(spec.fragment.stores):
        with contextlib.suppress(ValueError):
            spec.fragment.stores[at] = canonical_store_url(url)


# --- Fragment paths --------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class FragmentPath:
    """Where every fragment of one journal in one store lies: `key` (ending in '/') is the object
    key prefix within `storage`, which is "file" for file:// stores (the brokers' file root) and
    "bucket:<name>" for s3, gs and azure (lowercased, whatever the scheme, endpoint or region:
    one name may be reached through each, so they are taken as one)."""

    storage: str
    key: str


def key_problem(key: str) -> str | None:
    """Why object key prefix `key` is not a clean directory (None if it is)."""
    if not key.endswith("/") and key:
        return "does not end in '/'"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in key):
        return "holds a control character"
    if key and any(segment in ("", ".", "..") for segment in key[:-1].split("/")):
        return "is not a clean path (it has an empty, '.' or '..' segment)"
    return None


@functools.lru_cache(maxsize=1 << 16)
def fragment_path(journal: str, url: str) -> FragmentPath:
    """The fragment path of `journal` in store `url`, computed as the store computes object keys
    (its prefix, then its rewrite of `journal/`). Raises PathError (one line naming the journal)
    where its fragments would have no clean directory of their own, and StoreURLError for an
    unusable URL."""
    parsed = parse_store_url(canonical_store_url(url))
    directory = journal + "/"
    find = parsed.find
    if find and find not in directory:
        # Upstream rewrites the first match in the whole `journal/postfix/name`: one that starts
        # inside `journal/` and ends past it would move fragments out of the journal's path.
        for start in range(len(directory)):
            tail = directory[start:]
            if len(tail) < len(find) and find.startswith(tail):
                raise PathError(
                    f"journal {journal}: the rewrite of {show(url)} (find {show(find)}) could "
                    "match across the end of its name; its fragments would have no path of "
                    "their own"
                )
    key = parsed.prefix + parsed.rewrite(directory)
    problem = key_problem(key) or ("is the store's whole root" if not key else None)
    if problem is not None:
        raise PathError(
            f"journal {journal}: its fragments in {show(url)} would be under {show(key)}, "
            f"which {problem}"
        )
    storage = "file" if parsed.scheme == "file" else "bucket:" + unquote(parsed.bucket).lower()
    return FragmentPath(storage, key)


def lock_of(path: FragmentPath) -> tuple[str, str]:
    """What two Applies whose paths could meet (equal or nested) share: the storage and the
    first segment of the key directory (fragment_path refuses the store's whole root)."""
    return path.storage, path.key.partition("/")[0]


def chosen_origin(url: str) -> tuple[str, str, str, str] | None:
    """(scheme, bucket, endpoint, profile) of canonical store `url` when it sets an `endpoint`
    or a `profile`, else None: what decides where the broker sends requests signed with its
    credentials, and which of them sign."""
    parsed = parse_store_url(url)
    endpoint, profile = parsed.arg("endpoint"), parsed.arg("profile")
    if not endpoint and not profile:
        return None
    return parsed.scheme, unquote(parsed.bucket).lower(), endpoint, profile


def overlap(a: FragmentPath, b: FragmentPath) -> bool:
    """Whether fragment paths `a` and `b` are equal or one lies inside the other."""
    return a.storage == b.storage and (a.key.startswith(b.key) or b.key.startswith(a.key))


# --- The keyspace's paths --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Claim:
    create_revision: int
    journal: str
    key: str


@dataclass(frozen=True)
class StoreGuard:
    """What a broker may do with journal `journal`'s fragments in one store: nothing when `error`
    is set (its path is not its own); else its objects lie under `key`, except those under the
    `excluded` key prefixes (younger journals' paths nested in its own)."""

    journal: str
    store: str
    key: str = ""
    excluded: tuple[str, ...] = ()
    error: str = ""

    def key_problem(self, key: str) -> str | None:
        """Why a fragment of the journal may not be written or read at object key `key`."""
        if self.error:
            return self.error
        if not key.startswith(self.key) or any(key.startswith(e) for e in self.excluded):
            return (
                f"journal {self.journal}: object {show(key)} of {self.store} lies outside its own "
                f"fragment path {show(self.key)}"
            )
        relative = key[len(self.key) :]
        if any(part in ("", ".", "..") for part in relative.split("/")):
            return (
                f"journal {self.journal}: object {show(key)} of {self.store} is not a clean path "
                "under its fragment path"
            )
        return None


@dataclass
class PathIndex:
    """The fragment paths of a set of journals (a keyspace's, at one revision), by storage."""

    _claims: dict[str, dict[str, list[_Claim]]] = field(default_factory=dict)
    _sorted: dict[str, list[str]] = field(default_factory=dict)
    _revisions: dict[str, int] = field(default_factory=dict)
    _specs: dict[str, pb.JournalSpec] = field(default_factory=dict)

    @classmethod
    def of(cls, journals: Iterable[tuple[str, pb.JournalSpec, int]]) -> PathIndex:
        """The index of `journals`: (name, spec, create revision) each. A store whose path is
        refused (PathError, StoreURLError) claims nothing: the journal cannot use it."""
        index = cls()
        for name, spec, revision in journals:
            index._revisions[name] = revision
            index._specs[name] = spec
            for url in spec.fragment.stores:
                try:
                    path = fragment_path(name, url)
                except ValueError:
                    continue
                claim = _Claim(revision, name, path.key)
                index._claims.setdefault(path.storage, {}).setdefault(path.key, []).append(claim)
        for storage, keys in index._claims.items():
            index._sorted[storage] = sorted(keys)
        return index

    def spec(self, journal: str, create_revision: int = 0) -> pb.JournalSpec | None:
        """The spec of `journal`, or None when the index has no such journal (deleted), or,
        given the `create_revision` of the journal one knows, when that one was deleted and the
        name created again since (another journal, perhaps another tenant's)."""
        if create_revision and self._revisions.get(journal) != create_revision:
            return None
        return self._specs.get(journal)

    def overlapping(self, path: FragmentPath, exclude: Container[str] = ()) -> list[_Claim]:
        """Claims of journals (other than those in `exclude`) whose path is equal to `path`,
        contains it or lies inside it; oldest first."""
        claims = self._claims.get(path.storage, {})
        found: list[_Claim] = []
        # Keys end in '/': one containing `path` is a prefix of its key at a '/'.
        at = 0
        while (at := path.key.find("/", at) + 1) > 0:
            found.extend(claims.get(path.key[:at], ()))
        keys = self._sorted.get(path.storage, [])
        for key in keys[bisect.bisect_right(keys, path.key) :]:
            if not key.startswith(path.key):
                break
            found.extend(claims[key])
        found = [c for c in found if c.journal not in exclude]
        return sorted(set(found), key=lambda c: (c.create_revision, c.journal, c.key))

    def guard(self, journal: str, url: str) -> StoreGuard:
        """What `journal` (of this index) may do in store `url`: when its path meets an older
        journal's (lower create revision; then lower name), nothing; else what lies under its
        path, less younger journals' paths nested in it."""
        try:
            path = fragment_path(journal, url)
        except ValueError as err:
            return StoreGuard(journal, url, error=str(err))
        mine = (self._revisions.get(journal, 0), journal)
        excluded: list[str] = []
        for claim in self.overlapping(path, exclude=(journal,)):
            if (claim.create_revision, claim.journal) < mine:
                return StoreGuard(
                    journal,
                    url,
                    error=(
                        f"journal {journal}: its fragment path {show(path.key)} in {url} meets "
                        "an older journal's; it is neither listed nor persisted there"
                    ),
                )
            if claim.key.startswith(path.key) and claim.key != path.key:
                excluded.append(claim.key)
        return StoreGuard(journal, url, key=path.key, excluded=tuple(sorted(set(excluded))))


class PathIndexCache:
    """The PathIndex of a keyspace's journals, built again only when a journal changed.
    `source()` gives the revision and the journals (name, spec, create revision) at it;
    `revision()` the keyspace's revision now. The keyspace's owner calls `invalidate()` (from a
    keyspace observer, so in step with the mirror) when a batch touched the journals: the
    revision moves with every assignment and pulse, and building the index at each of those
    would cost every listing and persist O(journals)."""

    def __init__(
        self,
        source: Callable[[], tuple[int, Iterable[tuple[str, pb.JournalSpec, int]]]],
        revision: Callable[[], int],
    ) -> None:
        self._source = source
        self._revision = revision
        self._index: PathIndex | None = None

    def invalidate(self) -> None:
        self._index = None

    def index(self) -> tuple[int, PathIndex]:
        """The revision and index of the keyspace as it is now (call on the event loop): no
        journal changed between the index's build and that revision."""
        if self._index is None:
            revision, journals = self._source()
            self._index = PathIndex.of(journals)
            return revision, self._index
        return self._revision(), self._index

    def spec(self, journal: str, create_revision: int = 0) -> pb.JournalSpec | None:
        """The current spec of `journal`, None once it is deleted, or once it was created again
        after the journal of `create_revision` (call on the event loop)."""
        return self.index()[1].spec(journal, create_revision)

    def guards(self, journal: str, spec: pb.JournalSpec) -> Sequence[StoreGuard]:
        """The guard of each store of `spec` (the spec of `journal`), in order."""
        _, index = self.index()
        return [index.guard(journal, url) for url in spec.fragment.stores]
