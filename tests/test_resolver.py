"""The resolver state by state, on a real etcd and a real keyspace mirror, with no broker: each
status a resolution can have, local replicas started on assignment, invalidated when their
assignments change, and stopped when unassigned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest
from aetcd import transactions

from allocator import keyspace as aks
from broker.keyspace import broker_decoder
from broker.protocol import protocol_pb2 as pb
from broker.replica import Replica
from broker.resolver import ResolveError, Resolver
from keyspace import KeySpace
from plumbing import etcd as etcdx
from plumbing.tasks import TaskOwner
from tests.helpers.journals import journal_spec

LOCAL = pb.ProcessSpec.ID(zone="local", suffix="me")


@pytest.fixture
async def world(
    etcd: aetcd.Client, etcd_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[Resolver, aetcd.Client, str]]:
    ks = KeySpace(etcd_prefix, broker_decoder(etcd_prefix), apply_delay=0.0)
    await ks.load(etcd)
    owner = TaskOwner("test keyspace")
    owner.spawn(ks.watch(etcd), "watch")
    resolver = Resolver(ks, etcd_prefix, LOCAL, lambda journal: Replica(journal, tmp_path))
    lease = await etcd.lease(30)
    for suffix in ("me", "other", "third"):
        spec = pb.BrokerSpec(
            process_spec=pb.ProcessSpec(
                id=pb.ProcessSpec.ID(zone="local", suffix=suffix),
                endpoint=f"http://127.0.0.1:1/{suffix}",
            )
        )
        key = aks.member_key(etcd_prefix, "local", suffix).encode()
        await etcd.put(key, spec.SerializeToString(), lease=lease.id)
    try:
        yield resolver, etcd, etcd_prefix
    finally:
        await resolver.stop_serving()
        await owner.close()


async def put_journal(
    etcd: aetcd.Client,
    root: str,
    name: str,
    members: list[str],
    *,
    primary: bool = True,
    suspend: int = 0,
    replication: int = 0,
) -> int:
    """The journal and its assignments (the first member primary unless `primary` is False),
    replacing any earlier ones; returns the etcd revision."""
    spec = journal_spec(name, replication=replication or max(1, len(members)))
    spec.suspend.level = suspend  # type: ignore[assignment]
    existing = {kv.key for kv in await etcd.get_prefix(f"{root}{aks.ASSIGNMENTS}{name}#".encode())}
    ops: list[object] = [
        transactions.Put(aks.item_key(root, name).encode(), spec.SerializeToString())
    ]
    wanted = set()
    for slot, suffix in enumerate(members):
        key = aks.assignment_key(root, name, "local", suffix, slot if primary else slot + 1)
        wanted.add(key.encode())
        ops.append(transactions.Put(key.encode(), b""))
    ops.extend(transactions.Delete(key) for key in existing - wanted)
    result = await etcdx.txn(etcd, [], ops)
    return int(result.revision)


async def test_each_status_of_a_resolution(world: tuple[Resolver, aetcd.Client, str]) -> None:
    resolver, etcd, root = world
    rev = await put_journal(etcd, root, "r/remote", ["other", "third"])
    res = await resolver.resolve("r/absent", may_proxy=True, require_primary=True)
    assert res.status == pb.JOURNAL_NOT_FOUND and res.header.process_id == LOCAL

    res = await resolver.resolve(
        "r/remote", may_proxy=True, require_primary=True, min_etcd_revision=rev
    )
    assert res.status == pb.OK and not res.is_local
    assert res.header.process_id.suffix == "other"  # The primary: the append is proxied.
    assert [m.suffix for m in res.route.members] == ["other", "third"]
    res = await resolver.resolve("r/remote;meta", may_proxy=False, require_primary=True)
    assert res.status == pb.NOT_JOURNAL_PRIMARY_BROKER
    res = await resolver.resolve("r/remote", may_proxy=False, require_primary=False)
    assert res.status == pb.NOT_JOURNAL_BROKER

    rev = await put_journal(etcd, root, "r/headless", ["other"], primary=False)
    res = await resolver.resolve(
        "r/headless", may_proxy=True, require_primary=True, min_etcd_revision=rev
    )
    assert res.status == pb.NO_JOURNAL_PRIMARY_BROKER
    # A reader is still routed to a member.
    res = await resolver.resolve("r/headless", may_proxy=True, require_primary=False)
    assert res.status == pb.OK and res.header.process_id.suffix == "other"

    rev = await put_journal(etcd, root, "r/unassigned", [], replication=2)
    res = await resolver.resolve(
        "r/unassigned", may_proxy=True, require_primary=False, min_etcd_revision=rev
    )
    assert res.status == pb.INSUFFICIENT_JOURNAL_BROKERS

    rev = await put_journal(etcd, root, "r/suspended", [], suspend=pb.JournalSpec.Suspend.FULL)
    res = await resolver.resolve(
        "r/suspended", may_proxy=True, require_primary=True, min_etcd_revision=rev
    )
    assert res.status == pb.SUSPENDED


async def test_a_header_from_another_cluster_or_process_is_refused(
    world: tuple[Resolver, aetcd.Client, str],
) -> None:
    resolver, etcd, root = world
    await put_journal(etcd, root, "r/hdr", ["me"])
    foreign = pb.Header(etcd=pb.Header.Etcd(cluster_id=resolver.ks.header.cluster_id + 1))
    with pytest.raises(ResolveError, match="etcd cluster"):
        await resolver.resolve(
            "r/hdr", may_proxy=False, require_primary=False, proxy_header=foreign
        )
    other = pb.Header(process_id=pb.ProcessSpec.ID(zone="local", suffix="other"))
    other.etcd.cluster_id = resolver.ks.header.cluster_id
    with pytest.raises(ResolveError, match="not this broker"):
        await resolver.resolve("r/hdr", may_proxy=False, require_primary=False, proxy_header=other)


async def test_local_replicas_start_are_invalidated_and_stop(
    world: tuple[Resolver, aetcd.Client, str],
) -> None:
    resolver, etcd, root = world
    rev = await put_journal(etcd, root, "r/mine", ["me", "other"])
    res = await resolver.resolve(
        "r/mine", may_proxy=False, require_primary=True, min_etcd_revision=rev
    )
    assert res.status == pb.OK and res.is_local and res.replica is not None
    replica = res.replica
    assert replica.primary and replica.index.first_refresh.is_set()  # Started: no stores.
    assert not res.invalidated.is_set()

    # The assignments change (a third replica): resolutions made before are invalidated, and
    # a new resolution waits on a fresh event.
    rev = await put_journal(etcd, root, "r/mine", ["me", "other", "third"])
    await resolver.ks.wait_for_revision(rev)
    assert res.invalidated.is_set()
    again = await resolver.resolve("r/mine", may_proxy=False, require_primary=True)
    assert again.replica is replica and not again.invalidated.is_set()
    assert len(again.route.members) == 3

    # Demoted: no longer the primary; the replica (and its content) stays.
    rev = await put_journal(etcd, root, "r/mine", ["other", "me"])
    await resolver.ks.wait_for_revision(rev)
    assert resolver.replicas is not None and resolver.replicas["r/mine"] is replica
    assert not replica.primary
    res = await resolver.resolve("r/mine", may_proxy=False, require_primary=True)
    assert res.status == pb.NOT_JOURNAL_PRIMARY_BROKER

    # Unassigned: stopped, owned by the resolver until its shutdown ends.
    rev = await put_journal(etcd, root, "r/mine", ["other"])
    await resolver.ks.wait_for_revision(rev)
    assert "r/mine" not in resolver.replicas
    async with asyncio.timeout(10):
        await resolver.tasks.join()
    assert replica.stopped
