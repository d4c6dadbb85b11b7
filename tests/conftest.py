"""Shared fixtures: one real etcd per test session; each test isolated under its own key prefix."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from broker.testing import EtcdServer


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses (upstream tests use /broker.test; we add a unique suffix)."""
    return f"/gazette-test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def etcd(etcd_server: EtcdServer, etcd_prefix: str) -> AsyncIterator[aetcd.Client]:
    client = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
    await client.connect()
    try:
        yield client
    finally:
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
