"""A real PostgreSQL for tests (a pytest plugin, registered in conftest): a cluster in a
temporary directory on 127.0.0.1 (`consumer.local_postgres`), stopped by its pid at the end."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.testing import free_port, stop_process
from consumer import local_postgres


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="gazette-pg-"))
    local_postgres.init_cluster(root)
    port = free_port()
    log_path = root / "postgres.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            local_postgres.postgres_command(root, port), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        local_postgres.wait_postgres_ready(proc, root, port, log_path)
        yield local_postgres.postgres_dsn(port)
    finally:
        stop_process(proc)
        shutil.rmtree(root, ignore_errors=True)
