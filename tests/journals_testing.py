"""Test helpers: journals with hand-written assignments, as upstream's setTestJournal does,
for tests of the broker core that must not depend on the allocator."""

from __future__ import annotations

import aetcd

from broker.allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb


def journal_spec(name: str, replication: int = 3, length: int = 1 << 20) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


async def set_journal(
    etcd: aetcd.Client, root: str, spec: pb.JournalSpec, members: list[tuple[str, str]]
) -> None:
    """Upsert `spec` and assign it to `members` (the first is primary), each assignment under
    its member's lease, replacing any earlier assignments of the journal."""
    await etcd.put(aks.item_key(root, spec.name).encode(), spec.SerializeToString())
    await etcd.delete_prefix(f"{root}{aks.ASSIGNMENTS}{spec.name}{aks.SEP}".encode())
    for slot, (zone, suffix) in enumerate(members):
        member = await etcd.get(aks.member_key(root, zone, suffix).encode())
        assert member is not None, f"no member {zone}/{suffix}"
        key = aks.assignment_key(root, spec.name, zone, suffix, slot).encode()
        await etcd.put(key, b"", lease=member.lease)
