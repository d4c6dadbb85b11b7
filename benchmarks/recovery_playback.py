"""recovery_playback: MB/s of playing a recovery log into a directory (`Player`, to the write
head), beside a raw read of the same log through the broker in the same run (target ratio >= 0.5).

One `gazette serve`; a recorder writes a log of files written in 64 KiB pieces, half of them later
deleted (so playback skips dead ones by their hints, and reads past their writes). MB/s counts
the log's bytes, for both."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._cluster import one_broker, recovery_log
from broker.client.append_service import AppendService
from broker.client.reader import read, write_head
from broker.protocol import recorded_op_pb2 as rpb
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.player import Player
from consumer.recoverylog.recorder import Recorder

LOG = "bench/recovery/log"
PIECE = 64 << 10


async def _record(stub: Any, directory: Path, files: int, pieces: int) -> rpb.FSMHints:
    async with AppendService(stub) as service:
        recorder = Recorder(LOG, FSM(rpb.FSMHints(log=LOG)), new_author(), str(directory), service)
        await recorder.start()
        data = os.urandom(PIECE)
        for f in range(files):
            fnode = recorder.record_create(str(directory / f"file-{f}"))
            for p in range(pieces):
                recorder.record_write(fnode, data, p * PIECE)
            await recorder.durable()  # Bounds what is pending.
            if f % 2:
                recorder.record_remove(str(directory / f"file-{f}"))
        return await recorder.build_hints()


async def measure(files: int, pieces: int) -> dict[str, Any]:
    async with one_broker() as (client, root):
        await recovery_log(client, LOG)
        (root / "src").mkdir()
        hints = await _record(client.stub, root / "src", files, pieces)
        size = await write_head(client.stub, LOG)

        started = time.perf_counter()
        read_bytes = 0
        async for chunk in read(client.stub, LOG, 0):
            read_bytes += len(chunk.content)
        raw = time.perf_counter() - started

        async with AppendService(client.stub) as service:
            player = Player()
            player.finish_at_write_head()
            started = time.perf_counter()
            fsm = await player.play(hints, root / "played", lambda: client.stub, service)
            played = time.perf_counter() - started
        live = len(fsm.live_nodes)
    if read_bytes != size:
        raise RuntimeError(f"read {read_bytes} of the log's {size} bytes")
    return {"size": size, "raw_s": raw, "play_s": played, "live_files": live}


def run(quick: bool = False) -> dict[str, Any]:
    files, pieces = (4, 16) if quick else (16, 64)
    r = asyncio.run(measure(files, pieces))
    mb = r["size"] / 1e6
    value, baseline = mb / r["play_s"], mb / r["raw_s"]
    return {
        "value": round(value, 1),
        "unit": "MB/s",
        "baseline": round(baseline, 1),
        "ratio": round(value / baseline, 2),
        "log_mb": round(mb, 1),
        "live_files": r["live_files"],
    }


if __name__ == "__main__":
    print(run())
