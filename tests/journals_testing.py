"""Test helpers: journals with hand-written assignments, as upstream's setTestJournal does,
for tests of the broker core that must not depend on the allocator."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aetcd
from aetcd import transactions

from allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness
from plumbing import etcd as etcdx


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
