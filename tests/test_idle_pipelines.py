"""Idle journals cost little (issue 26): a primary releases a pipeline no append has used for a
while (its Replicate streams, and its peers' handlers of them) and the next append builds and
synchronizes a new one; a pipeline in use is kept; pulses of journals placed together spread
over the pulse interval instead of firing together."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.client.appender import append
from broker.client.reader import read
from broker.protocol import protocol_pb2 as pb
from broker.replica import PULSE_JITTER, Replica
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec, routed
from tests.helpers.waiting import until

pytestmark = pytest.mark.timeout(120)

JOURNAL = "idle/j"


async def brokers(
    etcd_server: EtcdServer, prefix: str, *, pulse: float, release: float
) -> list[BrokerHarness]:
    started = []
    for i in range(3):
        h = BrokerHarness(etcd_server.endpoint, prefix, id=f"broker-{i}", drain_timeout=1.0)
        h.config.pulse_interval = pulse
        h.config.idle_pipeline_release = release
        await h.__aenter__()
        started.append(h)
    return started


@pytest.fixture
async def stop_after() -> AsyncIterator[list[BrokerHarness]]:
    started: list[BrokerHarness] = []
    yield started
    for h in reversed(started):
        if h.broker.server is not None:
            await h.__aexit__(None, None, None)


def replicas(cluster: list[BrokerHarness]) -> tuple[Replica, list[Replica]]:
    """The journal's primary replica and its peers'."""
    found = []
    for h in cluster:
        assert h.broker.service is not None and h.broker.service.resolver.replicas is not None
        found.append(h.broker.service.resolver.replicas[JOURNAL])
    primary = [r for r in found if r.primary]
    assert len(primary) == 1
    return primary[0], [r for r in found if not r.primary]


async def placed_and_written(cluster: list[BrokerHarness], content: bytes) -> pb.Fragment:
    async with cluster[0].client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=journal_spec(JOURNAL, replication=3))])
        await routed(client, JOURNAL, replicas=3)
    stub = cluster[0].broker.service.dialer.journal_stub(cluster[0].endpoint)  # type: ignore[union-attr]
    return (await append(stub, JOURNAL, content)).commit


async def test_an_idle_primary_releases_its_pipeline_and_the_next_append_rebuilds_it(
    etcd_server: EtcdServer, etcd_prefix: str, stop_after: list[BrokerHarness]
) -> None:
    stop_after += await brokers(etcd_server, etcd_prefix, pulse=0.2, release=0.5)
    first = await placed_and_written(stop_after, b"first")
    assert (first.begin, first.end) == (0, 5)
    primary, peers = replicas(stop_after)

    # Idle: a pulse releases the pipeline, and the peers' Replicate handlers end, handing
    # their spools back (each pulse builds a pipeline for its own sync: wait for a moment
    # between them).
    await until(
        lambda: (
            primary.pipelines_released
            and primary.pipeline_queue.qsize() == 1
            and all(peer.spool_queue.qsize() == 1 for peer in peers)
        ),
        "the pipeline released and the peers' spools handed back",
        timeout=30,
        interval=0.01,
    )

    # The next append synchronizes a new pipeline, and every replica holds every byte once.
    stub = stop_after[1].broker.service.dialer.journal_stub(stop_after[1].endpoint)  # type: ignore[union-attr]
    second = await append(stub, JOURNAL, b"second")
    assert (second.commit.begin, second.commit.end) == (5, 11)
    for h in stop_after:
        stub = h.broker.service.dialer.journal_stub(h.endpoint)  # type: ignore[union-attr]
        got = b""
        async for chunk in read(stub, JOURNAL, offset=0, do_not_proxy=True):
            got += chunk.content
        assert got == b"firstsecond"


async def test_a_pipeline_in_use_is_kept(
    etcd_server: EtcdServer, etcd_prefix: str, stop_after: list[BrokerHarness]
) -> None:
    stop_after += await brokers(etcd_server, etcd_prefix, pulse=0.2, release=2.0)
    await placed_and_written(stop_after, b"x")
    primary, _ = replicas(stop_after)
    stub = stop_after[0].broker.service.dialer.journal_stub(stop_after[0].endpoint)  # type: ignore[union-attr]
    # (The journal's first pulse may have released the pipeline it built before any append:
    # a new primary's pipeline is idle until an append takes it.)
    pulses, released = primary.stable_pulses, primary.pipelines_released
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        await append(stub, JOURNAL, b"x")
        await asyncio.sleep(0.05)  # Workload pacing: appends keep the pipeline in use 4 s.
    assert primary.stable_pulses > pulses  # Pulses ran meanwhile...
    # ...and kept the pipeline appends were using.
    assert primary.pipelines_released == released


async def test_a_new_primary_releases_the_pipeline_its_first_pulse_built_unless_an_append_took_it(
    etcd_server: EtcdServer, etcd_prefix: str, stop_after: list[BrokerHarness]
) -> None:
    """A placement makes many primaries at once; each one's first pulse builds a pipeline.
    Those that no append takes are released by that pulse, not kept open until a second one
    (the pulse takes the pipeline twice when it advertises a new route: still one use)."""
    stop_after += await brokers(etcd_server, etcd_prefix, pulse=60.0, release=30.0)
    async with stop_after[0].client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=journal_spec(JOURNAL, replication=3))])
    primary: Replica | None = None

    def released() -> bool:
        nonlocal primary
        found = [
            h.broker.service.resolver.replicas.get(JOURNAL)  # type: ignore[union-attr]
            for h in stop_after
        ]
        primary = next((r for r in found if r is not None and r.primary), None)
        return primary is not None and bool(primary.pipelines_released)

    await until(released, "the primary's first pulse released its pipeline", 30, 0.05)
    assert primary is not None
    assert primary.pipeline_uses >= 1  # Its pulses, each counted once.
    # The next append builds and synchronizes a new pipeline, and keeps it.
    stub = stop_after[0].broker.service.dialer.journal_stub(stop_after[0].endpoint)  # type: ignore[union-attr]
    first = await append(stub, JOURNAL, b"first")
    assert (first.commit.begin, first.commit.end) == (0, 5)


async def test_pulses_of_journals_placed_together_spread_over_the_interval(
    tmp_path: Path,
) -> None:
    interval = 0.4
    pulses: dict[str, list[float]] = {}
    loop = asyncio.get_running_loop()

    async def pulse(replica: Replica) -> None:
        pulses.setdefault(replica.journal, []).append(loop.time())

    group = [
        Replica(f"spread/{i}", tmp_path, pulse=pulse, pulse_interval=interval) for i in range(8)
    ]
    try:
        for replica in group:  # Placed together: each pulses at once on its route.
            replica.primary = True
            replica.on_route_change()
        await until(
            lambda: len(pulses) == len(group) and min(map(len, pulses.values())) >= 3,
            "three pulses of each replica",
            timeout=60,
            interval=0.05,
        )
    finally:
        for replica in group:
            await replica.shutdown()
    gaps = [b - a for times in pulses.values() for a, b in itertools.pairwise(times)]
    # No pulse comes sooner than the jitter allows...
    assert min(gaps) >= interval * PULSE_JITTER - 0.01, gaps
    # ...and the first periodic pulses, all due at once without jitter, are spread apart.
    firsts = [times[1] - times[0] for times in pulses.values()]
    assert max(firsts) - min(firsts) > interval * 0.05, firsts
