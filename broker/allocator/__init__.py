"""Assignment of items (journals, shards) to members (brokers, consumers) through etcd.

`allocate` runs the loop; `State`, `solve` and `plan` are its pure parts, usable on their own.
"""

from broker.allocator.allocate import MemberKeyMissing, Round, allocate, drained
from broker.allocator.converge import MAX_TXN_OPS, Compare, Delete, Plan, Put, Txn, plan
from broker.allocator.rules import (
    DEFAULT_MAX_REPLICATION,
    Rules,
    broker_rules,
    journal_desired_replication,
    journal_is_consistent,
)
from broker.allocator.solver import Problem, Solution, fair_shares, solve
from broker.allocator.state import State

__all__ = [
    "DEFAULT_MAX_REPLICATION",
    "MAX_TXN_OPS",
    "Compare",
    "Delete",
    "MemberKeyMissing",
    "Plan",
    "Problem",
    "Put",
    "Round",
    "Rules",
    "Solution",
    "State",
    "Txn",
    "allocate",
    "broker_rules",
    "drained",
    "fair_shares",
    "journal_desired_replication",
    "journal_is_consistent",
    "plan",
    "solve",
]
