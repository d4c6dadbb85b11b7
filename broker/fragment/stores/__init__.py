"""Fragment stores: where journal fragments persist (file://, gs://, s3://, azure://), and reading the
fragment URLs brokers return.

`open_store(url, file_root=...)` gives the cached store of a URL; `check_store_url(url)` is what
spec validation calls. Importing this package is cheap: the cloud SDKs (google-cloud-storage,
boto3, azure-storage-blob) are imported only when a store of theirs is first opened.
"""

from __future__ import annotations

import threading
from pathlib import Path

from broker.fragment.stores.base import (
    HEALTH_CHECK_CONTENT,
    HEALTH_CHECK_PATH,
    FragmentStore,
    ObjectNotFoundError,
    StoreError,
    StoreObject,
    StoreURL,
    StoreURLError,
    check_store_url,
    parse_store_url,
)
from broker.fragment.stores.urls import URLStream, open_url, read_url, redact_url

__all__ = [
    "HEALTH_CHECK_CONTENT",
    "HEALTH_CHECK_PATH",
    "FragmentStore",
    "ObjectNotFoundError",
    "StoreError",
    "StoreObject",
    "StoreURL",
    "StoreURLError",
    "URLStream",
    "check_store_url",
    "close_stores",
    "open_store",
    "open_url",
    "parse_store_url",
    "read_url",
    "redact_url",
]

_stores: dict[tuple[str, Path | None], FragmentStore] = {}
_lock = threading.Lock()


def open_store(url: str, *, file_root: Path | None = None) -> FragmentStore:
    """The store of fragment store `url`, created on first use and cached per (url, file_root).

    Raises StoreURLError for an unusable URL, and StoreError when the store cannot be opened
    (no credentials, no region, a file:// store without a file root). Failures are not cached.
    """
    root = Path(file_root).absolute() if file_root is not None else None
    cache_key = (url, root)
    store = _stores.get(cache_key)
    if store is not None:
        return store
    with _lock:
        store = _stores.get(cache_key)
        if store is None:
            store = _construct(parse_store_url(url), root)
            _stores[cache_key] = store
        return store


def _construct(parsed: StoreURL, file_root: Path | None) -> FragmentStore:
    if parsed.scheme == "file":
        if file_root is None:
            raise StoreError(
                f"cannot open {parsed.url}: file:// stores need a file root "
                "(set --broker.file-root)"
            )
        from broker.fragment.stores.file import FileStore

        return FileStore(parsed, file_root)
    if parsed.scheme == "gs":
        from broker.fragment.stores.gcs import GCSStore

        return GCSStore(parsed)
    if parsed.scheme == "s3":
        from broker.fragment.stores.s3 import S3Store

        return S3Store(parsed)
    if parsed.scheme == "azure":
        from broker.fragment.stores.azure import AzureStore

        return AzureStore(parsed)
    raise StoreURLError(f"{parsed.url}: no store implements scheme {parsed.scheme!r}")


def close_stores() -> None:
    """Close and forget every cached store (at shutdown, and between tests)."""
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()
