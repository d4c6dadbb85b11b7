"""spark_replay: messages/s replaying 1,000,000 200-byte JSON messages (transactions of 100, four
producers; 8 MiB zstd fragments in a file:// store) read-committed into Parquet with Spark on
local[2]. Baseline in the same run: the single-process read-committed pipeline over the same
fragments (read from the store, framed, decoded, sequenced: what the read-committed iterator does,
without a broker). Both also per core (Spark's over its 2): Spark's per-core rate should be at
least half the single process's, so that a cluster multiplies it. A replay of 20,000 messages
first warms the session up (Spark's Python workers start once, as on a running cluster)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._messages import transactions
from broker.fragment.content import open_in_store
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb
from message.framing import FrameReader, JSONLines
from message.publisher import Reader
from message.sequencer import Sequencer
from message.types import DictMessages

JOURNAL = "bench/replay"
STORE = "file:///fragments/"
FRAGMENT = 8 << 20
CORES = 2


def write_journal(root: Path, count: int) -> int:
    from tests.helpers.fragments import put_fragment

    (root / "fragments").mkdir()
    store = open_store(STORE, file_root=root)
    data, _ = transactions(count, 100)
    begin = 0
    while begin < len(data):
        end = (
            len(data) if len(data) - begin <= FRAGMENT else data.index(b"\n", begin + FRAGMENT) + 1
        )
        put_fragment(store, JOURNAL, begin, data[begin:end], pb.ZSTANDARD)
        begin = end
    (root / "specs.yaml").write_text(
        f"name: {JOURNAL}\nreplication: 1\nlabels:\n  - name: content-type\n"
        f'    value: application/x-ndjson\nfragment:\n  stores: ["{STORE}"]\n'
    )
    return len(data)


def baseline(root: Path) -> int:
    """Committed messages through the iterator's own pipeline, from the store."""
    store = open_store(STORE, file_root=root)
    reader = Reader(DictMessages(), JSONLines())
    frames = FrameReader(JSONLines())
    seq = Sequencer()
    delivered = 0
    for fragment in store.list_fragments(JOURNAL):
        at = fragment.begin
        for block in open_in_store(store, fragment, fragment.begin):
            _, base, lines = frames.feed_lines(at, block)
            at += len(block)
            for envelope in reader.envelopes_of_lines(JOURNAL, base, lines):
                seq.queue_uncommitted(envelope)
                while (committed := seq.step()) is not None:
                    if not committed.is_ack:
                        delivered += 1
    return delivered


def with_spark(root: Path, session: Any, out: Path) -> int:
    from rich.progress import Progress

    from gazctl.spark.jobs import replay_to_parquet

    options = {"selector": f"name={JOURNAL}", "specs": str(root / "specs.yaml"),
               "file_root": str(root), "framing": "lines"}  # fmt: skip
    with Progress(disable=True) as progress:
        return replay_to_parquet(session, options, str(out), False, progress)


def run(quick: bool = False) -> dict[str, Any]:
    from gazctl.spark.session import spark_session, stop_spark

    count = 100_000 if quick else 1_000_000
    started = time.perf_counter()
    session = spark_session(f"local[{CORES}]", "spark_replay benchmark")
    startup = time.perf_counter() - started
    try:
        with tempfile.TemporaryDirectory(prefix="gazette-bench-replay-") as tmp:
            root = Path(tmp)
            # Warm up: Spark's Python workers start and import once, as on a running cluster.
            (root / "warm").mkdir()
            write_journal(root / "warm", 20_000)
            with_spark(root / "warm", session, root / "warm" / "out.parquet")
            size = write_journal(root, count)
            start = time.perf_counter()
            replayed = with_spark(root, session, root / "out.parquet")
            spark_seconds = time.perf_counter() - start
            start = time.perf_counter()
            delivered = baseline(root)
            base_seconds = time.perf_counter() - start
        close_stores()
    finally:
        stop_spark(session)
    assert replayed == delivered == count, (replayed, delivered, count)
    value, base = count / spark_seconds, count / base_seconds
    return {
        "value": round(value),
        "unit": "messages/s",
        "baseline": round(base),
        "ratio": round(value / base, 2),
        "per_core": round(value / CORES),
        "baseline_per_core": round(base),
        "per_core_ratio": round(value / CORES / base, 2),
        "per_core_target": 0.5,
        "messages": count,
        "bytes": size,
        "session_startup_s": round(startup, 1),
    }


if __name__ == "__main__":
    print(run())
