"""`gazctl dev up|down|status|kill|restart`: a real local cluster of etcd and broker subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gazctl.dev import ClusterState, is_running
from tests.conftest import Result, run_cli


def test_up_status_down(cluster_dir: Path) -> None:
    r = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "2", timeout=120)
    assert r.code == 0, r.err
    state = ClusterState.load(cluster_dir)
    assert state is not None and len(state.brokers) == 2
    assert all(is_running(p) for p in state.all())
    # stdout holds the exports alone, so that `eval "$(gazctl dev up)"` sets them; the status
    # table is on stderr.
    assert all(line.startswith("export ") for line in r.out.splitlines()), r.out
    assert "broker-1" in r.err
    exports = r.out.strip().splitlines()[-2:]
    assert exports == [
        f"export BROKER_ADDRESS={state.brokers[0].address},{state.brokers[1].address}",
        f"export BROKER_FILE_ROOT={cluster_dir.resolve() / 'fragments'}",
    ]

    # Both brokers are registered, and serve the Journal service.
    listed = run_cli("gazctl", "journals", "list", env={"BROKER_ADDRESS": state.brokers[1].address})
    assert listed.code == 0, listed.err

    # Every server bound to loopback.
    for proc in state.all():
        assert proc.address.startswith("http://127.0.0.1:")

    status = run_cli("gazctl", "dev", "status", "--dir", str(cluster_dir))
    assert status.code == 0
    assert status.out.count("running") == 3

    again = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir))
    assert again.code == 0
    assert "already running" in again.err
    assert all(line.startswith("export ") for line in again.out.splitlines()), again.out
    assert again.out.strip().splitlines()[-2:] == exports
    assert ClusterState.load(cluster_dir) == state  # Nothing new was started.

    down = run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir))
    assert down.code == 0, down.err
    assert "stopped 3" in down.err
    # It says what it waits for, process by process, as it goes.
    for proc in state.all():
        assert f"stopping {proc.role} (pid {proc.pid}): waiting up to" in down.err, down.err
    assert not any(is_running(p) for p in state.all())
    assert ClusterState.load(cluster_dir) is None

    status = run_cli("gazctl", "dev", "status", "--dir", str(cluster_dir))
    assert status.code != 0 and "no dev cluster" in status.err


def test_broker_address_reaches_any_live_broker(cluster_dir: Path, tmp_path: Path) -> None:
    """`dev up` exports every broker in BROKER_ADDRESS, so that after `dev kill broker-0`
    journals list and append reach broker-1 through the same exported value."""
    r = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "2", timeout=120)
    assert r.code == 0, r.err
    state = ClusterState.load(cluster_dir)
    assert state is not None
    env = exported(r.out)
    assert env["BROKER_ADDRESS"] == ",".join(b.address for b in state.brokers)
    specs = tmp_path / "specs.yaml"
    specs.write_text(
        "name: failover/one\nreplication: 1\n"
        "fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n"
    )
    applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
    assert applied.code == 0, applied.err

    killed = run_cli("gazctl", "dev", "kill", "--dir", str(cluster_dir), "broker-0")
    assert killed.code == 0, killed.err
    listed = run_cli("gazctl", "journals", "list", env=env)
    assert listed.code == 0 and "failover/one" in listed.out, listed.err
    # Served by broker-1 once broker-0's lease (10 s) lapses: within append's own --wait.
    appended = run_cli(
        "gazctl", "journals", "append", "-l", "name=failover/one", input="hello\n", env=env
    )
    assert appended.code == 0, appended.err
    read = run_cli("gazctl", "journals", "read", "-l", "name=failover/one", env=env)
    assert read.code == 0 and read.out == "hello\n", read.err
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0


def test_stale_state_from_a_crash_is_cleaned(cluster_dir: Path) -> None:
    assert (
        run_cli(
            "gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1", timeout=120
        ).code
        == 0
    )
    crashed = ClusterState.load(cluster_dir)
    assert crashed is not None
    # A crash (or a reboot): every process dies hard.
    for proc in crashed.all():
        os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(is_running(p) for p in crashed.all()) and time.monotonic() < deadline:
        time.sleep(0.05)

    status = run_cli("gazctl", "dev", "status", "--dir", str(cluster_dir))
    assert status.code != 0 and status.out.count("down") == 2

    # Nothing of it runs: a new cluster, as the flags ask, on the same addresses.
    r = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1", timeout=120)
    assert r.code == 0, r.err
    assert "stale" in r.err
    fresh = ClusterState.load(cluster_dir)
    assert fresh is not None and fresh.etcd.pid != crashed.etcd.pid
    assert all(is_running(p) for p in fresh.all())
    assert [p.address for p in fresh.all()] == [p.address for p in crashed.all()]
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir), "--purge").code == 0
    assert not cluster_dir.exists()
    assert not any(is_running(p) for p in fresh.all())


def test_state_file_is_json_with_pids(cluster_dir: Path) -> None:
    cluster_dir.mkdir(parents=True)
    (cluster_dir / "cluster.json").write_text("{not json")
    assert ClusterState.load(cluster_dir) is None
    (cluster_dir / "cluster.json").write_text(json.dumps({"dir": "x"}))
    assert ClusterState.load(cluster_dir) is None


def test_dev_up_again_keeps_addresses(cluster_dir: Path) -> None:
    up = ("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "2")
    r = run_cli(*up, timeout=120)
    assert r.code == 0, r.err
    first = ClusterState.load(cluster_dir)
    assert first is not None
    exports = r.out.strip().splitlines()[-2:]
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0

    # Back on the same addresses: an exported BROKER_ADDRESS keeps working.
    r = run_cli(*up, timeout=120)
    assert r.code == 0, r.err
    second = ClusterState.load(cluster_dir)
    assert second is not None and second.etcd.pid != first.etcd.pid
    assert [p.address for p in second.all()] == [p.address for p in first.all()]
    assert r.out.strip().splitlines()[-2:] == exports
    listed = run_cli("gazctl", "journals", "list", env={"BROKER_ADDRESS": first.brokers[0].address})
    assert listed.code == 0, listed.err
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0

    # A port another process took meanwhile: that broker moves, and up says so.
    port = int(first.brokers[0].address.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        r = run_cli(*up, timeout=120)
        assert r.code == 0, r.err
        third = ClusterState.load(cluster_dir)
        assert third is not None
        assert third.brokers[0].address != first.brokers[0].address
        assert [p.address for p in third.all()][1:] == [p.address for p in first.all()][1:]
        assert f"port {port}" in r.err and "BROKER_ADDRESS" in r.err, r.err
        brokers = ",".join(b.address for b in third.brokers)
        assert r.out.strip().splitlines()[-2] == f"export BROKER_ADDRESS={brokers}"
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0


def exported(out: str) -> dict[str, str]:
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in out.splitlines()
        if line.startswith("export ")
    )


def word_count(
    *args: str, env: dict[str, str], input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer.examples.word_count", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env}, input=input,
    )  # fmt: skip


def query_until(prefix: str, want: str, env: dict[str, str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        answer = word_count("query", prefix, env=env)
        if answer.returncode == 0 and want in answer.stdout:
            return answer.stdout
        assert time.monotonic() < deadline, (answer.stdout, answer.stderr)
        time.sleep(0.2)


@pytest.mark.slow
def test_up_with_word_count_consumers_on_postgres(cluster_dir: Path) -> None:
    r = run_cli(
        "gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1",
        "--app", "word-count", "--consumers", "2", "--postgres", timeout=120,
    )  # fmt: skip
    assert r.code == 0, r.err
    state = ClusterState.load(cluster_dir)
    assert state is not None and state.postgres is not None and len(state.consumers) == 2
    assert state.app == "word-count"
    env = exported(r.out)
    assert env["CONSUMER_ADDRESS"] == ",".join(c.address for c in state.consumers)
    assert env["POSTGRES_DSN"] == state.postgres.address
    assert all(is_running(p) for p in state.all())
    for proc in state.all():
        assert proc.address.removeprefix("postgresql://postgres@").startswith(
            ("http://127.0.0.1:", "127.0.0.1:")
        )

    assert word_count("setup", "--partitions", "2", env=env).returncode == 0
    published = word_count("publish", env=env, input="the fox and the dog\n\nthe fox\n")
    assert published.returncode == 0, published.stderr
    query_until("the", "       2  the fox", env)
    listed = run_cli("gazctl", "shards", "list", "--lag", env=env)
    assert listed.code == 0 and listed.out.count("PRIMARY") == 2, listed.err

    # A consumer dies: the other takes its shards over, the counts (in PostgreSQL) unchanged;
    # the exported CONSUMER_ADDRESS reaches the live one.
    os.kill(state.consumers[0].pid, signal.SIGKILL)
    out = query_until("the", "       2  the fox", env)
    assert "       3  the\n" in out

    pg_data = (cluster_dir / "postgres").resolve()
    assert (pg_data / "data" / "PG_VERSION").exists()
    down = run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir), "--purge")
    assert down.code == 0, down.err
    assert "stopped 4" in down.err  # consumer-1, the broker, PostgreSQL, etcd (consumer-0 died)
    assert not any(is_running(p) for p in state.all())
    assert not pg_data.exists() and not cluster_dir.exists()


@pytest.mark.slow
def test_up_with_an_application_by_module_and_name(cluster_dir: Path) -> None:
    r = run_cli(
        "gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1",
        "--app", "consumer.examples.word_count:from_environment", timeout=120,
    )  # fmt: skip
    assert r.code == 0, r.err
    state = ClusterState.load(cluster_dir)
    assert state is not None and len(state.consumers) == 2 and state.postgres is None
    env = exported(r.out)
    assert word_count("setup", "--partitions", "1", env=env).returncode == 0
    assert word_count("publish", env=env, input="one two two").returncode == 0
    query_until("two", "       2  two", env)
    # Its JSON-file stores are in the cluster's folder.
    assert list((cluster_dir / "stores").iterdir())
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0
    assert not any(is_running(p) for p in state.all())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--consumers", "2"], "--consumers needs --app"),
        (["--app", "nonsense"], "neither an example"),
        (["--app", "no_such_module_here:App"], "no module no_such_module_here"),
    ],
)
def test_up_refuses_a_bad_application(cluster_dir: Path, args: list[str], message: str) -> None:
    r = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), *args)
    assert r.code == 2 and message in r.err, r.err
    assert "Traceback" not in r.err
    assert ClusterState.load(cluster_dir) is None  # Nothing started.


def blocked_imports(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which importing each of `modules` fails as it does where the module is
    not installed (a package of that name first on PYTHONPATH raises ModuleNotFoundError)."""
    for module in modules:
        package = tmp_path / "blocked" / module
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n"
        )
    path = [str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}


@pytest.mark.parametrize(
    "blocked, args, extra",
    [
        ("apsw", ["--app", "word-count"], "sqlite"),  # word-count's module imports the store.
        ("asyncpg", ["--app", "word-count", "--postgres"], "sql"),  # Imported by the consumers.
        ("apsw", ["--app", "consumer.examples.stream_sum:from_environment"], "sqlite"),
    ],
)
def test_up_checks_that_the_application_imports_before_starting_anything(
    cluster_dir: Path, tmp_path: Path, blocked: str, args: list[str], extra: str
) -> None:
    """A consumer that cannot import its application (or its store's driver) would fail only
    after etcd and the brokers started: `up` refuses first, in one line naming the extra."""
    r = run_cli(
        "gazctl", "dev", "up", "--dir", str(cluster_dir), *args, env=blocked_imports(tmp_path, blocked)
    )  # fmt: skip
    assert r.code == 1, (r.out, r.err)
    assert "Traceback" not in r.err and r.err.count("\n") == 1, r.err
    assert f"No module named '{blocked}'" in r.err and f"gazette-py[{extra}]" in r.err, r.err
    assert ClusterState.load(cluster_dir) is None and not (cluster_dir / "etcd-data").exists()


@pytest.mark.slow
def test_up_with_locations_in_clusters_of_their_own(cluster_dir: Path) -> None:
    """`--locations east,west`: each location's log on a broker cluster of its own (its own etcd
    prefix), its process registered; connected by `gazctl replication`, an event crosses from
    one cluster to the other, and `down` stops every process by pid. Up again on the same
    folder, the locations keep their logs (persisted to the file:// store) and addresses."""
    up = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1",
                 "--locations", "east,west", timeout=180)  # fmt: skip
    assert up.code == 0, up.err
    state = ClusterState.load(cluster_dir)
    assert state is not None
    assert [p.role for p in state.locations] == ["location-east", "location-west"]
    assert len({p.address for p in state.location_brokers}) == 2
    env = {"ETCD_ADDRESS": exported(up.out)["ETCD_ADDRESS"]}

    def gazctl(*args: str) -> str:
        r = run_cli("gazctl", "replication", *args, env=env)
        assert r.code == 0, (args, r.err)
        return r.out

    listed = gazctl("locations")
    for proc in state.location_brokers:
        assert proc.address in listed  # Each location names its own cluster's broker.
    gazctl("connect", "east", "west", "--both")
    gazctl("emit", "east", '{"kind": "hello"}')
    deadline = time.monotonic() + 30
    while '"hello"' not in gazctl("events", "west"):
        assert time.monotonic() < deadline, gazctl("status", "west")
        time.sleep(0.2)

    down = run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir))
    assert down.code == 0 and "stopped 6" in down.err, down.err
    assert not any(is_running(p) for p in state.all())

    again = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "1",
                    "--locations", "east,west", timeout=180)  # fmt: skip
    assert again.code == 0, again.err
    restarted = ClusterState.load(cluster_dir)
    assert restarted is not None
    assert [p.address for p in restarted.locations] == [p.address for p in state.locations]
    assert '"hello"' in gazctl("events", "west") and '"hello"' in gazctl("events", "east")
    assert "east -> west" in gazctl("topology", "--at", "west")
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0

    bad = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir), "--locations", "a,a")
    assert bad.code == 2 and "distinct" in bad.err


@pytest.mark.slow
def test_up_with_tls_and_auth_runs_every_process_on_them(cluster_dir: Path) -> None:
    r = run_cli(
        "gazctl", "dev", "up", "--dir", str(cluster_dir), "--brokers", "2", "--tls", "--auth",
        "--app", "word-count", "--consumers", "1", "--locations", "1", timeout=180,
    )  # fmt: skip
    assert r.code == 0, r.err
    env = exported(r.out)
    state = ClusterState.load(cluster_dir)
    assert state is not None and state.tls and state.auth
    # No process carries a secret on its command line, where `ps` shows it: the key goes
    # through the environment or a file. The key and the private keys are the owner's alone.
    key = (cluster_dir / "auth-key").read_text().strip()
    for proc in state.all():
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert key not in cmdline, (proc.role, cmdline)
    for path in [cluster_dir / "auth-key", *(cluster_dir / "tls").glob("*.key")]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    # Every process serves TLS only: etcd, brokers, consumers, locations and their brokers.
    for proc in state.all():
        assert proc.address.startswith("https://127.0.0.1:"), proc
    assert env["ETCD_ADDRESS"].startswith("https://") and env["BROKER_AUTH_KEYS"]
    assert Path(env["BROKER_CERT_FILE"]).is_file() and Path(env["BROKER_TRUSTED_CA_FILE"]).is_file()

    # The exports make gazctl and the application's commands clients of the cluster.
    assert word_count("setup", env=env).returncode == 0
    published = word_count("publish", env=env, input="tls and tokens and tls\n")
    assert published.returncode == 0, published.stderr
    assert "       2  tls\n" in query_until("tls", "       2  tls\n", env)
    listed = run_cli("gazctl", "shards", "list", env=env)
    assert listed.code == 0 and listed.out.count("PRIMARY") == 4, listed.err
    located = run_cli("gazctl", "replication", "locations", env=env)
    assert located.code == 0 and "replication/A" in located.out, located.err
    emitted = run_cli("gazctl", "replication", "emit", "A", '{"kind": "secure"}', env=env)
    assert emitted.code == 0, emitted.err
    events = run_cli("gazctl", "replication", "events", "A", env=env)
    assert events.code == 0 and '"kind":"secure"' in events.out, events.err
    refused = run_cli("gazctl", "replication", "emit", "A", "{}", env={**env, "BROKER_AUTH_KEYS": ""})  # fmt: skip
    assert refused.code != 0 and "Authorization" in refused.err and "Traceback" not in refused.err

    # Without the client certificate, or without the key, the cluster refuses.
    no_cert = {**env, "BROKER_CERT_FILE": "", "BROKER_CERT_KEY_FILE": ""}
    refused = run_cli("gazctl", "journals", "list", env=no_cert)
    assert refused.code != 0 and "Traceback" not in refused.err
    no_key = {**env, "BROKER_AUTH_KEYS": ""}
    refused = run_cli("gazctl", "journals", "list", env=no_key)
    assert refused.code != 0 and "UNAUTHENTICATED" in refused.err
    plain = {**env, "ETCD_ADDRESS": env["ETCD_ADDRESS"].replace("https://", "http://")}
    refused = run_cli("gazctl", "replication", "locations", env=plain)
    assert refused.code != 0 and "Traceback" not in refused.err

    # Up again on the same folder: the same exports; down stops every process.
    again = run_cli("gazctl", "dev", "up", "--dir", str(cluster_dir))
    assert again.code == 0 and exported(again.out) == env
    assert run_cli("gazctl", "dev", "down", "--dir", str(cluster_dir)).code == 0
    assert not any(is_running(p) for p in state.all())


def dev(cluster_dir: Path, *args: str, timeout: float = 120) -> Result:
    return run_cli("gazctl", "dev", args[0], "--dir", str(cluster_dir), *args[1:], timeout=timeout)


def pids(state: ClusterState) -> dict[str, int]:
    return {p.role: p.pid for p in state.all()}


def chunker(broker: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer.examples.stream_sum", "chunker", "--broker.address",
         broker, "--streams", "5", "--chunks", "3", "--timeout", "60"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


@pytest.mark.slow
def test_kill_one_process_then_up_starts_only_it_and_restart(cluster_dir: Path) -> None:
    """Failover by hand, on one cluster of stream-sum: `up --app stream-sum` runs its setup;
    `dev kill broker-1` and `dev status` shows it down; `dev up` starts only it, on its
    address, and refuses flags that differ from the running cluster's; `dev restart
    consumer-0` gives it a new pid; the chunker's sums are exact before and after. Unknown
    names and signals are one line each."""
    r = dev(cluster_dir, "up", "--brokers", "2", "--app", "stream-sum", timeout=180)
    assert r.code == 0, r.err
    state = ClusterState.load(cluster_dir)
    assert state is not None and state.app == "stream-sum" and len(state.consumers) == 2
    env = exported(r.out)
    listed = run_cli("gazctl", "journals", "list", env=env)
    assert listed.code == 0, listed.err
    for name in ("chunks/part-000", "chunks/part-001", "sums"):
        assert f"examples/stream-sum/{name}" in listed.out
    shards = run_cli("gazctl", "shards", "list", "-p", env=env)
    assert shards.code == 0 and shards.out.count("PRIMARY") == 4, shards.out  # 2 shards.
    ran = chunker(env["BROKER_ADDRESS"])
    assert ran.returncode == 0, ran.stderr

    before = pids(state)
    killed = dev(cluster_dir, "kill", "broker-1")
    assert killed.code == 0 and f"sent SIGKILL to broker-1 (pid {before['broker-1']})" in killed.err
    status = dev(cluster_dir, "status")
    assert status.code == 1
    assert [line.split()[0] for line in status.out.splitlines() if " down " in line] == ["broker-1"]
    again = dev(cluster_dir, "kill", "broker-1")
    assert again.code == 1 and "already down" in again.err

    # A different configuration than the one running: refused, nothing started or stopped.
    refused = dev(cluster_dir, "up", "--brokers", "3", "--app", "stream-sum")
    assert refused.code == 1 and "Traceback" not in refused.err
    assert refused.err.count("\n") == 1 and "--brokers 2, not --brokers 3" in refused.err
    assert "dev down" in refused.err
    assert ClusterState.load(cluster_dir) == state

    started = dev(cluster_dir, "up")
    assert started.code == 0, started.err
    assert "started broker-1; 4 others were running" in started.err
    after = ClusterState.load(cluster_dir)
    assert after is not None
    assert {k: v for k, v in pids(after).items() if k != "broker-1"} == {
        k: v for k, v in before.items() if k != "broker-1"
    }
    assert after.brokers[1].pid != before["broker-1"] and is_running(after.brokers[1])
    assert [p.address for p in after.all()] == [p.address for p in state.all()]
    assert exported(started.out) == env
    assert dev(cluster_dir, "status").code == 0
    running = dev(cluster_dir, "up")
    assert running.code == 0 and "already running" in running.err
    assert ClusterState.load(cluster_dir) == after

    # Paused and resumed: `status` says so.
    assert dev(cluster_dir, "kill", "--signal", "STOP", "consumer-1").code == 0
    paused = dev(cluster_dir, "status")
    assert paused.code == 0 and "paused" in paused.out
    assert dev(cluster_dir, "kill", "--signal", "cont", "consumer-1").code == 0

    restarted = dev(cluster_dir, "restart", "consumer-0")
    assert restarted.code == 0, restarted.err
    final = ClusterState.load(cluster_dir)
    assert final is not None and final.consumers[0].pid != before["consumer-0"]
    assert not is_running(after.consumers[0]) and is_running(final.consumers[0])
    assert {k: v for k, v in pids(final).items() if k != "consumer-0"} == {
        k: v for k, v in pids(after).items() if k != "consumer-0"
    }
    ran = chunker(env["BROKER_ADDRESS"])
    assert ran.returncode == 0, ran.stderr
    shards = run_cli("gazctl", "shards", "list", env=env)  # consumer-0 answers again.
    assert shards.code == 0, shards.err

    unknown = dev(cluster_dir, "kill", "broker-7")
    assert unknown.code == 1 and "Traceback" not in unknown.err
    assert unknown.err.strip().splitlines() == [
        f"Error: no process 'broker-7' in the dev cluster in {cluster_dir.resolve()}: give one "
        "of etcd, broker-0, broker-1, consumer-0, consumer-1"
    ]
    assert dev(cluster_dir, "restart", "nothing").code == 1
    bad = dev(cluster_dir, "kill", "--signal", "BOGUS", "broker-0")
    assert bad.code == 2 and "'BOGUS' is not a signal" in bad.err and "Traceback" not in bad.err
    assert ClusterState.load(cluster_dir) == final and all(is_running(p) for p in final.all())

    down = dev(cluster_dir, "down")
    assert down.code == 0 and "stopped 5" in down.err


def test_dev_keys_are_created_0600_not_chmod_ed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The auth key and the private keys are never readable by others, not even for a moment:
    they are created 0600 (with no umask to narrow them, and no chmod after)."""
    from gazctl.dev import DevSecurity

    def no_chmod(*args: object, **kwargs: object) -> None:
        raise AssertionError("chmod after writing")

    monkeypatch.setattr(Path, "chmod", no_chmod)
    monkeypatch.setattr(os, "chmod", no_chmod)
    old = os.umask(0)
    try:
        DevSecurity.make(tmp_path, tls=True, auth=True)
    finally:
        os.umask(old)
    secrets = [tmp_path / "auth-key", *(tmp_path / "tls").glob("*.key")]
    assert len(secrets) == 4
    for path in secrets:
        assert path.stat().st_mode & 0o777 == 0o600, path
