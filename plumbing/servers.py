"""Options every gRPC server of the project (brokers, consumers, locations) is made with."""

from __future__ import annotations

from typing import Any

# gRPC core cancels a call (CANCELLED, with no detail) that arrives while more calls than
# `grpc.server.max_pending_requests` (default 1,000) wait for the application to take them: some
# calls above it, every call above the hard limit (default 3,000). An asyncio server takes calls
# only as its loop gets to them, so a burst (a consumer process starting 1,667 shards, each
# listing its sources' specs; shard_scale in docs/benchmarks-history.md) was cut off at random,
# and those shards FAILED. Go's gRPC server, upstream's, has no such limit: neither do ours, in
# effect (calls wait their turn, as they do on the loop once taken).
MAX_PENDING_REQUESTS = 1 << 20

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_REQUESTS),
]
