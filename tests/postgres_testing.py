"""A real PostgreSQL for tests (a pytest plugin, registered in conftest): Debian's `initdb` and
`postgres` (from PATH, or /usr/lib/postgresql/*/bin), a cluster in a temporary directory,
listening on 127.0.0.1 only, trusted local connections, and stopped by its pid at the end. As root,
the server runs as the `postgres` user (it refuses to run as root), through `setpriv`, which
execs it: the pid we hold is the server's."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.testing import free_port, stop_process


def postgres_binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        raise RuntimeError(
            f"PostgreSQL's {name} is not on PATH nor in /usr/lib/postgresql: install Debian's "
            "postgresql package"
        )
    return found


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="gazette-pg-"))
    data, sockets = root / "data", root / "sockets"
    data.mkdir()
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        shutil.chown(data, "postgres", "postgres")
        shutil.chown(sockets, "postgres", "postgres")
    subprocess.run(
        [*_as_server_user(), postgres_binary("initdb"), "-D", str(data), "-U", "postgres",
         "--auth=trust", "--no-instructions", "-E", "UTF8"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    log = (root / "postgres.log").open("wb")
    proc = subprocess.Popen(
        [*_as_server_user(), postgres_binary("postgres"), "-D", str(data), "-p", str(port),
         "-h", "127.0.0.1", "-k", str(sockets), "-c", "fsync=on"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (data / "postmaster.pid").exists() or not _accepts(port):
            if proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {(root / 'postgres.log').read_text()}")
            assert time.monotonic() < deadline, "postgres did not start"
            time.sleep(0.05)
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        stop_process(proc)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
