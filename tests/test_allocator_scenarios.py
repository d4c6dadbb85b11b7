"""The allocator against a real etcd, in the spirit of upstream's scenarios_test.go: members join,
leave, lose leases and exit; journals change replication; replicas synchronize their routes (done
here the way a broker's pulse would) and only then may surplus assignments go."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import pytest
from aetcd import transactions

from allocator import MemberKeyMissing, Round, State, allocate, solve
from allocator import keyspace as aks
from allocator.allocate import _converge
from broker.keyspace import broker_decoder, broker_rules
from broker.protocol import protocol_pb2 as pb
from keyspace import KeySpace, KeyValue
from plumbing import etcd as etcdx

WAIT = 15.0


class Cluster:
    """Journals and members written straight to etcd, a keyspace mirroring them, and allocators
    running for chosen members. Every task it starts is stopped by `close`."""

    def __init__(self, client: aetcd.Client, root: str) -> None:
        self.client = client
        self.root = root
        self.ks = KeySpace(root + "/", broker_decoder(root), apply_delay=0.005)
        self.leases: dict[str, int] = {}
        self.limits: dict[str, int] = {}
        self.written = 0
        self.allocators: dict[str, Allocator] = {}
        self.watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.ks.load(self.client)
        self.watch = asyncio.create_task(self.ks.watch(self.client))

    async def close(self) -> None:
        tasks = [a.task for a in self.allocators.values()]
        if self.watch is not None:
            tasks.append(self.watch)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for lease in self.leases.values():
            with contextlib.suppress(Exception):
                await self.client.revoke_lease(lease)

    async def _wrote(self, revision: int) -> None:
        self.written = max(self.written, revision)
        await self.ks.wait_for_revision(revision, WAIT)

    # ---- writing the fixture -------------------------------------------------------------

    async def journal(
        self, name: str, replication: int, suspend: pb.JournalSpec.Suspend.Level.ValueType = 0
    ) -> None:
        spec = pb.JournalSpec(name=name, replication=replication)
        spec.suspend.level = suspend
        rsp = await self.client.put(
            aks.item_key(self.root, name).encode(), spec.SerializeToString()
        )
        await self._wrote(rsp.header.revision)

    async def member(
        self, zone: str, suffix: str, limit: int = 100, *, exiting: bool = False
    ) -> None:
        """Create (under a fresh lease) or update (under its lease) a member key."""
        if suffix not in self.leases:
            self.leases[suffix] = (await self.client.lease(60)).id
        self.limits[suffix] = limit
        spec = pb.BrokerSpec(journal_limit=limit, exiting=exiting)
        spec.process_spec.id.zone, spec.process_spec.id.suffix = zone, suffix
        spec.process_spec.endpoint = f"http://{suffix}:8080"
        key = aks.member_key(self.root, zone, suffix).encode()
        rsp = await self.client.put(key, spec.SerializeToString(), lease=self.leases[suffix])
        await self._wrote(rsp.header.revision)

    async def revoke(self, suffix: str) -> None:
        """The member's lease ends, as when its process dies: its key and its assignments go."""
        await self.client.revoke_lease(self.leases.pop(suffix))
        # The revocation's revision is not returned; a marker write orders after it.
        rsp = await self.client.put(f"{self.root}/marker".encode(), b"")
        await self._wrote(rsp.header.revision)

    async def delete(self, key: str) -> None:
        rsp = await self.client.delete(key.encode())
        assert rsp is not None
        await self._wrote(rsp.header.revision)

    async def put(self, key: str, value: bytes = b"") -> None:
        rsp = await self.client.put(key.encode(), value)
        await self._wrote(rsp.header.revision)

    # ---- observing -------------------------------------------------------------------------

    def assignments(self) -> list[KeyValue]:
        return list(self.ks.prefixed(self.root + aks.ASSIGNMENTS))

    def keys(self) -> list[str]:
        return [kv.key.removeprefix(self.root + aks.ASSIGNMENTS) for kv in self.assignments()]

    def by_journal(self) -> dict[str, list[aks.Assignment]]:
        out: dict[str, list[aks.Assignment]] = {}
        for kv in self.assignments():
            a = kv.decoded
            assert isinstance(a, aks.Assignment)
            out.setdefault(a.item_id, []).append(a)
        return out

    def load(self) -> Counter[str]:
        return Counter(a.member_suffix for group in self.by_journal().values() for a in group)

    def check_invariants(self, zones: int) -> None:
        """What holds of any converged allocation: one assignment per member per journal, one
        primary, packed slots, limits respected, spread over zones when there are several."""
        for journal, group in self.by_journal().items():
            members = [(a.member_zone, a.member_suffix) for a in group]
            assert len(members) == len(set(members)), journal
            assert sorted(a.slot for a in group) == list(range(len(group))), journal
            if zones >= 2 and len(group) >= 2:
                assert len({a.member_zone for a in group}) >= 2, f"{journal} in one zone"
        for suffix, count in self.load().items():
            assert count <= self.limits[suffix], suffix

    # ---- the pulse ---------------------------------------------------------------------------

    async def sync_routes(self) -> int:
        """Write each journal's Route into its assignments where they differ, keeping each
        key's lease, as a broker's pulse does once its replicas have synchronized. Returns the
        number of assignments written."""
        groups: dict[str, list[KeyValue]] = {}
        for kv in self.assignments():
            a = kv.decoded
            assert isinstance(a, aks.Assignment)
            groups.setdefault(a.item_id, []).append(kv)
        compares, ops = [], []
        for group in groups.values():
            route = aks.build_route(group, self._lookup)
            raw = route.SerializeToString()
            for kv in group:
                if kv.raw != raw:
                    compares.append(transactions.Mod(kv.key.encode()) == kv.mod_revision)
                    ops.append(transactions.Put(kv.key.encode(), raw, lease=kv.lease))
        written = 0
        for start in range(0, len(ops), 100):
            result = await etcdx.txn(
                self.client, compares[start : start + 100], ops[start : start + 100]
            )
            assert result.succeeded, "assignments changed under the pulse"
            written += len(ops[start : start + 100])
            await self._wrote(result.revision)
        return written

    def _lookup(self, zone: str, suffix: str) -> aks.Member | None:
        kv = self.ks.get(aks.member_key(self.root, zone, suffix))
        return kv.decoded if kv is not None and isinstance(kv.decoded, aks.Member) else None

    # ---- allocators --------------------------------------------------------------------------

    def run(self, zone: str, suffix: str) -> Allocator:
        allocator = Allocator(self, aks.member_key(self.root, zone, suffix))
        self.allocators[suffix] = allocator
        return allocator

    async def converge(self, allocator: Allocator) -> int:
        """Let `allocator` run until idle, synchronizing routes each time it idles, until there
        is nothing left to synchronize. Returns how many pulses wrote routes."""
        pulses = 0
        while True:
            await allocator.until_idle(self.written)
            if await self.sync_routes() == 0:
                return pulses
            pulses += 1


class Allocator:
    """One member's `allocate` loop in a task, with the rounds it reports."""

    def __init__(self, cluster: Cluster, key: str) -> None:
        self.rounds: list[Round] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(
            allocate(
                cluster.ks, cluster.client, cluster.root, key,
                rules=broker_rules(), retry_delay=0.1, on_round=self._on_round,
            )
        )  # fmt: skip
        self.task.add_done_callback(lambda _: self.changed.set())

    def _on_round(self, round_: Round) -> None:
        # A round may fail a comparison when the test writes concurrently; it then re-plans.
        self.rounds.append(round_)
        self.changed.set()

    async def until_idle(self, revision: int) -> None:
        """Until a round planned from `revision` or later found nothing to do."""
        async with asyncio.timeout(WAIT):
            while True:
                self.changed.clear()
                if self.task.done():
                    self.task.result()
                    raise AssertionError("allocate returned while expected to run")
                if any(r.idle and r.revision >= revision for r in self.rounds[-3:]):
                    return
                await self.changed.wait()

    async def finished(self) -> None:
        async with asyncio.timeout(WAIT):
            await self.task


@pytest.fixture
async def cluster(etcd: aetcd.Client, etcd_prefix: str) -> AsyncIterator[Cluster]:
    c = Cluster(etcd, etcd_prefix)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


# ---- scenarios ------------------------------------------------------------------------------


async def test_initial_allocation(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A1", 2)
    await cluster.member("zone-a", "A2", 2)
    await cluster.member("zone-b", "B", 4)
    for n, r in enumerate([1, 2, 3], start=1):
        await cluster.journal(f"j{n}", r)
    leader = cluster.run("zone-a", "A1")
    await leader.until_idle(cluster.written)

    groups = cluster.by_journal()
    assert {j: len(g) for j, g in groups.items()} == {"j1": 1, "j2": 2, "j3": 3}
    cluster.check_invariants(zones=2)
    # New assignments are empty and live under their member's lease, so they go with it.
    for kv in cluster.assignments():
        a = kv.decoded
        assert isinstance(a, aks.Assignment)
        assert kv.raw == b""
        assert kv.lease == cluster.leases[a.member_suffix]

    # Once the replicas advertise their routes, nothing changes: the allocation is stable.
    before = cluster.keys()
    assert await cluster.converge(leader) == 1
    assert cluster.keys() == before


async def test_many_journals_in_batched_transactions(cluster: Cluster) -> None:
    for suffix, zone in [("A", "zone-a"), ("B", "zone-b"), ("C", "zone-c")]:
        await cluster.member(zone, suffix, 1000)
    for n in range(150):
        await cluster.journal(f"j{n:03d}", 3)
    leader = cluster.run("zone-a", "A")
    await leader.until_idle(cluster.written)
    # 450 puts could not fit one transaction of at most 128 operations.
    assert max(r.txns for r in leader.rounds) >= 4
    assert cluster.load() == {"A": 150, "B": 150, "C": 150}
    primaries = Counter(
        a.member_suffix for g in cluster.by_journal().values() for a in g if not a.slot
    )
    assert max(primaries.values()) - min(primaries.values()) <= 1, primaries


async def test_zones_added_and_removed(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A1")
    await cluster.member("zone-a", "A2")
    for n in range(6):
        await cluster.journal(f"j{n}", 2)
    leader = cluster.run("zone-a", "A1")
    await cluster.converge(leader)
    assert all(
        {a.member_zone for a in g} == {"zone-a"} and len(g) == 2
        for g in cluster.by_journal().values()
    )

    # A second zone: every journal now spans both.
    await cluster.member("zone-b", "B1")
    await cluster.converge(leader)
    cluster.check_invariants(zones=2)
    assert all(len(g) == 2 for g in cluster.by_journal().values())
    assert cluster.load()["B1"] == 6

    # The zone goes away with its only member: journals fall back to zone-a, fully replicated.
    await cluster.revoke("B1")
    await cluster.converge(leader)
    cluster.check_invariants(zones=1)
    groups = cluster.by_journal()
    assert all(len(g) == 2 and {a.member_zone for a in g} == {"zone-a"} for g in groups.values())


async def test_lease_loss_hands_assignments_over(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A")
    await cluster.member("zone-b", "B")
    await cluster.member("zone-c", "C")
    for n in range(6):
        await cluster.journal(f"j{n}", 2)
    leader = cluster.run("zone-a", "A")
    follower = cluster.run("zone-b", "B")
    await cluster.converge(leader)
    assert cluster.load()["C"] > 0
    assert not any(r.leader for r in follower.rounds)

    # C's process dies: its lease lapses, taking its member key and assignments at once.
    await cluster.revoke("C")
    assert "C" not in cluster.load()
    await cluster.converge(leader)
    assert cluster.load() == {"A": 6, "B": 6}
    cluster.check_invariants(zones=2)

    # The leader's lease goes too: its loop fails, and B, now the oldest, takes over.
    await cluster.revoke("A")
    with pytest.raises(MemberKeyMissing):
        await leader.finished()
    await cluster.member("zone-c", "C2")
    await cluster.converge(follower)
    assert any(r.leader for r in follower.rounds)
    assert cluster.load() == {"B": 6, "C2": 6}


async def test_member_key_deleted_with_lease_alive(cluster: Cluster) -> None:
    # The member key goes but its lease (and so its assignments) stays: those assignments are
    # not replicas of a live member and are removed without waiting for consistency.
    await cluster.member("zone-a", "A")
    await cluster.member("zone-a", "B")
    await cluster.journal("j1", 1)
    await cluster.journal("j2", 1)
    leader = cluster.run("zone-a", "A")
    await cluster.converge(leader)
    assert cluster.load() == {"A": 1, "B": 1}
    await cluster.delete(aks.member_key(cluster.root, "zone-a", "B"))
    await leader.until_idle(cluster.written)
    assert cluster.load() == {"A": 2}
    assert sorted(cluster.keys()) == ["j1#zone-a#A#0", "j2#zone-a#A#0"]


async def test_exiting_member_is_drained(cluster: Cluster) -> None:
    for suffix in ["A", "B", "C", "D"]:
        await cluster.member("zone-a", suffix, 10)
    for n in range(8):
        await cluster.journal(f"j{n}", 2)
    leader = cluster.run("zone-a", "A")
    exiting = cluster.run("zone-a", "D")
    await cluster.converge(leader)
    assert cluster.load()["D"] == 4

    await cluster.member("zone-a", "D", 10, exiting=True)
    await leader.until_idle(cluster.written)
    # Replacements are added, but D's replicas stay until those have synchronized.
    assert cluster.load()["D"] == 4
    assert not exiting.task.done()
    await cluster.converge(leader)
    await exiting.finished()  # Returns (without error) once D holds nothing.
    assert "D" not in cluster.load()
    assert all(len(g) == 2 for g in cluster.by_journal().values())
    cluster.check_invariants(zones=1)


async def test_exiting_leader_drains_itself(cluster: Cluster) -> None:
    for suffix in ["A", "B", "C"]:
        await cluster.member("zone-a", suffix, 10)
    for n in range(3):
        await cluster.journal(f"j{n}", 1)
    leader = cluster.run("zone-a", "A")
    follower = cluster.run("zone-a", "B")
    await cluster.converge(leader)
    assert cluster.load() == {"A": 1, "B": 1, "C": 1}

    await cluster.member("zone-a", "A", 10, exiting=True)
    # The leader hands its journal over, and returns once it holds nothing.
    async with asyncio.timeout(WAIT):
        while not leader.task.done():
            leader.changed.clear()
            if not await cluster.sync_routes():
                await leader.changed.wait()
    await leader.finished()
    assert "A" not in cluster.load()
    # A's process would now stop and its key go; B leads and finds nothing to change.
    await cluster.revoke("A")
    await follower.until_idle(cluster.written)
    assert sum(cluster.load().values()) == 3


async def test_replication_up_and_down(cluster: Cluster) -> None:
    for suffix, zone in [("A", "zone-a"), ("B", "zone-b"), ("C", "zone-c"), ("D", "zone-a")]:
        await cluster.member(zone, suffix)
    await cluster.journal("j1", 1)
    leader = cluster.run("zone-a", "A")
    await cluster.converge(leader)
    assert len(cluster.by_journal()["j1"]) == 1

    await cluster.journal("j1", 3)
    await cluster.converge(leader)
    group = cluster.by_journal()["j1"]
    assert len(group) == 3 and len({a.member_zone for a in group}) == 3

    await cluster.journal("j1", 2)
    await cluster.converge(leader)
    assert len(cluster.by_journal()["j1"]) == 2

    # Suspension: PARTIAL keeps one replica, FULL none.
    await cluster.journal("j1", 2, suspend=pb.JournalSpec.Suspend.PARTIAL)
    await cluster.converge(leader)
    assert len(cluster.by_journal()["j1"]) == 1
    await cluster.journal("j1", 2, suspend=pb.JournalSpec.Suspend.FULL)
    await cluster.converge(leader)
    assert cluster.by_journal() == {}


async def test_removal_waits_for_consistency(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A")
    await cluster.member("zone-a", "B")
    await cluster.journal("j1", 1)
    await cluster.put(aks.assignment_key(cluster.root, "j1", "zone-a", "B", 0))
    leader = cluster.run("zone-a", "A")
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#B#0"]

    # B's limit drops to zero: the journal should move to A. A is added; B, the only replica
    # that ever synchronized... has not (its value is empty), so it stays, round after round.
    await cluster.member("zone-a", "B", 0)
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#A#1", "j1#zone-a#B#0"]
    await cluster.put(f"{cluster.root}/marker")  # Another round, same answer.
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#A#1", "j1#zone-a#B#0"]

    # A stale route (of B alone) is not consistent with the assignment set either.
    route = pb.Route(primary=0)
    route.members.add(zone="zone-a", suffix="B")
    await cluster.put(
        aks.assignment_key(cluster.root, "j1", "zone-a", "B", 0), route.SerializeToString()
    )
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#A#1", "j1#zone-a#B#0"]

    # The pulse writes the route of {A, B} into both: now B may go, and A becomes primary.
    assert await cluster.sync_routes() == 2
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#A#0"]


async def test_limits(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A", 2)
    await cluster.member("zone-a", "B", 2)
    for n in range(6):
        await cluster.journal(f"j{n}", 1)
    leader = cluster.run("zone-a", "A")
    await cluster.converge(leader)
    # Six journals, four slots: four assigned, and no member over its limit.
    assert cluster.load() == {"A": 2, "B": 2}

    # B's limit grows to 10: every journal fits, and load follows limits (1:5), so A hands
    # one journal to B.
    await cluster.member("zone-a", "B", 10)
    await cluster.converge(leader)
    assert cluster.load() == {"A": 1, "B": 5}

    # B's limit falls to 1. A takes one journal back up to its limit, but B keeps the other
    # three over its limit: they have nowhere else to go, and removing a journal's only
    # consistent replica would leave it with fewer than it wants.
    await cluster.member("zone-a", "B", 1)
    await cluster.converge(leader)
    assert cluster.load() == {"A": 2, "B": 4}
    assert len(cluster.by_journal()) == 6

    # Room appears on A: B's surplus moves there, and B is back within its limit.
    await cluster.member("zone-a", "A", 5)
    await cluster.converge(leader)
    assert cluster.load() == {"A": 5, "B": 1}
    cluster.check_invariants(zones=1)


async def test_assignments_of_deleted_journals_are_removed(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A")
    await cluster.journal("j1", 1)
    await cluster.journal("j2", 1)
    leader = cluster.run("zone-a", "A")
    await cluster.converge(leader)
    await cluster.delete(aks.item_key(cluster.root, "j2"))
    await leader.until_idle(cluster.written)
    assert cluster.keys() == ["j1#zone-a#A#0"]


async def test_cancellation_leaves_nothing_running(cluster: Cluster) -> None:
    await cluster.member("zone-a", "A")
    await cluster.journal("j1", 1)
    leader = cluster.run("zone-a", "A")
    await leader.until_idle(cluster.written)
    before = asyncio.all_tasks()
    leader.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader.task
    assert asyncio.all_tasks() == before - {leader.task}


async def test_a_stale_leader_changes_nothing(cluster: Cluster) -> None:
    # Every transaction asserts the leader's member key is as the plan saw it: a leader whose
    # key changed since (or that lost leadership) plans from a stale state and is refused.
    await cluster.member("zone-a", "A")
    await cluster.journal("j1", 1)
    state = State.from_keyspace(
        cluster.ks, cluster.root, aks.member_key(cluster.root, "zone-a", "A"), broker_rules()
    )
    desired = solve(state.problem()).assignments
    await cluster.member("zone-a", "A", 50)
    applied, revision, error = await _converge(state, desired, cluster.client, 128)
    assert (applied, revision) == (0, 0)
    assert error is not None and "comparisons failed" in error
    assert cluster.keys() == []

    # Planned afresh, the same change applies.
    state = State.from_keyspace(
        cluster.ks, cluster.root, aks.member_key(cluster.root, "zone-a", "A"), broker_rules()
    )
    applied, revision, error = await _converge(state, desired, cluster.client, 128)
    assert (applied, error) == (1, None)
    await cluster.ks.wait_for_revision(revision, WAIT)
    assert cluster.keys() == ["j1#zone-a#A#0"]


async def test_a_round_that_held_the_loop_is_followed_by_a_wait_as_long(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's state and plan are built on the event loop in time linear in the keyspace;
    at 50,000 journals, with every pulse's assignment write calling for a new round, rounds ran
    back to back and took nine tenths of the leader's loop. The loop now waits at least as
    long as the round held it before the next."""
    build = State.from_keyspace

    def slow_build(*args: Any, **kwargs: Any) -> State:
        time.sleep(0.1)  # As a large keyspace takes.
        return build(*args, **kwargs)

    waits: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float, *args: Any) -> None:
        if sys._getframe(1).f_code.co_name == "allocate":  # The allocator's own waits.
            waits.append(delay)
        await sleep(delay, *args)

    monkeypatch.setattr(State, "from_keyspace", staticmethod(slow_build))
    monkeypatch.setattr(asyncio, "sleep", recorded)
    await cluster.member("zone-a", "A1", 4)
    await cluster.journal("j1", 1)
    leader = cluster.run("zone-a", "A1")
    await leader.until_idle(cluster.written)
    assert waits and all(wait >= 0.1 for wait in waits)
