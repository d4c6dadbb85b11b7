"""Developer sessions: tests, fuzz, docs, lint, typecheck, demo, bench, faults, modelcheck, proto.

Every session installs what it needs from the project's own files, so a fresh machine needs only
`python3 -m pip install nox` (and `uv`, which makes the virtualenvs faster).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
# uv makes virtualenvs and installs in about half pip's time (a fresh clone's `nox -s tests`
# spends 45 s installing with pip); without uv, nox falls back to virtualenv and pip.
nox.options.default_venv_backend = "uv|virtualenv"
# These machines set PYTHONDONTWRITEBYTECODE, and uv does not compile bytecode as it installs
# (pip does): every process the sessions start (hundreds of gazctl, broker, consumer and location
# processes in `nox -s tests`) would compile every module it imports, every time. Writing each
# module's bytecode the first time it is imported costs only what is used; compiling the whole
# virtualenv as uv installs it (UV_COMPILE_BYTECODE: 10,500 files, pyspark's among them) cost
# some 23 s of CPU on every fresh clone, most of it for modules no test imports.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

PYTHON = "3.11"


def _install(session: nox.Session, *args: str) -> None:
    """`session.install`, from uv's cache alone when it holds everything needed (`--offline`),
    else as usual. PyPI publishes pyspark as a source distribution only (450 MB): uv builds a
    wheel of it for every fresh virtualenv whose index answer it cannot revalidate, as behind
    these machines' proxy, where that cost 17 of a fresh clone's 28 s of install."""
    uv = shutil.which("uv")
    if uv and session.venv_backend == "uv" and session.virtualenv.location:
        env = {**os.environ, "VIRTUAL_ENV": session.virtualenv.location}
        offline = subprocess.run(
            [uv, "pip", "install", "--offline", "--quiet", *args],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if offline.returncode == 0:
            session.log(f"installed {' '.join(args)} from uv's cache")
            return
    session.install(*args)


PROTOS = [
    "broker/protocol/protocol.proto",
    "broker/protocol/recorded_op.proto",
    "broker/protocol/consumer.proto",
    "consumer/examples/word_count.proto",
    "replication/location.proto",
]
# Generated code is produced with this grpcio-tools release: its gencode (protobuf 5.27.2) runs on
# every protobuf runtime from 5.27.2 on, which is the floor aetcd needs anyway.
GRPCIO_TOOLS_FOR_GENERATION = "grpcio-tools==1.66.2"


# Workers for the parallel part of `nox -s tests`: most tests wait on leases, processes and etcd
# rather than compute, so more workers than this machine's two cores pay (measurements in
# docs/architecture.md, "Testing"). GAZETTE_TEST_WORKERS overrides it.
TEST_WORKERS = os.environ.get("GAZETTE_TEST_WORKERS", "6")


def _chooses_workers(args: list[str]) -> bool:
    return any(
        a in ("-n", "--numprocesses") or a.startswith(("-n", "--numprocesses=")) for a in args
    )


def _split_marker(args: list[str]) -> tuple[list[str], str]:
    """`args` without a `-m EXPR`, and EXPR ("" if none), so each part can add its own."""
    rest, expression = [], ""
    it = iter(args)
    for a in it:
        if a == "-m":
            expression = next(it, "")
        elif a.startswith("-m") and not a.startswith("--"):
            expression = a[2:]
        else:
            rest.append(a)
    return rest, expression


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite against real etcd, real gRPC servers and real subprocesses: the tests
    that share the machine in parallel (pytest-xdist), then the `serial` ones alone.
    `nox -s tests -- -n 0` runs everything serially in one process (for debugging); other
    arguments go to pytest in both parts. Benchmarks' quick runs (marked `bench`) and the fault
    scenarios' short runs that `nox -s faults` covers (marked `faults`) are left out unless `-m`
    selects them."""
    _install(session, "-e", ".[test]")
    args = session.posargs or ["-q"]
    rest, expression = _split_marker(args)
    # Unless a marker expression is given: the quick runs of benchmarks marked `bench` are left
    # to `nox -s bench -- --quick`, which runs every benchmark so, and the short fault scenarios
    # marked `faults` to `nox -s faults`, which runs them whole (`-- -m bench` runs them here).
    expression = expression or "not bench and not faults"
    if _chooses_workers(args):
        session.run("pytest", "-m", expression, *rest)
        return
    chosen = f"({expression}) and "
    # pytest rewrites the asserts of every test module (and of the plugins' modules) as it
    # imports them, and caches the result; on a fresh clone each worker would rewrite all of
    # them at once, 11 s of CPU apiece. One collection first fills the cache for them all.
    session.run(
        "pytest", "--collect-only", "-q", "-p", "no:xdist", "-m", f"{chosen}not serial", *rest,
        silent=True, success_codes=[0, 5],
    )  # fmt: skip
    parallel = ["-n", TEST_WORKERS, "--dist", "loadgroup", "-m", f"{chosen}not serial"]
    session.run("pytest", *parallel, *rest, success_codes=[0, 5])
    # Exit code 5: nothing selected in that part (arguments that name only serial tests, or none).
    if not _marks_serial_tests():
        session.log("no test is marked serial: the serial part is skipped")
        return
    # The serial tests ran beside the parallel part for a while (2026-11-29), at a higher
    # priority (the parallel part under `nice -n 19`): that starved the parallel part's own Spark
    # tests as they started, and a Spark Python worker has 10 s to connect back to its JVM (it
    # failed so in two runs of five). They run after it again.
    session.run("pytest", "-p", "no:xdist", "-m", f"{chosen}serial", *rest, success_codes=[0, 5])


def _marks_serial_tests() -> bool:
    """Whether any test module marks tests `serial` (collecting the suite to find none costs
    a run several seconds)."""
    return any("mark.serial" in p.read_text() for p in Path("tests").rglob("*.py"))


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """Fuzzed inputs against one live broker (tests/test_fuzz.py, at length): 10,500 RPC inputs
    (GAZETTE_FUZZ_INPUTS), store and gazctl inputs; prints the counts per RPC and outcome."""
    _install(session, "-e", ".[test]")
    inputs = os.environ.get("GAZETTE_FUZZ_INPUTS", "10500")
    session.run(
        "pytest", "tests/test_fuzz.py", "-s", "-q", "-rxX", *session.posargs,
        env={"GAZETTE_FUZZ_INPUTS": inputs},
    )  # fmt: skip


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs.yml: the guides and the API reference generated
    from docstrings) strict, warnings as errors, into site/ (or the folder given after --)."""
    _install(session, "-e", ".[docs]")
    out = session.posargs[0] if session.posargs else "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", out)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    _install(session, "-e", ".[dev]")
    session.run("mypy")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Start a local cluster, apply the example journal tree, list it, and stop the cluster."""
    _install(session, "-e", ".[test]")
    session.run("python", "docs/examples/demo.py")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks, each reporting a same-run baseline beside its figure."""
    _install(session, "-e", ".[test]")
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session(python=PYTHON)
def faults(session: nox.Session) -> None:
    """The fault campaign: etcd, a store and five brokers under faults, a recorded workload and
    a history checker; then replication networks, and stream-sum's consumers on each store
    (`-- --consumers` for those alone; `-- --spark-stream` runs the Spark Structured Streaming
    scenario five times); prints each scenario's seed and the results tables
    (docs/reliability.md).
    As root it adds partitions (network namespaces) and full disks (tmpfs). Arguments go to
    `python -m tests.faults` (for example `-- --scenario sigstop --seed 1234` to replay)."""
    _install(session, "-e", ".[test]")
    session.run("python", "-m", "tests.faults", *session.posargs)


# The bounds `nox -s modelcheck` explores when given no arguments, each a run of its own (about
# five minutes in all on this 2-core machine when idle; figures in docs/reliability.md).
MODELCHECK_BOUNDS = [
    [],  # The module's default bound: 4 locations, 2 events, 1 filter, 2 topology changes.
    ["--locations", "4", "--events", "2", "--filters", "2", "--changes", "1", "--deletions", "1"],
    ["--locations", "3", "--events", "2", "--filters", "1", "--changes", "2", "--fail-over",
     "--topology", "ring-in"],
]  # fmt: skip


# The bounds of the operator commands' check over partial views (replication/modelcheck_commands
# .py), each run on the old protocol, which must find issue 38's defects (exit 1), and on the new
# one, which must find none (about nine CPU-minutes in all, 1.2 GB at most; figures in
# docs/reliability.md).
MODELCHECK_COMMANDS_BOUNDS = [
    ["--start", "issue7", "--locations", "4", "--commands", "2", "--stops", "1", "--deaths", "1"],
    ["--locations", "3", "--commands", "2", "--operators", "2", "--stops", "1", "--deaths", "1",
     "--new-events-only"],
]  # fmt: skip


@nox.session(python=PYTHON)
def modelcheck(session: nox.Session) -> None:
    """The bounded exhaustive check of the replication rules and the causality filter
    (`replication/modelcheck.py`): every interleaving of emits, replication steps (with crashes
    between a write and its progress), topology changes, deletions and fail-overs up to a bound;
    prints the states explored, transitions, depth, seconds and violations of each bound.
    Arguments replace the bounds (for example `-- --locations 3 --events 3 --changes 3`, or
    `-- --without guard` to see the anomaly a rule prevents). Then the check of operator
    commands over partial views (`replication/modelcheck_commands.py`), the old protocol's
    counterexamples printed; `-- commands ARGS` runs that one alone with ARGS (for example
    `-- commands --protocol old --start issue7 --locations 4`)."""
    _install(session, "-e", ".[test]")
    if session.posargs[:1] == ["commands"]:
        session.run("python", "-m", "replication.modelcheck_commands", *session.posargs[1:])
        return
    for bound in [session.posargs] if session.posargs else MODELCHECK_BOUNDS:
        session.run("python", "-m", "replication.modelcheck", *bound)
    if session.posargs:
        return
    for bound in MODELCHECK_COMMANDS_BOUNDS:
        for protocol, found in (("old", 1), ("new", 0)):
            args = ["--protocol", protocol, *bound]
            session.run("python", "-m", "replication.modelcheck_commands", *args,
                        success_codes=[found])  # fmt: skip


@nox.session(python=PYTHON)
def proto(session: nox.Session) -> None:
    """Regenerate the Python protobuf and gRPC code from the .proto files (PROTOS)."""
    session.install(GRPCIO_TOOLS_FOR_GENERATION)
    session.run(
        "python", "-m", "grpc_tools.protoc", "-I", ".",
        "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", *PROTOS,
    )  # fmt: skip
