"""spark_split: a 1 GiB fragment (200-byte JSON messages in transactions of 100, zstd, in a file://
store) replayed into Parquet on a standalone cluster (one worker of 2 cores, executors of
`spark.executor.memory=512m`) split into 16 MiB partitions, beside same-run baselines: a 64 MiB
fragment replayed with the same split size (the peak should not grow with the fragment), and the
64 MiB and 128 MiB fragments replayed unsplit (the peak grows with the fragment: a 1 GiB fragment
unsplit would need about 8 GiB in one Python worker, too much to try). Quick mode: 64 MiB split
in 4 MiB partitions, beside 16 MiB split and 16 and 32 MiB unsplit. For each: the peak resident
memory of the executor (its JVM and Python workers, sampled every 50 ms from /proc), of its
largest Python worker and of its JVM, and the CPU seconds the executor used (wall time, also
reported, is stretched by whatever else the machine runs).

Each split decompresses the fragment from its start (a fragment is one zstd frame: no random
access), so the splits of a fragment together decompress about n/2 times its content: that work
is computed from the planned splits and the driver's measured decompression rate, and reported
beside the split replay's CPU seconds."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._messages import transactions
from benchmarks._proc import cpu_seconds, rss_bytes
from broker.fragment.stores import close_stores, open_store
from broker.protocol import protocol_pb2 as pb

STORE = "file:///fragments/"
EXECUTOR_MEMORY = "512m"
CORES = 2
MIB = 1 << 20


@dataclass(frozen=True)
class Scale:
    large: int  # The fragment replayed split: the benchmark's figure.
    small: int  # Replayed split as well (same split size), and unsplit.
    medium: int  # Replayed unsplit: a second point of the unsplit line.
    split: int


FULL = Scale(large=1 << 30, small=64 * MIB, medium=128 * MIB, split=16 * MIB)
QUICK = Scale(large=64 * MIB, small=16 * MIB, medium=32 * MIB, split=4 * MIB)
# Replayed first, unmeasured, in 4 splits: the executor and both Python workers start, as on a
# cluster already running.
WARM_UP = 1 * MIB


def journal_of(size: int) -> str:
    return f"bench/split-{size // MIB}m"


def write_fragment(root: Path, size: int) -> tuple[pb.Fragment, int]:
    """One fragment of about `size` bytes, the only one of its journal; returns it and its
    message count (ACKs not counted: a replay writes none)."""
    from tests.helpers.fragments import put_fragment

    count = size // 200
    data, _ = transactions(count, 100)
    fragment = put_fragment(open_store(STORE, file_root=root), journal_of(size), 0, data,
                            pb.ZSTANDARD)  # fmt: skip
    return fragment, count


def write_specs(root: Path, sizes: list[int]) -> None:
    (root / "specs.yaml").write_text(
        "replication: 1\nlabels:\n  - name: content-type\n    value: application/x-ndjson\n"
        f'fragment:\n  stores: ["{STORE}"]\nchildren:\n'
        + "".join(f"  - name: {name}\n" for name in sorted(map(journal_of, sizes)))
    )


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
        return rss_bytes(pid)
    except OSError:
        return 0  # Gone meanwhile.


def _cpu(pid: int) -> float:
    """Seconds of CPU the process has used (user and system)."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


class ExecutorMeter:
    """Samples the executors under `workers` (their descendants: JVMs and Python workers)
    every 50 ms until stopped: the peak resident memory of them all, of any one Python worker
    and of any one JVM, and the CPU seconds they used meanwhile (unlike wall time, not
    stretched by other work on the machine)."""

    def __init__(self, workers: list[int]) -> None:
        self.workers = workers
        self.total = self.python = self.jvm = 0
        self._cpu_at_start = {pid: _cpu(pid) for pid in self._executors()}
        self._cpu_seen = dict(self._cpu_at_start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu_seen.values()) - sum(self._cpu_at_start.values())

    def _executors(self) -> list[int]:
        return [p for p in _tree(self.workers) if p not in self.workers]

    def _sample(self) -> None:
        while True:
            pids = self._executors()
            sizes = {pid: _rss(pid) for pid in pids}
            self.total = max(self.total, sum(sizes.values()))
            for pid, size in sizes.items():
                self._cpu_seen[pid] = max(self._cpu_seen.get(pid, 0.0), _cpu(pid))
                try:
                    exe = Path(os.readlink(f"/proc/{pid}/exe")).name
                except OSError:
                    continue
                if "python" in exe:
                    self.python = max(self.python, size)
                elif exe == "java":
                    self.jvm = max(self.jvm, size)
            if self._stop.wait(0.05):
                return  # Sampled once more after the run ended.

    def __enter__(self) -> ExecutorMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def options(root: Path, size: int, split: int) -> dict[str, str]:
    return {"selector": f"name={journal_of(size)}", "specs": str(root / "specs.yaml"),
            "file_root": str(root), "framing": "lines", "split_bytes": str(split)}  # fmt: skip


def replay(session: Any, root: Path, size: int, split: int) -> int:
    from rich.progress import Progress

    from gazctl.spark.jobs import replay_to_parquet

    out = root / f"out-{size // MIB}m-{split}.parquet"
    with Progress(disable=True) as progress:
        return replay_to_parquet(session, options(root, size, split), str(out), False, progress)


def discarded_bytes(root: Path, size: int, split: int) -> tuple[int, int]:
    """How many splits the replay plans for the fragment, and the content its splits
    decompress and drop before their own (each starts decompressing at the fragment's begin)."""
    from gazctl.spark.source import GazetteReader

    partitions = list(GazetteReader(options(root, size, split)).partitions())
    return len(partitions), sum(p.begin - pb.Fragment.FromString(p.fragment).begin
                                for p in partitions)  # fmt: skip


def decompression_rate(root: Path, fragment: pb.Fragment) -> float:
    """Bytes of content per second decompressing `fragment` whole, unverified, on one core."""
    from broker.fragment.content import open_in_store

    store = open_store(STORE, file_root=root)
    start = time.perf_counter()
    n = sum(len(block) for block in open_in_store(store, fragment, fragment.begin, verify=False))
    return n / (time.perf_counter() - start)


def run(quick: bool = False) -> dict[str, Any]:
    from gazctl.spark.session import spark_session, stop_spark
    from gazctl.spark.testing import standalone_cluster

    scale = QUICK if quick else FULL
    sizes = [WARM_UP, scale.small, scale.medium, scale.large]
    # In order of expected peak (split, then unsplit): what an executor's JVM and its reused
    # Python workers keep resident from one run is counted again in the next.
    runs = [("small split", scale.small, scale.split), ("large split", scale.large, scale.split),
            ("small unsplit", scale.small, 0), ("medium unsplit", scale.medium, 0)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gazette-bench-split-") as tmp:
        root = Path(tmp)
        (root / "fragments").mkdir()
        write_specs(root, sizes)
        fragments = {size: write_fragment(root, size) for size in sizes}
        large, _ = fragments[scale.large]
        rate = decompression_rate(root, large)
        splits, discarded = discarded_bytes(root, scale.large, scale.split)
        figures: dict[str, tuple[float, ExecutorMeter, float]] = {}
        with standalone_cluster(root / "cluster", workers=1, cores=CORES, memory="1g") as cluster:
            os.environ["PYSPARK_SUBMIT_ARGS"] = (
                f"--conf spark.executor.memory={EXECUTOR_MEMORY} pyspark-shell"
            )
            session = spark_session(cluster.url, "spark_split benchmark")
            try:
                replay(session, root, WARM_UP, WARM_UP // 4)  # A Python worker per core.
                workers = [p.pid for p in cluster.workers]
                for name, size, split in runs:
                    whole = fragments[size][0].end + 1  # One partition: the fragment unsplit.
                    load = os.getloadavg()[0]
                    start = time.perf_counter()
                    with ExecutorMeter(workers) as meter:
                        rows = replay(session, root, size, split or whole)
                    seconds = time.perf_counter() - start
                    assert rows == fragments[size][1], (name, rows, fragments[size][1])
                    figures[name] = (seconds, meter, max(load, os.getloadavg()[0]))
            finally:
                stop_spark(session)
                os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
        close_stores()

    def mib(n: float) -> int:
        return round(n / MIB)

    large_run, small_run = figures["large split"][1], figures["small split"][1]
    out: dict[str, Any] = {
        "value": mib(large_run.total),
        "unit": f"MiB peak executor RSS ({mib(scale.split)} MiB splits)",
        "baseline": mib(small_run.total),
        "ratio": round(large_run.total / small_run.total, 2),
        "fragment_mib": mib(large.end),
        "messages": fragments[scale.large][1],
        "splits": splits,
        "small_mib": mib(fragments[scale.small][0].end),
        "medium_mib": mib(fragments[scale.medium][0].end),
        "executor_memory": EXECUTOR_MEMORY,
    }
    for name, (seconds, meter, load) in figures.items():
        key = name.replace(" ", "_")
        out[f"{key}_executor_mib"] = mib(meter.total)
        out[f"{key}_python_worker_mib"] = mib(meter.python)
        out[f"{key}_jvm_mib"] = mib(meter.jvm)
        out[f"{key}_s"] = round(seconds, 1)
        out[f"{key}_cpu_s"] = round(meter.cpu_seconds, 1)
        out[f"{key}_load"] = round(load, 1)  # The 1-minute load average, the higher of its ends.
    # The decompression the large fragment's splits repeat, against the split replay's CPU.
    out["decompress_mib_s"] = mib(rate)
    out["discarded_gib"] = round(discarded / (1 << 30), 1)
    out["discarded_cpu_s"] = round(discarded / rate, 1)
    return out


if __name__ == "__main__":
    print(run())
