"""The exactly-once step of the demo, as an application would write it: transactional messages
published into a partitioned topic (`topic=orders`, three journals), a batch appended twice as
a retry would, one transaction aborted, and read back read-committed: each committed message
once, none of the aborted ones. Exits non-zero if the reader sees anything else.

Run against a cluster: BROKER_ADDRESS=http://127.0.0.1:PORT python docs/examples/exactly_once.py
"""

from __future__ import annotations

import asyncio
import os
import sys

from rich.console import Console
from rich.table import Table

from broker.client import JournalsClient
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.reader import read
from broker.client.routes import Router
from broker.protocol.labels import parse_selector
from message.framing import JSONLines
from message.mapping import WatchedPartitions, modulo_mapping
from message.publisher import Publisher, Reader, read_committed, read_uncommitted
from message.types import DictMessages


async def main(address: str) -> int:
    console = Console()
    messages, framing = DictMessages(), JSONLines()
    router = Router(address)
    async with (
        JournalsClient(address) as client,
        WatchedPartitions(client, parse_selector("topic=orders")) as partitions,
    ):
        async with asyncio.timeout(30):
            while len(partitions()) < 3:  # The topic was just applied: wait for all of it.
                await partitions.changed()
        by_order = modulo_mapping(lambda m: m["order"].encode(), partitions)

        async with AppendService(router) as service:
            # A checkout: nine orders in one transaction, committed together.
            shop = Publisher(service, messages, framing)
            for n in range(9):
                await shop.publish_uncommitted(by_order, {"order": f"order-{n}", "total": n * 7})
            await shop.commit()
            await service.flush()

            # The answer to that append was lost, so the client retried it: the first partition
            # now holds the checkout's bytes twice (appended again here, byte for byte).
            first = partitions()[0].journal
            stub = router.stub_for(first)
            written = b"".join([chunk.content async for chunk in read(stub, first, 0)])
            await append(stub, first, written)

            # A basket abandoned: its transaction is rolled back, not one message survives.
            basket = Publisher(service, messages, framing)
            for n in range(5):
                await basket.publish_uncommitted(by_order, {"order": f"abandoned-{n}", "total": 1})
            await basket.abort()
            # Refunds, each committed as it is written (outside any transaction).
            refunds = Publisher(service, messages, framing)
            for n in range(3):
                await refunds.publish_committed(by_order, {"order": f"refund-{n}", "total": -n})
            await service.flush()

        table = Table(title="topic=orders, read back")
        columns = ("journal", "messages written", "ACKs", "read committed", "dropped")
        for column in columns:
            table.add_column(column, justify="left" if column == "journal" else "right")
        committed: list[str] = []
        for partition in partitions():
            stub = router.stub_for(partition.journal)
            reader = Reader(messages, framing)
            raw = [e async for e in read_uncommitted(stub, partition.journal, reader)]
            seen = [
                e.message["order"]
                async for e in read_committed(stub, partition.journal, Reader(messages, framing))
                if not e.is_ack
            ]
            committed += seen
            written = sum(not e.is_ack for e in raw)
            acks = len(raw) - written
            table.add_row(
                partition.journal, str(written), str(acks), str(len(seen)), str(written - len(seen))
            )
        console.print(table)
    await router.close()

    expected = sorted([f"order-{n}" for n in range(9)] + [f"refund-{n}" for n in range(3)])
    if sorted(committed) != expected:
        console.print(f"[red]read committed saw {sorted(committed)}, expected {expected}")
        return 1
    console.print(
        f"read committed: {len(committed)} messages, each committed one exactly once; "
        "none of the 5 abandoned; the retried append's copies dropped"
    )
    return 0


if __name__ == "__main__":
    address = os.environ.get("BROKER_ADDRESS")
    if not address:
        sys.exit("set BROKER_ADDRESS to a broker's address (gazctl dev up prints it)")
    sys.exit(asyncio.run(main(address)))
