"""Shared fixtures: one real etcd per test session (the test kit's, `consumer.testing`); each
test isolated under its own key prefix."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import pytest
from hypothesis import settings

# BrokerProcess, start_broker_process and stop_process live in the test kit; tests import them
# from here too.
from broker.testing import BrokerProcess as BrokerProcess
from broker.testing import EtcdServer
from broker.testing import start_broker_process as start_broker_process
from broker.testing import stop_process as stop_process
from plumbing import processes

# Helper modules whose asserts are the tests' own: rewritten as test modules are, so that a
# failure says what differed rather than a bare AssertionError.
pytest.register_assert_rewrite(
    "tests.helpers",
    *(f"tests.{path.stem}" for path in Path(__file__).parent.glob("*.py")
      if not path.stem.startswith(("test_", "conftest", "__"))),
)  # fmt: skip

from tests.helpers.cli_fork import ForkServer  # noqa: E402 (after the rewrite is registered)
from tests.helpers.server_fork import ZYGOTES, ForkedPopen  # noqa: E402

# Hypothesis's per-example deadline is a wall-clock assertion, and tests never assert speed: on a
# shared machine one example of a selector parse took 386 ms under load (deadline 200 ms) and
# failed a clean-clone run. Every property test runs without one.
settings.register_profile("gazette-py", deadline=None)
settings.load_profile("gazette-py")


@pytest.fixture(scope="session")
def etcd_server(gazette_etcd: EtcdServer) -> EtcdServer:
    """The test kit's session etcd (consumer.testing's plugin), under the suite's old name."""
    return gazette_etcd


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses (upstream tests use /broker.test; we add a unique suffix)."""
    return f"/gazette-test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def etcd(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[aetcd.Client]:
    client = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
    await client.connect()
    try:
        yield client
    finally:
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


@pytest.fixture(scope="module")
def broker_process(gazette_broker_process: BrokerProcess) -> BrokerProcess:
    """The test kit's module-scoped `gazette serve` process, under the suite's old name."""
    return gazette_broker_process


@dataclass
class Result:
    code: int
    out: str
    err: str


# `gazctl` runs fork from a process that imported its libraries already (tests/helpers/cli_fork.py);
# GAZETTE_TESTS_FORK_CLI=0 starts each one as a fresh interpreter instead.
FORK_SERVER = ForkServer()
# The test kits' broker and consumer processes (and the helpers' locations) start as clones of a
# process with their modules imported (tests/helpers/server_fork.py); GAZETTE_TESTS_FORK_SERVERS=0
# starts each one as a fresh interpreter instead.
processes.SERVER_POPEN = ForkedPopen


def run_cli(
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60,
) -> Result:
    """Run a console command (`gazctl`, `gazette`) as the user would, in a subprocess."""
    module = {"gazctl": "gazctl.cli", "gazette": "broker.main"}[args[0]]
    full_env = dict(os.environ)
    for inherited in (
        "BROKER_ADDRESS",
        "BROKER_FILE_ROOT",
        "CONSUMER_ADDRESS",
    ):  # As `gazctl dev up` exports them.
        full_env.pop(inherited, None)
    full_env.update(env or {})
    forks = module == "gazctl.cli" and os.environ.get("GAZETTE_TESTS_FORK_CLI", "1") != "0"
    if forks and FORK_SERVER.serves(full_env):
        code, out, err = FORK_SERVER.run(module, list(args[1:]), input, full_env, cwd, timeout)
        return Result(code, out, err)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args[1:]],
        input=input, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout,
    )  # fmt: skip
    return Result(proc.returncode, proc.stdout, proc.stderr)


from tests.helpers.store_servers import azure_server, gcs_server, s3_server  # noqa: E402,F401

pytest_plugins = [
    "tests.helpers.consumers",
    "tests.helpers.locations",
    "tests.helpers.postgres",
    "tests.helpers.recoverylog",
]


# How `nox -s tests` (`--dist loadgroup`) spreads tests over xdist workers: one test at a time,
# except that a module with module-scoped fixtures runs on one worker (its fixtures, brokers among
# them, start once rather than once per worker), and every test that takes the session's `spark`
# fixture shares one worker and its one Spark JVM (each JVM costs some 20 s of CPU to start, and
# more under load: spread, five workers started one each). pytest 9.2 no longer lets xdist's own
# `xdist_group` marker rename node ids, so the grouping is decided here, from the test files.


def _xdist_scope(nodeid: str, module_scoped: frozenset[str]) -> str:
    path = nodeid.split("::", 1)[0]
    name = nodeid.split("::", 2)[1].split("[", 1)[0] if "::" in nodeid else ""
    if (path, name) in _spark_tests():
        return "spark"
    if path == "tests/test_tenant_escape.py":
        # It collects the tests of tests/escape_*.py: those of a module with a module-scoped
        # fixture stay together (one fixture per worker), the rest spread.
        return _escape_module_scoped().get(name, nodeid)
    return path if path in module_scoped else nodeid


@functools.cache
def _spark_tests() -> frozenset[tuple[str, str]]:
    """(file, test function) of each test that takes the `spark` fixture."""
    signature = re.compile(r"^(?:async )?def (test_\w+)\(([^)]*)\)", re.MULTILINE)
    out = set()
    for p in Path(__file__).parent.glob("test_*.py"):
        for name, parameters in signature.findall(p.read_text()):
            if re.search(r"\bspark\s*:", parameters):
                out.add((f"tests/{p.name}", name))
    return frozenset(out)


@functools.cache
def _escape_module_scoped() -> dict[str, str]:
    """Test function name -> its escape module, for the escape modules with a module-scoped
    fixture."""
    out: dict[str, str] = {}
    for p in Path(__file__).parent.glob("escape_*.py"):
        text = p.read_text()
        if 'scope="module"' in text:
            for name in re.findall(r"^async def (test_\w+)|^def (test_\w+)", text, re.MULTILINE):
                out[name[0] or name[1]] = f"tests/{p.name}"
    return out


def _module_scoped() -> frozenset[str]:
    """The test modules with a module-scoped fixture: their own, or one of tests/helpers/ they
    bind (`cluster = fragment_history.cluster`) or import."""
    here = Path(__file__).parent
    binds = []
    for helper in (here / "helpers").glob("*.py"):
        names = re.findall(r'scope="module"\)\n(?:async )?def (\w+)', helper.read_text())
        if names:
            either = "|".join(names)
            binds.append(re.compile(
                rf"\b{helper.stem}\.(?:{either})\b"
                rf"|^from tests\.helpers\.{helper.stem} import [^\n]*\b(?:{either})\b",
                re.MULTILINE,
            ))  # fmt: skip
    return frozenset(
        f"tests/{p.name}"
        for p in here.glob("test_*.py")
        if 'scope="module"' in (text := p.read_text()) or any(b.search(text) for b in binds)
    )


SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's own modules to bytecode once, before any test starts a process;
    give the JVMs the suite starts (through the environment every process inherits) a JIT and a
    collector for short runs."""
    config.addinivalue_line(
        "markers", "bench: a benchmark's quick run, left to `nox -s bench -- --quick` by "
        "`nox -s tests` unless a marker expression selects it",
    )  # fmt: skip
    config.addinivalue_line(
        "markers", "faults: a short run of a fault scenario that `nox -s faults` runs whole, "
        "left out by `nox -s tests` unless a marker expression selects it",
    )  # fmt: skip
    # Every JVM here lives for seconds and runs a few small jobs, yet by default it spends most
    # of its CPU in the C2 compiler and G1's threads: with C1 alone and the serial collector, a
    # local[2] session's start and two small jobs cost 17.6 s of CPU instead of 33.4 s. Only
    # how Java compiles and collects changes: the same Spark, jobs and processes. The launcher
    # adds SPARK_SUBMIT_OPTS to the driver JVMs spark-submit starts (sessions, `gazctl spark`
    # jobs, the Connect server); SPARK_DAEMON_JAVA_OPTS to a standalone master's and workers';
    # the executors those workers start take theirs from the job's spark-defaults.conf.
    for variable in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
        os.environ.setdefault(variable, SHORT_LIVED_JVM)
    os.environ.setdefault("SPARK_CONF_DIR", str(Path(__file__).with_name("spark_conf")))
    if hasattr(config, "workerinput"):
        return  # An xdist worker: the controller compiled them before starting it.
    # These machines set PYTHONDONTWRITEBYTECODE, and the editable install leaves the project's
    # modules uncompiled (uv compiles site-packages only), so every `gazctl`, `gazette serve`,
    # consumer, location and benchmark process the suite starts (hundreds) compiled every
    # project module it imported, every time: 0.08 s of CPU a `gazctl`, 0.24 s a `gazette
    # serve`. Python still reads __pycache__ (git ignores it) under PYTHONDONTWRITEBYTECODE, and
    # ignores an entry older than its source. The first compile costs about 1.4 s, later ones
    # 0.3 s (only what changed).
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in sorted(p.parent for p in root.glob("*/__init__.py")):
        compileall.compile_dir(package, quiet=2)  # Errors are the importing test's to show.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest tests first (tests/slow_tests.txt), so that on xdist's workers none of them
    is left to run alone at the end while the other workers idle; the rest in collection order.
    Tests of a module with module-scoped fixtures keep their place (moved apart, its fixtures
    would start twice)."""
    rank = _slow_first()
    module_scoped = _module_scoped()
    last = len(rank)

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        if path in module_scoped:
            return last
        return rank.get(item.nodeid.split("[", 1)[0], last)

    items.sort(key=key)  # Stable: equal keys keep their collection order.


@functools.cache
def _slow_first() -> dict[str, int]:
    """Test function (file::name) -> its place among the slowest."""
    lines = Path(__file__).with_name("slow_tests.txt").read_text().splitlines()
    names = [line.split()[1] for line in lines if line.strip() and not line.startswith("#")]
    return {name: i for i, name in enumerate(names)}


@pytest.hookimpl(optionalhook=True)  # Unknown without xdist (`-p no:xdist`).
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    module_scoped = _module_scoped()

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid, module_scoped)

    return Grouped(config, log)  # type: ignore[arg-type]


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A `gazctl dev` cluster's directory; whatever a test left running there is stopped by
    pid."""
    from gazctl.dev import ClusterState, is_running

    directory = tmp_path / "dev"
    yield directory
    state = ClusterState.load(directory)
    if state is not None:
        for proc in state.all():
            if is_running(proc):
                os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def spark(gcs_server: object, s3_server: object) -> Iterator[object]:  # noqa: F811
    """One real Spark (local[2]) for every test that needs it, started after the storage
    emulators so that its Python workers inherit their environment; stopped by pid."""
    from gazctl.spark.session import spark_session, stop_spark

    session = spark_session("local[2]", "gazette-py tests")
    yield session
    stop_spark(session)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The fork server of `gazctl` runs and the servers' zygotes are stopped by their pids as
    the session ends."""
    FORK_SERVER.stop()
    ZYGOTES.stop()
