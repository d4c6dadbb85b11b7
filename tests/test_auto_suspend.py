"""`gazette serve --broker.auto-suspend`, on real broker processes: a journal left idle, whose
fragments are all persisted and older than its flush interval, is suspended by its primary's
pulses on its own (a never-written one fully, with no replicas); without the flag it is not; an
append resumes it at its offset."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest

from broker.client import JournalsClient
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.routes import append_routed
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_processes
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.journals import routed
from tests.helpers.waiting import until

pytestmark = pytest.mark.timeout(120)

WRITTEN, EMPTY = "idle/written", "idle/empty"
PARTIAL, FULL, NONE = (
    pb.JournalSpec.Suspend.PARTIAL,
    pb.JournalSpec.Suspend.FULL,
    pb.JournalSpec.Suspend.NONE,
)


def spec(name: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.fragment.length = 1024
    out.fragment.compression_codec = pb.NONE
    out.fragment.stores.append("file:///fragments/")
    out.fragment.refresh_interval.seconds = 1
    # No flush interval: content counts as flushed once persisted a day ago (upstream's rule).
    return out


def start(etcd_server: EtcdServer, root: Path, auto_suspend: bool) -> BrokerProcess:
    (root / "fragments").mkdir(parents=True)
    flags = ["--broker.file-root", str(root), "--broker.pulse-interval", "100ms"]
    if auto_suspend:
        flags.append("--broker.auto-suspend")
    return start_broker_process(
        etcd_server,
        f"/gazette-test/{uuid.uuid4().hex[:12]}",
        root / "broker.log",
        extra=tuple(flags),
    )


async def suspension(address: str, journal: str) -> pb.JournalSpec.Suspend:
    async with JournalsClient(address) as client:
        listing = await client.list(
            pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=journal)]))
        )
    return listing.journals[0].spec.suspend


async def written_and_aged(broker: BrokerProcess, root: Path) -> int:
    """Both journals created; one written and persisted, its fragments' mtimes set back two
    days (as if written long ago). Returns the written journal's end offset."""
    channel = dial(broker.address)
    stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    try:
        async with JournalsClient(broker.address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(j)) for j in (WRITTEN, EMPTY)])
            await routed(client, WRITTEN, replicas=1)  # The allocator places it after apply.
        await append(stub, WRITTEN, b"x" * 1100)
        await append(stub, WRITTEN, b"")  # Rolls the fragment (it is over its length).
        files: list[Path] = []

        def persisted() -> bool:
            nonlocal files
            files = list((root / "fragments" / WRITTEN).glob("[0-9a-f]*"))  # Not .partial-
            return bool(files)

        await until(persisted, "the fragment persisted", timeout=30, interval=0.1)
    finally:
        await channel.close(None)
    two_days_ago = time.time() - 2 * 24 * 3600
    for path in files:
        os.utime(path, (two_days_ago, two_days_ago))
    return 1100


async def test_an_idle_flushed_journal_is_suspended_with_auto_suspend_and_resumed_by_an_append(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    auto = start(etcd_server, tmp_path / "auto", auto_suspend=True)
    plain = start(etcd_server, tmp_path / "plain", auto_suspend=False)
    try:
        end = await written_and_aged(auto, tmp_path / "auto")
        await written_and_aged(plain, tmp_path / "plain")

        # The auto-suspending broker suspends both on its own, once their pulses are stable.
        written = empty = pb.JournalSpec.Suspend()

        async def suspended() -> bool:
            nonlocal written, empty
            written, empty = [await suspension(auto.address, j) for j in (WRITTEN, EMPTY)]
            return (written.level, empty.level) == (PARTIAL, FULL)

        await until(suspended, f"{WRITTEN} and {EMPTY} suspended", timeout=30, interval=0.2)
        assert written.offset == end and empty.offset == 0

        # The same journals, as idle, on a broker without the flag: never suspended.
        # A hold, the thing under test: some 30 pulses, twice what auto-suspension waits for,
        # in which the broker without the flag suspends nothing.
        await asyncio.sleep(3)  # The hold.
        for journal in (WRITTEN, EMPTY):
            assert (await suspension(plain.address, journal)).level == NONE

        # An append resumes a suspended journal where it was suspended.
        channel = dial(auto.address)
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await append(stub, WRITTEN, b"resumed\n")
            assert (response.commit.begin, response.commit.end) == (end, end + 8)
            # A fully suspended journal has no replicas: the append resumes it, then waits (as
            # the library's appender does) for the allocator to assign it.
            response = await append_routed(stub, EMPTY, b"first\n")
            assert (response.commit.begin, response.commit.end) == (0, 6)
        finally:
            await channel.close(None)
        for journal in (WRITTEN, EMPTY):
            assert (await suspension(auto.address, journal)).level == NONE
    finally:
        stop_processes([auto.proc, plain.proc])
