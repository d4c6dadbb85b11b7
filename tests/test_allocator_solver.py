"""The allocator's solver, pure and fast: properties against an independent max-flow reference on
small problems, plus worked examples (upstream's scenarios, scale) checked for the same laws."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.solver import Problem, Solution, fair_shares, solve

# ---- an independent reference: Edmonds-Karp on the explicit flow network --------------------


def _max_flow(nodes: int, edges: list[tuple[int, int, int]], source: int, sink: int) -> int:
    adjacent: list[list[int]] = [[] for _ in range(nodes)]
    head: list[int] = []
    residual: list[int] = []
    for u, v, capacity in edges:
        adjacent[u].append(len(head))
        head.append(v)
        residual.append(capacity)
        adjacent[v].append(len(head))
        head.append(u)
        residual.append(0)
    flow = 0
    while True:
        via = [-1] * nodes
        via[source] = -2
        queue = deque([source])
        while queue and via[sink] == -1:
            u = queue.popleft()
            for e in adjacent[u]:
                if residual[e] > 0 and via[head[e]] == -1:
                    via[head[e]] = e
                    queue.append(head[e])
        if via[sink] == -1:
            return flow
        v, bottleneck = sink, 1 << 30
        while v != source:
            bottleneck = min(bottleneck, residual[via[v]])
            v = head[via[v] ^ 1]
        v = sink
        while v != source:
            residual[via[v]] -= bottleneck
            residual[via[v] ^ 1] += bottleneck
            v = head[via[v] ^ 1]
        flow += bottleneck


def reference_max(
    replication: Sequence[int],
    zones: Sequence[str],
    limits: Sequence[int],
    zone_cap: Callable[[int], int] | None = None,
) -> int:
    """Most replicas any assignment places: item -> item-in-zone (capped by `zone_cap(r)`, else
    unconstrained) -> member (one replica per member) -> sink (member limit)."""
    active = [m for m, limit in enumerate(limits) if limit > 0]
    names = sorted({zones[m] for m in active})
    n, z = len(replication), len(names)
    first_zone_item, first_member = 2 + n, 2 + n + n * z
    edges = []
    for i, r in enumerate(replication):
        edges.append((0, 2 + i, r))
        for k, name in enumerate(names):
            node = first_zone_item + i * z + k
            edges.append((2 + i, node, r if zone_cap is None else zone_cap(r)))
            edges.extend((node, first_member + m, 1) for m in active if zones[m] == name)
    edges.extend((first_member + m, 1, limits[m]) for m in active)
    return _max_flow(first_member + len(limits), edges, 0, 1)


def spread_cap(r: int) -> int:
    return max(r - 1, 1)


# ---- laws every solution obeys --------------------------------------------------------------


def capped(problem: Problem) -> list[int]:
    active = sum(1 for limit in problem.limits if limit > 0)
    return [min(r, active) for r in problem.replication]


def zone_count(problem: Problem) -> int:
    return len({z for z, limit in zip(problem.zones, problem.limits, strict=True) if limit > 0})


def check_valid(problem: Problem, solution: Solution) -> None:
    assert len(solution.assignments) == len(problem.replication)
    for r, members in zip(problem.replication, solution.assignments, strict=True):
        assert list(members) == sorted(set(members)), "members are distinct and ordered"
        assert len(members) <= r
        assert all(problem.limits[m] > 0 for m in members), "no member without capacity"
    loads = solution.loads(len(problem.limits))
    assert all(load <= limit for load, limit in zip(loads, problem.limits, strict=True))
    assert solution.placed == sum(len(a) for a in solution.assignments)
    assert solution.wanted == sum(capped(problem))


def spread(problem: Problem, members: Sequence[int]) -> bool:
    return len({problem.zones[m] for m in members}) >= 2


def check_laws(problem: Problem, solution: Solution) -> None:
    check_valid(problem, solution)
    want = capped(problem)
    # Maximal: as many replicas as any assignment could place.
    best = reference_max(want, problem.zones, problem.limits)
    assert solution.placed == best
    # Zone spread whenever some maximal assignment spreads every item.
    if zone_count(problem) >= 2 and (
        reference_max(want, problem.zones, problem.limits, spread_cap) == best
    ):
        for w, members in zip(want, solution.assignments, strict=True):
            if len(members) == w >= 2:
                assert spread(problem, members), f"{members} lies in one zone"
    # Within fair shares (rounded up) whenever every replica fits within them, spread.
    limits = [max(0, limit) for limit in problem.limits]
    loads = solution.loads(len(limits))
    cap = spread_cap if zone_count(problem) >= 2 else None
    fair = fair_shares(limits, sum(want))
    if reference_max(want, problem.zones, fair, cap) == sum(want):
        assert all(load <= share for load, share in zip(loads, fair, strict=True)), (loads, fair)


def holding(problem: Problem) -> list[int]:
    counts = [0] * len(problem.limits)
    for members in problem.current:
        for m in set(members):
            counts[m] += 1
    return counts


@st.composite
def problems(draw: st.DrawFn, max_members: int = 6, max_items: int = 8) -> Problem:
    members = draw(st.integers(0, max_members))
    zones = draw(st.lists(st.sampled_from("abc"), min_size=members, max_size=members))
    limits = draw(st.lists(st.integers(0, 5), min_size=members, max_size=members))
    items = draw(st.integers(0, max_items))
    replication = draw(st.lists(st.integers(0, 4), min_size=items, max_size=items))
    everyone = list(range(members))
    current = [
        draw(st.lists(st.sampled_from(everyone), unique=True, max_size=members)) if members else []
        for _ in range(items)
    ]
    return Problem(replication, zones, limits, current)


@settings(max_examples=400, deadline=None)
@given(problems())
def test_laws(problem: Problem) -> None:
    check_laws(problem, solve(problem))


@settings(max_examples=200, deadline=None)
@given(problems())
def test_complete_solution_is_a_fixed_point(problem: Problem) -> None:
    """Re-solving from a complete, spread solution changes nothing: the leader's target does not
    drift once reached."""
    solution = solve(problem)
    if solution.placed != solution.wanted:
        return
    if zone_count(problem) >= 2 and not all(
        spread(problem, a) for a in solution.assignments if len(a) >= 2
    ):
        return
    again = solve(Problem(problem.replication, problem.zones, problem.limits, solution.assignments))
    assert again.assignments == solution.assignments


@settings(max_examples=200, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_valid_current_assignments_are_kept(problem: Problem, rnd: random.Random) -> None:
    """A current assignment that already satisfies everything (complete, spread, every member
    within its fair share) is returned unchanged, whatever the solver would choose afresh."""
    want = capped(problem)
    fair = fair_shares([max(0, limit) for limit in problem.limits], sum(want))
    # A current assignment built greedily within fair shares from a random member order, kept
    # only if it turns out complete and spread.
    order = [m for m, limit in enumerate(problem.limits) if limit > 0]
    rnd.shuffle(order)
    load = [0] * len(problem.limits)
    current: list[tuple[int, ...]] = []
    for w in want:
        chosen: list[int] = []
        for m in order:
            if len(chosen) < w and load[m] < fair[m]:
                chosen.append(m)
                load[m] += 1
        current.append(tuple(sorted(chosen)))
        order = order[1:] + order[:1]
    if any(len(c) != w for c, w in zip(current, want, strict=True)):
        return
    if zone_count(problem) >= 2:
        for members, w in zip(current, want, strict=True):
            zones = [problem.zones[m] for m in members]
            if w >= 2 and max(zones.count(z) for z in zones) > spread_cap(w):
                return
    solution = solve(Problem(problem.replication, problem.zones, problem.limits, current))
    assert list(solution.assignments) == current


# ---- worked examples --------------------------------------------------------------------------


def test_upstream_initial_allocation() -> None:
    # Items of replication 1, 2, 3 on zone-a (two members of limit 2) and zone-b (limit 4).
    problem = Problem([1, 2, 3], ["zone-a", "zone-a", "zone-b"], [2, 2, 4], [[], [], []])
    solution = solve(problem)
    check_laws(problem, solution)
    assert solution.placed == 6
    assert solution.assignments[2] == (0, 1, 2)
    assert spread(problem, solution.assignments[1])


def test_upstream_issue_157() -> None:
    # Seven items of replication 3 over three members in two zones: each item takes all three.
    problem = Problem([3] * 7, ["zone-a", "zone-a", "zone-b"], [1024] * 3, [[]] * 7)
    solution = solve(problem)
    assert solution.assignments == ((0, 1, 2),) * 7


def test_one_zone_needs_no_spread() -> None:
    problem = Problem([2] * 4, ["a", "a", "a"], [10, 10, 10], [[]] * 4)
    solution = solve(problem)
    check_laws(problem, solution)
    assert solution.placed == 8


def test_spread_relaxed_only_when_it_must_be() -> None:
    # Zone b holds one slot: one item spreads, the other must stay within zone a.
    problem = Problem([2, 2], ["a", "a", "b"], [5, 5, 1], [[], []])
    solution = solve(problem)
    check_laws(problem, solution)
    assert solution.placed == 4
    assert sorted(spread(problem, a) for a in solution.assignments) == [False, True]


def test_moves_make_room() -> None:
    # Item 0 sits on the only member item 1 can use in zone b; the solver moves it to the other
    # zone-b member rather than leave item 1 in one zone.
    problem = Problem([1, 2], ["a", "b", "b"], [1, 1, 1], [[1], [0]])
    solution = solve(problem)
    check_laws(problem, solution)
    assert solution.placed == 3
    assert spread(problem, solution.assignments[1])


def test_replication_above_member_count_is_capped() -> None:
    problem = Problem([5], ["a", "b"], [3, 3], [[]])
    solution = solve(problem)
    assert solution.assignments == ((0, 1),)
    assert solution.wanted == solution.placed == 2


def test_members_without_capacity_are_drained() -> None:
    # Member 1 has an effective limit of 0 (exiting and shed): its replicas go elsewhere.
    problem = Problem([2, 2], ["a", "a", "b", "b"], [5, 0, 5, 5], [[0, 1], [1, 2]])
    solution = solve(problem)
    check_laws(problem, solution)
    assert all(1 not in a for a in solution.assignments)
    assert 2 in solution.assignments[1], "the replica that could stay, stays"


def test_shortage_places_what_fits() -> None:
    problem = Problem([1, 2, 3], ["a"], [1], [[], [], []])
    solution = solve(problem)
    check_laws(problem, solution)
    assert solution.placed == 1


def test_new_member_takes_its_fair_share_and_no_more_moves() -> None:
    # 30 items of replication 1 on three members; a fourth joins.
    current = [[i % 3] for i in range(30)]
    problem = Problem([1] * 30, ["a"] * 4, [100] * 4, current)
    solution = solve(problem)
    check_laws(problem, solution)
    loads = solution.loads(4)
    assert max(loads) - min(loads) <= 1
    moved = sum(1 for a, c in zip(solution.assignments, current, strict=True) if list(a) != c)
    assert moved == loads[3] == 7, "only the new member's share moves"


def test_proportional_to_limits() -> None:
    problem = Problem([1] * 60, ["a", "a", "a"], [10, 20, 30], [[]] * 60)
    solution = solve(problem)
    assert solution.loads(3) == [10, 20, 30]


def test_large_cluster_balanced_and_spread_evenly() -> None:
    zones = [f"zone-{m % 3}" for m in range(30)]
    problem = Problem([3] * 2000, zones, [1024] * 30, [[]] * 2000)
    solution = solve(problem)
    check_valid(problem, solution)
    assert solution.placed == 6000
    assert set(solution.loads(30)) == {200}
    for members in solution.assignments:
        assert sorted(zones[m] for m in members) == ["zone-0", "zone-1", "zone-2"]
    # Replica sets are scattered, not a few sets shared by many items: a lost member's
    # journals then re-replicate from many members, and its partners are not left short.
    assert len(set(solution.assignments)) > 100

    # One member leaves. Its zone is now short of room for one replica of every item within
    # even loads: balance wins over a third zone (two zones remain the guarantee).
    limits = [0] + [1024] * 29
    after = solve(Problem([3] * 2000, zones, limits, solution.assignments))
    check_valid(Problem([3] * 2000, zones, limits, solution.assignments), after)
    loads = after.loads(30)[1:]
    assert max(loads) == fair_shares(limits, 6000)[1] == 207
    assert min(loads) >= 200
    moved = 0
    for before, now in zip(solution.assignments, after.assignments, strict=True):
        assert len(now) == 3 and spread(problem, now)
        moved += len(set(before) - set(now))
    # Only the departed member's replicas move: every other member just gains.
    assert moved == 200
