"""publish: 200-byte JSON messages published committed (OUTSIDE_TXN) through a Publisher and its
AppendService to a journal replicated on three broker processes, messages/s acknowledged.
Target >= 100,000/s.

Baseline in the same run: the same messages (UUIDs included) encoded to the same bytes and
appended as one raw stream, as a hand-rolled writer would: no per-message UUIDs, futures or
batching, just encoding and the cluster's bound for these bytes. Ratio target >= 0.5."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from benchmarks._cluster import cluster
from benchmarks._messages import MESSAGE_SIZE, document
from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.reader import read
from broker.message.framing import DictMessages, JSONLines
from broker.message.mapping import Partition
from broker.message.publisher import Publisher

JOURNAL = "bench/publish"
RAW_CHUNK = 1 << 20


async def measure(duration: float) -> dict[str, Any]:
    async with cluster(JOURNAL) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        partition = Partition(JOURNAL, "application/x-ndjson")

        def mapping(_msg: object) -> Partition:
            return partition

        async with AppendService(stub) as service:
            publisher = Publisher(service, DictMessages(), JSONLines())
            published = 0
            start = time.perf_counter()
            stop = start + duration
            last = None
            while time.perf_counter() < stop:
                for i in range(published, published + 512):
                    last = await publisher.publish_committed(mapping, document(i))
                published += 512
            assert last is not None
            end = (await last).end
            seconds = time.perf_counter() - start
            appends = service.appends

        # The baseline: the messages just published, read back, then encoded again and
        # appended as one stream.
        content = bytearray()
        async for chunk in read(stub, JOURNAL, 0, end_offset=end):
            content += chunk.content
        docs = [msgspec.json.decode(line) for line in content.splitlines()]
        assert len(docs) == published
        start = time.perf_counter()
        encode = msgspec.json.encode
        encoded = b"\n".join([encode(doc) for doc in docs]) + b"\n"
        await append(
            stub,
            JOURNAL,
            (encoded[at : at + RAW_CHUNK] for at in range(0, len(encoded), RAW_CHUNK)),
            chunk_size=RAW_CHUNK,
        )
        raw_seconds = time.perf_counter() - start
        assert encoded == content, "the baseline appended other bytes than were published"
    return {
        "published": published,
        "seconds": seconds,
        "raw_seconds": raw_seconds,
        "bytes": end,
        "appends": appends,
    }


def run(quick: bool = False) -> dict[str, Any]:
    result = asyncio.run(measure(1.0 if quick else 5.0))
    rate = result["published"] / result["seconds"]
    baseline = result["published"] / result["raw_seconds"]
    return {
        "value": round(rate),
        "unit": "messages/s",
        "baseline": round(baseline),
        "ratio": round(rate / baseline, 2),
        "target": 100_000,
        "ratio_target": 0.5,
        "message_bytes": MESSAGE_SIZE,
        "messages": result["published"],
        "mb_per_s": round(result["bytes"] / result["seconds"] / 1e6, 1),
        "raw_mb_per_s": round(result["bytes"] / result["raw_seconds"] / 1e6, 1),
        "messages_per_append": round(result["published"] / max(result["appends"], 1)),
    }


if __name__ == "__main__":
    print(run())
