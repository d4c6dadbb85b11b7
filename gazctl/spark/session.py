"""Starting Spark for gazctl's jobs: `local[*]` by default (the embedded engine), any cluster
with a master URL. What is missing (Java, PySpark, pyarrow) is one line naming what to install."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gazctl.spark.journals import JobError

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def check_requirements() -> None:
    """JobError naming what to install when Spark cannot run here."""
    for module, package in (("pyspark", "pyspark"), ("pyarrow", "pyarrow"), ("pandas", "pandas<3")):
        if importlib.util.find_spec(module) is None:
            raise JobError(
                f"{package} is not installed: pip install 'gazette-py[spark]' (PySpark, pyarrow "
                "and pandas<3) to run Spark jobs"
            )
    java_home = os.environ.get("JAVA_HOME")
    has_java = shutil.which("java") is not None or (
        java_home is not None and os.path.exists(os.path.join(java_home, "bin", "java"))
    )
    if not has_java:
        raise JobError(
            "Java is not installed (no java on PATH, no JAVA_HOME): Spark needs a JDK 17 or "
            "later, e.g. apt install openjdk-17-jre-headless"
        )


def spark_session(master: str | None = None, app: str = "gazctl") -> SparkSession:
    """The active SparkSession, or a new one on `master` (default ``local[*]``), with the
    gazette data source registered."""
    check_requirements()
    # Executors run this same Python, and the embedded engine binds to loopback.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from gazctl.spark.source import GazetteDataSource

    builder = (
        SparkSession.builder.appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # gazctl shows its own progress.
        .config(
            "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={LOG4J_CONFIG.as_uri()}"
        )
    )
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # Under spark-submit: its master rules.
    if master or not submitted:
        builder = builder.master(master or "local[*]")
    if not submitted and (not master or master.startswith("local")):
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J and JVM start-up failures: one line.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobError(f"cannot start Spark on {master or 'local[*]'}: {first}") from None
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(GazetteDataSource)
    return spark


def stop_spark(spark: SparkSession) -> None:
    """Stop the session and the JVM it runs in, by its pid (a later session starts a new one)."""
    from pyspark import SparkContext

    spark.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is not None:
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        from broker.processes import stop_process

        stop_process(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
