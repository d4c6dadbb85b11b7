"""Client library for brokers: dialing, listing and applying journal specs."""

from broker.client.journals import (
    ApplyConflict,
    BrokerUnavailable,
    JournalsClient,
    ListSnapshot,
    dial,
)

__all__ = ["ApplyConflict", "BrokerUnavailable", "JournalsClient", "ListSnapshot", "dial"]
