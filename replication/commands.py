"""The topology's authoritative history in etcd, and operator commands checked and recorded
against it (issue 38, items 7 to 9).

etcd holds every change an operator command made, linearizably:

* `PREFIX/topology/OP` (OP zero-padded to 20 digits, so keys sort as numbers): one change, as
  a system event carries it (`replication.system.change_document`), with its `op`;
* `PREFIX/topology-op`: the head, `{"op": N}`, the last op recorded. Every command's record is
  one transaction compared on the head's mod revision: two commands at once cannot both record
  on the same history (the second reads again and checks again).

A command reads the head and the whole history at one revision, folds it into a view, checks
its changes against that view (the rules of `replication.topology`, never an endpoint's partial
view), runs the caller's live checks (which change nothing), and records its changes in one
transaction: all or nothing. Only what etcd holds counts: locations then record it as system
events (`LocationProcess` reads this history when it starts and whenever the head moves), and
never refuse a change etcd recorded.

An op is greater than every earlier one and than the head's mod revision, so the changes an
older gazctl ordered by that revision (the op of `issue_op`) sort before every new command."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aetcd
from aetcd import rpc, transactions

from plumbing import etcd as etcdx
from replication.filters import parse_filter
from replication.system import change_document, change_from
from replication.topology import (
    Change,
    Connected,
    FailedOver,
    Filtered,
    RuleViolation,
    Topology,
    command_key,
)

__all__ = [
    "ATTEMPTS",
    "Command",
    "History",
    "command",
    "connect_etcd",
    "head_key",
    "history_key",
    "read_history",
    "record",
]

# Reads, checks and records of one command when other commands record in between each time.
ATTEMPTS = 5


def head_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/topology-op".encode()


def history_prefix(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/topology/".encode()


def history_key(prefix: str, op: int) -> bytes:
    return history_prefix(prefix) + f"{op:020d}".encode()


def connect_etcd(address: str) -> aetcd.Client:
    return etcdx.connect(address, timeout=10)


@dataclass(frozen=True)
class History:
    """etcd's topology history as of one revision."""

    changes: tuple[tuple[int, Change], ...]  # (op, change), in op order.
    head_revision: int  # The head's mod revision (0: no command ever recorded).
    last_op: int  # The op the head names (0: none).
    revision: int  # The revision it was read at.

    def view(self) -> Topology:
        return Topology.of((command_key(op), change) for op, change in self.changes)

    def next_op(self) -> int:
        return max(self.last_op, self.head_revision, *(op for op, _ in self.changes[-1:])) + 1


async def read_history(etcd: aetcd.Client, prefix: str) -> History:
    """The head and every recorded change, read in one transaction (ValueError naming a key
    that holds no change: etcd's history is not to be skipped over)."""
    await etcd.connect()
    start = history_prefix(prefix)
    end = start[:-1] + bytes([start[-1] + 1])
    request = rpc.TxnRequest(
        compare=[],
        success=[
            rpc.RequestOp(request_range=rpc.RangeRequest(key=head_key(prefix))),
            rpc.RequestOp(request_range=rpc.RangeRequest(key=start, range_end=end)),
        ],
        failure=[],
    )
    try:
        response = await etcdx.uncancelled(
            etcd.kvstub.Txn(request, timeout=etcd._timeout, metadata=etcd.metadata)
        )
    except rpc.AioRpcError as exc:
        aetcd.exceptions._handle_exception(exc)
        raise
    head_kvs = response.responses[0].response_range.kvs
    head_revision, last_op = 0, 0
    if head_kvs:
        head_revision = int(head_kvs[0].mod_revision)
        try:
            last_op = int(json.loads(head_kvs[0].value).get("op", 0))
        except (ValueError, AttributeError, TypeError):
            last_op = 0  # An older gazctl's head (the change itself): its revision orders.
    changes = []
    for kv in response.responses[1].response_range.kvs:
        key = bytes(kv.key).decode()
        try:
            op = int(key[len(start) :])
            body = json.loads(kv.value)
        except ValueError:
            raise ValueError(f"etcd key {key}: not a recorded topology change") from None
        changes.append((op, change_from(body, f"etcd key {key}")))
    changes.sort(key=lambda c: c[0])
    return History(tuple(changes), head_revision, last_op, int(response.header.revision))


async def record(
    etcd: aetcd.Client, prefix: str, history: History, changes: Sequence[Change]
) -> list[int] | None:
    """Record `changes` (no check: the caller checked them) after `history`, in one transaction
    compared on the head's mod revision: their ops, or None if the head moved since `history`
    was read (another command recorded; nothing of these was)."""
    first = history.next_op()
    ops = list(range(first, first + len(changes)))
    puts = []
    for op, c in zip(ops, changes, strict=True):
        body = json.dumps(change_document(c, op), sort_keys=True).encode()
        puts.append(transactions.Put(history_key(prefix, op), body))
    puts.append(transactions.Put(head_key(prefix), json.dumps({"op": ops[-1]}).encode()))
    guard = [transactions.Mod(head_key(prefix)) == history.head_revision]
    result = await etcdx.txn(etcd, guard, puts)
    return ops if result.succeeded else None


@dataclass(frozen=True)
class Command:
    """What a command did: the changes it recorded (with their ops), and the view it checked
    them against with them made (etcd's history as of its record)."""

    recorded: list[tuple[int, Change]]
    view: Topology


def check(view: Topology, change: Change) -> bool:
    """`change` checked on `view` (filters parsed too): False if it is in effect already."""
    if isinstance(change, Connected | Filtered | FailedOver):
        parse_filter(change.filter)  # FilterError (a ValueError) if it does not parse.
    return view.check_change(change)


async def command(
    etcd: aetcd.Client,
    prefix: str,
    plan: Callable[[Topology], Sequence[Change]],
    live_check: Callable[[Sequence[Change]], Awaitable[None]] | None = None,
) -> Command:
    """One operator command: `plan(view)` gives its changes on etcd's view; each is checked on
    that view with the ones before it made (a refusal raises, and nothing is recorded); those
    not in effect already go through `live_check` (which changes nothing) and are recorded in
    one transaction. A command that another recorded in between is read, planned and checked
    again (up to ATTEMPTS times, then refused in one line)."""
    for _ in range(ATTEMPTS):
        history = await read_history(etcd, prefix)
        view = history.view()
        todo = []
        for change in plan(view):
            if check(view, change):
                view.apply(change)
                todo.append(change)
        if not todo:
            return Command([], view)
        if live_check is not None:
            await live_check(todo)
        ops = await record(etcd, prefix, history, todo)
        if ops is not None:
            return Command(list(zip(ops, todo, strict=True)), view)
    raise RuleViolation(
        f"other topology changes were recorded while this one was checked, {ATTEMPTS} times: "
        "run it again"
    )
