"""The azure:// fragment store, over azure-storage-blob (imported only when an azure:// store opens).

As upstream, `azure://container/prefix/` names a blob container of the storage account in
AZURE_ACCOUNT_NAME, authorized by the shared key in AZURE_ACCOUNT_KEY; signed GET URLs carry a
read-only service SAS made with that key. The blob service is `https://<account>.blob.core.windows.net`
unless AZURE_BLOB_ENDPOINT names another (Azurite, a sovereign cloud, a private endpoint).
"""

from __future__ import annotations

import contextlib
import http
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO

from azure.core import exceptions as azure_exceptions
from azure.storage.blob import (
    BlobSasPermissions,
    BlobServiceClient,
    ContentSettings,
    generate_blob_sas,
)

from broker.fragment.stores.base import (
    ChunkedReader,
    FragmentStore,
    StoreError,
    StoreObject,
    StoreURL,
    one_line,
    stream,
)

__all__ = ["AzureStore"]

# Service error codes that mean the store is not usable with these credentials (upstream's
# IsAuthError treats a missing container like a denied one: persisting moves to the next store).
_AUTH_CODES = frozenset(
    {
        "ContainerNotFound",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "InsufficientAccountPermissions",
        "AccountIsDisabled",
    }
)


class AzureStore(FragmentStore):
    """A fragment store in an Azure Blob Storage container."""

    scheme = "azure"
    # open() reads ranges of this many bytes at a time.
    read_chunk_size = 8 << 20

    def __init__(self, store_url: StoreURL) -> None:
        super().__init__(store_url)
        account = os.environ.get("AZURE_ACCOUNT_NAME", "")
        key = os.environ.get("AZURE_ACCOUNT_KEY", "")
        if not account or not key:
            raise StoreError(
                f"cannot open {store_url.url}: azure:// stores need the storage account's name "
                "and shared key (set AZURE_ACCOUNT_NAME and AZURE_ACCOUNT_KEY)",
                is_auth_error=True,
            )
        endpoint = os.environ.get("AZURE_BLOB_ENDPOINT", "") or (
            f"https://{account}.blob.core.windows.net"
        )
        self._account = account
        self._key = key
        try:
            self._client: Any = BlobServiceClient(
                endpoint,
                credential={"account_name": account, "account_key": key},
                connection_timeout=10,
                read_timeout=60,
            )
        except (ValueError, azure_exceptions.AzureError) as exc:
            raise StoreError(f"cannot open {store_url.url}: {exc}") from exc
        self._container: Any = self._client.get_container_client(store_url.bucket)

    def describe(self, key: str) -> str:
        return f"azure://{self._store_url.bucket}/{key}"

    def close(self) -> None:
        self._client.close()

    def _blob(self, key: str) -> Any:
        return self._container.get_blob_client(key)

    def _put(self, key: str, body: BinaryIO, length: int, content_encoding: str) -> bool:
        settings = ContentSettings(
            content_type="application/octet-stream", content_encoding=content_encoding or None
        )
        try:
            # overwrite=False sends If-None-Match: *, so only a put where no blob is succeeds.
            self._blob(key).upload_blob(
                body, length=length, overwrite=False, content_settings=settings
            )
        except azure_exceptions.ResourceExistsError:
            return False
        return True

    def _exists(self, key: str) -> bool:
        return bool(self._blob(key).exists())

    def _download(self, key: str, offset: int, length: int | None) -> bytes:
        try:
            downloader = self._blob(key).download_blob(
                offset=offset,
                length=length,
                # The stored bytes, even of blobs with a Content-Encoding.
                decompress=False,
                max_concurrency=1,
            )
            data: bytes = downloader.readall()
        except azure_exceptions.HttpResponseError as exc:
            if exc.status_code == 416:
                return b""  # At or past the end.
            raise
        return data

    def _open(self, key: str, offset: int) -> BinaryIO:
        reader = ChunkedReader(
            lambda pos, size: self._download(key, pos, size), offset, self.read_chunk_size
        )
        reader.prime()
        return stream(reader.read, reader.close, self._reader_errors("read", key))

    def _get(self, key: str, offset: int, length: int | None) -> bytes:
        return self._download(key, offset, length)

    def _list(self, key_prefix: str) -> Iterator[StoreObject]:
        for blob in self._container.list_blobs(name_starts_with=key_prefix):
            name: str = blob.name
            if name.endswith("/"):
                continue  # A directory placeholder.
            yield StoreObject(
                path=name[len(key_prefix) :],
                size=int(blob.size or 0),
                mod_time=blob.last_modified.astimezone(UTC),
            )

    def _sign_get(self, key: str, ttl: timedelta) -> str:
        now = datetime.now(UTC)
        sas = generate_blob_sas(
            account_name=self._account,
            container_name=self._store_url.bucket,
            blob_name=key,
            account_key=self._key,
            permission=BlobSasPermissions(read=True),
            # A little slack for clocks behind ours, as the SDK's samples do.
            start=now - timedelta(minutes=5),
            expiry=now + ttl,
        )
        return f"{self._blob(key).url}?{sas}"

    def _remove(self, key: str) -> None:
        with contextlib.suppress(azure_exceptions.ResourceNotFoundError):  # Already gone is fine.
            self._blob(key).delete_blob()

    def _classify(self, op: str, exc: Exception) -> tuple[str, bool, bool]:
        if isinstance(exc, azure_exceptions.HttpResponseError):
            status = int(exc.status_code or 0)
            code = str(getattr(exc, "error_code", None) or "")
            message = _message(exc, status)
            summary = f"{status} {code}: {message}" if code else f"{status} {message}"
            is_auth = code in _AUTH_CODES or status == 403
            not_found = code == "BlobNotFound" or (status == 404 and code != "ContainerNotFound")
            return summary, is_auth, not_found and op in ("open", "get", "read")
        if isinstance(exc, azure_exceptions.AzureError):
            return f"{type(exc).__name__}: {one_line(str(exc), 200)}", False, False
        return f"{type(exc).__name__}: {exc}", False, False


def _message(exc: azure_exceptions.HttpResponseError, status: int) -> str:
    # The SDK's message repeats the code and adds request ids and timestamps on further lines.
    first = (exc.reason or "") or str(exc.message or "").split("\n", 1)[0]
    if first:
        return one_line(first, 200)
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "error"
