"""`gazctl journals apply|list|edit` and `print-config`, run as a user would, against a real
`gazette serve` subprocess and a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from broker.testing import EtcdServer
from tests.conftest import BrokerProcess, run_cli
from tests.helpers.gazctl import assert_one_line_error, gazctl
from tests.helpers.waiting import until

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "journals.yaml"


def tree(prefix: str, body: str) -> str:
    return textwrap.dedent(body).replace("PFX/", prefix)


def list_names(broker: BrokerProcess, selector: str) -> list[str]:
    r = gazctl(broker, "journals", "list", "-l", selector, "-o", "json")
    assert r.code == 0, r.err
    return [json.loads(line)["spec"]["name"] for line in r.out.splitlines()]


def test_apply_example_then_list_back_equivalently(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    r = gazctl(broker_process, "journals", "apply", "--specs", str(EXAMPLE))
    assert r.code == 0, r.err
    assert "create" in r.out and "examples/stream-sum/sums" in r.out

    names = list_names(broker_process, "prefix=examples/")
    assert names == [
        "examples/bike-share/cycles/part-000",
        "examples/bike-share/cycles/part-001",
        "examples/stream-sum/chunks/part-000",
        "examples/stream-sum/chunks/part-001",
        "examples/stream-sum/sums",
    ]
    docs = {
        json.loads(line)["spec"]["name"]: json.loads(line)["spec"]
        for line in gazctl(
            broker_process, "journals", "list", "-l", "prefix=examples/", "-o", "json"
        ).out.splitlines()
    }
    sums = docs["examples/stream-sum/sums"]
    assert sums["replication"] == 1 and sums["flags"] == 1
    assert sums["fragment"]["compression_codec"] == "GZIP"
    assert sums["fragment"]["refresh_interval"] == "5s"
    assert sums["fragment"]["retention"] == "2592000s"
    assert sums["fragment"]["stores"] == ["file:///examples/fragments/"]
    cycles = docs["examples/bike-share/cycles/part-000"]
    assert cycles["replication"] == 3 and cycles["fragment"]["compression_codec"] == "SNAPPY"
    assert {"name": "content-type", "value": "application/x-ndjson"} in cycles["labels"]["labels"]

    # Listed YAML applies back as exactly the same set: every journal unchanged.
    listed = gazctl(broker_process, "journals", "list", "-l", "prefix=examples/", "-o", "yaml")
    assert listed.code == 0, listed.err
    assert "revision:" in listed.out and "720h0m0s" in listed.out
    path = tmp_path / "listed.yaml"
    path.write_text(listed.out)
    again = gazctl(broker_process, "journals", "apply", "--specs", str(path), "--dry-run")
    assert again.code == 0, again.err
    assert again.out.count("unchanged") == 5 and "update" not in again.out

    table = gazctl(
        broker_process,
        "journals",
        "list",
        "-l",
        "prefix=examples/",
        "--rf",
        "--stores",
        "-L",
        "content-type",
    )
    assert table.code == 0
    assert "examples/stream-sum/sums" in table.out and "application/x-ndjson" in table.out
    assert "file:///examples/fragments/" in table.out


def test_dry_run_changes_nothing(broker_process: BrokerProcess, tmp_path: Path) -> None:
    specs = tmp_path / "s.yaml"
    specs.write_text(
        tree(
            "dry/",
            """\
        name: PFX/
        replication: 1
        fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}
        children:
          - name: PFX/one
          - name: PFX/two
        """,
        )
    )
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs), "--dry-run")
    assert r.code == 0, r.err
    assert r.out.count("create") == 2
    assert "dry run" in r.err
    assert list_names(broker_process, "prefix=dry/") == []


def test_stale_revision_conflicts_cleanly_and_applies_nothing(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    base = """\
        name: PFX/
        replication: 1
        fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}
        children:
          - name: PFX/existing
        """
    specs = tmp_path / "s.yaml"
    specs.write_text(tree("conflict/", base))
    assert gazctl(broker_process, "journals", "apply", "--specs", str(specs)).code == 0

    # Re-creating (revision 0) an existing journal beside a new one: neither applies.
    specs.write_text(tree("conflict/", base + "  - name: PFX/new\n"))
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs))
    assert_one_line_error(r, "revision conflict", "conflict/existing")
    assert list_names(broker_process, "prefix=conflict/") == ["conflict/existing"]


def test_max_txn_size_applies_in_batches(broker_process: BrokerProcess, tmp_path: Path) -> None:
    children = "".join(f"  - name: PFX/j{i}\n" for i in range(7))
    specs = tmp_path / "s.yaml"
    specs.write_text(
        tree(
            "batch/",
            """\
        name: PFX/
        replication: 1
        fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}
        children:
        """,
        )
        + children.replace("PFX/", "batch/")
    )
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs), "--max-txn-size", "3")
    assert r.code == 0, r.err
    assert len(list_names(broker_process, "prefix=batch/")) == 7


def test_more_changes_than_etcd_takes_in_one_transaction(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    """etcd takes 128 operations in a transaction (its --max-txn-ops): a larger apply is
    refused in one line saying what to do, with nothing applied; batched, it applies; a
    refusal that names many journals gives their count and the first few."""
    children = "".join(f"  - name: PFX/j{i:03d}\n" for i in range(130))
    header = """\
        name: PFX/
        replication: 1
        fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}
        children:
        """
    specs = tmp_path / "s.yaml"
    specs.write_text(tree("many/", header) + children.replace("PFX/", "many/"))
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs))
    assert_one_line_error(
        r, "130 changes", "--max-txn-ops", "nothing was applied", "--max-txn-size 128"
    )
    assert "aetcd" not in r.err and "UNKNOWN" not in r.err
    assert list_names(broker_process, "prefix=many/") == []

    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs), "--max-txn-size", "100")
    assert r.code == 0, r.err
    assert len(list_names(broker_process, "prefix=many/")) == 130

    # Created again (revision 0): every journal conflicts; the line counts them.
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs), "--max-txn-size", "100")
    assert_one_line_error(r, "revision conflict", "130 journals", "many/j000", "many/j001")
    assert "many/j129" not in r.err and len(r.err) < 400, r.err

    deletes = "".join(
        f"  - {{name: PFX/j{i:03d}, delete: true, revision: -1}}\n" for i in range(130)
    )
    specs.write_text(tree("many/", header) + deletes.replace("PFX/", "many/"))
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs), "--max-txn-size", "100")
    assert r.code == 0, r.err


def test_apply_from_stdin(broker_process: BrokerProcess) -> None:
    text = "name: stdin/j\nreplication: 1\nfragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n"
    r = gazctl(broker_process, "journals", "apply", input=text)
    assert r.code == 0, r.err
    assert list_names(broker_process, "name=stdin/j") == ["stdin/j"]


@pytest.mark.parametrize(
    ("yaml_text", "needles"),
    [
        ("name: bad/j\nreplicaton: 1\n", ["line 2", "replicaton"]),
        ("name: bad/j\nreplication: [1\n", ["YAML"]),
        (
            "name: bad/j\nreplication: 9\nfragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n",
            ["bad/j", "replication", "9"],
        ),
        (
            "name: /bad/j\nreplication: 1\nfragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n",
            ["/bad/j"],
        ),
        (
            "name: bad/j\nreplication: 1\nlabels: [{name: 'x y', value: v}]\nfragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n",
            ["x y"],
        ),
        (
            "name: bad/j\nreplication: 1\nfragment: {refresh_interval: 5 minutes}\n",
            ["line 3", "5 minutes"],
        ),
        ("name: bad/j\nreplication: 1\nfragment: {compression_codec: LZ4}\n", ["line 3", "LZ4"]),
    ],
)
def test_bad_specs_are_one_line_errors_and_apply_nothing(
    broker_process: BrokerProcess, tmp_path: Path, yaml_text: str, needles: list[str]
) -> None:
    specs = tmp_path / "s.yaml"
    specs.write_text(yaml_text)
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs))
    assert_one_line_error(r, *needles)
    assert list_names(broker_process, "prefix=bad/") == []


def test_bad_selector_and_unreachable_broker(broker_process: BrokerProcess) -> None:
    r = gazctl(broker_process, "journals", "list", "-l", "a in (b")
    assert_one_line_error(r, "a in (b")
    r = run_cli("gazctl", "journals", "list", env={"BROKER_ADDRESS": "http://127.0.0.1:1"})
    assert_one_line_error(r, "cannot reach broker", "127.0.0.1:1")
    r = run_cli("gazctl", "journals", "list", "--broker.address", "ftp://nope")
    assert_one_line_error(r, "ftp://nope")


@pytest.mark.parametrize(
    "args",
    [
        ["journals", "list"],
        ["journals", "read", "-l", "name=tls/j"],
        ["journals", "append", "-l", "name=tls/j"],
        ["journals", "fragments", "-l", "name=tls/j"],
        ["spark", "compact", "-l", "name=tls/j", "--dry-run"],
    ],
)
def test_https_to_a_plaintext_broker_fails_in_one_line(
    broker_process: BrokerProcess, args: list[str]
) -> None:
    # The broker behind the address is real (and plaintext): a client that ignored the scheme
    # would talk to it without TLS, and succeed.
    https = broker_process.address.replace("http://", "https://")
    r = run_cli("gazctl", *args, "--broker.address", https, input="")
    assert_one_line_error(r, https)
    r = run_cli("gazctl", *args, env={"BROKER_ADDRESS": https}, input="")
    assert_one_line_error(r, https)
    r = run_cli("gazctl", *args, "--broker.address", "ftp://127.0.0.1:1", input="")
    assert_one_line_error(r, "ftp://127.0.0.1:1", "http://HOST:PORT")


def test_missing_specs_file(broker_process: BrokerProcess, tmp_path: Path) -> None:
    r = gazctl(broker_process, "journals", "apply", "--specs", str(tmp_path / "absent.yaml"))
    assert_one_line_error(r, "absent.yaml")


EDITOR = """\
import sys, pathlib
path = pathlib.Path(sys.argv[1])
state = pathlib.Path(sys.argv[0] + ".count")
n = int(state.read_text()) if state.exists() else 0
state.write_text(str(n + 1))
text = path.read_text()
if n == 0 and "{mode}" == "retry":
    path.write_text(text.replace("replication: 1", "replicaton: 2"))  # a typo first
else:
    text = text.replace("replicaton: 2", "replication: 2").replace("replication: 1", "replication: 2")
    path.write_text(text)
"""


@pytest.mark.parametrize("mode", ["once", "retry"])
def test_edit_applies_and_reopens_on_error(
    broker_process: BrokerProcess, tmp_path: Path, mode: str
) -> None:
    prefix = f"edit-{mode}/"
    specs = tmp_path / "s.yaml"
    specs.write_text(
        f"name: {prefix}j\nreplication: 1\nfragment: {{length: 4096, compression_codec: NONE, refresh_interval: 1m0s}}\n"
    )
    assert gazctl(broker_process, "journals", "apply", "--specs", str(specs)).code == 0
    editor = tmp_path / "editor.py"
    editor.write_text(EDITOR.replace("{mode}", mode))
    r = gazctl(
        broker_process, "journals", "edit", "-l", f"prefix={prefix}",
        env={"GAZ_EDITOR": f"{sys.executable} {editor}", "EDITOR": "false"},
    )  # fmt: skip
    assert r.code == 0, r.err
    opened = int((tmp_path / "editor.py.count").read_text())
    assert opened == (2 if mode == "retry" else 1)
    if mode == "retry":
        assert "replicaton" in r.err  # The error was shown before re-opening.
    doc = json.loads(
        gazctl(broker_process, "journals", "list", "-l", f"name={prefix}j", "-o", "json").out
    )
    assert doc["spec"]["replication"] == 2


def test_edit_with_no_match_is_an_error(broker_process: BrokerProcess) -> None:
    r = gazctl(
        broker_process, "journals", "edit", "-l", "prefix=nothing-here/", env={"GAZ_EDITOR": "true"}
    )
    assert_one_line_error(r, "no journals match")


def test_list_watch_prints_each_change(broker_process: BrokerProcess, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gazctl.cli", "journals", "list", "--watch", "-l", "prefix=watch/", "-o", "json",
         "--broker.address", broker_process.address],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        specs = tmp_path / "s.yaml"
        specs.write_text(
            "name: watch/j\nreplication: 1\nfragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n"
        )
        assert gazctl(broker_process, "journals", "apply", "--specs", str(specs)).code == 0
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert json.loads(line)["spec"]["name"] == "watch/j"
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_print_config_merges_ini_and_env(tmp_path: Path) -> None:
    (tmp_path / "gazctl.ini").write_text("[broker]\naddress = http://from-ini:1234\n")
    r = run_cli("gazctl", "print-config", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert r.code == 0, r.err
    assert "address = http://from-ini:1234" in r.out
    r = run_cli(
        "gazctl",
        "print-config",
        cwd=tmp_path,
        env={"HOME": str(tmp_path), "BROKER_ADDRESS": "http://env:1"},
    )
    assert "address = http://env:1" in r.out


def test_ini_file_supplies_broker_address(broker_process: BrokerProcess, tmp_path: Path) -> None:
    (tmp_path / "gazctl.ini").write_text(f"[journals.broker]\naddress = {broker_process.address}\n")
    r = run_cli("gazctl", "journals", "list", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert r.code == 0, r.err


def test_upstream_yaml_applies_and_lists_back_as_the_same_set(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    from spec import journals as jspec

    source = Path(__file__).parent / "data" / "upstream_examples.yaml"
    text = source.read_text().replace("examples/", "upstream/")
    specs = tmp_path / "in.yaml"
    specs.write_text(text)
    r = gazctl(broker_process, "journals", "apply", "--specs", str(specs))
    assert r.code == 0, r.err

    listed = gazctl(broker_process, "journals", "list", "-l", "prefix=upstream/", "-o", "yaml")
    assert listed.code == 0, listed.err
    wanted = {
        e.spec.SerializeToString(deterministic=True) for e in jspec.flatten(jspec.decode_tree(text))
    }
    got = jspec.flatten(jspec.decode_tree(listed.out))
    assert {e.spec.SerializeToString(deterministic=True) for e in got} == wanted
    assert all(e.revision > 0 for e in got)


def test_print_config_never_prints_a_secret(tmp_path: Path) -> None:
    (tmp_path / "gazctl.ini").write_text("[broker]\nauth-token = token-from-the-ini\n")
    r = run_cli(
        "gazctl", "print-config", cwd=tmp_path,
        env={"HOME": str(tmp_path), "BROKER_AUTH_KEYS": "c2VjcmV0LWtleQ=="},
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "c2VjcmV0LWtleQ==" not in r.out and "token-from-the-ini" not in r.out
    assert "auth-keys = <hidden>" in r.out and "auth-token = <hidden>" in r.out
    # Configured through the INI file, the token is used: a broker that is not there is
    # reported, not the configuration.
    r = run_cli("gazctl", "journals", "list", "--broker.address", "http://127.0.0.1:1", cwd=tmp_path, env={"HOME": str(tmp_path)})  # fmt: skip
    assert r.code != 0 and "token-from-the-ini" not in r.err


def test_journals_beyond_the_brokers_slots_say_why_they_have_no_replicas(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """Two brokers of --broker.limit 1 and three journals: one has no replicas. `journals
    list` says which and why, and an append to it is refused in one line saying why."""
    import asyncio
    import uuid

    from broker.client import JournalsClient
    from broker.testing import start_broker_process, stop_processes

    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    brokers = [
        start_broker_process(
            etcd_server,
            prefix,
            tmp_path / f"b{i}.log",
            broker_id=f"broker-{i}",
            extra=("--broker.limit", "1"),
        )
        for i in range(2)
    ]
    try:
        address = ",".join(b.address for b in brokers)
        specs = tmp_path / "specs.yaml"
        specs.write_text(
            "name: slots/\nreplication: 1\n"
            "fragment: {length: 4096, compression_codec: NONE, refresh_interval: 1m0s}\n"
            "children:\n  - name: slots/j0\n  - name: slots/j1\n  - name: slots/j2\n"
        )
        env = {"BROKER_ADDRESS": address}
        applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
        assert applied.code == 0, applied.err

        async def placed() -> list[str]:  # Until the allocator has filled both slots.
            unplaced: list[str] = []
            async with JournalsClient(address) as client:

                async def filled() -> bool:
                    nonlocal unplaced
                    snapshot = await client.list()
                    unplaced = [j.spec.name for j in snapshot.journals if not j.route.members]
                    return len(unplaced) == 1

                await until(filled, "the allocator placed two of three journals", 15, 0.05)
            return unplaced

        (unplaced,) = asyncio.run(placed())
        why = (
            "the brokers' --broker.limit slots are all taken (2 brokers of 1 journal each: "
            "2 slots for 3 replicas)"
        )
        listed = run_cli("gazctl", "journals", "list", env=env)
        assert listed.code == 0, listed.err
        row = next(line for line in listed.out.splitlines() if unplaced in line)
        assert "no replicas" in row, listed.out
        assert f"1 journal has no replicas: {why}" in listed.err, listed.err

        appended = run_cli("gazctl", "journals", "append", "-l", f"name={unplaced}", "--wait",
                           "1s", input="x\n", env=env)  # fmt: skip
        assert_one_line_error(appended, unplaced, why)
    finally:
        stop_processes([b.proc for b in brokers])
