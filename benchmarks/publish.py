"""publish: 200-byte JSON messages published committed (OUTSIDE_TXN) through a Publisher and its
AppendService to a journal replicated on three broker processes, messages/s acknowledged.
Target >= 100,000/s. The value publishes lists of messages (`publish_committed_many`); the rate
of one `publish_committed` call per message is reported beside it (`one_at_a_time`).

Baseline in the same run: the same messages (UUIDs included) encoded to the same bytes and
appended as one raw stream, as a hand-rolled writer would: no per-message UUIDs, futures or
batching, just encoding and the cluster's bound for these bytes. Ratio target >= 0.8.

A full run alternates three rounds of each on one cluster (each baseline round re-encodes what
the round before it published) and reports each side's median round and the median of the
rounds' own ratios; every pair is listed. `--quick` runs one pair."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

import msgspec

from benchmarks._cluster import cluster
from benchmarks._messages import MESSAGE_SIZE, document
from benchmarks._rounds import median_round, paired
from broker.client.append_service import AppendService, PendingSpan
from broker.client.appender import append
from broker.client.reader import read
from broker.protocol import protocol_pb2_grpc as pb_grpc
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher
from message.types import DictMessages

JOURNAL = "bench/publish"
RAW_CHUNK = 1 << 20
BATCH = 512


async def _publish(publisher: Publisher[Any], first: int, duration: float, many: bool) -> dict[str, Any]:  # fmt: skip
    """Publish documents numbered from `first` for `duration` seconds, timed until the last is
    committed: lists of BATCH (`many`) or one call per message."""
    partition = Partition(JOURNAL, "application/x-ndjson")

    def mapping(_msg: object) -> Partition:
        return partition

    published = 0
    last: PendingSpan | None = None
    os.sync()  # Each timed phase starts without the one before's writeback to pay.
    start = time.perf_counter()
    stop = start + duration
    while time.perf_counter() < stop:
        if many:
            docs = [document(i) for i in range(first + published, first + published + BATCH)]
            (last,) = await publisher.publish_committed_many(mapping, docs)
        else:
            for i in range(first + published, first + published + BATCH):
                last = await publisher.publish_committed(mapping, document(i))
        published += BATCH
    assert last is not None
    span = await last
    seconds = time.perf_counter() - start
    return {"value": published / seconds, "published": published, "end": span.end}


async def _baseline(stub: pb_grpc.JournalStub, begin: int, end: int, count: int) -> dict[str, Any]:  # fmt: skip
    """The messages of [begin, end), read back, encoded again and appended as one stream."""
    content = bytearray()
    async for chunk in read(stub, JOURNAL, begin, end_offset=end):
        content += chunk.content
    docs = [msgspec.json.decode(line) for line in content.splitlines()]
    assert len(docs) == count
    # The documents decoded for the check are the benchmark's, not the writer's: kept out of
    # the collector's full passes, which would otherwise walk every one of them.
    gc.freeze()
    os.sync()
    start = time.perf_counter()
    encode = msgspec.json.encode
    encoded = b"\n".join([encode(doc) for doc in docs]) + b"\n"
    await append(
        stub,
        JOURNAL,
        (encoded[at : at + RAW_CHUNK] for at in range(0, len(encoded), RAW_CHUNK)),
        chunk_size=RAW_CHUNK,
    )
    seconds = time.perf_counter() - start
    gc.unfreeze()
    assert encoded == content, "the baseline appended other bytes than were published"
    return {"value": count / seconds, "bytes_per_s": len(encoded) / seconds}


async def measure(duration: float, pairs: int) -> dict[str, Any]:
    async with cluster(JOURNAL) as (addresses, dialer):
        stub = dialer.journal_stub(addresses[0])
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        async with AppendService(stub) as service:
            publisher = Publisher(service, DictMessages(), JSONLines())
            begin = first = 0
            for _ in range(pairs):
                mine = await _publish(publisher, first, duration, many=True)
                mine["bytes_per_s"] = (mine["end"] - begin) / (mine["published"] / mine["value"])
                ours.append(mine)
                # Nothing else is written meanwhile: the round's messages are [begin, end).
                theirs.append(await _baseline(stub, begin, mine["end"], mine["published"]))
                # The baseline appended the same bytes again after them.
                begin = mine["end"] + (mine["end"] - begin)
                first += mine["published"]
            singles = await _publish(publisher, first, duration / 2, many=False)
            appends = service.appends
    return {"ours": ours, "theirs": theirs, "singles": singles, "appends": appends}


def run(quick: bool = False) -> dict[str, Any]:
    duration, pairs = (1.0, 1) if quick else (4.0, 3)
    result = asyncio.run(measure(duration, pairs))
    ours, theirs = result["ours"], result["theirs"]
    mine, base = median_round(ours), median_round(theirs)
    pair_ratio, rounds = paired(ours, theirs)
    published = sum(r["published"] for r in ours)
    return {
        "value": round(mine["value"]),
        "unit": "messages/s",
        "baseline": round(base["value"]),
        "ratio": round(mine["value"] / base["value"], 2),
        "pair_ratio": pair_ratio,
        "rounds": rounds,
        "target": 100_000,
        "ratio_target": 0.8,
        "message_bytes": MESSAGE_SIZE,
        "batch": BATCH,
        "messages": published,
        "mb_per_s": round(mine["bytes_per_s"] / 1e6, 1),
        "raw_mb_per_s": round(base["bytes_per_s"] / 1e6, 1),
        "messages_per_append": round(
            (published + result["singles"]["published"]) / max(result["appends"], 1)
        ),
        "one_at_a_time": round(result["singles"]["value"]),
        "one_at_a_time_ratio": round(result["singles"]["value"] / base["value"], 2),
    }


if __name__ == "__main__":
    print(run())
