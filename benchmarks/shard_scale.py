"""shard_scale: what many idle shards cost three consumer processes.

For each size N (100, 1,000 and 5,000 shards; `--quick`: 50; `SHARD_SCALE_SIZES=100,1000`
picks others), on a fresh etcd: three `gazette serve` processes (`--broker.limit` raised to
hold every journal) and N source journals at replication 1, one a shard, placed before the
consumers start; then three consumer processes of a counting application
(`python -m consumer serve --app benchmarks._scale_app:Counter`: a JSON-file store a shard,
the least an application keeps; `--consumer.limit` raised to N, as an operator would, and
`--etcd.lease 20s`, the default), and N shard specs (no hot standbys) applied through one of
them in Apply requests of 100. Nothing is appended. Measured:

- **apply_s**: the Apply requests, end to end;
- **assigned_s**: from the first Apply until every shard has its primary assignment in etcd (the
  allocator's work), and **primary_s**: until every primary assignment says PRIMARY (its store
  restored, its sources' specs read, its reads started), both read from etcd every n/2000 s
  (at least 0.5 s);
- **rss_mib**: resident memory of the largest consumer process SETTLE (60) seconds after that, and
  **kib_per_shard**: its growth over the same process before the Apply (`idle_rss_mib`), per
  shard it hosts, the mean over the three;
- **cpu_idle**: CPU seconds of the busiest consumer process over the next 10 s (nothing to
  read), and **broker_cpu_idle** of the busiest broker over the same window;
- **list_s**: the wall time of `gazctl shards list` (the real CLI, a subprocess: its start-up,
  the List of every shard, the table), median of three, and **list_rpc_ms**: the List RPC
  alone, from this process (median of three).

`value` is KiB per shard at the largest size that completed, `baseline` at the smallest, and
`ratio` their quotient (1: the per-shard cost is flat). Every figure of every size is reported
as `n{N}_{figure}`, with the load average when it was measured (`n{N}_load`). A size that does
not settle within its budget (120 s + 0.1 s a shard) is reported as `n{N}_error`, with how many
shards were PRIMARY by then (`n{N}_primary_at_timeout`). CPU is utime + stime from
/proc/<pid>/stat, RSS VmRSS from /proc/<pid>/status.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aetcd

from benchmarks._cluster import PREFIX, BrokerProcess, start_broker, stop_brokers, wait_ready
from benchmarks._proc import cpu_seconds, rss_bytes
from benchmarks._sizes import Partial, each_size, sizes
from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from consumer.client import ShardsClient
from consumer.protocol import cpb
from consumer.testing.processes import ConsumerProcesses
from plumbing import etcd as etcdx

SIZES = (100, 1_000, 5_000)
QUICK_SIZES = (50,)
BROKERS = 3
CONSUMERS = 3
BATCH = 100
# Not under the brokers' /bench: a keyspace watches its root as a string prefix, and brokers
# would decode (and log) every shard key as theirs.
ROOT = "/scale-consumers"
APP = "benchmarks._scale_app:Counter"
# After every shard is PRIMARY, before memory and CPU are read: PRIMARY is advertised once the
# store is restored, before the shard's reads start, and at 5,000 shards the last reads started
# 45-60 s after the last PRIMARY here (a 20 s settle measured that tail, 0.4-3 CPU-s in 10 s,
# not an idle process).
SETTLE = 60.0
IDLE_WINDOW = 10.0
QUICK_SETTLE = 2.0
QUICK_WINDOW = 2.0
IDLE_SETTLE = 5.0  # After the consumers start, before their idle memory is read.


def mib(pid: int) -> float:
    return rss_bytes(pid) / (1 << 20)


def journal_spec(i: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=f"scale/source-{i:05d}", replication=1)
    spec.labels.labels.add(name="content-type", value="application/x-ndjson")
    spec.fragment.length = 1 << 28
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


def shard_spec(i: int) -> cpb.ShardSpec:
    spec = cpb.ShardSpec(
        id=f"scale-{i:05d}", sources=[cpb.ShardSpec.Source(journal=journal_spec(i).name)]
    )
    spec.max_txn_duration.FromSeconds(1)
    return spec


async def _journals_placed(etcd: Any, n: int) -> bool:
    kvs = await etcd.get_prefix(f"{PREFIX}/assign/".encode())
    return sum(1 for kv in kvs if kv.key.endswith(b"#0")) == n


async def _primaries(etcd: Any) -> tuple[int, dict[str, int], list[str]]:
    """Shards with a primary assignment, every primary assignment's status by name, and the
    errors of those FAILED."""
    kvs = await etcd.get_prefix(f"{ROOT}/assign/".encode())
    assigned = 0
    codes: dict[str, int] = {}
    errors: list[str] = []
    for kv in kvs:
        if not kv.key.endswith(b"#0"):
            continue
        assigned += 1
        status = cpb.ReplicaStatus.FromString(kv.value)
        name = cpb.ReplicaStatus.Code.Name(status.code)
        codes[name] = codes.get(name, 0) + 1
        errors += status.errors
    return assigned, codes, errors


async def _held(etcd: Any, consumer_id: str) -> int:
    kvs = await etcd.get_prefix(f"{ROOT}/assign/".encode())
    return sum(1 for kv in kvs if f"#{consumer_id}#".encode() in kv.key)


def gazctl_list(address: str) -> tuple[float, int]:
    """`gazctl shards list` against `address`: its wall time and the lines it printed."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gazctl.cli", "shards", "list", "--consumer.address", address],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"gazctl shards list exited {done.returncode}: {done.stderr[-2000:]}")
    return elapsed, done.stdout.count("\n")


async def measure(n: int, quick: bool) -> dict[str, Any]:
    """One size on a fresh etcd, brokers and consumers."""
    settle = QUICK_SETTLE if quick else float(os.environ.get("SHARD_SCALE_SETTLE", SETTLE))
    window = QUICK_WINDOW if quick else IDLE_WINDOW
    out: dict[str, Any] = {}
    brokers: list[BrokerProcess] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-shards-") as tmp:
        root = Path(tmp)
        consumers: ConsumerProcesses | None = None
        host, port = etcdx.parse_etcd_address(etcd.endpoint)
        raw = aetcd.Client(
            host=host, port=port, options={"grpc.max_receive_message_length": 256 << 20}
        )
        try:
            limit = ["--broker.limit", str(n + n // 10 + 16)]
            for i in range(BROKERS):
                log = root / f"broker-{i}.log"
                brokers.append(start_broker(etcd, f"broker-{i}", log, extra=limit))
            await wait_ready(brokers)
            consumers = ConsumerProcesses(
                [sys.executable, "-m", "consumer"],
                ["--app", APP, "--consumer.limit", str(n + n // 10 + 16), "--log.level", "warn"],
                etcd, brokers[0], ROOT, root / "consumers",
            )  # fmt: skip
            consumers.env = {"CONSUMER_STORE_ROOT": str(root / "stores")}
            async with JournalsClient(brokers[0].address, timeout=120) as client:
                await client.apply(
                    [pb.ApplyRequest.Change(upsert=journal_spec(i)) for i in range(n)],
                    max_txn_size=BATCH,
                )
            await _until(lambda: _journals_placed(raw, n), 120 + n * 0.05, "journals not placed")

            ids = [f"consumer-{i}" for i in range(CONSUMERS)]
            for consumer_id in ids:
                consumers.start(consumer_id, wait=False, lease="20s")
            for consumer_id in ids:
                consumers.wait_ready(consumer_id, timeout=60)
            await asyncio.sleep(settle if quick else IDLE_SETTLE)
            pids = [consumers.procs[i].pid for i in ids]
            idle = [mib(p) for p in pids]

            address = consumers.address(ids[0])
            async with ShardsClient(address, timeout=120) as shards:
                started = time.perf_counter()
                await shards.apply(
                    [cpb.ApplyRequest.Change(upsert=shard_spec(i)) for i in range(n)],
                    max_txn_size=BATCH,
                )
                out["apply_s"] = time.perf_counter() - started
                budget = 120 + n * 0.1
                every = max(0.5, n / 2000)
                deadline = started + budget
                assigned_s: float | None = None
                while True:
                    for consumer_id in ids:
                        proc = consumers.procs[consumer_id]
                        if proc.poll() is not None:
                            raise RuntimeError(
                                f"{consumer_id} exited {proc.returncode}: "
                                + consumers.log(consumer_id)[-2000:]
                            )
                    assigned, codes, errors = await _primaries(raw)
                    primary, failed = codes.get("PRIMARY", 0), codes.get("FAILED", 0)
                    now = time.perf_counter()
                    if assigned_s is None and assigned == n:
                        assigned_s = out["assigned_s"] = now - started
                    if primary == n:
                        out["primary_s"] = now - started
                        break
                    # A FAILED shard stays so (until `gazctl shards unassign`): once every
                    # shard is PRIMARY or FAILED, waiting longer cannot help.
                    if now > deadline or (failed and primary + failed == n):
                        out["primary_at_timeout"] = primary
                        out["failed"] = failed
                        out["assigned_at_timeout"] = assigned
                        first = f"; first error: {errors[0]}" if errors else ""
                        raise TimeoutError(
                            f"{primary} of {n} shards PRIMARY after {now - started:.0f} s "
                            f"({assigned} assigned; primaries' statuses {codes}){first}"
                        )
                    await asyncio.sleep(every)
                await asyncio.sleep(settle)

                held = [await _held(raw, i) for i in ids]
                out["load"] = os.getloadavg()[0]
                settled = [mib(p) for p in pids]
                broker_pids = [b.proc.pid for b in brokers]
                before = [cpu_seconds(p) for p in pids + broker_pids]
                await asyncio.sleep(window)
                after = [cpu_seconds(p) for p in pids + broker_pids]
                cpu = [a - b for a, b in zip(after, before, strict=True)]
                rpcs = []
                for _ in range(3):
                    t = time.perf_counter()
                    listed = await shards.list()
                    rpcs.append(time.perf_counter() - t)
                    if len(listed.shards) != n:
                        raise RuntimeError(f"List answered {len(listed.shards)} of {n} shards")
            lists = []
            for _ in range(3):
                elapsed, lines = await asyncio.to_thread(gazctl_list, address)
                if lines < n:
                    raise RuntimeError(f"gazctl shards list printed {lines} lines for {n} shards")
                lists.append(elapsed)
        except TimeoutError as exc:
            out["load"] = os.getloadavg()[0]
            raise Partial(str(exc), out) from None
        finally:
            if consumers is not None:
                consumers.stop_all()
            stop_brokers(brokers)
            keep = os.environ.get("SHARD_SCALE_LOGS")
            if keep:  # The processes' logs, for a size that went wrong.
                shutil.copytree(root, Path(keep) / f"n{n}", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("stores", "tmp"))  # fmt: skip
            await raw.close()
    per_shard = [(s - i) * 1024 / h for s, i, h in zip(settled, idle, held, strict=True) if h]
    out.update(
        idle_rss_mib=statistics.mean(idle),
        rss_mib=max(settled),
        shards_per_consumer=max(held),
        kib_per_shard=statistics.mean(per_shard),
        cpu_idle=max(cpu[:CONSUMERS]),
        broker_cpu_idle=max(cpu[CONSUMERS:]),
        window_s=window,
        list_s=statistics.median(lists),
        list_rpc_ms=statistics.median(rpcs) * 1000,
    )
    return out


async def _until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s")
        await asyncio.sleep(0.5)


def run(quick: bool = False) -> dict[str, Any]:
    ns = sizes("SHARD_SCALE_SIZES", SIZES, QUICK_SIZES, quick)
    results, failed = each_size(measure, ns, quick)
    first, last = results[min(results)], results[max(results)]
    out: dict[str, Any] = {
        "value": last["kib_per_shard"],
        "unit": "KiB/shard",
        "baseline": first["kib_per_shard"],
        "ratio": last["kib_per_shard"] / first["kib_per_shard"],
        "shards": max(results),
    }
    out.update(failed)
    for n, figures in results.items():
        for key, value in figures.items():
            out[f"n{n}_{key}"] = value
    return out


if __name__ == "__main__":
    print(run())
