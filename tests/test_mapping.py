"""Partitioned topics: upstream's FNV-1a modulo and rendezvous mappings, and a partition set kept
current by a List watch on a real broker."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from message.mapping import (
    Partition,
    WatchedPartitions,
    fnv1a32,
    modulo_mapping,
    random_mapping,
    rendezvous_mapping,
)
from tests.helpers.journals import started_brokers


def test_fnv1a32_matches_the_reference_vectors() -> None:
    # From the FNV reference test suite (and Go's hash/fnv).
    assert fnv1a32(b"") == 0x811C9DC5
    assert fnv1a32(b"a") == 0xE40C292C
    assert fnv1a32(b"foobar") == 0xBF9CF968


def parts(n: int) -> list[Partition]:
    return [Partition(f"topic/part-{i:03d}", "application/x-ndjson") for i in range(n)]


@given(key=st.binary(max_size=40), n=st.integers(min_value=1, max_value=20))
def test_modulo_is_fnv_modulo_the_partition_count(key: bytes, n: int) -> None:
    mapping = modulo_mapping(lambda k: k, lambda: parts(n))
    assert mapping(key) == parts(n)[fnv1a32(key) % n]


@given(key=st.binary(max_size=40), n=st.integers(min_value=1, max_value=20))
def test_rendezvous_takes_the_highest_weight(key: bytes, n: int) -> None:
    mapping = rendezvous_mapping(lambda k: k, lambda: parts(n))
    weights = [fnv1a32(key) ^ fnv1a32(p.journal.encode()) for p in parts(n)]
    # The first partition of the highest weight (upstream starts from weight 0 at index 0).
    expected = max(range(n), key=lambda i: (weights[i], -i)) if max(weights) > 0 else 0
    assert mapping(key) == parts(n)[expected]


def test_rendezvous_moves_only_keys_to_a_new_partition() -> None:
    current = parts(8)
    mapping = rendezvous_mapping(lambda k: k, lambda: current)
    keys = [f"key-{i}".encode() for i in range(2000)]
    before = {k: mapping(k) for k in keys}
    current = parts(9)
    after = {k: mapping(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(after[k].journal == "topic/part-008" for k in moved)
    # Modulo, by contrast, reshuffles most keys.
    mod8 = modulo_mapping(lambda k: k, lambda: parts(8))
    mod9 = modulo_mapping(lambda k: k, lambda: parts(9))
    assert sum(mod8(k) != mod9(k) for k in keys) > len(keys) // 2


def test_random_spreads_over_partitions() -> None:
    mapping = random_mapping(lambda: parts(4), random.Random(7))
    counts = Counter(mapping(None).journal for _ in range(4000))
    assert len(counts) == 4 and min(counts.values()) > 800


async def test_watched_partitions_pick_up_new_journals(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    def spec(name: str) -> pb.JournalSpec:
        out = pb.JournalSpec(name=name, replication=1)
        out.labels.CopyFrom(labels.label_set(("topic", "clicks"), ("content-type", "text/csv")))
        out.fragment.length = 1 << 20
        out.fragment.compression_codec = pb.NONE
        out.fragment.refresh_interval.seconds = 60
        return out

    async with (
        started_brokers(etcd_server.endpoint, etcd_prefix, ["bk-0"]) as (broker,),
        broker.client() as client,
    ):
        await client.apply([pb.ApplyRequest.Change(upsert=spec("clicks/part-000"))])
        selector = labels.parse_selector("topic=clicks")
        async with WatchedPartitions(client, selector) as partitions:
            await asyncio.wait_for(partitions.ready(), 10)
            assert [p.journal for p in partitions()] == ["clicks/part-000"]
            assert partitions()[0].content_type == "text/csv"
            changed = asyncio.ensure_future(partitions.changed())
            await client.apply([pb.ApplyRequest.Change(upsert=spec("clicks/part-001"))])
            await asyncio.wait_for(changed, 10)
            assert [p.journal for p in partitions()] == ["clicks/part-000", "clicks/part-001"]
