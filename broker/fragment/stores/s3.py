"""The s3:// fragment store, over boto3 (imported only when an s3:// store opens).

Query arguments are upstream's: `profile` (a shared-config profile), `endpoint` (an S3-compatible
service, which forces path-style addressing), `region`, and the put options `ACL`, `storageClass`,
`SSE` and `SSEKMSKeyId` (each sent only when given). Credentials come from the standard AWS chain
(or the profile); as upstream, a store without credentials or a region fails to open.
"""

from __future__ import annotations

import http
from collections.abc import Iterator
from datetime import UTC, timedelta
from typing import Any, BinaryIO

import boto3  # type: ignore[import-untyped]
import botocore.config  # type: ignore[import-untyped]
import botocore.exceptions  # type: ignore[import-untyped]

from broker.fragment.stores.base import (
    FragmentStore,
    StoreError,
    StoreObject,
    StoreURL,
    stream,
)

__all__ = ["S3Store"]

# Error codes upstream treats as authorization failures (besides any HTTP 403).
_AUTH_CODES = frozenset({"NoSuchBucket", "AccessDenied"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class S3Store(FragmentStore):
    """A fragment store in an S3 (or S3-compatible) bucket."""

    scheme = "s3"

    def __init__(self, store_url: StoreURL) -> None:
        super().__init__(store_url)
        profile = store_url.arg("profile") or None
        endpoint = store_url.arg("endpoint") or None
        try:
            session = boto3.session.Session(
                profile_name=profile, region_name=store_url.arg("region") or None
            )
            credentials = session.get_credentials()
        except botocore.exceptions.BotoCoreError as exc:
            raise StoreError(f"cannot open {store_url.url}: {exc}") from exc
        if credentials is None:
            raise StoreError(
                f"cannot open {store_url.url}: no AWS credentials found"
                + (f" for profile {profile!r}" if profile else "")
                + " (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or an instance role)"
            )
        if not session.region_name:
            raise StoreError(
                f"cannot open {store_url.url}: no AWS region configured "
                "(add ?region=..., set AWS_REGION, or use a profile with a region)"
            )
        options: dict[str, Any] = {
            "signature_version": "s3v4",
            "connect_timeout": 10,
            "read_timeout": 60,
            "retries": {"mode": "standard", "max_attempts": 5},
        }
        if endpoint:
            # Bucket-named virtual hosts do not work with explicit endpoints. Many S3-compatible
            # services also reject the streaming checksums newer SDKs send by default.
            options["s3"] = {"addressing_style": "path"}
            options["request_checksum_calculation"] = "when_required"
            options["response_checksum_validation"] = "when_required"
        self._client: Any = session.client(
            "s3", endpoint_url=endpoint, config=botocore.config.Config(**options)
        )
        self._bucket = store_url.bucket
        put_args: dict[str, str] = {}
        for arg, param in (
            ("ACL", "ACL"),
            ("storageClass", "StorageClass"),
            ("SSE", "ServerSideEncryption"),
            ("SSEKMSKeyId", "SSEKMSKeyId"),
        ):
            if store_url.arg(arg):
                put_args[param] = store_url.arg(arg)
        self._put_args = put_args

    def close(self) -> None:
        self._client.close()

    def _put(self, key: str, body: BinaryIO, length: int, content_encoding: str) -> bool:
        extra = dict(self._put_args)
        if content_encoding:
            extra["ContentEncoding"] = content_encoding
        try:
            self._client.put_object(
                Bucket=self._bucket,
                Key=key,
                Body=body,
                ContentLength=length,
                IfNoneMatch="*",  # Only if no object has this key.
                **extra,
            )
        except botocore.exceptions.ClientError as exc:
            if _code(exc) == "PreconditionFailed" or _status(exc) == 412:
                return False
            raise
        return True

    def _exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self._bucket, Key=key)
        except botocore.exceptions.ClientError as exc:
            if _status(exc) == 404:
                return False
            raise
        return True

    def _get_object(self, key: str, offset: int, length: int | None) -> Any:
        args: dict[str, Any] = {"Bucket": self._bucket, "Key": key}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            args["Range"] = f"bytes={offset}-{end}"
        try:
            return self._client.get_object(**args)["Body"]
        except botocore.exceptions.ClientError as exc:
            if _status(exc) == 416:
                return None  # At or past the end.
            raise

    def _open(self, key: str, offset: int) -> BinaryIO:
        body = self._get_object(key, offset, None)
        if body is None:
            return stream(lambda _: b"", lambda: None, self._reader_errors("read", key))
        return stream(body.read, body.close, self._reader_errors("read", key))

    def _get(self, key: str, offset: int, length: int | None) -> bytes:
        body = self._get_object(key, offset, length)
        if body is None:
            return b""
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def _list(self, key_prefix: str) -> Iterator[StoreObject]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=key_prefix
        )
        for page in pages:
            for obj in page.get("Contents", ()):
                name: str = obj["Key"]
                if name.endswith("/"):
                    continue  # A directory placeholder.
                yield StoreObject(
                    path=name[len(key_prefix) :],
                    size=int(obj["Size"]),
                    mod_time=obj["LastModified"].astimezone(UTC),
                )

    def _sign_get(self, key: str, ttl: timedelta) -> str:
        url: str = self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self._bucket, "Key": key},
            ExpiresIn=max(1, int(ttl.total_seconds())),
        )
        return url

    def _remove(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=key)

    def _classify(self, op: str, exc: Exception) -> tuple[str, bool, bool]:
        if isinstance(exc, botocore.exceptions.ClientError):
            code, status = _code(exc), _status(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            if not message:
                try:
                    message = http.HTTPStatus(status).phrase
                except ValueError:
                    message = ""
            summary = f"{code}: {message}" if code and code != str(status) else message
            summary = f"{status} {summary}".strip()
            is_auth = code in _AUTH_CODES or status == 403
            not_found = (code in _NOT_FOUND_CODES or status == 404) and code != "NoSuchBucket"
            return summary, is_auth, not_found and op in ("open", "get", "read")
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return str(exc), False, False
        return f"{type(exc).__name__}: {exc}", False, False


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
