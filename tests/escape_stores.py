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

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from broker.client.reader import READ_RETRYABLE, ReadError
from broker.client.routes import append_routed, waiting
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from plumbing import auth
from tests.fragments_testing import put_fragment
from tests.test_tenancy import KEYS, admin, md, team

__all__ = [
    "stores_broker",
    "test_a_health_probe_of_a_shared_store_stays_inside_the_callers_journal",
    "test_a_journal_cannot_name_another_journals_fragments",
    "test_a_spec_written_to_etcd_directly_does_not_reach_an_older_journals_fragments",
    "test_concurrent_applies_cannot_race_past_each_others_path_check",
    "test_non_canonical_store_spellings_are_refused_naming_the_canonical_form",
    "test_path_postfix_templates_cannot_climb_out_of_their_journal",
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
        yield Cluster(stub, root)
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
    import asyncio

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
