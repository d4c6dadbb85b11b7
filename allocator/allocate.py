"""The allocator loop every member runs: whenever the keyspace changes, the leader (the member
with the oldest key) solves for a desired assignment and converges etcd toward it.

`allocate` returns once the local member is exiting and holds no assignment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aetcd
import grpc
from aetcd import transactions

from allocator import keyspace as aks
from allocator.converge import MAX_TXN_OPS, Plan, Put, Txn, plan
from allocator.keyspace import Assignment, Member
from allocator.rules import Rules
from allocator.solver import solve
from allocator.state import State
from keyspace import KeySpace
from plumbing import etcd as etcdx
from plumbing import metrics

log = logging.getLogger(__name__)


class MemberKeyMissing(RuntimeError):
    """The local member key is not in the keyspace: its lease is gone, or it never announced."""


async def drained(
    allocator: asyncio.Task[None], ks: KeySpace, root: str, member_key: str, timeout: float
) -> bool:
    """For an exiting member: until its `allocate` task returns (its items moved elsewhere),
    `timeout` seconds pass, or no live member of its kind (brokers', consumers') is left that
    could take its items (then waiting cannot help). False only when the timeout passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    mine = ks.get(member_key)
    kind = (
        type(mine.decoded.spec) if mine is not None and isinstance(mine.decoded, Member) else None
    )
    while not allocator.done() and loop.time() < deadline:
        others = [
            kv
            for kv in ks.prefixed(root + aks.MEMBERS)
            if kv.key != member_key
            and isinstance(kv.decoded, Member)
            and (kind is None or isinstance(kv.decoded.spec, kind))
            and not _spec_exiting(kv.decoded.spec)
        ]
        if not others:
            return True
        await asyncio.wait({allocator}, timeout=min(0.25, deadline - loop.time()))
    return allocator.done()


def _spec_exiting(spec: Any) -> bool:
    """A BrokerSpec's or ConsumerSpec's `exiting`, which both carry."""
    return bool(spec.exiting)


@dataclass(frozen=True)
class Round:
    """What one pass of the loop did, as given to `on_round`."""

    number: int
    # Keyspace revision the round was planned from.
    revision: int
    leader: bool
    # Transactions applied.
    txns: int
    # The leader found nothing to do: the desired assignment is reached, or what remains
    # waits on consistency or limits.
    idle: bool
    # Why the round stopped early (a failed comparison or an etcd error), else None.
    error: str | None = None


async def allocate(
    ks: KeySpace,
    client: aetcd.Client,
    root: str,
    member_key: str,
    *,
    rules: Rules,
    max_txn_ops: int = MAX_TXN_OPS,
    retry_delay: float = 1.0,
    on_round: Callable[[Round], None] | None = None,
    settle: float = 0.05,
) -> None:
    """Allocate the items under `root` for as long as the member `member_key` is needed.

    `ks` mirrors `root` (decoded with the allocator layout) and is kept current by a watch the
    caller runs; `member_key` must already be in it. Returns once that member is exiting and
    holds no assignment; raises MemberKeyMissing if its key disappears. Cancel to stop: no task
    is left behind.

    `rules` reads specs (brokers': `broker.keyspace.broker_rules`; consumers':
    `consumer.keyspace.consumer_rules`); `max_txn_ops` bounds each transaction's operations and comparisons
    (etcd's --max-txn-ops); after an etcd error a round is retried within `retry_delay` seconds;
    `on_round`, if given, is called after every pass with what it did (tests wait on it);
    after each change the loop waits `settle` seconds, so a burst of changes costs one round.

    The leader caches its solution while items, members and effective limits are unchanged, and
    keeps converging toward it: re-solving on every assignment change would chase a target
    that shifts as replicas move.
    """
    desired: Sequence[Sequence[int]] = ()
    desired_for: tuple[Any, ...] | None = None
    number = 0
    while True:
        revision = ks.revision
        # The keyspace must move past this revision before there is anything new to do.
        wait_for = revision + 1
        timeout: float | None = None
        role = _role(ks, root, member_key, rules)
        if role == "done":
            break
        busy = 0.0  # Seconds this round held the event loop (building its state, planning).
        if role == "leader":
            began = time.perf_counter()
            state = State.from_keyspace(ks, root, member_key, rules)
            busy += time.perf_counter() - began
            if state.should_exit:
                break
            if state.network_key != desired_for:
                # Solving is pure CPU on an immutable snapshot: a worker thread keeps the
                # broker's event loop (and its RPCs) responsive meanwhile.
                desired = await asyncio.get_running_loop().run_in_executor(None, _solve, state)
                desired_for = state.network_key
            began = time.perf_counter()
            round_plan = plan(state, desired, max_ops=max_txn_ops)
            busy += time.perf_counter() - began
            applied, applied_at, error = await _apply_plan(state, round_plan, client)
            wait_for = max(wait_for, applied_at)
            if error is not None:
                log.warning("allocator round %d at revision %d: %s", number, revision, error)
                timeout = retry_delay
            if on_round is not None:
                idle = applied == 0 and error is None
                on_round(Round(number, revision, True, applied, idle, error))
        else:
            desired_for = None  # Leading again later starts from a fresh solution.
            if on_round is not None:
                on_round(Round(number, revision, False, 0, False))
        number += 1
        # After an etcd failure, retry even if nothing changes meanwhile.
        with contextlib.suppress(TimeoutError):
            await ks.wait_for_revision(wait_for, timeout)
        if settle > 0 or busy > 0:
            # Changes come in bursts (an apply of many journals, a rolling restart): one
            # round after the burst beats a round per change. A round's state and plan are
            # built on the event loop, in time linear in the keyspace (about a second at
            # 50,000 journals): waiting at least as long again keeps the rounds to half the
            # loop, while every pulse's assignment write is a change that calls for one.
            await asyncio.sleep(max(settle, busy))
    log.info("allocator: %s is exiting and holds no assignments; done", member_key)


def _role(
    ks: KeySpace, root: str, member_key: str, rules: Rules
) -> Literal["leader", "follower", "done"]:
    """The local member's part this round; "done" is an exiting follower holding nothing.
    Decided from the members alone where possible: followers look on every keyspace change."""
    local = ks.get(member_key)
    if local is None or not isinstance(local.decoded, Member):
        raise MemberKeyMissing(f"member key {member_key} is not in the keyspace")
    members = ks.prefixed(root + aks.MEMBERS)
    leader = min(members, key=lambda kv: (kv.create_revision, kv.key))
    if leader.key == member_key:
        return "leader"
    if not rules.member_exiting(local.decoded):
        return "follower"
    me = (local.decoded.zone, local.decoded.suffix)
    for kv in ks.prefixed(root + aks.ASSIGNMENTS):
        a = kv.decoded
        if isinstance(a, Assignment) and (a.member_zone, a.member_suffix) == me:
            return "follower"
    return "done"


# The last count of unplaceable replicas warned about: repeat the warning only when it changes.
_last_unplaced = [0]


def _solve(state: State) -> Sequence[Sequence[int]]:
    problem = state.problem()
    started = time.perf_counter()
    solution = solve(problem)
    elapsed = time.perf_counter() - started
    added = removed = 0
    for current, want in zip(problem.current, solution.assignments, strict=True):
        added += len(set(want) - set(current))
        removed += len(set(current) - set(want))
    metrics.allocator_converge.inc()
    metrics.allocator_max_flow_seconds.observe(elapsed)
    metrics.allocator_items.set(len(state.items))
    metrics.allocator_members.set(len(state.members))
    metrics.allocator_assignment_added.inc(added)
    metrics.allocator_assignment_removed.inc(removed)
    log.info(
        "allocator: solved %d items on %d members at revision %d in %.3fs: "
        "%d of %d replicas placed, %d to add, %d to remove",
        len(state.items), len(state.members), state.revision, elapsed,
        solution.placed, solution.wanted, added, removed,
    )  # fmt: skip
    if solution.placed < solution.wanted and solution.wanted - solution.placed != _last_unplaced[0]:
        _last_unplaced[0] = solution.wanted - solution.placed
        log.warning(
            "allocator: %d replicas cannot be placed (too few members, zones or slots)",
            solution.wanted - solution.placed,
        )
    return solution.assignments


async def _converge(
    state: State, desired: Sequence[Sequence[int]], client: aetcd.Client, max_ops: int
) -> tuple[int, int, str | None]:
    """Apply a round's transactions in order. Returns how many applied, the revision of the
    last one (0 if none) and why it stopped early, if it did."""
    return await _apply_plan(state, plan(state, desired, max_ops=max_ops), client)


async def _apply_plan(
    state: State, round_plan: Plan, client: aetcd.Client
) -> tuple[int, int, str | None]:
    """`_converge` for a plan already made."""
    if round_plan.txns:
        log.debug(
            "allocator: round at revision %d: %d txns, +%d -%d ~%d, %d removals deferred",
            state.revision, len(round_plan.txns), round_plan.added, round_plan.removed,
            round_plan.moved, round_plan.deferred,
        )  # fmt: skip
    revision = 0
    for applied, txn in enumerate(round_plan.txns):
        compares, ops = _to_etcd(txn)
        try:
            result = await etcdx.txn(client, compares, ops)
        except (aetcd.ClientError, grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
            return applied, revision, f"etcd transaction failed: {exc}"
        if not result.succeeded:
            # The keyspace changed under the plan (or leadership moved): re-plan from the
            # state that includes the change. Its revision is unknown, so it is not awaited.
            return applied, revision, "transaction comparisons failed; re-planning"
        revision = result.revision
    return len(round_plan.txns), revision, None


def _to_etcd(txn: Txn) -> tuple[list[Any], list[Any]]:
    compares: list[Any] = []
    for c in txn.compares:
        target = transactions.Mod if c.target == "mod" else transactions.Create
        compares.append(target(c.key.encode()) == c.revision)
    ops: list[Any] = []
    for op in txn.ops:
        if isinstance(op, Put):
            ops.append(transactions.Put(op.key.encode(), op.value, lease=op.lease))
        else:
            ops.append(transactions.Delete(op.key.encode()))
    return compares, ops
