"""The fragment store interface shared by file://, gs://, s3:// and azure:// stores, store URL parsing, and
the errors stores raise.

Stores are synchronous: each method blocks on its SDK or file system. The broker calls them through
`asyncio.to_thread`; Spark executors and gazctl call them directly. Paths handed to a store are
journal-relative content paths (`journal/postfix/name`, see `fragments.content_path`); the store
applies its URL's find/replace rewriter and prefix to get the object key, as upstream does.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import BinaryIO, ClassVar, cast
from urllib.parse import unquote, urlsplit

from broker.fragment.fragments import parse_relative_path
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError, quote, validate_fragment_store

__all__ = [
    "HEALTH_CHECK_CONTENT",
    "HEALTH_CHECK_PATH",
    "FragmentStore",
    "ObjectNotFoundError",
    "StoreError",
    "StoreObject",
    "StoreURL",
    "StoreURLError",
    "check_store_url",
    "one_line",
    "parse_store_url",
    "resolve_under",
]

log = logging.getLogger(__name__)

HEALTH_CHECK_PATH = ".test/health-check"
# Where a health check asked with a selector puts its probes: under the fragment path of a journal
# the caller sees, in a directory no postfix or journal name can spell ('~' is outside their
# alphabet), which listings of the journal skip.
JOURNAL_HEALTH_DIR = ".gazette~health"
HEALTH_CHECK_CONTENT = b"health-check\n"
DELETE_PROBE_NAME = ".gazette-delete-probe"
# Temporary files of in-progress file:// puts (upstream's naming too); listings skip them.
PARTIAL_PREFIX = ".partial-"

_MAX_MESSAGE = 300


# --- Errors --------------------------------------------------------------------------------------


class StoreURLError(ValueError):
    """A fragment store URL that gazette-py cannot use; the message is one line naming the URL."""


class StoreError(Exception):
    """A fragment store operation failed. The message is one line naming the operation and object.

    `is_auth_error` is True where the failure is known to be an authorization one (access denied,
    bucket or directory missing): when exiting, persisting falls back to the next store on those.
    """

    def __init__(self, message: str, *, is_auth_error: bool = False) -> None:
        super().__init__(one_line(message))
        self.is_auth_error = is_auth_error


class ObjectNotFoundError(StoreError):
    """The object does not exist (a read of a removed or never-written fragment)."""


class _ShortSourceError(StoreError):
    """A put's source ended before its declared length (named with its object by `_errors`)."""


def one_line(text: str, limit: int = _MAX_MESSAGE) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# --- Store URLs ----------------------------------------------------------------------------------

# Query arguments each scheme accepts, by their canonical (upstream field) spelling. Upstream
# decodes them with gorilla/schema, which matches keys case-insensitively and rejects unknown ones.
_REWRITER_ARGS = ("find", "replace")
_SCHEME_ARGS: dict[str, tuple[str, ...]] = {
    "file": _REWRITER_ARGS,
    "gs": _REWRITER_ARGS,
    "azure": _REWRITER_ARGS,
    "s3": (
        *_REWRITER_ARGS,
        "profile",
        "endpoint",
        "ACL",
        "storageClass",
        "SSE",
        "SSEKMSKeyId",
        "region",
    ),
}
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class StoreURL:
    """A parsed fragment store URL.

    `bucket` is the URL host (empty for file://); `prefix` is the URL path without its leading
    '/', so it is empty or ends in '/'; `args` are the query arguments under their canonical
    names, sorted; `find`/`replace` configure the journal path rewriter.
    """

    url: str
    scheme: str
    bucket: str
    prefix: str
    args: tuple[tuple[str, str], ...] = ()
    find: str = ""
    replace: str = ""

    def arg(self, name: str) -> str:
        """The value of query argument `name` (canonical spelling), or "" when absent."""
        for key, value in self.args:
            if key == name:
                return value
        return ""

    def rewrite(self, path: str) -> str:
        """`path` with the first occurrence of `find` replaced by `replace` (as upstream)."""
        return path.replace(self.find, self.replace, 1) if self.find else path

    def key(self, path: str) -> str:
        """The object key (file:// : the path under the file root) of a journal-relative path."""
        return self.prefix + self.rewrite(path)


def _unescape_query(text: str, url: str) -> str:
    match = _BAD_ESCAPE.search(text)
    if match:
        bad = text[match.start() : match.start() + 3]
        raise StoreURLError(f"{_quoted(url)} is not a valid fragment store: invalid escape {bad!r}")
    return unquote(text.replace("+", " "))


def _parse_query(raw: str, scheme: str, url: str) -> dict[str, str]:
    allowed = {name.lower(): name for name in _SCHEME_ARGS[scheme]}
    args: dict[str, str] = {}
    for part in raw.split("&"):
        if not part:
            continue
        if ";" in part:
            raise StoreURLError(
                f"{_quoted(url)} is not a valid fragment store: its query has a ';' separator "
                "(separate arguments with '&')"
            )
        raw_key, _, raw_value = part.partition("=")
        key = _unescape_query(raw_key, url)
        canonical = allowed.get(key.lower())
        if canonical is None:
            accepted = ", ".join(_SCHEME_ARGS[scheme])
            raise StoreURLError(
                f"{_quoted(url)} is not a valid fragment store: unknown query argument {key!r} "
                f"for {scheme}:// stores (accepted: {accepted})"
            )
        args[canonical] = _unescape_query(raw_value, url)  # The last one wins, as upstream.
    return args


def _quoted(url: str) -> str:
    return quote(url if len(url) <= 200 else url[:199] + "…")


def parse_store_url(url: str) -> StoreURL:
    """Parse and check a fragment store URL, raising StoreURLError (one line) if unusable."""
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme and scheme not in _SCHEME_ARGS and scheme != "azure-ad":
        raise StoreURLError(
            f"{_quoted(url)} is not a valid fragment store: scheme {scheme!r} is not one of "
            "file, gs, s3, azure"
        )
    try:
        validate_fragment_store(url, field="")
    except ValidationError as err:
        raise StoreURLError(str(err)) from None
    try:
        parts = urlsplit(url)
    except ValueError as err:
        raise StoreURLError(f"{_quoted(url)} is not a valid fragment store: {err}") from None
    if scheme == "azure-ad":
        raise StoreURLError(
            f"{_quoted(url)} is not a usable fragment store: azure-ad:// stores are not supported "
            "by gazette-py yet (use azure:// with AZURE_ACCOUNT_NAME and AZURE_ACCOUNT_KEY)"
        )
    args = _parse_query(parts.query, scheme, url)
    if args.get("endpoint"):
        problem = endpoint_problem(args["endpoint"])
        if problem is not None:
            raise StoreURLError(
                f"{_quoted(url)} is not a valid fragment store: its endpoint "
                f"{_quoted(args['endpoint'])} {problem} (write a bare origin: "
                "http://host[:port] or https://host[:port])"
            )
    path = unquote(parts.path)
    return StoreURL(
        url=url,
        scheme=scheme,
        bucket=parts.netloc.rpartition("@")[2],
        prefix=path[1:],
        args=tuple(sorted(args.items())),
        find=args.get("find", ""),
        replace=args.get("replace", ""),
    )


_ORIGIN_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def endpoint_problem(endpoint: str) -> str | None:
    """Why an s3:// store's `endpoint` is not a bare origin `http(s)://host[:port]` (None if it
    is; a trailing '/' is allowed, and canonical_store_url drops it). boto sends a path-style
    request for bucket B, key K to ENDPOINT/B/K: a path in the endpoint would make that another
    bucket's key, and a query, fragment or user info would change what is signed and sent."""
    if any(char in endpoint for char in "?#@\\%") or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in endpoint):  # fmt: skip
        return "has a query, fragment, user info, escape or control character"
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return "is not an http:// or https:// URL"
    host, slash, path = rest.partition("/")
    if path or (slash and not host):
        return "has a path"
    hostname, colon, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
    if not colon:
        hostname = host
    elif not port.isdigit() or not 0 < int(port) < 65536:
        return f"has no valid port ({port!r})"
    if not hostname or not _ORIGIN_HOST.fullmatch(hostname):
        return "has no valid host"
    return None


def check_store_url(url: str) -> None:
    """Raise StoreURLError (one line naming the URL and the problem) if `url` is unusable."""
    parse_store_url(url)


def resolve_under(root: Path, relative: str, *, what: str) -> Path:
    """`root / relative`, refusing (StoreError) a path that escapes `root`, and one with a '.'
    or '..' segment: an object store would take such a key as written, so resolving it would
    make it name another object (a probe or fragment of another journal's path)."""
    if "\x00" in relative:
        raise StoreError(f"{what}: {relative!r} contains a NUL character")
    if any(segment in (".", "..") for segment in relative.split("/")):
        raise StoreError(
            f"{what}: key {relative!r} has a '.' or '..' segment; no key is resolved through one"
        )
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, relative.lstrip("/")))
    if full != base and not full.startswith(base.rstrip(os.sep) + os.sep):
        raise StoreError(f"{what}: {relative!r} escapes the file root {base}", is_auth_error=True)
    return Path(full)


# --- Readers -------------------------------------------------------------------------------------


class _Section(io.RawIOBase):
    """The `length` bytes of `source` from its current position, seekable when `source` is (SDKs
    rewind bodies to retry and to sign them)."""

    def __init__(self, source: BinaryIO, length: int) -> None:
        super().__init__()
        if not source.seekable():
            source = io.BytesIO(source.read(length))
        self._source = source
        self._start = source.tell()
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._length - self._pos)
        if want <= 0:
            return 0
        self._source.seek(self._start + self._pos)
        data = self._source.read(want)
        if not data:
            raise _ShortSourceError(
                f"the source ended after {self._pos} of its declared {self._length} bytes"
            )
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class StreamReader(io.RawIOBase):
    """A raw reader over `read(n)`: optionally discarding the first `skip` bytes (a server that
    ignored a Range) and stopping after `limit` bytes; failures become StoreError via
    `on_error`."""

    def __init__(
        self,
        read: Callable[[int], bytes],
        close: Callable[[], None],
        on_error: Callable[[Exception], StoreError],
        *,
        skip: int = 0,
        limit: int | None = None,
    ) -> None:
        super().__init__()
        self._read = read
        self._close = close
        self._on_error = on_error
        self._skip = skip
        self._left = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        try:
            while self._skip > 0:
                dropped = self._read(min(self._skip, 1 << 20))
                if not dropped:
                    return 0
                self._skip -= len(dropped)
            want = len(buffer) if self._left is None else min(len(buffer), self._left)
            if want <= 0:
                return 0
            data = self._read(want)
        except StoreError:
            raise
        except Exception as exc:
            raise self._on_error(exc) from exc
        if self._left is not None:
            self._left -= len(data)
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._close()
            finally:
                super().close()


class ChunkedReader:
    """Sequential reads as ranged gets of `chunk_size` bytes (for stores without streaming)."""

    def __init__(self, fetch: Callable[[int, int], bytes], offset: int, chunk_size: int) -> None:
        self._fetch = fetch
        self._pos = offset
        self._chunk_size = chunk_size
        self._buffer = b""
        self._eof = False

    def prime(self) -> None:
        """Fetch the first chunk now, so that a missing object fails at open."""
        self._fill()

    def _fill(self) -> None:
        if not self._buffer and not self._eof:
            self._buffer = self._fetch(self._pos, self._chunk_size)
            self._pos += len(self._buffer)
            self._eof = len(self._buffer) < self._chunk_size

    def read(self, size: int) -> bytes:
        self._fill()
        out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out

    def close(self) -> None:
        self._buffer = b""
        self._eof = True


def stream(
    read: Callable[[int], bytes],
    close: Callable[[], None],
    on_error: Callable[[Exception], StoreError],
    buffer_size: int = 1 << 20,
) -> BinaryIO:
    """A buffered binary stream over `read(n)` whose failures raise StoreError."""
    return cast(BinaryIO, io.BufferedReader(StreamReader(read, close, on_error), buffer_size))


# --- The store interface -------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreObject:
    """An object found by `FragmentStore.list`.

    `path` is relative to the listed (journal-relative) prefix: listing "a/journal/" finds
    "postfix/name" for the object of "a/journal/postfix/name". It is the stored key with the key
    prefix removed, so with a rewriter it is relative to the rewritten prefix, as upstream.
    """

    path: str
    size: int
    mod_time: datetime  # UTC.


class FragmentStore(ABC):
    """A fragment store: put, read, list and remove objects by journal-relative path."""

    scheme: ClassVar[str]

    def __init__(self, store_url: StoreURL) -> None:
        self._store_url = store_url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def url(self) -> str:
        """The store URL, as written in the journal spec."""
        return self._store_url.url

    @property
    def store_url(self) -> StoreURL:
        return self._store_url

    def key(self, path: str) -> str:
        """The object key of journal-relative `path` (prefix + rewritten path)."""
        return self._store_url.key(path)

    def describe(self, key: str) -> str:
        """How messages name the object at `key`."""
        return f"{self.scheme}://{self._store_url.bucket}/{key}"

    # --- Operations (public; each maps failures to StoreError) --------------------------------

    def put(self, path: str, source: BinaryIO, length: int, content_encoding: str = "") -> bool:
        """Write `length` bytes of `source` (from its current position) at `path` unless an object
        is there already. Returns False, leaving the existing object, when one was.

        A seekable source is read in place (and re-read if the SDK retries); another is buffered
        in memory. The source's position afterwards is unspecified; it is not closed.
        """
        if length < 0:
            raise ValueError(f"put of {path!r}: negative length {length}")
        key = self.key(path)
        with (
            self._errors("put", key),
            io.BufferedReader(_Section(source, length), 1 << 20) as body,
        ):
            return self._put(key, cast(BinaryIO, body), length, content_encoding)

    def exists(self, path: str) -> bool:
        """Whether an object is at `path`."""
        key = self.key(path)
        with self._errors("exists", key):
            return self._exists(key)

    def open(self, path: str, offset: int = 0) -> BinaryIO:
        """A stream of the stored bytes at `path` from `offset` (as written: no decoding of a
        content encoding). An offset at or past the end gives an empty stream."""
        if offset < 0:
            raise ValueError(f"open of {path!r}: negative offset {offset}")
        key = self.key(path)
        with self._errors("open", key):
            return self._open(key, offset)

    def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """The stored bytes at `path` from `offset`, at most `length` of them (all when None)."""
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"get of {path!r}: negative offset {offset} or length {length}")
        if length == 0:
            return b""
        key = self.key(path)
        with self._errors("get", key):
            return self._get(key, offset, length)

    def list(self, prefix: str) -> Iterator[StoreObject]:
        """Objects under journal-relative `prefix` (e.g. "a/journal/"), with paths relative to it.
        Directory placeholders and in-progress file:// puts are skipped."""
        key = self.key(prefix)
        with self._errors("list", key):
            # Iterating the first page here surfaces errors such as a missing bucket promptly.
            objects = self._list(key)
            first = next(objects, None)
        if first is None:
            return iter(())
        return self._guarded_iter(first, objects, key)

    def _guarded_iter(
        self, first: StoreObject, rest: Iterator[StoreObject], key: str
    ) -> Iterator[StoreObject]:
        yield first
        with self._errors("list", key):
            yield from rest

    def list_fragments(
        self, journal: str, *, excluded: Sequence[str] = ()
    ) -> builtins.list[pb.Fragment]:
        """Fragments of `journal` in this store, ordered on (begin, end, path_postfix).

        Each has backing_store = this store's URL, mod_time in unix seconds, and the path_postfix
        it is stored under. Objects whose names are not fragments' are logged and skipped; so,
        silently, are health-check probes under the journal's path, and objects whose keys begin
        with one of `excluded` (other journals' paths nested in this one's).
        """
        found: builtins.list[pb.Fragment] = []
        listed = self.key(journal + "/")
        for obj in self.list(journal + "/"):
            if obj.path.startswith(JOURNAL_HEALTH_DIR + "/") or (
                excluded and (listed + obj.path).startswith(tuple(excluded))
            ):
                continue
            try:
                fragment = parse_relative_path(journal, obj.path)
            except ValidationError as err:
                # Quoted: a stored name may hold line breaks or terminal escapes.
                log.warning(
                    "skipping %s under journal %s of %s: not a fragment (%s)",
                    quote(obj.path),
                    journal,
                    self.url,
                    err,
                )
                continue
            fragment.backing_store = self.url
            fragment.mod_time = int(obj.mod_time.timestamp())
            found.append(fragment)
        found.sort(key=lambda f: (f.begin, f.end, f.path_postfix))
        return found

    def sign_get(self, path: str, ttl: timedelta) -> str:
        """A URL from which the bearer may GET the object at `path` for `ttl`."""
        key = self.key(path)
        with self._errors("sign", key):
            return self._sign_get(key, ttl)

    def remove(self, path: str) -> None:
        """Remove the object at `path` (removing a missing object is not an error)."""
        key = self.key(path)
        with self._errors("remove", key):
            self._remove(key)

    def health_check(
        self, check_delete_prefix: str | None = None, *, probe_dir: str = ".test/"
    ) -> None:
        """Check the operations brokers rely on, as upstream: put `.test/health-check`, get and
        compare it, list `.test/`, sign a GET URL and fetch it (when http or https). With
        `check_delete_prefix`, also put and remove a probe object under that prefix.
        `probe_dir` (journal-relative, ending in '/') puts the probe elsewhere than `.test/`.
        Raises StoreError (one line) naming the failed step."""
        from broker.fragment.stores.urls import read_url

        def failed(step: str, err: Exception) -> StoreError:
            return StoreError(
                f"health check of {self.url} failed at {step}: {err}",
                is_auth_error=getattr(err, "is_auth_error", False),
            )

        content = HEALTH_CHECK_CONTENT
        probe = probe_dir + HEALTH_CHECK_PATH.rpartition("/")[2]
        # put() returns False when an earlier check left the object; the request still had to
        # pass authorization to be refused on its precondition, so write access is checked.
        try:
            self.put(probe, io.BytesIO(content), len(content))
        except StoreError as err:
            raise failed("PUT", err) from None
        try:
            got = self.get(probe)
        except StoreError as err:
            raise failed("GET", err) from None
        if got != content:
            raise StoreError(
                f"health check of {self.url} failed at GET: content {got[:40]!r} is not {content!r}"
            )
        try:
            listed = [obj.path for obj in self.list(probe_dir)]
        except StoreError as err:
            raise failed("LIST", err) from None
        if "health-check" not in listed:
            raise StoreError(f"health check of {self.url} failed at LIST: health-check not found")
        try:
            signed = self.sign_get(probe, timedelta(minutes=5))
        except StoreError as err:
            raise failed("SignGet", err) from None
        if signed.startswith(("http://", "https://")):
            try:
                fetched = read_url(signed)
            except StoreError as err:
                raise failed("fetch of the signed URL", err) from None
            if fetched != content:
                raise StoreError(
                    f"health check of {self.url} failed at fetch of the signed URL: content "
                    f"{fetched[:40]!r} is not {content!r}"
                )
        if check_delete_prefix is not None:
            probe = check_delete_prefix + DELETE_PROBE_NAME
            marker = b"gazette-delete-probe\n"
            try:
                self.put(probe, io.BytesIO(marker), len(marker))
                self.remove(probe)
            except StoreError as err:
                raise failed("delete probe", err) from None

    def close(self) -> None:  # noqa: B027 (most stores hold nothing to release)
        """Release the store's client (connections)."""

    # --- Implementation hooks (keys are full object keys) --------------------------------------

    @abstractmethod
    def _put(self, key: str, body: BinaryIO, length: int, content_encoding: str) -> bool:
        """Write `body` (exactly `length` bytes, seekable) at `key` unless an object is there."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _open(self, key: str, offset: int) -> BinaryIO: ...

    def _get(self, key: str, offset: int, length: int | None) -> bytes:
        with self._open(key, offset) as stream_:
            return stream_.read() if length is None else stream_.read(length)

    @abstractmethod
    def _list(self, key_prefix: str) -> Iterator[StoreObject]: ...

    @abstractmethod
    def _sign_get(self, key: str, ttl: timedelta) -> str: ...

    @abstractmethod
    def _remove(self, key: str) -> None: ...

    @abstractmethod
    def _classify(self, op: str, exc: Exception) -> tuple[str, bool, bool]:
        """(one-line summary, is_auth_error, is_not_found) of an SDK or OS failure of `op`."""

    def _error(self, op: str, key: str, exc: Exception) -> StoreError:
        summary, is_auth, not_found = self._classify(op, exc)
        kind = ObjectNotFoundError if not_found else StoreError
        return kind(f"{op} {self.describe(key)}: {summary}", is_auth_error=is_auth)

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except _ShortSourceError as exc:
            raise StoreError(f"{op} {self.describe(key)}: {exc}") from None
        except StoreError:
            raise
        except (ValueError, TypeError) as exc:
            if _is_sdk_error(exc):
                raise self._error(op, key, exc) from exc
            raise
        except Exception as exc:
            raise self._error(op, key, exc) from exc

    def _reader_errors(self, op: str, key: str) -> Callable[[Exception], StoreError]:
        return lambda exc: self._error(op, key, exc)


def _is_sdk_error(exc: Exception) -> bool:
    # Some SDK failures subclass ValueError (botocore's ParamValidationError, google-auth's
    # configuration errors); plain ValueError/TypeError from our own code are bugs, not failures.
    module = type(exc).__module__
    return module.startswith(("botocore", "boto3", "google", "urllib3", "requests", "azure"))


def os_error_summary(exc: OSError) -> str:
    """A one-line summary of an OSError without repeating its file name."""
    return exc.strerror or type(exc).__name__ if exc.errno is not None else str(exc)
