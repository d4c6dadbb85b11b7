"""The worked example of docs/applications.md, "Testing an application" (the guide quotes this
file whole; tests/test_docs.py checks that it does): an application's own tests with the test
kit's fixtures, in-process and as processes."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

from broker.testing import BrokerHarness, BrokerProcess
from consumer.store import JSONFileStore
from consumer.testing import (
    ConsumerGroup,
    apply_shards,
    create_journals,
    journal_spec,
    publish,
    read_committed_messages,
    shard_spec,
)
from consumer.transaction import Shard
from message.mapping import Partition
from message.publisher import Publisher
from message.sequencer import Envelope


class WordTotals:
    """Counts words in a JSON-file store per shard, and publishes each word's new total to the
    journal named by the shard's `totals` label, in the shard's transaction."""

    def __init__(self, store_root: str | None = None) -> None:
        # As a process (`python -m consumer serve --app ...`), from its environment.
        self.store_root = store_root or os.environ["CONSUMER_STORE_ROOT"]

    async def new_store(self, shard: Shard) -> JSONFileStore:
        return JSONFileStore(self.store_root, shard.spec.id)

    async def consume_message(
        self, shard: Shard, store: JSONFileStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        word = envelope.message["word"]
        store.state[word] = store.state.get(word, 0) + 1
        totals = next(x.value for x in shard.spec.labels.labels if x.name == "totals")
        await publisher.publish_uncommitted(
            lambda _m: Partition(totals, "application/x-ndjson"),
            {"word": word, "total": store.state[word]},
        )

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None


def totals_of(messages: list[dict[str, Any]], word: str) -> list[int]:
    return [m["total"] for m in messages if m["word"] == word]


async def set_up(broker: str, consumer: str, name: str, hot_standbys: int = 0) -> None:
    """The journals `name/words` and `name/totals`, and a shard reading the words."""
    await create_journals(broker, [journal_spec(f"{name}/words"), journal_spec(f"{name}/totals")])
    spec = shard_spec(
        f"{name}-words", [f"{name}/words"], hot_standbys=hot_standbys,
        labels=[("totals", f"{name}/totals")],
    )  # fmt: skip
    await apply_shards(consumer, [spec])


async def test_every_word_is_counted_once(
    gazette_broker: BrokerHarness, gazette_consumers: ConsumerGroup, tmp_path: Path
) -> None:
    consumer = await gazette_consumers.start(WordTotals(str(tmp_path)))
    await set_up(gazette_broker.endpoint, consumer.endpoint, "guide")
    words = [{"word": w} for w in ["to", "be", "or", "not", "to", "be"]]
    await publish(gazette_broker.endpoint, "guide/words", words)

    totals = await read_committed_messages(gazette_broker.endpoint, "guide/totals", count=6)
    assert totals_of(totals, "to") == [1, 2] and totals_of(totals, "or") == [1]


async def test_a_standby_takes_over_and_counts_on(
    gazette_broker: BrokerHarness, gazette_consumers: ConsumerGroup, tmp_path: Path
) -> None:
    # Three consumers: when the primary leaves, its standby takes over and the third becomes
    # the new standby (a shard never drops below its replicas to let a consumer go).
    for _ in range(3):
        await gazette_consumers.start(WordTotals(str(tmp_path)))
    await set_up(gazette_broker.endpoint, gazette_consumers.address, "guide", hot_standbys=1)
    await publish(gazette_broker.endpoint, "guide/words", [{"word": "to"}] * 3)
    await read_committed_messages(gazette_broker.endpoint, "guide/totals", count=3)

    # The primary leaves gracefully; its standby becomes primary and restores the store.
    await gazette_consumers.stop(gazette_consumers.primary_of("guide-words"))
    await publish(gazette_broker.endpoint, "guide/words", [{"word": "to"}] * 2, transaction=True)
    totals = await read_committed_messages(gazette_broker.endpoint, "guide/totals", count=5)
    assert totals_of(totals, "to") == [1, 2, 3, 4, 5]  # Each word once, none twice.


def test_a_killed_consumer_process_loses_nothing(
    gazette_broker_process: BrokerProcess, gazette_consumer_processes: Any, tmp_path: Path
) -> None:
    group = gazette_consumer_processes(
        app="tests.test_application_guide:WordTotals",
        env={"CONSUMER_STORE_ROOT": str(tmp_path)},
    )
    group.start("counter-a")
    name, broker = f"guide-{uuid.uuid4().hex[:8]}", gazette_broker_process.address
    asyncio.run(set_up(broker, group.address("counter-a"), name))
    asyncio.run(publish(broker, f"{name}/words", [{"word": "be"}] * 3))
    asyncio.run(read_committed_messages(broker, f"{name}/totals", count=3))

    group.kill("counter-a")  # SIGKILL: counter-b takes the shard once counter-a's lease ends.
    group.start("counter-b")
    asyncio.run(publish(broker, f"{name}/words", [{"word": "be"}] * 2))
    totals = asyncio.run(read_committed_messages(broker, f"{name}/totals", count=5))
    assert totals_of(totals, "be") == [1, 2, 3, 4, 5]
