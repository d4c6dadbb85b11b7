"""The layers of the code, checked on its imports: production code never imports the test
harness; the fragment layer knows nothing of replicas, resolvers or pipelines; the handlers
and the append FSM never import the service (they get a BrokerContext); the client library
imports nothing of the broker server; consumers build on the broker's public parts only."""

from __future__ import annotations

import ast
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


# The test kit: a harness of brokers (broker.testing), of consumers (consumer.testing, which
# builds on the brokers' and is the pytest plugin) and a standalone Spark cluster
# (gazctl/spark/testing.py).
TEST_KITS = ("broker/testing", "consumer/testing", "gazctl/spark/testing.py")


def test_production_code_never_imports_the_test_harness() -> None:
    files = [
        p
        for p in python_files("broker", "consumer", "spec", "gazctl")
        if not any(kit in p.as_posix() for kit in TEST_KITS)
    ]
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
    assert offenders(python_files("broker/client", "broker/message"), forbidden) == []


# What consumers may use of `broker`: its client library, protocol, keyspace mirror, allocator,
# messages, the small shared helpers (retries, task ownership, etcd connection settings,
# command-line options bound to environment variables), and what every process serves or
# verifies alike (TLS, authorization, metrics, logs, the HTTP port).
CONSUMER_MAY_USE = (
    "broker.client",
    "broker.protocol",
    "broker.keyspace",
    "broker.allocator",
    "broker.message",
    "broker.retry",
    "broker.tasks",
    "broker.etcd",
    "broker.config",
    "broker.tls",
    "broker.auth",
    "broker.metrics",
    "broker.logs",
    "broker.http",
)


@pytest.mark.parametrize("package", ["consumer", "replication"])
def test_consumers_build_on_the_public_parts_of_the_broker(package: str) -> None:
    """Consumers, and the replication networks built on them, use the broker's public parts."""
    found = []
    for path in python_files(package):
        for module in sorted(imports_of(path)):
            # (`from broker import etcd` records both `broker` and `broker.etcd`: the latter
            # is the one to judge.)
            allowed = CONSUMER_MAY_USE
            if "consumer/testing" in path.as_posix():
                allowed += ("broker.testing",)  # The consumers' test kit builds on the brokers'.
            if module.startswith("broker.") and not module.startswith(allowed):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    assert python_files(package), f"no {package} package"
    assert found == []
