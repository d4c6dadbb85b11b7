"""`gazette serve` as a process: flags, environment and INI configuration, clean SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import aetcd

from allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, free_port
from tests.conftest import run_cli, start_broker_process, stop_process
from tests.helpers.waiting import until_blocking


async def member(etcd_server: EtcdServer, key: str) -> pb.BrokerSpec | None:
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port)
    try:
        got = await client.get(key.encode())
        return pb.BrokerSpec.FromString(got.value) if got else None
    finally:
        await client.close()


def test_serve_registers_and_sigterm_exits_cleanly(etcd_server: EtcdServer, tmp_path: Path) -> None:
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    broker = start_broker_process(etcd_server, prefix, tmp_path / "log", broker_id="serve-test")
    try:
        key = aks.member_key(prefix, "local", "serve-test")
        spec = asyncio.run(member(etcd_server, key))
        assert spec is not None and spec.process_spec.endpoint == broker.address
        assert spec.journal_limit == 1024
    finally:
        code = stop_process(broker.proc)
    assert code == 0, broker.log.read_text()
    assert asyncio.run(member(etcd_server, key)) is None  # Lease revoked on exit.


def test_serve_reads_env_and_ini(etcd_server: EtcdServer, tmp_path: Path) -> None:
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    port = free_port()
    (tmp_path / "gazette.ini").write_text(
        f"[broker]\nzone = ini-zone\nid = from-ini\nhost = 127.0.0.1\nport = {port}\nlimit = 77\n"
        f"[etcd]\nprefix = {prefix}\nlease = 5s\n"
    )
    env = dict(
        os.environ, ETCD_ADDRESS=etcd_server.endpoint, BROKER_ID="from-env", HOME=str(tmp_path)
    )
    log = tmp_path / "log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker.main", "serve"], cwd=tmp_path, env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        key = aks.member_key(prefix, "ini-zone", "from-env")  # env beats the INI file
        spec = None

        def announced_or_exited() -> bool:
            nonlocal spec
            spec = asyncio.run(member(etcd_server, key))
            return spec is not None or proc.poll() is not None

        with contextlib.suppress(AssertionError):  # Late, the assertion below shows the log.
            until_blocking(announced_or_exited, "the broker announced, or exited", 10, 0.05)
        assert spec is not None, log.read_text()
        assert spec.journal_limit == 77
        assert spec.process_spec.endpoint == f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 0


def test_print_config(tmp_path: Path) -> None:
    (tmp_path / "gazette.ini").write_text("[broker]\nzone = ini-zone\n")
    r = run_cli(
        "gazette",
        "print-config",
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "ETCD_PREFIX": "/from/env"},
    )
    assert r.code == 0, r.err
    assert "zone = ini-zone" in r.out
    assert "prefix = /from/env" in r.out
    assert "[etcd]" in r.out and "[broker]" in r.out


def test_bad_flags_are_one_line(etcd_server: EtcdServer) -> None:
    r = run_cli(
        "gazette", "serve", "--broker.zone", "bad zone!", "--etcd.address", etcd_server.endpoint
    )
    assert r.code != 0 and "Traceback" not in r.err
    assert "bad zone!" in r.err
    r = run_cli("gazette", "serve", "--etcd.lease", "soon", "--etcd.address", etcd_server.endpoint)
    assert r.code != 0 and "Traceback" not in r.err and "soon" in r.err


def test_https_etcd_address_of_a_plaintext_etcd_does_not_start(etcd_server: EtcdServer) -> None:
    # etcd behind the address is real and plaintext: the broker dials it with TLS, which
    # fails, and does not start (it never falls back to plaintext).
    https = etcd_server.endpoint.replace("http://", "https://")
    r = run_cli(
        "gazette", "serve", "--broker.id", "tls-test", "--broker.host", "127.0.0.1",
        "--etcd.address", https, "--log.level", "error",
    )  # fmt: skip
    assert r.code != 0 and "Traceback" not in r.err
    lines = [line for line in r.err.strip().splitlines() if line.startswith("gazette:")]
    assert len(lines) == 1, r.err
    assert "cannot start" in lines[0], r.err


def test_lost_lease_stops_the_broker(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """If etcd drops the broker's lease, its member key is gone: it must exit, non-zero."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    broker = start_broker_process(etcd_server, prefix, tmp_path / "log", broker_id="lease-test")
    key = aks.member_key(prefix, "local", "lease-test")

    async def revoke() -> None:
        client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port)
        try:
            got = await client.get(key.encode())
            assert got is not None and got.lease
            await client.revoke_lease(got.lease)
        finally:
            await client.close()

    try:
        asyncio.run(revoke())
        code = broker.proc.wait(timeout=20)
    finally:
        stop_process(broker.proc)
    assert code == 1
    assert "lease" in broker.log.read_text()
