"""The azure:// fragment store against Azurite, the real Azure Storage emulator: put without
overwriting, ranged reads, listing, SAS-signed URLs, removal, the health check, and failures as one
line naming the object (a missing container is an authorization error, as upstream)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import timedelta

import pytest

from broker.fragment.stores import (
    ObjectNotFoundError,
    StoreError,
    StoreURLError,
    close_stores,
    open_store,
    read_url,
)
from tests.helpers.store_servers import AzureServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def container(azure_server: AzureServer) -> Iterator[str]:
    yield azure_server.create_container()
    close_stores()


def test_put_get_list_and_remove(container: str) -> None:
    store = open_store(f"azure://{container}/fragments/")
    body = b"0123456789" * 1000
    assert store.put("a/journal/one", io.BytesIO(body), len(body)) is True
    # A second put at the same path leaves the first object: fragments are written once.
    assert store.put("a/journal/one", io.BytesIO(b"other"), 5) is False
    assert store.get("a/journal/one") == body
    assert store.get("a/journal/one", 9990, 20) == body[9990:10010]
    assert store.get("a/journal/one", len(body)) == b""
    with store.open("a/journal/one", 5000) as stream:
        assert stream.read() == body[5000:]
    assert store.exists("a/journal/one") and not store.exists("a/journal/two")

    store.put("a/journal/date=x/two", io.BytesIO(b"2"), 1, content_encoding="gzip")
    store.put("a/journalist/three", io.BytesIO(b"3"), 1)
    listed = sorted((o.path, o.size) for o in store.list("a/journal/"))
    assert listed == [("date=x/two", 1), ("one", len(body))]
    assert all(o.mod_time.tzinfo is not None for o in store.list("a/journal/"))
    # Stored bytes come back as written, whatever their Content-Encoding says.
    assert store.get("a/journal/date=x/two") == b"2"

    store.remove("a/journal/one")
    store.remove("a/journal/one")  # Already gone is fine.
    assert not store.exists("a/journal/one")
    with pytest.raises(
        ObjectNotFoundError, match=rf"get azure://{container}/fragments/a/journal/one"
    ):
        store.get("a/journal/one")


def test_a_rewriter_and_prefix_name_the_blob(container: str) -> None:
    store = open_store(f"azure://{container}/pre/fix/?find=a/&replace=b/")
    store.put("a/journal/x", io.BytesIO(b"x"), 1)
    plain = open_store(f"azure://{container}/")
    assert plain.get("pre/fix/b/journal/x") == b"x"


def test_signed_urls_read_with_a_sas_and_expire_by_their_ttl(container: str) -> None:
    store = open_store(f"azure://{container}/fragments/")
    store.put("j/frag", io.BytesIO(b"signed content"), 14)
    url = store.sign_get("j/frag", timedelta(minutes=5))
    assert "sig=" in url and "se=" in url, "a shared-access signature"
    assert read_url(url) == b"signed content"
    assert read_url(url, offset=7, length=3) == b"con"
    # The signature is the credential: the same URL without it is refused.
    with pytest.raises(StoreError, match=r"40[34]"):
        read_url(url.split("?", 1)[0])
    tampered = url.replace("sp=r", "sp=rw")
    with pytest.raises(StoreError, match="403") as refused:
        read_url(tampered)
    assert refused.value.is_auth_error


def test_health_check_passes_and_a_missing_container_fails_it_as_auth(
    azure_server: AzureServer, container: str
) -> None:
    open_store(f"azure://{container}/fragments/").health_check(check_delete_prefix="j/")
    missing = open_store("azure://no-such-container/fragments/")
    with pytest.raises(StoreError, match="health check of azure://no-such-container/fragments/ "
                       "failed at PUT") as failed:  # fmt: skip
        missing.health_check()
    assert failed.value.is_auth_error
    assert "\n" not in str(failed.value)


def test_a_store_without_an_account_says_which_variables_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AZURE_ACCOUNT_NAME", raising=False)
    monkeypatch.delenv("AZURE_ACCOUNT_KEY", raising=False)
    with pytest.raises(StoreError, match="AZURE_ACCOUNT_NAME and AZURE_ACCOUNT_KEY") as failed:
        open_store("azure://container/prefix/")
    assert failed.value.is_auth_error
    # azure-ad:// (a tenant's service principal) is not built yet, and says so.
    with pytest.raises(StoreURLError, match="azure-ad:// stores are not supported"):
        open_store("azure-ad://tenant/account/container/prefix/")
    with pytest.raises(StoreURLError, match="unknown query argument 'region'"):
        open_store("azure://container/prefix/?region=x")
