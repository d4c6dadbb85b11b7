"""The Journal service's List and Apply against real etcd, through in-process brokers."""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import pytest

from allocator import keyspace as aks
from broker.client import ApplyConflict, JournalsClient
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.waiting import until


def spec(name: str, replication: int = 1, **label_values: str) -> pb.JournalSpec:
    s = pb.JournalSpec(name=name, replication=replication)
    s.fragment.length = 1 << 20
    s.fragment.compression_codec = pb.SNAPPY
    s.fragment.refresh_interval.seconds = 60
    for k, v in sorted(label_values.items()):
        s.labels.labels.add(name=k.replace("_", "-"), value=v)
    return s


def upsert(s: pb.JournalSpec, revision: int = 0) -> pb.ApplyRequest.Change:
    return pb.ApplyRequest.Change(expect_mod_revision=revision, upsert=s)


@pytest.fixture
async def broker(etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client) -> BrokerHarness:
    async with BrokerHarness(etcd_server.endpoint, etcd_prefix) as harness:
        yield harness  # type: ignore[misc]


async def test_member_key_announced_under_lease_and_removed_on_stop(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    harness = BrokerHarness(etcd_server.endpoint, etcd_prefix, zone="zone-a", id="broker-xyz")
    key = aks.member_key(etcd_prefix, "zone-a", "broker-xyz").encode()
    async with harness:
        got = await etcd.get(key)
        assert got is not None
        member = pb.BrokerSpec.FromString(got.value)
        assert member.process_spec.id.zone == "zone-a"
        assert member.process_spec.id.suffix == "broker-xyz"
        assert member.process_spec.endpoint == harness.endpoint
        assert not member.exiting
        assert got.lease != 0
    assert await etcd.get(key) is None  # Lease revoked on a graceful stop.


async def test_second_broker_with_same_id_is_refused(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client, broker: BrokerHarness
) -> None:
    from plumbing.membership import AnnounceError

    twin = BrokerHarness(etcd_server.endpoint, etcd_prefix, lease=1.0)
    twin.broker.config.etcd_lease = 0.5  # Keep the refusal quick: it waits about 2 leases.
    with pytest.raises(AnnounceError, match="held by another live process"):
        async with twin:
            pass


async def test_apply_create_then_list(
    broker: BrokerHarness, etcd: aetcd.Client, etcd_prefix: str
) -> None:
    async with broker.client() as client:
        [response] = await client.apply([upsert(spec("a/one")), upsert(spec("a/two", team="x"))])
        assert response.status == pb.OK
        revision = response.header.etcd.revision
        assert revision > 0

        listed = await client.list()
        assert [j.spec.name for j in listed.journals] == ["a/one", "a/two"]
        assert all(j.mod_revision == revision for j in listed.journals)
        assert all(j.create_revision == revision for j in listed.journals)
        assert listed.journals[1].spec == spec("a/two", team="x")
        assert listed.header.process_id.suffix == "broker-0"
        assert listed.header.etcd.revision >= revision

        # Specs are stored protobuf-encoded under {prefix}/items/{journal}, as upstream.
        raw = await etcd.get(aks.item_key(etcd_prefix, "a/one").encode())
        assert raw is not None and pb.JournalSpec.FromString(raw.value) == spec("a/one")


async def test_apply_is_all_or_nothing_on_stale_revision(broker: BrokerHarness) -> None:
    async with broker.client() as client:
        [created] = await client.apply([upsert(spec("b/existing"))])
        with pytest.raises(ApplyConflict):
            # Creating b/new is fine, but b/existing already exists: neither may apply.
            await client.apply([upsert(spec("b/new")), upsert(spec("b/existing", 2), 0)])
        names = [j.spec.name for j in (await client.list()).journals]
        assert names == ["b/existing"]

        # The right revision updates; -1 skips the check; a stale one conflicts.
        rev = created.header.etcd.revision
        await client.apply([upsert(spec("b/existing", 2), rev)])
        with pytest.raises(ApplyConflict):
            await client.apply([upsert(spec("b/existing", 3), rev)])
        await client.apply([upsert(spec("b/existing", 3), -1)])
        [journal] = (await client.list()).journals
        assert journal.spec.replication == 3
        assert journal.create_revision == rev < journal.mod_revision

        # Deletes check the revision too.
        with pytest.raises(ApplyConflict):
            await client.apply(
                [pb.ApplyRequest.Change(expect_mod_revision=rev, delete="b/existing")]
            )
        await client.apply(
            [pb.ApplyRequest.Change(expect_mod_revision=journal.mod_revision, delete="b/existing")]
        )
        assert (await client.list()).journals == []


async def test_apply_rejects_invalid_specs(broker: BrokerHarness) -> None:
    async with broker.client() as client:
        bad = spec("c/ok")
        bad.replication = 7
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.apply([upsert(spec("c/fine")), upsert(bad)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "replication" in (info.value.details() or "")
        assert (await client.list()).journals == []


async def test_list_selectors(broker: BrokerHarness) -> None:
    async with broker.client() as client:
        await client.apply(
            [
                upsert(spec("sel/a/one", team="red")),
                upsert(spec("sel/a/two", team="blue")),
                upsert(spec("sel/b/three", team="red", tier="gold")),
                upsert(spec("selx/four")),
            ]
        )

        async def names(selector: str) -> list[str]:
            snapshot = await client.list(labels.parse_selector(selector))
            return [j.spec.name for j in snapshot.journals]

        assert await names("team=red") == ["sel/a/one", "sel/b/three"]
        assert await names("team in (red, blue), !tier") == ["sel/a/one", "sel/a/two"]
        assert await names("name=sel/a/two") == ["sel/a/two"]
        assert await names("prefix=sel/a/") == ["sel/a/one", "sel/a/two"]
        assert await names("prefix=sel/") == ["sel/a/one", "sel/a/two", "sel/b/three"]
        assert await names("team notin (red)") == ["sel/a/two", "selx/four"]


async def test_list_streams_in_chunks_of_25(broker: BrokerHarness) -> None:
    async with broker.client() as client:
        await client.apply([upsert(spec(f"many/j-{i:03d}")) for i in range(60)])
        stub = pb_grpc.JournalStub(client.channel)
        responses = [r async for r in stub.List(pb.ListRequest())]
        assert [len(r.journals) for r in responses] == [25, 25, 10]
        assert responses[0].HasField("header") and not responses[1].HasField("header")
        assert responses[0].status == pb.OK


async def test_list_watch_sends_a_snapshot_per_change(broker: BrokerHarness) -> None:
    async with broker.client() as client, JournalsClient(broker.endpoint) as other:
        watch = client.watch(labels.parse_selector("prefix=w/"))
        first = await asyncio.wait_for(anext(watch), 10)
        assert first.journals == []

        await other.apply([upsert(spec("w/one")), upsert(spec("unrelated/x"))])
        second = await asyncio.wait_for(anext(watch), 10)
        assert [j.spec.name for j in second.journals] == ["w/one"]

        await other.apply([upsert(spec("w/two"))])
        third = await asyncio.wait_for(anext(watch), 10)
        assert [j.spec.name for j in third.journals] == ["w/one", "w/two"]
        assert third.header.etcd.revision > second.header.etcd.revision
        await watch.aclose()


async def test_apply_through_one_broker_lists_through_another(
    etcd_server: EtcdServer, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    async with (
        BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-a") as a,
        BrokerHarness(etcd_server.endpoint, etcd_prefix, id="broker-b") as b,
        a.client() as ca,
        b.client() as cb,
    ):
        [response] = await ca.apply([upsert(spec("shared/j"))])
        # A watch resumed from the Apply's revision returns once broker b has caught up.
        stub = pb_grpc.JournalStub(cb.channel)
        resume = pb.Header(etcd=pb.Header.Etcd(revision=response.header.etcd.revision - 1))
        call = stub.List(pb.ListRequest(watch=True, watch_resume=resume))
        first = await asyncio.wait_for(anext(aiter(call)), 10)
        call.cancel()
        assert [j.spec.name for j in first.journals] == ["shared/j"]
        assert first.header.process_id.suffix == "broker-b"


async def test_broker_survives_an_etcd_restart(tmp_path: object) -> None:
    with EtcdServer() as private:
        async with BrokerHarness(private.endpoint, "/restart", lease=5.0) as harness:
            async with harness.client() as client:
                await client.apply([upsert(spec("r/before"))])
                # Shorter than the lease TTL: the broker must ride it out. An Apply that
                # arrives while etcd is down waits for the broker's connection to etcd to be
                # ready again (etcdx.wait_until_ready, as upstream's etcd client waits), and
                # goes through once etcd is back: a user's Apply is not tried again, nor is
                # this one.
                private.stop()
                channel = harness.broker.etcd.channel
                await until(
                    lambda: channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                    "the broker's connection to etcd failed",
                    10,
                )
                applied = asyncio.ensure_future(client.apply([upsert(spec("r/after"))]))
                await asyncio.to_thread(private.start)
                await applied
                names = [j.spec.name for j in (await client.list()).journals]
                assert names == ["r/after", "r/before"]
            assert harness.broker.failure is None
            assert not harness.broker.done.is_set()


async def test_a_burst_of_calls_past_grpcs_pending_limit_is_served(broker: BrokerHarness) -> None:
    """4,000 Lists sent at once: more than gRPC core lets wait for an asyncio server to take
    them by default (1,000, and every one past 3,000 is cancelled), as a consumer process
    starting thousands of shards sends (shard_scale, docs/benchmarks-history.md). Each is
    answered."""
    async with JournalsClient(broker.endpoint) as client:
        await client.apply([upsert(spec("burst/one"))])
        selector = labels.selector(labels.label_set(("name", "burst/one")))
        answers = await asyncio.gather(
            *(client.list(selector) for _ in range(4_000)), return_exceptions=True
        )
    failed = [repr(a) for a in answers if isinstance(a, BaseException)]
    assert failed == [], f"{len(failed)} of 4,000 failed, first: {failed[:1]}"
    assert all(len(a.journals) == 1 for a in answers if not isinstance(a, BaseException))
