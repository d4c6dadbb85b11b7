"""idle_tails: CPU seconds a broker process spends in 10 s serving 100 tailing readers (blocking
reads at the write head) while nothing is appended, before and after a route change (the
journal's replication raised from 1 to 3); baseline: the same broker over the same window with
no readers at all. Target: tails cost next to nothing either way (issue 12, defect 1).

Three `gazette serve` processes, one journal placed at replication 1; the tails read from its
one replica (the primary, which stays primary when the route grows). CPU is utime + stime of
the broker's process from /proc/<pid>/stat, all of its threads included.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster import (
    PREFIX,
    BrokerProcess,
    advertised,
    placed,
    start_broker,
    stop_brokers,
    wait_ready,
)
from benchmarks._proc import cpu_seconds
from broker.client.appender import AppendError, append
from broker.client.dialer import Dialer
from broker.client.reader import read
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from plumbing import etcd as etcdx

JOURNAL = "bench/tails"
BROKERS = 3
# Tails cost "next to nothing": at most this many CPU seconds per 10 s above the idle broker
# (1% of a core).
TARGET_EXCESS = 0.1


async def cpu_over(pids: list[int], window: float) -> list[float]:
    """CPU seconds each of `pids` spends over the next `window` seconds."""
    before = [cpu_seconds(p) for p in pids]
    await asyncio.sleep(window)
    return [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]


def _spec(replication: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=JOURNAL, replication=replication)
    spec.fragment.length = 1 << 30
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


async def _consistent(etcd: Any, members: int) -> bool:
    """The journal's `members` assignments all advertise their route (consistency)."""
    kvs = await etcd.get_prefix(f"{PREFIX}/assign/{JOURNAL}#".encode())
    route = advertised([kv.value for kv in kvs])
    return route is not None and len(route.members) == members


async def _writable(stub: pb_grpc.JournalStub, content: bytes) -> int:
    """Append `content` once the pipeline takes it (it may still be synchronizing); the write
    head after it."""
    async with asyncio.timeout(30):
        while True:
            try:
                return int((await append(stub, JOURNAL, content)).commit.end)
            except AppendError:
                await asyncio.sleep(0.05)


class Tails:
    """`count` blocking reads from `offset` (the write head) through one broker, each recording
    what it receives; `delivered(content)` is true once every tail has received `content`."""

    def __init__(self, stub: pb_grpc.JournalStub, count: int, offset: int) -> None:
        self.stub = stub
        self.offset = offset
        self.received: list[bytearray] = [bytearray() for _ in range(count)]
        self.tasks = [asyncio.ensure_future(self._tail(r)) for r in self.received]

    async def _tail(self, into: bytearray) -> None:
        # From a known offset, not -1: a read the broker takes only after the next append
        # would start past it, and never see it.
        async for chunk in read(self.stub, JOURNAL, self.offset, block=True):
            into += chunk.content

    def delivered(self, content: bytes) -> bool:
        for task in self.tasks:
            if task.done():
                task.result()  # A tail that ended: its error, or this one.
                raise RuntimeError("a tailing read ended while nothing was appended")
        return all(r.endswith(content) for r in self.received)

    async def until_delivered(self, content: bytes, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while not self.delivered(content):
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def measure(readers: int, window: float) -> dict[str, Any]:
    brokers: list[BrokerProcess] = []
    with EtcdServer() as etcd_server, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        dialer = Dialer()
        etcd = etcdx.connect(etcd_server.endpoint)
        tails: Tails | None = None
        try:
            await etcd.connect()
            for i in range(BROKERS):
                log = Path(tmp) / f"broker-{i}.log"
                brokers.append(start_broker(etcd_server, f"broker-{i}", log))
            await wait_ready(brokers)
            route = await placed(brokers[0].address, _spec(1))
            primary = next(b for b in brokers if b.address == route.endpoints[route.primary])
            others = [b.proc.pid for b in brokers if b is not primary]
            stub = dialer.journal_stub(primary.address)
            head = await _writable(stub, b"first\n")
            settle = min(1.0, window)
            await asyncio.sleep(settle)

            # The same broker, idle: no readers, nothing appended.
            idle_1 = await cpu_over([primary.proc.pid], window)

            tails = Tails(stub, readers, head)
            await _writable(stub, b"tails-ready\n")
            # Every tail has read it, and blocks at the head.
            await tails.until_delivered(b"tails-ready\n")
            await asyncio.sleep(settle)
            before, *others_before = await cpu_over([primary.proc.pid, *others], window)

            started = time.monotonic()
            route = await placed(primary.address, _spec(3), update=True)
            if route.endpoints[route.primary] != primary.address:
                raise RuntimeError("the primary moved when the route grew; the tails are elsewhere")
            async with asyncio.timeout(30):
                while not await _consistent(etcd, 3):
                    await asyncio.sleep(0.05)
            route_change_s = time.monotonic() - started
            await asyncio.sleep(settle)
            after, *others_after = await cpu_over([primary.proc.pid, *others], window)

            # The tails still deliver after the route change.
            await _writable(stub, b"after-route-change\n")
            await tails.until_delivered(b"after-route-change\n")
            await tails.close()
            tails = None
            await asyncio.sleep(settle)
            idle_3 = await cpu_over([primary.proc.pid], window)
        finally:
            if tails is not None:
                await tails.close()
            with contextlib.suppress(Exception):
                await etcd.close()
            await dialer.close()
            stop_brokers(brokers)
    return {
        "after": after,
        "idle_3": idle_3[0],
        "before": before,
        "idle_1": idle_1[0],
        "others_before": sum(others_before),
        "others_after": sum(others_after),
        "route_change_s": route_change_s,
    }


def run(quick: bool = False) -> dict[str, Any]:
    readers, window = (10, 1.0) if quick else (100, 10.0)
    m = asyncio.run(measure(readers, window))
    after, idle_3, before, idle_1 = m["after"], m["idle_3"], m["before"], m["idle_1"]
    return {
        "value": round(after, 3),
        "unit": f"CPU s per {window:g} s",
        "baseline": round(idle_3, 3),
        # An idle broker may use less than one clock tick (10 ms) in a window: no ratio then.
        "ratio": round(after / idle_3, 2) if idle_3 else None,
        "excess_after": round(after - idle_3, 3),
        "before": round(before, 3),
        "before_baseline": round(idle_1, 3),
        "excess_before": round(before - idle_1, 3),
        "target_excess": TARGET_EXCESS * window / 10.0,
        "met": max(after - idle_3, before - idle_1) <= TARGET_EXCESS * window / 10.0,
        "other_brokers_before": round(m["others_before"], 3),
        "other_brokers_after": round(m["others_after"], 3),
        "route_change_s": round(m["route_change_s"], 2),
        "readers": readers,
        "window_s": window,
    }


if __name__ == "__main__":
    print(run())
