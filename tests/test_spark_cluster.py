"""Spark jobs on a standalone cluster (`--master spark://...`): a master and two workers started
from PySpark's `spark-class` (gazctl.spark.testing), bound to 127.0.0.1 only, stopped by pid. The
replay runs as a user runs it, `gazctl spark replay` in its own process, its tasks on the
workers' executors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from broker.protocol import protocol_pb2 as pb
from gazctl.spark.testing import StandaloneCluster, standalone_cluster
from tests.conftest import run_cli
from tests.test_spark_replay import local_events, sequenced_offline


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as started:
        yield started


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) a process listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue  # Closed meanwhile.
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.add(fields[1].rsplit(":", 1)[0])
    return out


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


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
    state = cluster.state()
    apps = [a["name"] for a in state["completedapps"] + state["activeapps"]]
    assert "gazctl spark replay" in apps, apps
    for i in range(len(cluster.workers)):
        assert list((cluster.workdir / f"worker-{i}").glob("app-*/*")), (
            f"worker-{i} ran no executor"
        )
