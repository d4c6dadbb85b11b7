"""A local PostgreSQL for development and tests: Debian's `initdb` and `postgres` (from PATH, or
/usr/lib/postgresql/*/bin), a cluster in a directory, listening on 127.0.0.1 only (or one other
address the caller owns, such as the fault harness's bridge), with trusted local connections. As
root, the server runs as the `postgres` user (it refuses to run as root), through `setpriv`,
which execs it: the pid its caller holds is the server's, to stop by pid."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = [
    "PostgresNotFound",
    "init_cluster",
    "postgres_binary",
    "postgres_command",
    "postgres_dsn",
    "wait_postgres_ready",
]


class PostgresNotFound(RuntimeError):
    """PostgreSQL's server programs are not installed."""


def postgres_binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        raise PostgresNotFound(
            f"PostgreSQL's {name} is not on PATH nor in /usr/lib/postgresql: install Debian's "
            "postgresql package"
        )
    return found


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


def init_cluster(root: Path) -> None:
    """Make `root/data` a database cluster (unless it is one already) and `root/sockets` its
    socket directory, owned by the server's user."""
    data, sockets = root / "data", root / "sockets"
    for directory in (root, sockets):
        directory.mkdir(parents=True, exist_ok=True)
    fresh = not (data / "PG_VERSION").exists()
    data.mkdir(mode=0o700, exist_ok=True)
    if os.geteuid() == 0:
        for directory in (root, data, sockets):
            shutil.chown(directory, "postgres", "postgres")
    if fresh:
        done = subprocess.run(
            [*_as_server_user(), postgres_binary("initdb"), "-D", str(data), "-U", "postgres",
             "--auth=trust", "--no-instructions", "-E", "UTF8"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"initdb of {data} failed: {last}")


def postgres_command(root: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        *_as_server_user(), postgres_binary("postgres"), "-D", str(root / "data"),
        "-p", str(port), "-h", host, "-k", str(root / "sockets"), "-c", "fsync=on",
    ]  # fmt: skip


def postgres_dsn(port: int, host: str = "127.0.0.1") -> str:
    return f"postgresql://postgres@{host}:{port}/postgres"


def wait_postgres_ready(
    proc: subprocess.Popen[bytes],
    root: Path,
    port: int,
    log: Path,
    timeout: float = 30.0,
    host: str = "127.0.0.1",
) -> None:
    deadline = time.monotonic() + timeout
    while not (root / "data" / "postmaster.pid").exists() or not _accepts_logins(port, host):
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise RuntimeError(f"postgres exited with status {proc.returncode}: {lines[-1]}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"postgres did not accept connections on port {port} in {timeout:g}s"
            )
        time.sleep(0.05)


def _accepts_logins(port: int, host: str = "127.0.0.1") -> bool:
    """Whether the server takes logins: it listens on its port before that, while it starts
    up (and refuses them: "the database system is starting up"), so a connected socket is not
    enough; pg_isready tells the two apart."""
    with socket.socket() as s:
        s.settimeout(0.2)
        if s.connect_ex((host, port)) != 0:
            return False
    check = [postgres_binary("pg_isready"), "-q", "-h", host, "-p", str(port), "-t", "2"]
    return subprocess.run([*check, "-U", "postgres", "-d", "postgres"], check=False).returncode == 0
