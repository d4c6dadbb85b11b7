"""Assignment of items (journals, shards) to members (brokers, consumers) through etcd.

`allocate` runs the loop; `State`, `solve` and `plan` are its pure parts, usable on their own.
"""

from allocator.allocate import MemberKeyMissing, Round, allocate, drained
from allocator.converge import MAX_TXN_OPS, Compare, Delete, Plan, Put, Txn, plan
from allocator.rules import Rules
from allocator.solver import Problem, Solution, fair_shares, solve
from allocator.state import State

__all__ = [
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
    "drained",
    "fair_shares",
    "plan",
    "solve",
]
