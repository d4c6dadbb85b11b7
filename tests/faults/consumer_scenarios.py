"""Consumer scenarios of the fault campaign, and the run of one: stream-sum on one store (JSON
files, PostgreSQL, or SQLite recorded into recovery logs with hot standbys) under a chunk
workload, fault cycles drawn from a seed, healing, the sums read back and the check
(`tests/faults/consumer_checker.py`).

As the broker scenarios (`tests/faults/scenarios.py`), each scenario is a function doing one
fault cycle, repeated within the scenario's time budget, every choice drawn from generators
seeded by the run's seed and the scenario's name: `python -m tests.faults --scenario NAME --seed
SEED` replays the same schedule (timing still varies with the machine)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from broker.client.appender import append
from tests.faults.consumer_checker import ConsumerHistory, Report, check
from tests.faults.consumer_harness import (
    ChunkWorkload,
    ConsumerConfig,
    ConsumerHarness,
    ConsumerSlot,
)
from tests.faults.harness import HarnessError, describe
from tests.faults.network import ETCD, namespaces_unavailable
from tests.faults.runner import ScenarioSkipped, run_cycles

# A scenario's time budget (--budget), and the time kept at its end for healing, the workload's
# last streams, and reading the sums.
BUDGET = 85.0
RESERVE = 20.0


@dataclass
class Context:
    harness: ConsumerHarness
    history: ConsumerHistory
    rng: random.Random
    lease: float

    async def hold(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high))

    async def victim(self, primary_bias: float = 0.8) -> ConsumerSlot:
        """A consumer to fault: usually one hosting a shard's primary."""
        if self.rng.random() < primary_bias:
            shard = self.rng.choice(self.harness.shard_ids())
            slot = await self.harness.primary_of(shard)
            if slot is not None and slot.running() and not slot.paused:
                return slot
        return self.rng.choice(self.harness.consumers)

    async def settle(self) -> None:
        """Restart whatever is down, then give the shards a moment."""
        await self.harness.heal_all()
        await self.hold(0.5, 1.5)


Cycle = Callable[[Context], Awaitable[None]]


async def consumer_sigkill(ctx: Context) -> None:
    """SIGKILL a consumer (usually one hosting a primary); start it again after 0-2 s (the
    supervisor would too: it waits for its old lease to lapse before it takes shards)."""
    slot = await ctx.victim()
    fault = ctx.harness.fault("SIGKILL", slot.id)
    ctx.harness.signal(slot, signal.SIGKILL)
    await ctx.hold(0.0, 2.0)
    await ctx.harness.start_consumer(slot)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.5)


async def consumer_sigstop(ctx: Context) -> None:
    """SIGSTOP a consumer hosting a primary for 1.5-3 leases (another process takes its shards),
    then SIGCONT: the woken zombie's transactions must not commit."""
    slot = await ctx.victim(primary_bias=1.0)
    duration = ctx.rng.uniform(1.5 * ctx.lease, 3.0 * ctx.lease)
    fault = ctx.harness.fault("SIGSTOP", slot.id, f"for {duration:.1f}s")
    ctx.harness.signal(slot, signal.SIGSTOP)
    await asyncio.sleep(duration)
    ctx.harness.signal(slot, signal.SIGCONT)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.0)
    await ctx.settle()


async def broker_kill(ctx: Context) -> None:
    """SIGKILL a broker (every journal has replication 3 on the three), start it again after
    0.5-2.5 s. One fault at a time: the restarted broker holds only what is appended after it
    joined, so the next cycle waits until the fragments from before are persisted (killing the
    others before would lose them with every replica: a broker's durability, not a consumer's)."""
    index = ctx.rng.randrange(len(ctx.harness.cluster.brokers))
    fault = ctx.harness.fault("broker-SIGKILL", f"broker-{index}")
    ctx.harness.cluster.signal(index, signal.SIGKILL)
    await ctx.hold(0.5, 2.5)
    await ctx.harness.cluster.start_broker(index)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.0)
    if not await ctx.harness.persisted(timeout=30):
        ctx.history.note("fragments not all persisted within 30 s")


async def etcd_restart(ctx: Context) -> None:
    """etcd SIGKILLed and started again 0.1-1.5 s later (within the leases)."""
    fault = ctx.harness.fault("etcd-restart", "etcd")
    ctx.harness.cluster.stop_etcd()
    await ctx.hold(0.1, 1.5)
    ctx.harness.cluster.start_etcd()
    ctx.harness.heal(fault)
    await ctx.hold(1.5, 3.0)


async def _kill_etcd(ctx: Context, when: str, timeout: float) -> None:
    """SIGKILL etcd the moment a new assignment is written (a replica about to read its hints:
    etcd then refuses connections at once, and aetcd raises, it does not wait), or after
    `timeout`; start it again on its data 0.2-1.5 s later. Half the time, kill it once more
    at the next assignment, within 3 s of its start. Started in a thread: waiting for its
    health must not hold the workload up."""
    kills = 2 if ctx.rng.random() < 0.5 else 1
    for n in range(kills):
        down = ctx.rng.uniform(0.2, 1.5)
        came = await ctx.harness.kill_etcd_at_next_assignment(timeout if n == 0 else 3.0)
        at = "at an assignment" if came else "no assignment came"
        fault = ctx.harness.fault("etcd-kill", "etcd", f"{when}: {at}, down {down:.1f}s")
        await asyncio.sleep(down)
        await asyncio.to_thread(ctx.harness.cluster.start_etcd)
        ctx.harness.heal(fault)


async def etcd_kill_handoff(ctx: Context) -> None:
    """etcd SIGKILLed while shards start, hand off and promote standbys (issue 38). A summer
    hosting a primary stops: SIGTERM (it hands its shards off: standbys promoted at once, new
    standbys started elsewhere from the hints) or SIGKILL (its lease lapses, then the same);
    etcd is killed the moment the allocator assigns a replica, and started again. The summer
    starts again once etcd serves, and half the time etcd is killed again as replicas are
    assigned to it. A replica must wait out etcd's restart, never end FAILED for it."""
    slot = await ctx.victim(primary_bias=1.0)
    graceful = ctx.rng.random() < 0.5
    sig = signal.SIGTERM if graceful else signal.SIGKILL
    stop = ctx.harness.fault(sig.name, slot.id, "a primary's summer, then etcd killed")
    ctx.harness.signal(slot, sig)
    await _kill_etcd(ctx, "as its shards move", 2 * ctx.lease + 3)
    await ctx.harness.stopped(slot, timeout=10)
    if ctx.rng.random() < 0.5:
        starting = asyncio.create_task(ctx.harness.start_consumer(slot))
        try:
            await _kill_etcd(ctx, "as replicas start on the restarted summer", 2 * ctx.lease + 3)
        finally:
            try:
                await starting
            except HarnessError as exc:  # Killed before it announced itself: it exits.
                ctx.history.note(f"{slot.id} did not start while etcd was killed: {exc}")
        await ctx.harness.start_consumer(slot)
    else:
        await ctx.harness.start_consumer(slot)
    ctx.harness.heal(stop)
    await ctx.hold(1.5, 3.0)


async def etcd_outage(ctx: Context) -> None:
    """etcd down for 1.2-2 consumer leases: every consumer's lease lapses (each exits, and
    its shards are assigned again once etcd is back; the brokers, on a 5 s lease, pause their
    appends meanwhile), then everything comes back."""
    duration = ctx.rng.uniform(1.2 * ctx.lease, 2.0 * ctx.lease)
    fault = ctx.harness.fault("etcd-outage", "etcd", f"for {duration:.1f}s")
    ctx.harness.cluster.stop_etcd()
    await asyncio.sleep(duration)
    ctx.harness.cluster.start_etcd()
    ctx.harness.heal(fault)
    await ctx.hold(2.0, 3.0)
    await ctx.settle()


async def partition_etcd(ctx: Context) -> None:
    """A consumer hosting a primary cut from etcd (not from the brokers) for 1-3 leases: its
    lease lapses, another takes its shards; mended, it must not commit as a zombie."""
    slot = await ctx.victim(primary_bias=1.0)
    duration = ctx.rng.uniform(1.0 * ctx.lease, 3.0 * ctx.lease)
    fault = ctx.harness.fault("partition-etcd", slot.id, f"for {duration:.1f}s")
    ctx.harness.cluster.cut(slot.node, ETCD)
    await asyncio.sleep(duration)
    ctx.harness.cluster.mend(slot.node, ETCD)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.0)
    await ctx.settle()


async def partition_brokers(ctx: Context) -> None:
    """A consumer hosting a primary cut from every broker (not from etcd) for 0.5-3 leases:
    it keeps its lease and shards, and cannot read or commit until mended."""
    slot = await ctx.victim(primary_bias=1.0)
    duration = ctx.rng.uniform(0.5 * ctx.lease, 3.0 * ctx.lease)
    fault = ctx.harness.fault("partition-brokers", slot.id, f"for {duration:.1f}s")
    brokers = range(len(ctx.harness.cluster.brokers))
    for index in brokers:
        ctx.harness.cluster.cut(slot.node, index)
    await asyncio.sleep(duration)
    for index in brokers:
        ctx.harness.cluster.mend(slot.node, index)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.0)
    await ctx.settle()


async def postgres_restart(ctx: Context) -> None:
    """PostgreSQL SIGKILLed (or stopped fast) and started again on its data after 0.2-2 s:
    transactions in flight fail (their shards FAILED, saying why), and once the operator
    unassigns those, the shards recover from the store."""
    crash = ctx.rng.random() < 0.5
    fault = ctx.harness.fault("postgres-restart", "postgres", "SIGKILL" if crash else "fast stop")
    await asyncio.to_thread(ctx.harness.stop_postgres, signal.SIGKILL if crash else signal.SIGINT)
    await ctx.hold(0.2, 2.0)
    await asyncio.to_thread(ctx.harness.start_postgres)
    ctx.harness.heal(fault)
    await ctx.hold(1.0, 2.0)
    await ctx.settle()
    # A shard whose transaction met the outage FAILED (its own store's error, as upstream):
    # the operator unassigns it (`gazctl shards unassign --failed`), and it starts again.
    await ctx.harness.settle_shards(timeout=15)


async def stray_append(ctx: Context) -> None:
    """Stray bytes appended to a shard's recovery log (no frame: a misdirected write), then
    usually the primary's process SIGKILLed, so that its standby plays back across them."""
    shard = ctx.rng.choice(ctx.harness.shard_ids())
    log = ctx.harness.recovery_log(shard)
    stray = f"stray write {ctx.rng.getrandbits(32):08x} to the wrong journal\n".encode()
    fault = ctx.harness.fault("stray-append", log, f"{len(stray)} bytes")
    cluster = ctx.harness.cluster
    try:
        response = await append(cluster.dialer.journal_stub(cluster.any_address()), log, stray, timeout=10)  # fmt: skip
        ctx.history.note(
            f"stray bytes at [{response.commit.begin}, {response.commit.end}) of {log}"
        )
    except Exception as exc:
        ctx.history.note(f"stray append to {log} failed: {describe(exc)}")
    ctx.harness.heal(fault)
    await ctx.hold(0.3, 1.0)
    if ctx.rng.random() < 0.8:
        slot = await ctx.harness.primary_of(shard)
        if slot is not None and slot.running():
            kill = ctx.harness.fault(
                "SIGKILL", slot.id, f"primary of {shard}, after the stray bytes"
            )
            ctx.harness.signal(slot, signal.SIGKILL)
            await ctx.hold(0.0, 1.0)
            await ctx.harness.start_consumer(slot)
            ctx.harness.heal(kill)
    await ctx.hold(1.5, 3.0)


PARTITIONS = (partition_etcd, partition_brokers)


@dataclass(frozen=True)
class ConsumerScenario:
    name: str
    summary: str
    store: str
    cycle: Cycle | None = None
    mixed: tuple[Cycle, ...] = ()
    cycles: int = 10
    own_faults: tuple[str, ...] = ()
    symlink_tmp: bool = False
    lease: float = 2.0  # The consumers' etcd lease (the brokers' is 5 s: ConsumerConfig).
    default: bool = True

    @property
    def partitions(self) -> bool:
        return self.cycle in PARTITIONS or any(c in PARTITIONS for c in self.mixed)


_ALL = (
    consumer_sigkill, consumer_sigstop, broker_kill, etcd_restart, etcd_outage, partition_etcd,
    partition_brokers,
)  # fmt: skip

CONSUMER_SCENARIOS: dict[str, ConsumerScenario] = {
    s.name: s
    for s in [
        ConsumerScenario("consumer-sigkill", "SIGKILL a summer (usually a primary's), restart after 0-2 s (sqlite, standbys)", "sqlite", consumer_sigkill, cycles=10),
        ConsumerScenario("consumer-sigkill-json", "SIGKILL a summer, restart after 0-2 s (JSON files)", "json", consumer_sigkill, cycles=10),
        ConsumerScenario("consumer-sigstop", "SIGSTOP a primary's summer for 1.5-3 leases, SIGCONT (JSON files)", "json", consumer_sigstop, cycles=6),
        ConsumerScenario("consumer-sigstop-postgres", "SIGSTOP a primary's summer for 1.5-3 leases, SIGCONT (PostgreSQL)", "postgres", consumer_sigstop, cycles=6),
        ConsumerScenario("consumer-sigstop-sqlite", "SIGSTOP a primary's summer for 1.5-3 leases, SIGCONT (sqlite, standbys)", "sqlite", consumer_sigstop, cycles=6),
        ConsumerScenario("consumer-broker-kill", "SIGKILL a broker, restart after 0.5-2.5 s (sqlite, standbys)", "sqlite", broker_kill, cycles=10),
        ConsumerScenario("consumer-etcd-restart", "etcd SIGKILLed, started 0.1-1.5 s later (lease 5 s; JSON files)", "json", etcd_restart, cycles=8, lease=5.0),
        ConsumerScenario("consumer-etcd-kill-handoff", "etcd SIGKILLed (refusing connections) as a primary's summer stops or dies and its shards move, and as it starts again (sqlite, standbys; lease 5 s)", "sqlite", etcd_kill_handoff, cycles=8, lease=5.0),
        ConsumerScenario("consumer-etcd-outage", "etcd down 1.2-2 consumer leases (sqlite, standbys)", "sqlite", etcd_outage, cycles=4),
        ConsumerScenario("consumer-partition-etcd", "a primary's summer cut from etcd for 1-3 leases (PostgreSQL)", "postgres", partition_etcd, cycles=6),
        ConsumerScenario("consumer-partition-brokers", "a primary's summer cut from the brokers for 0.5-3 leases (sqlite, standbys)", "sqlite", partition_brokers, cycles=6),
        ConsumerScenario("consumer-postgres-restart", "PostgreSQL SIGKILLed or stopped, started again after 0.2-2 s", "postgres", postgres_restart, cycles=8, own_faults=("postgres-restart",)),
        ConsumerScenario("consumer-stray-append", "stray bytes appended to a recovery log, then its primary SIGKILLed (sqlite, standbys)", "sqlite", stray_append, cycles=8),
        ConsumerScenario("consumer-symlink", "every summer's local directory reached through a symlink; SIGKILL a summer (sqlite, standbys)", "sqlite", consumer_sigkill, cycles=8, symlink_tmp=True),
        ConsumerScenario("consumer-mixed-json", "any consumer fault at random (JSON files)", "json", mixed=_ALL, cycles=8),
        ConsumerScenario("consumer-mixed-postgres", "any consumer fault, PostgreSQL restarts too (PostgreSQL)", "postgres", mixed=(*_ALL, postgres_restart), cycles=8, own_faults=("postgres-restart",)),
        ConsumerScenario("consumer-mixed-sqlite", "any consumer fault, stray appends too (sqlite, standbys, symlinked directories)", "sqlite", mixed=(*_ALL, stray_append, etcd_kill_handoff), cycles=8, symlink_tmp=True),
    ]
}  # fmt: skip


async def run_consumer_scenario(
    scenario: ConsumerScenario,
    seed: int,
    workdir: Path,
    *,
    cycles: int | None = None,
    budget: float | None = None,
    namespaces: bool | None = None,
    say: Callable[[str], None] = print,
) -> tuple[ConsumerHistory, Report, float]:
    """Run `scenario` under `seed` in `workdir`; its history, report and wall time. `budget`:
    seconds (default 85)."""
    began = time.monotonic()
    budget = budget or BUDGET
    rng = random.Random(f"{seed}/{scenario.name}")
    history = ConsumerHistory(scenario=scenario.name, seed=seed, store=scenario.store)
    history.own_faults = list(scenario.own_faults)
    if namespaces is None:
        namespaces = not namespaces_unavailable()
    mixed = scenario.mixed
    if scenario.partitions and not namespaces:
        if not mixed:
            raise ScenarioSkipped(
                f"{scenario.name} needs network namespaces: {namespaces_unavailable() or 'off'}"
            )
        mixed = tuple(c for c in mixed if c not in PARTITIONS)
    if scenario.store == "postgres":
        from consumer.local_postgres import PostgresNotFound, postgres_binary

        try:
            postgres_binary("postgres")
        except PostgresNotFound as exc:
            raise ScenarioSkipped(str(exc)) from None
    config = ConsumerConfig(
        workdir, store=scenario.store, namespaces=namespaces, symlink_tmp=scenario.symlink_tmp,
        lease=scenario.lease,
    )  # fmt: skip
    harness = ConsumerHarness(config, history, random.Random(f"{seed}/{scenario.name}/harness"))
    async with harness:
        say(f"  {scenario.name}: cluster and summers up in {time.monotonic() - began:.1f}s ({harness.cluster.network.name})")  # fmt: skip
        workload = ChunkWorkload(harness, seed)
        workload.start()
        ctx = Context(harness, history, rng, config.lease)
        try:
            await ctx.hold(1.0, 2.0)
            await run_cycles(
                ctx, history, rng, count=scenario.cycles if cycles is None else cycles,
                deadline=began + budget - RESERVE, cycle=scenario.cycle, mixed=mixed,
            )  # fmt: skip
        finally:
            await harness.heal_all()
            history.healed = history.now()
            await workload.stop(timeout=40)
        expected = {c.stream for c in history.chunks if c.last}
        await harness.settle_shards(timeout=30)
        await harness.read_sums(expected, timeout=40)
        await harness.settle_shards(timeout=5)
        await harness.record_statuses()
    harness.scan_logs()
    report = check(history)
    return history, report, time.monotonic() - began
