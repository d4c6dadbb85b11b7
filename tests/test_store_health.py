"""Issue 38, "Also" (first item): appends to a journal whose fragment store cannot take fragments
are refused with FRAGMENT_STORE_UNHEALTHY, naming the store and why, until the store recovers,
as upstream's store health checks do; and nothing acknowledged is lost meanwhile.

Over the wire, on real brokers (in this process, with real stores: a file:// directory, and the
GCS and S3 emulators of tests/helpers/store_servers.py), and `gazctl journals append` as a user runs it.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from pathlib import Path

import aetcd
import pytest

from broker.client.appender import AppendError, append
from broker.client.reader import read
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness, EtcdServer
from tests.conftest import run_cli
from tests.helpers.journals import journal_spec, set_journal, started_brokers
from tests.helpers.store_servers import GCSServer, S3Server, unique_bucket
from tests.helpers.waiting import until


def stub(harness: BrokerHarness):  # type: ignore[no-untyped-def]
    return harness.broker.service.dialer.journal_stub(harness.endpoint)


async def read_committed(harness: BrokerHarness, journal: str) -> bytes:
    """Every committed byte of `journal`, read without blocking."""
    out = b""
    async for chunk in read(stub(harness), journal, 0, block=False):
        out += chunk.content
    return out


async def persisted_through(harness: BrokerHarness, journal: str, end: int) -> list[pb.Fragment]:
    """Wait (up to 30 s) until persisted fragments cover [0, end); returns them."""
    persisted: list[pb.Fragment] = []

    async def covered() -> bool:
        nonlocal persisted
        response = await stub(harness).ListFragments(pb.FragmentsRequest(journal=journal))
        persisted = [f.spec for f in response.fragments if f.spec.backing_store]
        through = 0
        for fragment in sorted(persisted, key=lambda f: f.begin):
            if fragment.begin <= through:
                through = max(through, fragment.end)
        return through >= end

    await until(covered, f"{journal} persisted through {end}", timeout=30, interval=0.1)
    return persisted


def create_bucket(server: GCSServer | S3Server, name: str) -> None:
    """Bucket `name` on the emulator (the fixtures' own helper makes one of its naming)."""
    if isinstance(server, S3Server):
        client = server.client()
        try:
            client.create_bucket(Bucket=name)  # type: ignore[attr-defined]
        finally:
            client.close()  # type: ignore[attr-defined]
        return
    from google.auth.credentials import AnonymousCredentials

    from broker.fragment.stores.gcs import storage

    gcs = storage.Client(project="test-project", credentials=AnonymousCredentials())
    try:
        gcs.create_bucket(name)
    finally:
        gcs.close()


async def test_an_append_to_a_missing_store_directory_is_refused_until_it_is_created(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, tmp_path: Path
) -> None:
    """A journal whose file:// store directory does not exist: its appends are refused with
    FRAGMENT_STORE_UNHEALTHY naming the store and the missing directory, and nothing lands.
    Once the operator creates the directory, appends go through (no restart) and persist."""
    root = tmp_path / "root"
    root.mkdir()
    journal = "health/missing-dir"
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["health-0"], file_root=str(root)
    ) as brokers:
        spec = journal_spec(journal, replication=1)
        spec.fragment.stores.append("file:///missing/")
        spec.fragment.refresh_interval.seconds = 1
        await set_journal(etcd, etcd_prefix, spec, [("local", "health-0")])

        with pytest.raises(AppendError) as refused:
            await append(stub(brokers[0]), journal, b"into the void\n")
        assert refused.value.status == pb.FRAGMENT_STORE_UNHEALTHY
        said = refused.value.response.store_health_error
        assert "file:///missing/" in said and "does not exist" in said, said
        assert await read_committed(brokers[0], journal) == b""

        (root / "missing").mkdir()
        response = await append(stub(brokers[0]), journal, b"once it exists\n")
        assert (response.commit.begin, response.commit.end) == (0, 15)
        # The next append rolls the journal's first write: the primary persists it at once.
        await append(stub(brokers[0]), journal, b"")
        persisted = await persisted_through(brokers[0], journal, 15)
        assert all(f.backing_store == "file:///missing/" for f in persisted)
        listed = open_store("file:///missing/", file_root=root).list_fragments(journal)
        assert [(f.begin, f.end) for f in listed] == [(0, 15)]
        assert await read_committed(brokers[0], journal) == b"once it exists\n"


async def test_a_store_that_fails_a_persist_refuses_appends_and_keeps_what_was_acknowledged(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, tmp_path: Path
) -> None:
    """The store directory goes away after appends were acknowledged. The persist that fails
    there makes the store unhealthy: further appends are refused (naming the store), while what
    was acknowledged waits in the spool. Once the directory is back, appends go on and every
    acknowledged byte is persisted, once."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    journal = "health/outage"
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["health-0"], file_root=str(root)
    ) as brokers:
        spec = journal_spec(journal, replication=1, length=16)
        spec.fragment.stores.append("file:///fragments/")
        spec.fragment.refresh_interval.seconds = 1
        await set_journal(etcd, etcd_prefix, spec, [("local", "health-0")])
        await append(stub(brokers[0]), journal, b"warm up\n")  # [0, 8)
        await append(stub(brokers[0]), journal, b"")  # Rolls the first write: persisted.
        await persisted_through(brokers[0], journal, 8)

        (root / "fragments").rename(root / "away")
        # The store was healthy when last checked: this one is taken, then its fragment (over
        # the spec's length) is rolled by the next append and the persist fails.
        await append(stub(brokers[0]), journal, b"acknowledged in the outage\n")  # [8, 35)
        await append(stub(brokers[0]), journal, b"")
        health = brokers[0].broker.service.persister.health
        await until(
            lambda: health.problem("file:///fragments/"),
            "the failed persist made the store unhealthy",
            timeout=30,
            interval=0.05,
        )

        with pytest.raises(AppendError) as refused:
            await append(stub(brokers[0]), journal, b"refused\n")
        assert refused.value.status == pb.FRAGMENT_STORE_UNHEALTHY
        said = refused.value.response.store_health_error
        assert "file:///fragments/" in said and "does not exist" in said, said

        (root / "away").rename(root / "fragments")
        response = await append(stub(brokers[0]), journal, b"after the outage, at last\n")
        assert (response.commit.begin, response.commit.end) == (35, 61)
        await append(stub(brokers[0]), journal, b"")  # Rolls [35, 61): all is persisted.
        await persisted_through(brokers[0], journal, 61)
        listed = open_store("file:///fragments/", file_root=root).list_fragments(journal)
        spans = [(f.begin, f.end) for f in listed]
        assert len(spans) == len(set(spans)), "no fragment is written twice"
        assert await read_committed(brokers[0], journal) == (
            b"warm up\nacknowledged in the outage\nafter the outage, at last\n"
        )


async def test_gazctl_append_to_an_unhealthy_store_says_which_store_and_why_in_one_line(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, tmp_path: Path
) -> None:
    """`gazctl journals append` as a user runs it: one line naming the journal, the store and
    what is wrong with it; exit 1; no traceback."""
    root = tmp_path / "root"
    root.mkdir()
    journal = "health/cli"
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["health-0"], file_root=str(root)
    ) as brokers:
        spec = journal_spec(journal, replication=1)
        spec.fragment.stores.append("file:///not/made/")
        await set_journal(etcd, etcd_prefix, spec, [("local", "health-0")])
        r = await asyncio.to_thread(
            run_cli,
            "gazctl", "journals", "append", "-l", f"name={journal}", "--wait", "1s",
            input="a line\n", env={"BROKER_ADDRESS": brokers[0].endpoint},
        )  # fmt: skip
        assert r.code == 1, (r.out, r.err)
        assert "Traceback" not in r.err
        lines = [line for line in r.err.splitlines() if line.strip()]
        assert len(lines) == 1, r.err
        for needle in (journal, "FRAGMENT_STORE_UNHEALTHY", "file:///not/made/", "does not exist"):
            assert needle in lines[0], r.err
        assert await read_committed(brokers[0], journal) == b""


@pytest.mark.parametrize("scheme", ["gs", "s3"])
async def test_an_append_to_a_missing_bucket_is_refused_until_the_bucket_exists(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    scheme: str,
) -> None:
    """The same against the GCS and S3 emulators: a journal on a bucket that does not exist is
    refused, naming the store; once the bucket is made, appends go through and persist. (Before
    the health checks, a missing bucket was refused too, after 10 s, as its first listing fails:
    unlike a missing file:// directory, which lists as empty. This holds the emulators to it.)"""
    server: GCSServer | S3Server = request.getfixturevalue(
        {"gs": "gcs_server", "s3": "s3_server"}[scheme]
    )
    bucket = unique_bucket()
    url = f"gs://{bucket}/fragments/"
    if scheme == "s3":
        endpoint = urllib.parse.quote(server.endpoint, safe="")
        url = f"s3://{bucket}/fragments/?endpoint={endpoint}&region=us-east-1"
    journal = f"health/bucket-{scheme}"
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["health-0"], file_root=str(tmp_path)
    ) as brokers:
        spec = journal_spec(journal, replication=1)
        spec.fragment.stores.append(url)
        spec.fragment.refresh_interval.seconds = 1
        await set_journal(etcd, etcd_prefix, spec, [("local", "health-0")])

        with pytest.raises(AppendError) as refused:
            await append(stub(brokers[0]), journal, b"no bucket\n")
        assert refused.value.status == pb.FRAGMENT_STORE_UNHEALTHY
        said = refused.value.response.store_health_error
        assert f"{scheme}://{bucket}/fragments/" in said, said
        assert await read_committed(brokers[0], journal) == b""

        await asyncio.to_thread(create_bucket, server, bucket)
        response = await append(stub(brokers[0]), journal, b"a bucket\n")
        assert (response.commit.begin, response.commit.end) == (0, 9)
        await append(stub(brokers[0]), journal, b"")  # Rolls the first write: persisted.
        persisted = await persisted_through(brokers[0], journal, 9)
        assert all(f.backing_store == url for f in persisted)
