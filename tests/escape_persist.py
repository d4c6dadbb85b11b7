"""Escape attempts through a journal's name once it is deleted: what its replicas still hold
(the open fragment at the delete) must not be persisted by the spec of a journal created under
its name since, which may be another tenant's, with stores of its own. Collected through
tests/test_tenant_escape.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.client.routes import append_routed
from broker.fragment.stores import HEALTH_CHECK_CONTENT, HEALTH_CHECK_PATH
from broker.fragment.stores.base import JOURNAL_HEALTH_DIR
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from plumbing import auth
from tests.escape_stores import journal_spec, read_content
from tests.helpers.tenancy import KEYS, admin, md, team

__all__ = [
    "test_a_deleted_journals_last_fragment_is_never_persisted_by_a_journal_created_in_its_name",
    "two_persisting_brokers",
]

SECRET = b"the victim's unpersisted tail: card 4111-1111-1111-1111\n"
PERSIST_INTERVAL = 3.0  # How long a replica waits before persisting what its primary completed.


@pytest.fixture
async def two_persisting_brokers(etcd_server: Any, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[tuple[pb_grpc.JournalStub, Path]]:  # fmt: skip
    root = tmp_path / "root"
    (root / "tenant-y").mkdir(parents=True)
    (root / "x").mkdir()
    options = {"file_root": str(root), "auth_keys": KEYS, "persist_interval": PERSIST_INTERVAL}
    first = BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-0", **options)
    async with (
        first,
        BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-1", **options),
        grpc.aio.insecure_channel(first.endpoint.removeprefix("http://")) as channel,
    ):
        yield pb_grpc.JournalStub(channel), root  # type: ignore[no-untyped-call]


def _is_health_probe(path: Path) -> bool:
    """Whether `path` is a store health check's probe (at the store's root or under a journal's
    path), holding only the probe's content."""
    name = HEALTH_CHECK_PATH.rpartition("/")[2]
    dirs = (HEALTH_CHECK_PATH.rpartition("/")[0], JOURNAL_HEALTH_DIR)
    return (
        path.name == name and path.parent.name in dirs and path.read_bytes() == HEALTH_CHECK_CONTENT
    )


async def _members(stub: pb_grpc.JournalStub, name: str) -> int:
    sel = pb.LabelSelector()
    sel.include.labels.add(name="name", value=name)
    async for response in stub.List(pb.ListRequest(selector=sel), metadata=admin()):
        for j in response.journals:
            return len(j.route.members)
    return 0


async def test_a_deleted_journals_last_fragment_is_never_persisted_by_a_journal_created_in_its_name(
    two_persisting_brokers: tuple[pb_grpc.JournalStub, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Team y's journal (two replicas) holds content not yet persisted when the operator deletes
    it; team x, which never saw it, creates a journal of that name in its own store at once (an
    absent name may be created). No replica writes the deleted journal's last fragment into x's
    store (each persists it into y's, before the delete reached it, or drops it), and x reads
    nothing of y's."""
    caplog.set_level(logging.INFO, logger="broker.fragment.persister")
    stub, root = two_persisting_brokers
    victim = "tenant-y/tail"
    spec = journal_spec(victim, "y", "file:///tenant-y/")
    spec.replication = 2
    await stub.Apply(pb.ApplyRequest(changes=[pb.ApplyRequest.Change(upsert=spec)]), metadata=admin())  # fmt: skip
    async with asyncio.timeout(20):
        while await _members(stub, victim) < 2:
            await asyncio.sleep(0.05)
    appended = await append_routed(stub, victim, SECRET, metadata=md(auth.ALL, team("y")))
    assert appended.status == pb.OK
    gone = pb.ApplyRequest.Change(delete=victim, expect_mod_revision=-1)
    await stub.Apply(pb.ApplyRequest(changes=[gone]), metadata=admin())
    mine = journal_spec(victim, "x", "file:///x/")
    change = pb.ApplyRequest.Change(upsert=mine, expect_mod_revision=0)
    x = md(auth.ALL, team("x"))
    assert (await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=x)).status == pb.OK

    def outcomes() -> list[str]:
        """What each replica did with the fragment: persisted it (before the delete reached
        it, into y's store), or dropped it."""
        return [
            m
            for r in caplog.records
            if victim in (m := r.getMessage()) and m.startswith(("dropping", "persisted"))
        ]

    # Each replica completed the fragment (the primary at once, the other after the persist
    # interval), and persisted or dropped it.
    async with asyncio.timeout(10 * PERSIST_INTERVAL):
        while len(outcomes()) < 2:
            await asyncio.sleep(0.05)
    assert not [m for m in outcomes() if "file:///x/" in m], outcomes()
    # x's store holds nothing but the probes of its own store's health checks
    # (broker/fragment/health.py, its own journal's): no fragment, and nothing of y's.
    written = [p for p in (root / "x").rglob("*") if p.is_file()]
    assert not [p for p in written if SECRET in p.read_bytes()], "y's content in x's store"
    assert not [p for p in written if not _is_health_probe(p)], ("persisted into x's store", written)  # fmt: skip
    status, content = await read_content(stub, victim, x)
    assert SECRET not in content, (status, content)
