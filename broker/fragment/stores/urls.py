"""Reading the fragment URLs brokers hand to clients (signed http(s) URLs, and file:// URLs of
file stores), so that readers fetch fragment content directly from storage.

Every failure is a StoreError with a one-line message; messages show URLs without their query,
which for signed URLs carries the signature.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlsplit

from broker.fragment.stores.base import (
    ObjectNotFoundError,
    StoreError,
    StreamReader,
    one_line,
    os_error_summary,
    resolve_under,
)

__all__ = ["URLStream", "open_url", "read_url", "redact_url"]

_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_READ_SIZE = 1 << 20


class URLStream(io.BufferedReader):
    """The content of a fragment URL. `content_encoding` is the response's Content-Encoding
    (e.g. "gzip" when a store did not decompress as asked), or "" (always for file://)."""

    def __init__(self, raw: io.RawIOBase, content_encoding: str = "") -> None:
        super().__init__(raw, _READ_SIZE)
        self.content_encoding = content_encoding


def redact_url(url: str) -> str:
    """`url` without its query and fragment (a signed URL's query is a bearer credential)."""
    parts = urlsplit(url)
    if not parts.scheme:
        return one_line(url.split("?", 1)[0], 200)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def open_url(
    url: str,
    *,
    offset: int = 0,
    length: int | None = None,
    file_root: Path | None = None,
    accept_encoding: str | None = None,
    timeout: float = 60.0,
) -> URLStream:
    """A stream of the content at `url` from byte `offset` (at most `length` bytes).

    http(s) URLs are fetched with a Range header (servers ignoring it are handled);
    `accept_encoding` sets the Accept-Encoding header: "gzip" asks for stored gzip bytes as they
    are, "identity" asks the store to decompress (GZIP_OFFLOAD_DECOMPRESSION). file:// URLs are
    resolved under `file_root`. An offset at or past the end gives an empty stream.
    """
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"negative offset {offset} or length {length} for {redact_url(url)}")
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _open_http(url, offset, length, accept_encoding, timeout)
    if scheme == "file":
        return _open_file(url, offset, length, file_root)
    raise StoreError(
        f"cannot read fragment URL {redact_url(url)}: scheme {scheme or '(none)'!r} is not "
        "http, https or file"
    )


def read_url(
    url: str,
    offset: int = 0,
    length: int | None = None,
    file_root: Path | None = None,
    *,
    accept_encoding: str | None = None,
    timeout: float = 60.0,
) -> bytes:
    """The content at `url` from `offset`, at most `length` bytes (see `open_url`)."""
    if length == 0:
        open_url(url, offset=offset, length=0, file_root=file_root).close()
        return b""
    with open_url(
        url,
        offset=offset,
        length=length,
        file_root=file_root,
        accept_encoding=accept_encoding,
        timeout=timeout,
    ) as body:
        return body.read()


def _empty() -> URLStream:
    return URLStream(StreamReader(lambda _: b"", lambda: None, lambda exc: StoreError(str(exc))))


def _open_http(
    url: str, offset: int, length: int | None, accept_encoding: str | None, timeout: float
) -> URLStream:
    shown = redact_url(url)
    headers: dict[str, str] = {}
    if offset or length is not None:
        end = "" if length is None else str(offset + max(length, 1) - 1)
        headers["Range"] = f"bytes={offset}-{end}"
    if accept_encoding:
        headers["Accept-Encoding"] = accept_encoding
    try:
        response = urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        )
    except urllib.error.HTTPError as exc:
        with exc:
            detail = _error_detail(exc.read(4096))
        if detail.lstrip(": ") == str(exc.reason):
            detail = ""
        if exc.code == 416:
            return _empty()
        kind = ObjectNotFoundError if exc.code == 404 else StoreError
        raise kind(
            f"GET {shown}: {exc.code} {exc.reason}{detail}", is_auth_error=exc.code in (401, 403)
        ) from None
    except urllib.error.URLError as exc:
        raise StoreError(f"GET {shown}: {_reason(exc.reason)}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise StoreError(f"GET {shown}: {_reason(exc)}") from None

    # 206 carries the range asked for; 200 is the whole object (the server ignored Range).
    skip = offset if response.status == 200 else 0
    body = StreamReader(
        response.read,
        response.close,
        lambda exc: StoreError(f"GET {shown}: reading the response failed: {_reason(exc)}"),
        skip=skip,
        limit=length,
    )
    return URLStream(body, response.headers.get("Content-Encoding", "") or "")


def _open_file(url: str, offset: int, length: int | None, file_root: Path | None) -> URLStream:
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.netloc not in ("", "localhost"):
        raise StoreError(f"cannot read fragment URL {shown}: a file:// URL cannot name a host")
    if file_root is None:
        raise StoreError(
            f"cannot read fragment URL {shown}: file:// fragments are read under a file root "
            "(pass file_root, as the broker's --broker.file-root)"
        )
    path = resolve_under(file_root, unquote(parts.path), what=f"fragment URL {shown}")
    try:
        f = path.open("rb", buffering=0)
    except FileNotFoundError:
        raise ObjectNotFoundError(f"read {shown}: no such file {path}") from None
    except OSError as exc:
        raise StoreError(
            f"read {shown}: {os_error_summary(exc)}", is_auth_error=isinstance(exc, PermissionError)
        ) from None
    f.seek(offset)
    if length is None:
        # The file itself: one copy per read, straight into the caller's buffer.
        return URLStream(f)
    body = StreamReader(
        f.read,
        f.close,
        lambda exc: StoreError(f"read {shown}: {_reason(exc)}"),
        limit=length,
    )
    return URLStream(body)


def _reason(reason: object) -> str:
    if isinstance(reason, OSError):
        return os_error_summary(reason)
    if isinstance(reason, BaseException):
        text = str(reason)
        return f"{type(reason).__name__}: {text}" if text else type(reason).__name__
    return str(reason)


def _error_detail(body: bytes) -> str:
    """What a storage service said about a failed request (S3 XML or GCS JSON errors)."""
    text = body.decode("utf-8", "replace").strip()
    if not text:
        return ""
    code, message = _XML_CODE.search(text), _XML_MESSAGE.search(text)
    if code or message:
        parts = [m.group(1) for m in (code, message) if m]
        return ": " + one_line(": ".join(parts), 200)
    if text.startswith("{"):
        try:
            error = json.loads(text).get("error", {})
            return ": " + one_line(str(error.get("message", error)), 200)
        except (ValueError, AttributeError):
            pass
    return ": " + one_line(text.splitlines()[0], 200)
