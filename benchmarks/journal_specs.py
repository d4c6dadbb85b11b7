"""Journal spec management at scale: Apply and List of many journals through a broker, against
the same etcd operations issued directly (the floor any broker could reach).

- apply: N specs in transactions of 100 changes, through `Apply`, vs direct etcd transactions
  putting the same encoded specs with the same revision compares.
- list: a full listing of N journals through `List` (server-streamed in chunks of 25) vs a
  direct etcd range read of the same keys (decoding included on both sides).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from aetcd import transactions

from broker import etcd as etcdx
from broker.allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer

JOURNALS = 2000
BATCH = 100
ROUNDS = 3


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


async def run(etcd: EtcdServer) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"apply": [], "apply_base": [], "list": [], "list_base": []}
    root = "/bench"
    async with BrokerHarness(etcd.endpoint, root, watch_delay=0.03) as harness:
        client = harness.client()
        raw = etcdx.connect(etcd.endpoint)
        try:
            for r in range(ROUNDS):
                specs = [journal(i, f"broker-{r}") for i in range(JOURNALS)]
                t = time.perf_counter()
                for start in range(0, JOURNALS, BATCH):
                    changes = [
                        pb.ApplyRequest.Change(upsert=s) for s in specs[start : start + BATCH]
                    ]
                    await client.apply(changes)
                out["apply"].append(time.perf_counter() - t)

                specs = [journal(i, f"direct-{r}") for i in range(JOURNALS)]
                t = time.perf_counter()
                for start in range(0, JOURNALS, BATCH):
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

            total = ROUNDS * JOURNALS * 2
            for _ in range(ROUNDS):
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


def main() -> None:
    with EtcdServer() as etcd:
        out = asyncio.run(run(etcd))
    apply_, apply_base = statistics.median(out["apply"]), statistics.median(out["apply_base"])
    list_, list_base = statistics.median(out["list"]), statistics.median(out["list_base"])
    listed = ROUNDS * JOURNALS * 2
    print(f"journal-specs: {JOURNALS} specs per round, {BATCH} per transaction, median of {ROUNDS}")
    print(
        f"  apply  broker {JOURNALS / apply_:9.0f} specs/s   direct etcd {JOURNALS / apply_base:9.0f} specs/s"
        f"   ratio {apply_base / apply_:.2f}"
    )
    print(
        f"  list   broker {listed / list_:9.0f} specs/s   direct etcd {listed / list_base:9.0f} specs/s"
        f"   ratio {list_base / list_:.2f}   ({listed} journals)"
    )


if __name__ == "__main__":
    main()
