"""The layers of the code, checked on its imports: production code never imports the test
harness; the fragment layer knows nothing of replicas, resolvers or pipelines; the handlers
and the append FSM never import the service (they get a BrokerContext); the client library
imports nothing of the broker server; consumers build on the broker's public parts only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any level (TYPE_CHECKING blocks included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in files:
        for module in sorted(imports_of(path)):
            if module.startswith(forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


# The product's packages (what the wheel ships).
PRODUCT = (
    "broker", "allocator", "keyspace", "message", "plumbing", "consumer", "spec", "gazctl",
    "replication",
)  # fmt: skip


# The test kit: a harness of brokers (broker.testing), of consumers (consumer.testing, which
# builds on the brokers' and is the pytest plugin) and a standalone Spark cluster
# (gazctl/spark/testing.py).
TEST_KITS = ("broker/testing", "consumer/testing", "gazctl/spark/testing.py")


def test_production_code_never_imports_the_test_harness() -> None:
    files = [p for p in python_files(*PRODUCT) if not any(kit in p.as_posix() for kit in TEST_KITS)]
    assert files and offenders(files, ("broker.testing", "consumer.testing", "tests")) == []


def test_the_fragment_layer_knows_nothing_of_replicas() -> None:
    forbidden = (
        "broker.replica",
        "broker.resolver",
        "broker.pipeline",
        "broker.service",
        "broker.server",
        "broker.append_fsm",
    )
    assert offenders(python_files("broker/fragment"), forbidden) == []


def test_handlers_depend_on_the_context_not_the_service() -> None:
    files = [
        ROOT / "broker" / name
        for name in (
            "append_api.py",
            "append_fsm.py",
            "read_api.py",
            "replicate_api.py",
            "fragments_api.py",
            "pipeline.py",
        )
    ]
    assert offenders(files, ("broker.service", "broker.server")) == []


def test_the_client_library_imports_nothing_of_the_broker_server() -> None:
    forbidden = (
        "broker.service",
        "broker.server",
        "broker.replica",
        "broker.resolver",
        "broker.pipeline",
        "broker.append_fsm",
        "broker.context",
    )
    assert offenders(python_files("broker/client", "message"), forbidden) == []


# The packages brokers, consumers and locations share sit at the top, as upstream's do
# (`allocator/`, `keyspace/`, `message/`), beneath the processes that use them: what each may
# import of the product, beyond itself.
SHARED_PACKAGES = {
    "keyspace": ("plumbing",),
    "allocator": ("keyspace", "plumbing", "broker.protocol"),
    "message": ("keyspace", "plumbing", "broker.protocol", "broker.client"),
}


@pytest.mark.parametrize("package", sorted(SHARED_PACKAGES))
def test_the_shared_packages_sit_beneath_the_processes(package: str) -> None:
    allowed = (package, *SHARED_PACKAGES[package])
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in python_files(package)
        for module in sorted(imports_of(path))
        if module.split(".")[0] in PRODUCT
        and not any(module == a or module.startswith(a + ".") for a in allowed)
        # (`from broker import client` records `broker` too: the dotted name is the one judged.)
        and module != "broker"
    ]
    assert python_files(package) and found == []


def test_the_broker_holds_none_of_the_shared_packages() -> None:
    assert [n for n in ("allocator", "message") if (ROOT / "broker" / n).exists()] == []
    text = (ROOT / "broker" / "keyspace.py").read_text()
    assert "class KeySpace" not in text, "the keyspace mirror is the top-level keyspace package"


# What consumers may use of `broker`: its client library and protocol (the keyspace mirror, the
# allocator and messages are packages of their own). What every process shares (flags, the etcd
# connection, backoff, task ownership and membership, metrics, logs, TLS, tokens, the HTTP port)
# is plumbing's, open to all.
CONSUMER_MAY_USE = ("broker.client", "broker.protocol")


@pytest.mark.parametrize("package", ["consumer", "replication"])
def test_consumers_build_on_the_public_parts_of_the_broker(package: str) -> None:
    """Consumers, and the replication networks built on them, use the broker's public parts."""
    found = []
    for path in python_files(package):
        for module in sorted(imports_of(path)):
            # (`from broker import client` records both `broker` and `broker.client`: the
            # latter is the one to judge.)
            allowed = CONSUMER_MAY_USE
            if "consumer/testing" in path.as_posix():
                allowed += ("broker.testing",)  # The consumers' test kit builds on the brokers'.
            if module.startswith("broker.") and not module.startswith(allowed):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    assert python_files(package), f"no {package} package"
    assert found == []


def test_plumbing_is_beneath_every_process() -> None:
    """The package every process shares knows none of them: of the broker it uses only the
    protocol (tokens carry label selectors)."""
    found = [
        line
        for line in offenders(
            python_files("plumbing"), (*(p for p in PRODUCT if p != "plumbing"), "tests")
        )
        if not line.split(" imports ")[1].startswith("broker.protocol")
    ]
    assert python_files("plumbing") and found == []


# The broker's root holds the broker alone: what brokers, consumers and locations all use lives
# in plumbing.
SHARED_MODULES = (
    "config", "etcd", "local_etcd", "backoff", "retry", "tasks", "metrics", "logs", "tls",
    "auth", "processes", "http", "debug_http",
)  # fmt: skip


def test_the_brokers_root_holds_the_broker_alone() -> None:
    assert sorted(n for n in SHARED_MODULES if (ROOT / "broker" / f"{n}.py").exists()) == []
    assert all(
        (ROOT / "plumbing" / f"{n}.py").exists()
        for n in SHARED_MODULES
        if n not in ("retry", "http")
    )


def test_one_helper_waits_for_the_first_of_several_awaitables() -> None:
    """ "The first of these" is plumbing.tasks.first_of (or wait_any, on events): the bare
    asyncio pattern, whose helper tasks each caller had to cancel and await, lives only there."""
    found = [
        str(path.relative_to(ROOT))
        for path in python_files(*PRODUCT)
        if "FIRST_COMPLETED" in path.read_text() and path != ROOT / "plumbing" / "tasks.py"
    ]
    assert found == []


GLOBAL_RANDOM = {
    "random", "uniform", "randrange", "randint", "choice", "choices", "shuffle", "sample",
    "getrandbits", "gauss", "seed", "setstate", "randbytes", "expovariate", "triangular",
}  # fmt: skip


def test_production_code_draws_from_its_own_random_never_the_global_one() -> None:
    """A jitter or a port drawn from the module-level `random` moves the state every other
    user of it shares: an application that seeds it for a replay, and Hypothesis, which fails
    a property test when that state moves under its draw (seen: a broker's pulse, in a thread
    of the same test worker, failed `test_merge_is_the_least_upper_bound`). Tests that seed it
    on one worker also made another worker's `free_port` draw the same ports."""
    found = []
    for path in python_files(*PRODUCT):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "random"
                and node.func.attr in GLOBAL_RANDOM
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} random.{node.func.attr}")
    assert not found, found


def loaded_by(imported: tuple[str, ...], watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter has loaded once it imported `imported`."""
    probe = (
        f"import sys, {', '.join(imported)}\n"
        f"print(' '.join(sorted(m for m in {watched!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_client_library_loads_no_server_machinery() -> None:
    """Every `gazctl` run imports the client: the spool's metrics (the Prometheus client) and
    the brokers' HTTP server (aiohttp) would cost each one ~0.1 s of CPU for nothing."""
    loaded = loaded_by(
        ("broker.client", "broker.client.reader", "gazctl.cli"),
        ("prometheus_client", "aiohttp", "broker.fragment.spool"),
    )
    assert loaded == []


def test_a_server_with_no_http_port_imports_no_http_stack() -> None:
    """Brokers, consumers and locations import aiohttp only to serve an HTTP port, which is off
    unless a flag asks for one: it cost every start 0.2 s of CPU (the suite starts hundreds)."""
    loaded = loaded_by(
        ("broker.main", "consumer.__main__", "replication.__main__"),
        ("aiohttp", "broker.gateway", "plumbing.debug_http"),
    )
    assert loaded == []


def test_gazctl_commands_share_options_through_their_own_module() -> None:
    """The options and helpers gazctl's command groups share live in gazctl/options.py (and the
    edit loop in gazctl/editor.py): of a group's module, another takes only the group, to add
    commands to it (`journals fragments`, `journals read`, ...)."""
    groups = {"gazctl.journals": "journals", "gazctl.shards": "shards"}
    found = []
    for path in python_files("gazctl"):
        for module in sorted(imports_of(path)):
            owner, _, name = module.rpartition(".")
            if owner in groups and name != groups[owner]:
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    assert found == []


def test_gazctl_commands_share_fragment_operations_through_their_own_module() -> None:
    """One gazctl module takes no private name of another: what several commands share (the
    fragment listing and removal that `journals prune`, `shards prune` and `replication delete`
    use) lives in a module of its own, gazctl/fragment_ops.py, not in one command's module."""
    found = []
    for path in python_files("gazctl"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gazctl"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    found.append(f"{path.relative_to(ROOT)} imports {private} of {node.module}")
    assert found == []


# gazctl/dev/, each module on those before it.
DEV_MODULES = ("state", "security", "ports", "supervisor", "processes", "cluster", "cli")


def test_gazctl_dev_modules_build_on_those_before_them() -> None:
    found = []
    for i, name in enumerate(DEV_MODULES):
        later = tuple(f"gazctl.dev.{m}" for m in DEV_MODULES[i:])
        found += offenders([ROOT / "gazctl" / "dev" / f"{name}.py"], later)
    assert sorted(p.stem for p in (ROOT / "gazctl" / "dev").glob("*.py")) == sorted(
        ("__init__", *DEV_MODULES)
    )
    assert found == []


# ---- the tests' own layers ---------------------------------------------------------------------


def test_test_modules_import_helpers_never_one_another() -> None:
    """What tests share lives in tests/helpers/ (or conftest): a test module's helpers imported
    by another made it a library of the other, whose fixtures registered in the importer and
    whose helpers moved with its tests. The test kit (shipped) imports nothing of tests/."""
    found = offenders(python_files("tests", "benchmarks"), ("tests.test_",))
    for path in python_files("tests", "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level
                and (
                    (node.module or "").startswith("test_")
                    or any(alias.name.startswith("test_") for alias in node.names)
                )
            ):
                found.append(f"{path.relative_to(ROOT)} imports .{node.module or ''}")
    assert found == []
    kits = [
        p for kit in TEST_KITS for p in ([ROOT / kit] if kit.endswith(".py") else python_files(kit))
    ]
    assert kits and offenders(kits, ("tests",)) == []


# The names a generic wait goes by; tests/helpers/waiting.py defines the one there is.
GENERIC_WAIT = re.compile(r"_*(?:wait_until|until|until_blocking|eventually|wait_for)")


def test_the_tests_wait_with_one_until() -> None:
    """A test waits for a state with tests.helpers.waiting.until (until_blocking where no event
    loop runs): copies drifted apart in their bounds, polls and failure messages."""
    waiting = ROOT / "tests" / "helpers" / "waiting.py"
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} defines {node.name}"
        for path in python_files("tests")
        if path != waiting
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and GENERIC_WAIT.fullmatch(node.name)
    ]
    assert found == []
    defined = {n.name for n in ast.parse(waiting.read_text()).body if hasattr(n, "name")}
    assert {"until", "until_blocking"} <= defined
