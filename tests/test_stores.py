"""Fragment stores against real backends: a temporary directory (file://), fake-gcs-server (gs://)
and moto's S3 server (s3://); store URL checks; reading signed fragment URLs."""

from __future__ import annotations

import gzip
import io
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.fragment.fragments import content_name, content_path, sum_of
from broker.fragment.stores import (
    FragmentStore,
    ObjectNotFoundError,
    StoreError,
    StoreURLError,
    check_store_url,
    close_stores,
    open_store,
    open_url,
    parse_store_url,
    read_url,
)
from broker.protocol import protocol_pb2 as pb
from broker.testing import free_port
from tests.store_servers import S3_PROFILE, GCSServer, S3Server

JOURNAL = "acme/events/part-000"
DATA = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable.


@pytest.fixture(scope="module", autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    close_stores()


@dataclass
class Backend:
    """One store backend of a test: makes store URLs in its own bucket (or file root)."""

    kind: str
    bucket: str
    file_root: Path | None = None
    server: GCSServer | S3Server | None = None

    def url(self, prefix: str = "frags/", query: str = "", bucket: str | None = None) -> str:
        bucket = bucket or self.bucket
        args = [query] if query else []
        if self.kind == "file":
            assert self.file_root is not None
            (self.file_root / prefix).mkdir(parents=True, exist_ok=True)
            base = f"file:///{prefix}"
        elif self.kind == "gs":
            base = f"gs://{bucket}/{prefix}"
        else:
            assert self.server is not None
            args.insert(0, "endpoint=" + quote(self.server.endpoint, safe=""))
            base = f"s3://{bucket}/{prefix}"
        return base + ("?" + "&".join(args) if args else "")

    def store(self, prefix: str = "frags/", query: str = "") -> FragmentStore:
        return open_store(self.url(prefix, query), file_root=self.file_root)

    def content_encoding_of(self, key: str) -> str:
        """The Content-Encoding the backend recorded for object `key` (read with its own SDK)."""
        if self.kind == "gs":
            from google.auth.credentials import AnonymousCredentials

            # Through the store module, which imports the SDK without its ImportWarning.
            from broker.fragment.stores.gcs import storage

            client = storage.Client(project="test-project", credentials=AnonymousCredentials())
            try:
                return str(client.bucket(self.bucket).get_blob(key).content_encoding or "")
            finally:
                client.close()
        assert isinstance(self.server, S3Server)
        s3 = self.server.client()
        try:
            head = s3.head_object(Bucket=self.bucket, Key=key)  # type: ignore[attr-defined]
            return str(head.get("ContentEncoding", ""))
        finally:
            s3.close()  # type: ignore[attr-defined]


def _backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if kind == "file":
        root = tmp_path / "file-root"
        root.mkdir()
        return Backend("file", "", file_root=root)
    server = request.getfixturevalue("gcs_server" if kind == "gs" else "s3_server")
    return Backend(kind, server.create_bucket(), server=server)


@pytest.fixture(params=["file", "gs", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return _backend(request.param, request, tmp_path)


@pytest.fixture(params=["gs", "s3"])
def cloud(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return _backend(request.param, request, tmp_path)


def fragment(
    begin: int, content: bytes, codec: pb.CompressionCodec.ValueType = pb.NONE
) -> pb.Fragment:
    return pb.Fragment(
        journal=JOURNAL,
        begin=begin,
        end=begin + len(content),
        sum=sum_of(content),
        compression_codec=codec,
    )


def put_bytes(store: FragmentStore, path: str, data: bytes, encoding: str = "") -> bool:
    return store.put(path, io.BytesIO(data), len(data), encoding)


def assert_one_line(err: BaseException, *must_contain: str) -> None:
    text = str(err)
    assert "\n" not in text and text.strip() == text and text
    for part in must_contain:
        assert part in text, (part, text)


# --- Every store -----------------------------------------------------------------------------


def test_put_then_read_and_list(backend: Backend) -> None:
    store = backend.store()
    path = content_path(JOURNAL, "", content_name(fragment(0, DATA)))
    before = datetime.now(UTC)

    assert not store.exists(path)
    assert put_bytes(store, path, DATA) is True
    assert store.exists(path)
    assert not store.exists(path + ".other")

    assert store.get(path) == DATA
    assert store.get(path, 1000, 300) == DATA[1000:1300]
    assert store.get(path, 10000) == DATA[10000:]
    assert store.get(path, 10000, 1000) == DATA[10000:]  # Clipped at the end.
    assert store.get(path, len(DATA)) == b""
    assert store.get(path, 5, 0) == b""
    with store.open(path, 4321) as stream:
        assert stream.read(10) == DATA[4321:4331]
        assert stream.read() == DATA[4331:]
    with store.open(path, len(DATA)) as stream:
        assert stream.read() == b""

    (obj,) = store.list(JOURNAL + "/")
    assert obj.path == content_name(fragment(0, DATA))
    assert obj.size == len(DATA)
    assert obj.mod_time.tzinfo is not None
    assert before - timedelta(minutes=2) <= obj.mod_time <= datetime.now(UTC) + timedelta(minutes=2)
    assert list(store.list("no/such/journal/")) == []


def test_put_from_a_position_within_the_source(backend: Backend) -> None:
    store = backend.store()
    source = io.BytesIO(b"HEADER" + DATA + b"TRAILER")
    source.seek(6)
    assert store.put("a/journal/x", source, len(DATA))
    assert store.get("a/journal/x") == DATA


def test_put_twice_keeps_the_first_content(backend: Backend) -> None:
    store = backend.store()
    assert put_bytes(store, "acme/journal/obj", b"first") is True
    assert put_bytes(store, "acme/journal/obj", b"second, longer") is False
    assert store.get("acme/journal/obj") == b"first"
    assert [o.path for o in store.list("acme/journal/")] == ["obj"]


def test_put_with_a_short_source_fails_and_writes_nothing(backend: Backend) -> None:
    store = backend.store()
    with pytest.raises(StoreError) as caught:
        store.put("acme/journal/short", io.BytesIO(b"12345"), 10)
    assert_one_line(caught.value, "5", "10")
    assert not store.exists("acme/journal/short")
    assert list(store.list("acme/journal/")) == []


def test_list_fragments_with_postfix_and_rewriter(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.store(query="find=acme%2F&replace=legacy%2F")
    first = fragment(0, DATA[:100])
    second = fragment(100, DATA[100:250], pb.GZIP)
    second_path = content_path(JOURNAL, "date=2024-01-01", content_name(second))
    put_bytes(store, content_path(JOURNAL, "", content_name(first)), b"raw bytes")
    put_bytes(store, second_path, b"gzip bytes")
    put_bytes(store, f"{JOURNAL}/notes.txt", b"not a fragment")
    put_bytes(store, f"{JOURNAL}/date=2024-01-01/0000-zz.raw", b"not one either")
    neighbour = fragment(0, b"x")
    neighbour.journal = JOURNAL + "1"
    put_bytes(store, content_path(neighbour.journal, "", content_name(neighbour)), b"x")

    with caplog.at_level(logging.WARNING, logger="broker.fragment.stores"):
        found = store.list_fragments(JOURNAL)

    now = datetime.now(UTC).timestamp()
    for got in found:
        assert got.backing_store == store.url
        assert abs(got.mod_time - now) < 120
        got.ClearField("mod_time")
        got.ClearField("backing_store")
    expect_second = pb.Fragment()
    expect_second.CopyFrom(second)
    expect_second.path_postfix = "date=2024-01-01"
    assert found == [first, expect_second]
    skipped = " ".join(record.getMessage() for record in caplog.records)
    assert "notes.txt" in skipped and "0000-zz.raw" in skipped

    # Objects are stored under the rewritten journal path, as upstream's rewriter does.
    plain = backend.store()
    assert plain.exists(second_path.replace("acme/", "legacy/", 1))
    assert not plain.exists(second_path)
    # Both stores see the same journal-relative listing under their own naming.
    assert [o.path for o in plain.list("legacy/events/part-000/")] == [
        o.path for o in store.list(JOURNAL + "/")
    ]


def test_file_store_listings_skip_names_that_are_not_utf8(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by tests/test_fuzz.py: a directory whose name is not UTF-8 (another tool's, or a
    # copy from a Latin-1 system) under a journal made every listing of its store fail; names
    # were logged as they are.
    (tmp_path / "frags").mkdir()
    store = open_store("file:///frags/", file_root=tmp_path)
    good = fragment(0, DATA[:100])
    put_bytes(store, content_path(JOURNAL, "", content_name(good)), DATA[:100])
    journal_dir = os.fsencode(tmp_path / "frags" / JOURNAL)
    os.makedirs(journal_dir + b"/date=\xe9t\xe9")
    odd_names = (
        b"/date=\xe9t\xe9/" + os.fsencode(content_name(good)),
        b"/\xff\xfe.raw",
        b"/two\nlines\x1b[31m",  # Neither a line break nor a terminal's escape gets to the log.
    )
    for odd in odd_names:
        with open(journal_dir + odd, "wb") as f:
            f.write(b"odd")
    with caplog.at_level(logging.WARNING, logger="broker.fragment.stores"):
        found = store.list_fragments(JOURNAL)
    assert [(f.begin, f.end, f.path_postfix) for f in found] == [(0, 100, "")]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 3 and all(m.isprintable() for m in skipped), skipped


def test_list_matches_keys_by_string_prefix(backend: Backend) -> None:
    store = backend.store()
    put_bytes(store, "acme/events/part-000/a", b"1")
    put_bytes(store, "acme/events/part-0001/b/c", b"22")
    put_bytes(store, "acme/other/d", b"333")
    listed = sorted((o.path, o.size) for o in store.list("acme/events/part-00"))
    assert listed == [("0/a", 1), ("01/b/c", 2)]


def test_remove(backend: Backend) -> None:
    store = backend.store()
    put_bytes(store, "acme/journal/gone", b"content")
    signed = store.sign_get("acme/journal/gone", timedelta(minutes=5))
    store.remove("acme/journal/gone")
    assert not store.exists("acme/journal/gone")
    store.remove("acme/journal/gone")  # Removing again is fine.
    with pytest.raises(ObjectNotFoundError) as caught:
        store.get("acme/journal/gone")
    assert_one_line(caught.value, "acme/journal/gone")
    with pytest.raises(ObjectNotFoundError):
        store.open("acme/journal/gone")
    with pytest.raises(ObjectNotFoundError) as caught:
        read_url(signed, file_root=backend.file_root)
    assert_one_line(caught.value)
    assert "?" not in str(caught.value)  # A signed URL's query (its signature) is not shown.


def test_sign_get_then_read_url(backend: Backend) -> None:
    store = backend.store()
    path = content_path(JOURNAL, "p=1", content_name(fragment(0, DATA)))
    put_bytes(store, path, DATA)
    signed = store.sign_get(path, timedelta(minutes=10))
    if backend.kind == "file":
        assert signed == f"file:///frags/{path}"
    else:
        assert signed.startswith("http://127.0.0.1:")

    root = backend.file_root
    assert read_url(signed, file_root=root) == DATA
    assert read_url(signed, 3, 7, file_root=root) == DATA[3:10]
    assert read_url(signed, len(DATA) - 5, 100, file_root=root) == DATA[-5:]
    assert read_url(signed, len(DATA), file_root=root) == b""
    with open_url(signed, offset=9000, file_root=root) as stream:
        assert stream.read(24) == DATA[9000:9024]
        assert stream.read() == DATA[9024:]


def test_health_check_passes(backend: Backend) -> None:
    store = backend.store()
    store.health_check()
    store.health_check(check_delete_prefix="probes/")  # Again: the check object exists now.
    assert [o.path for o in store.list(".test/")] == ["health-check"]
    assert not store.exists("probes/.gazette-delete-probe")


def test_health_check_fails_cleanly(backend: Backend) -> None:
    if backend.kind == "file":
        assert backend.file_root is not None
        store = open_store("file:///not/created/", file_root=backend.file_root)
    else:
        store = open_store(backend.url(bucket="gz-no-such-bucket"))
    with pytest.raises(StoreError) as caught:
        store.health_check()
    assert_one_line(caught.value, store.url, "PUT")
    assert caught.value.is_auth_error


def test_file_names_with_url_special_characters_round_trip(tmp_path: Path) -> None:
    (tmp_path / "x y%").mkdir()
    store = open_store("file:///x%20y%25/", file_root=tmp_path)
    put_bytes(store, "j/o%u r=nal/obj", b"data")
    assert (tmp_path / "x y%" / "j" / "o%u r=nal" / "obj").read_bytes() == b"data"
    assert read_url(store.sign_get("j/o%u r=nal/obj", timedelta(1)), file_root=tmp_path) == b"data"


# --- Cloud stores ----------------------------------------------------------------------------


def test_content_encoding_gzip_round_trip(cloud: Backend) -> None:
    store = cloud.store()
    plain = b"offloaded decompression " * 200
    packed = gzip.compress(plain)
    path = content_path(
        JOURNAL, "", content_name(fragment(0, plain, pb.GZIP_OFFLOAD_DECOMPRESSION))
    )
    assert store.put(path, io.BytesIO(packed), len(packed), content_encoding="gzip")
    assert cloud.content_encoding_of(store.key(path)) == "gzip"

    # Store reads give the stored bytes, as written.
    assert store.get(path) == packed
    assert store.get(path, 10, 20) == packed[10:30]
    with store.open(path, 5) as stream:
        assert stream.read() == packed[5:]

    signed = store.sign_get(path, timedelta(minutes=5))
    assert read_url(signed, accept_encoding="gzip") == packed
    # Asking the store to decompress: fake-gcs-server does (as GCS); moto does not (as MinIO),
    # which the response's Content-Encoding tells the reader.
    with open_url(signed, accept_encoding="identity") as stream:
        body = stream.read()
        encoding = stream.content_encoding
    assert (gzip.decompress(body) if encoding == "gzip" else body) == plain


def test_gcs_open_reads_in_ranged_chunks(gcs_server: GCSServer) -> None:
    store = open_store(f"gs://{gcs_server.create_bucket()}/chunks/")
    put_bytes(store, "acme/j/big", DATA)
    store.read_chunk_size = 1000  # type: ignore[attr-defined]
    with store.open("acme/j/big", 123) as stream:
        assert stream.read() == DATA[123:]
    with store.open("acme/j/big", 9000) as stream:
        assert stream.read(2000) == DATA[9000:10240]


def test_s3_put_options_and_profile(s3_server: S3Server) -> None:
    bucket = s3_server.create_bucket()
    endpoint = quote(s3_server.endpoint, safe="")
    store = open_store(
        f"s3://{bucket}/opts/?endpoint={endpoint}&ACL=bucket-owner-full-control"
        f"&storageclass=STANDARD_IA&SSE=AES256&Profile={S3_PROFILE}"
    )
    assert put_bytes(store, "acme/j/o", b"content")
    s3 = s3_server.client()
    try:
        head = s3.head_object(Bucket=bucket, Key="opts/acme/j/o")  # type: ignore[attr-defined]
    finally:
        s3.close()  # type: ignore[attr-defined]
    assert head["StorageClass"] == "STANDARD_IA"
    assert head["ServerSideEncryption"] == "AES256"
    assert store.get("acme/j/o") == b"content"


def test_s3_open_failures_are_one_line(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = quote(s3_server.endpoint, safe="")
    with pytest.raises(StoreError) as caught:
        open_store(f"s3://bucket/p/?endpoint={endpoint}&profile=no-such-profile")
    assert_one_line(caught.value, "no-such-profile")

    monkeypatch.delenv("AWS_DEFAULT_REGION")
    with pytest.raises(StoreError) as caught:
        open_store(f"s3://bucket/noregion/?endpoint={endpoint}")
    assert_one_line(caught.value, "region")
    # With the region in the URL it opens.
    open_store(f"s3://bucket/noregion/?endpoint={endpoint}&region=eu-west-1")


# --- Store URLs ------------------------------------------------------------------------------


def test_check_store_url_accepts_upstream_forms() -> None:
    example = "s3://examples/fragments/?profile=minio&endpoint=http%3A%2F%2Fminio%3A9000"
    check_store_url(example)
    parsed = parse_store_url(example)
    assert (parsed.scheme, parsed.bucket, parsed.prefix) == ("s3", "examples", "fragments/")
    assert parsed.arg("profile") == "minio" and parsed.arg("endpoint") == "http://minio:9000"

    parsed = parse_store_url("s3://b/?REGION=us-east-2&sseKmsKeyID=k&Find=a&REPLACE=b")
    assert parsed.args == (
        ("SSEKMSKeyId", "k"),
        ("find", "a"),
        ("region", "us-east-2"),
        ("replace", "b"),
    )
    assert parsed.prefix == ""
    assert parsed.key("a/journal/a") == "b/journal/a"  # The first occurrence only.

    parsed = parse_store_url("gs://bucket/a/b/?find=x&replace=")
    assert (parsed.bucket, parsed.prefix, parsed.find, parsed.replace) == (
        "bucket",
        "a/b/",
        "x",
        "",
    )
    assert parse_store_url("file:///mnt/frags/").prefix == "mnt/frags/"
    assert parse_store_url("file:///").prefix == ""


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://b/p/?bogus=1", "'bogus'"),
        ("gs://b/p/?profile=x", "'profile'"),
        ("file:///p/?endpoint=x", "'endpoint'"),
        ("s3://b/p/?a=1;b=2", "';'"),
        ("s3://b/p/?region=%zz", "escape"),
        ("azure://container/p/", "not supported by gazette-py yet"),
        ("azure-ad://tenant/account/container/p/", "not supported by gazette-py yet"),
        ("http://host/p/", "scheme"),
        ("gs://b/p", "end in '/'"),
        ("s3://b", "end in '/'"),
        ("file://host/p/", "host"),
        ("s3:///p/", "bucket"),
        ("relative/path/", "absolute"),
    ],
)
def test_check_store_url_rejects(url: str, problem: str) -> None:
    with pytest.raises(StoreURLError) as caught:
        check_store_url(url)
    assert isinstance(caught.value, ValueError)
    assert_one_line(caught.value, url, problem)


_URL_TEXT = st.text(alphabet=st.sampled_from("ab/:?&=%;#@[]. \n\x00é+2F"), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    st.text(max_size=40)
    | st.builds(
        lambda scheme, host, path, query: f"{scheme}://{host}/{path}?{query}",
        st.sampled_from(["s3", "gs", "file", "azure", "S3", "http", ""]),
        _URL_TEXT,
        _URL_TEXT,
        _URL_TEXT,
    )
)
def test_check_store_url_fails_only_with_one_line_store_url_errors(url: str) -> None:
    try:
        parsed = parse_store_url(url)
    except StoreURLError as err:
        assert "\n" not in str(err) and str(err)
    else:
        assert parsed.scheme in ("s3", "gs", "file")
        assert parsed.prefix == "" or parsed.prefix.endswith("/")


# --- Opening stores and reading URLs --------------------------------------------------------


def test_open_store_caches_per_url_and_root(tmp_path: Path) -> None:
    (tmp_path / "a" / "frags").mkdir(parents=True)
    (tmp_path / "b" / "frags").mkdir(parents=True)
    url = "file:///frags/"
    with ThreadPoolExecutor(8) as pool:
        stores = list(pool.map(lambda _: open_store(url, file_root=tmp_path / "a"), range(32)))
    assert all(store is stores[0] for store in stores)
    other = open_store(url, file_root=tmp_path / "b")
    assert other is not stores[0]
    put_bytes(other, "j/x", b"b's")
    assert not stores[0].exists("j/x")

    with pytest.raises(StoreError) as caught:
        open_store(url)
    assert_one_line(caught.value, "--broker.file-root")
    with pytest.raises(StoreURLError):
        open_store("gs://b/no-slash")


def test_file_store_refuses_paths_escaping_its_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "frags").mkdir(parents=True)
    (tmp_path / "secret").write_bytes(b"secret")

    escaping = open_store("file:///../", file_root=root)
    with pytest.raises(StoreError) as caught:
        escaping.get("secret")
    assert_one_line(caught.value, "escapes")
    rewritten = open_store("file:///frags/?find=acme&replace=../../..", file_root=root)
    with pytest.raises(StoreError):
        put_bytes(rewritten, "acme/x", b"data")
    with pytest.raises(StoreError):
        rewritten.sign_get("acme/secret", timedelta(minutes=1))
    assert not (tmp_path.parent / "x").exists()
    for url in ("file:///../secret", "file:///frags/%2e%2e/%2e%2e/secret"):
        with pytest.raises(StoreError) as caught:
            read_url(url, file_root=root)
        assert_one_line(caught.value, "escapes")
    # In-progress puts leave no partial files behind, and listings never show them.
    store = open_store("file:///frags/", file_root=root)
    put_bytes(store, "acme/j/x", b"data")
    assert sorted(p.name for p in (root / "frags" / "acme" / "j").iterdir()) == ["x"]


def test_read_url_failures_are_store_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError) as caught:
        read_url("ftp://host/fragment?sig=secret")
    assert_one_line(caught.value, "ftp")
    assert "secret" not in str(caught.value)

    with pytest.raises(StoreError) as caught:
        read_url(f"http://127.0.0.1:{free_port()}/fragment?sig=secret")
    assert_one_line(caught.value, "GET http://127.0.0.1")
    assert "secret" not in str(caught.value)

    with pytest.raises(StoreError) as caught:
        read_url("file:///frags/x")
    assert_one_line(caught.value, "file root")
    with pytest.raises(ObjectNotFoundError):
        read_url("file:///frags/x", file_root=tmp_path)


def test_read_url_handles_servers_ignoring_range(tmp_path: Path) -> None:
    """A plain HTTP server (no Range support) still yields the asked-for bytes."""
    import http.server

    (tmp_path / "obj").write_bytes(DATA)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/obj"
        assert read_url(url, 5000, 10) == DATA[5000:5010]
        assert read_url(url, 10000) == DATA[10000:]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_importing_stores_does_not_import_cloud_sdks() -> None:
    code = (
        "import sys, broker.fragment.stores\n"
        "heavy = [m for m in ('boto3', 'botocore', 'google.cloud.storage') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
