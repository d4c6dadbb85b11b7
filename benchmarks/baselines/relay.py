"""Bare-relay baseline for append throughput: what a protocol-free Python broker chain does here.

client -> relay -> 2 sinks, each a separate process on 127.0.0.1 speaking plain grpc.aio with raw
bytes. The client streams each append in chunks (client-streaming RPC); the relay SHA-1s and writes
every chunk to a file and forwards it through a bounded queue to a long-lived stream to each sink;
sinks SHA-1 and write too, and acknowledge at the end of each append; the client's append completes
once the relay has both acknowledgements. This is our broker's append path (the primary hashes and
writes its spool and replicates to two peers) minus all protocol logic. As in a journal's pipeline,
one append streams at a time and the next may stream while earlier acknowledgements are awaited.

Run `python -m benchmarks.baselines.relay` for a figure on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc

from benchmarks.baselines import _procs
from benchmarks.baselines._spool import Spool

# The broker forwards each content chunk it receives as one replication message, so the client sets
# the chunk size for the whole chain. Upstream's Go client sends 32 KiB (io.Copy's buffer); ours
# sends 128 KiB (`broker.client.appender.CHUNK`) because Python pays per message, so that is the
# default here. Append benchmarks should pass the chunk size their client actually used.
DEFAULT_CHUNK_SIZE = 1 << 17
DEFAULT_APPEND_SIZE = 1 << 20
# Chunks queued per sink stream before the relay stops reading its client (a bounded pipeline).
QUEUE_DEPTH = 8

APPEND = "/bench.Relay/Append"
REPLICATE = "/bench.Sink/Replicate"
ACK = b"\x01"


def sink_handlers() -> list[grpc.GenericRpcHandler[Any, Any]]:
    spool = Spool()

    async def replicate(
        chunks: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk:
                spool.write(chunk)
            else:  # An empty chunk ends an append.
                yield ACK

    return [
        grpc.method_handlers_generic_handler(
            "bench.Sink", {"Replicate": grpc.stream_stream_rpc_method_handler(replicate)}
        )
    ]


class SinkLink:
    """One long-lived stream from the relay to a sink: a bounded send queue drained by a writer
    task, and a reader task resolving acknowledgements in order."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=_procs.CHANNEL_OPTIONS)
        replicate = self.channel.stream_stream(REPLICATE, None, None)  # raw bytes both ways
        self.call = replicate()  # type: ignore[call-arg]  # grpc-stubs: iterator is optional
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_DEPTH)
        self.acks: deque[asyncio.Future[None]] = deque()
        self.tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._receive())]

    async def _send(self) -> None:
        while True:
            await self.call.write(await self.queue.get())

    async def _receive(self) -> None:
        while (ack := await self.call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert ack == ACK, ack
            self.acks.popleft().set_result(None)
        for pending in self.acks:
            pending.set_exception(RuntimeError("sink stream ended"))


class Relay:
    def __init__(self, sinks: list[str]) -> None:
        self.sink_addresses = sinks
        self.links: list[SinkLink] = []
        self.spool = Spool()
        self.pipeline = asyncio.Lock()

    async def connect(self) -> None:
        self.links = [SinkLink(a) for a in self.sink_addresses]

    async def close(self) -> None:
        for link in self.links:
            for task in link.tasks:
                task.cancel()
            await asyncio.gather(*link.tasks, return_exceptions=True)
            await link.channel.close(grace=None)

    async def append(
        self, chunks: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        async with self.pipeline:
            async for chunk in chunks:
                self.spool.write(chunk)
                for link in self.links:
                    await link.queue.put(chunk)
            loop = asyncio.get_running_loop()
            acks = [loop.create_future() for _ in self.links]
            for link, ack in zip(self.links, acks, strict=True):
                link.acks.append(ack)
                await link.queue.put(b"")
        await asyncio.gather(*acks)
        return ACK

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        return [
            grpc.method_handlers_generic_handler(
                "bench.Relay", {"Append": grpc.stream_unary_rpc_method_handler(self.append)}
            )
        ]


async def _client(
    address: str, duration_s: float, chunk_size: int, append_size: int, concurrency: int
) -> tuple[int, float, list[float]]:
    """Append for `duration_s` from `concurrency` appenders; return bytes appended, the seconds
    they took, and each append's latency."""
    chunk = os.urandom(chunk_size)
    sizes = [chunk_size] * (append_size // chunk_size)
    if append_size % chunk_size:
        sizes.append(append_size % chunk_size)
    chunks = [chunk if n == chunk_size else chunk[:n] for n in sizes]
    latencies: list[float] = []

    async with grpc.aio.insecure_channel(address, options=_procs.CHANNEL_OPTIONS) as channel:
        append = channel.stream_unary(APPEND, None, None)  # raw bytes both ways

        async def one() -> None:
            call = append()  # type: ignore[call-arg]  # grpc-stubs: iterator is optional
            for c in chunks:
                await call.write(c)
            await call.done_writing()
            assert await call == ACK

        for _ in range(2):  # Warm up: connections, relay streams, the first file pages.
            await one()

        deadline = time.perf_counter() + duration_s

        async def appender() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                await one()
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(appender() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return len(latencies) * append_size, elapsed, latencies


async def relay_throughput(
    duration_s: float = 5.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    append_size: int = DEFAULT_APPEND_SIZE,
    concurrency: int = 1,
) -> dict[str, Any]:
    """`measure_relay_throughput` for callers already inside an event loop."""
    module = "benchmarks.baselines.relay"
    with _procs.servers(module, ["sink"], ["sink"]) as sinks:
        relay_args = ["relay", *(s.address for s in sinks)]
        with _procs.servers(module, relay_args) as (relay,):
            pids = [relay.pid, *(s.pid for s in sinks)]
            cpu0, own0 = _procs.cpu_seconds(pids), time.process_time()
            appended, elapsed, latencies = await _client(
                relay.address, duration_s, chunk_size, append_size, concurrency
            )
            cpu1, own1 = _procs.cpu_seconds(pids), time.process_time()
    cores = None
    if cpu0 is not None and cpu1 is not None:
        cores = round((cpu1 - cpu0 + own1 - own0) / elapsed, 2)
    latencies.sort()
    return {
        "value": appended / elapsed / 1e6,
        "unit": "MB/s",
        "appends": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "cpu_cores": cores,
        "chunk_size": chunk_size,
        "append_size": append_size,
        "concurrency": concurrency,
        "seconds": elapsed,
    }


def measure_relay_throughput(
    duration_s: float = 5.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    append_size: int = DEFAULT_APPEND_SIZE,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Bare-relay append throughput: `value` in MB/s (10^6 bytes) of appends acknowledged by both
    sinks, with append latency (`p50_ms`, `p99_ms`) and the CPU cores the chain used.

    Pass the chunk size, append size and number of concurrent appenders of the broker run this is
    the baseline for: each changes the figure a lot (see docs/benchmarks.md)."""
    return asyncio.run(relay_throughput(duration_s, chunk_size, append_size, concurrency))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baselines.relay")
    sub = parser.add_subparsers(dest="role")
    sub.add_parser("sink", help="(internal) serve as a sink")
    relay = sub.add_parser("relay", help="(internal) serve as the relay")
    relay.add_argument("sinks", nargs=2)
    for flag, default in [
        ("--chunk-size", DEFAULT_CHUNK_SIZE),
        ("--append-size", DEFAULT_APPEND_SIZE),
    ]:
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.role == "sink":
        _procs.serve(sink_handlers())
    elif args.role == "relay":
        server = Relay(args.sinks)
        _procs.serve(server.handlers(), server.connect, server.close)
    else:
        result = measure_relay_throughput(
            args.seconds, args.chunk_size, args.append_size, args.concurrency
        )
        print(_procs.describe(result))


if __name__ == "__main__":
    main()
