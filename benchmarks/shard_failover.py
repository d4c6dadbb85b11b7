"""shard_failover: SIGKILL the process hosting a shard's primary; seconds until the shard is
PRIMARY elsewhere and its next transaction has committed (Stat, through the survivor, reports the
source read past what was written before the kill), beside the consumer's etcd lease TTL.

One `gazette serve`, two stream-sum summer processes (`--etcd.lease`, one shard with a hot
standby on a chunk journal), chunks written before each kill. Baseline in the same run: kill ->
the lease's expiry (the victim's member key deleted, seen by an etcd watch), the floor that no
process can beat. Each of `kills` rounds kills the current primary and starts it again after."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aetcd

from benchmarks._cluster import start_broker, stop_brokers, wait_ready
from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.client.reader import write_head
from broker.testing import EtcdServer, free_port, stop_process
from consumer.client import ShardsClient
from consumer.examples.stream_sum import chunk_journal
from consumer.protocol import cpb
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher
from message.types import DictMessages

EXAMPLE = [sys.executable, "-m", "consumer.examples.stream_sum"]
# Not under the brokers' /bench (as shard_scale's): a keyspace watches its root as a string
# prefix, and the brokers would see (and decode) every consumer key as theirs.
PREFIX = "/bench-consumers"
SHARD = "stream-sum-000"


def _start_summer(
    summer_id: str, port: int, etcd: EtcdServer, broker: str, lease: int, root: Path
) -> subprocess.Popen[bytes]:
    (root / "tmp").mkdir(exist_ok=True)  # Its replicas' directories, removed with the run's.
    with open(root / f"{summer_id}.log", "ab") as out:
        return subprocess.Popen(
            [
                *EXAMPLE, "serve", "--consumer.id", summer_id, "--consumer.port", str(port),
                "--broker.address", broker, "--etcd.address", etcd.endpoint,
                "--etcd.prefix", PREFIX, "--etcd.lease", f"{lease}s", "--log.level", "warn",
                "--summer.store-root", str(root / "stores"),
            ],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(root / "tmp")},
        )  # fmt: skip


async def _primary(address: str) -> tuple[str, int] | None:
    async with ShardsClient(address, timeout=2) as client:
        listed = await client.list()
    for shard in listed.shards:
        route = shard.route
        if shard.spec.id == SHARD and route.primary != -1:
            status = shard.status[route.primary].code
            if status == cpb.ReplicaStatus.PRIMARY:
                return route.members[route.primary].suffix, route.primary
    return None


async def _publish(broker: str, count: int, base: int) -> None:
    async with JournalsClient(broker) as client, AppendService(client.stub) as service:
        publisher = Publisher(service, DictMessages(), JSONLines())
        for i in range(count):
            await publisher.publish_committed(
                lambda _m: Partition(chunk_journal(0), "application/x-ndjson"),
                {"stream": f"s-{base}-{i}", "seq": 1, "value": i, "last": False},
            )
        await service.flush()


async def measure(kills: int, lease: int, store: str = "json") -> dict[str, Any]:
    times: list[float] = []
    expiries: list[float] = []
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        root = Path(tmp)
        (root / "stores").mkdir()
        broker = start_broker(etcd, "broker-0", root / "broker.log")
        summers: dict[str, subprocess.Popen[bytes]] = {}
        ports = {f"summer-{i}": free_port() for i in range(2)}
        try:
            await wait_ready([broker])
            for summer_id, port in ports.items():
                summers[summer_id] = _start_summer(
                    summer_id, port, etcd, broker.address, lease, root
                )
            addresses = {s: f"http://127.0.0.1:{p}" for s, p in ports.items()}
            await _until_answers(addresses.values())
            setup = subprocess.run(
                [*EXAMPLE, "setup", "--partitions", "1", "--broker.address", broker.address,
                 "--consumer.address", addresses["summer-0"], "--store", store],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if setup.returncode != 0:
                raise RuntimeError(f"stream-sum setup failed: {setup.stderr}")
            etcd_client = aetcd.Client(host=etcd.host, port=etcd.client_port)
            await etcd_client.connect()
            for round_ in range(kills):
                primary = await _wait_primary(addresses.values())
                survivor = next(s for s in ports if s != primary)
                await _publish(broker.address, 200, round_)
                async with JournalsClient(broker.address) as client:
                    head = await write_head(client.stub, chunk_journal(0))
                member = f"{PREFIX}/members/local#{primary}".encode()
                killed = time.monotonic()
                os.kill(summers[primary].pid, signal.SIGKILL)
                summers[primary].wait()
                expiry = asyncio.ensure_future(_expired(etcd_client, member))
                await _stat_through(addresses[survivor], head)
                times.append(time.monotonic() - killed)
                expiries.append(await expiry - killed)
                summers[primary] = _start_summer(
                    primary, ports[primary], etcd, broker.address, lease, root
                )
                await _until_answers([addresses[primary]])
            await etcd_client.close()
        finally:
            for proc in summers.values():
                stop_process(proc)
            stop_brokers([broker])
    return {"times": times, "expiries": expiries}


async def _stat_through(address: str, head: int, timeout: float = 120) -> None:
    """Until Stat answers OK with the source read through `head` (retrying while the shard has
    no primary, or its route still names the killed process)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with ShardsClient(address, timeout=10) as client:
                stat = await client.stat(SHARD, {chunk_journal(0): head})
            if stat.status == cpb.OK:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the shard did not come back")
        await asyncio.sleep(0.02)


async def _expired(client: aetcd.Client, key: bytes) -> float:
    """When the key is gone (polled every 10 ms): the victim's lease expired."""
    while await client.get(key) is not None:
        await asyncio.sleep(0.01)
    return time.monotonic()


async def _until_answers(addresses: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for address in addresses:
        while True:
            try:
                async with ShardsClient(address, timeout=1) as client:
                    await client.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def _wait_primary(addresses: Any, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for address in addresses:
            try:
                found = await _primary(address)
            except Exception:
                continue
            if found is not None:
                return found[0]
        await asyncio.sleep(0.05)
    raise TimeoutError("the shard has no PRIMARY")


def run(quick: bool = False, kills: int | None = None, lease: int = 5) -> dict[str, Any]:
    kills = kills if kills is not None else (1 if quick else 3)
    lease = 2 if quick else lease
    return summary(asyncio.run(measure(kills, lease)), lease, kills)


def summary(result: dict[str, list[float]], lease: int, kills: int) -> dict[str, Any]:
    """The median time back (value), beside the median lease expiry of the same kills
    (baseline, the floor: each take-over comes after its own expiry)."""
    times = sorted(result["times"])
    expiries = sorted(result["expiries"])
    median = times[len(times) // 2]
    baseline = expiries[len(expiries) // 2]
    return {
        "value": round(median, 2),
        "unit": "s",
        "baseline": round(baseline, 2),
        "ratio": round(median / baseline, 2) if baseline else None,
        "max": round(times[-1], 2),
        "lease_ttl": lease,
        "kills": kills,
        "each": [round(t, 2) for t in result["times"]],
    }


if __name__ == "__main__":
    print(run())
