"""The allocator leader's work in one round, without etcd: solving the desired assignment of
10,000 journals (replication 3) over 30 brokers in 3 zones, and planning the convergence.

`value` is a full solve from no assignments; extras time its convergence plan, re-solving and
re-planning after a broker is replaced, deriving a State, and a settled cluster's idle round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from allocator import keyspace as aks
from allocator.converge import plan
from allocator.solver import solve
from allocator.state import State
from broker.keyspace import broker_decoder, broker_rules
from broker.protocol import protocol_pb2 as pb
from keyspace import KeyValue

ROOT = "/gazette/cluster"
JOURNALS = 10_000
BROKERS = 30
ZONES = 3
REPLICATION = 3
LIMIT = 1024  # gazette serve's default --broker.limit.


class Keys:
    """KeyValues as the keyspace would hold them, with increasing revisions."""

    def __init__(self) -> None:
        self.decode = broker_decoder(ROOT)
        self.revision = 0

    def kv(self, key: str, raw: bytes, lease: int = 0) -> KeyValue:
        self.revision += 1
        return KeyValue(key, raw, self.decode(key, raw), self.revision, self.revision, 1, lease)


def broker(keys: Keys, zone: str, suffix: str, lease: int) -> KeyValue:
    spec = pb.BrokerSpec(journal_limit=LIMIT)
    spec.process_spec.id.zone, spec.process_spec.id.suffix = zone, suffix
    spec.process_spec.endpoint = f"http://{suffix}:8080"
    return keys.kv(aks.member_key(ROOT, zone, suffix), spec.SerializeToString(), lease)


def cluster(journals: int) -> tuple[Keys, list[KeyValue], list[KeyValue]]:
    keys = Keys()
    members = [
        broker(keys, f"zone-{b % ZONES}", f"broker-{b:03d}", 1000 + b) for b in range(BROKERS)
    ]
    items = []
    for j in range(journals):
        name = f"examples/events/part-{j:05d}"
        spec = pb.JournalSpec(name=name, replication=REPLICATION)
        items.append(keys.kv(aks.item_key(ROOT, name), spec.SerializeToString()))
    return keys, sorted(members, key=lambda kv: kv.key), items


def build(
    members: list[KeyValue], items: list[KeyValue], assignments: list[KeyValue], revision: int
) -> State:
    local = members[0].key
    return State.build(
        ROOT,
        revision,
        local,
        broker_rules(),
        items=items,
        members=members,
        assignments=sorted(assignments, key=lambda kv: kv.key),
    )


def settled(keys: Keys, state: State, desired: tuple[tuple[int, ...], ...]) -> list[KeyValue]:
    """Assignments exactly as `desired`, primaries as the converge plan chose them, every one
    holding its journal's route (consistent)."""
    out = []
    txns = plan(state, desired).txns
    slots: dict[tuple[str, str, str], int] = {}
    for txn in txns:
        for op in txn.ops:
            item, zone, suffix, slot = op.key.removeprefix(ROOT + aks.ASSIGNMENTS).split("#")
            slots[(item, zone, suffix)] = int(slot)
    for i, members in enumerate(desired):
        item_id = state.item_ids[i]
        route = pb.Route(primary=-1)
        ids = [state.member_ids[m] for m in members]
        for n, (zone, suffix) in enumerate(ids):
            route.members.add(zone=zone, suffix=suffix)
            if slots[(item_id, zone, suffix)] == 0:
                route.primary = n
        raw = route.SerializeToString()
        for m, (zone, suffix) in zip(members, ids, strict=True):
            key = aks.assignment_key(ROOT, item_id, zone, suffix, slots[(item_id, zone, suffix)])
            out.append(keys.kv(key, raw, state.members[m].lease))
    return out


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


def run(quick: bool = False) -> dict[str, Any]:
    journals = 1000 if quick else JOURNALS
    repeat = 1 if quick else 3
    keys, members, items = cluster(journals)

    # From scratch: no assignment exists.
    empty = build(members, items, [], keys.revision)
    t_solve, solution = timed(lambda: solve(empty.problem()), repeat)
    assert solution.placed == journals * REPLICATION
    t_plan, first = timed(lambda: plan(empty, solution.assignments), repeat)
    assert first.added == journals * REPLICATION

    # Settled, then one broker replaced: its key gone (with its assignments) and a new one in
    # its zone. The solver moves its replicas and rebalances onto the newcomer.
    assignments = settled(keys, empty, solution.assignments)
    gone = members[0]
    zone, suffix = gone.key.removeprefix(ROOT + aks.MEMBERS).split("#")
    survivors = [kv for kv in assignments if f"#{zone}#{suffix}#" not in kv.key]
    newcomer = broker(keys, zone, "broker-new", 2000)
    rolled = sorted([*members[1:], newcomer], key=lambda kv: kv.key)
    t_state, state = timed(lambda: build(rolled, items, survivors, keys.revision), repeat)
    t_resolve, again = timed(lambda: solve(state.problem()), repeat)
    assert again.placed == journals * REPLICATION
    t_replan, second = timed(lambda: plan(state, again.assignments), repeat)

    # Every round of a settled cluster plans from a fresh State and finds nothing to do.
    def settled_round() -> int:
        fresh = build(members, items, assignments, keys.revision)
        return len(plan(fresh, solution.assignments).txns)

    t_idle, idle_txns = timed(settled_round, repeat)
    assert idle_txns == 0

    return {
        "value": t_solve,
        "unit": "s",
        "converge": t_plan,
        "solve_replaced": t_resolve,
        "converge_replaced": t_replan,
        "state_build": t_state,
        "idle_round": t_idle,
        "txns": len(first.txns),
        "moved_replicas": second.added,
    }


def main() -> None:
    result = run()
    print(f"allocator_round  {result['value']:.3f} s  ({JOURNALS} journals x{REPLICATION}, "
          f"{BROKERS} brokers in {ZONES} zones, solve from scratch)")  # fmt: skip
    for key, value in result.items():
        if key not in ("value", "unit"):
            print(f"  {key}: {value:.3f} s" if isinstance(value, float) else f"  {key}: {value}")


if __name__ == "__main__":
    main()
