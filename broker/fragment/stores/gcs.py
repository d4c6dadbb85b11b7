"""The gs:// fragment store, over google-cloud-storage (imported only when a gs:// store opens).

Credentials are Application Default Credentials. When `STORAGE_EMULATOR_HOST` is set (tests, local
development against fake-gcs-server) the client talks to the emulator with anonymous credentials
and project "test-project", and signed URLs are the emulator's plain media download URLs.
"""

from __future__ import annotations

import contextlib
import http
import os
import re
import warnings
from collections.abc import Iterator
from datetime import UTC, timedelta
from typing import Any, BinaryIO
from urllib.parse import quote

import google.auth
import google.auth.exceptions
import google.auth.transport.requests
from google.auth.credentials import AnonymousCredentials, Credentials, Signing

with warnings.catch_warnings():
    # google-api-core warns when grpcio is installed without grpcio-status; that only concerns
    # gRPC error details, and this store uses the JSON API.
    warnings.simplefilter("ignore", ImportWarning)
    from google.api_core import exceptions as api_exceptions
    from google.cloud import storage  # type: ignore[import-untyped]

from broker.fragment.stores.base import (
    ChunkedReader,
    FragmentStore,
    StoreError,
    StoreObject,
    StoreURL,
    one_line,
    stream,
)

__all__ = ["GCSStore"]

_FULL_CONTROL = "https://www.googleapis.com/auth/devstorage.full_control"
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"([^"]*)"')
_EMULATOR_PROJECT = "test-project"


class GCSStore(FragmentStore):
    """A fragment store in a Google Cloud Storage bucket."""

    scheme = "gs"
    # open() reads ranges of this many bytes at a time.
    read_chunk_size = 8 << 20

    def __init__(self, store_url: StoreURL) -> None:
        super().__init__(store_url)
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        self._emulator = emulator if "://" in emulator or not emulator else "http://" + emulator
        credentials: Credentials
        try:
            if self._emulator:
                credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
                client = storage.Client(project=_EMULATOR_PROJECT, credentials=credentials)
            else:
                credentials, _ = google.auth.default(scopes=[_FULL_CONTROL])
                client = storage.Client(project=None, credentials=credentials)
        except Exception as exc:
            raise StoreError(
                f"cannot open {store_url.url}: {type(exc).__name__}: {exc}",
                is_auth_error=isinstance(exc, google.auth.exceptions.DefaultCredentialsError),
            ) from exc
        self._credentials = credentials
        self._client: Any = client
        self._bucket: Any = client.bucket(store_url.bucket)

    def close(self) -> None:
        self._client.close()

    def _put(self, key: str, body: BinaryIO, length: int, content_encoding: str) -> bool:
        blob = self._bucket.blob(key)
        if content_encoding:
            blob.content_encoding = content_encoding
        try:
            blob.upload_from_file(
                body,
                size=length,
                content_type="application/octet-stream",
                if_generation_match=0,  # Only if no live object has this name.
            )
        except api_exceptions.PreconditionFailed:
            return False
        return True

    def _exists(self, key: str) -> bool:
        return bool(self._bucket.blob(key).exists())

    def _download(self, key: str, start: int, end: int | None) -> bytes:
        ranged = start > 0 or end is not None
        try:
            data: bytes = self._bucket.blob(key).download_as_bytes(
                start=start if ranged else None,
                end=end,
                # The stored bytes, even of objects with a Content-Encoding (no transcoding).
                raw_download=True,
                checksum=None if ranged else "auto",
            )
        except api_exceptions.RequestRangeNotSatisfiable:
            return b""  # At or past the end.
        return data

    def _open(self, key: str, offset: int) -> BinaryIO:
        chunk_size = self.read_chunk_size
        reader = ChunkedReader(
            lambda pos, size: self._download(key, pos, pos + size - 1), offset, chunk_size
        )
        reader.prime()
        return stream(reader.read, reader.close, self._reader_errors("read", key))

    def _get(self, key: str, offset: int, length: int | None) -> bytes:
        return self._download(key, offset, None if length is None else offset + length - 1)

    def _list(self, key_prefix: str) -> Iterator[StoreObject]:
        for blob in self._client.list_blobs(self._bucket, prefix=key_prefix):
            name: str = blob.name
            if name.endswith("/"):
                continue  # A directory placeholder.
            yield StoreObject(
                path=name[len(key_prefix) :],
                size=int(blob.size or 0),
                mod_time=blob.updated.astimezone(UTC),
            )

    def _sign_get(self, key: str, ttl: timedelta) -> str:
        creds = self._credentials
        if self._emulator or isinstance(creds, AnonymousCredentials):
            base = self._emulator or "https://storage.googleapis.com"
            return (
                f"{base.rstrip('/')}/download/storage/v1/b/{quote(self._store_url.bucket, safe='')}"
                f"/o/{quote(key, safe='')}?alt=media"
            )
        blob = self._bucket.blob(key)
        if isinstance(creds, Signing):
            url: str = blob.generate_signed_url(version="v4", expiration=ttl, method="GET")
            return url
        # Credentials without a private key (e.g. on Compute Engine) sign through the IAM
        # signBlob API, which needs the service account's email and a current token.
        if not creds.valid:
            creds.refresh(google.auth.transport.requests.Request())  # type: ignore[no-untyped-call]
        email = getattr(creds, "service_account_email", None)
        if not email or email == "default":
            raise StoreError(
                f"sign {self.describe(key)}: these credentials cannot sign URLs "
                "(use a service-account key via GOOGLE_APPLICATION_CREDENTIALS)",
                is_auth_error=True,
            )
        url = blob.generate_signed_url(
            version="v4",
            expiration=ttl,
            method="GET",
            service_account_email=email,
            access_token=creds.token,
        )
        return url

    def _remove(self, key: str) -> None:
        with contextlib.suppress(api_exceptions.NotFound):  # Already gone is fine.
            self._bucket.blob(key).delete()

    def _classify(self, op: str, exc: Exception) -> tuple[str, bool, bool]:
        if isinstance(exc, api_exceptions.GoogleAPICallError):
            code = int(exc.code or 0)
            reason = _reason(exc, code)
            # An upload or a listing can only 404 when the bucket is missing.
            missing_bucket = code == 404 and (op in ("put", "list") or "bucket" in reason.lower())
            not_found = code == 404 and not missing_bucket and op in ("open", "get", "read")
            return f"{code} {reason}", code == 403 or missing_bucket, not_found
        if isinstance(exc, google.auth.exceptions.GoogleAuthError):
            return f"credentials: {type(exc).__name__}: {exc}", False, False
        return f"{type(exc).__name__}: {exc}", False, False


def _reason(exc: api_exceptions.GoogleAPICallError, code: int) -> str:
    for error in exc.errors or ():
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    match = _JSON_MESSAGE.search(exc.message or "")
    if match:
        return match.group(1)
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return one_line(exc.message or type(exc).__name__, 120)
