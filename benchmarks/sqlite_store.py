"""sqlite_store: transactions/s of a small-write workload on the SQLite store recorded into a
recovery log (`SQLiteStore`: each transaction upserts 10 rows of 100 bytes and commits its
checkpoint, durable in the log; the next transaction writes while earlier commits become
durable, up to the store's `pipelined_commits` in flight, as the transaction loop runs them), beside the same workload on plain SQLite with
`synchronous=FULL` (apsw, the same WAL and locking mode, a local file, fsynced) in the same run.
The ratio is reported.

One `gazette serve` holds the log; its spool is a local file too, so both pay for fsync, and the
recorded store pays for the round trips to the broker that make each commit durable."""

from __future__ import annotations

import asyncio
import collections
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import apsw

from benchmarks._cluster import one_broker, recovery_log
from broker.client.append_service import AppendService
from broker.client.reader import write_head
from broker.protocol import recorded_op_pb2 as rpb
from consumer.protocol import cpb
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.recorder import Recorder
from consumer.store_sqlite import SQLiteStore

LOG = "bench/sqlite/log"
ROWS = 10
TABLE = "CREATE TABLE IF NOT EXISTS kv (k INTEGER PRIMARY KEY, v BLOB)"


def _upsert(db: apsw.Connection, txn: int) -> None:
    db.execute(TABLE)
    db.executemany(
        "INSERT OR REPLACE INTO kv VALUES (?, ?)",
        [((txn * ROWS + i) % 5000, os.urandom(100)) for i in range(ROWS)],
    )


def _plain(path: Path, txns: int) -> float:
    """Seconds for `txns` transactions on plain SQLite (synchronous=FULL, the store's WAL and
    exclusive locking), checkpoint row too."""
    db = apsw.Connection(str(path))
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS gazette_checkpoint (id INTEGER PRIMARY KEY, c BLOB)")
    checkpoint = cpb.Checkpoint().SerializeToString()
    started = time.perf_counter()
    for txn in range(txns):
        db.execute("BEGIN")
        _upsert(db, txn)
        db.execute("INSERT OR REPLACE INTO gazette_checkpoint VALUES (0, ?)", (checkpoint,))
        db.execute("COMMIT")
    elapsed = time.perf_counter() - started
    db.close()
    return elapsed


async def _recorded(stub: Any, directory: Path, txns: int) -> float:
    async with AppendService(stub) as service:
        recorder = Recorder(LOG, FSM(rpb.FSMHints(log=LOG)), new_author(), str(directory), service)
        await recorder.start()
        store = SQLiteStore(recorder)
        await store.restore_checkpoint()
        started = time.perf_counter()
        inflight: collections.deque[Any] = collections.deque()
        for txn in range(txns):
            # As the transaction loop runs them: the next one writes while earlier commits
            # become durable, with up to the store's `pipelined_commits` in flight.
            await store.run(lambda db, t=txn: _upsert(db, t))  # type: ignore[misc]
            while len(inflight) >= store.pipelined_commits:
                await inflight.popleft()
            inflight.append(asyncio.ensure_future(store.start_commit(cpb.Checkpoint())))
        for commit in inflight:
            await commit
        elapsed = time.perf_counter() - started
        await store.close()
    return elapsed


async def measure(txns: int) -> dict[str, Any]:
    async with one_broker() as (client, root):
        await recovery_log(client, LOG)
        (root / "recorded").mkdir()
        recorded = await _recorded(client.stub, root / "recorded", txns)
        log_bytes = await write_head(client.stub, LOG)
        # The floor under each durable commit: one append of a commit's size, in turn.
        piece = os.urandom(max(1, log_bytes // txns))
        async with AppendService(client.stub) as service:
            started = time.perf_counter()
            for _ in range(200):
                await service.append(LOG, piece)
            append_s = (time.perf_counter() - started) / 200
    # The baseline after the broker stopped, as before: plain SQLite on its own.
    with tempfile.TemporaryDirectory(prefix="gazette-bench-") as tmp:
        plain = await asyncio.to_thread(_plain, Path(tmp) / "plain.db", txns)
    return {
        "recorded_s": recorded, "plain_s": plain, "log_bytes": log_bytes, "append_s": append_s,
    }  # fmt: skip


def run(quick: bool = False) -> dict[str, Any]:
    txns = 100 if quick else 1000
    r = asyncio.run(measure(txns))
    value, baseline = txns / r["recorded_s"], txns / r["plain_s"]
    return {
        "value": round(value, 1),
        "unit": "txn/s",
        "baseline": round(baseline, 1),
        "ratio": round(value / baseline, 2),
        "transactions": txns,
        "log_kb_per_txn": round(r["log_bytes"] / txns / 1024, 1),
        "append_ms": round(r["append_s"] * 1000, 2),
        "pipelined_commits": SQLiteStore.pipelined_commits,
    }


if __name__ == "__main__":
    print(run())
