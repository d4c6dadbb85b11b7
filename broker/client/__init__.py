"""Client library for brokers: dialing, listing and applying journal specs."""

from broker.client.journals import (
    ApplyConflict,
    ApplyTooLarge,
    BrokerUnavailable,
    JournalsClient,
    ListSnapshot,
    dial,
)

__all__ = [
    "ApplyConflict",
    "ApplyTooLarge",
    "BrokerUnavailable",
    "JournalsClient",
    "ListSnapshot",
    "dial",
]
