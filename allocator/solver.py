"""The desired assignment of items to members: a pure function (no I/O) of each item's desired
replication, each member's zone and effective limit, and the current assignments.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """Solver input. Members are indexes into `zones` / `limits`."""

    # Replicas each item wants.
    replication: Sequence[int]
    # Zone of each member.
    zones: Sequence[str]
    # Effective item limit of each member; a member with 0 is assigned nothing.
    limits: Sequence[int]
    # Members currently assigned each item, primary first.
    current: Sequence[Sequence[int]]


@dataclass(frozen=True)
class Solution:
    # Members assigned each item, in ascending order.
    assignments: tuple[tuple[int, ...], ...]
    # Replicas wanted (each item's replication, capped by the members able to hold one).
    wanted: int
    # Replicas placed: less than `wanted` when limits or members fall short.
    placed: int

    def loads(self, members: int) -> list[int]:
        load = [0] * members
        for assigned in self.assignments:
            for m in assigned:
                load[m] += 1
        return load


def fair_shares(limits: Sequence[int], wanted: int) -> list[int]:
    """Each member's share of `wanted` replicas in proportion to its limit, rounded up."""
    capacity = sum(limits)
    if capacity == 0 or wanted >= capacity:
        return list(limits)
    return [min(limit, -(-limit * wanted // capacity)) for limit in limits]


def even_shares(limits: Sequence[int], wanted: int, current: Sequence[int]) -> list[int]:
    """Shares in proportion to limits that sum to exactly `wanted`: each member's share rounded
    down, and the remainder handed out one each, first to members currently holding more than
    that, so that reaching an even load moves as few replicas as possible."""
    capacity = sum(limits)
    if capacity == 0 or wanted >= capacity:
        return list(limits)
    shares = [limit * wanted // capacity for limit in limits]
    remainder = wanted - sum(shares)
    # The remainder is the sum of the fractions rounded away, so fewer than the members that
    # had one: each of `remainder` of them takes one more, never exceeding its rounded-up share.
    takers = sorted(
        (m for m, limit in enumerate(limits) if limit * wanted % capacity),
        key=lambda m: (current[m] <= shares[m], -(limits[m] * wanted % capacity), m),
    )
    for m in takers[:remainder]:
        shares[m] += 1
    return shares


def solve(problem: Problem) -> Solution:
    """The desired assignment of `problem`.

    The problem is a maximum flow: source -> item (its replication) -> item-in-zone (at most
    replication-1 replicas per zone while two or more zones have capacity, so replicas spread) ->
    member (one replica of an item per member) -> sink (the member's capacity). It is solved in
    stages, each continuing from the previous one's flow and reaching that stage's maximum:

    1. members capped at their fair share of the load (in proportion to limits, rounded up), zone
       spread enforced. Current assignments seed the flow: all of a member's while it is within its
       fair share, else down to an even share (fair shares rounded down, the remainder going to
       the members that would otherwise shed most), so that the members it sheds to catch up;
    2. members capped at their full limit;
    3. zone spread relaxed, for items that could not otherwise be fully replicated.

    Each stage places replicas greedily (emptiest zone of the item, then least loaded member) and
    then searches augmenting paths, which move replicas between members to make room, choosing
    the path that moves the fewest current assignments. The result places as many replicas as
    any assignment could; spreads every fully replicated item across zones whenever a maximum
    assignment doing so exists; and keeps every member within its fair share whenever all
    replicas fit that way.
    """
    if len(problem.current) != len(problem.replication):
        raise ValueError("current and replication must have one entry per item")
    if len(problem.zones) != len(problem.limits):
        raise ValueError("zones and limits must have one entry per member")
    network = _Network(problem)
    limits = [max(0, limit) for limit in problem.limits]
    holding = [0] * len(limits)
    for members in problem.current:
        for m in set(members):
            if 0 <= m < len(limits):
                holding[m] += 1
    even = even_shares(limits, network.wanted, holding)
    fair = fair_shares(limits, network.wanted)
    # A member within its fair share keeps what it holds; one above sheds down to its even
    # share, so that the members it sheds to end up even with it rather than short.
    keep = [f if h <= f else e for h, f, e in zip(holding, fair, even, strict=True)]
    network.seed(problem.current, keep)
    network.run_stage(fair, network.spread_cap)
    network.run_stage(limits, network.spread_cap)
    if network.zones >= 2:
        network.run_stage(limits, network.want)
    assignments = tuple(tuple(sorted(held)) for held in network.hold)
    return Solution(assignments, network.wanted, sum(len(h) for h in network.hold))


# Visit stamp of nodes proven unable to reach the sink for the rest of a stage.
_DEAD = 1 << 62
# A large odd multiplier (Knuth's multiplicative hash) scattering tie-breaks across items.
_SCATTER = 2654435761


class _Network:
    """The flow of one solve, as replica placements.

    Nodes of the residual graph are numbered: members `0..M-1`, items `M..M+N-1`, and
    item-in-zone nodes `M+N + item*Z + zone`.
    """

    def __init__(self, problem: Problem) -> None:
        limits = problem.limits
        self.n_members = len(limits)
        self.n_items = len(problem.replication)
        self.active = [m for m in range(self.n_members) if limits[m] > 0]
        names = sorted({problem.zones[m] for m in self.active})
        zone_of = {name: z for z, name in enumerate(names)}
        self.zones = len(names)
        self.member_zone = [zone_of.get(problem.zones[m], -1) for m in range(self.n_members)]
        self.zone_members = [
            [m for m in self.active if self.member_zone[m] == z] for z in range(self.zones)
        ]
        # Each zone's members twice over, so any rotation of them is one slice.
        self.zone_members_twice = [ms + ms for ms in self.zone_members]
        # An item cannot use more members than can hold anything.
        self.want = [max(0, min(r, len(self.active))) for r in problem.replication]
        self.wanted = sum(self.want)
        # While two zones have capacity, no zone may hold every replica of an item.
        self.spread_cap = [max(w - 1, 1) for w in self.want] if self.zones >= 2 else list(self.want)
        self.hold: list[list[int]] = [[] for _ in range(self.n_items)]
        # Items placed on each member: by this solve (free to move), and kept from the current
        # assignment (moving one costs a replica resync). Dicts, as ordered sets.
        self.on_new: list[dict[int, None]] = [{} for _ in range(self.n_members)]
        self.on_kept: list[dict[int, None]] = [{} for _ in range(self.n_members)]
        self.load = [0] * self.n_members
        # Replicas of item i in zone z, at i*Z + z.
        self.zone_count = [0] * (self.n_items * self.zones)
        # Current assignments (item * members + member): moving one costs a replica resync.
        self.was: set[int] = set()
        # Set by each stage.
        self.cap: Sequence[int] = ()
        self.inverse: list[float] = []
        self.zone_cap: Sequence[int] = ()
        self.visit: list[int] = []
        self.done: list[int] = []
        self.stamp = 0
        self.live_in_zone: list[int] = []
        self.live = 0

    def place(self, i: int, m: int) -> None:
        self.hold[i].append(m)
        on = self.on_kept if i * self.n_members + m in self.was else self.on_new
        on[m][i] = None
        self.load[m] += 1
        self.zone_count[i * self.zones + self.member_zone[m]] += 1

    def unplace(self, i: int, m: int) -> None:
        self.hold[i].remove(m)
        on = self.on_kept if i * self.n_members + m in self.was else self.on_new
        del on[m][i]
        self.load[m] -= 1
        self.zone_count[i * self.zones + self.member_zone[m]] -= 1

    def seed(self, current: Sequence[Sequence[int]], keep: Sequence[int]) -> None:
        """Start from the current assignments that fit (each member keeping at most `keep`,
        within zone spread), primaries before other replicas, so that a primary is the last
        replica to move."""
        zones, cap, zc, member_zone = self.zones, self.spread_cap, self.zone_count, self.member_zone
        self.was = {
            i * self.n_members + m
            for i, members in enumerate(current)
            for m in members
            if 0 <= m < self.n_members
        }
        for rank in (0, 1):
            for i, members in enumerate(current):
                want, held = self.want[i], self.hold[i]
                for m in members[:1] if rank == 0 else members[1:]:
                    if not 0 <= m < self.n_members or member_zone[m] < 0:
                        continue  # Gone, or can hold nothing.
                    if len(held) >= want or m in held or self.load[m] >= keep[m]:
                        continue
                    if zc[i * zones + member_zone[m]] >= cap[i]:
                        continue
                    self.place(i, m)

    def run_stage(self, cap: Sequence[int], zone_cap: Sequence[int]) -> None:
        """Bring the flow to the maximum of the network with member capacities `cap` and
        per-zone item capacities `zone_cap`."""
        self.cap = cap
        self.inverse = [1.0 / c if c > 0 else 0.0 for c in cap]
        self.zone_cap = zone_cap
        nodes = self.n_members + self.n_items * (1 + self.zones)
        # Search stamps: a node's tentative distance is valid when `visit` holds the current
        # stamp, and it is settled when `done` does (or dead, at _DEAD).
        self.visit = [0] * nodes
        self.done = [0] * nodes
        self.stamp = 0
        self.live_in_zone = [len(ms) for ms in self.zone_members]
        self.live = sum(self.live_in_zone)
        hold, want = self.hold, self.want
        for i in range(self.n_items):
            while len(hold[i]) < want[i]:
                m = self.best_member(i)
                if m >= 0:
                    self.place(i, m)
                elif not self.augment(i):
                    break

    def best_member(self, i: int) -> int:
        """The member to take a new replica of item `i` directly: in the zone holding fewest
        of its replicas, then the least loaded relative to capacity. -1 if none has room."""
        cap, load, inverse = self.cap, self.load, self.inverse
        base = i * self.zones
        counts = self.zone_count[base : base + self.zones]
        limit = self.zone_cap[i]
        held = self.hold[i]
        best, best_key, best_count = -1, 2.0, limit
        # Zones by how many replicas of the item they hold: a member of a zone holding fewer
        # always wins, so the search stops at the first zone count that yields one.
        for count, z in sorted(zip(counts, range(self.zones), strict=True)):
            if count >= best_count:
                break
            # Ties go to the first member from a start that varies by item and zone: taken in a
            # fixed order, items would share identical member sets (whole replica sets moving
            # together), and a lost member's replicas would all fall to the same few members.
            members = self.zone_members[z]
            n = len(members)
            start = ((i + 1) * _SCATTER >> (8 + z)) % n
            for m in self.zone_members_twice[z][start : start + n]:
                used = load[m]
                if used < cap[m]:
                    key = used * inverse[m]
                    if key < best_key and m not in held:
                        best, best_key = m, key
            if best >= 0:
                best_count = count + 1
        return best

    def augment(self, start: int) -> bool:
        """Find the path of replica moves freeing a slot for item `start` that moves the fewest
        current assignments, and apply it. False if there is none, in which case every node
        reached is dead for the rest of the stage: augmenting elsewhere never opens a path from
        a node that had none.

        A 0-1 breadth-first search over the residual graph: moving a replica the current
        assignment holds costs 1, anything else 0. A full member's replicas (a thousand, say)
        are enumerated lazily, by a token in the queue that yields one at a time, so that a
        search ending early has not paid for them all.
        """
        n_members, zones = self.n_members, self.zones
        zi_base = n_members + self.n_items
        visit, done, cap, load = self.visit, self.done, self.cap, self.load
        zc, zone_cap, hold = self.zone_count, self.zone_cap, self.hold
        member_zone, zone_members = self.member_zone, self.zone_members
        self.stamp += 1
        stamp = self.stamp
        # Members not yet settled, by zone: a zone whose members are all settled is not
        # scanned again, and once no member is left unsettled there is no path.
        unsettled = list(self.live_in_zone)
        remaining = self.live
        distance: dict[int, int] = {}
        parent: dict[int, int] = {}
        # Tokens (negative) enumerating a member's replicas: (member, distance, iterator).
        tokens: dict[int, tuple[int, int, Iterator[int]]] = {}
        origin = n_members + start
        if done[origin] >= stamp:
            return False  # Found dead by an earlier search.
        distance[origin] = 0
        visit[origin] = stamp
        queue = deque((origin,))
        while queue and remaining:
            u = queue.popleft()
            if u < 0:
                m, d, replicas = tokens[u]
                j = next(replicas, -1)
                if j < 0:
                    continue
                queue.appendleft(u)  # More to come, at the same distance.
                v = zi_base + j * zones + member_zone[m]
                if done[v] < stamp and (visit[v] < stamp or d < distance[v]):
                    visit[v] = stamp
                    distance[v] = d
                    parent[v] = m
                    queue.appendleft(v)
                continue
            if done[u] >= stamp:
                continue  # Settled at a lower cost already.
            done[u] = stamp
            d = distance[u]
            if u < n_members:
                unsettled[member_zone[u]] -= 1
                remaining -= 1
                if load[u] < cap[u]:
                    self._apply(parent, u, origin)
                    return True
                # A full member: any of its replicas may move elsewhere, those it holds from
                # the current assignment at a cost.
                token = -1 - 2 * u
                tokens[token] = (u, d, iter(self.on_new[u]))
                queue.appendleft(token)
                tokens[token - 1] = (u, d + 1, iter(self.on_kept[u]))
                queue.append(token - 1)
            elif u < zi_base:
                # An item: it may add a replica in any zone below its cap.
                j = u - n_members
                base = j * zones
                limit = zone_cap[j]
                for z in range(zones):
                    if zc[base + z] < limit:
                        v = zi_base + base + z
                        if done[v] < stamp and (visit[v] < stamp or d < distance[v]):
                            visit[v] = stamp
                            distance[v] = d
                            parent[v] = u
                            queue.appendleft(v)
            else:
                # An item in a zone: onto a member of that zone not holding it, or back to the
                # item itself (giving up a replica in this zone for one in another).
                k = u - zi_base
                j, z = divmod(k, zones)
                if unsettled[z]:
                    held = hold[j]
                    for m in zone_members[z]:
                        if (
                            done[m] < stamp
                            and m not in held
                            and (visit[m] < stamp or d < distance[m])
                        ):
                            visit[m] = stamp
                            distance[m] = d
                            parent[m] = u
                            queue.appendleft(m)
                if zc[k]:
                    v = n_members + j
                    if done[v] < stamp and (visit[v] < stamp or d < distance[v]):
                        visit[v] = stamp
                        distance[v] = d
                        parent[v] = u
                        queue.appendleft(v)
        for v in distance:
            done[v] = _DEAD
            if v < n_members:
                self.live_in_zone[member_zone[v]] -= 1
                self.live -= 1
        return False

    def _apply(self, parent: dict[int, int], end: int, origin: int) -> None:
        n_members, zones = self.n_members, self.zones
        zi_base = n_members + self.n_items
        moves: list[tuple[bool, int, int]] = []
        v = end
        while v != origin:
            u = parent[v]
            if v < n_members:
                moves.append((True, (u - zi_base) // zones, v))  # item-in-zone -> member
            elif u < n_members:
                moves.append((False, (v - zi_base) // zones, u))  # member -> item-in-zone
            v = u
        # Vacate before occupying, so no member ever holds an item twice.
        for add, j, m in moves:
            if not add:
                self.unplace(j, m)
        for add, j, m in moves:
            if add:
                self.place(j, m)
