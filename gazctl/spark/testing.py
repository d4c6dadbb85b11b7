"""A standalone Spark cluster for tests and benchmarks: a master and workers started from PySpark's
own `spark-class`, bound to 127.0.0.1 only, and stopped by pid. What `--master spark://...` runs
on, without a Spark install beside PySpark's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.testing import free_port
from plumbing.processes import stop_process


@dataclass(frozen=True)
class StandaloneCluster:
    """A running master (`url` is what --master takes) and its workers' processes."""

    url: str
    web_url: str
    workdir: Path  # Logs (master.log, worker-N.log) and each worker's work-dir (worker-N/).
    master: subprocess.Popen[bytes]
    workers: tuple[subprocess.Popen[bytes], ...]

    def state(self) -> dict[str, Any]:
        """The master's view of the cluster (its web UI's JSON: workers, applications)."""
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=5) as response:
            found: dict[str, Any] = json.load(response)
        return found


def spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def cluster_environment(workdir: Path) -> dict[str, str]:
    """The daemons' environment: loopback only, logs and scratch under `workdir`, and this
    Python (with this PYTHONPATH) for the executors' Python workers."""
    env = dict(os.environ)
    env.update(
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_DIRS=str(workdir / "local"),
        SPARK_LOG_DIR=str(workdir / "logs"),
        SPARK_PID_DIR=str(workdir),
        PYSPARK_PYTHON=sys.executable,
    )
    env.pop("SPARK_HOME", None)  # spark-class finds PySpark's own.
    return env


@contextmanager
def standalone_cluster(
    workdir: Path, workers: int = 2, cores: int = 1, memory: str = "1g", timeout: float = 60
) -> Iterator[StandaloneCluster]:
    """Start a master and `workers` workers (each offering `cores` and `memory`), wait until
    every worker has registered, and stop them all by pid on exit."""
    env = cluster_environment(workdir)
    (workdir / "local").mkdir(parents=True, exist_ok=True)
    port, web_port = free_port(), free_port()
    url, web_url = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}"
    with ExitStack() as stack:

        def start(name: str, *args: str) -> subprocess.Popen[bytes]:
            log = stack.enter_context((workdir / f"{name}.log").open("wb"))
            proc = subprocess.Popen(
                [str(spark_class()), *args], stdout=log, stderr=subprocess.STDOUT, env=env
            )
            stack.callback(stop_process, proc)
            return proc

        master = start(
            "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(web_port),
        )  # fmt: skip
        started = []
        for i in range(workers):
            args = ["--host", "127.0.0.1", "--webui-port", str(free_port()), "--cores", str(cores),
                    "--memory", memory, "--work-dir", str(workdir / f"worker-{i}")]  # fmt: skip
            started.append(
                start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", url, *args)
            )
        cluster = StandaloneCluster(url, web_url, workdir, master, tuple(started))
        deadline = time.monotonic() + timeout
        while True:
            for proc in (master, *started):
                if proc.poll() is not None:
                    logs = "".join(p.read_text()[-1500:] for p in workdir.glob("*.log"))
                    raise RuntimeError(f"a Spark daemon exited {proc.returncode}: {logs}")
            try:
                if cluster.state().get("aliveworkers", 0) >= workers:
                    break
            except (OSError, ValueError):
                pass  # The master's web UI is not up yet (or answered before it had a body).
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers} Spark workers did not register with {url}")
            time.sleep(0.25)
        yield cluster


@dataclass(frozen=True)
class ConnectServer:
    """A running Spark Connect server (`url` is what --remote takes), its JVM's process."""

    url: str
    workdir: Path  # Its log (connect.log) and scratch.
    proc: subprocess.Popen[bytes]


@contextmanager
def connect_server(
    workdir: Path, master: str = "local[2]", timeout: float = 90
) -> Iterator[ConnectServer]:
    """Start a Spark Connect server from PySpark's own distribution (its spark-connect jar, run
    by `spark-class` through SparkSubmit; the JVM is the process started, `spark-class` execs
    it) on 127.0.0.1 and a free port, its Spark on `master`; wait until it accepts gRPC, and
    stop it by pid on exit."""
    import socket

    env = cluster_environment(workdir)
    (workdir / "local").mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = workdir / "connect.log"
    with ExitStack() as stack:
        log = stack.enter_context(log_path.open("wb"))
        proc = subprocess.Popen(
            [str(spark_class()), "org.apache.spark.deploy.SparkSubmit",
             "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
             "--name", "Spark Connect server", "--master", master,
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.driver.bindAddress=127.0.0.1",
             "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", f"spark.local.dir={workdir / 'local'}",
             "--conf", f"spark.pyspark.python={sys.executable}",
             "spark-internal"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        stack.callback(stop_process, proc)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the Spark Connect server exited {proc.returncode}: "
                    f"{log_path.read_text()[-3000:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                pass  # Not listening yet.
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Spark Connect server did not listen on port {port}")
            time.sleep(0.25)
        yield ConnectServer(f"sc://127.0.0.1:{port}", workdir, proc)
