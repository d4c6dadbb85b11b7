"""read_committed: messages/s through the read-committed iterator over a journal of 1M 200-byte
JSON messages written in transactions of 100 (four producers in turn). Each message is framed,
decoded to a dict, its UUID parsed and sequenced; the ACKs are read and skipped. Target >= 200,000/s.

`batches` is the same through `read_committed_batches`, a list of committed messages per chunk
read (no per-message iteration step). Reported beside them, from the same run: the raw read of the same journal (no framing or decoding)
in MB/s and the messages/s it would carry, which bounds the iterator."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks._cluster import cluster
from benchmarks._messages import MESSAGE_SIZE, transactions
from broker.client.appender import append
from broker.client.reader import read
from message.framing import JSONLines
from message.publisher import Reader, read_committed, read_committed_batches
from message.types import DictMessages

JOURNAL = "bench/committed"
APPEND_CHUNK = 16 << 20


async def measure(count: int) -> dict[str, Any]:
    data, acks = transactions(count, 100)
    async with cluster(JOURNAL) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        for at in range(0, len(data), APPEND_CHUNK):
            await append(stub, JOURNAL, data[at : at + APPEND_CHUNK])
        end = len(data)

        start = time.perf_counter()
        raw = 0
        async for chunk in read(stub, JOURNAL, 0, end_offset=end):
            raw += len(chunk.content)
        raw_seconds = time.perf_counter() - start
        assert raw == end

        reader = Reader(DictMessages(), JSONLines())
        delivered = seen_acks = 0
        last_id = -1
        start = time.perf_counter()
        async for envelope in read_committed(stub, JOURNAL, reader, end_offset=end):
            if envelope.is_ack:
                seen_acks += 1
                continue
            last_id = envelope.message["id"]  # The message is really decoded and used.
            delivered += 1
        seconds = time.perf_counter() - start
        assert delivered == count, f"delivered {delivered} of {count} messages"
        assert seen_acks == acks and last_id == count - 1 and not reader.errors

        # The bulk iterator: a list of committed messages per chunk read.
        reader = Reader(DictMessages(), JSONLines())
        delivered = 0
        start = time.perf_counter()
        async for batch in read_committed_batches(stub, JOURNAL, reader, end_offset=end):
            for envelope in batch:
                last_id = envelope.message["id"]
            delivered += len(batch)
        batch_seconds = time.perf_counter() - start
        assert delivered == count and last_id == count - 1 and not reader.errors
    return {
        "seconds": seconds,
        "batch_seconds": batch_seconds,
        "raw_seconds": raw_seconds,
        "bytes": end,
    }


def run(quick: bool = False) -> dict[str, Any]:
    count = 100_000 if quick else 1_000_000
    result = asyncio.run(measure(count))
    rate = count / result["seconds"]
    return {
        "value": round(rate),
        "unit": "messages/s",
        "target": 200_000,
        "messages": count,
        "transaction_size": 100,
        "message_bytes": MESSAGE_SIZE,
        "batches": round(count / result["batch_seconds"]),
        "raw_read_mb_per_s": round(result["bytes"] / result["raw_seconds"] / 1e6, 1),
        "raw_read_messages_per_s": round(count / result["raw_seconds"]),
    }


if __name__ == "__main__":
    print(run())
