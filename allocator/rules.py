"""What the allocator needs to know about the specs it allocates: an item's desired replication,
whether an item's replicas are consistent, a member's item limit and whether it is exiting.

Brokers' rules (`broker.keyspace.broker_rules`) read JournalSpec / BrokerSpec / Route, and
consumers' (`consumer.keyspace.consumer_rules`) ShardSpec / ConsumerSpec / ReplicaStatus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from allocator.keyspace import Item, Member
from keyspace import KeyValue

# (item, one of its assignments, all of its assignments) -> is that assignment consistent?
IsConsistent = Callable[[Item, KeyValue, Sequence[KeyValue]], bool]


@dataclass(frozen=True)
class Rules:
    """The spec-reading functions the allocator is parameterized by."""

    desired_replication: Callable[[Item], int]
    is_consistent: IsConsistent
    member_limit: Callable[[Member], int]
    member_exiting: Callable[[Member], bool]
