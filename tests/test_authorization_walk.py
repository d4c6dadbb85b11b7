"""Every RPC of every service (Journal, Shard, Location) and the HTTP gateway, walked with a token
that lacks the capability the RPC needs, and with one that has it but whose selector hides the
target: the first is refused UNAUTHENTICATED, the second finds nothing (or is refused as any
unauthorized change). The walk is driven by the services' descriptors, so an RPC added without a
capability, or without a case here, fails it."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from broker.protocol import consumer_pb2 as cpb
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from consumer.testing import ConsumerGroup, shard_spec
from plumbing import auth
from plumbing.debug_http import HTTPConfig
from replication import location_pb2 as lpb
from replication.journals import apply_location_journals
from replication.process import LocationConfig
from replication.rpc import SERVICE as LOCATION_SERVICE
from tests.helpers.consumers import WordTotals
from tests.helpers.locations import serving
from tests.helpers.waiting import until

KEY = b"the key of this walk's brokers, consumers and location"
KEYS = base64.b64encode(KEY).decode()
SIGNER = auth.KeyedAuth([KEY])
NAMES = {auth.LIST: "LIST", auth.APPLY: "APPLY", auth.READ: "READ", auth.APPEND: "APPEND",
         auth.REPLICATE: "REPLICATE"}  # fmt: skip

HIDDEN_JOURNAL, SEEN_JOURNAL, HIDDEN_SHARD = "walk/hidden", "walk/seen", "walk-hidden"


def metadata(capability: int, selector: pb.LabelSelector | None = None) -> tuple[tuple[str, str], ...]:  # fmt: skip
    return (("authorization", f"Bearer {SIGNER.sign(capability, selector, 600)}"),)


def team_x() -> pb.LabelSelector:
    """Selects what team x owns: the hidden journal and shard (team y's) are not among it, and
    no location's log journal carries the label."""
    sel = pb.LabelSelector()
    sel.include.labels.add(name="team", value="x")
    return sel


def admin() -> tuple[tuple[str, str], ...]:
    """Every capability, no selector: signed when used (a module-level token would expire
    before a long suite reaches these tests)."""
    return metadata(auth.ALL)


def journal_spec(name: str, team: str) -> pb.JournalSpec:
    spec = pb.JournalSpec(
        name=name,
        replication=1,
        fragment=pb.JournalSpec.Fragment(
            length=1 << 20,
            compression_codec=pb.NONE,
            refresh_interval={"seconds": 60},
            stores=[f"file:///{team}/"],
        ),
    )
    spec.labels.labels.add(name="team", value=team)
    return spec


@dataclass
class World:
    journals: pb_grpc.JournalStub
    shards: cpb_grpc.ShardStub
    location: grpc.aio.Channel
    http: str
    hidden_header: pb.Header  # A header naming the hidden journal's route, as a peer sends it.


@pytest.fixture
async def world(etcd_server: Any, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[World]:
    for team in ("x", "y"):
        (tmp_path / team).mkdir()
    walked = BrokerHarness(etcd_server.endpoint, etcd_prefix, file_root=str(tmp_path), auth_keys=KEYS)  # fmt: skip
    walked.config.http = HTTPConfig(port=0)
    # The location's own broker (the Location service has keys of its own; its brokers none).
    logs = BrokerHarness(etcd_server.endpoint, f"/gazette-test-logs/{uuid.uuid4().hex[:12]}", id="log-broker")  # fmt: skip
    async with walked, logs:
        channel = grpc.aio.insecure_channel(walked.endpoint.removeprefix("http://"))
        journals = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        changes = [pb.ApplyRequest.Change(upsert=journal_spec(HIDDEN_JOURNAL, "y")),
                   pb.ApplyRequest.Change(upsert=journal_spec(SEEN_JOURNAL, "x"))]  # fmt: skip
        await journals.Apply(pb.ApplyRequest(changes=changes), metadata=admin())
        header = await _routed_header(journals)
        await apply_location_journals(logs.endpoint, "A")
        location = LocationConfig("A", logs.endpoint, etcd_server.endpoint,
                                  prefix=f"/gazette-test-replication/{uuid.uuid4().hex[:12]}", lease=5, auth_keys=KEYS)  # fmt: skip
        async with (
            ConsumerGroup(
                etcd_server,
                walked.endpoint,
                f"/gazette-test-walk/{uuid.uuid4().hex[:12]}",
                auth_keys=KEYS,
            ) as group,  # fmt: skip
            serving(location) as served,
        ):
            consumer = await group.start(WordTotals(str(tmp_path)), run_allocator=False)
            shard_channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
            shards = cpb_grpc.ShardStub(shard_channel)  # type: ignore[no-untyped-call]
            hidden = shard_spec(HIDDEN_SHARD, [HIDDEN_JOURNAL], labels=[("team", "y")])
            hidden.disable = True
            create = cpb.ApplyRequest.Change(upsert=hidden, expect_mod_revision=0)
            assert (await shards.Apply(cpb.ApplyRequest(changes=[create]), metadata=admin())).status == cpb.OK  # fmt: skip
            location_channel = grpc.aio.insecure_channel(served.endpoint.removeprefix("http://"))
            assert walked.broker.http is not None
            try:
                yield World(journals, shards, location_channel,
                            f"http://127.0.0.1:{walked.broker.http.port}", header)  # fmt: skip
            finally:
                await location_channel.close(None)
                await shard_channel.close(None)
        await channel.close(None)


async def _routed_header(journals: pb_grpc.JournalStub) -> pb.Header:
    """The header of a Read of the hidden journal once the broker took it on (a peer's
    Replicate carries such a header)."""
    header = pb.Header()

    async def taken_on() -> bool:
        nonlocal header
        call = journals.Read(pb.ReadRequest(journal=HIDDEN_JOURNAL, block=False), metadata=admin())  # fmt: skip
        first = await call.read()
        call.cancel()
        header = first.header
        return first.status in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE) and first.header.route.primary == 0  # fmt: skip

    await until(taken_on, "the broker took the hidden journal on", timeout=30, interval=0.05)
    return header


# ---- what each RPC does, with the hidden target -------------------------------------------------


async def _first(call: Any) -> Any:
    """The first response of a streaming call (or the answer of a unary one)."""
    if hasattr(call, "read"):
        response = await call.read()
        call.cancel()
        return response
    return await call


def _journal_cases(w: World) -> dict[str, Callable[[Any], Awaitable[Any]]]:
    def append_requests() -> list[pb.AppendRequest]:
        return [pb.AppendRequest(journal=HIDDEN_JOURNAL), pb.AppendRequest(content=b"x"), pb.AppendRequest()]  # fmt: skip

    def replicate_requests() -> list[pb.ReplicateRequest]:
        proposal = pb.Fragment(journal=HIDDEN_JOURNAL, begin=0, end=0)
        return [pb.ReplicateRequest(header=w.hidden_header, proposal=proposal, acknowledge=True)]

    upsert = pb.ApplyRequest.Change(upsert=journal_spec(HIDDEN_JOURNAL, "x"), expect_mod_revision=-1)  # fmt: skip
    return {
        "List": lambda md: _first(w.journals.List(pb.ListRequest(), metadata=md)),
        "Apply": lambda md: w.journals.Apply(pb.ApplyRequest(changes=[upsert]), metadata=md),
        "Read": lambda md: _first(
            w.journals.Read(pb.ReadRequest(journal=HIDDEN_JOURNAL, block=False), metadata=md)
        ),
        "Append": lambda md: w.journals.Append(iter(append_requests()), metadata=md),
        "Replicate": lambda md: _first(
            w.journals.Replicate(iter(replicate_requests()), metadata=md)
        ),
        "ListFragments": lambda md: w.journals.ListFragments(
            pb.FragmentsRequest(journal=HIDDEN_JOURNAL), metadata=md
        ),
        "FragmentStoreHealth": lambda md: w.journals.FragmentStoreHealth(
            pb.FragmentStoreHealthRequest(fragment_store="file:///y/"), metadata=md
        ),
    }


def _shard_cases(w: World) -> dict[str, Callable[[Any], Awaitable[Any]]]:
    moved = shard_spec(HIDDEN_SHARD, [SEEN_JOURNAL], labels=[("team", "x")])
    upsert = cpb.ApplyRequest.Change(upsert=moved, expect_mod_revision=-1)
    return {
        "Stat": lambda md: w.shards.Stat(cpb.StatRequest(shard=HIDDEN_SHARD), metadata=md),
        "List": lambda md: w.shards.List(cpb.ListRequest(), metadata=md),
        "Apply": lambda md: w.shards.Apply(cpb.ApplyRequest(changes=[upsert]), metadata=md),
        "GetHints": lambda md: w.shards.GetHints(
            cpb.GetHintsRequest(shard=HIDDEN_SHARD), metadata=md
        ),
        "Unassign": lambda md: w.shards.Unassign(
            cpb.UnassignRequest(shards=[HIDDEN_SHARD]), metadata=md
        ),
    }


def _location_cases(w: World) -> dict[str, Callable[[Any], Awaitable[Any]]]:
    names = [m.name for m in lpb.DESCRIPTOR.services_by_name["Location"].methods]
    # Checked before the request is parsed: any bytes do.
    return {
        name: (
            lambda md, name=name: w.location.unary_unary(f"/{LOCATION_SERVICE}/{name}")(
                b"", metadata=md, timeout=10
            )
        )
        for name in names
    }


# How the hidden target looks to a token that may call the RPC but whose selector hides it.
HIDDEN: dict[str, Callable[[Any], bool] | grpc.StatusCode] = {
    "/protocol.Journal/List": lambda r: HIDDEN_JOURNAL not in [j.spec.name for j in r.journals],
    "/protocol.Journal/Apply": grpc.StatusCode.UNAUTHENTICATED,
    "/protocol.Journal/Read": lambda r: (
        r.status == pb.JOURNAL_NOT_FOUND and not r.header.route.members
    ),
    "/protocol.Journal/Append": lambda r: r.status == pb.JOURNAL_NOT_FOUND,
    "/protocol.Journal/Replicate": lambda r: r.status == pb.JOURNAL_NOT_FOUND,
    "/protocol.Journal/ListFragments": lambda r: r.status == pb.JOURNAL_NOT_FOUND,
    "/protocol.Journal/FragmentStoreHealth": grpc.StatusCode.UNAUTHENTICATED,
    "/consumer.Shard/Stat": lambda r: r.status == cpb.SHARD_NOT_FOUND,
    "/consumer.Shard/List": lambda r: HIDDEN_SHARD not in [s.spec.id for s in r.shards],
    "/consumer.Shard/Apply": grpc.StatusCode.UNAUTHENTICATED,
    "/consumer.Shard/GetHints": lambda r: r.status == cpb.SHARD_NOT_FOUND,
    "/consumer.Shard/Unassign": grpc.StatusCode.UNAUTHENTICATED,
    **{
        f"/{LOCATION_SERVICE}/{m.name}": grpc.StatusCode.NOT_FOUND
        for m in lpb.DESCRIPTOR.services_by_name["Location"].methods
    },
}


def every_method() -> list[str]:
    out: list[str] = []
    for module in (pb, cpb, lpb):
        for service in module.DESCRIPTOR.services_by_name.values():
            out.extend(f"/{service.full_name}/{m.name}" for m in service.methods)
    return out


def test_every_rpc_of_every_service_has_a_capability_and_a_case() -> None:
    methods = every_method()
    assert len(methods) == 21
    assert sorted(set(methods) - set(auth.METHOD_CAPABILITY)) == []
    assert sorted(set(methods) - set(HIDDEN)) == []


async def _outcome(call: Callable[[Any], Awaitable[Any]], md: Any) -> Any:
    try:
        return await call(md)
    except grpc.aio.AioRpcError as exc:
        return exc


async def test_each_rpc_refuses_a_token_without_its_capability_and_hides_what_the_selector_hides(
    world: World,
) -> None:
    cases = {
        **{f"/protocol.Journal/{k}": v for k, v in _journal_cases(world).items()},
        **{f"/consumer.Shard/{k}": v for k, v in _shard_cases(world).items()},
        **{f"/{LOCATION_SERVICE}/{k}": v for k, v in _location_cases(world).items()},
    }
    assert sorted(cases) == sorted(every_method())
    problems = []
    for method, call in sorted(cases.items()):
        needed = auth.METHOD_CAPABILITY[method]
        lacking = await _outcome(call, metadata(auth.ALL & ~needed))
        if not (
            isinstance(lacking, grpc.aio.AioRpcError)
            and lacking.code() == grpc.StatusCode.UNAUTHENTICATED
            and f"missing required {NAMES[needed]} capability" in (lacking.details() or "")
        ):
            problems.append(f"{method} without {NAMES[needed]}: {lacking!r}")
        hidden = await _outcome(call, metadata(auth.ALL, team_x()))
        expected = HIDDEN[method]
        if isinstance(expected, grpc.StatusCode):
            ok = isinstance(hidden, grpc.aio.AioRpcError) and hidden.code() == expected
        else:
            ok = not isinstance(hidden, grpc.aio.AioRpcError) and expected(hidden)
        if not ok:
            problems.append(f"{method} with a hiding selector: {hidden!r}")
    assert problems == []


async def test_the_http_gateway_refuses_without_the_capability_and_hides_what_the_selector_hides(
    world: World,
) -> None:
    def bearer(md: tuple[tuple[str, str], ...]) -> dict[str, str]:
        return {"Authorization": md[0][1]}

    url = f"{world.http}/{HIDDEN_JOURNAL}"
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(url, headers=bearer(metadata(auth.ALL & ~auth.READ)))).status_code == 401  # fmt: skip
        assert (await client.put(url, content=b"x", headers=bearer(metadata(auth.ALL & ~auth.APPEND)))).status_code == 401  # fmt: skip
        hiding = bearer(metadata(auth.ALL, team_x()))
        assert (await client.get(url, headers=hiding)).status_code == 404
        assert (await client.put(url, content=b"x", headers=hiding)).status_code == 404
        seen = f"{world.http}/{SEEN_JOURNAL}"
        assert (await client.put(seen, content=b"x\n", headers=hiding)).status_code == 204
