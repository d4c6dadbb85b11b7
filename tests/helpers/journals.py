"""Journals of the broker-core tests: specs, hand-written assignments (as upstream's
setTestJournal writes them, for tests that must not depend on the allocator), in-process brokers
(`started_brokers`, and the three `IDS` of the append tests with a stub and a whole read of each),
and a wait for a journal's route."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import pytest
from aetcd import transactions

from allocator import keyspace as aks
from broker.append_api import ClientStream
from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness
from plumbing import etcd as etcdx
from tests.helpers.waiting import until


def journal_spec(name: str, replication: int = 3, length: int = 1 << 20) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


# The brokers `started_brokers` runs in this process, by etcd root (each test has its own).
_STARTED: dict[str, list[BrokerHarness]] = {}


async def set_journal(
    etcd: aetcd.Client, root: str, spec: pb.JournalSpec, members: list[tuple[str, str]]
) -> None:
    """Upsert `spec` and assign it to `members` (the first is primary), each assignment under
    its member's lease, replacing earlier assignments of the journal in the same transaction,
    so a broker that stays assigned never sees itself unassigned (its replica keeps its spool,
    as with the allocator, which never drops every replica of a journal at once)."""
    prefix = f"{root}{aks.ASSIGNMENTS}{spec.name}{aks.SEP}"
    existing = {kv.key for kv in await etcd.get_prefix(prefix.encode())}
    ops: list[object] = [
        transactions.Put(aks.item_key(root, spec.name).encode(), spec.SerializeToString())
    ]
    wanted = set()
    for slot, (zone, suffix) in enumerate(members):
        member = await etcd.get(aks.member_key(root, zone, suffix).encode())
        assert member is not None, f"no member {zone}/{suffix}"
        key = aks.assignment_key(root, spec.name, zone, suffix, slot).encode()
        wanted.add(key)
        if key not in existing:
            ops.append(transactions.Put(key, b"", lease=member.lease))
    ops.extend(transactions.Delete(key) for key in existing - wanted)
    result = await etcdx.txn(etcd, [], ops)
    # As upstream's setTestJournal: return once the running brokers under `root` (those of
    # `started_brokers`) see the change, so that the test's next call finds the journal
    # however loaded the machine is.
    for harness in _STARTED.get(root, []):
        if harness.broker.server is not None:
            await harness.broker.ks.wait_for_revision(result.revision, timeout=10)


@contextlib.asynccontextmanager
async def started_brokers(
    etcd_endpoint: str, root: str, ids: list[str], **options: Any
) -> AsyncIterator[list[BrokerHarness]]:
    """In-process brokers with these ids, stopped (in reverse) on exit. By default without the
    allocator: tests of the broker core place journals with `set_journal`."""
    options.setdefault("run_allocator", False)
    started: list[BrokerHarness] = []
    running = _STARTED.setdefault(root, [])
    try:
        for broker_id in ids:
            harness = BrokerHarness(etcd_endpoint, root, id=broker_id, **options)
            await harness.__aenter__()
            started.append(harness)
            running.append(harness)
        yield started
    finally:
        for harness in reversed(started):
            if harness.broker.server is not None:
                await harness.__aexit__(None, None, None)
            running.remove(harness)
        if not running:
            _STARTED.pop(root, None)


async def routed(
    client: JournalsClient, journal: str, replicas: int, members: str = ""
) -> pb.Route:
    """The journal's route once it has `replicas` members (with ids starting with `members`)
    and a primary."""
    route = pb.Route()

    async def assigned() -> bool:
        nonlocal route
        listing = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))
        )
        if not listing.journals:
            return False
        route = listing.journals[0].route
        return (
            len(route.members) == replicas
            and route.primary != -1
            and all(m.suffix.startswith(members) for m in route.members)
        )

    await until(assigned, f"{journal} assigned", timeout=30, interval=0.05)
    return route


IDS = ["broker-a", "broker-b", "broker-c"]


def stub(h: BrokerHarness):  # type: ignore[no-untyped-def]
    return h.broker.service.dialer.journal_stub(h.endpoint)


async def read_all(h: BrokerHarness, journal: str, offset: int = 0, end: int = 0) -> bytes:
    out = bytearray()
    async for r in stub(h).Read(
        pb.ReadRequest(journal=journal, offset=offset, end_offset=end, block=False)
    ):
        if r.status == pb.OFFSET_NOT_YET_AVAILABLE:
            break
        assert r.status == pb.OK, r
        out += r.content
    return bytes(out)


def append_streams(monkeypatch: pytest.MonkeyPatch) -> list[ClientStream]:
    """Every Append stream the in-process brokers open from now on, as each opens: a test that
    writes part of an append waits until a broker has read it (`bytes_received`)."""
    streams: list[ClientStream] = []
    opened = ClientStream.__init__

    def recorded(self: ClientStream, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        streams.append(self)

    monkeypatch.setattr(ClientStream, "__init__", recorded)
    return streams
