"""Escape attempts through the fields that name a journal or a shard directly (the RPCs' `journal`,
`shard`, `delete` and `shards` fields, the gateway's path) and through the fields a peer's
Replicate proposal carries (`backing_store`, `path_postfix`, `journal`), made by a `team=x` token
with every capability. Each spelling of a hidden name is generated, and each must find nothing:
the hidden journal's content never comes back, nothing is appended to it, the hidden shard is
neither revealed nor unassigned. Collected through tests/test_tenant_escape.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import httpx
import pytest

from broker.client.routes import append_routed
from broker.protocol import consumer_pb2 as cpb
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import BrokerHarness
from consumer.testing import ConsumerGroup, shard_spec
from plumbing import auth
from plumbing.credentials import Credentials
from plumbing.debug_http import HTTPConfig
from tests.helpers.consumers import WordTotals
from tests.helpers.tenancy import KEYS, SIGNER, admin, md, spec, team

__all__ = [
    "names_world",
    "test_a_replicate_proposal_cannot_name_a_store_or_postfix_of_its_own",
    "test_spellings_of_a_hidden_journal_in_the_gateways_path_find_nothing",
    "test_spellings_of_a_hidden_journal_name_find_nothing_in_any_journal_rpc",
    "test_spellings_of_a_hidden_shard_id_find_nothing_in_any_shard_rpc",
    "test_stats_read_through_names_only_the_shards_own_sources",
]

HIDDEN, SEEN, HIDDEN_SHARD = "names/hidden", "names/seen", "names/hidden-shard"
# x's journal that nothing appends to: no pipeline of its primary holds its spool, so a
# Replicate reaches the spool at once (an idle pipeline keeps it until it is released).
REPLICATED = "names/replicated"
SECRET = b"the hidden journal's secret\n"


def spellings(name: str) -> list[str]:
    """Other ways to write `name` that a lax resolver might take for it: traversal, doubled and
    trailing separators, meta suffixes, case, escapes, NUL and whitespace."""
    head, _, tail = name.rpartition("/")
    return sorted(
        {
            name + ";",
            name + ";meta",
            name + "/",
            "/" + name,
            "./" + name,
            f"{head}/./{tail}",
            f"{head}//{tail}",
            f"{head}/x/../{tail}",
            f"{head}/{tail}/.",
            name.upper(),
            quote(name, safe=""),
            name.replace("/", "%2F"),
            name + "\x00",
            name + " ",
            " " + name,
            name + "\n",
            name + "/../" + tail,
        }
    )


@dataclass
class NamesWorld:
    journals: pb_grpc.JournalStub
    shards: cpb_grpc.ShardStub
    http: str
    root: Path


@pytest.fixture
async def names_world(etcd_server: Any, etcd_prefix: str, tmp_path: Path) -> AsyncIterator[NamesWorld]:  # fmt: skip
    for owner in ("x", "y"):
        (tmp_path / owner).mkdir()
    harness = BrokerHarness(etcd_server.endpoint, etcd_prefix, file_root=str(tmp_path), auth_keys=KEYS)  # fmt: skip
    harness.config.http = HTTPConfig(port=0)
    async with harness:
        channel = grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://"))
        journals = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        changes = [
            pb.ApplyRequest.Change(upsert=spec(HIDDEN, "y", "file:///y/")),
            pb.ApplyRequest.Change(upsert=spec(SEEN, "x", "file:///x/")),
            pb.ApplyRequest.Change(upsert=spec(REPLICATED, "x", "file:///x/")),
        ]
        await journals.Apply(pb.ApplyRequest(changes=changes), metadata=admin())
        signing = auth.authorized_channel(
            grpc.aio.insecure_channel(harness.endpoint.removeprefix("http://")), SIGNER
        )
        owner = pb_grpc.JournalStub(signing)  # type: ignore[no-untyped-call]
        assert (await append_routed(owner, HIDDEN, SECRET)).status == pb.OK
        assert (await append_routed(owner, SEEN, b"x's own\n")).status == pb.OK
        await signing.close(None)
        root = f"/gazette-test-names/{uuid.uuid4().hex[:12]}"
        credentials = Credentials(auth=auth.authorizer_of(KEYS))  # The consumer's, to brokers.
        async with ConsumerGroup(
            etcd_server, harness.endpoint, root, auth_keys=KEYS, broker_credentials=credentials
        ) as group:
            consumer = await group.start(WordTotals(str(tmp_path)))
            shard_channel = grpc.aio.insecure_channel(consumer.endpoint.removeprefix("http://"))
            shards = cpb_grpc.ShardStub(shard_channel)  # type: ignore[no-untyped-call]
            hidden = shard_spec(HIDDEN_SHARD, [HIDDEN], labels=[("team", "y")])
            hidden.disable = True
            create = cpb.ApplyRequest.Change(upsert=hidden, expect_mod_revision=0)
            applied = await shards.Apply(cpb.ApplyRequest(changes=[create]), metadata=admin())
            assert applied.status == cpb.OK
            assert harness.broker.http is not None
            try:
                yield NamesWorld(journals, shards, f"http://127.0.0.1:{harness.broker.http.port}", tmp_path)  # fmt: skip
            finally:
                await shard_channel.close(None)
        await channel.close(None)


async def _append(journals: pb_grpc.JournalStub, journal: str, content: bytes, metadata: Any) -> pb.AppendResponse:  # fmt: skip
    async def requests() -> AsyncIterator[pb.AppendRequest]:
        yield pb.AppendRequest(journal=journal)
        yield pb.AppendRequest(content=content)
        yield pb.AppendRequest()

    async with asyncio.timeout(30):
        return await journals.Append(requests(), metadata=metadata)  # type: ignore[no-any-return]


async def _read_all(journals: pb_grpc.JournalStub, journal: str, metadata: Any) -> tuple[list[int], bytes]:  # fmt: skip
    """Every status and every byte a non-blocking Read of `journal` answers (or the refusal)."""
    statuses: list[int] = []
    content = b""
    try:
        call = journals.Read(pb.ReadRequest(journal=journal, block=False), metadata=metadata)
        async for response in call:
            statuses.append(response.status)
            content += response.content
    except grpc.aio.AioRpcError as exc:
        statuses.append(-int(exc.code().value[0]))
    return statuses, content


async def _write_head(journals: pb_grpc.JournalStub, journal: str) -> int:
    call = journals.Read(pb.ReadRequest(journal=journal, block=False, metadata_only=True), metadata=admin())  # fmt: skip
    first = await call.read()
    call.cancel()
    return int(first.write_head)


async def test_spellings_of_a_hidden_journal_name_find_nothing_in_any_journal_rpc(
    names_world: NamesWorld,
) -> None:
    x = md(auth.ALL, team("x"))
    journals = names_world.journals
    head = await _write_head(journals, HIDDEN)
    assert head == len(SECRET)
    # The token works: its own journal reads as written.
    assert (await _read_all(journals, SEEN, x))[1] == b"x's own\n"
    leaks = []
    for name in spellings(HIDDEN):
        statuses, content = await _read_all(journals, name, x)
        if content or pb.OK in statuses:
            leaks.append(f"Read {name!r}: {statuses} {content!r}")
        try:
            appended = await _append(journals, name, b"planted by x\n", x)
            if appended.status == pb.OK:
                leaks.append(f"Append {name!r} was accepted")
        except grpc.aio.AioRpcError:
            pass
        try:
            listed = await journals.ListFragments(pb.FragmentsRequest(journal=name), metadata=x)
            if listed.status == pb.OK:
                leaks.append(f"ListFragments {name!r}: {listed}")
        except grpc.aio.AioRpcError:
            pass
        try:
            delete = pb.ApplyRequest.Change(delete=name, expect_mod_revision=-1)
            await journals.Apply(pb.ApplyRequest(changes=[delete]), metadata=x)
            leaks.append(f"Apply delete {name!r} was accepted")
        except grpc.aio.AioRpcError:
            pass
    assert leaks == []
    # Nothing reached the hidden journal, which still serves its owner as before.
    assert await _write_head(journals, HIDDEN) == head
    assert (await _read_all(journals, HIDDEN, admin()))[1] == SECRET


async def test_spellings_of_a_hidden_shard_id_find_nothing_in_any_shard_rpc(
    names_world: NamesWorld,
) -> None:
    x = md(auth.ALL, team("x"))
    shards = names_world.shards
    leaks = []
    for shard_id in [HIDDEN_SHARD, *spellings(HIDDEN_SHARD)]:
        delete = cpb.ApplyRequest.Change(delete=shard_id, expect_mod_revision=-1)
        calls: list[tuple[str, Any]] = [
            ("Stat", shards.Stat(cpb.StatRequest(shard=shard_id), metadata=x)),
            ("GetHints", shards.GetHints(cpb.GetHintsRequest(shard=shard_id), metadata=x)),
            ("Unassign", shards.Unassign(cpb.UnassignRequest(shards=[shard_id]), metadata=x)),
            ("Apply delete", shards.Apply(cpb.ApplyRequest(changes=[delete]), metadata=x)),
        ]
        for name, call in calls:
            try:
                answer = await call
            except grpc.aio.AioRpcError as exc:
                refusals = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)
                if exc.code() not in refusals:
                    leaks.append(f"{name} {shard_id!r}: {exc.code()} {exc.details()}")
                continue
            if answer.status == cpb.OK:
                leaks.append(f"{name} {shard_id!r} answered OK: {answer}")
    assert leaks == []
    listed = await shards.List(cpb.ListRequest(), metadata=admin())
    assert [s.spec.id for s in listed.shards] == [HIDDEN_SHARD]


async def test_spellings_of_a_hidden_journal_in_the_gateways_path_find_nothing(
    names_world: NamesWorld,
) -> None:
    hiding = {"Authorization": md(auth.ALL, team("x"))[0][1]}
    journals = names_world.journals
    head = await _write_head(journals, HIDDEN)
    paths = sorted(
        {
            f"/{HIDDEN}",
            f"//{HIDDEN}",
            "/names/./hidden",
            "/names/x/../hidden",
            "/names/seen/../hidden",
            "/names%2Fhidden",
            "/names/%68idden",
            f"/{HIDDEN};meta",
            f"/{HIDDEN}/",
            f"/{HIDDEN}?journal=names/seen",
            f"/names/seen?journal={HIDDEN}",
        }
    )
    leaks = []
    async with httpx.AsyncClient(timeout=10) as client:
        own = await client.get(f"{names_world.http}/{SEEN}", headers=hiding)
        assert own.status_code in (200, 206) and own.content == b"x's own\n", own
        for path in paths:
            # httpx would normalise dot segments: send the path as written.
            url = httpx.URL(names_world.http).copy_with(raw_path=path.encode())
            got = await client.get(url, headers=hiding)
            if got.status_code < 400 and SECRET.strip() in got.content:
                leaks.append(f"GET {path}: {got.status_code} {got.content!r}")
            put = await client.put(url, content=b"planted by x\n", headers=hiding)
            if put.status_code < 300 and await _write_head(journals, HIDDEN) != head:
                leaks.append(f"PUT {path}: {put.status_code} reached the hidden journal")
    assert leaks == []
    assert await _write_head(journals, HIDDEN) == head


async def test_a_replicate_proposal_cannot_name_a_store_or_postfix_of_its_own(
    names_world: NamesWorld,
) -> None:
    """A token with REPLICATE over its own journal acts as a primary would, but the proposal's
    `backing_store` and `path_postfix` are the persister's to set, not a peer's: a proposal that
    carries them is refused as a mismatch, and nothing is written to the other tenant's store."""
    x = md(auth.ALL, team("x"))
    journals = names_world.journals
    call = journals.Read(pb.ReadRequest(journal=REPLICATED, block=False, metadata_only=True), metadata=admin())  # fmt: skip
    header = (await call.read()).header
    call.cancel()
    before = sorted(p.relative_to(names_world.root) for p in (names_world.root / "y").rglob("*"))
    for field, value in (
        ("backing_store", "file:///y/"),
        ("path_postfix", "../../y/names/hidden"),
        ("journal", HIDDEN),
    ):
        proposal = pb.Fragment(journal=REPLICATED, begin=0, end=0)
        setattr(proposal, field, value)
        try:
            replicate = journals.Replicate(
                iter([pb.ReplicateRequest(header=header, proposal=proposal, acknowledge=True)]),
                metadata=x,
            )
            response = await replicate.read()
            replicate.cancel()
            assert response.status != pb.OK or field != "journal", (field, response)
            if field != "journal":
                # Either refused outright or answered with the replica's own fragment.
                assert response.status != pb.OK or not response.fragment.backing_store, response
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT), exc  # fmt: skip
    after = sorted(p.relative_to(names_world.root) for p in (names_world.root / "y").rglob("*"))
    assert after == before
    assert (await _read_all(journals, HIDDEN, admin()))[1] == SECRET


async def test_stats_read_through_names_only_the_shards_own_sources(
    names_world: NamesWorld,
) -> None:
    """Stat's `read_through` names journals the shard must have read through: only its own
    sources (authorized when the shard was applied). A hidden journal there is refused exactly
    as a journal that does not exist, and the Stat waits on nothing of it."""
    x = md(auth.ALL, team("x"))
    shards = names_world.shards
    source = spec("names/x-input", "x", "file:///x/")
    source.labels.labels.insert(0, pb.Label(name="content-type", value="application/x-ndjson"))
    change = pb.ApplyRequest.Change(upsert=source, expect_mod_revision=0)
    await names_world.journals.Apply(pb.ApplyRequest(changes=[change]), metadata=x)
    own = shard_spec("names/x-shard", [source.name], labels=[("team", "x")])
    create = cpb.ApplyRequest.Change(upsert=own, expect_mod_revision=0)
    assert (await shards.Apply(cpb.ApplyRequest(changes=[create]), metadata=x)).status == cpb.OK
    async with asyncio.timeout(30):
        while (await shards.Stat(cpb.StatRequest(shard=own.id), metadata=x)).status != cpb.OK:
            await asyncio.sleep(0.05)
    answers = {}
    for journal in (HIDDEN, "names/absent", *spellings(HIDDEN)):
        request = cpb.StatRequest(shard=own.id, read_through={journal: 1})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await shards.Stat(request, metadata=x)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        answers[journal] = (refused.value.details() or "").replace(journal, "J")
    assert answers[HIDDEN] == answers["names/absent"], answers
    served = await shards.Stat(cpb.StatRequest(shard=own.id, read_through={source.name: 0}), metadata=x)  # fmt: skip
    assert served.status == cpb.OK
