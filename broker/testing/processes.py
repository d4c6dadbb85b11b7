"""Brokers as processes for tests: `start_broker_process` runs `gazette serve` on a loopback
port against a test's etcd, returns once it answers List, and `stop_process` stops it by pid."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from plumbing import processes
from plumbing.local_etcd import EtcdServer, free_port
from plumbing.processes import stop_process


@dataclass
class BrokerProcess:
    """A `gazette serve` subprocess; `address` is what `--broker.address` takes."""

    proc: subprocess.Popen[bytes]
    address: str
    prefix: str
    log: Path


def start_broker_process(
    etcd_server: EtcdServer,
    prefix: str,
    log: Path,
    broker_id: str = "broker-0",
    lease: str = "5s",
    extra: tuple[str, ...] = (),
    tls: grpc.ChannelCredentials | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> BrokerProcess:
    """A broker process under the etcd `prefix`, its output in `log`, ready once it answers
    List (with `tls` and `metadata` if it serves TLS or needs authorization: its address is
    then https://). `extra` are more `gazette serve` flags."""
    port = free_port()
    with log.open("wb") as out:
        proc = processes.SERVER_POPEN(
            [
                sys.executable, "-m", "broker.main", "serve",
                "--broker.id", broker_id, "--broker.host", "127.0.0.1", "--broker.port", str(port),
                "--etcd.address", etcd_server.endpoint, "--etcd.prefix", prefix, "--etcd.lease", lease,
                "--broker.drain-timeout", "2s", *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    address = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    # Ready once it answers List: the gRPC server starts only after the member key is written.
    deadline = time.monotonic() + 30
    target = f"127.0.0.1:{port}"
    with grpc.secure_channel(target, tls) if tls else grpc.insecure_channel(target) as channel:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gazette serve exited {proc.returncode}: {log.read_text()}")
            try:
                list(stub.List(pb.ListRequest(), timeout=1, metadata=metadata))
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    stop_process(proc)
                    raise TimeoutError("gazette serve did not become ready") from None
                time.sleep(0.05)
    return BrokerProcess(proc, address, prefix, log)
