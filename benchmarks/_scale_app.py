"""shard_scale's consumer application: each shard counts the messages of its sources in a
JSON-file store under $CONSUMER_STORE_ROOT, the least an application can keep. Run as
`python -m consumer serve --app benchmarks._scale_app:Counter`; the benchmark appends nothing,
so what its processes cost is the shards' own keep (a store, a transaction loop and a blocking
read of each source)."""

from __future__ import annotations

import os
from typing import Any

from consumer.store import JSONFileStore
from consumer.transaction import Shard
from message.publisher import Publisher
from message.sequencer import Envelope


class Counter:
    def __init__(self) -> None:
        self.root = os.environ["CONSUMER_STORE_ROOT"]

    async def new_store(self, shard: Shard) -> JSONFileStore:
        return JSONFileStore(self.root, shard.spec.id)

    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        store.state["messages"] = store.state.get("messages", 0) + 1

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None
