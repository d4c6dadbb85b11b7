"""Journals and shards for tests: specs with test-friendly defaults, applied and waited for
until every journal has its replicas and a primary, and every shard a PRIMARY replica."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from consumer.client import ShardsClient
from consumer.protocol import cpb

NDJSON = "application/x-ndjson"


def journal_spec(
    name: str,
    *,
    content_type: str = NDJSON,
    replication: int = 1,
    fragment_length: int = 1 << 20,
    stores: Sequence[str] = (),
    labels: Iterable[tuple[str, str]] = (),
) -> pb.JournalSpec:
    """A JournalSpec of `content_type` messages: uncompressed fragments of up to
    `fragment_length` bytes, persisted to `stores` (none by default: content stays with the
    brokers)."""
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = fragment_length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    spec.fragment.stores.extend(stores)
    pairs = sorted([("content-type", content_type), *labels])
    spec.labels.labels.extend(pb.Label(name=n, value=v) for n, v in pairs)
    return spec


def shard_spec(
    shard_id: str,
    sources: Sequence[str],
    *,
    max_txn_duration: float = 0.2,
    hot_standbys: int = 0,
    recovery_log_prefix: str = "",
    labels: Iterable[tuple[str, str]] = (),
) -> cpb.ShardSpec:
    """A ShardSpec reading `sources` (journal names), with transactions of at most
    `max_txn_duration` seconds (short, so that tests see commits soon). A
    `recovery_log_prefix` (for recorded stores such as SQLite) gets hints under the consumer's
    hint root (`<its etcd prefix>/hints`: the hint prefix is left empty for Apply to fill in)."""
    spec = cpb.ShardSpec(
        id=shard_id,
        sources=[cpb.ShardSpec.Source(journal=j) for j in sources],
        hot_standbys=hot_standbys,
    )
    spec.max_txn_duration.FromNanoseconds(int(max_txn_duration * 1e9))
    spec.recovery_log_prefix = recovery_log_prefix
    spec.labels.labels.extend(pb.Label(name=n, value=v) for n, v in sorted(labels))
    return spec


async def create_journals(
    broker_address: str, specs: Sequence[pb.JournalSpec], *, timeout: float = 30.0
) -> None:
    """Apply `specs` (created or replaced) through the broker at `broker_address`, and return
    once each journal has `replication` members and a primary (so appends go through at
    once). A journal the brokers cannot place (fewer brokers than its replication) fails
    with a TimeoutError naming it."""
    wanted = {spec.name: spec.replication for spec in specs}
    async with JournalsClient(broker_address) as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec) for spec in specs])
        waiting = set(wanted)
        try:
            async with asyncio.timeout(timeout):
                while waiting:
                    waiting = set(wanted)
                    for listed in (await client.list()).journals:
                        route = listed.route
                        if (
                            listed.spec.name in wanted
                            and route.primary != -1
                            and len(route.members) >= wanted[listed.spec.name]
                        ):
                            waiting.discard(listed.spec.name)
                    if waiting:
                        # List again: a watch answers when specs change, not routes (upstream's).
                        await asyncio.sleep(0.05)
        except TimeoutError:
            raise TimeoutError(
                f"journals without all their replicas after {timeout:g}s: {sorted(waiting)}"
            ) from None


async def apply_shards(
    consumer_address: str, specs: Sequence[cpb.ShardSpec], *, timeout: float = 30.0
) -> None:
    """Apply `specs` through the consumer at `consumer_address` and return once each shard
    has a PRIMARY replica and as many STANDBY ones as it wants (given consumers enough). A
    shard that FAILED fails here with its error."""
    wanted = {spec.id: spec.hot_standbys for spec in specs}
    async with ShardsClient(consumer_address) as client:
        await client.apply([cpb.ApplyRequest.Change(upsert=spec) for spec in specs])
        waiting = set(wanted)
        try:
            async with asyncio.timeout(timeout):
                while waiting:
                    waiting = set(wanted)
                    for shard in (await client.list()).shards:
                        if shard.spec.id not in wanted:
                            continue
                        codes = [status.code for status in shard.status]
                        if cpb.ReplicaStatus.FAILED in codes:
                            errors = [e for status in shard.status for e in status.errors]
                            raise RuntimeError(f"shard {shard.spec.id} FAILED: {errors}")
                        standbys = codes.count(cpb.ReplicaStatus.STANDBY)
                        if cpb.ReplicaStatus.PRIMARY in codes and standbys >= wanted[shard.spec.id]:
                            waiting.discard(shard.spec.id)
                    if waiting:
                        await asyncio.sleep(0.05)  # Shards have no watch: List again.
        except TimeoutError:
            raise TimeoutError(
                f"shards without a primary (and their standbys) after {timeout:g}s: "
                f"{sorted(waiting)}"
            ) from None
