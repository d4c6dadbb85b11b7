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
from tests.faults.runner import ScenarioSkipped, run_cycles

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
    delete: dict[str, Any] | None = None,
) -> int:
    """An operator command, with etcd's topology head before and after it, for the checker. A
    deletion (`delete`: its plan, see `_plan_delete`) also gets, read at once after it, the
    location's deletion state and the CVV of each of its neighbours (CVVs only grow: one that
    does not cover the DVV now did not when the location checked it)."""
    before = await ctx.net.topology_head()
    code, out = await ctx.net.gazctl(*args, check=False, kill_after=kill_after)
    after = await ctx.net.topology_head()
    if delete is not None:
        status = await ctx.net.status_of(delete["location"])
        delete["after"] = status and {"deleted_through": status["deleted_through"], "dvv": status["dvv"]}  # fmt: skip
        delete["cvv_after"] = {y: await _cvv(ctx, y) for y in delete["neighbours"]}
    ctx.history.commands.append({"args": list(args), "code": code, "out": out[-400:], "forbidden": forbidden, "head_before": before, "head_after": after, "killed": code == -9, "delete": delete})  # fmt: skip
    return code


async def _cvv(ctx: Context, location: str) -> dict[str, int] | None:
    status = await ctx.net.status_of(location)
    return None if status is None else dict(status["cvv"])


async def _once_served(ctx: Context, *args: str) -> None:
    """A command run once every location is served again (a location between hosts is refused
    as not running once gazctl's wait is over, as an operator's command would be); the network
    is restored before the cycle ends, so a refusal now is a failure of the campaign."""
    await ctx.settle()
    if await _command(ctx, *args) != 0:
        raise RuntimeError(
            f"gazctl replication {' '.join(args)} was refused with every location served"
        )


async def _kill_host(ctx: Context, location: str, why: str) -> dict[str, Any] | None:
    """SIGKILL the host that serves `location` (its standby takes over after the lease); the
    fault, or None if no live host serves it now."""
    slot = await ctx.net.serving(location)
    if slot is None:
        return None
    fault = ctx.fault("SIGKILL", f"host {slot.id}", f"serving {location}, {why}")
    ctx.net.signal(slot, signal.SIGKILL)
    return fault


async def _cut(ctx: Context, x: str, y: str, why: str) -> dict[str, Any] | None:
    """Cut `x`'s side (its brokers and the host serving it) from `y`'s, as `location_partition`
    does, until `_mend`; the fault, or None if it cannot be cut now (no namespaces, a location
    not served, or one host serving both)."""
    if not ctx.net.nodes.partitions:
        return None
    hx, hy = await ctx.net.serving(x), await ctx.net.serving(y)
    if hx is None or hy is None or hx is hy:
        ctx.history.note(f"partition {x}|{y} skipped: hosts {hx and hx.id} / {hy and hy.id}")
        return None
    side_x = [s.node for s in ctx.net.brokers_of[x]] + [hx.node]
    side_y = [s.node for s in ctx.net.brokers_of[y]] + [hy.node]
    fault = ctx.fault("partition", f"{x}|{y}", f"{side_x} from {side_y}, {why}")
    ctx.net.nodes.cut(side_x, side_y)
    return fault


def _mend(ctx: Context, faults: list[dict[str, Any]]) -> None:
    """Mend the partitions among `faults` (a killed host is started again by `settle`)."""
    cuts = [f for f in faults if f["kind"] == "partition" and f["end"] < 0]
    if cuts:
        ctx.net.nodes.mend_all()
        for fault in cuts:
            ctx.heal(fault)


async def _under_command(ctx: Context) -> list[dict[str, Any]]:
    """The fault a command meets, drawn: the host serving a random location SIGKILLed (30%),
    a random pair of locations partitioned (30%, with namespaces), or none."""
    draw = ctx.rng.random()
    fault = None
    if draw < 0.3:
        fault = await _kill_host(ctx, ctx.location(), "under a command")
    elif draw < 0.6:
        x, y = ctx.rng.sample(list(ctx.net.config.locations), 2)
        fault = await _cut(ctx, x, y, "under a command")
    return [fault] if fault is not None else []


async def operator_commands(ctx: Context) -> None:
    """Operator commands at random under traffic, some while a location's host is SIGKILLed
    (its standby taking over) or two locations are partitioned, and some with gazctl SIGKILLed
    mid-command: commands the rules forbid (refused, nothing recorded), a connection of the
    cycle (or a pair, `--both`) disconnected and connected again, the second time perhaps
    `--new-events-only`, the filtered A -> D that is redundant with C -> D (added, then taken
    away), deletions (`_deletion`). A partition is mended before the network is restored, and
    every cycle ends with the network as it began, so what each location must hold stays
    defined."""
    choice = ctx.rng.choice(["forbidden", "cycle", "both", "redundant", "delete", "delete"])
    if choice == "delete":
        await _deletion(ctx)
        return
    faults = await _under_command(ctx)
    kill = ctx.rng.uniform(0.2, 1.5) if ctx.rng.random() < 0.3 else None
    if choice == "forbidden":
        args, change = ctx.rng.choice(FORBIDDEN)
        await _command(ctx, *args, forbidden=change, kill_after=kill)
        await ctx.hold(0.3, 1.0)
        _mend(ctx, faults)
    elif choice == "redundant":
        await _command(ctx, "connect", "A", "D", "--filter", "kind=red", kill_after=kill)
        await ctx.hold(0.3, 1.5)
        _mend(ctx, faults)
        if await _connected(ctx, "A", "D"):  # Accepted (or recorded before gazctl died).
            await _once_served(ctx, "disconnect", "A", "D")
    else:
        source, target = ctx.rng.choice(CYCLE)
        both = ["--both"] if choice == "both" else []
        await _command(ctx, "disconnect", source, target, *both, kill_after=kill)
        await ctx.hold(0.3, 1.5)
        _mend(ctx, faults)
        new_only = ["--new-events-only"] if ctx.rng.random() < 0.3 else []
        await _once_served(ctx, "connect", source, target, *both, *new_only)
    for fault in faults:
        if fault["end"] < 0:
            ctx.heal(fault)
    await ctx.settle()


async def _deletion(ctx: Context) -> None:
    """`gazctl replication delete X --through N`, of one of two kinds. One the rule allows: N
    such that the DVV it leaves is <= the CVV every neighbour of X reported just before (they
    only grow), after a moment for replication, with the command perhaps meeting a random
    fault. One beyond what a neighbour Y holds: Y's host SIGKILLed or X partitioned from Y,
    X's emitter going on for 0.5-2 s (or no fault, at once: replication racing the command),
    then N = X's last committed event (which Y lacks, unless it came around another way): it
    must be refused if Y's CVV does not cover it. Either may
    meet gazctl SIGKILLed mid-command. The network is not changed, so what each location must
    hold stays defined; the checker takes the deleted events off what X must hold."""
    x = ctx.location()
    neighbours = await ctx.net.neighbours(x)
    kill = ctx.rng.uniform(0.2, 1.5) if ctx.rng.random() < 0.3 else None
    if ctx.rng.random() < 0.5 or not neighbours:
        mode = "allowed"
        await ctx.hold(0.5, 2.0)
        faults = await _under_command(ctx)
    else:
        mode = "beyond"
        y = ctx.rng.choice(neighbours)
        fault, draw = None, ctx.rng.random()
        if draw < 0.4:
            fault = await _cut(ctx, x, y, f"under delete {x}")
        if fault is None and draw < 0.8:
            fault = await _kill_host(ctx, y, f"a neighbour of {x}, under delete {x}")
        faults = [fault] if fault is not None else []
        if faults:
            await ctx.hold(0.5, 2.0)
    plan = await _plan_delete(ctx, x, neighbours, mode)
    if plan is None:
        ctx.history.note(f"delete {x} ({mode}) skipped: nothing to delete, or {x} not served")
    else:
        await _command(ctx, "delete", x, "--through", str(plan["through"]), kill_after=kill, delete=plan)  # fmt: skip
        await ctx.hold(0.2, 1.0)
    _mend(ctx, faults)
    for fault in faults:
        if fault["end"] < 0:
            ctx.heal(fault)
    await ctx.settle()


def _merge(a: dict[str, int], b: dict[str, Any]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0), int(v))
    return out


def _covers(cvv: dict[str, int] | None, dvv: dict[str, int]) -> bool | None:
    """dvv <= cvv (None: the CVV is unknown)."""
    return None if cvv is None else all(v <= cvv.get(k, 0) for k, v in dvv.items())


async def _plan_delete(
    ctx: Context, x: str, neighbours: list[str], mode: str
) -> dict[str, Any] | None:
    """What `delete X --through N` is to delete and what the rule says of it, read before: X's
    deleted_through and DVV, its stored events from there through its last committed one (N is
    one of them: "allowed", the highest prefix whose DVV each neighbour's CVV covers, or a
    little below; "beyond", the last), each neighbour's CVV (None if it does not answer), and
    the events through N (what an accepted deletion removes). None: nothing to delete, or X
    does not answer."""
    from replication.rpc import LocationError
    from tests.faults.harness import HarnessError

    status = await ctx.net.status_of(x)
    if status is None:
        return None
    base = int(status["deleted_through"])
    try:
        events = await ctx.net.read_events(x, base)
    except (LocationError, HarnessError) as exc:
        ctx.history.note(f"reading {x} for a deletion failed: {exc}")
        return None
    cvvs = {y: await _cvv(ctx, y) for y in neighbours}
    dvv, allowed = dict(status["dvv"]), base
    for e in events:
        dvv = _merge(dvv, e["ts"])
        if not all(_covers(c, dvv) for c in cvvs.values()):
            break
        allowed = int(e["seq"])
    last = int(events[-1]["seq"]) if events else base
    if mode == "allowed":
        if allowed <= base:
            return None
        through = ctx.rng.randint(max(base + 1, allowed - 10), allowed)
    else:
        if last <= base:
            return None
        through = last
    doomed = [e for e in events if int(e["seq"]) <= through]
    would = dict(status["dvv"])
    for e in doomed:
        would = _merge(would, e["ts"])
    return {
        "location": x, "through": through, "mode": mode, "neighbours": neighbours,
        "before": {"deleted_through": base, "dvv": status["dvv"]}, "dvv": would,
        "cvv_before": cvvs, "events": doomed,
    }  # fmt: skip


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
    """The disaster at C, the hub of the terminal D (C -> D filtered, D -> C not): C's recovery
    must read D's log from its beginning under its group's write guard, and D's progress on C's
    remade log must start again from nothing, whatever read was in flight (findings 4, 11 and
    12 of docs/reliability.md, "Replication networks under faults")."""
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
        ReplicationScenario(
            "operator-commands", operator_commands, 25,
            "operator commands at random (forbidden ones, disconnect and connect, --both, --new-events-only, a redundant filtered connection, deletions allowed and beyond a neighbour), some with a host SIGKILLed or two locations partitioned, some with gazctl SIGKILLed mid-command",
            budget=420.0, partitions=True,
        ),
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
    """Run `scenario` under `seed` in `workdir`; its history, report and wall time. `budget`:
    seconds (default the scenario's own)."""
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
            await run_cycles(
                ctx, history, rng, count=scenario.cycles if cycles is None else cycles,
                deadline=began + budget - RESERVE, cycle=scenario.cycle,
            )  # fmt: skip
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
