"""Fixtures of the consumer tests (a pytest plugin, registered in conftest): one in-process
broker with an input and an output journal of JSON lines, and a Journal stub to it; and
`ConsumerProcesses`, an example application's consumer processes started, killed and stopped by
pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from broker.client.journals import dial
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer, free_port, stop_process
from consumer.protocol import cpb
from tests.conftest import BrokerProcess
from tests.journals_testing import started_brokers
from tests.test_persistence import routed

INPUT, OUTPUT = "sums/input", "sums/output"


def spec(name: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.fragment.length = 1 << 20
    out.fragment.compression_codec = pb.NONE
    out.fragment.refresh_interval.seconds = 60
    out.labels.labels.add(name="content-type", value="application/x-ndjson")
    return out


@pytest.fixture
async def sums_broker(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-txn"], run_allocator=True
    ) as (harness,):
        async with harness.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(j)) for j in (INPUT, OUTPUT)])
            for journal in (INPUT, OUTPUT):
                await routed(client, journal, 1)
        yield harness


@pytest.fixture
async def sums_stub(sums_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(sums_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()


# Seconds a consumer process gets to stop gracefully before SIGKILL (see ConsumerProcesses.stop).
STOP_TIMEOUT = 30.0


class ConsumerProcesses:
    """Consumer processes of an example (`example`: its command line, `app_args`: its own
    flags) by id, each started (again) on its own port, and stopped by pid."""

    def __init__(
        self,
        example: list[str],
        app_args: list[str],
        etcd: EtcdServer,
        broker: BrokerProcess,
        root: str,
        logs: Path,
    ) -> None:
        self.example, self.app_args = example, app_args
        self.etcd, self.broker, self.root, self.logs = etcd, broker, root, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        # For processes serving TLS and verifying tokens: how to check they are ready, and
        # the environment they run with (credentials of their clients).
        self.tls: grpc.ChannelCredentials | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.env: dict[str, str] = {}

    def start(self, consumer_id: str, *, wait: bool = True, lease: str = "2s") -> None:
        port = self.ports.setdefault(consumer_id, free_port())
        # Its replicas' local directories (made under TMPDIR) go with the test's, even when
        # the process is SIGKILLed.
        tmp = self.logs / "tmp"
        tmp.mkdir(exist_ok=True)
        with (self.logs / f"{consumer_id}.log").open("ab") as out:
            self.procs[consumer_id] = subprocess.Popen(
                [
                    *self.example, "serve", "--consumer.id", consumer_id,
                    "--consumer.port", str(port), "--consumer.drain-timeout", "5s",
                    "--broker.address", self.broker.address, "--etcd.address", self.etcd.endpoint,
                    "--etcd.prefix", self.root, "--etcd.lease", lease, *self.app_args,
                ],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, "TMPDIR": str(tmp)},
            )  # fmt: skip
        if wait:
            self.wait_ready(consumer_id)

    def address(self, consumer_id: str) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports[consumer_id]}"

    def log(self, consumer_id: str) -> str:
        return (self.logs / f"{consumer_id}.log").read_text()

    def wait_ready(self, consumer_id: str) -> None:
        deadline = time.monotonic() + 30
        target = f"127.0.0.1:{self.ports[consumer_id]}"
        with (
            grpc.secure_channel(target, self.tls) if self.tls else grpc.insecure_channel(target)
        ) as channel:
            stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
            while True:
                proc = self.procs[consumer_id]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{consumer_id} exited {proc.returncode}: {self.log(consumer_id)[-2000:]}"
                    )
                try:
                    stub.List(cpb.ListRequest(), timeout=1, metadata=self.metadata)
                    return
                except grpc.RpcError:
                    assert time.monotonic() < deadline, f"{consumer_id} did not become ready"
                    time.sleep(0.05)

    def kill(self, consumer_id: str) -> None:
        os.kill(self.procs[consumer_id].pid, signal.SIGKILL)
        self.procs[consumer_id].wait()

    def stop(self, consumer_id: str) -> int:
        """SIGTERM, and SIGKILL only past the bound of a graceful stop: the drain (5 s here),
        the gRPC grace (5 s), and the lease revocation and etcd close (5 s each at most), with
        the shards' final commits between (a 10 s bound killed a hand-off under load)."""
        return stop_process(self.procs[consumer_id], timeout=STOP_TIMEOUT)

    def stop_all(self) -> list[int]:
        return [stop_process(proc, timeout=STOP_TIMEOUT) for proc in self.procs.values()]
