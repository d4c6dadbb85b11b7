"""Escape attempts through fragment stores (issue 37, defects 2 and 3): a tenant's token, with
every capability over its own journals, names a store, a rewrite, a path postfix template or a
journal name so that its journal's fragments would be another journal's, then reads, appends or
probes there. Each attempt is refused at Apply (or the probe kept inside the caller's own
journal's path); the victim's content is never returned, nothing is written outside, and the
victim's next append still works.

Collected by tests/test_tenant_escape.py; run alone with
`python -m pytest tests/escape_stores.py -p no:xdist -q`.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.client.appender import AppendError
from broker.client.reader import READ_RETRYABLE, ReadError
from broker.client.routes import append_routed, waiting
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from plumbing import auth
from tests.helpers.fragments import put_fragment
from tests.helpers.store_servers import S3Server
from tests.helpers.tenancy import KEYS, admin, md, team

__all__ = [
    "left_behind",
    "stores_broker",
    "test_a_health_probe_of_a_shared_store_stays_inside_the_callers_journal",
    "test_a_journal_cannot_name_another_journals_fragments",
    "test_a_restricted_token_cannot_choose_a_stores_endpoint_or_profile",
    "test_a_restricted_token_cannot_claim_fragments_a_journal_left_behind",
    "test_a_spec_written_to_etcd_directly_does_not_reach_an_older_journals_fragments",
    "test_a_store_that_cannot_be_listed_refuses_a_restricted_apply_unavailable",
    "test_an_endpoints_trailing_slash_is_not_canonical",
    "test_an_operators_endpoint_and_profile_stay_usable_by_a_restricted_token",
    "test_an_s3_endpoint_that_is_not_a_bare_origin_is_refused_for_every_caller",
    "test_another_tenants_apply_flood_does_not_fail_a_tenants_applies",
    "test_applies_whose_client_leaves_at_any_point_leave_nothing_half_done",
    "test_check_delete_prefix_is_a_clean_key_directory_for_every_caller",
    "test_check_delete_prefix_lies_inside_a_visible_journal_after_the_stores_rewrite",
    "test_concurrent_applies_cannot_race_past_each_others_path_check",
    "test_non_canonical_store_spellings_are_refused_naming_the_canonical_form",
    "test_path_postfix_templates_cannot_climb_out_of_their_journal",
    "test_the_operator_may_create_a_journal_over_fragments_left_behind",
]

VICTIM = "tenant-y/secret"
SECRET = b"the victim's persisted secret\n"
FIRST = b"the victim's first append\n"


def prefix_token(prefix: str) -> pb.LabelSelector:
    sel = pb.LabelSelector()
    sel.include.labels.add(name="prefix", value=prefix)
    return sel


def journal_spec(name: str, owner: str, store: str, postfix: str = "") -> pb.JournalSpec:
    out = pb.JournalSpec(
        name=name,
        replication=1,
        fragment=pb.JournalSpec.Fragment(
            length=1 << 20,
            compression_codec=pb.NONE,
            refresh_interval={"seconds": 1},
            path_postfix_template=postfix,
        ),
    )
    out.labels.labels.add(name="team", value=owner)
    if store:
        out.fragment.stores.append(store)
    return out


@dataclass
class Cluster:
    stub: pb_grpc.JournalStub
    root: Path
    harness: BrokerHarness

    def files(self) -> set[str]:
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}


@pytest.fixture
async def stores_broker(etcd_server: object, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:  # fmt: skip
    """A keyed broker whose file root holds the victim's journal `tenant-y/secret` (team=y, in
    store file:///), with a persisted fragment of SECRET."""
    root = tmp_path / "root"
    (root / "tenant-y" / "secret").mkdir(parents=True)
    (root / "x").mkdir()
    put_fragment(open_store("file:///", file_root=root), VICTIM, 0, SECRET)
    async with BrokerHarness(
        etcd_server.endpoint,  # type: ignore[attr-defined]
        etcd_prefix,
        file_root=str(root),
        auth_keys=KEYS,
    ) as harness:
        channel = grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://"))
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        change = pb.ApplyRequest.Change(upsert=journal_spec(VICTIM, "y", "file:///"))
        await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
        # Its first append rolls its write head forward to the end of what its store holds.
        await append_routed(stub, VICTIM, FIRST, offset=len(SECRET), metadata=admin())
        yield Cluster(stub, root, harness)
        await channel.close(None)


async def read_content(stub: pb_grpc.JournalStub, journal: str, metadata: object) -> tuple[int, bytes]:  # fmt: skip
    """The status and content of a non-blocking read of `journal` from offset 0."""
    call = stub.Read(pb.ReadRequest(journal=journal, block=False), metadata=metadata)
    status, content = pb.OK, b""
    async for response in call:
        if response.status != pb.OK:
            status = response.status
        content += response.content
    return status, content


async def read_routed(stub: pb_grpc.JournalStub, journal: str, metadata: object) -> tuple[int, bytes]:  # fmt: skip
    """As read_content, once the journal has a primary (its reads then wait for its first
    listing of its stores)."""

    async def attempt() -> tuple[int, bytes]:
        status, content = await read_content(stub, journal, metadata)
        if status in READ_RETRYABLE:
            raise ReadError(journal, status)  # Transient: `waiting` tries again.
        return status, content

    return await waiting(attempt, f"a read of {journal}", wait=15)


async def exists(stub: pb_grpc.JournalStub, name: str) -> bool:
    sel = pb.LabelSelector()
    sel.include.labels.add(name="name", value=name)
    async for response in stub.List(pb.ListRequest(selector=sel), metadata=admin()):
        if response.journals:
            return True
    return False


async def victim_unharmed(cluster: Cluster, files_before: set[str]) -> None:
    """Nothing new was written in the file root, and the victim appends and reads as before."""
    assert cluster.files() == files_before
    response = await append_routed(cluster.stub, VICTIM, b"victim's next append\n", metadata=admin())  # fmt: skip
    assert response.status == pb.OK
    status, content = await read_content(cluster.stub, VICTIM, admin())
    assert content == SECRET + FIRST + b"victim's next append\n", (status, content)


async def attempt(
    cluster: Cluster, spec: pb.JournalSpec, token: tuple[tuple[str, str], ...]
) -> grpc.aio.AioRpcError:
    """Apply `spec` with `token`; it must be refused. If it was not, say what the attacker then
    read of the victim's content (the attack the refusal prevents)."""
    change = pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)
    try:
        await cluster.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=token)
    except grpc.aio.AioRpcError as err:
        return err
    status, leaked = await read_routed(cluster.stub, spec.name, token)
    raise AssertionError(f"{spec.name} in {list(spec.fragment.stores)} was applied; it read {pb.Status.Name(status)} {leaked!r}")  # fmt: skip


X = "team=x"
PREFIX = "prefix=team-x/"

# (attacker's journal, its store, whose token): each makes its fragment path equal to the
# victim's ('tenant-y/secret/' under the file root), contain it, or lie inside it.
ALIASES = [
    ("secret", "file:///tenant-y/", X),  # The reported attack.
    ("secret", "file:///tenant-y/?find=zz&replace=yy", X),  # A rewrite that matches nothing.
    ("mine/secret", "file:///?find=mine&replace=tenant-y", X),
    ("team-x/secret", "file:///?find=team-x%2F&replace=tenant-y%2F", PREFIX),
    ("team-x/a", "file:///?find=team-x%2Fa&replace=tenant-y%2Fsecret", PREFIX),
    ("xyzw", "file:///tenant-y/secret/?find=xyzw%2F", X),  # Rewritten to the victim's own dir.
    ("tenant-y", "file:///", X),  # Contains the victim's path.
    ("tenant-y/secret/inner", "file:///", X),  # Inside it.
    ("inner", "file:///tenant-y/secret/", X),
    ("team-x/in", "file:///?find=team-x&replace=tenant-y%2Fsecret", PREFIX),
]


def token_of(who: str) -> tuple[tuple[str, str], ...]:
    return md(auth.ALL, team("x") if who == X else prefix_token("team-x/"))


@pytest.mark.parametrize(("name", "store", "who"), ALIASES)
async def test_a_journal_cannot_name_another_journals_fragments(
    stores_broker: Cluster, name: str, store: str, who: str
) -> None:
    before = stores_broker.files()
    err = await attempt(stores_broker, journal_spec(name, "x", store), token_of(who))
    # Refused exactly as any unauthorized change: nothing names the hidden journal.
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert err.details() == f"not authorized to {name}"
    assert not await exists(stores_broker.stub, name)
    await victim_unharmed(stores_broker, before)
    # The operator, who sees both, is told which journal's path it is.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        change = pb.ApplyRequest.Change(upsert=journal_spec(name, "x", store))
        await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert VICTIM in (info.value.details() or "") and name in (info.value.details() or "")


# (store as written, its canonical form): each names the victim's store directory.
SPELLINGS = [
    ("file:///./tenant-y/", "file:///tenant-y/"),
    ("file:///x/../tenant-y/", "file:///tenant-y/"),
    ("file:////tenant-y/", "file:///tenant-y/"),
    ("file:///tenant-y//", "file:///tenant-y/"),
    ("file:///tenant-%79/", "file:///tenant-y/"),
    ("FILE:///tenant-y/", "file:///tenant-y/"),
    ("file:///tenant-y/.//./", "file:///tenant-y/"),
    ("file:///tenant-y/?", "file:///tenant-y/"),
    ("file:///?find=team-x/&replace=tenant-y/", "file:///?find=team-x%2F&replace=tenant-y%2F"),
    (
        "file:///?find=zz&find=team-x%2F&replace=tenant-y%2F",
        "file:///?find=team-x%2F&replace=tenant-y%2F",
    ),
    ("file:///?FIND=team-x%2F&Replace=tenant-y%2F", "file:///?find=team-x%2F&replace=tenant-y%2F"),
    ("file:///tenant-y/?find=", "file:///tenant-y/"),
]


@pytest.mark.parametrize(("store", "canonical"), SPELLINGS)
async def test_non_canonical_store_spellings_are_refused_naming_the_canonical_form(
    stores_broker: Cluster, store: str, canonical: str
) -> None:
    before = stores_broker.files()
    name = "team-x/secret" if "find" in store.lower() else "secret"
    token = md(auth.ALL, prefix_token("team-x/") if name.startswith("team-x/") else team("x"))
    err = await attempt(stores_broker, journal_spec(name, "x", store), token)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == (
        f'journal {name}: fragment.stores[0]: fragment store "{store}" is not canonical '
        f'(write "{canonical}")'
    )
    assert not await exists(stores_broker.stub, name)
    await victim_unharmed(stores_broker, before)


# (journal, store, postfix template): paths that climb, or that no store key can reason about.
CLIMBS = [
    ("secret", "file:///../tenant-y/", ""),
    ("secret", "file:///x/../../tenant-y/", ""),
    ("../tenant-y/secret", "file:///x/", ""),
    ("../tenant-y", "file:///", ""),
    ("secret", "file:///x/?find=secret&replace=..%2Ftenant-y%2Fsecret", ""),
    ("secret", "file:///x/?find=t%2F0&replace=%2F..%2F..%2Ftenant-y%2Fsecret%2F0", ""),
    ("mine", "file:///x/", ".."),
    ("mine", "file:///x/", "../../tenant-y/secret"),
    ("mine", "file:///x/", "/tenant-y/secret"),
    ("mine", "file:///x/", "a/../../../tenant-y/secret"),
    ("mine", "file:///x/", "{{.JournalSpec.Name}}/../../.."),
]


@pytest.mark.parametrize(("name", "store", "postfix"), CLIMBS)
async def test_path_postfix_templates_cannot_climb_out_of_their_journal(
    stores_broker: Cluster, name: str, store: str, postfix: str
) -> None:
    before = stores_broker.files()
    spec = journal_spec(name, "x", store, postfix)
    err = await attempt(stores_broker, spec, md(auth.ALL, team("x")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert details.startswith(f"journal {name}: "), details
    assert not await exists(stores_broker.stub, name)
    await victim_unharmed(stores_broker, before)


@pytest.mark.parametrize("spelling", ["file:///tenant-y/", "file:///./tenant-y/"])
async def test_a_health_probe_of_a_shared_store_stays_inside_the_callers_journal(
    stores_broker: Cluster, spelling: str
) -> None:
    """The attacker may have a journal of its own in the victim's store (their paths are
    disjoint), and may check that store's health: the probe goes under its own journal's path,
    never at the store's root (which is the victim's directory)."""
    x = md(auth.ALL, team("x"))
    change = pb.ApplyRequest.Change(upsert=journal_spec("mine", "x", "file:///tenant-y/"))
    await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
    request = pb.FragmentStoreHealthRequest(fragment_store=spelling)
    response = await stores_broker.stub.FragmentStoreHealth(request, metadata=x)
    assert response.status == pb.OK, response
    files = stores_broker.files()
    assert not any(f.startswith("tenant-y/.test") for f in files), files
    assert {f for f in files if not f.startswith("tenant-y/secret/")} <= {
        "tenant-y/mine/.gazette~health/health-check"
    }, files
    # With a delete probe: only under a journal the caller sees.
    request.check_delete = True
    request.check_delete_prefix = "secret/"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stores_broker.stub.FragmentStoreHealth(request, metadata=x)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    request.check_delete_prefix = "mine/"
    assert (await stores_broker.stub.FragmentStoreHealth(request, metadata=x)).status == pb.OK
    # The probes are not fragments of `mine`: its reads find nothing.
    assert await read_routed(stores_broker.stub, "mine", x) == (pb.OFFSET_NOT_YET_AVAILABLE, b"")
    await victim_unharmed(stores_broker, stores_broker.files())


async def test_a_spec_written_to_etcd_directly_does_not_reach_an_older_journals_fragments(
    stores_broker: Cluster, etcd: object, etcd_prefix: str
) -> None:
    """Defence in depth, for specs that reached etcd other than through Apply (etcd is the root
    of trust; an older broker's Apply): the younger of two journals sharing a path is neither
    listed nor persisted there, whatever its store's spelling."""
    alias = journal_spec("secret", "x", "file:///./tenant-y/")
    await etcd.put(f"{etcd_prefix}/items/secret".encode(), alias.SerializeToString())  # type: ignore[attr-defined]
    x = md(auth.ALL, team("x"))
    status, content = await read_routed(stores_broker.stub, "secret", x)
    assert SECRET not in content and FIRST not in content, (status, content)
    # Brokers use the canonical spelling of what they read.
    sel = pb.LabelSelector()
    sel.include.labels.add(name="name", value="secret")
    listed = [j async for r in stores_broker.stub.List(pb.ListRequest(selector=sel), metadata=admin()) for j in r.journals]  # fmt: skip
    assert [list(j.spec.fragment.stores) for j in listed] == [["file:///tenant-y/"]]
    before = stores_broker.files()
    await victim_unharmed(stores_broker, before)


async def test_concurrent_applies_cannot_race_past_each_others_path_check(
    stores_broker: Cluster,
) -> None:
    """Applies at once of journals whose paths are one ('tenant-y/race/' by rewrites of their
    names): each checked against a keyspace without the others, yet at most one is applied."""

    async def apply(i: int) -> str:
        name = f"team-x/race-{i}"
        store = f"file:///tenant-y/?find=team-x%2Frace-{i}&replace=race"
        change = pb.ApplyRequest.Change(upsert=journal_spec(name, "x", store), expect_mod_revision=0)  # fmt: skip
        try:
            response = await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())  # fmt: skip
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            return "refused"
        return pb.Status.Name(response.status)

    outcomes = await asyncio.gather(*(apply(i) for i in range(8)))
    assert outcomes.count("OK") == 1, outcomes
    assert set(outcomes) <= {"OK", "refused", "ETCD_TRANSACTION_FAILED"}, outcomes
    created = [i for i in range(8) if await exists(stores_broker.stub, f"team-x/race-{i}")]
    assert len(created) == 1


# --- S3 endpoints and profiles (review finding 1) ----------------------------------------------------


def s3_url(bucket: str, endpoint: str = "", prefix: str = "", profile: str = "") -> str:
    """An s3:// store URL spelled canonically: `endpoint` and `profile` are written as given."""
    args = [f"endpoint={urllib.parse.quote(endpoint, safe='')}"] if endpoint else []
    args += [f"profile={profile}"] if profile else []
    return f"s3://{bucket}/{prefix}?" + "&".join([*args, "region=us-east-1"])


# Endpoints that are not a bare origin `http(s)://host[:port]`: each refused for every caller,
# the operator included. With a path, boto's path-style request for bucket B goes to
# ENDPOINT/PATH/B/KEY: another bucket's keys (the reviewer's attack).
NOT_ORIGINS = [
    "{moto}/SHARED",
    "{moto}/SHARED/",
    "{moto}/%2E%2E/SHARED",
    "{moto}?x=1",
    "{moto}/?x=1",
    "{moto}#frag",
    "http://user:pw@127.0.0.1:9",
    "ftp://127.0.0.1:9",
    "127.0.0.1:9",
    "http://",
    "http:///SHARED",
    "http://127.0.0.1:notaport",
]


@pytest.mark.parametrize("endpoint", NOT_ORIGINS)
@pytest.mark.parametrize("who", ["operator", X])
async def test_an_s3_endpoint_that_is_not_a_bare_origin_is_refused_for_every_caller(
    stores_broker: Cluster, s3_server: S3Server, endpoint: str, who: str
) -> None:
    shared = s3_server.create_bucket()
    put_fragment(open_store(s3_url(shared, s3_server.endpoint)), "y/secret", 0, SECRET)
    endpoint = endpoint.format(moto=s3_server.endpoint).replace("SHARED", shared)
    store = s3_url("y", endpoint)
    token = admin() if who == "operator" else md(auth.ALL, team("x"))
    err = await attempt(stores_broker, journal_spec("secret", "x", store), token)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert details.startswith("journal secret: fragment.stores[0]: "), details
    assert "endpoint" in details and "\n" not in details, details
    assert not await exists(stores_broker.stub, "secret")
    # Nothing was written beside the victim's fragment.
    client: Any = s3_server.client()
    try:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=shared).get("Contents", [])]
    finally:
        client.close()
    assert len(keys) == 1 and keys[0].startswith("y/secret/"), keys


async def test_an_endpoints_trailing_slash_is_not_canonical(stores_broker: Cluster) -> None:
    store = "s3://b/?endpoint=http%3A%2F%2F127.0.0.1%3A9%2F&region=us-east-1"
    err = await attempt(stores_broker, journal_spec("secret", "x", store), admin())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == (
        f'journal secret: fragment.stores[0]: fragment store "{store}" is not canonical (write '
        '"s3://b/?endpoint=http%3A%2F%2F127.0.0.1%3A9&region=us-east-1")'
    )


# Stores a restricted token names for a journal of its own: each chooses where the broker sends
# requests signed with its credentials (SSRF), or which of its credentials sign them, or (a
# bucket-named virtual host) another bucket than the one the path index sees.
CHOSEN = [
    ("{shared}", "{moto}", ""),
    ("{mine}", "{moto}", ""),
    ("{mine}", "http://{shared}.s3.amazonaws.com", ""),
    ("y", "http://127.0.0.1:1", ""),
    ("{mine}", "", "gazette-test"),
    ("{mine}", "{moto}", "gazette-test"),
]


@pytest.mark.parametrize(("bucket", "endpoint", "profile"), CHOSEN)
async def test_a_restricted_token_cannot_choose_a_stores_endpoint_or_profile(
    stores_broker: Cluster, s3_server: S3Server, bucket: str, endpoint: str, profile: str
) -> None:
    shared, mine = s3_server.create_bucket(), s3_server.create_bucket()
    put_fragment(open_store(s3_url(shared, s3_server.endpoint)), "secret", 0, SECRET)
    fill = {"shared": shared, "mine": mine, "moto": s3_server.endpoint}
    store = s3_url(bucket.format(**fill), endpoint.format(**fill), profile=profile)
    err = await attempt(stores_broker, journal_spec("secret", "x", store), md(auth.ALL, team("x")))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert err.details() == (
        "journal secret: fragment.stores[0]: a token with a selector cannot choose the store's "
        "endpoint or profile (an operator sets them)"
    )
    assert not await exists(stores_broker.stub, "secret")


async def test_an_operators_endpoint_and_profile_stay_usable_by_a_restricted_token(
    stores_broker: Cluster, s3_server: S3Server
) -> None:
    """The operator created the journal with its store's endpoint: its tenant may re-apply it,
    move it within that bucket and endpoint, but not change the endpoint or the bucket."""
    bucket, other = s3_server.create_bucket(), s3_server.create_bucket()
    x = md(auth.ALL, team("x"))
    ops = s3_url(bucket, s3_server.endpoint)
    change = pb.ApplyRequest.Change(upsert=journal_spec("ops-j", "x", ops))
    await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    for store in (ops, s3_url(bucket, s3_server.endpoint, prefix="moved/")):
        change = pb.ApplyRequest.Change(upsert=journal_spec("ops-j", "x", store), expect_mod_revision=-1)  # fmt: skip
        response = await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
        assert response.status == pb.OK
    for store in (
        s3_url(bucket, "http://127.0.0.1:1", prefix="moved/"),
        s3_url(other, s3_server.endpoint, prefix="moved/"),
        s3_url(bucket, s3_server.endpoint, prefix="moved/", profile="gazette-test"),
    ):
        change = pb.ApplyRequest.Change(upsert=journal_spec("ops-j", "x", store), expect_mod_revision=-1)  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
        assert "cannot choose the store's endpoint or profile" in (info.value.details() or "")


# --- Fragments a journal left behind (review finding 2) ---------------------------------------------


# (attacker's journal, its store, whose token): each names the path of fragments left in the
# store by a journal that was deleted ('tenant-y/gone-j/', 'deep/down/j/') or moved ('y/logs/' in
# file:///old/).
LEFT_BEHIND = [
    ("gone-j", "file:///tenant-y/", X),
    ("gone", "file:///tenant-y/?find=gone%2F&replace=gone-j%2F", X),
    ("team-x/steal", "file:///?find=team-x%2Fsteal&replace=tenant-y%2Fgone-j", PREFIX),
    ("deep", "file:///", X),  # Contains the deleted journal's path.
    ("team-x/deep", "file:///?find=team-x%2F", PREFIX),
    ("logs", "file:///old/y/", X),  # The moved journal's old path.
    ("team-x/logs", "file:///old/?find=team-x%2F&replace=y%2F", PREFIX),
]


@pytest.fixture
async def left_behind(stores_broker: Cluster) -> Cluster:
    """`stores_broker`, where journals `tenant-y/gone-j` and `deep/down/j` (team=y) persisted
    fragments and were deleted, and `y/logs` moved from file:///old/ to file:///new/ (by its
    own team=y token)."""
    root, stub = stores_broker.root, stores_broker.stub
    (root / "old").mkdir()
    (root / "new").mkdir()
    for name in ("tenant-y/gone-j", "deep/down/j"):
        put_fragment(open_store("file:///", file_root=root), name, 0, SECRET)
        change = pb.ApplyRequest.Change(upsert=journal_spec(name, "y", "file:///"))
        await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
        change = pb.ApplyRequest.Change(delete=name, expect_mod_revision=-1)
        await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    put_fragment(open_store("file:///old/", file_root=root), "y/logs", 0, SECRET)
    change = pb.ApplyRequest.Change(upsert=journal_spec("y/logs", "y", "file:///old/"))
    await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    change = pb.ApplyRequest.Change(upsert=journal_spec("y/logs", "y", "file:///new/"), expect_mod_revision=-1)  # fmt: skip
    await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=md(auth.ALL, team("y")))
    # The broker's own health check of file:///new/ probes under y/logs/ there: an append waits
    # for it, and the tests' snapshots of the root are taken once no probe is half written.
    # Whether the journal's index still holds the fragment listed from file:///old/ depends on
    # which listing came first: if it does, the append is refused INDEX_HAS_GREATER_OFFSET, a
    # refusal made only after the store's health check passed, which is all this waits for.
    try:
        await append_routed(stub, "y/logs", b"", metadata=admin())
    except AppendError as exc:
        assert exc.status == pb.INDEX_HAS_GREATER_OFFSET, exc
    deadline = asyncio.get_running_loop().time() + 15
    while partial := list(root.rglob(".partial-*")):
        assert asyncio.get_running_loop().time() < deadline, f"still half written: {partial}"
        await asyncio.sleep(0.05)
    return stores_broker


@pytest.mark.parametrize(("name", "store", "who"), LEFT_BEHIND)
async def test_a_restricted_token_cannot_claim_fragments_a_journal_left_behind(
    left_behind: Cluster, name: str, store: str, who: str
) -> None:
    before = left_behind.files()
    err = await attempt(left_behind, journal_spec(name, "x", store), token_of(who))
    # Refused exactly as any unauthorized change: the caller learns only that it may not.
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert err.details() == f"not authorized to {name}"
    assert not await exists(left_behind.stub, name)
    await victim_unharmed(left_behind, before)


async def test_the_operator_may_create_a_journal_over_fragments_left_behind(
    left_behind: Cluster,
) -> None:
    """Upstream's flow of re-creating a deleted journal over its fragments stays the
    operator's; and a tenant re-applying its own journal, whose path holds its own fragments,
    is not refused."""
    stub = left_behind.stub
    change = pb.ApplyRequest.Change(upsert=journal_spec("tenant-y/gone-j", "y", "file:///"), expect_mod_revision=0)  # fmt: skip
    assert (await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())).status == pb.OK
    status, content = await read_routed(stub, "tenant-y/gone-j", admin())
    assert content == SECRET, (status, content)
    y = md(auth.ALL, team("y"))
    spec = journal_spec("tenant-y/gone-j", "y", "file:///")
    spec.labels.labels.add(name="version", value="2")
    change = pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=-1)
    assert (await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=y)).status == pb.OK


async def test_a_store_that_cannot_be_listed_refuses_a_restricted_apply_unavailable(
    stores_broker: Cluster, s3_server: S3Server
) -> None:
    bucket = s3_server.create_bucket()
    x = md(auth.ALL, team("x"))
    change = pb.ApplyRequest.Change(upsert=journal_spec("ops-j", "x", s3_url(bucket, s3_server.endpoint)))  # fmt: skip
    await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
    client: Any = s3_server.client()
    try:
        client.delete_bucket(Bucket=bucket)
    finally:
        client.close()
    moved = journal_spec("ops-j", "x", s3_url(bucket, s3_server.endpoint, prefix="moved/"))
    change = pb.ApplyRequest.Change(upsert=moved, expect_mod_revision=-1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stores_broker.stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "\n" not in (info.value.details() or "")
    listed = [j async for r in stores_broker.stub.List(pb.ListRequest(selector=team("x")), metadata=admin()) for j in r.journals]  # fmt: skip
    assert [list(j.spec.fragment.stores) for j in listed] == [[s3_url(bucket, s3_server.endpoint)]]
    # Its bucket is gone: deleted, the journal does not hold the broker's stop on its store.
    gone = pb.ApplyRequest.Change(delete="ops-j", expect_mod_revision=-1)
    await stores_broker.stub.Apply(pb.ApplyRequest(changes=[gone]), metadata=admin())


# --- FragmentStoreHealth's check_delete_prefix (review finding 3) -----------------------------------

# Prefixes that are not a clean relative key directory: refused for every caller.
UNCLEAN_PREFIXES = [
    "mine/../tenant-y/secret/",
    "mine/../tenant-z/new/",
    "mine/a/../../tenant-y/secret/",
    "../tenant-y/secret/",
    "mine/./",
    "./mine/",
    "mine//",
    "/mine/",
    "/tenant-y/secret/",
    "mine/\x7f/",
    "mine/\n/",
    "mine/..",
    "..",
    "mine/../",
]


@pytest.mark.parametrize("prefix", UNCLEAN_PREFIXES)
@pytest.mark.parametrize("who", ["operator", X])
async def test_check_delete_prefix_is_a_clean_key_directory_for_every_caller(
    stores_broker: Cluster, prefix: str, who: str
) -> None:
    stub, root = stores_broker.stub, stores_broker.root
    x = md(auth.ALL, team("x"))
    change = pb.ApplyRequest.Change(upsert=journal_spec("mine", "x", "file:///"))
    await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
    # A victim's object named as the probe is: a put finds it, and the remove deletes it.
    victim_object = root / "tenant-y" / "secret" / ".gazette-delete-probe"
    victim_object.write_bytes(b"victim's object\n")
    before = stores_broker.files()
    request = pb.FragmentStoreHealthRequest(
        fragment_store="file:///", check_delete=True, check_delete_prefix=prefix
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.FragmentStoreHealth(request, metadata=admin() if who == "operator" else x)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    details = info.value.details() or ""
    assert details.startswith("check_delete_prefix ") and "\n" not in details, details
    assert victim_object.read_bytes() == b"victim's object\n"
    assert stores_broker.files() == before
    assert not (root / "tenant-z").exists()


async def test_check_delete_prefix_lies_inside_a_visible_journal_after_the_stores_rewrite(
    stores_broker: Cluster,
) -> None:
    """A clean prefix under the caller's journal's name, which the store's rewrite sends
    elsewhere ('rw-j/zz/' to 'x/rw-j/../../tenant-y/secret/'): refused to the token, and the store
    itself never resolves a key with '..' for the operator either."""
    stub, root = stores_broker.stub, stores_broker.root
    x = md(auth.ALL, team("x"))
    store = "file:///x/?find=zz&replace=..%2F..%2Ftenant-y%2Fsecret"
    change = pb.ApplyRequest.Change(upsert=journal_spec("rw-j", "x", store))
    assert (await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)).status == pb.OK
    victim_object = root / "tenant-y" / "secret" / ".gazette-delete-probe"
    victim_object.write_bytes(b"victim's object\n")
    before = stores_broker.files()
    request = pb.FragmentStoreHealthRequest(
        fragment_store=store, check_delete=True, check_delete_prefix="rw-j/zz/"
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.FragmentStoreHealth(request, metadata=x)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    response = await stub.FragmentStoreHealth(request, metadata=admin())
    assert response.status == pb.FRAGMENT_STORE_UNHEALTHY, response
    assert "'..'" in response.store_health_error, response
    assert victim_object.read_bytes() == b"victim's object\n"
    own = ("x/.test/", "x/rw-j/.gazette~health/")  # The store checks, inside x's own space.
    written = {f for f in stores_broker.files() - before if not f.startswith(own)}
    assert written == set(), written
    # Inside the journal's path, the probe goes and comes.
    request.check_delete_prefix = "rw-j/sub/"
    assert (await stub.FragmentStoreHealth(request, metadata=x)).status == pb.OK
    assert not (root / "x" / "rw-j" / "sub" / ".gazette-delete-probe").exists()


# --- Applies of other tenants do not contend (review finding 4) -------------------------------------


async def test_another_tenants_apply_flood_does_not_fail_a_tenants_applies(
    stores_broker: Cluster,
) -> None:
    """Tenant x re-applies its journals in a loop, without stores and with stores in its own
    directory; tenant y's Applies of new journals with a store in another directory, with no
    expected revision, all succeed meanwhile (they share no path lock with x's)."""
    stub, root = stores_broker.stub, stores_broker.root
    (root / "y").mkdir()
    stop = asyncio.Event()
    x = md(auth.ALL, team("x"))
    applied = [0, 0]

    async def flood(i: int) -> None:
        spec = journal_spec(f"x-flood-{i}", "x", "file:///x/" if i % 2 else "")
        while not stop.is_set():
            change = pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=-1)
            await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
            applied[i % 2] += 1

    floods = [asyncio.create_task(flood(i)) for i in range(6)]
    y = md(auth.ALL, team("y"))
    outcomes = []
    try:
        # The flood is under way, both kinds, before y applies.
        async with asyncio.timeout(30):
            while min(applied) < 5:
                await asyncio.sleep(0.05)
        for i in range(10):
            change = pb.ApplyRequest.Change(upsert=journal_spec(f"y/new-{i}", "y", "file:///y/"), expect_mod_revision=-1)  # fmt: skip
            response = await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=y)
            outcomes.append(pb.Status.Name(response.status))
        during = applied[:]
    finally:
        stop.set()
        await asyncio.gather(*floods)
    assert outcomes == ["OK"] * 10, outcomes
    assert min(during) > 5, during  # The flood went on meanwhile.


# --- A client that leaves mid-Apply ---------------------------------------------------------------


async def test_applies_whose_client_leaves_at_any_point_leave_nothing_half_done(
    stores_broker: Cluster,
) -> None:
    """60 concurrent Applies whose deadlines (1 to 20 ms) end them while they read the path locks,
    list the store or commit: afterwards each journal is there whole or not at all, nothing holds
    a lock, and the next Applies of both tenants succeed at once."""
    stub, root = stores_broker.stub, stores_broker.root
    (root / "y").mkdir()
    x, y = md(auth.ALL, team("x")), md(auth.ALL, team("y"))
    wanted = {f"c-{i}": journal_spec(f"c-{i}", "x", "file:///x/") for i in range(60)}

    async def leave_early(i: int) -> None:
        change = pb.ApplyRequest.Change(upsert=wanted[f"c-{i}"], expect_mod_revision=0)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x, timeout=0.001 * (i % 20 + 1))  # fmt: skip

    await asyncio.gather(*(leave_early(i) for i in range(60)))
    listed = [j async for r in stub.List(pb.ListRequest(selector=team("x")), metadata=admin()) for j in r.journals]  # fmt: skip
    for journal in listed:
        if journal.spec.name in wanted:
            assert journal.spec == wanted[journal.spec.name], journal.spec
    async with asyncio.timeout(20):
        for name, owner, token in (("y/after", "y", y), ("x-after", "x", x)):
            change = pb.ApplyRequest.Change(upsert=journal_spec(name, owner, f"file:///{owner}/"), expect_mod_revision=0)  # fmt: skip
            assert (
                await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=token)
            ).status == pb.OK
