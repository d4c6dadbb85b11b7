"""Operating brokers: Prometheus metrics that parse and move with a workload, upstream's HTTP
gateway (httpx as the curl-like client), the diagnostics port's stack dump, and JSON logs that
carry the journal and RPC, against `gazette serve` processes with authorization on."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.testing import EtcdServer, free_port, stop_processes
from plumbing import auth
from plumbing.debug_http import HTTPConfig, HTTPServers
from tests.conftest import BrokerProcess, run_cli, start_broker_process

KEY = b"the operations tests' key, long enough for HS256"


def token(cap: int = auth.ALL, sel: dict[str, Any] | None = None) -> str:
    doc: dict[str, Any] = {"cap": cap, "iat": int(time.time()), "exp": int(time.time()) + 600}
    if sel is not None:
        doc["sel"] = sel
    return jwt.encode(doc, KEY, algorithm="HS256")


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@dataclass
class Ops:
    brokers: list[BrokerProcess]
    http: list[str]  # Each broker's HTTP base URL.
    debug: list[str]  # Each broker's diagnostics base URL.
    env: dict[str, str]

    def scrape(self, index: int = 0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{self.http[index]}/debug/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def ops(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    logs = tmp_path_factory.mktemp("ops")
    key = base64.b64encode(KEY).decode()
    brokers: list[BrokerProcess] = []
    http: list[str] = []
    debug: list[str] = []
    try:
        for i in range(2):
            http_port, debug_port = free_port(), free_port()
            brokers.append(
                start_broker_process(
                    etcd_server,
                    prefix,
                    logs / f"b{i}.log",
                    broker_id=f"ops-broker-{i}",
                    extra=(
                        "--broker.auth-keys",
                        key,
                        "--broker.http-port",
                        str(http_port),
                        "--debug.port",
                        str(debug_port),
                        "--broker.allow-origin",
                        "https://app.example",
                        "--log.format",
                        "json",
                        "--log.level",
                        "info",
                    ),
                    metadata=(("authorization", f"Bearer {token()}"),),
                )
            )
            http.append(f"http://127.0.0.1:{http_port}")
            debug.append(f"http://127.0.0.1:{debug_port}")
        env = {"BROKER_ADDRESS": brokers[0].address, "BROKER_AUTH_KEYS": key}
        for name, team in (("ops/one", "red"), ("ops/secret", "blue")):
            spec = (
                f"name: {name}\nreplication: 2\nlabels: [{{name: team, value: {team}}}]\n"
                "fragment: {length: 100000, compression_codec: NONE, refresh_interval: 1m}\n"
            )
            r = run_cli("gazctl", "journals", "apply", input=spec, env=env)
            assert r.code == 0, r.err
        yield Ops(brokers, http, debug, env)
    finally:
        stop_processes(b.proc for b in brokers)


def test_a_scrape_parses_and_its_counters_move_with_a_workload(ops: Ops) -> None:
    before = [ops.scrape(i) for i in range(2)]
    lines = 20
    for i in range(lines):
        r = run_cli("gazctl", "journals", "append", "-l", "name=ops/one", input=f"line {i}\n", env=ops.env)  # fmt: skip
        assert r.code == 0, r.err
    r = run_cli("gazctl", "journals", "read", "-l", "name=ops/one", env=ops.env)
    assert r.code == 0 and r.out.count("\n") == lines, r.err
    written = sum(len(f"line {i}\n") for i in range(lines))
    after = [ops.scrape(i) for i in range(2)]

    def moved(name: str, **labels: str) -> float:
        return sum(value(a, name, **labels) - value(b, name, **labels) for a, b in zip(after, before, strict=True))  # fmt: skip

    # Upstream's names: RPCs by operation and status, the write head, spools.
    # (upstream's `..._totals` names are exposed as they are; the parser reads them `_total`.)
    text = httpx.get(f"{ops.http[0]}/debug/metrics", timeout=10).text
    assert "\n# TYPE gazette_journal_server_started_totals counter\n" in text
    assert 'gazette_journal_server_started_totals{operation="Append"}' in text
    assert moved("gazette_journal_server_started_totals_total", operation="Append") >= lines
    assert moved("gazette_journal_server_completed_totals_total", operation="Append", status="ok") >= lines  # fmt: skip
    assert (
        moved("gazette_journal_server_completed_totals_total", operation="Read", status="ok") >= 1
    )
    heads = [value(a, "gazette_write_head", journal="ops/one") for a in after]
    assert max(heads) >= written
    # Both replicas committed every append: spool commits and bytes on both brokers.
    assert moved("gazette_spool_commits_total") >= 2 * lines
    assert moved("gazette_spool_commit_bytes_total") >= 2 * written
    # Ours: append bytes and latency by status, replication latency, reads.
    assert moved("gazette_journal_server_append_bytes_total", status="ok") >= written
    assert moved("gazette_journal_server_append_seconds_count", status="ok") >= lines
    assert moved("gazette_replication_commit_seconds_count") >= lines
    assert moved("gazette_journal_server_read_bytes_total") >= written
    for a in after:
        assert value(a, "gazette_etcd_lease_remaining_seconds") > 0
        assert value(a, "gazette_etcd_watch_revision") > 0
        assert value(a, "gazette_broker_fenced") == 0
    assert sum(value(a, "gazette_allocator_converge_total") for a in after) >= 1
    assert any(value(a, "gazette_spool_disk_bytes") > 0 for a in after)


def test_nothing_secret_or_hidden_reaches_metrics_or_logs(ops: Ops) -> None:
    secret = token(sel={"include": {"labels": [{"name": "name", "value": "ops/one"}]}})
    # A refused append to a journal the token hides, and one with a bad token.
    r = httpx.put(f"{ops.http[0]}/ops/secret", content=b"x", headers=bearer(secret), timeout=10)
    assert r.status_code == 404
    bad = jwt.encode({"cap": auth.ALL, "exp": int(time.time()) + 60}, b"not the key" * 4, algorithm="HS256")  # fmt: skip
    r = httpx.put(f"{ops.http[0]}/ops/one", content=b"x", headers=bearer(bad), timeout=10)
    assert r.status_code == 401
    for i in range(2):
        text = httpx.get(f"{ops.http[i]}/debug/metrics", timeout=10).text
        assert secret not in text and bad not in text
        assert 'journal="ops/secret"' not in text  # Never written: no series names it.
        log = ops.brokers[i].log.read_text()
        assert secret not in log and bad not in log and base64.b64encode(KEY).decode() not in log


def test_a_refused_gateway_append_is_401_while_its_body_still_streams(ops: Ops) -> None:
    """The broker refuses a bad token at the first message, while the gateway may still be
    streaming the body into the call: the answer is the refusal (401), never the write's own
    failure after it (gRPC's "Internal error from Core", a 500)."""
    bad = jwt.encode({"cap": auth.ALL, "exp": int(time.time()) + 60}, b"not the key" * 4, algorithm="HS256")  # fmt: skip
    body = b"x" * (4 << 20)
    statuses = [
        httpx.put(f"{ops.http[0]}/ops/one", content=body, headers=bearer(bad), timeout=30)
        for _ in range(50)
    ]
    assert [r.status_code for r in statuses] == [401] * 50, {r.text for r in statuses}


def test_the_http_gateway_reads_and_appends_as_upstreams(ops: Ops) -> None:
    base = ops.http[1]  # Either broker serves the gateway; it proxies as its service does.
    body = b"through the gateway\n"
    r = httpx.put(f"{base}/ops/one", content=body, headers=bearer(token()), timeout=10)
    assert r.status_code == 204, r.text
    begin, end = int(r.headers["X-Commit-Begin"]), int(r.headers["X-Commit-End"])
    assert end - begin == len(body) and r.headers["X-Write-Head"] == str(end)
    import hashlib

    assert r.headers["X-Commit-SHA1-Sum"] == hashlib.sha1(body).hexdigest()
    assert r.headers["X-Route-Token"] and r.headers["Location"].endswith("/ops/one")

    r = httpx.get(f"{base}/ops/one", params={"offset": begin}, headers=bearer(token()), timeout=10)
    assert r.status_code == 206 and r.content == body
    assert r.headers["Content-Range"] == f"bytes {begin}-{2**63 - 1}/{2**63 - 1}"
    assert r.headers["X-Fragment-Name"].endswith(".raw")
    assert int(r.headers["X-Write-Head"]) >= end
    head = httpx.head(f"{base}/ops/one", params={"offset": begin}, headers=bearer(token()), timeout=10)  # fmt: skip
    assert head.status_code == 206 and head.content == b"" and head.headers["X-Fragment-Name"]
    # Upstream's status mapping.
    r = httpx.get(f"{base}/ops/none", headers=bearer(token()), timeout=10)
    assert r.status_code == 404 and "JOURNAL_NOT_FOUND" in r.text
    r = httpx.get(f"{base}/ops/one", params={"offset": 10**9}, headers=bearer(token()), timeout=10)
    assert r.status_code == 416 and "OFFSET_NOT_YET_AVAILABLE" in r.text
    r = httpx.get(f"{base}/ops/one", params={"offset": "soon"}, headers=bearer(token()), timeout=10)
    assert r.status_code == 400
    # A blocking read returns what there is and waits for more: a read with a short timeout.
    blocking = {"offset": end, "block": "true"}
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream(
            "GET", f"{base}/ops/one", params=blocking, headers=bearer(token()), timeout=1.0
        ) as s,  # fmt: skip
    ):
        assert s.status_code == 206
        for _ in s.iter_bytes():
            pass
    # Authorization: none, or a selector that hides the journal.
    assert httpx.get(f"{base}/ops/one", timeout=10).status_code == 401
    hidden = bearer(token(sel={"include": {"labels": [{"name": "team", "value": "red"}]}}))
    assert httpx.get(f"{base}/ops/secret", headers=hidden, timeout=10).status_code == 404
    assert httpx.put(f"{base}/ops/secret", content=b"no", headers=hidden, timeout=10).status_code == 404  # fmt: skip
    read_only = bearer(token(cap=auth.READ))
    assert httpx.put(f"{base}/ops/one", content=b"no", headers=read_only, timeout=10).status_code == 401  # fmt: skip

    # CORS, for the allowed origin only.
    pre = httpx.options(f"{base}/ops/one", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "PUT"}, timeout=10)  # fmt: skip
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    other = httpx.get(f"{base}/ops/one", headers={"Origin": "https://evil.example", **bearer(token())}, timeout=10)  # fmt: skip
    assert other.status_code == 206 and "Access-Control-Allow-Origin" not in other.headers


def test_stacks_are_on_the_diagnostics_port_only(ops: Ops) -> None:
    r = httpx.get(f"{ops.debug[0]}/debug/stacks", timeout=10)
    assert r.status_code == 200
    assert "Thread MainThread" in r.text and "keyspace watch" in r.text
    assert httpx.get(f"{ops.debug[0]}/debug/metrics", timeout=10).status_code == 200
    # On the HTTP port the path is a journal's, for the gateway (refused here without a token).
    r = httpx.get(f"{ops.http[0]}/debug/stacks", timeout=10)
    assert r.status_code != 200 and "Thread" not in r.text


async def test_debug_private_keeps_diagnostics_off_the_http_port() -> None:
    servers = HTTPServers(HTTPConfig(port=0, debug_port=0, private=True))
    await servers.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            main = f"http://127.0.0.1:{servers.port}"
            assert (await client.get(f"{main}/debug/metrics")).status_code == 404
            assert (await client.get(f"{main}/debug/stacks")).status_code == 404
            debug = f"http://127.0.0.1:{servers.debug_port}"
            assert (await client.get(f"{debug}/debug/metrics")).status_code == 200
            assert (await client.get(f"{debug}/debug/ready")).status_code == 200
    finally:
        await servers.stop()


def test_json_logs_carry_the_journal_and_rpc(ops: Ops) -> None:
    records = []
    for broker in ops.brokers:
        for line in broker.log.read_text().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
    assert records, "no JSON records"
    assert all({"time", "level", "logger", "msg"} <= set(r) for r in records)
    started = [r for r in records if r["msg"].startswith("starting local replica of ops/one")]
    assert started and all(r.get("journal") == "ops/one" for r in started)


def test_bad_http_flags_are_one_line(tmp_path: Path) -> None:
    r = run_cli("gazette", "serve", "--broker.id", "bad-http", "--broker.http-port", "99999")
    assert r.code != 0 and "--broker.http-port" in r.err and "Traceback" not in r.err


def test_a_gateway_read_left_blocking_does_not_hold_up_a_graceful_stop(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """A blocking gateway read whose client gave up never ends by itself: on SIGTERM the broker
    still exits by itself (status 0), instead of waiting on it until it is killed."""
    http_port = free_port()
    broker = start_broker_process(
        etcd_server, f"/gazette-test/{uuid.uuid4().hex[:12]}", tmp_path / "broker.log",
        broker_id="gateway-stop", extra=("--broker.http-port", str(http_port)),
    )  # fmt: skip
    try:
        spec = "name: ops/blocked\nreplication: 1\nfragment: {length: 100000, compression_codec: NONE, refresh_interval: 1m}\n"
        r = run_cli("gazctl", "journals", "apply", input=spec, env={"BROKER_ADDRESS": broker.address})  # fmt: skip
        assert r.code == 0, r.err
        blocking = {"offset": "0", "block": "true"}
        url = f"http://127.0.0.1:{http_port}/ops/blocked"
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.stream("GET", url, params=blocking, timeout=1.0) as s,
        ):
            for _ in s.iter_bytes():
                pass
    finally:
        status = stop_processes([broker.proc])
    assert status == [0], (status, broker.log.read_text()[-2000:])
