"""Replication scenarios of the fault campaign, and the run of one: a network of four locations
(A, B, C a cycle, A <-> B <-> C <-> A unfiltered; D terminal, C -> D filtered by `kind=red`,
D -> C unfiltered), each on a broker cluster of its own, run by location hosts; emitters at
every location; fault cycles drawn from a seed; healing, quiescence, collection and the check
(`tests/faults/replication_checker.py`).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.faults.network import namespaces_unavailable
from tests.faults.replication_checker import Disaster, ReplicationHistory, Report, check
from tests.faults.replication_harness import Emitters, NetworkConfig, ReplicationNetwork
from tests.faults.scenarios import ScenarioSkipped

# Kept at the end of a budget for healing, probes, quiescence and collection.
RESERVE = 35.0


@dataclass
class Context:
    net: ReplicationNetwork
    history: ReplicationHistory
    rng: random.Random
    lease: float
    filters: dict[tuple[str, str], str] = field(default_factory=dict)

    async def hold(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high))

    def location(self) -> str:
        return self.rng.choice(list(self.net.config.locations))

    def fault(self, kind: str, target: str, detail: str = "") -> dict[str, Any]:
        fault = {"kind": kind, "target": target, "detail": detail, "start": self.history.now(), "end": -1.0}  # fmt: skip
        self.history.faults.append(fault)
        self.history.note(f"fault {kind} {target} {detail}".rstrip())
        return fault

    def heal(self, fault: dict[str, Any]) -> None:
        fault["end"] = self.history.now()
        self.history.note(f"healed {fault['kind']} {fault['target']}")

    async def settle(self) -> None:
        """Start whatever died, until every location is served again (bounded), a moment more."""
        started = await self.net.ensure_running()
        if started:
            self.history.note(f"restarted {started}")
        if not await self.net.wait_served(timeout=45):
            self.history.note("not every location served again within 45 s")
        await self.hold(0.3, 1.0)


Cycle = Callable[[Context], Awaitable[None]]


async def location_kill(ctx: Context) -> None:
    """SIGKILL the host that serves a location: its standby takes over once the host's lease
    expires; the killed host comes back as a new member."""
    location = ctx.location()
    slot = await ctx.net.serving(location)
    if slot is None:
        await ctx.settle()
        return
    fault = ctx.fault("SIGKILL", f"host {slot.id}", f"serving {location}")
    ctx.net.signal(slot, signal.SIGKILL)
    began = time.monotonic()
    await ctx.net.wait_served(timeout=30, locations=[location])
    ctx.history.note(f"{location} served again after {time.monotonic() - began:.1f}s")
    await ctx.hold(0.0, 1.0)
    ctx.heal(fault)
    await ctx.settle()


async def location_pause(ctx: Context) -> None:
    """SIGSTOP the host that serves a location for 1.5-3 leases, then SIGCONT: a standby took
    the log meanwhile, and the woken process must be fenced (its appends refused)."""
    location = ctx.location()
    slot = await ctx.net.serving(location)
    if slot is None:
        await ctx.settle()
        return
    duration = ctx.rng.uniform(1.5 * ctx.lease, 3.0 * ctx.lease)
    fault = ctx.fault("SIGSTOP", f"host {slot.id}", f"serving {location}, for {duration:.1f}s")
    ctx.net.signal(slot, signal.SIGSTOP)
    await asyncio.sleep(duration)
    ctx.net.signal(slot, signal.SIGCONT)
    ctx.heal(fault)
    await ctx.hold(0.5, 1.5)
    await ctx.settle()


async def location_partition(ctx: Context) -> None:
    """Cut one location's side (its brokers and the host serving it) from another's, 1-2.5
    leases, then mend: its connections with that location stop, events go around."""
    names = list(ctx.net.config.locations)
    x, y = ctx.rng.sample(names, 2)
    hx, hy = await ctx.net.serving(x), await ctx.net.serving(y)
    if hx is None or hy is None or hx is hy:
        ctx.history.note(f"partition {x}|{y} skipped: hosts {hx and hx.id} / {hy and hy.id}")
        await ctx.settle()
        return
    side_x = [s.node for s in ctx.net.brokers_of[x]] + [hx.node]
    side_y = [s.node for s in ctx.net.brokers_of[y]] + [hy.node]
    duration = ctx.rng.uniform(1.0 * ctx.lease, 2.5 * ctx.lease)
    fault = ctx.fault("partition", f"{x}|{y}", f"{side_x} from {side_y} for {duration:.1f}s")
    ctx.net.nodes.cut(side_x, side_y)
    await asyncio.sleep(duration)
    ctx.net.nodes.mend_all()
    ctx.heal(fault)
    await ctx.settle()


async def location_broker_kill(ctx: Context) -> None:
    """SIGKILL a broker of a location's cluster (its journal has replication 2: the other
    replica holds the log), start it again after 0.5-2.5 s."""
    location = ctx.location()
    slot = ctx.rng.choice(ctx.net.brokers_of[location])
    fault = ctx.fault("SIGKILL", f"broker {slot.id}")
    ctx.net.signal(slot, signal.SIGKILL)
    await ctx.hold(0.5, 2.5)
    await ctx.net.start_slot(slot)
    ctx.heal(fault)
    await ctx.settle()
    # One fault at a time: the restarted broker holds only what was appended since, so the
    # rest is on one broker's spool until persisted. Killing that one too would be a double
    # fault, which loses acknowledged content with every replica (a broker's durability, not
    # replication's): the next cycle waits until the journal's closed fragments are persisted.
    if not await _persisted(ctx, location, timeout=30):
        ctx.history.note(f"replication/{location}'s fragments not all persisted within 30 s")


async def _persisted(ctx: Context, location: str, timeout: float) -> bool:
    """Whether every fragment of the location's journal but the open one is persisted (as a
    broker of its cluster lists them), polled until `timeout`."""
    from broker.client.journals import dial
    from broker.protocol import protocol_pb2 as pb
    from broker.protocol import protocol_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index in range(len(ctx.net.brokers_of[location])):
            channel = dial(ctx.net.broker_address(location, index))
            try:
                stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
                listed = await stub.ListFragments(pb.FragmentsRequest(journal=f"replication/{location}"), timeout=5)  # fmt: skip
                fragments = sorted((f.spec for f in listed.fragments), key=lambda f: f.end)
                if all(f.backing_store for f in fragments[:-1]):
                    return True
            except Exception:  # That broker is not ready: the other, or again in a moment.
                pass
            finally:
                await channel.close(None)
        await asyncio.sleep(0.5)
    return False


# The terminal connection's filter, written two ways: a change between them is a filter change
# (its connection restarts) that admits the same events, so what D must hold stays defined.
RED = ("kind=red", "kind in (red)")


async def topology_churn(ctx: Context) -> None:
    """Under traffic: a connection disconnected and connected again (B -> C or A -> B on the
    cycle; C -> D or D -> C, the terminal's), or the terminal's filter changed."""
    choice = ctx.rng.choice(["B>C", "A>B", "C>D", "D>C", "filter"])
    if choice == "filter":
        now = ctx.filters.get(("C", "D"), RED[0])
        new = RED[1] if now == RED[0] else RED[0]
        fault = ctx.fault("filter", "C -> D", f"{now!r} to {new!r}")
        await _gazctl(ctx, "connect", "C", "D", "--filter", new)
        ctx.filters[("C", "D")] = new
        ctx.heal(fault)
        await ctx.hold(0.3, 1.5)
        return
    source, target = choice.split(">")
    fault = ctx.fault("disconnect", f"{source} -> {target}")
    await _gazctl(ctx, "disconnect", source, target)
    await ctx.hold(0.3, 2.0)
    filter_ = ctx.filters.get((source, target), RED[0] if (source, target) == ("C", "D") else "")
    await _gazctl(ctx, "connect", source, target, *(["--filter", filter_] if filter_ else []))
    ctx.heal(fault)
    await ctx.hold(0.3, 1.5)


# Commands the rules forbid on the campaign's network whatever was done before (its history
# always holds the unfiltered cycle A, B, C and the filtered C -> D): each with the change it
# would record, as a view's history shows it.
FORBIDDEN = [
    (("connect", "A", "D", "--filter", "kind=blue"), {"type": "connected", "source": "A", "target": "D", "filter": "kind=blue"}),
    (("connect", "B", "C", "--filter", "kind=red"), {"type": "filtered", "source": "B", "target": "C", "filter": "kind=red"}),
    (("connect", "A", "D"), {"type": "connected", "source": "A", "target": "D", "filter": ""}),
    (("connect", "D", "A", "--filter", "kind=red"), {"type": "connected", "source": "D", "target": "A", "filter": "kind=red"}),
    (("connect", "B", "D", "--filter", "kind=blue"), {"type": "connected", "source": "B", "target": "D", "filter": "kind=blue"}),
]  # fmt: skip
# Connections of the unfiltered cycle: any one or a pair of them gone, A, B and C still reach
# each other, so what every location must hold stays defined.
CYCLE = [("A", "B"), ("B", "A"), ("B", "C"), ("C", "B"), ("C", "A"), ("A", "C")]


async def _command(
    ctx: Context,
    *args: str,
    forbidden: dict[str, str] | None = None,
    kill_after: float | None = None,
) -> int:
    """An operator command, with etcd's topology head before and after it, for the checker."""
    before = await ctx.net.topology_head()
    code, out = await ctx.net.gazctl(*args, check=False, kill_after=kill_after)
    after = await ctx.net.topology_head()
    ctx.history.commands.append({"args": list(args), "code": code, "out": out[-400:], "forbidden": forbidden, "head_before": before, "head_after": after, "killed": code == -9})  # fmt: skip
    return code


async def _until_ok(ctx: Context, *args: str) -> None:
    """A command run until it is accepted (an endpoint between hosts is refused as not running
    once gazctl's wait is over): the network is restored before the cycle ends."""
    for _ in range(10):
        if await _command(ctx, *args) == 0:
            return
        await ctx.settle()
    raise RuntimeError(f"gazctl replication {' '.join(args)} refused 10 times")


async def operator_commands(ctx: Context) -> None:
    """Operator commands at random under traffic, some while a location's host is SIGKILLed
    (its standby taking over) and some with gazctl SIGKILLed mid-command: commands the rules
    forbid (refused, nothing recorded), a connection of the cycle (or a pair, `--both`)
    disconnected and connected again, the second time perhaps `--new-events-only`, the filtered
    A -> D that is redundant with C -> D (added, then taken away); every cycle ends with the
    network as it began, so what each location must hold stays defined."""
    fault = None
    if ctx.rng.random() < 0.4:
        location = ctx.location()
        slot = await ctx.net.serving(location)
        if slot is not None:
            fault = ctx.fault("SIGKILL", f"host {slot.id}", f"serving {location}, under a command")
            ctx.net.signal(slot, signal.SIGKILL)
    kill = ctx.rng.uniform(0.2, 1.5) if ctx.rng.random() < 0.3 else None
    choice = ctx.rng.choice(["forbidden", "cycle", "both", "redundant"])
    if choice == "forbidden":
        args, change = ctx.rng.choice(FORBIDDEN)
        await _command(ctx, *args, forbidden=change, kill_after=kill)
    elif choice == "redundant":
        await _command(ctx, "connect", "A", "D", "--filter", "kind=red", kill_after=kill)
        await ctx.hold(0.3, 1.5)
        if await _connected(ctx, "A", "D"):  # Accepted (or recorded before gazctl died).
            await _until_ok(ctx, "disconnect", "A", "D")
    else:
        source, target = ctx.rng.choice(CYCLE)
        both = ["--both"] if choice == "both" else []
        await _command(ctx, "disconnect", source, target, *both, kill_after=kill)
        await ctx.hold(0.3, 1.5)
        new_only = ["--new-events-only"] if ctx.rng.random() < 0.3 else []
        await _until_ok(ctx, "connect", source, target, *both, *new_only)
    if fault is not None:
        ctx.heal(fault)
    await ctx.settle()


async def _connected(ctx: Context, source: str, target: str) -> bool:
    """Whether etcd's history has source -> target connected now."""
    from replication import commands
    from tests.faults.replication_harness import REGISTRY

    history = await commands.read_history(ctx.net._etcd, REGISTRY)
    return (source, target) in history.view().current


async def _gazctl(ctx: Context, *args: str) -> None:
    """An operator's command, once: gazctl itself waits for a location that is between hosts,
    so a refusal here is the product's, and the scenario fails with it."""
    code, out = await ctx.net.gazctl(*args, check=False)
    if code != 0:
        raise RuntimeError(f"gazctl replication {' '.join(args)} failed: {out[-400:]}")


async def disaster(ctx: Context) -> None:
    """A location's journal deleted while it runs (its log lost); then, as an operator would,
    `gazctl replication recover NAME`: the journal made anew, the location restarted on a
    host, its clock and its neighbours' progress recovered, its events back from them. Only
    locations whose every neighbour the rules let it recover from: A and B (unfiltered both
    ways with each neighbour) and D (terminal); C is `disaster-hub`'s."""
    await _disaster(ctx, ctx.rng.choice(["A", "B", "D"]))


async def disaster_hub(ctx: Context) -> None:
    """The disaster at C, whose terminal neighbour D it may not recover from (C -> D is
    filtered and C is not terminal): recovery skips C's progress on D to D's head, and with it
    D's events that C never held (emitted while C was down). Left out of the default run: a
    known defect (docs/reliability.md, "Replication networks under faults")."""
    await _disaster(ctx, "C")


async def _disaster(ctx: Context, location: str) -> None:
    fault = ctx.fault("disaster", location, "journal deleted")
    await ctx.net.delete_journal(location)
    record = Disaster(location, ctx.history.now())
    ctx.history.disasters.append(record)
    await ctx.hold(0.5, 2.0)
    await _gazctl(ctx, "recover", location, "--timeout", "60")
    record.recovered = ctx.history.now()
    ctx.heal(fault)
    await ctx.settle()


@dataclass(frozen=True)
class ReplicationScenario:
    name: str
    cycle: Cycle
    cycles: int
    summary: str
    budget: float = 200.0  # A cap: a scenario ends once its cycles ran.
    partitions: bool = False
    store: bool = False
    lease: float = 2.0
    default: bool = True  # In the campaign's default run.


REPLICATION_SCENARIOS = {
    s.name: s
    for s in [
        ReplicationScenario("location-kill", location_kill, 13, "SIGKILL the host serving a location; its standby takes over"),
        ReplicationScenario("location-pause", location_pause, 12, "SIGSTOP the host serving a location 3-6 s (lease 2 s), SIGCONT: fenced"),
        ReplicationScenario(
            "location-partition", location_partition, 21,
            "a location's brokers and host cut from another's 2-5 s", partitions=True,
        ),
        ReplicationScenario(
            "location-broker-kill", location_broker_kill, 15,
            "SIGKILL a broker of a location's cluster (RF 2), restart it 0.5-2.5 s later", store=True,
        ),
        ReplicationScenario("topology-churn", topology_churn, 30, "disconnect and connect a connection, or change the terminal's filter, under traffic", budget=420.0),
        ReplicationScenario("operator-commands", operator_commands, 25, "operator commands at random (forbidden ones, disconnect and connect, --both, --new-events-only, a redundant filtered connection), some with a host SIGKILLed, some with gazctl SIGKILLed mid-command", budget=420.0),
        ReplicationScenario("disaster", disaster, 10, "delete A's, B's or D's journal while it runs; gazctl replication recover"),
        ReplicationScenario(
            "disaster-hub", disaster_hub, 3,
            "delete C's journal (the hub of terminal D) while it runs; gazctl replication recover",
        ),
    ]
}  # fmt: skip


async def run_replication_scenario(
    scenario: ReplicationScenario,
    seed: int,
    workdir: Path,
    *,
    cycles: int | None = None,
    budget: float | None = None,
    namespaces: bool | None = None,
    say: Callable[[str], None] = print,
) -> tuple[ReplicationHistory, Report, float]:
    """Run `scenario` under `seed` in `workdir`; its history, report and wall time."""
    began = time.monotonic()
    budget = budget or scenario.budget
    rng = random.Random(f"{seed}/{scenario.name}")
    if namespaces is None:
        namespaces = not namespaces_unavailable()
    if scenario.partitions and not namespaces:
        raise ScenarioSkipped(
            f"{scenario.name} needs network namespaces: {namespaces_unavailable() or 'off'}"
        )
    config = NetworkConfig(workdir, lease=scenario.lease, namespaces=namespaces, store=scenario.store)  # fmt: skip
    history = ReplicationHistory(scenario.name, seed, locations=list(config.locations))
    history.admits = {n: list(kinds) for n, kinds in config.admits}
    history.now()
    net = ReplicationNetwork(config, history, rng=random.Random(f"{seed}/{scenario.name}/net"))
    async with net:
        say(f"  {scenario.name}: network up in {time.monotonic() - began:.1f}s ({net.nodes.name})")
        emitters = Emitters(net, seed)
        emitters.start()
        try:
            ctx = Context(net, history, rng, scenario.lease)
            await ctx.hold(1.0, 2.0)
            deadline = began + budget - RESERVE
            for n in range(scenario.cycles if cycles is None else cycles):
                if time.monotonic() > deadline:
                    history.note(f"time budget reached after {n} cycles")
                    break
                await scenario.cycle(ctx)
                history.cycles += 1
            net.nodes.mend_all()
            await net.ensure_running()
            await net.wait_served(timeout=60)
            history.healed = history.now()
            await asyncio.gather(*(emitters.probe(n, timeout=30) for n in config.locations))
            await asyncio.sleep(1.0)
        finally:
            await emitters.stop()
        await net.wait_quiescent(timeout=60)
        await net.collect()
    report = check(history)
    return history, report, time.monotonic() - began
