"""Fault campaign finding 6: a journal stalled for 15-30 s through a series of fragment store
outages. Appends to a replica wait for its first listing of the stores, and what is persisted
waits for the store: once an outage ends, both must go on within seconds, however long the
outage (or the series of them) was."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest

from broker.client.appender import append
from broker.fragment.persister import Persister
from broker.fragment.stores import StoreError
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, free_port
from tests.helpers.journals import journal_spec, set_journal, started_brokers
from tests.helpers.store_servers import create_gcs_bucket, fake_gcs_binary
from tests.helpers.waiting import until, until_blocking


class PrivateGCS:
    """A fake-gcs-server of this test's own on its filesystem backend, so that it can be killed
    and started again on the same port with its buckets and objects (as the campaign does)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(fake_gcs_binary()),
                "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(self.root),
                "-host", "127.0.0.1", "-port", str(self.port),
                "-external-url", self.endpoint, "-log-level", "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proc = self.proc

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1):
                    return True
            except OSError:
                assert proc.poll() is None, "fake-gcs-server exited"
                return False

        until_blocking(answers, "fake-gcs-server started", 20, 0.05)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def create_bucket(self) -> str:
        return create_gcs_bucket()  # Through STORAGE_EMULATOR_HOST, which the fixture sets.


@pytest.fixture
def gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PrivateGCS]:
    server = PrivateGCS(tmp_path / "gcs")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    try:
        yield server
    finally:
        server.kill()


def stub(harness):  # type: ignore[no-untyped-def]
    return harness.broker.service.dialer.journal_stub(harness.endpoint)


async def test_appends_resume_soon_after_a_gcs_outage_that_held_the_first_listing(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, gcs: PrivateGCS
) -> None:
    """The replica starts while fake GCS is down: its first listing cannot complete, and
    appends wait for it. Once GCS is back, an append goes through within seconds. (The GCS
    client retries a failed call within itself, backing off up to a minute for two minutes: a
    listing begun in the outage must not be what the appends wait for.)"""
    bucket = gcs.create_bucket()
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ["store-0"]) as brokers:
        gcs.kill()
        spec = journal_spec("outage/gcs", replication=1)
        spec.fragment.stores.append(f"gs://{bucket}/fragments/")
        await set_journal(etcd, etcd_prefix, spec, [("local", "store-0")])
        await asyncio.sleep(10.0)  # The outage's length, the first listing held through it.

        await asyncio.to_thread(gcs.start)
        back = time.monotonic()
        response = await append(stub(brokers[0]), "outage/gcs", b"after the outage\n")
        waited = time.monotonic() - back
        assert response.status == pb.OK
        assert waited < 3.0, f"the append waited {waited:.1f}s after the store came back"


async def test_appends_resume_soon_after_a_store_outage_that_failed_the_first_listings(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store whose listings fail at once (an error answered, not a hang) while the replica
    starts: the listing is retried, and once the store answers again an append goes through
    within a couple of seconds, not after a backoff grown meanwhile."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    down = True
    listing = Persister.list_blocking

    def list_unless_down(
        self: Persister, journal: str, spec: pb.JournalSpec, guards: Any = None
    ) -> list[pb.Fragment]:
        if down:
            raise StoreError("list: the store is unavailable (test)")
        return listing(self, journal, spec, guards)

    monkeypatch.setattr(Persister, "list_blocking", list_unless_down)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["store-0"], file_root=str(root)
    ) as brokers:
        spec = journal_spec("outage/file", replication=1)
        spec.fragment.stores.append("file:///fragments/")
        await set_journal(etcd, etcd_prefix, spec, [("local", "store-0")])
        await asyncio.sleep(6.0)  # The outage's length: listings fail, retried, meanwhile.

        down = False
        back = time.monotonic()
        response = await append(stub(brokers[0]), "outage/file", b"after the outage\n")
        waited = time.monotonic() - back
        assert response.status == pb.OK
        assert waited < 2.0, f"the append waited {waited:.1f}s after the store came back"


async def test_a_fragment_is_persisted_soon_after_a_long_store_outage(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, tmp_path: Path
) -> None:
    """A completed fragment's persist fails through a 13 s outage of its (file) store: once the
    store is back, it is persisted within seconds, not after a retry delay grown to a minute."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["store-0"], file_root=str(root)
    ) as brokers:
        journal = "outage/persist"
        spec = journal_spec(journal, replication=1, length=16)
        spec.fragment.stores.append("file:///fragments/")
        spec.fragment.refresh_interval.seconds = 1
        await set_journal(etcd, etcd_prefix, spec, [("local", "store-0")])
        await append(stub(brokers[0]), journal, b"warm up\n")

        (root / "fragments").rename(root / "away")
        await append(stub(brokers[0]), journal, b"over the fragment's length\n")
        await append(stub(brokers[0]), journal, b"")  # Rolls it: the primary persists at once.
        await asyncio.sleep(13.0)  # The outage's length: the persist's retries back off.
        listed = await stub(brokers[0]).ListFragments(pb.FragmentsRequest(journal=journal))
        # (The warm-up's fragment may have been rolled and persisted before the outage.)
        assert not any(f.spec.backing_store for f in listed.fragments if f.spec.end == 35)

        (root / "away").rename(root / "fragments")

        async def persisted() -> bool:
            listed = await stub(brokers[0]).ListFragments(pb.FragmentsRequest(journal=journal))
            return any(f.spec.backing_store and f.spec.end == 35 for f in listed.fragments)

        await until(persisted, "persisted within 6 s of the store's return", 6.0, 0.1)


def test_a_put_never_makes_the_store_directory_that_vanished_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's own directory goes away (a volume unmounted) between a put's check that it
    exists and its making of the fragment's directories: the put fails, as if it had gone
    before, and does not make the store directory again (a later put would then persist to the
    empty mount point, and an outage would end at once)."""
    from broker.fragment.stores import open_store

    root = tmp_path / "root"
    base = root / "fragments"
    base.mkdir(parents=True)
    store = open_store("file:///fragments/", file_root=root)
    checked = Path.is_dir

    def unmounted_after_the_check(self: Path) -> bool:
        exists = checked(self)
        if self == base and exists:
            base.rename(root / "away")
        return exists

    monkeypatch.setattr(Path, "is_dir", unmounted_after_the_check)
    with pytest.raises(StoreError, match="does not exist"):
        store.put("a/journal/0000000000000000-0000000000000008-0.raw", io.BytesIO(b"x" * 8), 8)
    assert not base.exists(), "the put made the store directory again"
