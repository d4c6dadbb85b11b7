"""Consumer processes for tests: an application's `serve` command run by id, each on a loopback
port of its own, started (again), SIGKILLed, or stopped gracefully, always by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.testing import EtcdServer, free_port, stop_process, stop_processes
from consumer.protocol import cpb
from plumbing import processes

# Seconds a consumer process gets to stop gracefully before SIGKILL (see ConsumerProcesses.stop).
STOP_TIMEOUT = 30.0


class HasAddress(Protocol):
    """A broker the processes dial (a `BrokerProcess`, or anything with its `address`)."""

    @property
    def address(self) -> str: ...


class ConsumerProcesses:
    """Consumer processes of one application by id, each started (again) on its own port and
    stopped by pid.

    `command` runs the application's command line (its `serve` sub-command gets the consumer
    flags: id, port, broker and etcd addresses, `--etcd.prefix root`), `app_args` are the
    application's own flags, and each process's output goes to `logs/ID.log`."""

    def __init__(
        self,
        command: Sequence[str],
        app_args: Sequence[str],
        etcd: EtcdServer,
        broker: HasAddress,
        root: str,
        logs: Path,
    ) -> None:
        self.example, self.app_args = list(command), list(app_args)
        self.etcd, self.broker, self.root, self.logs = etcd, broker, root, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        # For processes serving TLS and verifying tokens: how to check they are ready, and
        # the environment they run with (credentials of their clients).
        self.tls: grpc.ChannelCredentials | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.env: dict[str, str] = {}

    def start(self, consumer_id: str, *, wait: bool = True, lease: str = "2s") -> None:
        """Start (or start again, on the same port) the process `consumer_id`; with `wait`,
        return once its Shard service answers."""
        port = self.ports.setdefault(consumer_id, free_port())
        # Its replicas' local directories (made under TMPDIR) go with the test's, even when
        # the process is SIGKILLed.
        tmp = self.logs / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{consumer_id}.log").open("ab") as out:
            self.procs[consumer_id] = processes.SERVER_POPEN(
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
        """The process's `--consumer.address`."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports[consumer_id]}"

    def log(self, consumer_id: str) -> str:
        """What the process wrote so far."""
        return (self.logs / f"{consumer_id}.log").read_text()

    def wait_ready(self, consumer_id: str, timeout: float = 30.0) -> None:
        """Return once the process answers List; fail with its log if it exits first."""
        deadline = time.monotonic() + timeout
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
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{consumer_id} did not become ready") from None
                    time.sleep(0.05)

    def running(self) -> list[str]:
        """The ids of the processes running now."""
        return [i for i, proc in self.procs.items() if proc.poll() is None]

    def primaries(self) -> set[str]:
        """The ids of the processes hosting a shard's primary, as the first running process
        that answers lists them (an empty set if none answers)."""
        for consumer_id in self.running():
            target = f"127.0.0.1:{self.ports[consumer_id]}"
            try:
                with (
                    grpc.secure_channel(target, self.tls)
                    if self.tls
                    else grpc.insecure_channel(target)
                ) as channel:
                    stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
                    listed = stub.List(cpb.ListRequest(), timeout=2, metadata=self.metadata)
            except grpc.RpcError:
                continue
            return {
                s.route.members[s.route.primary].suffix
                for s in listed.shards
                if s.route.primary >= 0
            }
        return set()

    def kill(self, consumer_id: str) -> None:
        """SIGKILL, wherever the process is (mid-transaction, mid-commit)."""
        os.kill(self.procs[consumer_id].pid, signal.SIGKILL)
        self.procs[consumer_id].wait()

    def stop(self, consumer_id: str) -> int:
        """SIGTERM, and SIGKILL only past the bound of a graceful stop: the drain (5 s here),
        the gRPC grace (5 s), and the lease revocation and etcd close (5 s each at most), with
        the shards' final commits between (a 10 s bound killed a hand-off under load).
        Returns the exit code."""
        return stop_process(self.procs[consumer_id], timeout=STOP_TIMEOUT)

    def stop_all(self) -> list[int]:
        """Stop every process at once (each sees the others leaving, so none waits to hand its
        shards to them); those already stopped return their code."""
        return stop_processes(self.procs.values(), timeout=STOP_TIMEOUT)


# What the `gazette_consumer_processes` fixture gives a test: called with `app="module:Name"`
# or `command=[...]` (and `args`, `env`), it returns a group of processes of that application.
ConsumerProcessesFactory = Callable[..., ConsumerProcesses]
