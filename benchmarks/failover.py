"""failover: a journal's primary broker SIGKILLed under a steady append load; seconds until an
append begun after the kill is acknowledged, beside the etcd lease TTL. Target: under TTL + 2 s.

Four `gazette serve` processes with `--etcd.lease TTL`, one journal at replication 3 placed by
the allocator, a few appenders retrying through a Router (`append_routed`) as any client does.
Each round kills the current primary, starts one more append (its own Router, knowing the old
route, as a client that appended before), and times kill -> acknowledgement; the killed broker
is then started again. Baseline in the same run: kill -> the lease's expiry (the victim's member
key deleted in etcd), the floor no broker can beat. The phases after it come from an etcd watch:
the allocator's round (new assignments), the new primary's pipeline synchronization (the route
advertised in every assignment), then the client finding it (retry backoff) and appending.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks._cluster import (
    PREFIX,
    BrokerProcess,
    advertised,
    listed,
    placed,
    start_broker,
    stop_brokers,
    wait_ready,
)
from broker.client.dialer import Dialer
from broker.client.routes import Router, append_routed, is_transient
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from plumbing import etcd as etcdx

JOURNAL = "bench/failover"
BROKERS = 4  # One more than the replication: the allocator has somewhere to put a new replica.
APPENDERS = 4
PAYLOAD = b"x" * 255 + b"\n"
SLACK = 2.0  # The target: the lease TTL plus this.
# Clients ride out a failover: their wait is bounded by the benchmark's timeouts.
WAIT = 3600.0
ASSIGN = f"{PREFIX}/assign/{JOURNAL}#"


def _spec() -> pb.JournalSpec:
    spec = pb.JournalSpec(name=JOURNAL, replication=3)
    spec.fragment.length = 1 << 30
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    return spec


def lost_status(exc: BaseException) -> bool:
    """An append whose outcome the client lost: grpc.aio's INTERNAL "Internal error from Core"
    (the broker answered or aborted the client-streaming Append while the client was still
    writing), or a transient failure after its commit was sent (the primary killed mid-append:
    it may have landed). `append_routed` does not send those again; the benchmark's appenders,
    whose records need not be unique, begin them again."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "Internal error from Core":
        return True
    return bool(getattr(exc, "commit_sent", False)) and is_transient(exc)


async def append_riding_out(router: Router, max_delay: float) -> int:
    """`append_routed`, begun again after a lost status (see `lost_status`); how many times."""
    lost = 0
    while True:
        try:
            await append_routed(router, JOURNAL, PAYLOAD, wait=WAIT, max_delay=max_delay)
            return lost
        except grpc.aio.AioRpcError as exc:
            if not lost_status(exc):
                raise
            lost += 1


def _member_key(broker_id: str) -> str:
    return f"{PREFIX}/members/local#{broker_id}"  # `gazette serve`'s default zone.


class Watcher:
    """Every change under the benchmark's prefix since etcd's first revision, with the time
    (monotonic) this process saw it: the timeline of each failover."""

    def __init__(self, etcd: Any) -> None:
        self.etcd = etcd
        self.events: list[tuple[float, str, str, bytes]] = []
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        watch = await self.etcd.watch_prefix(PREFIX.encode(), start_revision=1)
        async for event in watch:
            self.events.append(
                (time.monotonic(), event.kind, event.kv.key.decode(), event.kv.value)
            )

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@dataclass
class Round:
    """One kill, and when each step of the failover after it was seen (monotonic seconds)."""

    victim: str
    leader: bool  # The victim also led the allocator.
    killed: float
    acked: float = 0.0
    attempts: list[float] = field(default_factory=list)  # When each try of the append began.
    expired: float | None = None  # The victim's member key deleted: its lease expired.
    assigned: float | None = None  # The allocator's round: the journal's assignments changed.
    synced: float | None = None  # The new route advertised in every assignment.
    load_acked: float | None = None  # The steady load's first acknowledgement on the new route.
    lost: int = 0  # Statuses the append lost (see `lost_status`), and the load's meanwhile.
    load_lost: int = 0

    def read_timeline(self, events: Sequence[tuple[float, str, str, bytes]]) -> None:
        assignments: dict[str, bytes] = {}
        member = _member_key(self.victim)
        for t, kind, key, value in events:
            if key.startswith(ASSIGN):
                if kind == "PUT":
                    assignments[key] = value
                else:
                    assignments.pop(key, None)
            if t < self.killed:
                continue
            if self.expired is None:
                if kind == "DELETE" and key == member:
                    self.expired = t
            elif self.assigned is None and kind == "PUT" and key.startswith(ASSIGN):
                self.assigned = t
            if self.assigned is not None and self.synced is None:
                route = advertised(list(assignments.values()))
                if route is not None and all(m.suffix != self.victim for m in route.members):
                    self.synced = t


class _RecordingRouter(Router):
    """A Router noting when each attempt of an append begins."""

    def __init__(self, address: str, dialer: Dialer) -> None:
        super().__init__(address, dialer=dialer)
        self.attempts: list[float] = []

    def stub_for(self, journal: str) -> pb_grpc.JournalStub:
        self.attempts.append(time.monotonic())
        return super().stub_for(journal)


class Load:
    """`count` appenders appending small records through one Router until closed."""

    def __init__(self, router: Router, count: int, max_delay: float) -> None:
        self.router = router
        self.max_delay = max_delay
        self.acks: list[float] = []
        self.lost: list[float] = []  # When an append lost its status (and was begun again).
        self.errors: list[str] = []
        self.tasks = [asyncio.ensure_future(self._appender()) for _ in range(count)]

    async def _appender(self) -> None:
        while True:
            try:
                await append_routed(
                    self.router, JOURNAL, PAYLOAD, wait=WAIT, max_delay=self.max_delay
                )
            except Exception as exc:
                if lost_status(exc):
                    self.lost.append(time.monotonic())
                    continue
                if isinstance(exc, grpc.aio.AioRpcError):
                    detail = f"{exc.code().name}: {exc.details()} ({exc.debug_error_string()})"
                else:
                    detail = f"{type(exc).__name__}: {exc}"
                self.errors.append(f"{time.monotonic():.3f} {detail}")
                await asyncio.sleep(0.1)
                continue
            self.acks.append(time.monotonic())

    async def flowing(self, timeout: float = 30) -> None:
        """Until the load is acknowledged again (a few appends in the last moment)."""
        async with asyncio.timeout(timeout):
            seen = len(self.acks)
            while len(self.acks) < seen + 2 * len(self.tasks):
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _steady(etcd: Any, brokers: Sequence[BrokerProcess]) -> pb.Route:
    """Wait until the journal's route is settled on three live brokers and advertised (the
    allocator and the primary are done); the route, with endpoints."""
    live = [b for b in brokers if b.proc.poll() is None]
    async with asyncio.timeout(60):
        while True:
            route = (await listed(live[0].address, JOURNAL)).route
            addresses = {b.address for b in live}
            kvs = await etcd.get_prefix(ASSIGN.encode())
            value = advertised([kv.value for kv in kvs])
            if (
                len(route.members) == 3
                and route.primary != -1
                and all(e in addresses for e in route.endpoints)
                and value is not None
                and list(value.members) == list(route.members)
                and value.primary == route.primary
            ):
                return route
            await asyncio.sleep(0.1)


async def _leader(etcd: Any) -> str:
    """The allocator's leader: the member with the oldest key."""
    kvs = await etcd.get_prefix(f"{PREFIX}/members/".encode())
    oldest = min(kvs, key=lambda kv: (kv.create_revision, kv.key))
    return str(oldest.key.decode().rsplit("#", 1)[1])


async def measure(kills: int, lease: int, max_delay: float = 2.0) -> list[Round]:
    brokers: list[BrokerProcess] = []
    rounds: list[Round] = []
    with EtcdServer() as etcd_server, tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        dialer = Dialer()
        etcd = etcdx.connect(etcd_server.endpoint)
        watcher: Watcher | None = None
        load: Load | None = None
        try:
            await etcd.connect()
            watcher = Watcher(etcd)
            for i in range(BROKERS):
                log = Path(tmp) / f"broker-{i}.log"
                brokers.append(start_broker(etcd_server, f"broker-{i}", log, lease=f"{lease}s"))
            await wait_ready(brokers)
            await placed(brokers[0].address, _spec())
            route = await _steady(etcd, brokers)
            # The clients' default broker (which proxies) is one that survives each kill, as
            # a load-balanced service address would be.
            survivor = next(b for b in brokers if b.address != route.endpoints[route.primary])
            load = Load(Router(survivor.address, dialer=dialer), APPENDERS, max_delay)
            await load.flowing()
            for n in range(kills):
                route = await _steady(etcd, brokers)
                await load.flowing()
                victim = next(
                    b
                    for b in brokers
                    if b.address == route.endpoints[route.primary] and b.proc.poll() is None
                )
                survivor = next(b for b in brokers if b is not victim and b.proc.poll() is None)
                load.router.address = survivor.address
                probe = _RecordingRouter(survivor.address, dialer)
                probe.cache.update(JOURNAL, route)  # A client that appended before the kill.
                leader = await _leader(etcd)

                killed = time.monotonic()
                os.kill(victim.proc.pid, signal.SIGKILL)
                victim.proc.wait()
                async with asyncio.timeout(3 * lease + 60):
                    lost = await append_riding_out(probe, max_delay)
                one = Round(victim.id, leader == victim.id, killed, time.monotonic())
                one.lost = lost
                one.load_lost = sum(killed <= t <= one.acked + 1 for t in load.lost)
                one.attempts = probe.attempts
                await asyncio.sleep(0.5)  # The watch delivers the last events.
                one.read_timeline(watcher.events)
                # (Acknowledgements right after the kill answer appends the old primary had
                # already committed: the load is back once it is acknowledged on the new route.)
                since = one.synced if one.synced is not None else one.acked
                one.load_acked = next((t for t in load.acks if t >= since), None)
                rounds.append(one)

                # Back to four brokers: the killed one starts again (a new port, its old key
                # gone with its lease).
                log = Path(tmp) / f"{victim.id}.{n + 1}.log"
                restarted = start_broker(etcd_server, victim.id, log, lease=f"{lease}s")
                brokers.append(restarted)
                await wait_ready([restarted])
            if load.errors:
                raise RuntimeError(f"appends of the load gave up: {load.errors[:3]}")
        finally:
            if load is not None:
                await load.close()
            if watcher is not None:
                await watcher.close()
            with contextlib.suppress(Exception):
                await etcd.close()
            await dialer.close()
            stop_brokers(brokers)
    return rounds


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _since(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def summarize(rounds: Sequence[Round], lease: int) -> dict[str, Any]:
    took = [r.acked - r.killed for r in rounds]
    expiry = [_since(r.expired, r.killed) for r in rounds]
    target = lease + SLACK
    median = statistics.median(took)
    baseline = _median(expiry)
    return {
        "value": round(median, 3),
        "unit": "s",
        "baseline": baseline,
        "ratio": round(median / baseline, 2) if baseline else None,
        "max": round(max(took), 3),
        "lease_ttl": lease,
        "target": target,
        "target_ratio": round(median / target, 2),
        "max_target_ratio": round(max(took) / target, 2),
        "met": max(took) < target,
        "each": [round(t, 2) for t in took],
        # Phases, medians over the kills: lease expiry -> the allocator's round -> the route
        # synchronized and advertised -> the append's acknowledgement.
        "allocate": _median([_since(r.assigned, r.expired) for r in rounds]),
        "sync": _median([_since(r.synced, r.assigned) for r in rounds]),
        "client": _median([_since(r.acked, r.synced) for r in rounds]),
        # Of which the client spent waiting for its next try (backoff) once the route was
        # ready, and how many tries the append took.
        "client_wait": _median(
            [_since(max(r.attempts), r.synced) if r.synced is not None else None for r in rounds]
        ),
        "attempts": statistics.median(len(r.attempts) for r in rounds),
        "load_recovery": _median([_since(r.load_acked, r.killed) for r in rounds]),
        "leader_killed": sum(r.leader for r in rounds),
        # Appends that failed with INTERNAL instead of the broker's status (not retried by
        # append_routed; begun again here): the timed append's, and the load's.
        "lost_statuses": sum(r.lost for r in rounds),
        "load_lost_statuses": sum(r.load_lost for r in rounds),
        "kills": len(rounds),
    }


def run(
    quick: bool = False,
    *,
    lease: int | None = None,
    kills: int | None = None,
    max_delay: float = 2.0,
) -> dict[str, Any]:
    """`max_delay` caps the clients' retry backoff (`append_routed`'s, 2 s by default)."""
    lease = lease if lease is not None else (2 if quick else 5)
    kills = kills if kills is not None else (1 if quick else 5)
    result = summarize(asyncio.run(measure(kills, lease, max_delay)), lease)
    if max_delay != 2.0:
        result["max_retry_delay"] = max_delay
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.failover")
    parser.add_argument("--lease", type=int, default=5, help="--etcd.lease of the brokers (s)")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument(
        "--max-delay", type=float, default=2.0, help="cap of the clients' retry backoff (s)"
    )
    args = parser.parse_args()
    print(run(lease=args.lease, kills=args.kills, max_delay=args.max_delay))
