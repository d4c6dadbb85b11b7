"""Bare unary-chain baseline for small appends: what a protocol-free Python broker chain does here.

client -> relay -> 2 sinks, each a separate process on 127.0.0.1 speaking plain grpc.aio with raw
bytes. Many callers each issue small unary calls to the relay, which SHA-1s and writes the payload
and calls both sinks in parallel (they SHA-1 and write too), answering once both have. This is a
small append's round trip through a primary and two peers, minus all protocol logic.

Run `python -m benchmarks.baselines.unary_chain` for a figure on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import grpc

from benchmarks.baselines import _procs
from benchmarks.baselines._spool import Spool

DEFAULT_CONCURRENCY = 64
DEFAULT_PAYLOAD = 256

CALL = "/bench.Chain/Call"
ACK = b"\x01"


def sink_handlers() -> list[grpc.GenericRpcHandler[Any, Any]]:
    spool = Spool()

    async def call(payload: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        spool.write(payload)
        return ACK

    return [
        grpc.method_handlers_generic_handler(
            "bench.Chain", {"Call": grpc.unary_unary_rpc_method_handler(call)}
        )
    ]


class Relay:
    def __init__(self, sinks: list[str]) -> None:
        self.sink_addresses = sinks
        self.channels: list[grpc.aio.Channel] = []
        self.calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = []
        self.spool = Spool()

    async def connect(self) -> None:
        for address in self.sink_addresses:
            channel = grpc.aio.insecure_channel(address, options=_procs.CHANNEL_OPTIONS)
            self.channels.append(channel)
            self.calls.append(channel.unary_unary(CALL, None, None))  # raw bytes both ways

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close(grace=None)

    async def call(self, payload: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        self.spool.write(payload)
        acks = await asyncio.gather(*(call(payload) for call in self.calls))
        assert all(a == ACK for a in acks), acks
        return ACK

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        return [
            grpc.method_handlers_generic_handler(
                "bench.Chain", {"Call": grpc.unary_unary_rpc_method_handler(self.call)}
            )
        ]


async def _client(
    address: str, concurrency: int, payload: int, duration_s: float
) -> tuple[list[float], float]:
    """Call from `concurrency` callers for `duration_s`; return each call's latency and the
    seconds they took."""
    body = os.urandom(payload)
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address, options=_procs.CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(CALL, None, None)  # raw bytes both ways
        await asyncio.gather(*(call(body) for _ in range(concurrency)))  # Warm up.
        deadline = time.perf_counter() + duration_s

        async def caller() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                assert await call(body) == ACK
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latencies, elapsed


async def unary_chain(
    concurrency: int = DEFAULT_CONCURRENCY, payload: int = DEFAULT_PAYLOAD, duration_s: float = 5.0
) -> dict[str, Any]:
    """`measure_unary_chain` for callers already inside an event loop."""
    module = "benchmarks.baselines.unary_chain"
    with _procs.servers(module, ["sink"], ["sink"]) as sinks:
        relay_args = ["relay", *(s.address for s in sinks)]
        with _procs.servers(module, relay_args) as (relay,):
            pids = [relay.pid, *(s.pid for s in sinks)]
            cpu0, own0 = _procs.cpu_seconds(pids), time.process_time()
            latencies, elapsed = await _client(relay.address, concurrency, payload, duration_s)
            cpu1, own1 = _procs.cpu_seconds(pids), time.process_time()
    cores = None
    if cpu0 is not None and cpu1 is not None:
        cores = round((cpu1 - cpu0 + own1 - own0) / elapsed, 2)
    latencies.sort()
    return {
        "value": len(latencies) / elapsed,
        "unit": "calls/s",
        "calls": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "cpu_cores": cores,
        "concurrency": concurrency,
        "payload": payload,
        "seconds": elapsed,
    }


def measure_unary_chain(
    concurrency: int = DEFAULT_CONCURRENCY, payload: int = DEFAULT_PAYLOAD, duration_s: float = 5.0
) -> dict[str, Any]:
    """Bare unary-chain rate: `value` in calls/s completed through relay and both sinks, with call
    latency (`p50_ms`, `p99_ms`) and the CPU cores the chain used."""
    return asyncio.run(unary_chain(concurrency, payload, duration_s))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baselines.unary_chain")
    sub = parser.add_subparsers(dest="role")
    sub.add_parser("sink", help="(internal) serve as a sink")
    relay = sub.add_parser("relay", help="(internal) serve as the relay")
    relay.add_argument("sinks", nargs=2)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--payload", type=int, default=DEFAULT_PAYLOAD)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if args.role == "sink":
        _procs.serve(sink_handlers())
    elif args.role == "relay":
        server = Relay(args.sinks)
        _procs.serve(server.handlers(), server.connect, server.close)
    else:
        result = measure_unary_chain(args.concurrency, args.payload, args.seconds)
        print(_procs.describe(result))


if __name__ == "__main__":
    main()
