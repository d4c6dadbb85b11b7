"""Journal spec management at scale: Apply and List of many journals through a broker, against
the same etcd operations issued directly (the floor any broker could reach).

- apply: N specs in transactions of 100 changes, through `Apply`, vs direct etcd transactions
  putting the same encoded specs with the same revision compares.
- list: a full listing of N journals through `List` (server-streamed in chunks of 25) vs a
  direct etcd range read of the same keys (decoding included on both sides).

`run()` reports apply as `value` (specs/s) beside its direct-etcd `baseline`, and list as `list`,
`list_baseline` and `list_ratio`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from aetcd import transactions

from allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from plumbing import etcd as etcdx

JOURNALS = 2000
BATCH = 100
ROUNDS = 3
# --quick: enough to exercise every path (two Apply batches, one List) in a couple of seconds.
QUICK_JOURNALS = 200
QUICK_ROUNDS = 1


def journal(i: int, tag: str) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=f"bench/{tag}/part-{i:05d}", replication=3)
    spec.labels.labels.add(name="app.gazette.dev/message-type", value="bench.Message")
    spec.labels.labels.add(name="content-type", value="application/x-ndjson")
    spec.fragment.length = 1 << 28
    spec.fragment.compression_codec = pb.SNAPPY
    spec.fragment.stores.append("s3://bucket/fragments/?region=us-east-1")
    spec.fragment.refresh_interval.seconds = 60
    spec.fragment.retention.seconds = 720 * 3600
    spec.fragment.flush_interval.seconds = 600
    return spec


async def measure(etcd: EtcdServer, journals: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"apply": [], "apply_base": [], "list": [], "list_base": []}
    root = "/bench"
    # Spec management alone: no allocator, so the journals are not made live (allocator_round
    # and the append benchmarks measure that side).
    async with BrokerHarness(etcd.endpoint, root, watch_delay=0.03, run_allocator=False) as harness:
        client = harness.client()
        raw = etcdx.connect(etcd.endpoint)
        try:
            for r in range(rounds):
                specs = [journal(i, f"broker-{r}") for i in range(journals)]
                t = time.perf_counter()
                for start in range(0, journals, BATCH):
                    changes = [
                        pb.ApplyRequest.Change(upsert=s) for s in specs[start : start + BATCH]
                    ]
                    await client.apply(changes)
                out["apply"].append(time.perf_counter() - t)

                specs = [journal(i, f"direct-{r}") for i in range(journals)]
                t = time.perf_counter()
                for start in range(0, journals, BATCH):
                    compare, ops = [], []
                    for s in specs[start : start + BATCH]:
                        key = aks.item_key(root, s.name).encode()
                        compare.append(transactions.Mod(key) == 0)
                        ops.append(transactions.Put(key, s.SerializeToString()))
                    result = await etcdx.txn(raw, compare, ops)
                    assert result.succeeded
                out["apply_base"].append(time.perf_counter() - t)
                # The broker learns of direct writes through its watch; let it catch up.
                await harness.broker.ks.wait_for_revision(result.revision)

            total = rounds * journals * 2
            for _ in range(rounds):
                t = time.perf_counter()
                listed = await client.list()
                out["list"].append(time.perf_counter() - t)
                assert len(listed.journals) == total

                t = time.perf_counter()
                got = await raw.get_prefix(f"{root}{aks.ITEMS}".encode())
                decoded = [pb.JournalSpec.FromString(kv.value) for kv in got]
                out["list_base"].append(time.perf_counter() - t)
                assert len(decoded) == total
        finally:
            await client.close()
            await raw.close()
    return out


def run(quick: bool = False) -> dict[str, Any]:
    journals, rounds = (QUICK_JOURNALS, QUICK_ROUNDS) if quick else (JOURNALS, ROUNDS)
    with EtcdServer() as etcd:
        out = asyncio.run(measure(etcd, journals, rounds))
    apply_, apply_base = statistics.median(out["apply"]), statistics.median(out["apply_base"])
    list_, list_base = statistics.median(out["list"]), statistics.median(out["list_base"])
    listed = rounds * journals * 2
    return {
        "value": journals / apply_,
        "unit": "specs/s",
        "baseline": journals / apply_base,
        "ratio": apply_base / apply_,
        "list": listed / list_,
        "list_baseline": listed / list_base,
        "list_ratio": list_base / list_,
        "journals_applied": journals,
        "journals_listed": listed,
        "rounds": rounds,
    }
