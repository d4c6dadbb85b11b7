"""Gazette consumers: shards that read journals, run transactions against a store and commit
their state with a checkpoint, exactly once (upstream's `consumer` package).

Built on the public parts of `broker` (its client, protocol, keyspace, allocator and message
packages), never on the broker server's internals.
"""
