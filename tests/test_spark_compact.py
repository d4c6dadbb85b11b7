"""`gazctl spark compact` on real Spark (local[2]) over file, gs (fake-gcs-server) and s3 (moto)
stores: identical bytes before and after, fewer and larger fragments, safe to interrupt between
writing a merged fragment and removing what it covers, idempotent, and refusing corrupt input."""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from broker.client.journals import dial
from broker.client.routes import append_routed
from broker.fragment.content import fragment_path
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from gazctl.cli import cli
from gazctl.spark.compaction import plan_journal, write_merged
from gazctl.spark.journals import covering
from tests.conftest import run_cli
from tests.helpers import fragment_history
from tests.helpers.fragment_history import STORE, Cluster, History
from tests.helpers.fragments import put_pieces
from tests.helpers.journals import routed, started_brokers
from tests.helpers.persistence import JOURNAL as APPENDED  # The journal its helpers append to.
from tests.helpers.persistence import read_all
from tests.helpers.spark import JOURNAL, content, journal_bytes, specs_file
from tests.helpers.store_servers import GCSServer, S3Server

# The module-scoped fixtures of tests/test_gazctl_fragments.py's broker and history, for this
# module's tests of them.
cluster = fragment_history.cluster
history = fragment_history.history


def compact(*args: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(cli, ["spark", "compact", *args], env=env)
    return result


def stores(tmp_path: Path, which: str, gcs: GCSServer, s3: S3Server) -> tuple[str, Path | None]:
    if which == "file":
        (tmp_path / "root" / "store").mkdir(parents=True)
        return "file:///store/", tmp_path / "root"
    if which == "gs":
        return f"gs://{gcs.create_bucket()}/journals/", None
    return f"s3://{s3.create_bucket()}/journals/?endpoint={s3.endpoint}", None


@pytest.mark.slow
@pytest.mark.parametrize("which", ["file", "gs", "s3"])
def test_compaction_keeps_bytes_and_merges_fragments(
    spark: object, gcs_server: GCSServer, s3_server: S3Server, tmp_path: Path, which: str
) -> None:
    url, root = stores(tmp_path, which, gcs_server, s3_server)
    store = open_store(url, file_root=root)
    data = content(300_000)
    cuts = sorted(random.Random(1).sample(range(1, len(data)), 39))
    put_pieces(store, JOURNAL, data, cuts, codec=pb.SNAPPY)
    before = journal_bytes(store, JOURNAL)
    assert before == data and len(store.list_fragments(JOURNAL)) == 40
    specs = specs_file(tmp_path, url)
    args = ["-l", f"name={JOURNAL}", "--specs", str(specs), "--min-age", "0s",
            "--target-size", "64KiB"]  # fmt: skip
    if root is not None:
        args += ["--file-root", str(root)]

    dry = compact(*args, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would merge" in dry.output and len(store.list_fragments(JOURNAL)) == 40

    result = compact(*args)
    assert result.exit_code == 0, result.output
    after = store.list_fragments(JOURNAL)
    assert journal_bytes(store, JOURNAL) == data
    assert 5 <= len(after) < 10  # 300 KB in pieces of at most 64 KiB.
    assert all(f.end - f.begin <= 64 << 10 for f in after)
    assert {f.compression_codec for f in after} == {pb.ZSTANDARD}  # The journal's codec.
    assert covering(after)[1] == []  # Nothing redundant left behind.

    again = compact(*args)  # Idempotent: nothing left to merge.
    assert again.exit_code == 0, again.output
    assert "nothing to compact" in again.output
    assert [fragment_path(f) for f in store.list_fragments(JOURNAL)] == [
        fragment_path(f) for f in after
    ]


@pytest.mark.slow
def test_interrupted_compaction_reads_the_same_and_a_rerun_finishes(
    spark: object, tmp_path: Path
) -> None:
    url, root = "file:///store/", tmp_path / "root"
    (root / "store").mkdir(parents=True)
    store = open_store(url, file_root=root)
    data = content(120_000, seed=3)
    put_pieces(store, JOURNAL, data, list(range(4000, len(data), 4000)), codec=pb.GZIP)
    spec = pb.JournalSpec(name=JOURNAL)
    spec.fragment.compression_codec = pb.ZSTANDARD
    plan = plan_journal(
        spec, store.list_fragments(JOURNAL), target_size=50_000, codec=None, min_age=0, now=1e10
    )
    assert len(plan.runs) == 3
    # "Killed" after the first two runs' fragments were written, before anything was removed.
    for run in plan.runs[:2]:
        write_merged(run, root)
    listed = store.list_fragments(JOURNAL)
    assert len(covering(listed)[1]) == sum(len(r.fragments) for r in plan.runs[:2])
    assert journal_bytes(store, JOURNAL) == data  # Readers see identical bytes meanwhile.

    result = compact("-l", f"name={JOURNAL}", "--specs", str(specs_file(tmp_path, url)),
                     "--file-root", str(root), "--min-age", "0s", "--target-size", "50000")  # fmt: skip
    assert result.exit_code == 0, result.output
    # The two merged fragments cover 24 old ones, removed now; the last run is merged.
    assert "6 fragments (24000 bytes) into 1 fragment; 24 redundant fragments" in result.output
    after = store.list_fragments(JOURNAL)
    assert len(after) == 3 and covering(after)[1] == []
    assert journal_bytes(store, JOURNAL) == data


@pytest.mark.slow
def test_a_corrupt_fragment_fails_the_job_and_nothing_is_removed(
    spark: object, tmp_path: Path
) -> None:
    url, root = "file:///store/", tmp_path / "root"
    (root / "store").mkdir(parents=True)
    store = open_store(url, file_root=root)
    data = content(40_000, seed=5)
    fragments = put_pieces(store, JOURNAL, data, [10_000, 20_000, 30_000])
    victim = root / "store" / fragment_path(fragments[2])
    os.chmod(victim, 0o644)
    victim.write_bytes(b"X" * (fragments[2].end - fragments[2].begin))  # Same size, wrong bytes.
    result = compact("-l", f"name={JOURNAL}", "--specs", str(specs_file(tmp_path, url, "NONE")),
                     "--file-root", str(root), "--min-age", "0s")  # fmt: skip
    assert result.exit_code == 1
    assert "does not match its SHA-1" in result.output
    assert fragment_path(fragments[2]) in result.output
    assert result.output.count("\n") == 1, result.output  # One line, no traceback.
    assert len(store.list_fragments(JOURNAL)) == 4


def test_plan_respects_gaps_postfixes_age_and_target() -> None:
    spec = pb.JournalSpec(name=JOURNAL)

    def f(begin: int, end: int, postfix: str = "", mod_time: int = 100) -> pb.Fragment:
        return pb.Fragment(journal=JOURNAL, begin=begin, end=end, backing_store="file:///s/",
                           path_postfix=postfix, mod_time=mod_time)  # fmt: skip

    fragments = [
        f(0, 10),
        f(10, 20),
        f(20, 30),  # one run (30 <= 35)
        f(30, 40),  # would pass the target: starts the next run
        f(40, 50),
        f(60, 70),
        f(70, 80),  # after a gap: a run of their own
        f(80, 90, "date=2"),  # another postfix: alone
        f(90, 95, "date=2", mod_time=195),
        f(95, 99, "date=2", mod_time=199),  # too young
        f(0, 20),  # covers the first two: they are redundant
    ]
    plan = plan_journal(spec, fragments, target_size=35, codec=pb.GZIP, min_age=10, now=200)
    assert [(r.begin, r.end, len(r.fragments)) for r in plan.runs] == [
        (0, 30, 2), (30, 50, 2), (60, 80, 2)
    ]  # fmt: skip
    assert [(g.begin, g.end) for g in plan.redundant] == [(0, 10), (10, 20)]
    assert plan.too_young == 2 and plan.untouched == 1
    assert {r.codec for r in plan.runs} == {pb.GZIP}


def test_dry_run_prints_the_plan_as_a_table(tmp_path: Path) -> None:
    """--dry-run prints (stdout) a row per merge: the fragments it merges with their offsets,
    their bytes and the fragment they become; a row per redundant fragment to remove, and per
    journal what stays as it is and why. Without Spark: nothing runs."""
    (tmp_path / "root" / "store").mkdir(parents=True)
    store = open_store("file:///store/", file_root=tmp_path / "root")
    data = content(600)
    put_pieces(store, JOURNAL, data, [100, 200, 300, 400, 500], codec=pb.NONE)
    put_pieces(store, JOURNAL, data[:200], [], codec=pb.NONE)  # Covers [0, 100) and [100, 200).
    specs = specs_file(tmp_path, "file:///store/")
    args = ("gazctl", "spark", "compact", "-l", f"name={JOURNAL}", "--specs", str(specs),
            "--file-root", str(tmp_path / "root"), "--target-size", "300", "--dry-run")  # fmt: skip
    r = run_cli(*args, "--min-age", "0s")
    assert r.code == 0, r.err
    header, *rows = r.out.splitlines()
    assert header.split() == ["Journal", "Action", "Fragments", "Offsets", "Bytes", "Into"]
    assert len(rows) == 4, r.out
    merges = [row for row in rows if " merge " in row]
    assert len(merges) == 2, r.out
    assert "[0, 200) [200, 300)" in merges[0] and "[0, 300) ZSTANDARD" in merges[0], merges[0]
    assert merges[0].split()[-4] == "300", merges[0]  # Bytes of content.
    assert "[300, 400) [400, 500) [500, 600)" in merges[1], merges[1]
    assert "[300, 600) ZSTANDARD" in merges[1], merges[1]
    removes = [row for row in rows if " remove " in row]
    assert [("[0, 100)" in row, "[100, 200)" in row) for row in removes] == [
        (True, False), (False, True)
    ], r.out  # fmt: skip
    assert all("covered by [0, 200)" in row for row in removes), r.out
    assert "would merge 1 journal: 5 fragments (600 bytes) into 2 fragments" in r.err, r.err

    # Too young to merge (the default --min-age: 1h): a row says what stays, and why.
    young = run_cli(*args)
    assert young.code == 0, young.err
    header, *rows = young.out.splitlines()
    assert len(rows) == 3, young.out  # The two redundant fragments, and what stays.
    kept = [row for row in rows if " keep " in row]
    assert len(kept) == 1 and "5 fragments" in kept[0], young.out
    assert "5 persisted less than --min-age ago (by default the journal's flush" in kept[0], kept[0]


@pytest.mark.slow
def test_a_spark_job_starts_without_jvm_warnings(tmp_path: Path) -> None:
    """`gazctl spark compact`, run as a user runs it (its own JVM), says on stderr only what
    it did: no WARN lines from the JVM, Spark or Hadoop (log levels, incubator modules, native
    libraries, loopback addresses)."""
    (tmp_path / "root" / "store").mkdir(parents=True)
    store = open_store("file:///store/", file_root=tmp_path / "root")
    put_pieces(store, JOURNAL, content(3000), [1000, 2000], codec=pb.NONE)
    r = run_cli("gazctl", "spark", "compact", "-l", f"name={JOURNAL}", "--master", "local[1]",
                "--specs", str(specs_file(tmp_path, "file:///store/")), "--min-age", "0s",
                "--file-root", str(tmp_path / "root"), timeout=180)  # fmt: skip
    assert r.code == 0, r.err
    assert r.err.splitlines() == [
        "compacted 1 journal: 3 fragments (3000 bytes) into 1 fragment; 0 redundant fragments "
        "removed; 0 left as they are, 0 too young"
    ], r.err


def test_sizes_and_bad_flags_are_one_line() -> None:
    result = compact("-l", "name=x", "--specs", "/nonexistent.yaml", "--target-size", "lots")
    assert result.exit_code == 2 and "'lots' is not a size" in result.output
    result = compact("-l", "name=x", "--specs", "/nonexistent.yaml")
    assert result.exit_code == 1
    assert (
        result.output.strip()
        == "Error: cannot read the specs file /nonexistent.yaml: No such file or directory"
    )


@pytest.mark.slow
async def test_compaction_while_a_broker_keeps_appending(
    spark: object, etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    url = "file:///store/"
    journal = pb.JournalSpec(name=APPENDED, replication=2)
    journal.fragment.length = 4096  # Many small fragments, persisted as they complete.
    journal.fragment.compression_codec = pb.SNAPPY
    journal.fragment.stores.append(url)
    journal.fragment.refresh_interval.seconds = 1
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-0", "bk-1"], run_allocator=True, file_root=str(root),
        persist_interval=0.2,
    ) as brokers:  # fmt: skip
        async with brokers[0].client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=journal)])
            await routed(client, APPENDED, 2)
        channel = dial(brokers[0].endpoint)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        lines: list[bytes] = []
        stop = asyncio.Event()

        async def appender() -> None:
            while not stop.is_set() or len(lines) < 400:
                line = f'{{"n": {len(lines)}, "pad": "{"p" * 150}"}}\n'.encode()
                await append_routed(stub, APPENDED, line)
                lines.append(line)
                await asyncio.sleep(0.005)

        try:
            task = asyncio.ensure_future(appender())
            while len(lines) < 150:  # Some fragments persisted before compaction starts.
                await asyncio.sleep(0.05)
            args = ["-l", f"name={APPENDED}", "--file-root", str(root), "--min-age", "0s",
                    "--target-size", "24KiB", "--broker.address", brokers[0].endpoint]  # fmt: skip
            first = await asyncio.to_thread(compact, *args)
            assert first.exit_code == 0, first.output
            assert "into" in first.output
            second = await asyncio.to_thread(compact, *args)  # Again, on what came since.
            assert second.exit_code == 0, second.output
            stop.set()
            await task
            await append_routed(stub, APPENDED, b"")
            expected = b"".join(lines)
            # Through the brokers: every appended line once, in order, nothing else.
            assert await read_all(stub) == expected
        finally:
            await channel.close(None)
    # The store holds all but the spool's last, incomplete fragment, merged or not, identically.
    store = open_store(url, file_root=root)
    stored = journal_bytes(store, APPENDED)
    assert len(expected) - 4096 <= len(stored) and stored == expected[: len(stored)]
    listed = store.list_fragments(APPENDED)
    assert any(f.end - f.begin > 4096 for f in listed), "nothing was merged"


def test_spark_compact_notes_unpersisted_content(
    cluster: Cluster,
    history: History,
    tmp_path: Path,
) -> None:
    # frag/a: [0,1400) persisted, [1400,1600) in the broker only; frag/b: [0,4) in the broker.
    # The job reads stores only, so it says what it leaves out, and how to persist it.
    plan = ("gazctl", "spark", "compact", "-l", "prefix=frag/", "--dry-run",
            "--file-root", str(cluster.root), "--broker.address", cluster.broker.address)  # fmt: skip
    r = run_cli(*plan)
    assert r.code == 0, r.err
    notes = [line for line in r.err.splitlines() if "not persisted yet" in line]
    assert len(notes) == 2, r.err
    a, b = notes
    assert "frag/a" in a and "1400" in a and "1600" in a, a
    assert "gazctl journals suspend -l name=frag/a" in a
    assert "frag/b" in b and "0" in b and "4" in b and "name=frag/b" in b, b

    # Doing what it says persists the rest, and the note goes away.
    flush = shlex.split(a[a.index("gazctl journals suspend") :].rstrip(")"))
    done = run_cli(*flush, env={"BROKER_ADDRESS": cluster.broker.address})
    assert done.code == 0, done.err
    store = open_store(STORE, file_root=cluster.root)
    deadline = time.monotonic() + 20
    while max(f.end for f in store.list_fragments("frag/a")) < 1600:
        assert time.monotonic() < deadline, "the suspended journal's content was never persisted"
        time.sleep(0.1)
    r = run_cli(*plan)
    assert r.code == 0, r.err
    assert not [line for line in r.err.splitlines() if line.startswith("frag/a:")], r.err

    # With --specs there is no broker to ask: nothing is said.
    specs = tmp_path / "specs.yaml"
    specs.write_text(f'name: frag/b\nreplication: 1\nfragment:\n  stores: ["{STORE}"]\n')
    r = run_cli("gazctl", "spark", "compact", "-l", "name=frag/b", "--dry-run",
                "--specs", str(specs), "--file-root", str(cluster.root))  # fmt: skip
    assert r.code == 0 and "not persisted" not in r.err, r.err
