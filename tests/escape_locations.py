"""Escape attempts on the Location service (issue 37, defect 5): a token that selects only
location A's log journal, with every capability, names another location in a request to A.

Two real location processes, A (its journal labelled `team=x`) and B (`team=y`), serve on a
real broker and etcd, their Location service verifying tokens with tests/test_tenancy's key and
their own calls to each other signed with it (as `python -m replication serve` is deployed).
The attacker's token selects A's journal only (three spellings); B answers it NOT_FOUND.

Every field of every Location request that can carry a location's name is found from the
service's descriptors (every string field and map key, at any depth, in every branch of a
`oneof`, except the replication filters' texts), and filled with B, with an unregistered name
and with spellings of B, in a request to A. Each must be refused as B refuses the token
(NOT_FOUND, "no location NAME"), and leave nothing behind: A's view names no other location,
A's log holds none of B's events, B was not changed and still emits. A filter naming B reads
nothing of B's and answers as for a name that does not exist. Recover, which asks every
registered location and may reset their progress, is refused to a token that does not select
them all, without naming one. The positive case: a token selecting both connects them, and A
then holds B's events. Collected through tests/test_tenant_escape.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, stop_process
from broker.testing.processes import BrokerProcess, start_broker_process
from plumbing import auth
from replication import location_pb2 as lpb
from replication import location_pb2_grpc as lpb_grpc
from replication import registry
from replication.journals import location_journal, location_journal_spec
from tests.helpers.server_fork import ForkedPopen
from tests.helpers.tenancy import KEYS, md
from tests.helpers.waiting import until

__all__ = [
    "location_network",
    "test_a_filter_naming_a_hidden_location_reads_nothing_of_it",
    "test_a_location_name_in_any_request_field_is_refused_as_if_it_did_not_exist",
    "test_a_location_whose_log_cannot_be_listed_is_refused_as_if_it_did_not_exist",
    "test_a_token_that_selects_both_locations_connects_them",
    "test_recover_is_refused_to_a_token_that_does_not_select_every_location",
    "test_the_generated_attempts_cover_every_name_field_of_the_service",
    "test_those_not_heard_from_are_listed_only_as_the_caller_sees_them",
]

SECRET = "B's secret"
# Spellings of the victim's name: itself, a name nobody registered, and names a lax lookup
# might take for it (case, its journal's name, traversal, trailing space).
VICTIMS = ["B", "Z", "b", "replication/B", "../B", "B "]
TEAMS = {"A": "x", "B": "y", "C": "x", "D": "y", "F": "x"}


def _selector(**labels: str) -> pb.LabelSelector:
    sel = pb.LabelSelector()
    for name, value in labels.items():
        sel.include.labels.add(name=name, value=value)
    return sel


# The attacker's selectors: each selects A's log journal and not B's.
ATTACKERS = {
    "name": _selector(name=location_journal("A")),
    "prefix": _selector(prefix=location_journal("A")),
    "team": _selector(team="x"),
}


# ---- the fields that name a location, from the service's descriptors -----------------------------

NOT_NAMES = {"filter"}  # A replication filter's text: an event selector, not a location's name.


@dataclass(frozen=True)
class NameField:
    """A field of a Location request that carries a location's name: `path` from the request
    down to it, each step a field name (a map's key is the last step's key)."""

    method: str
    path: tuple[str, ...]
    kind: str  # "string", "repeated" or "map key".

    def __str__(self) -> str:
        return f"{self.method}.{'.'.join(self.path)}"


def name_fields() -> list[NameField]:
    """Every string field and string map key of every Location request message (any depth,
    every branch of a oneof), less the filters' texts."""
    service = lpb.DESCRIPTOR.services_by_name["Location"]
    out = []
    for method in service.methods:
        for path, kind in _strings(method.input_type, ()):
            out.append(NameField(method.name, path, kind))
    return out


def _strings(descriptor: Descriptor, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:  # fmt: skip
    for f in descriptor.fields:
        here = (*path, f.name)
        if f.name in NOT_NAMES:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            if f.message_type.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING:
                yield here, "map key"
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            yield from _strings(f.message_type, here)
        elif f.type == FieldDescriptor.TYPE_STRING:
            yield here, "repeated" if f.is_repeated else "string"


def request_naming(where: NameField, name: str) -> Message:
    """A request of `where.method` whose field `where` carries `name`, and whose other name
    fields on the way (a connection's other end) name A: the worst that field can do. A
    Change is asked to be recorded."""
    service = lpb.DESCRIPTOR.services_by_name["Location"]
    request: Any = getattr(lpb, service.methods_by_name[where.method].input_type.name)()
    if where.method == "Change":
        request.record = True
    message = request
    for step in where.path[:-1]:
        message = getattr(message, step)
    for sibling in message.DESCRIPTOR.fields:  # The other ends of a connection or fail-over.
        named = sibling.type == FieldDescriptor.TYPE_STRING and sibling.name not in NOT_NAMES
        if named and not sibling.is_repeated:
            setattr(message, sibling.name, "A")
    last = where.path[-1]
    if where.kind == "map key":
        getattr(message, last)[name] = 1
    elif where.kind == "repeated":
        getattr(message, last).append(name)
    else:
        setattr(message, last, name)
    return request  # type: ignore[no-any-return]


NAME_FIELDS = name_fields()


# ---- the network ---------------------------------------------------------------------------------


@dataclass
class Network:
    """Location processes on one broker and etcd, by name, with their endpoints."""

    etcd: EtcdServer
    broker: BrokerProcess
    prefix: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    endpoints: dict[str, str] = field(default_factory=dict)

    def start(self, name: str) -> None:
        """Start location `name`'s process: its service verifies tokens with KEYS, and its own
        calls (to the broker, to other locations) are signed with them."""
        log = self.logs / f"{name}.log"
        env = {**os.environ, "REPLICATION_AUTH_KEYS": KEYS, "BROKER_AUTH_KEYS": KEYS}
        with log.open("ab") as out:
            self.procs[name] = ForkedPopen(
                [
                    sys.executable, "-m", "replication", "serve", "--location", name,
                    "--broker.address", self.broker.address,
                    "--etcd.address", self.etcd.endpoint, "--replication.prefix", self.prefix,
                    "--etcd.lease", "2s",
                ],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while "serving at" not in log.read_text():
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"location {name} exited: {log.read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"location {name} did not start"
            time.sleep(0.05)
        self.endpoints[name] = log.read_text().rsplit("serving at ", 1)[1].split()[0]

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)


async def _apply_journals(broker: str, *names: str) -> None:
    """The logs' journals, each labelled with its team (so a `team=` selector picks it)."""
    changes = []
    for name in names:
        spec = location_journal_spec(name)
        spec.labels.labels.add(name="team", value=TEAMS[name])
        changes.append(pb.ApplyRequest.Change(upsert=spec))
    async with JournalsClient(broker) as client:
        await client.apply(changes)


def _start_network(etcd: EtcdServer, logs: Path, *names: str) -> Network:
    logs.mkdir(parents=True, exist_ok=True)
    broker = start_broker_process(etcd, f"/gazette-test/{uuid.uuid4().hex[:12]}", logs / "broker.log")  # fmt: skip
    net = Network(etcd, broker, f"/gazette-test/{uuid.uuid4().hex[:12]}/replication", logs)
    try:
        asyncio.run(_apply_journals(broker.address, *names))
        for name in names:
            net.start(name)
    except BaseException:
        net.stop()
        stop_process(broker.proc)
        raise
    return net


@pytest.fixture(scope="module")
def location_network(
    etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Network]:
    """A (team x) and B (team y) serving, B holding one event, both having heard from each
    other; D (team y) declared but not running (its process down), as `gazctl replication add`
    leaves a location until a host runs it."""
    net = _start_network(etcd_server, tmp_path_factory.mktemp("locations"), "A", "B")
    try:

        async def prepare() -> None:
            async with grpc.aio.insecure_channel(_target(net, "B")) as channel:
                stub = lpb_grpc.LocationStub(channel)  # type: ignore[no-untyped-call]
                await _clock_ok(stub)
                payload = json.dumps({"secret": SECRET}).encode()
                await stub.Emit(lpb.EmitRequest(payloads=[payload]), metadata=md(), timeout=10)
            async with grpc.aio.insecure_channel(_target(net, "A")) as channel:
                # A has heard from B too: D, declared next, is not waited for by either.
                await _clock_ok(lpb_grpc.LocationStub(channel))  # type: ignore[no-untyped-call]
            await _apply_journals(net.broker.address, "D")
            etcd = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
            await etcd.connect()
            try:
                declaration = {"journal": location_journal("D"), "broker": net.broker.address}
                await etcd.put(registry.location_key(net.prefix, "D"), json.dumps(declaration).encode())  # fmt: skip
            finally:
                await etcd.close()

        asyncio.run(prepare())
        yield net
    finally:
        net.stop()
        stop_process(net.broker.proc)


def _target(net: Network, name: str) -> str:
    return net.endpoints[name].removeprefix("http://")


@contextlib.asynccontextmanager
async def _stubs_of_a_and_b(net: Network) -> AsyncIterator[tuple[Any, Any]]:
    """Location stubs of A and B, their channels closed after."""
    async with (
        grpc.aio.insecure_channel(_target(net, "A")) as ca,
        grpc.aio.insecure_channel(_target(net, "B")) as cb,
    ):
        yield lpb_grpc.LocationStub(ca), lpb_grpc.LocationStub(cb)  # type: ignore[no-untyped-call]


async def _clock_ok(stub: Any) -> None:
    """Until the location may emit (it has heard from every registered location)."""

    async def heard() -> bool:
        status = await stub.Status(lpb.StatusRequest(), metadata=md(), timeout=10)
        return bool(status.clock_ok)

    await until(heard)


# ---- what an attempt must leave ------------------------------------------------------------------


def _emitters(records: bytes) -> list[str]:
    return [json.loads(line).get("emitter", "") for line in records.decode().splitlines() if line]


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def _nothing_of_b_at_a(a: Any, b: Any, attacker: Any) -> None:
    """A's view names no other location, A's log holds nothing of B's (read as the attacker
    reads it), B was not changed, and B still emits."""
    status = await a.Status(lpb.StatusRequest(), metadata=md(), timeout=10)
    assert not status.history and not status.connections and not status.progress, status
    assert set(status.cvv.times) <= {"A"}, status.cvv
    read = await a.Read(lpb.ReadRequest(after=0, limit=1000), metadata=attacker, timeout=10)
    assert "B" not in _emitters(read.records) and SECRET.encode() not in read.records
    theirs = await b.Status(lpb.StatusRequest(), metadata=md(), timeout=10)
    assert not theirs.history and not theirs.connections and not theirs.progress, theirs
    emitted = await b.Emit(lpb.EmitRequest(payloads=[b'{"still": "B"}']), metadata=md(), timeout=10)  # fmt: skip
    assert [e.emitter for e in emitted.events] == ["B"]


# ---- the attempts --------------------------------------------------------------------------------


def test_the_generated_attempts_cover_every_name_field_of_the_service() -> None:
    """The generator finds the fields the proto has (a new field naming a location is attacked
    without anyone listing it here; this is what it finds today)."""
    assert sorted(map(str, NAME_FIELDS)) == [
        "Change.change.connected.source",
        "Change.change.connected.target",
        "Change.change.disconnected.source",
        "Change.change.disconnected.target",
        "Change.change.failed_over.previous",
        "Change.change.failed_over.source",
        "Change.change.failed_over.target",
        "Change.change.filtered.source",
        "Change.change.filtered.target",
        "Change.change.retired",
        "Join.sources",
        "Read.cvv.times",
        "Read.or_emitter",
        "ResetProgress.source",
        "TrustClock.without",
    ]
    # No request carries an endpoint or address: a location dials only what the registry
    # (etcd, the root of trust) says of a location.
    for f in NAME_FIELDS:
        assert not any(w in step for step in f.path for w in ("endpoint", "address", "broker"))


@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
@pytest.mark.parametrize("victim", VICTIMS)
@pytest.mark.parametrize("where", NAME_FIELDS, ids=str)
async def test_a_location_name_in_any_request_field_is_refused_as_if_it_did_not_exist(
    location_network: Network, where: NameField, victim: str, attacker: str
) -> None:
    net = location_network
    token = md(auth.ALL, ATTACKERS[attacker])
    async with _stubs_of_a_and_b(net) as (a, b):
        # The token does not see B: B itself says so.
        unseen = await _refused(b.Status(lpb.StatusRequest(), metadata=token, timeout=10))
        assert (unseen.code(), unseen.details()) == (grpc.StatusCode.NOT_FOUND, "no location B")
        request = request_naming(where, victim)
        refused = await _refused(getattr(a, where.method)(request, metadata=token, timeout=10))
        assert (refused.code(), refused.details()) == (
            grpc.StatusCode.NOT_FOUND,
            f"no location {victim}",
        ), request
        await _nothing_of_b_at_a(a, b, token)


@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
async def test_a_filter_naming_a_hidden_location_reads_nothing_of_it(
    location_network: Network, attacker: str
) -> None:
    """A filter is an event selector over A's own log, not a location's name: one naming B
    returns nothing of B's, and the same answer as one naming a location nobody registered."""
    net = location_network
    token = md(auth.ALL, ATTACKERS[attacker])
    async with _stubs_of_a_and_b(net) as (a, b):
        answers = []
        for name in ("B", "Z"):
            read = await a.Read(lpb.ReadRequest(filter=f"emitter={name}"), metadata=token, timeout=10)  # fmt: skip
            assert read.records == b"" and SECRET.encode() not in read.records
            answers.append(read)
            looped = lpb.Change.Connection(source="A", target="A", filter=f"emitter={name}")
            change = lpb.ChangeRequest(change=lpb.Change(connected=looped), record=True)
            refused = await _refused(a.Change(change, metadata=token, timeout=10))
            answers.append((refused.code(), refused.details().replace(name, "?")))  # type: ignore[arg-type]
        assert answers[0] == answers[2] and answers[1] == answers[3], answers
        await _nothing_of_b_at_a(a, b, token)


@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
async def test_recover_is_refused_to_a_token_that_does_not_select_every_location(
    location_network: Network, attacker: str
) -> None:
    """Recover asks every registered location (any may hold A's latest times) and may reset
    their progress for A: refused to a token that does not select them all, and the refusal
    names none of them (neither B, nor D whose process is down)."""
    net = location_network
    token = md(auth.ALL, ATTACKERS[attacker])
    async with _stubs_of_a_and_b(net) as (a, b):
        refused = await _refused(a.Recover(lpb.RecoverRequest(), metadata=token, timeout=30))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused
        details = refused.details() or ""
        assert "B" not in details and "D" not in details, details
        await _nothing_of_b_at_a(a, b, token)


async def _declare(net: Network, name: str, broker: str) -> None:
    """Declare location `name` in the registry, its log at `broker`, as `gazctl replication
    add` does before a host runs it."""
    etcd = aetcd.Client(host=net.etcd.host, port=net.etcd.client_port)
    await etcd.connect()
    try:
        declaration = {"journal": location_journal(name), "broker": broker}
        await etcd.put(registry.location_key(net.prefix, name), json.dumps(declaration).encode())  # fmt: skip
    finally:
        await etcd.close()


async def test_a_location_whose_log_cannot_be_listed_is_refused_as_if_it_did_not_exist(
    location_network: Network,
) -> None:
    """Fail closed: F is declared (its journal labelled team x, as the token selects) at a
    broker that does not answer, so its labels cannot be listed. A token of team x naming F
    is answered as for a location it does not see, in the time the listing is given; the
    operator's token reaches the check the call makes (F has no process)."""
    net = location_network
    await _declare(net, "F", "http://127.0.0.1:9")  # The discard port: nothing answers.
    token = md(auth.ALL, _selector(team="x"))
    async with grpc.aio.insecure_channel(_target(net, "A")) as ca:
        a = lpb_grpc.LocationStub(ca)  # type: ignore[no-untyped-call]
        join = lpb.JoinRequest(sources=["F"])
        refused = await _refused(a.Join(join, metadata=token, timeout=30))
        assert (refused.code(), refused.details()) == (grpc.StatusCode.NOT_FOUND, "no location F")  # fmt: skip
        operator = await _refused(a.Join(join, metadata=md(), timeout=30))
        assert operator.code() == grpc.StatusCode.UNAVAILABLE, operator


async def test_those_not_heard_from_are_listed_only_as_the_caller_sees_them(
    location_network: Network,
) -> None:
    """The registry's names are not the caller's: C (team x) starts after D (team y) was
    declared and never runs, so C has not heard from D and may not emit. The operator is told
    D's name; a team x token is told neither in Status, nor in Emit's or TrustClock's refusal,
    and naming D is refused as for a location that does not exist."""
    net = location_network
    if "C" not in net.procs:
        await _apply_journals(net.broker.address, "C")
        await asyncio.to_thread(net.start, "C")
    token = md(auth.ALL, _selector(team="x"))
    async with grpc.aio.insecure_channel(_target(net, "C")) as cc:
        c = lpb_grpc.LocationStub(cc)  # type: ignore[no-untyped-call]
        operator = await c.Status(lpb.StatusRequest(), metadata=md(), timeout=10)
        assert not operator.clock_ok and "D" in operator.unheard, operator
        status = await c.Status(lpb.StatusRequest(), metadata=token, timeout=10)
        assert not status.clock_ok and "D" not in status.unheard, status
        emit = await _refused(c.Emit(lpb.EmitRequest(payloads=[b"{}"]), metadata=token, timeout=10))  # fmt: skip
        assert emit.code() == grpc.StatusCode.FAILED_PRECONDITION, emit
        assert "D" not in (emit.details() or ""), emit.details()
        stranger = await _refused(c.TrustClock(lpb.TrustClockRequest(without=["A"]), metadata=token, timeout=10))  # fmt: skip
        assert stranger.code() == grpc.StatusCode.INVALID_ARGUMENT, stranger
        assert "D" not in (stranger.details() or ""), stranger.details()
        named = await _refused(c.TrustClock(lpb.TrustClockRequest(without=["D"]), metadata=token, timeout=10))  # fmt: skip
        assert (named.code(), named.details()) == (grpc.StatusCode.NOT_FOUND, "no location D")
        still = await c.Status(lpb.StatusRequest(), metadata=md(), timeout=10)
        assert not still.clock_ok and "D" in still.unheard, still


def test_a_token_that_selects_both_locations_connects_them(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """The positive case: a token selecting both logs (`team in (x, y)`; or A's and C's names)
    connects B -> A (one command, recorded in etcd's history; the same call at the other end
    is accepted as in effect), both logs come to hold it, and A's log then holds B's event; it resets A's progress for
    B, joins and trusts the clock naming B. A location both see may be named; one it does not
    is still refused."""
    net = _start_network(etcd_server, tmp_path, "A", "B", "C")

    async def go() -> None:
        both = pb.LabelSelector()
        both.include.labels.add(name="team", value="x")
        both.include.labels.add(name="team", value="y")
        token = md(auth.ALL, both)
        async with _stubs_of_a_and_b(net) as (a, b):
            for stub in (a, b):
                await _clock_ok(stub)
            payload = json.dumps({"secret": SECRET}).encode()
            await b.Emit(lpb.EmitRequest(payloads=[payload]), metadata=token, timeout=10)
            # A token of team x (A and C) names C, which it sees, and not B.
            x = md(auth.ALL, _selector(team="x"))
            join_c = await a.Join(lpb.JoinRequest(sources=["C"]), metadata=x, timeout=10)
            assert join_c is not None
            refused = await _refused(a.Join(lpb.JoinRequest(sources=["C", "B"]), metadata=x, timeout=10))  # fmt: skip
            assert (refused.code(), refused.details()) == (grpc.StatusCode.NOT_FOUND, "no location B")  # fmt: skip
            connect = lpb.ChangeRequest(
                change=lpb.Change(connected=lpb.Change.Connection(source="B", target="A")), record=True
            )  # fmt: skip
            # One whole command records it in etcd's history (then in A's log); the same call
            # at the other end finds it in effect and is accepted, not refused. Whether B's
            # call stores an event depends on whether B's follower of etcd's history recorded
            # it first, so only the acceptance is asserted; both logs then hold the change.
            assert (await a.Change(connect, metadata=token, timeout=10)).recorded
            await b.Change(connect, metadata=token, timeout=10)

            def connected(status: Any) -> bool:
                return any(
                    kc.change.WhichOneof("change") == "connected"
                    and (kc.change.connected.source, kc.change.connected.target) == ("B", "A")
                    for kc in status.history
                )

            for stub in (a, b):

                async def holds(stub: Any = stub) -> bool:
                    return connected(await stub.Status(lpb.StatusRequest(), metadata=token, timeout=10))  # fmt: skip

                await until(holds)

            async def arrived() -> bool:
                read = await a.Read(lpb.ReadRequest(after=0, limit=1000), metadata=token, timeout=10)  # fmt: skip
                return SECRET.encode() in read.records

            await until(arrived)
            reset = await a.ResetProgress(lpb.ResetProgressRequest(source="B", seq=10**6), metadata=token, timeout=10)  # fmt: skip
            assert reset.progress > 0
            assert (await a.Join(lpb.JoinRequest(sources=["B"]), metadata=token, timeout=10)) is not None  # fmt: skip
            trusted = await a.TrustClock(lpb.TrustClockRequest(without=["B"]), metadata=token, timeout=10)  # fmt: skip
            assert trusted.clock_ok

    try:
        asyncio.run(go())
    finally:
        net.stop()
        stop_process(net.broker.proc)
