"""journal_scale: what many idle journals cost three brokers (issue 26, "Scale").

For each size N (1,000, 10,000 and 50,000 journals; `--quick`: 200), on a fresh etcd and three
fresh `gazette serve` processes started with `--broker.limit` raised to hold every replica (as an
operator would: the default is 1,024 journals a broker), N journals at replication 3 are applied
through one broker in Apply requests of 100, then:

- **apply_s**: the Apply requests, end to end;
- **placed_s**: from the first Apply until every journal has three assignments in etcd, a
  primary among them (the allocator's work; read from etcd every n/2000 s, at least 0.5 s);
- **consistent_s**: until every journal's assignments in etcd advertise the route the primary
  synchronized on (its first pulse ran: the journal takes appends without a resync);
- **cpu_short** and **cpu_long**: CPU seconds of the busiest broker over 10 s and over one pulse
  interval (a minute: a primary pulses each journal about once a minute, so a shorter window may
  miss them), from SETTLE seconds after every journal is consistent; **etcd_writes_idle**: etcd
  revisions over that minute (0 when the cluster is idle);
- **rss_mib**: resident memory of the largest broker at the end of that minute (and
  `settled_rss_mib` at its start), and **kib_per_replica** (`settled_kib_per_replica`): the
  growth over the same broker before the Apply (an idle broker with no journals,
  `idle_rss_mib`), per replica it holds;
- **list_ms**: a full List of the N journals through one broker (median of three).

The baseline is the smallest size's cost per journal: `value` is KiB per replica at the largest
size, `baseline` at the smallest, `ratio` their quotient (1: the per-journal cost is flat). Every
figure of every size is reported as `n{N}_{figure}`. `JOURNAL_SCALE_SIZES=1000,10000` overrides the
sizes (a full run of 50,000 takes a long while). CPU is utime + stime from /proc/<pid>/stat, RSS
VmRSS from /proc/<pid>/status; the load average when each size was measured is `n{N}_load`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aetcd

from benchmarks._cluster import (
    PREFIX,
    BrokerProcess,
    advertised,
    start_broker,
    stop_brokers,
    wait_ready,
)
from benchmarks._proc import cpu_seconds, rss_bytes
from benchmarks._sizes import each_size, sizes
from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from plumbing import etcd as etcdx

SIZES = (1_000, 10_000, 50_000)
QUICK_SIZES = (200,)
BROKERS = 3
REPLICATION = 3
BATCH = 100
PULSE_INTERVAL = 60.0  # --broker.pulse-interval's default.
SETTLE = 20.0  # After every journal is consistent, before memory and CPU are read.
QUICK_SETTLE = 2.0
QUICK_WINDOWS = (2.0, 4.0)


def rss_mib(pid: int) -> float:
    return rss_bytes(pid) / (1 << 20)


def load_average() -> float:
    return os.getloadavg()[0]


def spec(i: int) -> pb.JournalSpec:
    out = pb.JournalSpec(name=f"scale/part-{i:06d}", replication=REPLICATION)
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    out.fragment.length = 1 << 28
    out.fragment.compression_codec = pb.NONE
    out.fragment.refresh_interval.seconds = 60
    return out


async def _assignments(etcd: Any) -> dict[str, list[tuple[int, bytes]]]:
    """Each journal's assignments in etcd: (slot, value) of each."""
    kvs = await etcd.get_prefix(f"{PREFIX}/assign/".encode())
    by_journal: dict[str, list[tuple[int, bytes]]] = {}
    for kv in kvs:
        journal, _, _, slot = kv.key.decode().split("/assign/", 1)[1].split("#")
        by_journal.setdefault(journal, []).append((int(slot), kv.value))
    return by_journal


async def _all_placed(etcd: Any, n: int) -> bool:
    """Every journal has REPLICATION assignments, a primary (slot 0) among them. Read from etcd,
    not through a List: a List of 10,000 journals each half second loads the broker it asks."""
    placed = sum(
        1
        for slots in (await _assignments(etcd)).values()
        if len(slots) == REPLICATION and any(slot == 0 for slot, _ in slots)
    )
    return placed == n


async def _all_consistent(etcd: Any, n: int) -> bool:
    by_journal = await _assignments(etcd)
    if len(by_journal) < n:
        return False
    return all(
        (route := advertised([value for _, value in slots])) is not None
        and len(route.members) == REPLICATION
        for slots in by_journal.values()
    )


async def _wait(check: Any, timeout: float, what: str, every: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        await asyncio.sleep(every)


async def measure(n: int, quick: bool) -> dict[str, Any]:
    """One size on a fresh cluster."""
    settle = QUICK_SETTLE if quick else SETTLE
    short, long_ = QUICK_WINDOWS if quick else (10.0, PULSE_INTERVAL)
    out: dict[str, Any] = {}
    brokers: list[BrokerProcess] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-scale-") as tmp:
        # Room for every replica on every broker, plus a little, as an operator would.
        limit = ["--broker.limit", str(n + n // 10 + 16)]
        try:
            for i in range(BROKERS):
                # JOURNAL_SCALE_LOGS=DIR keeps the brokers' logs (to see why a size failed).
                logs = Path(os.environ.get("JOURNAL_SCALE_LOGS") or tmp)
                logs.mkdir(parents=True, exist_ok=True)
                log = logs / f"broker-{i}-{n}.log"
                brokers.append(start_broker(etcd, f"broker-{i}", log, extra=limit))
            await wait_ready(brokers)
            await asyncio.sleep(settle)
            pids = [b.proc.pid for b in brokers]
            idle = [rss_mib(p) for p in pids]
            # Every assignment, in one range read: past gRPC's default 4 MiB at 10,000 journals.
            host, port = etcdx.parse_etcd_address(etcd.endpoint)
            raw = aetcd.Client(
                host=host, port=port, options={"grpc.max_receive_message_length": 256 << 20}
            )
            try:
                async with JournalsClient(brokers[0].address, timeout=120) as client:
                    changes = [pb.ApplyRequest.Change(upsert=spec(i)) for i in range(n)]
                    started = time.perf_counter()
                    await client.apply(changes, max_txn_size=BATCH)
                    out["apply_s"] = time.perf_counter() - started
                    budget = 120 + n * 0.05
                    every = max(0.5, n / 2000)  # Each check reads every assignment.
                    await _wait(lambda: _all_placed(raw, n), budget, "not placed", every)
                    out["placed_s"] = time.perf_counter() - started
                    await _wait(lambda: _all_consistent(raw, n), budget, "not consistent", every)
                    out["consistent_s"] = time.perf_counter() - started
                    await asyncio.sleep(settle)

                    kvs = await raw.get_prefix(f"{PREFIX}/assign/".encode())
                    held = [
                        sum(1 for kv in kvs if f"#broker-{i}#".encode() in kv.key)
                        for i in range(BROKERS)
                    ]
                    settled = [rss_mib(p) for p in pids]
                    out["load"] = load_average()
                    revision = (await etcdx.get_current(raw, [b"/"]))[1]
                    before = [cpu_seconds(p) for p in pids]
                    await asyncio.sleep(short)
                    mid = [cpu_seconds(p) for p in pids]
                    await asyncio.sleep(long_ - short)
                    after = [cpu_seconds(p) for p in pids]
                    out["etcd_writes_idle"] = (await etcdx.get_current(raw, [b"/"]))[1] - revision
                    rss = [rss_mib(p) for p in pids]
                    lists = []
                    for _ in range(3):
                        t = time.perf_counter()
                        listing = await client.list()
                        lists.append(time.perf_counter() - t)
                        assert len(listing.journals) == n
            finally:
                await raw.close()
        finally:
            stop_brokers(brokers)
    per_replica = [(r - i) * 1024 / h for r, i, h in zip(rss, idle, held, strict=True) if h]
    settled_per_replica = [
        (r - i) * 1024 / h for r, i, h in zip(settled, idle, held, strict=True) if h
    ]
    out.update(
        idle_rss_mib=statistics.mean(idle),
        settled_rss_mib=max(settled),
        settled_kib_per_replica=statistics.mean(settled_per_replica),
        rss_mib=max(rss),
        replicas_per_broker=max(held),
        kib_per_replica=statistics.mean(per_replica),
        cpu_short=max(m - b for m, b in zip(mid, before, strict=True)),
        cpu_long=max(a - b for a, b in zip(after, before, strict=True)),
        short_window_s=short,
        long_window_s=long_,
        list_ms=statistics.median(lists) * 1000,
    )
    return out


def run(quick: bool = False) -> dict[str, Any]:
    ns = sizes("JOURNAL_SCALE_SIZES", SIZES, QUICK_SIZES, quick)
    results, failed = each_size(measure, ns, quick)
    first, last = results[min(results)], results[max(results)]
    out: dict[str, Any] = {
        "value": last["kib_per_replica"],
        "unit": "KiB/replica",
        "baseline": first["kib_per_replica"],
        "ratio": last["kib_per_replica"] / first["kib_per_replica"],
    }
    out.update(failed)
    smallest = min(results)
    for n, figures in results.items():
        for key, value in figures.items():
            out[f"n{n}_{key}"] = value
        if n != smallest:
            # Cost per journal against the smallest size's (1: flat).
            for key in ("apply_s", "placed_s", "consistent_s", "list_ms"):
                out[f"n{n}_{key}_per_journal_ratio"] = (figures[key] / n) / (
                    results[smallest][key] / smallest
                )
    return out
