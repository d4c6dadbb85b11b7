"""Tenants sharing brokers and consumers, each with a token whose selector names its own: what
we refuse beyond upstream. An Apply may neither take over nor probe a journal or shard its
caller cannot see; FragmentStoreHealth takes APPLY and only the stores of visible journals;
signed fragment URLs live no longer than the token they were asked with; and metrics can leave
journal names out."""

from __future__ import annotations

import asyncio
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from broker.fragment.stores import open_store
from broker.protocol import consumer_pb2 as cpb
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from broker.testing.processes import start_broker_process
from consumer.testing import ConsumerGroup
from plumbing import auth
from plumbing.processes import stop_process
from tests.helpers.consumers import WordTotals
from tests.helpers.fragments import put_fragment
from tests.helpers.store_servers import S3Server
from tests.helpers.tenancy import KEYS, admin, md, spec, team
from tests.helpers.waiting import until


@pytest.fixture
async def broker(etcd_server: object, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[pb_grpc.JournalStub]:  # fmt: skip
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    async with BrokerHarness(
        etcd_server.endpoint,  # type: ignore[attr-defined]
        etcd_prefix,
        file_root=str(tmp_path),
        auth_keys=KEYS,
    ) as harness:
        channel = grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://"))
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        await stub.Apply(
            pb.ApplyRequest(
                changes=[
                    pb.ApplyRequest.Change(
                        upsert=spec("t/ours", "x", "file:///x/"), expect_mod_revision=0
                    ),
                    pb.ApplyRequest.Change(
                        upsert=spec("t/theirs", "y", "file:///y/"), expect_mod_revision=0
                    ),
                ]
            ),
            metadata=admin(),
        )
        yield stub
        await channel.close(None)


async def journal(stub: pb_grpc.JournalStub, name: str) -> pb.ListResponse.Journal | None:
    sel = pb.LabelSelector()
    sel.include.labels.add(name="name", value=name)
    async for response in stub.List(pb.ListRequest(selector=sel), metadata=admin()):
        for found in response.journals:
            return found
    return None


async def refused(call: object, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    for word in words:
        assert word in (info.value.details() or ""), info.value.details()


async def test_an_apply_neither_takes_over_nor_probes_a_journal_its_caller_cannot_see(
    broker: pb_grpc.JournalStub,
) -> None:
    x = md(auth.APPLY | auth.LIST | auth.READ, team("x"))
    theirs = await journal(broker, "t/theirs")
    assert theirs is not None
    # Relabelled as the caller's own, under every expectation of its revision: the right one,
    # none (-1), or "must not exist" (which, answered as a conflict, would reveal it exists).
    for expect in (theirs.mod_revision, -1, 0):
        change = pb.ApplyRequest.Change(upsert=spec("t/theirs", "x"), expect_mod_revision=expect)
        await refused(broker.Apply(pb.ApplyRequest(changes=[change]), metadata=x), "not authorized to t/theirs")  # fmt: skip
    after = await journal(broker, "t/theirs")
    assert after is not None and after.mod_revision == theirs.mod_revision
    assert [(label.name, label.value) for label in after.spec.labels.labels] == [("team", "y")]
    # One such change refuses the whole request: the caller's own journal is not changed.
    ours = await journal(broker, "t/ours")
    assert ours is not None
    both = [
        pb.ApplyRequest.Change(
            upsert=spec("t/ours", "x", "file:///x/"), expect_mod_revision=ours.mod_revision
        ),
        pb.ApplyRequest.Change(upsert=spec("t/theirs", "x"), expect_mod_revision=-1),
    ]
    await refused(broker.Apply(pb.ApplyRequest(changes=both), metadata=x), "not authorized to t/theirs")  # fmt: skip
    # What it can see, it changes and learns of as before: its own journal, a new name, and a
    # conflict on its own journal's revision.
    ok = await broker.Apply(pb.ApplyRequest(changes=both[:1]), metadata=x)
    assert ok.status == pb.OK
    again = await broker.Apply(pb.ApplyRequest(changes=both[:1]), metadata=x)
    assert again.status == pb.ETCD_TRANSACTION_FAILED
    created = pb.ApplyRequest.Change(upsert=spec("t/new", "x"), expect_mod_revision=0)
    assert (await broker.Apply(pb.ApplyRequest(changes=[created]), metadata=x)).status == pb.OK
    # The operator, unrestricted, replaces whatever it names.
    take = pb.ApplyRequest.Change(upsert=spec("t/theirs", "z"), expect_mod_revision=-1)
    assert (await broker.Apply(pb.ApplyRequest(changes=[take]), metadata=admin())).status == pb.OK


async def test_a_shard_apply_neither_takes_over_nor_probes_a_shard_its_caller_cannot_see(
    etcd_server: object, etcd_prefix: str, broker: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    from consumer.testing import shard_spec

    async with (
        ConsumerGroup(
            etcd_server,  # type: ignore[arg-type]
            "",  # Not dialled: no shard of this test runs.
            f"/gazette-test-tenancy/{uuid.uuid4().hex[:12]}",
            auth_keys=KEYS,
        ) as group
    ):
        consumer = await group.start(WordTotals(str(tmp_path)), run_allocator=False)
        channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
        stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
        try:
            theirs = shard_spec("s-theirs", ["t/theirs"], labels=[("team", "y")])
            theirs.disable = True
            answer = await stub.Apply(
                cpb.ApplyRequest(
                    changes=[cpb.ApplyRequest.Change(upsert=theirs, expect_mod_revision=0)]
                ),
                metadata=admin(),
            )
            assert answer.status == cpb.OK
            mine = cpb.ShardSpec()
            mine.CopyFrom(theirs)
            del mine.labels.labels[:]
            mine.labels.labels.add(name="team", value="x")
            x = md(auth.APPLY | auth.LIST, team("x"))
            for expect in (answer.header.etcd.revision, -1, 0):
                change = cpb.ApplyRequest.Change(upsert=mine, expect_mod_revision=expect)
                await refused(stub.Apply(cpb.ApplyRequest(changes=[change]), metadata=x), "not authorized to s-theirs")  # fmt: skip
            listed = await stub.List(cpb.ListRequest(), metadata=admin())
            assert [(s.spec.id, s.spec.labels.labels[0].value) for s in listed.shards] == [("s-theirs", "y")]  # fmt: skip
        finally:
            await channel.close(None)


async def test_store_health_takes_apply_and_only_the_stores_of_visible_journals(
    broker: pb_grpc.JournalStub,
) -> None:
    def check(store: str, metadata: tuple[tuple[str, str], ...]) -> object:
        return broker.FragmentStoreHealth(pb.FragmentStoreHealthRequest(fragment_store=store), metadata=metadata)  # fmt: skip

    await refused(check("file:///x/", md(auth.READ)), "APPLY")
    x = md(auth.APPLY, team("x"))
    assert (await check("file:///x/", x)).status == pb.OK  # t/ours names it.
    await refused(check("file:///y/", x), "not authorized to file:///y/")  # Only t/theirs does.
    await refused(check("file:///elsewhere/", x), "not authorized to file:///elsewhere/")
    # Unrestricted, APPLY may check any store (it could name it in a journal anyway).
    assert (await check("file:///y/", md(auth.APPLY))).status == pb.OK


async def test_signed_fragment_urls_live_no_longer_than_the_token_they_were_asked_with(
    etcd_server: object, etcd_prefix: str, s3_server: S3Server
) -> None:
    """Asked of the journal's broker or of another one (which proxies), ListFragments and Read
    hand out URLs that expire with the caller's token."""
    bucket = s3_server.create_bucket()
    endpoint = urllib.parse.quote(s3_server.endpoint, safe="")
    store = f"s3://{bucket}/fragments/?endpoint={endpoint}&region=us-east-1"
    put_fragment(open_store(store), "t/signed", 0, b"persisted content\n")
    address = etcd_server.endpoint  # type: ignore[attr-defined]
    async with (
        BrokerHarness(address, etcd_prefix, auth_keys=KEYS, id="broker-0") as one,
        BrokerHarness(address, etcd_prefix, auth_keys=KEYS, id="broker-1") as two,
    ):
        channels = [grpc.aio.insecure_channel(h.endpoint.removeprefix("http://")) for h in (one, two)]  # fmt: skip
        stubs = [pb_grpc.JournalStub(c) for c in channels]  # type: ignore[no-untyped-call]
        try:
            change = pb.ApplyRequest.Change(upsert=spec("t/signed", "x", store))
            await stubs[0].Apply(pb.ApplyRequest(changes=[change]), metadata=admin())
            found: pb.ListResponse.Journal | None = None

            async def taken_on() -> bool:
                nonlocal found
                found = await journal(stubs[0], "t/signed")
                return found is not None and found.route.primary == 0

            await until(taken_on, "a broker took the journal on", timeout=30, interval=0.05)
            assert found is not None
            member = found.route.members[0].suffix
            local, proxying = (stubs[0], stubs[1]) if member == "broker-0" else (stubs[1], stubs[0])

            def expiry(url: str) -> int:
                return int(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["X-Amz-Expires"][0])  # fmt: skip

            async def listed(stub: pb_grpc.JournalStub, token_ttl: float, ttl: int) -> int:
                request = pb.FragmentsRequest(journal="t/signed", signatureTTL={"seconds": ttl})
                response = await stub.ListFragments(request, metadata=md(auth.READ, ttl=token_ttl))
                assert response.status == pb.OK
                (fragment,) = [f for f in response.fragments if f.spec.backing_store]
                return expiry(fragment.signed_url)

            async def read(stub: pb_grpc.JournalStub, token_ttl: float) -> int:
                request = pb.ReadRequest(journal="t/signed", block=False, metadata_only=True)
                call = stub.Read(request, metadata=md(auth.READ, ttl=token_ttl))
                first = await call.read()
                call.cancel()
                return expiry(first.fragment_url)

            for stub in (local, proxying):
                assert await listed(stub, 600, 3600) <= 600
                assert 25 <= await listed(stub, 30, 3600) <= 30
                assert await listed(stub, 600, 60) == 60  # Shorter than the token.
                assert 15 <= await read(stub, 20) <= 20
                assert await read(stub, 600) == 60  # A Read's URL lives its minute.
        finally:
            for channel in channels:
                await channel.close(None)


def test_metrics_can_leave_journal_names_and_store_urls_out(
    etcd_server: object, etcd_prefix: str, tmp_path: Path
) -> None:
    from broker.client.routes import append_routed
    from plumbing.local_etcd import free_port

    (tmp_path / "secret-bucket").mkdir()
    port = free_port()
    proc = start_broker_process(
        etcd_server,  # type: ignore[arg-type]
        etcd_prefix,
        tmp_path / "broker.log",
        broker_id="quiet-metrics",
        extra=("--broker.http-port", str(port), "--broker.metrics-journal-labels=false",
               "--broker.file-root", str(tmp_path)),
    )  # fmt: skip
    try:

        async def write() -> None:
            channel = grpc.aio.insecure_channel(proc.address.removeprefix("http://"))
            stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
            try:
                for name in ("tenant-a/orders", "tenant-b/payroll"):
                    change = pb.ApplyRequest.Change(
                        upsert=spec(name, "a", "file:///secret-bucket/")
                    )
                    await stub.Apply(pb.ApplyRequest(changes=[change]))
                    await append_routed(stub, name, b"hello\n")
                    await append_routed(stub, name, b"")  # A zero-byte append: persisted later.
            finally:
                await channel.close(None)

        asyncio.run(write())
        text = httpx.get(f"http://127.0.0.1:{port}/debug/metrics", timeout=10).text
        assert "tenant-" not in text and "secret-bucket" not in text
        assert "gazette_write_head{" not in text
        sums = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("gazette_write_heads_")}  # fmt: skip
        assert sums == {"gazette_write_heads_sum": 12.0, "gazette_write_heads_journals": 2.0}
    finally:
        stop_process(proc.proc)
