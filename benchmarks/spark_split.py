"""spark_split: one large fragment (1 GiB of 200-byte JSON messages in transactions of 100, zstd, in
a file:// store; 64 MiB in quick mode) replayed into Parquet on a standalone cluster (one worker,
executors of 512 MiB) with the fragment split into 16 MiB partitions (8 MiB quick), and again
unsplit as the same run's baseline. Peak memory of the executor (its JVM and its Python workers,
resident set, sampled every 50 ms from /proc) is measured for each: split, a task holds its split's
messages only; unsplit, the whole fragment's."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._messages import transactions
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb

JOURNAL = "bench/split"
STORE = "file:///fragments/"
EXECUTOR_MEMORY = "512m"


def write_fragment(root: Path, size: int) -> tuple[int, int]:
    """One fragment of about `size` bytes; returns its size and its message count."""
    from tests.fragments_testing import put_fragment

    (root / "fragments").mkdir()
    count = size // 200
    data, _ = transactions(count, 100)
    put_fragment(open_store(STORE, file_root=root), JOURNAL, 0, data, pb.ZSTANDARD)
    (root / "specs.yaml").write_text(
        f"name: {JOURNAL}\nreplication: 1\nlabels:\n  - name: content-type\n"
        f'    value: application/x-ndjson\nfragment:\n  stores: ["{STORE}"]\n'
    )
    return len(data), count


def _tree(pids: list[int]) -> list[int]:
    """The pids and all their descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """Samples the resident memory of the executors under `workers` (their descendants) until
    stopped: the peak of the sum, and the peak of any one Python worker."""

    def __init__(self, workers: list[int]) -> None:
        self.workers = workers
        self.total = self.python = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            pids = [p for p in _tree(self.workers) if p not in self.workers]
            sizes = {pid: _rss(pid) for pid in pids}
            self.total = max(self.total, sum(sizes.values()))
            for pid, size in sizes.items():
                try:
                    exe = os.readlink(f"/proc/{pid}/exe")
                except OSError:
                    continue
                if "python" in Path(exe).name:
                    self.python = max(self.python, size)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def replay(session: Any, root: Path, out: Path, split: int) -> int:
    from rich.progress import Progress

    from gazctl.spark.jobs import replay_to_parquet

    options = {"selector": f"name={JOURNAL}", "specs": str(root / "specs.yaml"),
               "file_root": str(root), "framing": "lines", "split_bytes": str(split)}  # fmt: skip
    with Progress(disable=True) as progress:
        return replay_to_parquet(session, options, str(out), False, progress)


def run(quick: bool = False) -> dict[str, Any]:
    from gazctl.spark.session import spark_session, stop_spark
    from gazctl.spark.testing import standalone_cluster

    size, split = (64 << 20, 8 << 20) if quick else (1 << 30, 16 << 20)
    with tempfile.TemporaryDirectory(prefix="gazette-bench-split-") as tmp:
        root = Path(tmp)
        total, count = write_fragment(root, size)
        with standalone_cluster(root / "cluster", workers=1, cores=2, memory="1g") as cluster:
            os.environ["PYSPARK_SUBMIT_ARGS"] = (
                f"--conf spark.executor.memory={EXECUTOR_MEMORY} pyspark-shell"
            )
            session = spark_session(cluster.url, "spark_split benchmark")
            try:
                figures = {}
                for name, bytes_ in (("split", split), ("whole", total + 1)):
                    workers = [p.pid for p in cluster.workers]
                    start = time.perf_counter()
                    with PeakMemory(workers) as peak:
                        rows = replay(session, root, root / f"{name}.parquet", bytes_)
                    seconds = time.perf_counter() - start
                    assert rows == count, (name, rows, count)
                    figures[name] = (seconds, peak.total, peak.python)
            finally:
                stop_spark(session)
                os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
        close_stores()
    mib = 1 << 20
    split_s, split_total, split_python = figures["split"]
    whole_s, whole_total, whole_python = figures["whole"]
    return {
        "value": round(split_total / mib),
        "unit": "MiB peak executor RSS (split)",
        "baseline": round(whole_total / mib),
        "ratio": round(split_total / whole_total, 2),
        "fragment_mib": round(total / mib),
        "split_mib": split // mib,
        "executor_memory": EXECUTOR_MEMORY,
        "messages": count,
        "split_s": round(split_s, 1),
        "whole_s": round(whole_s, 1),
        "split_python_worker_peak_mib": round(split_python / mib),
        "whole_python_worker_peak_mib": round(whole_python / mib),
    }


if __name__ == "__main__":
    print(run())
