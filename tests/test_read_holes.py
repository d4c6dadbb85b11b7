"""A read that meets a range its broker's index does not cover yet, although the range is
committed and persisted: the broker lists its stores at once instead of answering as if the
journal ended there (until its next listing, a minute later by default).

Found by the replication fault campaign (`location-broker-kill`): a broker restarted with an
empty spool listed its store just before the surviving replica persisted the fragment of the
last appends; reads through it stopped at that range, and a location's log looked as if it
ended there, acknowledged events and all."""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest

from broker.client import JournalsClient
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.reader import read
from broker.client.routes import append_routed
from broker.fragment.content import fragment_path
from broker.fragment.fragments import sum_from_digest
from broker.fragment.persister import Persister
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerProcess, EtcdServer, stop_process
from tests.conftest import start_broker_process
from tests.helpers.gazctl import gazctl
from tests.helpers.journals import journal_spec, routed, set_journal, started_brokers
from tests.helpers.waiting import until

STORE = "file:///fragments/"
JOURNAL = "holes/journal"


def content(begin: int, end: int) -> bytes:
    """Lines of the journal's content in [begin, end): each byte known by its offset."""
    return b"".join(b"\n" if i % 20 == 19 else bytes([97 + i % 26]) for i in range(begin, end))


def persist(root: Path, begin: int, end: int, store: str = STORE) -> None:
    """A fragment of [begin, end) put straight into the store, as another broker would."""
    body = content(begin, end)
    fragment = pb.Fragment(
        journal=JOURNAL, begin=begin, end=end,
        sum=sum_from_digest(hashlib.sha1(body).digest()), compression_codec=pb.NONE,
    )  # fmt: skip
    assert open_store(store, file_root=root).put(
        fragment_path(fragment), io.BytesIO(body), len(body)
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The broker's --broker.file-root: file:///a/ is the directory a/ under it."""
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def broker(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path, root: Path
) -> Iterator[BrokerProcess]:
    """A `gazette serve` process over `root`, stopped after the test (unless it stopped it)."""
    broker = start_broker_process(
        etcd_server, etcd_prefix, tmp_path / "broker.log",
        extra=("--broker.file-root", str(root)),
    )  # fmt: skip
    try:
        yield broker
    finally:
        stop_process(broker.proc)


@pytest.fixture
async def stub(broker: BrokerProcess) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(broker.address)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close(None)


async def apply_journal(broker: BrokerProcess) -> None:
    """JOURNAL at replication 1 on STORE, applied through `broker` and placed."""
    spec = pb.JournalSpec(name=JOURNAL, replication=1)
    spec.fragment.length = 1 << 20
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.stores.append(STORE)
    spec.fragment.refresh_interval.seconds = 60
    async with JournalsClient(broker.address) as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec)])
        await routed(client, JOURNAL, 1)


async def test_a_read_across_a_range_persisted_after_the_last_listing_reads_it(
    broker: BrokerProcess, stub: pb_grpc.JournalStub, root: Path
) -> None:
    (root / "fragments").mkdir()
    persist(root, 0, 100)
    persist(root, 200, 300)  # [100, 200) persisted later: a range no listing has seen yet.
    await apply_journal(broker)
    listed = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
    assert [(f.spec.begin, f.spec.end) for f in listed.fragments] == [(0, 100), (200, 300)]
    await append(stub, JOURNAL, content(300, 340), offset=300)  # The write head is at 300.
    persist(root, 100, 200)  # Committed content, persisted as a replica would.

    got = b"".join([c.content async for c in read(stub, JOURNAL, 0, block=False)])
    assert got == content(0, 340)


async def test_a_read_goes_past_a_range_no_store_holds_and_apply_warns_of_it(
    broker: BrokerProcess, stub: pb_grpc.JournalStub, root: Path, tmp_path: Path
) -> None:
    """As an operator met it: [0, 20) persisted to store a/, [20, 40) in a local fragment, then
    the spec's stores changed to b/ alone, which hides a/'s fragments. `journals apply` warns
    that the change makes a/'s fragment unreadable, and `journals read` of the whole journal
    prints what it can with a note of what it skipped (it printed nothing, silently).

    b/ holds [0, 10), so that the hole, [10, 20), has a fragment on each side whether or not
    [20, 40) has been persisted to b/ and listed by the time of the read (the stores change
    rolls it, and its primary persists it at once)."""
    for store in ("a", "b"):
        (root / store).mkdir()
    persist(root, 0, 20, "file:///a/")
    persist(root, 0, 10, "file:///b/")
    spec_yaml = tmp_path / "spec.yaml"
    template = (
        f"name: {JOURNAL}\nrevision: -1\nreplication: 1\nfragment:\n  length: 1048576\n"
        "  compression_codec: NONE\n  refresh_interval: 1m0s\n  stores: [{stores}]\n"
    )
    spec_yaml.write_text(template.replace("{stores}", "file:///a/"))
    assert gazctl(broker, "journals", "apply", "--specs", str(spec_yaml)).code == 0
    async with JournalsClient(broker.address) as client:
        await routed(client, JOURNAL, 1)
    response = await append_routed(stub, JOURNAL, content(20, 40), offset=20)
    assert (response.commit.begin, response.commit.end) == (20, 40)

    spec_yaml.write_text(template.replace("{stores}", "file:///b/"))
    r = gazctl(broker, "journals", "apply", "--specs", str(spec_yaml))
    assert r.code == 0, r.err
    assert (
        f"warning: {JOURNAL}: the change drops file:///a/, which holds 1 of its fragments "
        "([0, 20))" in r.err
    ), r.err
    assert "list file:///a/ after the new store(s)" in r.err

    r = gazctl(broker, "journals", "read", "-l", f"name={JOURNAL}")
    assert r.code == 0, r.err
    assert r.out.encode() == content(0, 10) + content(20, 40)
    assert f"{JOURNAL}: skipped [10, 20): no broker holds it" in r.err, r.err

    # A blocking read with a hole handler goes past it too, then waits for new content.
    skipped: list[tuple[int, int]] = []
    reader = read(stub, JOURNAL, 10, block=True, on_hole=lambda b, e: skipped.append((b, e)))
    first = await anext(reader)
    assert (first.offset, skipped) == (20, [(10, 20)])
    await reader.aclose()
    # Without one, a read stops at the hole, as upstream's does.
    assert [c async for c in read(stub, JOURNAL, 10, block=False)] == []


async def test_a_read_from_before_every_fragment_says_what_it_skipped(
    broker: BrokerProcess, stub: pb_grpc.JournalStub, root: Path
) -> None:
    """A journal whose stores begin at 100 (its first content lost with every replica at a
    graceful exit whose store failed, or removed from the stores): the broker moves a read from
    0 to the first fragment, as upstream's does, and the reader says what it skipped rather
    than going on quietly (`gazctl journals read` printed the rest with no note)."""
    (root / "fragments").mkdir()
    persist(root, 100, 200)
    await apply_journal(broker)
    skipped: list[tuple[int, int]] = []
    got = b"".join(
        [c.content async for c in read(stub, JOURNAL, 0, block=False, on_hole=lambda b, e: skipped.append((b, e)))]
    )  # fmt: skip
    assert (got, skipped) == (content(100, 200), [(0, 100)])
    r = gazctl(broker, "journals", "read", "-l", f"name={JOURNAL}")
    assert r.code == 0, r.err
    assert r.out.encode() == content(100, 200)
    assert f"{JOURNAL}: skipped [0, 100): no broker holds it" in r.err, r.err


async def test_a_broker_stopping_with_a_hole_in_its_journal_suspends_it_and_exits(
    broker: BrokerProcess, stub: pb_grpc.JournalStub, root: Path
) -> None:
    """SIGTERM to the last broker of a journal with a hole below its end, [10, 20), that no
    store holds: the broker flushes what it holds, suspends the journal at its end and exits
    at once. The flush at exit waited for the stores to hold the hole too, which no waiting
    could bring about: the exit took FLUSH_TIMEOUT (15s) and more, long enough to be
    SIGKILLed by a supervisor's grace period (stop_process's 10s, Kubernetes' 30s)."""
    (root / "fragments").mkdir()
    persist(root, 0, 10)
    persist(root, 20, 40)
    await apply_journal(broker)
    await append(stub, JOURNAL, content(40, 60), offset=40)  # Confirms the head at 40.
    # A clean exit well within stop_process's SIGKILL deadline.
    status = stop_process(broker.proc, timeout=8)
    log = broker.log.read_text()
    assert status == 0, log
    assert f"flushed {JOURNAL} and suspended it at its end" in log, log
    assert f"{JOURNAL}: suspending it at 60 over [10, 20)" in log, log
    # What it held, [40, 60), is in the store: the suspension hides no byte but the hole's.
    # Not the store health probe, which lives under the journal's path too (.gazette~health/).
    persisted = sorted(
        f.name.split("-")[:2]
        for f in (root / "fragments" / JOURNAL).iterdir()
        if not f.name.startswith(".")
    )
    assert persisted == [[f"{b:016x}", f"{e:016x}"] for b, e in ((0, 10), (20, 40), (40, 60))]


async def test_a_broker_stopping_with_a_journal_that_needs_reset_head_exits_at_once(
    broker: BrokerProcess, root: Path
) -> None:
    """SIGTERM to the last broker of a journal whose store holds offsets past its spool (its
    brokers were lost without a suspension): no append can go through until `reset-head`, so
    the flush at exit says so once and the broker exits. It retried until FLUSH_TIMEOUT (20s),
    past stop_process's SIGKILL deadline."""
    (root / "fragments").mkdir()
    persist(root, 0, 100)
    await apply_journal(broker)
    channel = dial(broker.address)
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        # Answered once the replica has listed its stores.
        listed = await stub.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
    finally:
        await channel.close(None)
    assert [(f.spec.begin, f.spec.end) for f in listed.fragments] == [(0, 100)]
    status = stop_process(broker.proc, timeout=8)
    log = broker.log.read_text()
    assert status == 0, log
    assert log.count(f"cannot flush {JOURNAL} before exiting") == 1, log
    assert "it needs `gazctl journals reset-head`" in log
    assert "retrying" not in log, log


async def test_a_read_before_the_first_listing_of_the_stores_waits_for_it(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    etcd: aetcd.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker that has just taken a journal whose content is all in its store (restarted
    brokers, a suspended journal) knows nothing of it until its first listing. A read that
    arrived before then was answered "not yet available" at a write head of 0, and `journals
    read` printed nothing, as if the journal were empty (the demo's read after its restart
    met this). The read now waits for the first listing, then serves what it lists."""
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    persist(root, 0, 100)
    persist(root, 100, 250)
    store_slow = threading.Event()
    listing = Persister.list_blocking

    def slow_listing(
        self: Persister, journal: str, spec: pb.JournalSpec, guards: Any = None
    ) -> list[pb.Fragment]:
        store_slow.wait(timeout=30)
        return listing(self, journal, spec, guards)

    monkeypatch.setattr(Persister, "list_blocking", slow_listing)
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["holes-0"], file_root=str(root)
    ) as brokers:
        spec = journal_spec(JOURNAL, replication=1)
        spec.fragment.stores.append(STORE)
        await set_journal(etcd, etcd_prefix, spec, [("local", "holes-0")])
        service = brokers[0].broker.service
        stub = service.dialer.journal_stub(brokers[0].endpoint)
        await until(
            lambda: JOURNAL in service.resolver.replicas,  # type: ignore[operator]
            "the broker took its assignment",
            timeout=10,
            interval=0.05,
        )

        async def read_all(offset: int) -> bytes:
            return b"".join([c.content async for c in read(stub, JOURNAL, offset, block=False)])

        reads = [asyncio.create_task(read_all(0)), asyncio.create_task(read_all(120))]
        try:
            await asyncio.sleep(1.0)  # A hold: no read answers while the listing is held.
            replica = service.resolver.replicas[JOURNAL]  # type: ignore[union-attr,index]
            assert not replica.index.first_refresh.is_set()
            assert not any(task.done() for task in reads), "a read answered before the listing"
        finally:
            store_slow.set()
        assert await asyncio.gather(*reads) == [content(0, 250), content(120, 250)]
