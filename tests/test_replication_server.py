"""A location's process in this test's own event loop (`LocationProcess`), for the states of its
connection loop that a test cannot reach through a separate process: a peer's call that ends
as the connection is cancelled."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from broker.testing import EtcdServer
from replication import location_pb2 as lpb
from replication.journals import apply_location_journals
from replication.process import LocationConfig, LocationProcess
from replication.rpc import change_message
from replication.topology import Connected, Disconnected
from tests.conftest import BrokerProcess
from tests.helpers.locations import serving
from tests.helpers.waiting import until


class EndsAsAnErrorWhenCancelled:
    """A peer's client whose Read, cancelled while it waits, ends with the call's CANCELLED
    status rather than the cancellation, as a gRPC call can when it completes in the same
    moment: the race, made certain."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cancelled_reads = 0
        self.reading = 0  # Reads under way.

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        self.reading += 1
        try:
            return await self.inner.read(*args, **kwargs)
        except asyncio.CancelledError:
            if self.cancelled_reads:
                raise  # Once is the race; a test that fails must still stop.
            self.cancelled_reads += 1
            md = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, md, md, "Locally cancelled") from None  # fmt: skip
        finally:
            self.reading -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def record(server: LocationProcess, change: Any) -> None:
    await server.change(lpb.ChangeRequest(change=change_message(change), record=True))


async def emit(server: LocationProcess, *payloads: dict[str, Any]) -> lpb.EmitResponse:
    return await server.emit(lpb.EmitRequest(payloads=[json.dumps(p).encode() for p in payloads]))


def test_a_connection_whose_read_ends_as_it_is_cancelled_stops_and_changes_take_effect(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async def go() -> None:
        await apply_location_journals(location_broker.address, "A", "B")

        def config(name: str) -> LocationConfig:
            return LocationConfig(name, location_broker.address, etcd_server.endpoint,
                                  prefix=etcd_prefix + "/replication", lease=2)  # fmt: skip

        async with serving(config("A")) as a, serving(config("B")) as b:
            ask = b.ask
            wrapped: dict[str, EndsAsAnErrorWhenCancelled] = {}

            def patched(entry: Any) -> Any:
                if entry.endpoint not in wrapped:
                    wrapped[entry.endpoint] = EndsAsAnErrorWhenCancelled(ask(entry))
                return wrapped[entry.endpoint]

            b.ask = patched  # type: ignore[method-assign]
            for server in (b, a):
                await record(server, Connected("A", "B"))
            await emit(a, {"n": 1})
            await until(
                lambda: b.log is not None and b.log.progress.get("A", 0) >= 2, "B read A's events"
            )
            # B's connection reads A again, and waits there (A has nothing more).
            await until(
                lambda: any(w.reading for w in wrapped.values()), "B's connection waits in a Read"
            )
            for server in (b, a):
                await record(server, Disconnected("A", "B"))
            # The connection stops; the loop goes on.
            await until(lambda: "A" not in b.connections, "B's connection to A stopped", 10)
            assert sum(w.cancelled_reads for w in wrapped.values()) >= 1
            # And the loop still follows the topology: a new connection starts.
            for server in (b, a):
                await record(server, Connected("A", "B"))
            await emit(a, {"n": 2})
            await until(lambda: b.log.progress.get("A", 0) >= 5, "B read A's new events")

    asyncio.run(go())


def test_status_and_deletion_see_committed_events_only(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    # An emit staged and not yet committed (its append held behind a barrier): Status reports
    # the CVV and last sequence number of what is committed (a neighbour's deletion and
    # fail-over checks trust them), and a deletion through the staged event waits for it to
    # commit, so the DVV covers every event the deletion covers.
    async def go() -> None:
        async with asyncio.timeout(60):
            await steps()

    async def steps() -> None:
        await apply_location_journals(location_broker.address, "A")
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=etcd_prefix + "/replication", lease=2)  # fmt: skip
        async with serving(config) as a:
            assert a.log is not None
            await emit(a, {"n": 1})
            before = await a.status(lpb.StatusRequest())
            hold: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            try:
                a.log.service.barrier(config.journal, dependency=hold)
                emitting = asyncio.ensure_future(emit(a, {"n": 2}))
                log = a.log
                await until(lambda: log.next_seq == before.last_seq + 2, "the second emit staged")
                assert not emitting.done()
                held = await a.status(lpb.StatusRequest())
                assert (held.cvv, held.last_seq) == (before.cvv, before.last_seq)
                through = held.last_seq + 1
                waiting = asyncio.Event()
                settled = log.settled

                async def settling() -> None:
                    waiting.set()
                    await settled()

                log.settled = settling  # type: ignore[method-assign]
                deleting = asyncio.ensure_future(a.delete(lpb.DeleteRequest(through=through)))
                await until(waiting.is_set, "the deletion waits for the staged emit")
                assert not deleting.done()
                hold.set_result(None)
                emitted, deleted = await emitting, await deleting
                assert deleted.dvv.times["A"] == emitted.events[0].time == 2
                after = await a.status(lpb.StatusRequest())
                assert after.last_seq == before.last_seq + 1 and after.cvv.times["A"] == 2
            finally:
                if not hold.done():
                    hold.set_result(None)  # A failed check must not hold the log's appends.

    asyncio.run(go())


def test_a_process_whose_endpoint_lease_expired_does_not_take_back_anothers_endpoint(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A location process paused past its endpoint's lease (as a zombie host is) finds, when it
    resumes, that another process registered the location meanwhile: it must not overwrite
    that endpoint (found in a fault campaign: the zombie's put left the location unreachable
    once the zombie exited). An endpoint that is gone it registers again."""
    import aetcd

    from replication import registry

    async def go() -> None:
        await apply_location_journals(location_broker.address, "A")
        prefix = etcd_prefix + "/replication"
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=prefix, lease=2)  # fmt: skip
        key = registry.endpoint_key(prefix, "A")
        etcd_client = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
        async with etcd_client as etcd, serving(config) as a:
            # Its lease expires (the process was paused), and another takes the location.
            await etcd.revoke_lease(a.membership.lease_id)
            other = await etcd.lease(30)
            theirs = json.dumps({"endpoint": "http://127.0.0.1:1", "pid": 1}).encode()
            await etcd.put(key, theirs, lease=other)
            # A hold, the thing under test: its keep-alive notices the loss more than once in
            # this while, and leaves the other's registration alone.
            await asyncio.sleep(2.5)  # The hold.
            got = await etcd.get(key)
            assert got is not None and got.value == theirs
            # The other goes: this process registers the location again.
            await etcd.revoke_lease(other.id)

            async def registered() -> bool:
                nonlocal got
                got = await etcd.get(key)
                return got is not None

            await until(registered, "the location registered again", timeout=10, interval=0.1)
            assert got is not None and json.loads(got.value)["endpoint"] == a.endpoint

    asyncio.run(go())


def test_a_recovered_location_emits_only_once_its_own_events_are_back(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """After `recover`, A's own lost events come back from B. An event A emitted before they
    were back would raise A's own entry of its CVV past them, and the causality filter would
    then drop every one of them for good (found by the disaster fault scenario). A refuses to
    emit until event recovery is done, then emits after them."""
    from broker.client import JournalsClient
    from broker.protocol import protocol_pb2 as pb
    from replication.journal_log import read_events
    from replication.topology import RuleViolation

    async def go() -> None:
        await apply_location_journals(location_broker.address, "A", "B")
        prefix = etcd_prefix + "/replication"

        def config(name: str) -> LocationConfig:
            return LocationConfig(name, location_broker.address, etcd_server.endpoint,
                                  prefix=prefix, lease=2, batch=10)  # fmt: skip

        async with serving(config("B")) as b:
            async with serving(config("A")) as a:
                for server in (b, a):
                    await record(server, Connected("A", "B"))
                    await record(server, Connected("B", "A"))
                await emit(a, *({"n": i} for i in range(200)))
                await until(
                    lambda: b.log is not None and b.log.cvv["A"] >= a.log.local_time,  # type: ignore[union-attr]
                    "B holds A's 200 events",
                    timeout=30,
                    interval=0.05,
                )
            async with JournalsClient(location_broker.address) as client:  # A's log is lost.
                await client.apply([pb.ApplyRequest.Change(delete="replication/A", expect_mod_revision=-1)])  # fmt: skip

                async def gone() -> bool:
                    named = pb.LabelSet(labels=[pb.Label(name="name", value="replication/A")])
                    return not (await client.list(pb.LabelSelector(include=named))).journals

                await until(gone, "the broker dropped A's journal", interval=0.05)
            await apply_location_journals(location_broker.address, "A")
            async with serving(config("A")) as a:
                assert a.lost and a.log is not None
                await a.recover(lpb.RecoverRequest())
                with pytest.raises(RuleViolation, match="recovering its events"):
                    await emit(a, {"n": "too early"})
                status = await a.status(lpb.StatusRequest())
                assert status.recovering.startswith("recovering its events from B"), status

                async def recovered() -> bool:
                    return not (await a.status(lpb.StatusRequest())).recovering

                await until(recovered, "A's event recovery done", timeout=60, interval=0.1)
                await emit(a, {"n": "after"})
                stored, _ = await read_events(a._stub, "replication/A", 0, 1000)
                ns = [e.event.payload.get("n") for e in stored]
                assert [n for n in ns if isinstance(n, int)] == list(range(200))
                assert ns[-1] == "after" and "too early" not in ns

    asyncio.run(go())


def test_the_location_service_checks_the_token_before_the_request_and_bounds_reads(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A request is parsed only once its caller's token checked out: garbage without a token
    is UNAUTHENTICATED (it was parsed first, and refused as garbage). Read's `limit` has an
    upper bound (MAX_READ_EVENTS): a caller cannot make one reply hold the whole log."""
    import base64

    from plumbing import auth
    from replication.process import MAX_READ_EVENTS
    from replication.rpc import SERVICE

    key = b"a key for the location service's tokens, 32+"

    async def go() -> None:
        await apply_location_journals(location_broker.address, "A")
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=etcd_prefix + "/replication", lease=5,
                                auth_keys=base64.b64encode(key).decode())  # fmt: skip
        async with serving(config) as a:
            channel = grpc.aio.insecure_channel(a.endpoint.removeprefix("http://"))
            read = channel.unary_unary(f"/{SERVICE}/Read")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read(b"\xff\xff\xff\xff not a ReadRequest", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
            token = auth.KeyedAuth([key]).sign(auth.ALL, None, 60)
            metadata = (("authorization", f"Bearer {token}"),)
            with pytest.raises(grpc.aio.AioRpcError) as garbage:
                await read(b"\xff\xff\xff\xff not a ReadRequest", timeout=10, metadata=metadata)
            assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage.value

            count = MAX_READ_EVENTS + 10
            for begin in range(0, count, 2000):
                await emit(a, *({"n": n} for n in range(begin, min(count, begin + 2000))))
            request = lpb.ReadRequest(after=0, limit=10**9)
            raw = await read(request.SerializeToString(), timeout=30, metadata=metadata)
            reply = lpb.ReadResponse.FromString(raw)
            assert reply.last_seq >= count
            assert reply.through <= MAX_READ_EVENTS < reply.last_seq  # The rest comes next.
            await channel.close()

    asyncio.run(go())


def test_the_location_service_authorizes_by_its_log_journals_labels(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A token whose selector excludes the log journal's content-type is refused by the
    brokers; the Location service refuses it too (NOT_FOUND, as for a log the caller cannot
    see), matching the journal's labels and meta-labels as the brokers do, not its name only."""
    import base64

    from broker.protocol import protocol_pb2 as pb
    from plumbing import auth
    from replication.rpc import SERVICE

    key = b"a key for the location service's tokens, 32+"

    def selector(*, exclude: tuple[str, str] | None = None) -> pb.LabelSelector:
        sel = pb.LabelSelector()
        if exclude is not None:
            sel.exclude.labels.add(name=exclude[0], value=exclude[1])
        return sel

    async def go() -> None:
        await apply_location_journals(location_broker.address, "A")
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=etcd_prefix + "/replication", lease=5,
                                auth_keys=base64.b64encode(key).decode())  # fmt: skip
        async with serving(config) as a:
            channel = grpc.aio.insecure_channel(a.endpoint.removeprefix("http://"))
            status = channel.unary_unary(f"/{SERVICE}/Status")
            signer = auth.KeyedAuth([key])

            async def ask(sel: pb.LabelSelector) -> grpc.StatusCode:
                token = signer.sign(auth.ALL, sel, 60)
                try:
                    await status(lpb.StatusRequest().SerializeToString(), timeout=10,
                                 metadata=(("authorization", f"Bearer {token}"),))  # fmt: skip
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert await ask(selector()) == grpc.StatusCode.OK
            hidden = selector(exclude=("content-type", "application/x-ndjson"))
            assert await ask(hidden) == grpc.StatusCode.NOT_FOUND
            assert (
                await ask(selector(exclude=("name", config.journal))) == grpc.StatusCode.NOT_FOUND
            )
            assert await ask(selector(exclude=("content-type", "text/csv"))) == grpc.StatusCode.OK
            await channel.close()

    asyncio.run(go())


def test_a_location_read_ends_when_its_token_expires(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The Location service bounds each call by its caller's token: a Read waiting (up to 10 s)
    for events ends UNAUTHENTICATED at the token's exp plus the 5 s of leeway."""
    import base64
    import time

    import jwt

    from plumbing import auth
    from replication.rpc import SERVICE

    key = b"a key for the location service's tokens, 32+"

    async def go() -> None:
        await apply_location_journals(location_broker.address, "A")
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=etcd_prefix + "/replication", lease=5,
                                auth_keys=base64.b64encode(key).decode())  # fmt: skip
        async with serving(config) as a:
            channel = grpc.aio.insecure_channel(a.endpoint.removeprefix("http://"))
            signer = auth.KeyedAuth([key])
            full = (("authorization", f"Bearer {signer.sign(auth.ALL, None, 600)}"),)
            status = channel.unary_unary(f"/{SERVICE}/Status")
            raw = await status(lpb.StatusRequest().SerializeToString(), timeout=10, metadata=full)
            last = lpb.StatusResponse.FromString(raw).last_seq
            short = signer.sign(auth.ALL, None, 2)
            exp = jwt.decode(short, options={"verify_signature": False})["exp"]
            read = channel.unary_unary(f"/{SERVICE}/Read")
            request = lpb.ReadRequest(after=last, wait=10)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read(request.SerializeToString(), timeout=15,
                           metadata=(("authorization", f"Bearer {short}"),))  # fmt: skip
            at = time.time()
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED, ended.value
            assert "expired" in (ended.value.details() or "")
            assert exp + auth.LEEWAY - 0.5 <= at <= exp + auth.LEEWAY + 2, at - exp
            await channel.close()

    asyncio.run(go())


def test_an_emit_after_the_log_writer_closed_is_refused_as_unavailable(
    location_broker: BrokerProcess, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A process stopping its location (a zombie host that found its lease gone) closes the
    log's writer while its server may still take an emit: the emit is refused as the location
    being unreachable here, in one line, not as an unexpected error of the server."""
    from replication.rpc import LocationClient, LocationError

    async def steps() -> None:
        await apply_location_journals(location_broker.address, "A")
        config = LocationConfig("A", location_broker.address, etcd_server.endpoint,
                                prefix=etcd_prefix + "/replication", lease=2)  # fmt: skip
        async with serving(config) as a:
            assert a.log is not None and a.log.service is not None
            await emit(a, {"n": 1})
            await a.log.service.close()
            async with LocationClient("A", a.endpoint, timeout=10) as client:
                with pytest.raises(LocationError) as info:
                    await client.emit({"n": 2})
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert "unreachable" in str(info.value) and "writer" in str(info.value)
        assert "Unexpected" not in str(info.value) and "\n" not in str(info.value)

    async def go() -> None:
        async with asyncio.timeout(60):
            await steps()

    asyncio.run(go())
