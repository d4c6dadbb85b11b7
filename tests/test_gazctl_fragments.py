"""`gazctl journals fragments|prune|store-health|suspend`, and `journals read` of persisted
fragments, against a real broker process persisting to a file:// store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import click

from broker.fragment.content import fragment_path
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from tests.conftest import Result, run_cli, stop_process
from tests.helpers import fragment_history
from tests.helpers.fragment_history import (
    STORE,
    Cluster,
    History,
    Journals,
    content,
    journal,
)
from tests.helpers.gazctl import assert_one_line_error, gazctl
from tests.helpers.waiting import until, until_blocking

# The module-scoped fixtures: one broker and one history of fragments for this module's tests.
cluster = fragment_history.cluster
history = fragment_history.history


def cli(cluster: Cluster, *args: str, **kw: object) -> Result:
    r = gazctl(cluster.broker, "journals", *args, **kw)
    assert isinstance(r, Result)
    return r


# ---- fragments ----------------------------------------------------------------------------


def json_rows(r: Result) -> list[dict[str, object]]:
    assert r.code == 0, r.err
    return [json.loads(line) for line in r.out.splitlines()]


def spans(rows: list[dict[str, object]]) -> list[tuple[int, int, bool]]:
    """(begin, end, persisted) of `fragments -o json` rows (int64 fields are JSON strings)."""
    out = []
    for row in rows:
        spec = row["spec"]
        assert isinstance(spec, dict)
        out.append((int(spec.get("begin", 0)), int(spec["end"]), "backing_store" in spec))
    return out


def test_fragments_table_and_json(cluster: Cluster, history: History) -> None:
    a, b = history.a, history.b
    r = cli(cluster, "fragments", "-l", "name=frag/a")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split() == [
        "Journal", "Begin", "End", "Length", "Codec", "Persisted", "Store"
    ]  # fmt: skip
    when = datetime.fromtimestamp(a.mod_time, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert lines[1].split() == ["frag/a", "0", "300", "300", "NONE", *when.split(), STORE]
    assert lines[2].split()[:4] == ["frag/a", "300", "1400", "1100"]
    assert lines[3].split() == ["frag/a", "1400", "1600", "200", "NONE", "local", "-"]
    assert len(lines) == 4

    rows = json_rows(cli(cluster, "fragments", "-l", "prefix=frag/", "-o", "json"))
    assert spans(rows) == [(0, 300, True), (300, 1400, True), (1400, 1600, False), (0, 4, False)]
    first = rows[0]["spec"]
    assert isinstance(first, dict)
    assert first["backing_store"] == STORE and int(first["mod_time"]) == a.mod_time
    assert first["compression_codec"] == "NONE" and "signed_url" not in rows[0]

    # Signed URLs for persisted fragments only, readable under the broker's file root.
    rows = json_rows(
        cli(cluster, "fragments", "-l", "name=frag/a", "-o", "json", "--url-ttl", "1m")
    )
    urls = [row.get("signed_url") for row in rows]
    assert urls[2] is None
    assert urls[0] == f"file:///fragments/{fragment_path(a)}"
    assert urls[1] == f"file:///fragments/{fragment_path(b)}"
    on_disk = cluster.root / "fragments" / fragment_path(b)
    assert on_disk.read_bytes() == history.data[300:1400]
    r = cli(cluster, "fragments", "-l", "name=frag/a", "--url-ttl", "1m")
    assert r.code == 0 and r.out.splitlines()[0].split()[-1] == "URL"
    assert f"file:///fragments/{fragment_path(a)}" in r.out

    # --from keeps local fragments (not persisted at all); --to excludes them.
    rows = json_rows(cli(cluster, "fragments", "-l", "name=frag/a", "-o", "json", "--from", str(b.mod_time)))  # fmt: skip
    assert spans(rows) == [(300, 1400, True), (1400, 1600, False)]
    rows = json_rows(cli(cluster, "fragments", "-l", "name=frag/a", "-o", "json", "--to", str(a.mod_time)))  # fmt: skip
    assert spans(rows) == [(0, 300, True)]
    rows = json_rows(cli(cluster, "fragments", "-l", "name=frag/a", "-o", "json",
                         "--from", str(b.mod_time), "--to", str(b.mod_time)))  # fmt: skip
    assert spans(rows) == [(300, 1400, True)]

    r = cli(cluster, "fragments", "-l", "name=frag/a", "--from", "20", "--to", "10")
    assert_one_line_error(r, "--to 10 is before --from 20")
    r = cli(cluster, "fragments", "-l", "name=frag/a", "--url-ttl", "soon")
    assert_one_line_error(r, "--url-ttl", "soon")
    r = cli(cluster, "fragments", "-l", "name=frag/none")
    assert_one_line_error(r, "no journals match")


# ---- read ---------------------------------------------------------------------------------


def test_read_persisted_fragments_directly(
    cluster: Cluster, history: History, tmp_path: Path
) -> None:
    r = cli(cluster, "read", "-l", "name=frag/a", "--file-root", str(cluster.root))
    assert r.code == 0, r.err
    assert r.out.encode() == history.data and r.err == ""

    # The persisted fragments come from the store under --file-root, not through the broker:
    # a copy of the store where B is cut short fails the read (the broker's copy is whole).
    copy = tmp_path / "copy"
    shutil.copytree(cluster.root, copy)
    damaged = copy / "fragments" / fragment_path(history.b)
    damaged.write_bytes(damaged.read_bytes()[:500])
    r = cli(cluster, "read", "-l", "name=frag/a", "--file-root", str(copy))
    assert_one_line_error(r, fragment_path(history.b), "ends at offset 800, before its end 1400")

    # --from skips fragments persisted before it; local fragments are always read.
    r = cli(cluster, "read", "-l", "name=frag/a", "--file-root", str(cluster.root),
            "--from", str(history.b.mod_time))  # fmt: skip
    assert r.code == 0 and r.out.encode() == history.data[300:]
    r = cli(cluster, "read", "-l", "name=frag/a", "--file-root", str(cluster.root),
            "--from", str(history.b.mod_time + 1))  # fmt: skip
    assert r.code == 0 and r.out.encode() == history.data[1400:]


def test_file_root_from_env(cluster: Cluster, history: History, tmp_path: Path) -> None:
    # Every command taking --file-root reads it from $BROKER_FILE_ROOT (as `gazctl dev up`
    # prints it, and as brokers read their --broker.file-root), the flag winning.
    from gazctl.cli import cli as gazctl_cli

    def with_file_root(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
        for param in command.params:
            if isinstance(param, click.Option) and "--file-root" in param.opts:
                yield path, param
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from with_file_root(sub, f"{path} {name}")

    found = dict(with_file_root(gazctl_cli.load_all(), "gazctl"))
    assert {"gazctl journals read", "gazctl journals prune", "gazctl spark compact",
            "gazctl spark replay"} <= set(found)  # fmt: skip
    assert {path: option.envvar for path, option in found.items()} == {
        path: "BROKER_FILE_ROOT" for path in found
    }

    # Reads from the store the variable names: a copy where B is cut short fails the read.
    copy = tmp_path / "copy"
    shutil.copytree(cluster.root, copy)
    damaged = copy / "fragments" / fragment_path(history.b)
    damaged.write_bytes(damaged.read_bytes()[:500])
    r = cli(cluster, "read", "-l", "name=frag/a", env={"BROKER_FILE_ROOT": str(copy)})
    assert_one_line_error(r, fragment_path(history.b))
    r = cli(cluster, "read", "-l", "name=frag/a", env={"BROKER_FILE_ROOT": str(cluster.root)})
    assert r.code == 0 and r.out.encode() == history.data, r.err
    r = cli(cluster, "read", "-l", "name=frag/a", "--file-root", str(cluster.root),
            env={"BROKER_FILE_ROOT": str(copy)})  # fmt: skip
    assert r.code == 0 and r.out.encode() == history.data, r.err

    # Without a broker: a Spark job's plan over a file:// store needs the root, and takes it
    # from the environment.
    specs = tmp_path / "specs.yaml"
    specs.write_text(f'name: frag/a\nreplication: 1\nfragment:\n  stores: ["{STORE}"]\n')
    plan = ("gazctl", "spark", "compact", "-l", "name=frag/a", "--specs", str(specs), "--dry-run")
    assert_one_line_error(run_cli(*plan), "--file-root")
    r = run_cli(*plan, env={"BROKER_FILE_ROOT": str(cluster.root)})
    assert r.code == 0 and "would merge" in r.err, r.err


def without_b(r: Result) -> bytes:
    """The output of reading frag/a and frag/b (interleaved by chunk), less frag/b's."""
    out = r.out.encode()
    assert out.count(b"bbb\n") == 1
    return out.replace(b"bbb\n", b"")


def test_read_offsets_round_trip(cluster: Cluster, history: History, tmp_path: Path) -> None:
    offsets = tmp_path / "offsets.json"
    root = ("--file-root", str(cluster.root))
    r = cli(cluster, "read", "-l", "prefix=frag/", "--offsets-out", str(offsets), *root)
    assert r.code == 0, r.err
    assert without_b(r) == history.data
    assert json.loads(offsets.read_text()) == {"frag/a": 1600, "frag/b": 4}

    # From the middle of a persisted fragment; journals not in --offsets start at 0; entries
    # of journals not read are kept; the same file is both input and output.
    offsets.write_text(json.dumps({"frag/a": 1000, "gone/j": 7}))
    r = cli(cluster, "read", "-l", "prefix=frag/", "--offsets", str(offsets),
            "--offsets-out", str(offsets), *root)  # fmt: skip
    assert r.code == 0, r.err
    assert without_b(r) == history.data[1000:]
    assert json.loads(offsets.read_text()) == {"frag/a": 1600, "frag/b": 4, "gone/j": 7}

    # Nothing new: nothing read, offsets unchanged. With --tail, unlisted journals start at
    # their write head.
    r = cli(cluster, "read", "-l", "prefix=frag/", "--offsets", str(offsets),
            "--offsets-out", str(offsets))  # fmt: skip
    assert r.code == 0 and r.out == ""
    assert json.loads(offsets.read_text()) == {"frag/a": 1600, "frag/b": 4, "gone/j": 7}
    fresh = tmp_path / "fresh.json"
    r = cli(cluster, "read", "-l", "prefix=frag/", "--tail", "--offsets-out", str(fresh))
    assert r.code == 0 and r.out == ""
    assert json.loads(fresh.read_text()) == {"frag/a": 1600, "frag/b": 4}

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_one_line_error(cli(cluster, "read", "-l", "name=frag/a", "--offsets", str(bad)),
                          "--offsets", "not JSON")  # fmt: skip
    bad.write_text('{"frag/a": -3}')
    assert_one_line_error(cli(cluster, "read", "-l", "name=frag/a", "--offsets", str(bad)),
                          "frag/a", "-3")  # fmt: skip
    r = cli(cluster, "read", "-l", "name=frag/a", "--offsets", str(tmp_path / "missing.json"))
    assert_one_line_error(r, "missing.json")


def test_read_interrupted_writes_offsets(
    cluster: Cluster, history: History, tmp_path: Path
) -> None:
    offsets = tmp_path / "offsets.json"
    env = dict(os.environ, BROKER_ADDRESS=cluster.broker.address)
    command = [sys.executable, "-m", "gazctl.cli", "journals", "read", "-l", "name=frag/b",
               "--block", "--offsets-out", str(offsets)]  # fmt: skip
    # As from a terminal: a suite run in the background (nohup, `&`) ignores SIGINT, and
    # children inherit that.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        got = b""

        def printed() -> bool:
            nonlocal got
            assert proc.stdout is not None
            if select.select([proc.stdout], [], [], 0.1)[0]:
                got += os.read(proc.stdout.fileno(), 100)
            return got == b"bbb\n"

        # A blocking read: it has read all there is, and waits.
        until_blocking(printed, "gazctl read printed all there is", 20, interval=0)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # gazctl prints its threads' stacks, then dies.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(
                f"gazctl read ignored Ctrl-C; its stacks:\n{err.decode()}"
            ) from None
    finally:
        stop_process(proc)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 0 and b"Traceback" not in err, err
    assert json.loads(offsets.read_text()) == {"frag/b": 4}


# ---- prune --------------------------------------------------------------------------------


def test_prune_removes_aged_fragments_but_the_last(cluster: Cluster, tmp_path: Path) -> None:
    journals = Journals(cluster.broker.address)
    store = open_store(STORE, file_root=cluster.root)
    old = [content(300, "a "), content(1100, "b "), content(1100, "c "), content(200, "d ")]

    async def setup() -> None:
        await journals.create(
            journal("prune/old", retention=1, codec=pb.ZSTANDARD),
            journal("prune/young", retention=3600),
            journal("prune/keep"),  # No retention: never pruned.
        )
        for name in ("prune/old", "prune/young", "prune/keep"):
            for data in old:
                await journals.append(name, data)
        for name in ("prune/old", "prune/young", "prune/keep"):
            # [0,300), [300,1400) and [1400,2500) persisted; [2500,2700) local.
            await journals.persisted(name, 3)

    asyncio.run(setup())
    newest = max(f.mod_time for f in store.list_fragments("prune/old"))
    # Every fragment is past the 1s retention (the index's mod times may be a second later).
    time.sleep(max(0.0, newest + 2.2 - time.time()))  # The retention must really pass.

    def on_disk(name: str) -> list[tuple[int, int]]:
        return [(f.begin, f.end) for f in store.list_fragments(name)]

    everything = [(0, 300), (300, 1400), (1400, 2500)]
    r = cli(cluster, "prune", "-l", "prefix=prune/", "--dry-run")
    assert r.code == 0, r.err
    rows = [line.split()[:3] for line in r.out.splitlines()[1:]]
    assert rows == [["prune/old", "0", "300"], ["prune/old", "300", "1400"]]
    assert "would remove 2 fragments (1400 bytes)" in r.err
    assert "1 journal without a retention skipped" in r.err
    assert on_disk("prune/old") == everything

    # file:// stores are deleted from directly: that needs their root.
    r = cli(cluster, "prune", "-l", "prefix=prune/")
    assert_one_line_error(r, "--file-root", STORE)
    assert on_disk("prune/old") == everything

    r = cli(cluster, "prune", "-l", "prefix=prune/", "--file-root", str(cluster.root))
    assert r.code == 0, r.err
    assert "removed 2 fragments (1400 bytes); examined 8 fragments of 2 journals" in r.err
    # The last persisted fragment stays however old; younger ones and unpruned journals too.
    assert on_disk("prune/old") == [(1400, 2500)]
    assert on_disk("prune/young") == everything
    assert on_disk("prune/keep") == everything
    # What is left still reads back, from the kept fragment on, once brokers list the store
    # again (until then, their index still names the removed fragments).
    asyncio.run(settled_after_prune(journals, "prune/old", cluster.root))
    r = cli(cluster, "read", "-l", "name=prune/old", "--file-root", str(cluster.root))
    assert r.code == 0 and r.out.encode() == b"".join(old)[1400:]


async def settled_after_prune(journals: Journals, name: str, root: Path) -> None:

    async def dropped() -> bool:
        return len(await journals.settled(name, root)) == 1

    await until(dropped, "the index dropped the pruned fragments", timeout=20, interval=0.1)


# ---- store-health -------------------------------------------------------------------------


def test_store_health(cluster: Cluster) -> None:
    r = cli(cluster, "store-health", STORE)
    assert r.code == 0, r.err
    assert r.out.strip() == f"fragment store {STORE} is healthy"
    r = cli(cluster, "store-health", "--check-delete-prefix", "probes/", STORE)
    assert r.code == 0, r.err
    assert not (cluster.root / "fragments" / "probes" / ".gazette-delete-probe").exists()

    # A store directory that does not exist under the broker's file root.
    r = cli(cluster, "store-health", "file:///missing/")
    assert_one_line_error(r, "file:///missing/ is unhealthy", "does not exist")
    assert r.code == 1

    assert_one_line_error(cli(cluster, "store-health", "file:///no-slash"), "end in '/'")
    assert_one_line_error(cli(cluster, "store-health", "ftp://host/x/"), "scheme 'ftp'")
    r = cli(cluster, "store-health", "--check-delete-prefix", "probes", STORE)
    assert_one_line_error(r, "--check-delete-prefix", "must end in '/'")


# ---- suspend ------------------------------------------------------------------------------


def suspend_of(cluster: Cluster, name: str) -> dict[str, object]:
    r = cli(cluster, "list", "-l", f"name={name}", "-o", "json")
    assert r.code == 0, r.err
    suspend = json.loads(r.out)["spec"].get("suspend", {})
    assert isinstance(suspend, dict)
    return suspend


def test_suspend(cluster: Cluster) -> None:
    journals = Journals(cluster.broker.address)
    data = [content(300, "one "), content(500, "two ")]

    async def setup() -> None:
        await journals.create(journal("susp/busy"), journal("susp/never"))
        for part in data:
            await journals.append("susp/busy", part)

    asyncio.run(setup())

    # Not flushed: [300, 800) is only local, so the journal is not suspended without --force.
    r = cli(cluster, "suspend", "-l", "name=susp/busy")
    assert r.code == 0, r.err
    assert "not suspended" in r.out and "--force" in r.out
    assert "1 journal: 0 suspended now, 0 already suspended, 1 not suspended" in r.err
    assert suspend_of(cluster, "susp/busy") == {}

    r = cli(cluster, "suspend", "-l", "name=susp/busy", "--force")
    assert r.code == 0, r.err
    assert r.out.splitlines()[1].split()[:3] == ["susp/busy", "PARTIAL", "800"]
    assert "1 suspended now" in r.err
    assert suspend_of(cluster, "susp/busy") == {"level": "PARTIAL", "offset": "800"}
    # Its content was rolled and persisted, and the remaining replica serves reads.
    persisted = asyncio.run(journals.persisted("susp/busy", 2))
    assert [(f.begin, f.end) for f in persisted] == [(0, 300), (300, 800)]
    r = cli(cluster, "read", "-l", "name=susp/busy", "--file-root", str(cluster.root))
    assert r.code == 0 and r.out.encode() == b"".join(data)

    # A journal never written to has nothing to keep: it is suspended FULL (no replicas).
    r = cli(cluster, "suspend", "-l", "prefix=susp/")
    assert r.code == 0, r.err
    assert "2 journals: 1 suspended now, 1 already suspended, 0 not suspended" in r.err
    assert suspend_of(cluster, "susp/never")["level"] == "FULL"
    r = cli(cluster, "fragments", "-l", "prefix=susp/")
    assert r.code == 0 and "skipped 1 fully suspended journal" in r.err
    assert "susp/busy" in r.out and "susp/never" not in r.out
