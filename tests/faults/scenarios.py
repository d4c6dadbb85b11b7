"""Fault scenarios and the run of one: a cluster, the workload, fault cycles drawn from a seed,
healing, a probe of every journal, collection, and the check.

Each scenario is a function doing one fault cycle (inject, hold, heal, let the cluster settle);
`run_scenario` repeats it within the scenario's time budget. Every choice (targets, durations,
the workload's records) comes from random generators seeded by the run's seed and the scenario's
name, so `python -m tests.faults --scenario NAME --seed SEED` replays the same schedule (timing
still varies with the machine)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tests.faults.checker import Report, check
from tests.faults.harness import Cluster, ClusterConfig
from tests.faults.history import History
from tests.faults.network import ETCD, namespaces_unavailable
from tests.faults.runner import ScenarioSkipped, run_cycles
from tests.faults.workload import Workload

# Rate-limited journals: one for the crowds (many small appends at once), one for the held
# appends and the clients that give up behind them.
CROWD_JOURNAL, LEAVE_JOURNAL = "faults/rate/crowd", "faults/rate/leave"
APPEND_RATE = 2 << 20  # max_append_rate of both, bytes/s.
RAW_JOURNALS = [f"faults/raw/{i}" for i in range(4)] + [CROWD_JOURNAL, LEAVE_JOURNAL]
MESSAGE_JOURNALS = ["faults/msg/0", "faults/msg/1"]
JOURNALS = RAW_JOURNALS + MESSAGE_JOURNALS
# A scenario's time budget (--budget), and the time kept at its end for healing, probing,
# collecting and stopping.
BUDGET = 60.0
RESERVE = 16.0


@dataclass
class Context:
    cluster: Cluster
    history: History
    rng: random.Random
    lease: float

    async def hold(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high))

    async def target(self, primary_bias: float = 0.7) -> int:
        """A broker to fault: usually the primary of a random journal, else any broker."""
        if self.rng.random() < primary_bias:
            journal = self.rng.choice(JOURNALS)
            primary = await self.cluster.primary_of(journal)
            if primary is not None and self.cluster.brokers[primary].running():
                return primary
        return self.rng.randrange(len(self.cluster.brokers))

    async def settle(self) -> None:
        """Restart whatever died, and give the cluster a moment."""
        started = await self.cluster.ensure_running()
        if started:
            self.history.note(f"restarted {started}")
        await self.hold(0.3, 1.2)


Cycle = Callable[[Context], Awaitable[None]]


async def sigkill(ctx: Context) -> None:
    i = await ctx.target()
    fault = ctx.cluster.fault("SIGKILL", f"broker-{i}")
    ctx.cluster.signal(i, signal.SIGKILL)
    await ctx.hold(0.5, 2.5)
    await ctx.cluster.start_broker(i)
    ctx.cluster.heal(fault)
    await ctx.settle()


async def crash_restart(ctx: Context) -> None:
    """SIGKILL and an immediate restart under the same id (which waits for its old lease)."""
    i = await ctx.target()
    fault = ctx.cluster.fault("restart", f"broker-{i}", "SIGKILL, started again at once")
    ctx.cluster.signal(i, signal.SIGKILL)
    await ctx.cluster.start_broker(i)
    ctx.cluster.heal(fault)
    await ctx.settle()


async def sigstop(ctx: Context) -> None:
    """A paused primary: shorter than its lease (a stall) or longer (the others take over,
    and the paused broker wakes up as a zombie whose lease is gone)."""
    i = await ctx.target(primary_bias=0.9)
    duration = ctx.rng.uniform(0.3, 2.5 * ctx.lease)
    fault = ctx.cluster.fault("SIGSTOP", f"broker-{i}", f"for {duration:.1f}s")
    ctx.cluster.signal(i, signal.SIGSTOP)
    await asyncio.sleep(duration)
    ctx.cluster.signal(i, signal.SIGCONT)
    ctx.cluster.heal(fault)
    await ctx.hold(0.3, 1.0)
    await ctx.settle()


async def sigterm(ctx: Context) -> None:
    i = await ctx.target()
    fault = ctx.cluster.fault("SIGTERM", f"broker-{i}")
    ctx.cluster.signal(i, signal.SIGTERM)
    status = await ctx.cluster.wait_exit(i, timeout=30)
    if status != 0:
        ctx.history.note(f"broker-{i} exited {status} after SIGTERM")
    await ctx.hold(0.2, 1.5)
    await ctx.cluster.start_broker(i)
    ctx.cluster.heal(fault)
    await ctx.settle()


async def etcd_restart(ctx: Context) -> None:
    """etcd killed and started again well within the brokers' lease: they ride it out. Each
    restart waits until the brokers have had time to refresh their leases since the last."""
    down = ctx.rng.uniform(0.1, 0.3 * ctx.lease)
    fault = ctx.cluster.fault("etcd-restart", "etcd", f"down {down:.1f}s")
    ctx.cluster.stop_etcd()
    await asyncio.sleep(down)
    ctx.cluster.start_etcd()
    ctx.cluster.heal(fault)
    await ctx.hold(0.5 * ctx.lease, ctx.lease)
    await ctx.settle()


async def etcd_flapping(ctx: Context) -> None:
    """etcd killed and started again, over and over, each outage well within the brokers'
    lease but the next one soon after (the spacing etcd-restart leaves out)."""
    down = ctx.rng.uniform(0.1, 0.3 * ctx.lease)
    incarnations = [slot.incarnation for slot in ctx.cluster.brokers]
    fault = ctx.cluster.fault("etcd-restart", "etcd", f"down {down:.1f}s, again soon")
    ctx.cluster.stop_etcd()
    await asyncio.sleep(down)
    ctx.cluster.start_etcd()
    ctx.cluster.heal(fault)
    await ctx.hold(0.5, 1.5)
    await ctx.settle()
    restarted = [s.incarnation for s in ctx.cluster.brokers] != incarnations
    if restarted:  # Brokers lost their leases: journals may refuse appends until reset.
        await asyncio.gather(
            *(ctx.cluster.probe(j, reset_allowed=True, timeout=10) for j in JOURNALS)
        )


async def etcd_outage(ctx: Context) -> None:
    """etcd down for longer than the brokers' lease. Each broker fences itself once its lease
    may have lapsed (appends wait, nothing is acknowledged) and goes on once etcd answers again,
    since etcd keeps leases alive across its own restart. Were a lease gone, its broker would
    persist its spools and exit, and the operator might have to reset heads: allowed here."""
    down = ctx.rng.uniform(1.2 * ctx.lease, 2.0 * ctx.lease)
    fault = ctx.cluster.fault("etcd-outage", "etcd", f"down {down:.1f}s")
    ctx.cluster.stop_etcd()
    await asyncio.sleep(down)
    ctx.cluster.start_etcd()
    ctx.cluster.heal(fault)
    await ctx.cluster.ensure_running()
    await ctx.cluster.wait_replicated(JOURNALS, timeout=15)
    await asyncio.gather(*(ctx.cluster.probe(j, reset_allowed=True, timeout=15) for j in JOURNALS))
    await ctx.hold(0.5, 1.5)


async def full_disk(ctx: Context) -> None:
    i = await ctx.target()
    written = ctx.cluster.fill_disk(i)
    fault = ctx.cluster.fault("disk-full", f"broker-{i}", f"{written} bytes of filler")
    await ctx.hold(0.5, 3.0)
    ctx.cluster.free_disk(i)
    ctx.cluster.heal(fault)
    await ctx.settle()


async def store_outage(ctx: Context) -> None:
    down = ctx.rng.uniform(0.5, 4.0)
    fault = ctx.cluster.fault("store-outage", "gcs", f"down {down:.1f}s")
    ctx.cluster.stop_store()
    await asyncio.sleep(down)
    ctx.cluster.start_store()
    ctx.cluster.heal(fault)
    await ctx.settle()


async def partition_peers(ctx: Context) -> None:
    """A broker (usually a primary) cut off from every other broker, or the brokers split in
    two groups; etcd and the clients still reach everyone."""
    n = len(ctx.cluster.brokers)
    i = await ctx.target()
    side = {i}
    if ctx.rng.random() < 0.5:
        side.add(ctx.rng.choice([j for j in range(n) if j != i]))
    other = [j for j in range(n) if j not in side]
    duration = ctx.rng.uniform(0.5, 2.5 * ctx.lease)
    fault = ctx.cluster.fault(
        "partition", f"{sorted(side)}|{other}", f"brokers from brokers for {duration:.1f}s"
    )
    pairs = [(a, b) for a in side for b in other]
    for a, b in pairs:
        ctx.cluster.cut(a, b)
    await asyncio.sleep(duration)
    for a, b in pairs:
        ctx.cluster.mend(a, b)
    ctx.cluster.heal(fault)
    await ctx.settle()


async def partition_etcd(ctx: Context) -> None:
    """A broker (usually a primary) cut off from etcd but not from peers or clients: past its
    lease, the others take its journals while it may still believe it is their primary."""
    i = await ctx.target(primary_bias=0.9)
    duration = ctx.rng.uniform(0.5, 2.5 * ctx.lease)
    fault = ctx.cluster.fault("partition", f"broker-{i}|etcd", f"for {duration:.1f}s")
    ctx.cluster.cut(i, ETCD)
    await asyncio.sleep(duration)
    ctx.cluster.mend(i, ETCD)
    ctx.cluster.heal(fault)
    await ctx.hold(0.3, 1.0)
    await ctx.settle()


async def sigkill_all(ctx: Context) -> None:
    """Every broker SIGKILLed at once: whatever was not persisted is gone with every replica.
    Journals then refuse appends (INDEX_HAS_GREATER_OFFSET) until the operator resets their
    heads, after checking that the brokers' heads are the stores' ends."""
    fault = ctx.cluster.fault("SIGKILL-all", "every broker")
    ctx.cluster.spools_renewed()
    for slot in ctx.cluster.brokers:
        ctx.cluster.signal(slot.index, signal.SIGKILL)
    await ctx.hold(0.2, 1.0)
    await ctx.cluster.ensure_running()
    ctx.cluster.heal(fault)
    await ctx.cluster.wait_replicated(JOURNALS, timeout=15)
    await asyncio.gather(*(ctx.cluster.probe(j, reset_allowed=True, timeout=15) for j in JOURNALS))
    await ctx.hold(0.5, 1.5)


async def sigterm_all(ctx: Context) -> None:
    """Every broker stopped gracefully at once: they flush what nobody is left to serve, so
    after a restart journals take appends with no operator action."""
    fault = ctx.cluster.fault("SIGTERM-all", "every broker")
    ctx.cluster.spools_renewed(lossy=False)  # Graceful: nothing acknowledged may be lost.
    for slot in ctx.cluster.brokers:
        ctx.cluster.signal(slot.index, signal.SIGTERM)
    for slot in ctx.cluster.brokers:
        status = await ctx.cluster.wait_exit(slot.index, timeout=40)
        if status != 0:
            ctx.history.note(f"{slot.id} exited {status} after SIGTERM")
    await ctx.hold(0.2, 1.0)
    await ctx.cluster.ensure_running()
    ctx.cluster.heal(fault)
    await ctx.hold(1.0, 2.0)


async def quiet(ctx: Context) -> None:
    """No fault: the workload alone for a while (the crowds' groups and the leavers behind a
    held pipeline, where nothing excuses a difference between replicas)."""
    await ctx.hold(4.0, 6.0)


@dataclass(frozen=True)
class Scenario:
    name: str
    cycle: Cycle
    cycles: int
    summary: str
    lease: float = 2.0
    store: str = "file"
    spool_limit: int = 0
    partitions: bool = False
    may_reset: bool = False
    mixed: tuple[Cycle, ...] = ()


async def _mixed(ctx: Context) -> None:
    raise AssertionError("replaced by run_scenario")


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("quiet", quiet, 8, "no fault: the workload alone, 4-6 s a cycle"),
        Scenario("sigkill", sigkill, 12, "SIGKILL a broker (usually a primary), restart it"),
        Scenario("sigstop", sigstop, 10, "SIGSTOP a primary 0.3-5 s, SIGCONT (zombie if past its lease)"),
        Scenario("sigterm", sigterm, 10, "SIGTERM a broker (graceful), restart it"),
        Scenario("restart", crash_restart, 12, "SIGKILL and restart at once under the same id"),
        Scenario("etcd-restart", etcd_restart, 8, "etcd killed, started 0.1-1.5 s later", lease=5.0),
        Scenario(
            "full-disk", full_disk, 14, "a broker's spool filesystem filled 0.5-3 s",
            spool_limit=32 << 20,
        ),
        Scenario("store-outage", store_outage, 12, "fake GCS stopped 0.5-4 s, started", store="gcs"),
        Scenario(
            "partition-peers", partition_peers, 10,
            "a broker (or two) cut off from the other brokers 0.5-5 s", partitions=True,
        ),
        Scenario(
            "partition-etcd", partition_etcd, 10,
            "a primary cut off from etcd 0.5-5 s (not from peers or clients)", partitions=True,
        ),
        Scenario(
            "mixed", _mixed, 12, "any of the single faults above, at random", store="gcs",
            spool_limit=32 << 20, partitions=True, lease=3.0,
            mixed=(sigkill, sigstop, sigterm, crash_restart, etcd_restart, full_disk,
                   store_outage, partition_peers, partition_etcd),
        ),
        Scenario(
            "sigkill-all", sigkill_all, 3,
            "SIGKILL every broker; the operator resets heads (INDEX_HAS_GREATER_OFFSET expected)",
            may_reset=True,
        ),
        Scenario("sigterm-all", sigterm_all, 3, "SIGTERM every broker at once, restart them all"),
        Scenario(
            "etcd-flapping", etcd_flapping, 8,
            "etcd killed and restarted every 2-4 s (each outage under the lease); the operator "
            "resets heads if every broker exits", lease=5.0, may_reset=True,
        ),
        Scenario(
            "etcd-outage", etcd_outage, 2,
            "etcd down past the brokers' lease (brokers fence themselves, then go on)",
            may_reset=True,
        ),
    ]
}  # fmt: skip


async def run_scenario(
    scenario: Scenario,
    seed: int,
    workdir: Path,
    *,
    cycles: int | None = None,
    budget: float | None = None,
    namespaces: bool | None = None,
    say: Callable[[str], None] = print,
    tls: bool = False,
    auth: bool = False,
    crowd: tuple[int, int] = (32, 100),
) -> tuple[History, Report, float]:
    """Run `scenario` under `seed` in `workdir`; its history, report and wall time. `budget`:
    seconds (default 60). `crowd`: how many clients each of the crowds' waves has at once
    (least, most)."""
    began = time.monotonic()
    budget = budget or BUDGET
    rng = random.Random(f"{seed}/{scenario.name}")
    history = History(scenario=scenario.name, seed=seed)
    if namespaces is None:
        namespaces = not namespaces_unavailable()
    if scenario.partitions and not namespaces:
        if scenario.mixed:
            cycles_available = tuple(
                c for c in scenario.mixed if c not in (partition_peers, partition_etcd)
            )
            scenario = Scenario(**{**scenario.__dict__, "mixed": cycles_available})
        else:
            raise ScenarioSkipped(
                f"{scenario.name} needs network namespaces: {namespaces_unavailable() or 'off'}"
            )
    if scenario.spool_limit and namespaces_unavailable():
        raise ScenarioSkipped(f"{scenario.name} mounts a tmpfs: {namespaces_unavailable()}")
    config = ClusterConfig(
        workdir,
        lease=scenario.lease,
        store=scenario.store,
        spool_limit=scenario.spool_limit,
        namespaces=namespaces,
        tls=tls,
        auth=auth,
        append_rates={CROWD_JOURNAL: APPEND_RATE, LEAVE_JOURNAL: APPEND_RATE},
    )
    cluster = Cluster(config, history, rng=random.Random(f"{seed}/{scenario.name}/cluster"))
    async with cluster:
        await cluster.create_journals(JOURNALS)
        say(
            f"  {scenario.name}: cluster up in {time.monotonic() - began:.1f}s ({cluster.network.name})"
        )
        workload = Workload(
            cluster,
            history,
            seed,
            raw_journals=RAW_JOURNALS,
            message_journals=MESSAGE_JOURNALS,
            register_journal=RAW_JOURNALS[0],
            crowd_journal=CROWD_JOURNAL,
            leave_journal=LEAVE_JOURNAL,
            crowd=crowd,
        )
        workload.start()
        try:
            ctx = Context(cluster, history, rng, scenario.lease)
            await ctx.hold(0.5, 1.0)
            await run_cycles(
                ctx, history, rng, count=scenario.cycles if cycles is None else cycles,
                deadline=began + budget - RESERVE, cycle=scenario.cycle, mixed=scenario.mixed,
            )  # fmt: skip
            await cluster.heal_all()
            history.healed = history.now()
            await asyncio.sleep(1.0)
        finally:
            await workload.stop(timeout=10)
        # Within what is left of the budget (keeping a few seconds to collect), at least 8 s.
        left = max(8.0, began + budget - time.monotonic() - 6)
        await asyncio.gather(
            *(cluster.probe(j, reset_allowed=scenario.may_reset, timeout=left) for j in JOURNALS)
        )
        await cluster.collect(JOURNALS)
    report = check(history)
    return history, report, time.monotonic() - began
