"""A consumer process: it announces a ConsumerSpec under an etcd lease, mirrors the shard
keyspace, runs the allocator for shards (the same one brokers run for journals, with consumer
rules), hosts the replicas of shards assigned to it, and serves the Shard service.

A replica in slot 0 is the shard's primary: it asks the application for a store, reads the
sources' specs from the brokers (their content types pick the framing), and runs the shard's
transactions (`consumer.transaction.run_shard`), reporting PRIMARY in its assignment, or FAILED
with the error when they fail (a FAILED shard stays so until `gazctl shards unassign`). A replica
in another slot is a hot standby: with a recovery log it plays the log into its local directory
(BACKFILL) and tails it (STANDBY), and when promoted it completes that playback by a hand-off
(`consumer.recovery`) rather than replaying the log; without one there is nothing to play, so it
is STANDBY at once. A primary with a recovery log plays it (or takes over its standby's
playback), records into it, and stores its hints on becoming primary and periodically. Statuses are written into the assignment keys, guarded by their revisions and
keeping their leases, as upstream's.

Stat is answered by the primary (proxied there by any other process): it waits until the
shard's progress covers the requested offsets (`read_through`) and returns its progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import aetcd
import grpc

from allocator import MemberKeyMissing, allocate, drained
from allocator import keyspace as aks
from broker.client.dialer import Dialer
from broker.client.routes import Router
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError, validate_process_id
from consumer.client import PrimaryUnreachable
from consumer.hooks import AppHooks
from consumer.keyspace import consumer_rules, shard_keyspace
from consumer.protocol import DEFAULT_MAX_HOT_STANDBYS, cpb
from consumer.recovery import HINTS_INTERVAL
from consumer.replicas import Replica, Replicas
from consumer.shard_api import (
    HintsError,
    JournalsUnavailable,
    NotAuthorized,
    ShardState,
    apply_shards,
    broker_journals,
    get_hints,
    in_route_order,
    list_shards,
    unassign_shards,
)
from consumer.store import Store
from consumer.transaction import Application, Shard
from plumbing import auth, metrics
from plumbing import etcd as etcdx
from plumbing.credentials import Credentials
from plumbing.http_config import HTTPConfig
from plumbing.membership import (
    LeaseLost,
    LeasePolicy,
    Membership,
    ProcessTasks,
    while_etcd_starts,
)
from plumbing.servers import SERVER_OPTIONS
from plumbing.tasks import TaskOwner, first_of, in_thread
from plumbing.tls import ClientTLS, ServerTLS

__all__ = ["Consumer", "ConsumerApplication", "ConsumerConfig", "LeaseLost", "Resolution"]


if TYPE_CHECKING:
    from plumbing.debug_http import HTTPServers

log = logging.getLogger(__name__)

T = TypeVar("T")

# etcd's errors that a moment cures (refused connections of an etcd restarting, no leader, a
# connection reset, a deadline): every etcd call on a replica's way to PRIMARY or STANDBY is
# made through them (`Consumer._through_etcd`), so that a shard fails only for its own errors.


class ConsumerApplication(Application, Protocol):
    """An application a consumer process hosts: a store per shard (`new_store`), and what it
    does with messages (`Application`). Optional: `message_type(journal_spec)` picks the message
    type of each source journal (default: JSON objects, as dicts); `async
    init_application(consumer)` runs as the process starts, before it serves (an application's
    own gRPC services go on `consumer.server` there, as upstream's `InitApplication`), and
    `async close_application()` as it stops, after its shards stopped.

    An application whose shards serve rather than consume (a replication location, see
    `replication.host`) gives `async run_primary(consumer, spec, ready)`, run as the shard's
    primary instead of the transaction loop (it calls `await ready()` once it has fenced out
    any earlier primary and serves: only then is it advertised PRIMARY), and optionally `async
    run_standby(consumer, spec)`, run by each standby (STANDBY) until the replica stops.

    Each optional hook is declared as a Protocol in `consumer.hooks`, and checked as the
    application loads."""

    async def new_store(self, shard: Shard) -> Store: ...


CONSUMER_PEER_TLS_FLAGS = ("--consumer.peer-cert-file", "--consumer.peer-cert-key-file", "--consumer.peer-ca-file")  # fmt: skip


@dataclass
class ConsumerConfig:
    """Upstream's --consumer.*, --broker.* and --etcd.* flags, by their names."""

    id: str
    broker_address: str
    etcd_address: str
    etcd_prefix: str
    zone: str = "local"
    host: str = "127.0.0.1"
    port: int = 0
    limit: int = 32
    max_hot_standbys: int = DEFAULT_MAX_HOT_STANDBYS
    watch_delay: float = 0.03
    etcd_lease: float = 20.0
    run_allocator: bool = True
    drain_timeout: float = 30.0
    # Where replicas with a recovery log keep their files ("": a temporary directory).
    local_dir: str = ""
    hints_interval: float = HINTS_INTERVAL
    # TLS of the Shard service (`--consumer.server-*`), etcd's (`--etcd.*`), the keys that
    # verify (and sign) Shard calls (`--consumer.auth-keys`), and how brokers are dialled
    # (`--broker.cert-file` ..., `--broker.auth-keys` or `--broker.auth-token`; None: the
    # process's defaults, see plumbing.credentials).
    server_tls: ServerTLS = field(default_factory=lambda: ServerTLS(prefix="--consumer.server"))
    peer_tls: ClientTLS = field(default_factory=lambda: ClientTLS(flags=CONSUMER_PEER_TLS_FLAGS))
    etcd_tls: ClientTLS = field(default_factory=lambda: ClientTLS(flags=etcdx.ETCD_TLS_FLAGS))
    auth_keys: str = ""
    broker_credentials: Credentials | None = None
    http: HTTPConfig = field(default_factory=HTTPConfig)


@dataclass
class Resolution:
    """Where a shard is served, as `Consumer.resolve` found it: `status` OK with the local
    primary's `replica`, or OK with the `endpoint` of the primary elsewhere; otherwise why not
    (SHARD_NOT_FOUND, NO_SHARD_PRIMARY, or NOT_SHARD_PRIMARY for a request proxied already).
    `header` names this process and the shard's route."""

    status: cpb.Status
    header: pb.Header
    spec: cpb.ShardSpec | None = None
    replica: Replica | None = None
    endpoint: str = ""


class Consumer:
    """One consumer process's runtime; every task it starts is owned here and awaited on stop."""

    def __init__(self, config: ConsumerConfig, app: ConsumerApplication) -> None:
        self.config = config
        self.app = app
        self.hooks = AppHooks.of(app)  # Its optional hooks, checked (HookError names one amiss).
        self.process_id = pb.ProcessSpec.ID(zone=config.zone, suffix=config.id)
        self.root = config.etcd_prefix
        self.etcd: aetcd.Client = etcdx.connect(config.etcd_address, tls=config.etcd_tls)
        # Calls to other consumer processes (proxied Stat) go with `--consumer.peer-*` and are
        # signed with this process's own --consumer.auth-keys.
        self.verifier = auth.verifier_of(config.auth_keys, "--consumer.auth-keys")
        self.peer_credentials = Credentials(
            config.peer_tls, auth.authorizer_of(config.auth_keys, flag="--consumer.auth-keys")
        )
        self.ks = shard_keyspace(self.root, apply_delay=config.watch_delay)
        # A restricted caller's Apply names journals the brokers must show are its own: asked
        # with this process's own broker credentials.
        journals = broker_journals(config.broker_address, config.broker_credentials)
        self.state = ShardState(self.etcd, self.ks, self.root, self.process_id, journals)
        self.router = Router(config.broker_address, dialer=Dialer(config.broker_credentials))
        self.server: grpc.aio.Server | None = None
        self.http: HTTPServers | None = None
        self.port = 0
        # The member key under a lease: past the TTL without etcd's answer the lease counts as
        # lost (other processes may run our shards by then: their stores' fences refuse our
        # commits), and the consumer stops.
        self.membership = Membership(
            self.etcd,
            self.member_key,
            config.etcd_lease,
            LeasePolicy.EXIT,
            conflict="give this consumer a different --consumer.id or stop the other one",
        )
        # Keyspace watch, lease keep-alive, replicas, allocator: a failure of any stops it.
        self.tasks = ProcessTasks("consumer", translate=self._name_failure)
        self.done = self.tasks.done
        # Its shards' replicas, primaries and standbys (see consumer.replicas).
        self.shard_replicas = Replicas(self)
        self._allocator: asyncio.Task[None] | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._app_started = False
        self.local_dir = Path(config.local_dir) if config.local_dir else None

    @property
    def failure(self) -> BaseException | None:
        return self.tasks.failure

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.shard_replicas.replicas

    @property
    def shards(self) -> TaskOwner:
        """The tasks of its shards' replicas."""
        return self.shard_replicas.tasks

    @property
    def lease_id(self) -> int:
        return self.membership.lease_id

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.config.server_tls.enabled else "http"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def member_key(self) -> str:
        return aks.member_key(self.root, self.config.zone, self.config.id)

    def spec(self, exiting: bool = False) -> cpb.ConsumerSpec:
        return cpb.ConsumerSpec(
            process_spec=pb.ProcessSpec(id=self.process_id, endpoint=self.endpoint),
            shard_limit=self.config.limit,
            exiting=exiting,
        )

    # ---- lifetime ------------------------------------------------------------------------

    async def start(self) -> None:
        validate_process_id(self.process_id, field="consumer id")
        if self.local_dir is None:  # Ours, made here and removed on stop.
            self.local_dir = Path(tempfile.mkdtemp(prefix="gazette-consumer-"))
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS,
            interceptors=auth.call_bounds(self.verifier),  # A call ends when its token does.
        )
        cpb_grpc.add_ShardServicer_to_server(_ShardServicer(self), self.server)  # type: ignore[no-untyped-call]
        bind = f"{self.config.host}:{self.config.port}"
        if self.config.server_tls.enabled:
            self.port = self.server.add_secure_port(bind, self.config.server_tls.grpc_credentials())
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot listen on {bind}: the port is in use or not permitted")
        # Started as etcd restarts (it refuses connections), the process waits for it, as
        # upstream's clientv3 does, rather than exiting; for as long as announcing waits.
        deadline = self.membership.start_deadline()
        try:
            await self.etcd.connect()
            await while_etcd_starts(
                "reading the keyspace", lambda: self.ks.load(self.etcd), deadline
            )
            self.ks.add_observer(
                lambda update: (
                    self.shard_replicas.changed.set() if update.changes or update.reload else None
                )
            )
            self.shard_replicas.changed.set()  # Assignments we may hold already (a quick restart).
            self.tasks.spawn(self.ks.watch(self.etcd), "keyspace watch")
            await self.membership.grant(deadline)
            self.tasks.spawn(self.membership.keep_alive(), "lease keep-alive")
            await self.membership.announce(
                self.spec().SerializeToString(), deadline, applied=self.ks.wait_for_revision
            )
            if self.hooks.init_application is not None:
                await self.hooks.init_application(self)
            self._app_started = True
            await self.server.start()
            await self._start_http()
            self.tasks.spawn(self.shard_replicas.run(), "shard replicas")
            if self.config.run_allocator:
                rules = consumer_rules(self.config.max_hot_standbys)
                self._allocator = self.tasks.spawn(
                    allocate(self.ks, self.etcd, self.root, self.member_key, rules=rules),
                    "allocator",
                )
        except BaseException:
            await self.stop()
            raise
        log.info("consumer %s/%s serving at %s", self.config.zone, self.config.id, self.endpoint)

    async def _start_http(self) -> None:
        """The HTTP port (metrics) and the diagnostics port, when configured."""
        metrics.watch_revision.set_function(lambda: self.ks.revision)
        if not self.config.http.enabled:
            return
        from plumbing.debug_http import HTTPServers  # Only here: no HTTP port, no HTTP stack.

        self.http = HTTPServers(
            self.config.http,
            name=f"consumer {self.config.zone}/{self.config.id}",
            host=self.config.host,
            tls=self.config.server_tls,
        )
        await self.http.start()

    def _name_failure(self, exc: BaseException) -> BaseException:
        if isinstance(exc, MemberKeyMissing):  # The allocator noticed first.
            return LeaseLost(f"member key {self.member_key} vanished: its lease is gone")
        return exc

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful exit: mark the member exiting, let the allocator move our shards, stop the
        replicas, stop serving, revoke the lease."""
        if self.lease_id and self.failure is None:
            await self.membership.mark_exiting(self.spec(exiting=True).SerializeToString(), 5.0)
            allocator = self._allocator
            if allocator is not None and not await drained(
                allocator, self.ks, self.root, self.member_key, self.config.drain_timeout
            ):
                log.warning(
                    "shards not drained from %s within %gs; stopping anyway",
                    self.member_key, self.config.drain_timeout,
                )  # fmt: skip
        await self.shard_replicas.tasks.close()
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.stop()
            self.http = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        close = self.hooks.close_application
        if self._app_started and close is not None:
            self._app_started = False
            with contextlib.suppress(Exception):
                await close()
        await self.tasks.close()
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close(None)
        self._channels.clear()
        await self.membership.revoke(5.0)
        await self.router.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.etcd.close(), 5.0)
        if not self.config.local_dir and self.local_dir is not None:
            await in_thread(shutil.rmtree, self.local_dir, True)  # Its replicas': off the loop.
        self.done.set()

    def resolve(
        self, shard_id: str, proxied: bool = False, claims: auth.Claims = auth.UNRESTRICTED
    ) -> Resolution:
        """Where `shard_id` is served: here (its running primary replica) or at the primary's
        endpoint, to proxy to; a request `proxied` once already is not proxied again. A shard
        `claims` do not select is not found."""
        header = self.state.unrouted_header()
        found = self.state.spec_of(shard_id)
        if found is None or not auth.sees_shard(claims, found[0]):
            return Resolution(cpb.SHARD_NOT_FOUND, header)
        spec, _ = found
        assignments = in_route_order(self.state.assignments_of(shard_id))
        route = aks.build_route(assignments, self.state.member)
        header.route.CopyFrom(route)
        replica = self.replicas.get(shard_id)
        if replica is not None and replica.slot == 0 and replica.task is not None:
            return Resolution(cpb.OK, header, spec, replica=replica)
        if route.primary == -1:
            return Resolution(cpb.NO_SHARD_PRIMARY, header, spec)
        if proxied:
            return Resolution(cpb.NOT_SHARD_PRIMARY, header, spec)
        endpoint = route.endpoints[route.primary] if route.endpoints else ""
        return Resolution(cpb.OK, header, spec, endpoint=endpoint)

    def channel_to(self, endpoint: str) -> grpc.aio.Channel:
        """A channel to another consumer process (kept, and closed when this one stops)."""
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self.peer_credentials.open_channel(endpoint, what="consumer endpoint")
            self._channels[endpoint] = channel
        return channel

    async def stat(
        self, request: cpb.StatRequest, claims: auth.Claims = auth.UNRESTRICTED
    ) -> cpb.StatResponse:
        resolution = self.resolve(request.shard, proxied=request.HasField("header"), claims=claims)
        response = cpb.StatResponse(status=resolution.status, header=resolution.header)
        if resolution.status != cpb.OK:
            return response
        assert resolution.spec is not None
        sources = {s.journal for s in resolution.spec.sources}
        for journal in request.read_through:
            if journal not in sources:
                raise ValidationError(
                    "read_through", journal, f"{journal} is not a source of shard {request.shard}"
                )
        replica = resolution.replica
        if replica is None:
            proxied = cpb.StatRequest()
            proxied.CopyFrom(request)
            proxied.header.CopyFrom(response.header)
            stub = cpb_grpc.ShardStub(self.channel_to(resolution.endpoint))  # type: ignore[no-untyped-call]
            try:
                answer: cpb.StatResponse = await stub.Stat(proxied)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                route = resolution.header.route
                raise PrimaryUnreachable(
                    request.shard, route.members[route.primary].suffix, resolution.endpoint
                ) from None
            return answer
        assert replica.task is not None
        await first_of(replica.progress.wait_for(dict(request.read_through)), replica.task)
        if replica.task.done():
            response.status = cpb.SHARD_STOPPED
            return response
        response.read_through.update(replica.progress.read_through)
        response.publish_at.update(replica.progress.publish_at)
        return response


class _ShardServicer(cpb_grpc.ShardServicer):
    """The Shard service over gRPC: malformed requests are INVALID_ARGUMENT with one line."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    async def _guard(self, context: Any, call: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await call
        except NotAuthorized as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except HintsError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except JournalsUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except etcdx.UNREACHABLE as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, etcdx.unreachable_message(exc))
        except PrimaryUnreachable as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                str(exc),
                trailing_metadata=((PrimaryUnreachable.METADATA, exc.member),),
            )

    async def _claims(self, context: Any, require: int) -> auth.Claims:
        return await auth.verify_or_abort(self.consumer.verifier, context, require)

    async def Stat(self, request: cpb.StatRequest, context: Any) -> cpb.StatResponse:
        claims = await self._claims(context, auth.READ)
        return await self._guard(context, self.consumer.stat(request, claims))  # type: ignore[no-any-return]

    async def List(self, request: cpb.ListRequest, context: Any) -> cpb.ListResponse:
        claims = await self._claims(context, auth.LIST)

        async def answer() -> cpb.ListResponse:
            return list_shards(self.consumer.state, request, claims)

        return await self._guard(context, answer())  # type: ignore[no-any-return]

    async def Apply(self, request: cpb.ApplyRequest, context: Any) -> cpb.ApplyResponse:
        claims = await self._claims(context, auth.APPLY)
        try:
            return await self._guard(context, apply_shards(self.consumer.state, request, claims))  # type: ignore[no-any-return]
        except etcdx.TxnTooLarge:
            changes = len(request.changes)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, etcdx.too_many_changes(changes))
            raise AssertionError("unreachable") from None

    async def GetHints(self, request: cpb.GetHintsRequest, context: Any) -> cpb.GetHintsResponse:
        claims = await self._claims(context, auth.READ)
        return await self._guard(context, get_hints(self.consumer.state, request, claims))  # type: ignore[no-any-return]

    async def Unassign(self, request: cpb.UnassignRequest, context: Any) -> cpb.UnassignResponse:
        claims = await self._claims(context, auth.APPLY)
        return await self._guard(context, unassign_shards(self.consumer.state, request, claims))  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def running(config: ConsumerConfig, app: ConsumerApplication) -> AsyncIterator[Consumer]:
    """A started consumer for the block, stopped after it."""
    consumer = Consumer(config, app)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()
