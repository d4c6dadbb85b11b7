"""Spark jobs on a standalone cluster (`--master spark://...`): a master and two workers started
from PySpark's `spark-class` (gazctl.spark.testing), bound to 127.0.0.1 only, stopped by pid, and
shared by the module's tests. Each job runs as a user runs it, `gazctl spark replay` or `gazctl
spark compact` in its own process, its tasks on the workers' executors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer
from gazctl.spark.testing import StandaloneCluster, standalone_cluster
from tests.conftest import run_cli
from tests.helpers.fragments import put_pieces
from tests.helpers.spark import (
    JOURNAL,
    LOOPBACK,
    content,
    journal_bytes,
    listening_addresses,
    local_events,
    sequenced_offline,
    specs_file,
)
from tests.helpers.spark_stream import TOPIC, broker_with, committed, ordered, write_history


@pytest.fixture(scope="module")  # Three JVMs, started once for the module's tests.
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as started:
        yield started


def executors_of(cluster: StandaloneCluster, app: str) -> list[int]:
    """The workers (by index) that ran an executor of the application named `app`."""
    state = cluster.state()
    ids = [a["id"] for a in state["completedapps"] + state["activeapps"] if a["name"] == app]
    assert ids, [a["name"] for a in state["completedapps"] + state["activeapps"]]
    return [
        i
        for i in range(len(cluster.workers))
        if any((cluster.workdir / f"worker-{i}" / app_id).is_dir() for app_id in ids)
    ]


@pytest.mark.slow
def test_replay_runs_on_a_standalone_cluster_of_two_workers(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    for proc in (cluster.master, *cluster.workers):
        found = listening_addresses(proc.pid)
        assert found and found <= LOOPBACK, found
    data, _, specs = local_events(tmp_path, pb.ZSTANDARD)
    out = tmp_path / "out.parquet"
    result = run_cli(
        "gazctl", "spark", "replay", "-l", "name=local/events", "--specs", str(specs),
        "--file-root", str(tmp_path), "--split-size", "2000", "--master", cluster.url,
        "--to", f"parquet:{out}", timeout=300,
    )  # fmt: skip
    assert result.code == 0, result.err
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: (r["commit_offset"], r["offset"]))
    got = [(r["journal"], r["offset"], json.loads(r["content"])["id"]) for r in rows]
    assert got == sequenced_offline(data, "local/events")
    # It ran on the cluster, with an executor on each worker.
    assert executors_of(cluster, "gazctl spark replay") == [0, 1]


@pytest.mark.slow
def test_compact_runs_on_a_standalone_cluster_of_two_workers(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    (tmp_path / "root" / "store").mkdir(parents=True)
    store = open_store("file:///store/", file_root=tmp_path / "root")
    data = content(3000)
    put_pieces(store, JOURNAL, data, [1000, 2000], codec=pb.NONE)
    r = run_cli("gazctl", "spark", "compact", "-l", f"name={JOURNAL}", "--master", cluster.url,
                "--specs", str(specs_file(tmp_path, "file:///store/")), "--min-age", "0s",
                "--file-root", str(tmp_path / "root"), timeout=300)  # fmt: skip
    assert r.code == 0, r.err
    assert r.err.splitlines() == [
        "compacted 1 journal: 3 fragments (3000 bytes) into 1 fragment; 0 redundant fragments "
        "removed; 0 left as they are, 0 too young"
    ], r.err
    fragments = store.list_fragments(JOURNAL)
    assert [(f.begin, f.end, f.compression_codec) for f in fragments] == [
        (0, 3000, pb.ZSTANDARD)
    ], fragments
    assert journal_bytes(store, JOURNAL) == data
    # The executors wrote, verified and removed the fragments: one on each worker.
    assert executors_of(cluster, "gazctl spark compact") == [0, 1]


@pytest.mark.slow
async def test_a_stream_runs_on_a_standalone_cluster_of_two_workers(
    cluster: StandaloneCluster, etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """`gazctl spark stream --master spark://...`: the planner in the driver, the journals' reads
    on the workers' executors, each committed message once in the table (a run from its
    checkpoint adding nothing is tested locally, in tests/test_spark_stream.py)."""
    root = tmp_path / "root"
    async with broker_with(etcd_server, etcd_prefix, root, TOPIC) as (address, stub):
        await write_history(stub, rounds=3)
        want = []
        for journal in TOPIC:
            want += await committed(stub, journal)
        table = tmp_path / "table"
        args = ("gazctl", "spark", "stream", "-l", "topic=stream", "--file-root", str(root),
                "--broker.address", address, "--once", "--to", f"parquet:{table}",
                "--checkpoint", str(tmp_path / "checkpoint"), "--master", cluster.url)  # fmt: skip
        result = await asyncio.to_thread(run_cli, *args, timeout=300)
        assert result.code == 0, result.err
        assert f"streamed {len(want)} messages in " in result.err, result.err
        rows = pq.read_table(table).to_pylist()
        got = [(r["journal"], r["offset"], json.dumps(json.loads(r["content"]), sort_keys=True)) for r in rows]  # fmt: skip
        assert ordered(got) == ordered(want)
        assert executors_of(cluster, "gazctl spark stream") == [0, 1]
