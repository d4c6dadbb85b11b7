"""Starting Spark for gazctl's jobs: `local[*]` by default (the embedded engine), any cluster
with a master URL. What is missing (Java, PySpark, pyarrow) is one line naming what to install."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gazctl.spark.journals import JobError

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")

# What the JVM itself prints on stderr as it starts, which no option turns off and which says
# nothing to a user of gazctl: Spark's launcher always adds jdk.incubator.vector (--add-modules),
# and a JDK past 23 warns once of sun.misc.Unsafe, which Spark's libraries still call. Everything
# else the JVM prints (its log, at error level: see log4j2.properties) reaches stderr.
JVM_NOISE = (
    "WARNING: Using incubator modules:",
    "WARNING: A terminally deprecated method in sun.misc.Unsafe",
    "WARNING: sun.misc.Unsafe::",
    "WARNING: Please consider reporting this to the maintainers of",
    "WARNING: sun.misc.Unsafe",
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def check_requirements(java: bool = True) -> None:
    """JobError naming what to install when Spark cannot run here (without `java`: when a Spark
    Connect client cannot, which needs no JVM of its own)."""
    for module, package in (("pyspark", "pyspark"), ("pyarrow", "pyarrow"), ("pandas", "pandas<3")):
        if importlib.util.find_spec(module) is None:
            raise JobError(
                f"{package} is not installed: pip install 'gazette-py[spark]' (PySpark, pyarrow "
                "and pandas<3) to run Spark jobs"
            )
    if not java:
        return
    java_home = os.environ.get("JAVA_HOME")
    has_java = shutil.which("java") is not None or (
        java_home is not None and os.path.exists(os.path.join(java_home, "bin", "java"))
    )
    if not has_java:
        raise JobError(
            "Java is not installed (no java on PATH, no JAVA_HOME): Spark needs a JDK 17 or "
            "later, e.g. apt install openjdk-17-jre-headless"
        )


def is_connect(session: Any) -> bool:
    """Whether `session` is a Spark Connect client's (no SparkContext, RDDs or accumulators)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def connect_session(remote: str, app: str = "gazctl") -> SparkSession:
    """A Spark Connect session on `remote` (sc://host:port), the gazette data source registered
    on the server's side."""
    check_requirements(java=False)
    for module, package in (("grpc", "grpcio"), ("grpc_status", "grpcio-status"),
                            ("google.rpc", "googleapis-common-protos")):  # fmt: skip
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise JobError(
                f"{package} is not installed: pip install 'gazette-py[spark]' (it brings Spark "
                "Connect's client) to use --remote"
            )
    from pyspark.sql import SparkSession

    from gazctl.spark.source import GazetteDataSource

    try:
        spark = SparkSession.builder.remote(remote).appName(app).getOrCreate()
        spark.dataSource.register(GazetteDataSource)
    except Exception as exc:  # gRPC and server-side failures: one line.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobError(f"cannot use Spark Connect at {remote}: {first}") from None
    return spark


def spark_session(
    master: str | None = None, app: str = "gazctl", remote: str | None = None
) -> SparkSession:
    """The active SparkSession, or a new one on `master` (default ``local[*]``), or a Spark
    Connect session on `remote`, with the gazette data source registered."""
    if remote is not None:
        return connect_session(remote, app)
    check_requirements()
    # Executors run this same Python, and the embedded engine binds to loopback.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from gazctl.spark.source import GazetteDataSource

    options = {
        "spark.app.name": app,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",  # gazctl shows its own progress.
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG4J_CONFIG.as_uri()}",
    }
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # Under spark-submit: its master rules.
    if master or not submitted:
        options["spark.master"] = master or "local[*]"
    if not submitted and (not master or master.startswith("local")):
        options["spark.driver.bindAddress"] = "127.0.0.1"
        options["spark.driver.host"] = "127.0.0.1"
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    try:
        if not submitted:
            _launch_gateway(options)
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J and JVM start-up failures: one line.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobError(f"cannot start Spark on {master or 'local[*]'}: {first}") from None
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(GazetteDataSource)
    return spark


def _launch_gateway(options: dict[str, str]) -> None:
    """Start the driver's JVM as PySpark would (spark-submit with `options`), unless one runs,
    with its stderr passed on through a thread that leaves out JVM_NOISE (stop_spark joins it)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        conf = SparkConf(loadDefaults=False)
        for key, value in options.items():
            conf.set(key, value)
        gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})  # type: ignore[no-untyped-call]
        proc = gateway.proc
        forwarder = threading.Thread(
            target=_pass_stderr_on, args=(proc.stderr,), name="spark-jvm-stderr", daemon=True
        )
        forwarder.start()
        gateway.stderr_forwarder = forwarder
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm


def _pass_stderr_on(source: IO[bytes]) -> None:
    """The JVM's stderr, line by line, to ours, but for JVM_NOISE; until the JVM exits."""
    out: Any = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    for line in iter(source.readline, b""):
        if line.decode(errors="replace").startswith(JVM_NOISE):
            continue
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sys.stderr.write(line.decode(errors="replace"))


def stop_spark(spark: SparkSession) -> None:
    """Stop the session and the JVM it runs in, by its pid (a later session starts a new one)."""
    from pyspark import SparkContext

    spark.stop()
    if is_connect(spark):
        return  # The server's JVM is not ours.
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    forwarder = getattr(gateway, "stderr_forwarder", None)
    if gateway is not None:
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        from plumbing.processes import stop_process

        stop_process(proc)
        if forwarder is not None:
            forwarder.join(timeout=10)  # The JVM has exited: its stderr ends.
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def use_in_this_thread(spark: SparkSession) -> None:
    """Make `spark` the JVM's active session for this thread. Spark looks up a Python data
    source's streaming sink through the thread's active session: a query started from another
    thread than the one that made the session fails with DATA_SOURCE_NOT_FOUND without this."""
    if is_connect(spark):
        return
    jvm: Any = spark._jvm
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
