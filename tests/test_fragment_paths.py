"""Canonical store URLs and journals' fragment paths (broker/fragment/stores/paths.py): one
spelling per location, and no journal's fragments another's, checked against brute force."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.fragment.stores import StoreURLError, open_store, parse_store_url
from broker.fragment.stores.paths import (
    FragmentPath,
    PathError,
    PathIndex,
    canonical_store_url,
    fragment_path,
    overlap,
)
from broker.protocol import protocol_pb2 as pb

SEGMENTS = st.sampled_from(["a", "b", "ab", "tenant-y", "x y", "%", "é", "a.b", "~"])


def spell(segment: str, how: int) -> str:
    """One of several spellings of path segment `segment`."""
    if how == 0:
        return quote(segment, safe="~")  # Only what must be escaped.
    if how == 1:
        return "".join(f"%{b:02X}" for b in segment.encode())  # Every byte, upper case.
    return "".join(f"%{b:02x}" for b in segment.encode())  # Every byte, lower case.


@st.composite
def spelled(draw: st.DrawFn) -> tuple[list[str], str]:
    """A store directory (its segments) and one of its many spellings: escapes, '.', '..',
    empty segments, the scheme's case, an empty query."""
    segments = draw(st.lists(SEGMENTS, max_size=4))
    parts: list[str] = []
    for segment in segments:
        noise = draw(st.sampled_from(["", ".", "", "zz/..", "/"]))
        if noise:
            parts.append(noise)
        parts.append(spell(segment, draw(st.integers(0, 2))))
    scheme = draw(st.sampled_from(["file", "FILE", "File"]))
    tail = draw(st.sampled_from(["/", "//", "/./", "/?"]))
    return segments, f"{scheme}:///" + "/".join(parts) + tail


@settings(max_examples=300, deadline=None)
@given(spelled())
def test_every_spelling_of_a_location_is_one_canonical_url(case: tuple[list[str], str]) -> None:
    segments, url = case
    canonical = canonical_store_url(url)
    assert canonical_store_url(canonical) == canonical
    # The store reads the same prefix from both, and the canonical one is the brute-force
    # resolution of the segments.
    assert parse_store_url(canonical).prefix == "".join(s + "/" for s in segments)
    assert canonical == canonical_store_url(
        "file:///" + "".join(spell(s, 1) + "/" for s in segments)
    )


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["file", "s3", "gs", "azure"]),
    st.text(alphabet="ab/.%~ ?#&=", max_size=12),
    st.dictionaries(
        st.sampled_from(["find", "FIND", "replace", "Replace"]), st.text("ab/%+ &=", max_size=4)
    ),
)
def test_canonical_is_idempotent_and_names_the_same_location(
    scheme: str, path: str, args: dict[str, str]
) -> None:
    host = "" if scheme == "file" else "bucket"
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in args.items())
    url = f"{scheme}://{host}/{quote(path, safe='/%')}/" + (f"?{query}" if query else "")
    try:
        canonical = canonical_store_url(url)
    except StoreURLError:
        return  # Refused (a '..' above the root, an escape that decodes to nothing usable).
    assert canonical_store_url(canonical) == canonical
    before, after = parse_store_url(url), parse_store_url(canonical)
    assert (after.find, after.replace) == (before.find, before.replace)
    assert after.bucket == before.bucket
    # The same files: the file store resolves '.', '..' and '//' as os.path does.
    assert os.path.normpath("/r/" + after.prefix) == os.path.normpath("/r/" + before.prefix)


@pytest.mark.parametrize(
    "url",
    ["file:///../x/", "file:///a/../../x/", "file:///%2E%2E/x/", "file:///a/%00/", "file:///%FF/"],
)
def test_urls_that_climb_or_hold_what_no_key_can_are_refused(url: str) -> None:
    with pytest.raises(StoreURLError, match="is not a valid fragment store"):
        canonical_store_url(url)


def test_fragment_paths_follow_the_stores_keys(tmp_path: Path) -> None:
    """The path is where the store puts and lists: checked by persisting through the store."""
    from tests.helpers.fragments import put_fragment

    (tmp_path / "s").mkdir()
    cases = [
        ("a/jj", "file:///s/", "s/a/jj/"),
        ("old/j", "file:///s/?find=old%2F&replace=new%2F", "s/new/j/"),
        ("team-x/j", "file:///s/?find=nomatch", "s/team-x/j/"),
        ("jjjj", "file:///s/?find=jjjj%2F&replace=k%2Fl%2F", "s/k/l/"),
        ("jjjj", "file:///s/?find=jjjj%2F", "s/"),  # The store's prefix is this journal's.
    ]
    for journal, url, key in cases:
        assert fragment_path(journal, url) == FragmentPath("file", key)
        store = open_store(url, file_root=tmp_path)
        put_fragment(store, journal, 0, b"x\n", postfix="p=1")
        written = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.raw")]
        assert any(w.startswith(key) for w in written), (written, key)
        assert [f.path_postfix for f in store.list_fragments(journal)] == ["p=1"]
        for p in tmp_path.rglob("*.raw"):
            p.unlink()
    assert fragment_path("j", "s3://Bucket/p/?endpoint=http%3A%2F%2Fx") == fragment_path(
        "j", "gs://bucket/p/"
    )  # One bucket name is one storage, whatever the scheme or endpoint.


@pytest.mark.parametrize(
    ("journal", "url", "why"),
    [
        ("../a", "file:///", "not a clean path"),
        ("../a", "file:///x/", "not a clean path"),
        ("jjjj", "file:///?find=jjjj%2F", "the store's whole root"),
        ("abc", "file:///?find=c%2Fd", "could match across the end of its name"),
        ("abc", "file:///?find=abc%2F0", "could match across the end of its name"),
        ("abc", "file:///?find=abc&replace=..", "not a clean path"),
        ("abc", "file:///?find=c%2F&replace=c", "does not end in '/'"),
    ],
)
def test_paths_no_key_can_reason_about_are_refused(journal: str, url: str, why: str) -> None:
    with pytest.raises(PathError, match=why) as info:
        fragment_path(journal, url)
    assert str(info.value).startswith(f"journal {journal}: ")


KEYS = st.lists(st.sampled_from(["a", "b", "ab"]), min_size=1, max_size=3).map(
    lambda parts: "/".join(parts) + "/"
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["file", "bucket:b"]), KEYS), max_size=8), st.tuples(st.sampled_from(["file", "bucket:b"]), KEYS))  # fmt: skip
def test_the_index_finds_exactly_the_paths_equal_or_nested(
    existing: list[tuple[str, str]], probe: tuple[str, str]
) -> None:
    """PathIndex.overlapping against brute force: two directories meet when one's segments
    begin the other's."""

    def meets(a: tuple[str, str], b: tuple[str, str]) -> bool:
        sa, sb = a[1].split("/")[:-1], b[1].split("/")[:-1]
        n = min(len(sa), len(sb))
        return a[0] == b[0] and sa[:n] == sb[:n]

    index = PathIndex()
    for at, (storage, key) in enumerate(existing):
        # Built through `of` would need URLs; the claims are what it records.
        from broker.fragment.stores.paths import _Claim

        index._claims.setdefault(storage, {}).setdefault(key, []).append(_Claim(at, f"j{at}", key))
    for storage, keys in index._claims.items():
        index._sorted[storage] = sorted(keys)
    found = {c.journal for c in index.overlapping(FragmentPath(*probe))}
    expected = {f"j{at}" for at, e in enumerate(existing) if meets(e, probe)}
    assert found == expected
    assert all(overlap(FragmentPath(*e), FragmentPath(*probe)) == meets(e, probe) for e in existing)


def spec(name: str, *stores: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name)
    out.fragment.stores.extend(stores)
    return out


def test_the_older_of_two_journals_sharing_a_path_keeps_it(tmp_path: Path) -> None:
    """At runtime (specs that reached etcd other than through Apply): the younger is neither
    listed nor persisted; the older's listing leaves out what lies under a younger nested path."""
    from tests.helpers.fragments import put_fragment

    (tmp_path / "y").mkdir()
    index = PathIndex.of(
        [
            ("y/secret", spec("y/secret", "file:///"), 10),
            ("secret", spec("secret", "file:///./y/"), 20),  # Same path, younger.
            ("y", spec("y", "file:///"), 30),  # Contains both, younger.
            ("y/secret/inner", spec("y/secret/inner", "file:///"), 40),  # Nested, younger.
        ]
    )
    victim = index.guard("y/secret", "file:///")
    assert not victim.error and victim.excluded == ("y/secret/inner/",)
    for name, url in [("secret", "file:///y/"), ("y", "file:///"), ("y/secret/inner", "file:///")]:
        guard = index.guard(name, url)
        assert "meets an older journal's" in guard.error and "y/secret" not in guard.error.replace(name, "")  # fmt: skip
        assert guard.key_problem("y/secret/inner/x") == guard.error
    store = open_store("file:///", file_root=tmp_path)
    put_fragment(store, "y/secret", 0, b"victim\n")
    put_fragment(store, "y/secret/inner", 0, b"intruder\n")
    listed = store.list_fragments("y/secret", excluded=victim.excluded)
    assert [(f.path_postfix, f.end) for f in listed] == [("", 7)]
    assert victim.key_problem("y/secret/inner/0-1-x.raw") is not None
    assert victim.key_problem("y/secret/p/../../z") is not None
    assert victim.key_problem("y/secret/p=1/0-1-x.raw") is None
    # A health probe under the journal's path is not one of its fragments.
    store.put("y/secret/.gazette~health/health-check", io.BytesIO(b"h\n"), 2)
    assert len(store.list_fragments("y/secret", excluded=victim.excluded)) == 1


async def test_the_brokers_path_index_is_built_again_only_when_a_journal_changes(
    etcd_server: object, etcd_prefix: str, tmp_path: Path
) -> None:
    """Listings and persists consult the index at every store operation: rebuilding it at each
    keyspace revision (every assignment write and pulse) would cost each O(journals)."""
    from broker.client.routes import append_routed
    from broker.protocol import protocol_pb2_grpc as pb_grpc
    from broker.testing import BrokerHarness

    (tmp_path / "x").mkdir()

    def journal(name: str) -> pb.ApplyRequest.Change:
        spec = pb.JournalSpec(name=name, replication=1)
        spec.fragment.length = 1 << 20
        spec.fragment.refresh_interval.seconds = 60
        spec.fragment.compression_codec = pb.NONE
        spec.fragment.stores.append("file:///x/")
        return pb.ApplyRequest.Change(upsert=spec)

    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, file_root=str(tmp_path)) as harness:  # type: ignore[attr-defined]  # fmt: skip
        import grpc

        service = harness.broker.service
        assert service is not None
        async with grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://")) as channel:
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            await stub.Apply(pb.ApplyRequest(changes=[journal("paths/a")]))
            built_at, first = service.paths.index()
            # Appends, members, assignments and pulses move the revision, not the journals.
            assert (await append_routed(stub, "paths/a", b"one\n")).status == pb.OK
            async with BrokerHarness(etcd_server.endpoint, etcd_prefix, id="another"):  # type: ignore[attr-defined]  # fmt: skip
                await service.ks.wait_for_revision(built_at + 1, timeout=30)
                revision, again = service.paths.index()
                assert again is first and revision > built_at
            applied = await stub.Apply(pb.ApplyRequest(changes=[journal("paths/b")]))
            await service.ks.wait_for_revision(applied.header.etcd.revision)
            _, rebuilt = service.paths.index()
            assert rebuilt is not first
            claims = rebuilt.overlapping(fragment_path("paths/b", "file:///x/"))
            assert [c.journal for c in claims] == ["paths/b"]


# --- S3 endpoints (review finding 1) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "canonical"),
    [
        ("http://127.0.0.1:9", "http://127.0.0.1:9"),
        ("http://127.0.0.1:9/", "http://127.0.0.1:9"),
        ("HTTPS://S3.Example.COM/", "https://s3.example.com"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_an_endpoint_is_a_bare_origin_in_one_spelling(endpoint: str, canonical: str) -> None:
    url = f"s3://b/?endpoint={quote(endpoint, safe='')}&region=r"
    assert canonical_store_url(url) == f"s3://b/?endpoint={quote(canonical, safe='')}&region=r"


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://127.0.0.1:9/SHARED",
        "http://127.0.0.1:9//",
        "http://127.0.0.1:9/?x=1",
        "http://127.0.0.1:9#f",
        "http://user@127.0.0.1:9",
        "http://127.0.0.1:9/%2E%2E",
        "ftp://127.0.0.1:9",
        "127.0.0.1:9",
        "http://",
        "http://127.0.0.1:99999",
        "http://a b",
    ],
)
def test_an_endpoint_that_is_not_a_bare_origin_is_refused_in_one_line(endpoint: str) -> None:
    url = f"s3://b/?endpoint={quote(endpoint, safe='')}&region=r"
    for parse in (parse_store_url, canonical_store_url):
        with pytest.raises(StoreURLError) as info:
            parse(url)
        message = str(info.value)
        assert "its endpoint" in message and "bare origin" in message and "\n" not in message


# --- The file store's keys (review finding 3) ------------------------------------------------------


@pytest.mark.parametrize("key", ["a/../b", "a/./b", "..", "a/..", "./a", "a/../../b/"])
def test_the_file_store_never_resolves_a_key_through_dot_segments(tmp_path: Path, key: str) -> None:
    from broker.fragment.stores import StoreError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").write_bytes(b"outside\n")
    store = open_store("file:///", file_root=tmp_path)
    for operation in (
        lambda: store.put(key + "/p", io.BytesIO(b"p\n"), 2),
        lambda: store.get(key),
        lambda: store.remove(key),
        lambda: list(store.list(key + "/")),
    ):
        with pytest.raises(StoreError, match=r"'\.' or '\.\.' segment"):
            operation()
    assert (tmp_path / "b").read_bytes() == b"outside\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


# --- Path locks (review finding 4) -----------------------------------------------------------------


def test_applies_share_a_path_lock_exactly_when_their_paths_could_meet() -> None:
    from allocator.keyspace import path_lock_key
    from broker.fragment.stores.paths import lock_of

    journals = ["a", "a/b", "ab", "b/c", "x%2Fy", "x/y"]
    stores = ["file:///", "file:///a/", "s3://a/?region=r", "gs://a/", "s3://a.b/?region=r"]
    paths = [fragment_path(j, s) for j in journals for s in stores]
    for p in paths:
        for q in paths:
            same_lock = path_lock_key("/r", *lock_of(p)) == path_lock_key("/r", *lock_of(q))
            if overlap(p, q):
                assert same_lock, (p, q)
            assert same_lock == (lock_of(p) == lock_of(q)), (p, q)
    # Each part escaped whole: one '/' between storage and segment, whatever they hold.
    assert all(path_lock_key("/r", *lock_of(p)).removeprefix("/r/paths/").count("/") == 1 for p in paths)  # fmt: skip


async def test_path_locks_are_left_out_of_the_brokers_mirror_quietly(
    etcd_server: object,
    etcd: Any,
    etcd_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import grpc

    from allocator.keyspace import PATHS
    from broker.protocol import protocol_pb2_grpc as pb_grpc
    from broker.testing import BrokerHarness

    (tmp_path / "x").mkdir()
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix, file_root=str(tmp_path)) as harness:  # type: ignore[attr-defined]  # fmt: skip
        service = harness.broker.service
        assert service is not None
        async with grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://")) as channel:
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            spec = pb.JournalSpec(name="locks/a", replication=1)
            spec.fragment.length = 1 << 20
            spec.fragment.refresh_interval.seconds = 60
            spec.fragment.compression_codec = pb.NONE
            spec.fragment.stores.append("file:///x/")
            applied = await stub.Apply(pb.ApplyRequest(changes=[pb.ApplyRequest.Change(upsert=spec)]))  # fmt: skip
        await service.ks.wait_for_revision(applied.header.etcd.revision)
        held = [kv.key.decode() for kv in await etcd.get_prefix((etcd_prefix + PATHS).encode())]
        assert held == [f"{etcd_prefix}{PATHS}file/x"]
        assert not [kv for kv in service.ks.prefixed(etcd_prefix + PATHS)]
        assert not [r for r in caplog.records if "failed to decode" in r.getMessage()]
