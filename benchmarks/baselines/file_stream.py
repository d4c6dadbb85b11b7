"""Bare file-streaming baseline for reads of persisted fragments: a plain grpc.aio server process
reads the fragment files of a directory, in order, and streams their bytes to a client in messages
of `chunk_size` (raw bytes, no protocol logic); the client is the benchmark's own process.

Also `hash_files`: one Python process reading the same files and SHA-1 hashing them, the baseline of
direct store reads.

Run `python -m benchmarks.baselines.file_stream DIR` for a figure on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from benchmarks.baselines import _procs

READ = "/bench.Files/Read"
BLOCK = 1 << 20  # Read from disk a block at a time, as the broker reads a fragment.


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def handlers() -> list[grpc.GenericRpcHandler[Any, Any]]:
    async def read(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        directory, _, size = request.decode().rpartition("\n")
        chunk = int(size)
        for path in files_of(Path(directory)):
            with path.open("rb", buffering=0) as f:
                while block := await asyncio.to_thread(f.read, BLOCK):
                    for at in range(0, len(block), chunk):
                        yield block[at : at + chunk]

    return [
        grpc.method_handlers_generic_handler(
            "bench.Files", {"Read": grpc.unary_stream_rpc_method_handler(read)}
        )
    ]


async def stream_files(directory: Path, chunk_size: int) -> dict[str, float]:
    """MB/s of the directory's files streamed from a server process to this one."""
    with _procs.servers(__name__, []) as (server,):
        async with grpc.aio.insecure_channel(server.address, options=_procs.CHANNEL_OPTIONS) as ch:
            call = ch.unary_stream(READ, None, None)(f"{directory}\n{chunk_size}".encode())  # type: ignore[arg-type]
            total = 0
            start = time.perf_counter()
            async for message in call:
                total += len(message)
            elapsed = time.perf_counter() - start
    return {"value": total / elapsed / 1e6, "bytes": total, "seconds": elapsed}


def hash_files(directory: Path) -> dict[str, float]:
    """MB/s of one process reading the directory's files and SHA-1 hashing each."""
    total = 0
    start = time.perf_counter()
    for path in files_of(directory):
        summer = hashlib.sha1()
        with path.open("rb", buffering=0) as f:
            while block := f.read(BLOCK):
                summer.update(block)
                total += len(block)
        summer.digest()
    elapsed = time.perf_counter() - start
    return {"value": total / elapsed / 1e6, "bytes": total, "seconds": elapsed}


if __name__ == "__main__":
    if len(sys.argv) == 1:
        _procs.serve(handlers())
    else:
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("directory", type=Path)
        parser.add_argument("--chunk-size", type=int, default=(1 << 15) - 32)
        args = parser.parse_args()
        print(_procs.describe(asyncio.run(stream_files(args.directory, args.chunk_size))))
        print(_procs.describe(hash_files(args.directory)))
        os._exit(0)
