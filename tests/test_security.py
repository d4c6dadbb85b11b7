"""TLS and authorization of brokers, with real certificates (made here) and real tokens (signed
here with PyJWT, as any upstream client would sign them), against `gazette serve` processes."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import ssl
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jwt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_process, stop_processes
from plumbing import auth
from plumbing.tls import DevPKI, make_dev_pki
from tests.conftest import BrokerProcess, run_cli, start_broker_process
from tests.helpers.waiting import until_blocking

KEY1 = b"first key of the security tests, 32+ bytes"
KEY2 = b"second key, rotated in after the first one"
KEY3 = b"a key that no broker of these tests knows"


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def token(
    key: bytes = KEY1,
    cap: int = auth.ALL,
    sel: dict[str, Any] | None = None,
    *,
    exp: float | None = None,
    iat: float | None = None,
    alg: str = "HS256",
) -> str:
    now = time.time()
    doc: dict[str, Any] = {"cap": cap, "iat": int(iat if iat is not None else now)}
    if exp != -1:
        doc["exp"] = int(exp if exp is not None else now + 600)
    if sel is not None:
        doc["sel"] = sel
    with warnings.catch_warnings():  # HS512 wants longer keys: these are for refusal tests.
        warnings.simplefilter("ignore")
        return jwt.encode(doc, key, algorithm=alg)


def bearer(tok: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tok}"),)


def name_prefix(prefix: str) -> dict[str, Any]:
    """A claim selector as upstream encodes it: `name:prefix=<prefix>`."""
    return {"include": {"labels": [{"name": "name", "value": prefix, "prefix": True}]}}


@dataclass
class Cluster:
    pki: DevPKI
    other: DevPKI  # Another CA and its certificates: trusted by nobody here.
    brokers: list[BrokerProcess]

    def client_creds(self, *, ca: bool = True, cert: bool = True) -> grpc.ChannelCredentials:
        p = self.pki
        return grpc.ssl_channel_credentials(
            root_certificates=p.ca_cert.read_bytes() if ca else self.other.ca_cert.read_bytes(),
            private_key=p.client_key.read_bytes() if cert else None,
            certificate_chain=p.client_cert.read_bytes() if cert else None,
        )

    def stub(self, index: int = 0, **kw: bool) -> tuple[grpc.Channel, pb_grpc.JournalStub]:
        target = self.brokers[index].address.removeprefix("https://")
        channel = grpc.secure_channel(target, self.client_creds(**kw))
        return channel, pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]

    def gazctl_env(self, **extra: str) -> dict[str, str]:
        p = self.pki
        env = {
            "BROKER_ADDRESS": self.brokers[0].address,
            "BROKER_CERT_FILE": str(p.client_cert),
            "BROKER_CERT_KEY_FILE": str(p.client_key),
            "BROKER_TRUSTED_CA_FILE": str(p.ca_cert),
            "BROKER_AUTH_KEYS": b64(KEY1),
        }
        env.update(extra)
        return env


def tls_flags(pki: DevPKI, keys: str) -> tuple[str, ...]:
    return (*pki.server_flags("broker"), "--broker.auth-keys", keys)


@pytest.fixture(scope="module")
def pki_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[DevPKI, DevPKI]:
    root = tmp_path_factory.mktemp("pki")
    return make_dev_pki(root / "ours"), make_dev_pki(root / "other", ca_name="someone else's CA")


@pytest.fixture(scope="module")
def cluster(
    etcd_server: EtcdServer,
    tmp_path_factory: pytest.TempPathFactory,
    pki_pair: tuple[DevPKI, DevPKI],
) -> Iterator[Cluster]:
    """Two brokers serving TLS with client certificates required, replicating to each other
    over TLS, verifying tokens with KEY2 or KEY1 (a rotation in progress)."""
    pki, other = pki_pair
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    logs = tmp_path_factory.mktemp("tls-brokers")
    ready = grpc.ssl_channel_credentials(
        pki.ca_cert.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    brokers: list[BrokerProcess] = []
    try:
        for i in range(2):
            brokers.append(
                start_broker_process(
                    etcd_server,
                    prefix,
                    logs / f"b{i}.log",
                    broker_id=f"tls-broker-{i}",
                    extra=tls_flags(pki, f"{b64(KEY2)},{b64(KEY1)}"),
                    tls=ready,
                    metadata=bearer(token()),
                )
            )
        c = Cluster(pki, other, brokers)
        for name, rf, team in (("a/one", 2, "red"), ("a/two", 1, "red"), ("b/secret", 1, "blue")):
            spec = (
                f"name: {name}\nreplication: {rf}\nlabels: [{{name: team, value: {team}}}]\n"
                "fragment: {length: 100000, compression_codec: NONE, refresh_interval: 1m}\n"
            )
            r = run_cli("gazctl", "journals", "apply", input=spec, env=c.gazctl_env())
            assert r.code == 0, r.err
        yield c
    finally:
        stop_processes(b.proc for b in brokers)


def gazctl(c: Cluster, *args: str, input: str | None = None, **env: str) -> Any:
    return run_cli("gazctl", *args, input=input, env=c.gazctl_env(**env))


def one_line(r: Any, *words: str) -> None:
    assert r.code != 0, r
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.err, r.err
    for word in words:
        assert word in lines[0], lines[0]


# ---- TLS ---------------------------------------------------------------------------------------


def test_brokers_replicate_and_serve_over_tls(cluster: Cluster) -> None:
    # a/one has two replicas: an append commits only once both brokers took it, over TLS.
    r = gazctl(cluster, "journals", "append", "-l", "name=a/one", input="over tls\n")
    assert r.code == 0, r.err
    for broker in cluster.brokers:  # Each broker serves the read (one proxies if need be).
        r = gazctl(cluster, "journals", "read", "-l", "name=a/one", BROKER_ADDRESS=broker.address)
        assert r.code == 0 and r.out == "over tls\n", r.err
    r = gazctl(cluster, "journals", "list", "--format", "json")
    assert r.code == 0 and all(b.address in r.out for b in cluster.brokers), r.out


def test_a_plaintext_client_is_refused(cluster: Cluster) -> None:
    plain = cluster.brokers[0].address.replace("https://", "http://")
    one_line(
        gazctl(cluster, "journals", "list", BROKER_ADDRESS=plain),
        plain, "the server speaks TLS: use https://",
    )  # fmt: skip
    target = plain.removeprefix("http://")
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.List(pb.ListRequest(), timeout=5, metadata=bearer(token())))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_signed_by_another_ca_is_refused(cluster: Cluster) -> None:
    r = gazctl(cluster, "journals", "list", BROKER_TRUSTED_CA_FILE=str(cluster.other.ca_cert))
    one_line(r, cluster.brokers[0].address)
    channel, stub = cluster.stub(ca=False)
    with channel, pytest.raises(grpc.RpcError) as info:
        list(stub.List(pb.ListRequest(), timeout=5, metadata=bearer(token())))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_is_required_when_the_server_has_a_ca(cluster: Cluster) -> None:
    r = gazctl(cluster, "journals", "list", BROKER_CERT_FILE="", BROKER_CERT_KEY_FILE="")
    one_line(r, cluster.brokers[0].address, "the server requires a client certificate")
    # A certificate from another CA is no better than none.
    other = cluster.other
    r = gazctl(
        cluster, "journals", "list",
        BROKER_CERT_FILE=str(other.client_cert), BROKER_CERT_KEY_FILE=str(other.client_key),
    )  # fmt: skip
    one_line(r, cluster.brokers[0].address, "the server refused the client certificate")
    channel, stub = cluster.stub(cert=False)
    with channel, pytest.raises(grpc.RpcError) as info:
        list(stub.List(pb.ListRequest(), timeout=5, metadata=bearer(token())))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bad_tls_files_are_one_line_naming_the_flag(cluster: Cluster, tmp_path: Path) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    r = gazctl(cluster, "journals", "list", BROKER_CERT_FILE=str(tmp_path / "missing.crt"))
    one_line(r, "--broker.cert-file", "missing.crt")
    r = gazctl(cluster, "journals", "list", BROKER_TRUSTED_CA_FILE=str(not_pem))
    one_line(r, "--broker.trusted-ca-file", "not a PEM file")
    # A certificate with another's key.
    r = gazctl(cluster, "journals", "list", BROKER_CERT_KEY_FILE=str(cluster.other.client_key))
    one_line(r, "--broker.cert-file", "--broker.cert-key-file", "do not load together")
    r = run_cli(
        "gazette", "serve", "--broker.id", "bad-tls", "--broker.host", "127.0.0.1",
        "--broker.server-cert-file", str(cluster.pki.server_cert),
    )  # fmt: skip
    one_line(r, "--broker.server-cert-file", "--broker.server-cert-key-file")
    r = run_cli("gazette", "serve", "--broker.id", "bad-keys", "--broker.auth-keys", "not base64!")
    one_line(r, "--broker.auth-keys", "index 0", "base64")


def test_a_secret_flag_takes_a_file_instead(cluster: Cluster, tmp_path: Path) -> None:
    """Every flag that takes a secret has a `-file` form (and its variable), so the secret
    need never be on a command line; giving both is one line naming them, as is a bad file."""
    keys = tmp_path / "keys"
    keys.write_text(b64(KEY1) + "\n")
    r = gazctl(cluster, "journals", "list", "--broker.auth-keys-file", str(keys), BROKER_AUTH_KEYS="")  # fmt: skip
    assert r.code == 0 and "a/one" in r.out, r.err
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS="", BROKER_AUTH_KEYS_FILE=str(keys))
    assert r.code == 0 and "a/one" in r.out, r.err
    tok = tmp_path / "token"
    tok.write_text(token(cap=auth.LIST))
    r = gazctl(cluster, "journals", "list", "--broker.auth-token-file", str(tok), BROKER_AUTH_KEYS="")  # fmt: skip
    assert r.code == 0 and "a/one" in r.out, r.err
    # A flag wins over a variable, as everywhere; both at once is refused.
    r = gazctl(cluster, "journals", "list", "--broker.auth-keys-file", str(keys), BROKER_AUTH_KEYS="AA==")  # fmt: skip
    assert r.code == 0 and "a/one" in r.out, r.err
    r = gazctl(cluster, "journals", "list", "--broker.auth-keys", b64(KEY1), "--broker.auth-keys-file", str(keys))  # fmt: skip
    one_line(r, "--broker.auth-keys", "--broker.auth-keys-file", "not both")
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS_FILE=str(keys))
    one_line(r, "--broker.auth-keys", "--broker.auth-keys-file", "not both")
    missing = tmp_path / "missing-keys"
    r = gazctl(cluster, "journals", "list", "--broker.auth-keys-file", str(missing), BROKER_AUTH_KEYS="")  # fmt: skip
    one_line(r, "--broker.auth-keys-file", str(missing))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = gazctl(cluster, "journals", "list", "--broker.auth-token-file", str(empty), BROKER_AUTH_KEYS="")  # fmt: skip
    one_line(r, "--broker.auth-token-file", str(empty), "empty")
    # The servers' flags alike.
    for command in (
        ("gazette", "serve", "--broker.id", "bad-file", "--broker.auth-keys-file"),
        (sys.executable, "-m", "replication", "serve", "--location", "A", "--replication.auth-keys-file"),
    ):  # fmt: skip
        flag = command[-1]
        r = (
            run_cli(*command, str(missing))
            if command[0] == "gazette"
            else run(command, str(missing))
        )
        one_line(r, flag, str(missing))


@dataclass
class Ran:
    code: int
    out: str
    err: str


def run(command: tuple[str, ...], *args: str) -> Ran:
    p = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)
    return Ran(p.returncode, p.stdout, p.stderr)


# ---- tokens ------------------------------------------------------------------------------------


def call_list(cluster: Cluster, metadata: Any, index: int = 0) -> list[str]:
    channel, stub = cluster.stub(index)
    with channel:
        names: list[str] = []
        for response in stub.List(pb.ListRequest(), timeout=10, metadata=metadata):
            names.extend(j.spec.name for j in response.journals)
        return names


def unauthenticated(cluster: Cluster, metadata: Any, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call_list(cluster, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    for word in words:
        assert word in (info.value.details() or ""), info.value.details()


def test_tokens_each_refused_as_upstream_refuses_them(cluster: Cluster) -> None:
    unauthenticated(cluster, (), "missing or empty Authorization token")
    unauthenticated(cluster, (("authorization", "Basic dXNlcjpwYXNz"),), "expected 'Bearer'")
    unauthenticated(cluster, bearer("not.a.jwt"), "malformed")
    unauthenticated(cluster, bearer(token(KEY3)), "signature is invalid")
    # Expired beyond the 5 s leeway; within it, still good.
    unauthenticated(cluster, bearer(token(exp=time.time() - 30)), "expired")
    assert "a/one" in call_list(cluster, bearer(token(exp=time.time() - 2)))
    # Issued in the future beyond the leeway.
    unauthenticated(cluster, bearer(token(iat=time.time() + 60)), "before issued")
    unauthenticated(cluster, bearer(token(exp=-1)), "exp")
    # Algorithms: `none` and HS512 are refused; HS384 is accepted.
    unsigned = jwt.encode({"cap": auth.ALL, "exp": int(time.time()) + 60}, None, algorithm="none")
    unauthenticated(cluster, bearer(unsigned), "signature is invalid")
    unauthenticated(cluster, bearer(token(alg="HS512")), "signature is invalid")
    assert "a/one" in call_list(cluster, bearer(token(alg="HS384")))
    # Capabilities.
    unauthenticated(cluster, bearer(token(cap=auth.READ | auth.APPEND)), "missing required LIST capability")  # fmt: skip
    assert "a/one" in call_list(cluster, bearer(token(cap=auth.LIST)))
    # No refusal leaks the token, and none is logged.
    secret = token(KEY3)
    with pytest.raises(grpc.RpcError) as info:
        call_list(cluster, bearer(secret))
    assert secret not in (info.value.details() or "")
    for broker in cluster.brokers:
        assert secret not in broker.log.read_text()


def test_key_rotation_accepts_either_key_and_gazctl_signs_with_its_first(cluster: Cluster) -> None:
    # The brokers verify with KEY2 and KEY1.
    assert "a/one" in call_list(cluster, bearer(token(KEY1)))
    assert "a/one" in call_list(cluster, bearer(token(KEY2)))
    for keys in (b64(KEY2), f"{b64(KEY1)} {b64(KEY3)}"):
        r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS=keys)
        assert r.code == 0 and "a/one" in r.out, r.err
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS=f"{b64(KEY3)},{b64(KEY1)}")
    one_line(r, "UNAUTHENTICATED", "signature is invalid")
    # A pre-shared token instead of keys.
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS="", BROKER_AUTH_TOKEN=token(cap=auth.LIST))  # fmt: skip
    assert r.code == 0 and "a/one" in r.out, r.err
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS="")
    one_line(r, "UNAUTHENTICATED", "missing or empty Authorization token")


def test_a_selector_hides_journals_from_every_rpc(cluster: Cluster) -> None:
    reds = token(sel=name_prefix("a/"))
    md = bearer(reds)
    assert sorted(call_list(cluster, md)) == ["a/one", "a/two"]
    assert "b/secret" in call_list(cluster, bearer(token()))
    # A label selector works as well as a name: team=blue sees only b/secret.
    blue = bearer(token(sel={"include": {"labels": [{"name": "team", "value": "blue"}]}}))
    assert call_list(cluster, blue) == ["b/secret"]
    # `exclude`: everything but team=blue.
    not_blue = bearer(token(sel={"exclude": {"labels": [{"name": "team", "value": "blue"}]}}))
    assert sorted(call_list(cluster, not_blue)) == ["a/one", "a/two"]

    for index in range(2):  # Whichever broker is asked (a replica, or one that would proxy).
        channel, stub = cluster.stub(index)
        with channel:
            reads = list(stub.Read(pb.ReadRequest(journal="b/secret", block=False), metadata=md, timeout=10))  # fmt: skip
            assert [r.status for r in reads] == [pb.JOURNAL_NOT_FOUND]
            assert not reads[0].header.route.members  # Not even where it lives.
            ok = list(stub.Read(pb.ReadRequest(journal="a/two", block=False), metadata=md, timeout=10))  # fmt: skip
            assert ok[0].status in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE)
            appended = stub.Append(iter([pb.AppendRequest(journal="b/secret"), pb.AppendRequest(content=b"x"), pb.AppendRequest()]), metadata=md, timeout=10)  # fmt: skip
            assert appended.status == pb.JOURNAL_NOT_FOUND
            frags = stub.ListFragments(pb.FragmentsRequest(journal="b/secret"), metadata=md, timeout=10)  # fmt: skip
            assert frags.status == pb.JOURNAL_NOT_FOUND
            # Apply: an upsert or a delete outside the selector is refused, and nothing changes.
            for change in (
                pb.ApplyRequest.Change(delete="b/secret", expect_mod_revision=-1),
                pb.ApplyRequest.Change(
                    upsert=pb.JournalSpec(
                        name="b/new",
                        replication=1,
                        fragment=pb.JournalSpec.Fragment(
                            length=100000,
                            compression_codec=pb.NONE,
                            refresh_interval={"seconds": 60},
                        ),
                    ),
                    expect_mod_revision=0,
                ),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Apply(pb.ApplyRequest(changes=[change]), metadata=md, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "not authorized to b/" in (info.value.details() or "")
    assert sorted(call_list(cluster, bearer(token()))) == ["a/one", "a/two", "b/secret"]
    # gazctl with a pre-shared narrow token sees the same.
    r = gazctl(cluster, "journals", "list", BROKER_AUTH_KEYS="", BROKER_AUTH_TOKEN=reds)
    assert r.code == 0 and "a/one" in r.out and "b/secret" not in r.out, r.err
    r = gazctl(cluster, "journals", "read", "-l", "name=b/secret", BROKER_AUTH_KEYS="", BROKER_AUTH_TOKEN=reds)  # fmt: skip
    assert "secret" not in r.out


def test_a_read_proxied_by_a_broker_carries_its_own_authorization(cluster: Cluster) -> None:
    # a/two has one replica: the other broker proxies to it, signing with its own key, and
    # the narrow token of the client is honoured on the way.
    r = gazctl(cluster, "journals", "append", "-l", "name=a/two", input="proxied\n")
    assert r.code == 0, r.err
    md = bearer(token(cap=auth.READ, sel=name_prefix("a/")))
    contents = []
    for index in range(2):
        channel, stub = cluster.stub(index)
        with channel:
            data = b"".join(
                r.content
                for r in stub.Read(
                    pb.ReadRequest(journal="a/two", block=False), metadata=md, timeout=10
                )
            )
            contents.append(data)
    assert contents == [b"proxied\n", b"proxied\n"]


def _until_it_ends(call: Any) -> tuple[list[Any], grpc.RpcError | None, float]:
    """Every response of a streaming call, how it ended, and when (wall-clock)."""
    received: list[Any] = []
    try:
        for response in call:
            received.append(response)
    except grpc.RpcError as exc:
        return received, exc, time.time()
    return received, None, time.time()


def test_a_call_ends_when_its_token_expires(cluster: Cluster) -> None:
    """A token is checked when a call starts, and the call lasts no longer than it does: a
    blocking Read (through either broker: one proxies) and a List watch, each given a token
    that expires in 2 s, get what there is, then end UNAUTHENTICATED at its exp plus the 5 s
    of leeway, not whenever they happen to finish."""
    from concurrent.futures import ThreadPoolExecutor

    r = gazctl(cluster, "journals", "append", "-l", "name=a/two", input="before it expires\n")
    assert r.code == 0, r.err
    exp = int(time.time()) + 2
    md = bearer(token(exp=exp))
    channels = [cluster.stub(index) for index in range(2)]
    try:
        with ThreadPoolExecutor(3) as pool:
            calls = [
                stub.Read(pb.ReadRequest(journal="a/two", block=True), metadata=md, timeout=15)
                for _, stub in channels
            ]
            calls.append(channels[0][1].List(pb.ListRequest(watch=True), metadata=md, timeout=15))
            futures = [pool.submit(_until_it_ends, call) for call in calls]
            ended = [future.result() for future in futures]
    finally:
        for channel, _ in channels:
            channel.close()
    for index, (_, error, at) in enumerate(ended):
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED, (index, error)
        assert "expired" in (error.details() or ""), error.details()
        assert exp + auth.LEEWAY - 0.5 <= at <= exp + auth.LEEWAY + 2, (index, at - exp)
    for received, _, _ in ended[:2]:  # Each read had the content before it was cut off.
        assert b"".join(r.content for r in received).endswith(b"before it expires\n")
    assert "a/two" in {j.spec.name for j in ended[2][0][0].journals}  # The watch's snapshot.


# ---- etcd over TLS, and the AA== roll-out -----------------------------------------------------


@pytest.fixture(scope="module")
def tls_etcd(pki_pair: tuple[DevPKI, DevPKI]) -> Iterator[EtcdServer]:
    pki = pki_pair[0]
    with EtcdServer(tls=pki) as etcd:
        yield etcd


def test_a_broker_reaches_etcd_over_tls_and_rolls_authorization_out(
    tls_etcd: EtcdServer, pki_pair: tuple[DevPKI, DevPKI], tmp_path: Path
) -> None:
    pki = pki_pair[0]
    etcd_flags = (
        "--etcd.cert-file", str(pki.client_cert), "--etcd.cert-key-file", str(pki.client_key),
        "--etcd.trusted-ca-file", str(pki.ca_cert),
    )  # fmt: skip
    # Without a client certificate etcd refuses the broker, which does not start.
    r = run_cli(
        "gazette", "serve", "--broker.id", "no-etcd-cert", "--broker.host", "127.0.0.1",
        "--broker.port", "0", "--etcd.address", tls_etcd.endpoint, "--log.level", "error",
        "--etcd.trusted-ca-file", str(pki.ca_cert), timeout=60,
    )  # fmt: skip
    assert r.code != 0 and "Traceback" not in r.err, r.err
    # With one, it serves; `AA==` among its keys admits calls without a token (a roll-out),
    # while a token that is there must verify.
    broker = start_broker_process(
        tls_etcd, "/rollout", tmp_path / "broker.log", broker_id="rollout-broker",
        extra=(*etcd_flags, "--broker.auth-keys", f"{b64(KEY1)} AA=="),
    )  # fmt: skip
    try:
        target = broker.address.removeprefix("http://")
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            assert next(iter(stub.List(pb.ListRequest(), timeout=10))).status == pb.OK
            assert list(stub.List(pb.ListRequest(), timeout=10, metadata=bearer(token())))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.List(pb.ListRequest(), timeout=10, metadata=bearer(token(KEY3))))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        r = run_cli("gazctl", "journals", "list", env={"BROKER_ADDRESS": broker.address})
        assert r.code == 0, r.err
    finally:
        stop_process(broker.proc)


# ---- consumers ---------------------------------------------------------------------------------


def test_consumers_serve_tls_and_verify_tokens_end_to_end(
    cluster: Cluster, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """stream-sum's summers serve the Shard service over TLS with client certificates
    required and verify tokens; they reach the brokers over TLS with tokens of their own. Its
    setup and chunker (configured by environment, as upstream's) run against them, every sum
    arrives exact, and shard RPCs honour capabilities and selectors."""
    from broker.protocol import consumer_pb2 as cpb
    from broker.protocol import consumer_pb2_grpc as cpb_grpc
    from tests.helpers.consumers import ConsumerProcesses

    pki = cluster.pki
    example = [sys.executable, "-m", "consumer.examples.stream_sum"]
    consumer_keys = b64(KEY2)
    client_env = {
        **cluster.gazctl_env(),
        "CONSUMER_CERT_FILE": str(pki.client_cert),
        "CONSUMER_CERT_KEY_FILE": str(pki.client_key),
        "CONSUMER_TRUSTED_CA_FILE": str(pki.ca_cert),
        "CONSUMER_AUTH_KEYS": consumer_keys,
    }
    (tmp_path / "stores").mkdir()
    server_flags = [
        "--summer.store-root", str(tmp_path / "stores"), *pki.server_flags("consumer"),
        "--consumer.auth-keys", consumer_keys,
        "--broker.cert-file", str(pki.client_cert), "--broker.cert-key-file", str(pki.client_key),
        "--broker.trusted-ca-file", str(pki.ca_cert), "--broker.auth-keys", b64(KEY1),
        "--consumer.http-port", "0",
    ]  # fmt: skip
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    group = ConsumerProcesses(
        example, server_flags, etcd_server, cluster.brokers[0], root, tmp_path
    )
    group.tls = cluster.client_creds()
    group.metadata = bearer(token(KEY2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BROKER_", "CONSUMER_"))}
    env.update(client_env)
    try:
        for summer in ("summer-0", "summer-1"):
            group.start(summer)
        setup = subprocess.run(
            [*example, "setup", "--partitions", "2", "--broker.address", cluster.brokers[0].address,
             "--consumer.address", group.address("summer-0")],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert setup.returncode == 0, setup.stderr
        chunker = subprocess.run(
            [*example, "chunker", "--streams", "20", "--chunks", "5", "--pace", "0.01",
             "--seed", "5", "--timeout", "60", "--broker.address", cluster.brokers[0].address],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
        assert chunker.returncode == 0, chunker.stderr + chunker.stdout
        assert "all exact" in chunker.stdout
        # Each summer serves its metrics over TLS (client certificate required, as on gRPC).
        transactions = 0.0
        for summer in ("summer-0", "summer-1"):
            found = re.search(r"serves HTTP on port (\d+)", group.log(summer))
            assert found, group.log(summer)[-2000:]
            url = f"https://127.0.0.1:{found.group(1)}/debug/metrics"
            anonymous = ssl.create_default_context(cafile=str(pki.ca_cert))
            with pytest.raises(httpx.HTTPError):
                httpx.get(url, verify=anonymous, timeout=10)  # No client certificate.
            client = ssl.create_default_context(cafile=str(pki.ca_cert))
            client.load_cert_chain(str(pki.client_cert), str(pki.client_key))
            text = httpx.get(url, verify=client, timeout=10).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "gazette_shard_transactions_total":
                        transactions += sample.value
            if "gazette_shard_transactions_total{" in text:  # It ran shards: their heads and lag.
                assert "gazette_shard_read_head{" in text and "gazette_shard_lag_bytes{" in text
        assert transactions > 0

        r = run_cli("gazctl", "shards", "list", "--consumer.address", group.address("summer-0"), env=client_env)  # fmt: skip
        assert r.code == 0, r.err
        shard_ids = sorted(line.split()[0] for line in r.out.splitlines()[1:] if line.strip())
        assert len(shard_ids) == 2, r.out
        hidden, visible = shard_ids
        target = group.address("summer-0").removeprefix("https://")
        with grpc.secure_channel(target, cluster.client_creds()) as channel:
            stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
            only = bearer(token(KEY2, sel={"include": {"labels": [{"name": "id", "value": visible}]}}))  # fmt: skip
            listed = stub.List(cpb.ListRequest(), metadata=only, timeout=10)
            assert [s.spec.id for s in listed.shards] == [visible]
            for shard, status in ((hidden, cpb.SHARD_NOT_FOUND), (visible, cpb.OK)):
                assert stub.Stat(cpb.StatRequest(shard=shard), metadata=only, timeout=10).status == status  # fmt: skip
                hints = stub.GetHints(cpb.GetHintsRequest(shard=shard), metadata=only, timeout=10)
                assert hints.status == status
            for request, call in (
                (cpb.UnassignRequest(shards=[hidden], dry_run=True), stub.Unassign),
                (
                    cpb.ApplyRequest(
                        changes=[cpb.ApplyRequest.Change(delete=hidden, expect_mod_revision=-1)]
                    ),
                    stub.Apply,
                ),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, metadata=only, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert f"not authorized to {hidden}" in (info.value.details() or "")
            # Capabilities: a READ token may Stat but not List; a broker's key is not theirs.
            with pytest.raises(grpc.RpcError) as info:
                stub.List(cpb.ListRequest(), metadata=bearer(token(KEY2, cap=auth.READ)), timeout=10)  # fmt: skip
            assert "missing required LIST capability" in (info.value.details() or "")
            with pytest.raises(grpc.RpcError) as info:
                stub.List(cpb.ListRequest(), metadata=bearer(token(KEY1)), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Plaintext is refused.
        r = run_cli(
            "gazctl", "shards", "list",
            "--consumer.address", group.address("summer-0").replace("https://", "http://"),
            env=client_env,
        )  # fmt: skip
        one_line(r, "http://127.0.0.1")
    finally:
        group.stop_all()


# ---- Spark --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_spark_replay_reaches_tls_brokers_with_tokens_from_its_executors(
    etcd_server: EtcdServer, pki_pair: tuple[DevPKI, DevPKI], tmp_path: Path
) -> None:
    """`gazctl spark replay --to journal:` in a process of its own: its driver lists through a
    TLS broker that verifies tokens, and its executors append to it, with the credentials gazctl
    was given (passed to Spark's workers through the environment)."""
    pki = pki_pair[0]
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    ready = grpc.ssl_channel_credentials(
        pki.ca_cert.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    broker = start_broker_process(
        etcd_server, f"/gazette-test/{uuid.uuid4().hex[:12]}", tmp_path / "broker.log",
        broker_id="spark-tls-broker",
        extra=(*tls_flags(pki, b64(KEY1)), "--broker.file-root", str(root)),
        tls=ready, metadata=bearer(token()),
    )  # fmt: skip
    env = {
        "BROKER_ADDRESS": broker.address,
        "BROKER_CERT_FILE": str(pki.client_cert),
        "BROKER_CERT_KEY_FILE": str(pki.client_key),
        "BROKER_TRUSTED_CA_FILE": str(pki.ca_cert),
        "BROKER_AUTH_KEYS": b64(KEY1),
        "BROKER_FILE_ROOT": str(root),
    }
    try:
        for name, store in (("spk/source", "file:///store/"), ("spk/target", "")):
            stores = f", stores: [{store}]" if store else ""
            spec = (
                f"name: {name}\nreplication: 1\n"
                "labels: [{name: content-type, value: application/x-ndjson}]\n"
                f"fragment: {{length: 100000, compression_codec: GZIP, refresh_interval: 1s{stores}}}\n"
            )
            r = run_cli("gazctl", "journals", "apply", input=spec, env=env)
            assert r.code == 0, r.err
        lines = "".join(f'{{"n": {i}}}\n' for i in range(50))
        r = run_cli("gazctl", "attach-uuids", "--template", '{"_meta":{"uuid":"{{.UUID}}"},"line":{{.Line}}}\n', input=lines, env=env)  # fmt: skip
        assert r.code == 0, r.err
        messages = r.out
        r = run_cli(
            "gazctl", "journals", "append", "-l", "name=spk/source", input=messages, env=env
        )
        assert r.code == 0, r.err
        r = run_cli("gazctl", "journals", "suspend", "-l", "name=spk/source", "--force", env=env)
        assert r.code == 0, r.err

        def stored() -> bool:
            listed = run_cli("gazctl", "journals", "fragments", "-l", "name=spk/source", "-o", "json", env=env)  # fmt: skip
            return listed.code == 0 and "file:///store/" in listed.out

        until_blocking(stored, "the store holds spk/source", 30, 0.5)
        r = run_cli(
            "gazctl", "spark", "replay", "-l", "name=spk/source", "--to", "journal:spk/target",
            env=env, timeout=240,
        )  # fmt: skip
        assert r.code == 0, r.err
        r = run_cli("gazctl", "journals", "read", "-l", "name=spk/target", env=env)
        assert r.code == 0, r.err
        assert r.out.count('"line"') == 50, r.out[:2000]
        # Without the key, the same replay is refused, in one line.
        r = run_cli(
            "gazctl", "spark", "replay", "-l", "name=spk/source", "--to", "journal:spk/target",
            env={**env, "BROKER_AUTH_KEYS": ""}, timeout=240,
        )  # fmt: skip
        one_line(r, "UNAUTHENTICATED")
    finally:
        stop_process(broker.proc)


def test_token_claims_are_read_as_upstream_reads_them() -> None:
    """Differences from upstream's JWT parsing, each a failing test first: an `aud` claim (set
    by external issuers) is accepted; a selector whose values have the wrong type is refused
    rather than coerced ("prefix": "false" read as a prefix match), and a null one read as
    Go reads it (tests/test_auth_claims.py has the rest); an empty authorization
    header is refused as not Bearer, not taken for a missing token."""
    verifier = auth.KeyedVerifier([KEY1], allow_missing=True)
    now = int(time.time())
    with_aud = jwt.encode(
        {"cap": auth.ALL, "exp": now + 60, "aud": "gazette", "iss": "https://issuer.example"},
        KEY1, algorithm="HS256",
    )  # fmt: skip
    assert verifier.verify(bearer(with_aud), auth.LIST).capability == auth.ALL
    label = {"name": "name", "value": "a/", "prefix": True}
    good = token(sel={"include": {"labels": [label]}})
    assert verifier.verify(bearer(good), auth.LIST).selector.include.labels[0].prefix
    for bad in (
        {**label, "prefix": "false"},
        {**label, "prefix": 1},
        {**label, "value": 7},
    ):
        with pytest.raises(auth.Unauthenticated, match="claim 'sel'"):
            verifier.verify(bearer(token(sel={"include": {"labels": [bad]}})), auth.LIST)
    # Null is no value to Go's decoding (the name stays empty): read so, not refused. A label
    # of no name selects nothing, so the token sees nothing rather than everything.
    nameless = verifier.verify(bearer(token(sel={"include": {"labels": [{**label, "name": None}]}})), auth.LIST)  # fmt: skip
    assert [(lb.name, lb.value) for lb in nameless.selector.include.labels] == [("", "a/")]
    with pytest.raises(auth.Unauthenticated, match="claim 'sel'"):
        verifier.verify(bearer(token(sel={"include": {"labels": "name=a/"}})), auth.LIST)
    with pytest.raises(auth.Unauthenticated, match="expected 'Bearer'"):
        verifier.verify((("authorization", ""),), auth.LIST)
    # No header at all, with missing tokens allowed (a broker without keys' strictness).
    assert verifier.verify((), auth.LIST).capability == auth.LIST


# ---- the tokens brokers sign for themselves ------------------------------------------------------


class RecordingVerifier:
    """A broker's verifier that keeps the claims of every call it verified, by capability."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leeway = inner.leeway
        self.seen: list[tuple[int, auth.Claims]] = []

    def verify(self, metadata: Any, require: int) -> auth.Claims:
        claims: auth.Claims = self.inner.verify(metadata, require)
        self.seen.append((require, claims))
        return claims

    def of(self, capability: int) -> list[auth.Claims]:
        return [claims for require, claims in self.seen if require == capability]


async def append_to(endpoint: str, journal: str, content: bytes) -> pb.AppendResponse:
    """One Append with a client's token for everything (no retries: its first answer)."""
    channel = grpc.aio.insecure_channel(endpoint.removeprefix("http://"))
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        requests = [pb.AppendRequest(journal=journal), pb.AppendRequest(content=content), pb.AppendRequest()]  # fmt: skip
        response: pb.AppendResponse = await stub.Append(iter(requests), metadata=bearer(token()), timeout=20)  # fmt: skip
        return response
    finally:
        await channel.close()


async def test_brokers_sign_their_own_tokens_for_one_journal_and_briefly(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: Any
) -> None:
    """A broker that proxies an Append, or replicates a journal it leads, signs itself a token
    for that journal alone (`name=<journal>`), living minutes: not APPEND or REPLICATE over
    every journal, for a minute or an hour."""
    from tests.helpers.journals import journal_spec, set_journal, started_brokers

    ids = ["signer", "peer"]
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ids, auth_keys=b64(KEY1)) as (a, b):  # fmt: skip
        assert b.broker.service is not None
        recording = b.broker.service.verifier = RecordingVerifier(b.broker.service.verifier)
        await set_journal(etcd, etcd_prefix, journal_spec("own/replicated", replication=2), [("local", "signer"), ("local", "peer")])  # fmt: skip
        await set_journal(etcd, etcd_prefix, journal_spec("own/proxied", replication=1), [("local", "peer")])  # fmt: skip
        for journal in ("own/replicated", "own/proxied"):  # Both through the signer.
            assert (await append_to(a.endpoint, journal, b"hello\n")).status == pb.OK
        signed = time.time()
        for capability, journal in ((auth.REPLICATE, "own/replicated"), (auth.APPEND, "own/proxied")):  # fmt: skip
            tokens = recording.of(capability)
            assert tokens, capability
            for claims in tokens:
                assert claims.capability == capability
                sel = claims.selector
                assert [(x.name, x.value, x.prefix) for x in sel.include.labels] == [("name", journal, False)], sel  # fmt: skip
                assert not sel.exclude.labels, sel
                assert claims.exp - signed <= 600 + 1, claims.exp - signed


async def test_a_pipeline_is_renewed_before_its_token_expires(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replication pipeline lives longer than its token: its primary builds a new one (with
    a fresh token) before the peer would end the old one, so an append after the token's
    expiry commits on its first try, never failing for it."""
    from broker import pipeline
    from tests.helpers.journals import journal_spec, set_journal, started_brokers

    monkeypatch.setattr(pipeline, "TOKEN_TTL", 2.0, raising=False)
    monkeypatch.setattr(pipeline, "RENEW_BEFORE", 1.0, raising=False)
    ids = ["renewing", "peer"]
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ids, auth_keys=b64(KEY1)) as (a, b):  # fmt: skip
        assert b.broker.service is not None
        recording = b.broker.service.verifier = RecordingVerifier(b.broker.service.verifier)
        spec = journal_spec("own/renewed", replication=2)
        await set_journal(etcd, etcd_prefix, spec, [("local", "renewing"), ("local", "peer")])
        assert (await append_to(a.endpoint, "own/renewed", b"first\n")).status == pb.OK
        first = recording.of(auth.REPLICATE)[-1]
        assert first.exp - time.time() <= 2, first.exp - time.time()  # The pipeline's, short.
        # Past the token's exp and the peer's leeway: the peer ended the old pipeline's stream.
        await asyncio.sleep(first.exp + auth.LEEWAY + 0.5 - time.time())  # The expiry under test.
        response = await append_to(a.endpoint, "own/renewed", b"second\n")
        assert response.status == pb.OK, response
        assert recording.of(auth.REPLICATE)[-1].exp > first.exp  # A new pipeline's token.


def test_a_clients_token_for_a_shard_call_names_its_shard() -> None:
    """As a Read's token names its journal, a Stat's or GetHints' names its shard (`id`): a
    consumer proxying a Stat to the shard's primary signs READ over that shard alone."""
    from broker.protocol import consumer_pb2 as cpb
    from broker.protocol import labels

    sent: list[Any] = []

    class Recording:  # A channel's multi-callables, recording each call's metadata.
        def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return lambda request, metadata=None, **kw: sent.append(metadata)

    channel: Any = auth.authorized_channel(Recording(), auth.KeyedAuth([KEY1]))  # type: ignore[arg-type]
    channel.unary_unary("/consumer.Shard/Stat")(cpb.StatRequest(shard="shard-a"))
    channel.unary_unary("/consumer.Shard/GetHints")(cpb.GetHintsRequest(shard="shard-a"))
    channel.unary_unary("/consumer.Shard/List")(cpb.ListRequest())
    verifier = auth.KeyedVerifier([KEY1], False)
    stat, hints, listing = (verifier.verify(md, 0) for md in sent)
    for claims in (stat, hints):
        assert [(label.name, label.value) for label in claims.selector.include.labels] == [
            ("id", "shard-a")
        ]
        assert claims.sees_labels(labels.label_set(("id", "shard-a")))
        assert not claims.sees_labels(labels.label_set(("id", "shard-b")))
    assert listing.unrestricted  # A List asks for its capability over everything.
