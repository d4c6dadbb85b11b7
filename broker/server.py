"""A broker process: announces itself in etcd under a lease, mirrors the keyspace, and serves the
Journal gRPC service until it is asked to stop.

`Broker` is the asyncio runtime that `gazette serve` runs and that `broker.testing` embeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import exceptions as etcd_errors
from aetcd import transactions

from broker.allocator import MemberKeyMissing, allocate, broker_rules
from broker.allocator import keyspace as aks
from broker.client.dialer import Dialer
from broker.fragment import spool
from broker.fragment.persister import FINAL_ATTEMPT_TIMEOUT, Persister
from broker.gateway import Gateway
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate
from broker.service import JournalService, add_journal_service
from plumbing import auth, metrics
from plumbing import etcd as etcdx
from plumbing.backoff import Backoff
from plumbing.credentials import Credentials
from plumbing.debug_http import HTTPConfig, HTTPServers
from plumbing.servers import SERVER_OPTIONS
from plumbing.tasks import TaskOwner
from plumbing.tls import ClientTLS, ServerTLS

log = logging.getLogger(__name__)

# At a graceful exit, how long flushing the journals nobody else can take over may last.
FLUSH_ON_EXIT_TIMEOUT = 20.0
# How long stopping the journal service may last beyond the persister's last attempts at what
# the spools held (BrokerConfig.exit_flush_timeout): its replicas' own stops (each bounded).
SERVICE_STOP_MARGIN = 20.0


def lease_retry_backoff() -> Backoff:
    """Between failed refreshes of the etcd lease: soon, as etcd usually answers again within
    a second or two of a restart (and keeps every lease alive across it)."""
    return Backoff(initial=0.2, factor=1.5, maximum=0.5)


PEER_TLS_FLAGS = ("--broker.peer-cert-file", "--broker.peer-cert-key-file", "--broker.peer-ca-file")


class AnnounceError(RuntimeError):
    pass


class LeaseLost(RuntimeError):
    pass


@dataclass
class BrokerConfig:
    """Settings of one broker, named after upstream's `--broker.*` and `--etcd.*` flags."""

    zone: str = "local"
    id: str = field(default_factory=socket.gethostname)
    host: str = field(default_factory=socket.gethostname)
    port: int = 8080
    listen_host: str = ""
    file_root: str = ""
    limit: int = 1024
    max_replication: int = 9
    min_append_rate: int = 65536
    max_append_rate: int = 0
    watch_delay: float = 0.03
    etcd_address: str = "http://localhost:2379"
    etcd_prefix: str = "/gazette/cluster"
    etcd_lease: float = 20.0
    max_grpc_recv_size: int = 4 * 1024 * 1024
    # How long a stopping broker waits for the allocator to move its journals elsewhere.
    drain_timeout: float = 30.0
    # How long a stopping broker keeps trying to persist what it holds (its exit flush of the
    # journals nobody is left to take over, then the persister's last attempts at each spool).
    exit_flush_timeout: float = FINAL_ATTEMPT_TIMEOUT
    # How long a replica waits before checking that a completed fragment was persisted.
    persist_interval: float = 60.0
    # Upstream's --broker.auto-suspend: pulses of a journal idle on a stable route ask to
    # suspend it if its fragments are all persisted (AppendRequest.SUSPEND_IF_FLUSHED).
    auto_suspend: bool = False
    # How often each journal's primary pulses (a zero-byte append through its pipeline).
    pulse_interval: float = 60.0
    # A primary releases a pipeline no append has used for this long, after a pulse (0: never).
    idle_pipeline_release: float = 30.0
    # Tests of the broker core turn the allocator off and write assignments themselves.
    run_allocator: bool = True
    # TLS: served with `server_tls` (advertising https://), peers dialled with `peer_tls`,
    # etcd with `etcd_tls` (for an https:// --etcd.address).
    server_tls: ServerTLS = field(default_factory=ServerTLS)
    peer_tls: ClientTLS = field(default_factory=lambda: ClientTLS(flags=PEER_TLS_FLAGS))
    etcd_tls: ClientTLS = field(default_factory=lambda: ClientTLS(flags=etcdx.ETCD_TLS_FLAGS))
    # `--broker.auth-keys`: verifies clients' tokens, and the first key signs this broker's
    # own (to proxy and to replicate). Empty: no authorization.
    auth_keys: str = ""
    # The HTTP port (metrics, the gateway: broker.gateway) and the diagnostics port: see
    # plumbing.debug_http.
    http: HTTPConfig = field(default_factory=HTTPConfig)

    def bind_host(self) -> str:
        """Where to listen: as given, else loopback when the advertised host is loopback (it
        could not be reached from elsewhere anyway), else every interface as upstream does."""
        if self.listen_host:
            return self.listen_host
        try:
            addresses = {str(info[4][0]) for info in socket.getaddrinfo(self.host, None)}
        except OSError:
            return "0.0.0.0"
        if addresses and all(a.startswith("127.") or a == "::1" for a in addresses):
            return "127.0.0.1"
        return "0.0.0.0"


def describe_refresh_failure(error: BaseException | None, bound: float) -> str:
    """Why a lease refresh failed, never empty: its error's text, or its type's name when the
    text is empty (`str(TimeoutError())` is ""), a timeout with the bound it ran out
    ("TimeoutError after 2.0s"); a gRPC error as its code and first line of details."""
    if error is None:
        return "no answer"
    if isinstance(error, grpc.aio.AioRpcError):
        detail = (error.details() or "").split("\n")[0]
        return f"{error.code().name}: {detail}" if detail else error.code().name
    text = str(error)
    if text:
        return text
    if isinstance(error, TimeoutError):
        return f"{type(error).__name__} after {bound:.1f}s"
    return type(error).__name__


class Broker:
    """One broker's runtime. Every background task it starts is owned here and awaited on stop."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.process_id = pb.ProcessSpec.ID(zone=config.zone, suffix=config.id)
        self.etcd: aetcd.Client = etcdx.connect(config.etcd_address, tls=config.etcd_tls)
        self.ks = aks.broker_keyspace(config.etcd_prefix, apply_delay=config.watch_delay)
        self.server: grpc.aio.Server | None = None
        self.service: JournalService | None = None
        self._spool_dir: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0
        self.lease_id = 0
        self.lease_ttl = 0  # As etcd granted it, in seconds.
        # Until when (event loop clock) etcd cannot have expired our lease: the send time of the
        # last refresh it answered, plus the TTL. Past it (less a margin), appends stop.
        self.lease_valid_until = 0.0
        self.fenced = False
        # Keyspace watch, lease keep-alive, allocator: a failure of any stops the broker.
        self.tasks = TaskOwner("broker")
        self._allocator: asyncio.Task[None] | None = None
        self.http: HTTPServers | None = None
        self.done = asyncio.Event()
        self.failure: BaseException | None = None

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.config.server_tls.enabled else "http"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def member_key(self) -> str:
        return aks.member_key(self.config.etcd_prefix, self.config.zone, self.config.id)

    def spec(self, exiting: bool = False) -> pb.BrokerSpec:
        return pb.BrokerSpec(
            process_spec=pb.ProcessSpec(id=self.process_id, endpoint=self.endpoint),
            journal_limit=self.config.limit,
            exiting=exiting,
        )

    async def start(self) -> None:
        # Peers refuse headers naming an invalid process id: refuse to run as one (`gazette
        # serve` says which flag; an embedding program gets the ValidationError).
        validate.validate_process_id(self.process_id, field="broker id")
        verifier = auth.verifier_of(self.config.auth_keys, "--broker.auth-keys")
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_grpc_recv_size),
                *SERVER_OPTIONS,
            ],
            interceptors=auth.call_bounds(verifier),  # A call ends when its token does.
        )
        self._spool_dir = tempfile.TemporaryDirectory(prefix="gazette-spools-")
        self.service = JournalService(
            self.ks,
            self.etcd,
            self.config.etcd_prefix,
            self.process_id,
            spool_dir=Path(self._spool_dir.name),
            min_append_rate=self.config.min_append_rate,
            max_append_rate=self.config.max_append_rate,
            max_replication=self.config.max_replication,
            auto_suspend=self.config.auto_suspend,
            pulse_interval=self.config.pulse_interval,
            idle_pipeline_release=self.config.idle_pipeline_release,
            dialer=Dialer(Credentials(self.config.peer_tls, self._peer_auth())),
            verifier=verifier,
            persister=Persister(
                file_root=Path(self.config.file_root) if self.config.file_root else None,
                spool_dir=Path(self._spool_dir.name),
                persist_interval=self.config.persist_interval,
            ),
        )
        add_journal_service(self.service, self.server)
        # After the resolver's observer: a replica started while fenced is fenced at once.
        self.ks.add_observer(self._on_keyspace_update)
        bind = f"{self.config.bind_host()}:{self.config.port}"
        if self.config.server_tls.enabled:
            self.port = self.server.add_secure_port(bind, self.config.server_tls.grpc_credentials())
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"cannot listen on {bind}: the port is in use or not permitted")
        try:
            await self.etcd.connect()
            await self.ks.load(self.etcd)
            self._spawn(self.ks.watch(self.etcd), "keyspace watch")
            await self._grant_lease()
            self._spawn(self._keep_lease_alive(), "lease keep-alive")
            await self._announce()
            await self.server.start()
            await self._start_http()
            if self.config.run_allocator:
                self._allocator = self._spawn(
                    allocate(
                        self.ks,
                        self.etcd,
                        self.config.etcd_prefix,
                        self.member_key,
                        rules=broker_rules(self.config.max_replication),
                    ),
                    "allocator",
                )
        except BaseException:
            await self.stop()
            raise
        log.info("broker %s/%s serving at %s", self.config.zone, self.config.id, self.endpoint)

    async def _start_http(self) -> None:
        """The HTTP and diagnostics ports, when configured, and this broker's gauges."""
        loop = asyncio.get_running_loop()
        metrics.lease_remaining.set_function(lambda: max(0.0, self.lease_valid_until - loop.time()))
        metrics.watch_revision.set_function(lambda: self.ks.revision)
        metrics.spool_disk_bytes.set_function(spool.disk_bytes)
        if not self.config.http.enabled:
            return
        # The gateway calls this broker's own service, as a peer would (its authorization is
        # the HTTP request's).
        channel = Credentials(self.config.peer_tls).open_channel(
            self.endpoint, [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        self.http = HTTPServers(
            self.config.http,
            name=f"broker {self.config.zone}/{self.config.id}",
            host=self.config.bind_host(),
            tls=self.config.server_tls,
            routes=Gateway(channel, self.service.verifier if self.service else None),
        )
        await self.http.start()

    def _peer_auth(self) -> auth.Authorizer:
        """How this broker authorizes its own calls to peers: signed with its first key."""
        if not self.config.auth_keys.strip():
            return auth.NOOP_AUTH
        return auth.KeyedAuth.from_text(self.config.auth_keys, "--broker.auth-keys")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = self.tasks.spawn(coro, name)
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, MemberKeyMissing):
                # The allocator noticed first: the key went with our lease.
                exc = LeaseLost(
                    f"member key {self.member_key} vanished: its etcd lease expired or was revoked"
                )
            log.error("broker task %r failed: %s", task.get_name(), exc)
            self.failure = self.failure or exc
            self.done.set()

    async def _grant_lease(self) -> None:
        sent = asyncio.get_running_loop().time()
        lease = await self.etcd.lease(max(1, round(self.config.etcd_lease)))
        self.lease_id = lease.id
        self.lease_ttl = int(lease.ttl) or max(1, round(self.config.etcd_lease))
        self.lease_valid_until = sent + self.lease_ttl

    async def _announce(self) -> None:
        """Create our member key under a fresh lease. If a previous incarnation still holds it,
        wait for its lease to expire rather than steal it."""
        ttl = max(1, round(self.config.etcd_lease))
        key = self.member_key.encode()
        deadline = asyncio.get_running_loop().time() + 2 * ttl + 2
        while True:
            result = await etcdx.txn(
                self.etcd,
                [transactions.Version(key) == 0],
                [transactions.Put(key, self.spec().SerializeToString(), lease=self.lease_id)],
            )
            if result.succeeded:
                await self.ks.wait_for_revision(result.revision)
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AnnounceError(
                    f"member key {self.member_key} is held by another live process: "
                    "give this broker a different --broker.id or stop the other one"
                )
            log.warning("member key %s exists; waiting for its lease to expire", self.member_key)
            await asyncio.sleep(1.0)

    async def _keep_lease_alive(self) -> None:
        """Refresh the lease every third of its TTL; after a failed refresh, retry soon (see
        `lease_retry_backoff`), each attempt bounded so that one hung call cannot use up the TTL.

        The lease is lost only when etcd says so: a refresh answered with TTL <= 0 (expired or
        revoked; etcd answers so for a lease it does not know). Then this raises LeaseLost, and
        the broker exits, once its spools are persisted (`stop`: each replica's open fragment is
        completed and the persister given `exit_flush_timeout`).

        While etcd does not answer, the lease may still be alive: etcd keeps leases across its
        own restart (a new leader extends each by its TTL), so an etcd outage, however long, is
        survivable. But once our own clock passes the TTL since the last refresh etcd answered
        (counted from when we sent it, so never later than etcd's own expiry, less a margin),
        etcd may have expired the lease: then other brokers, connected to etcd, may take over our
        journals. Upstream's broker exits at that point (its etcd session ends once the TTL
        passes without a keep-alive answer), losing what its spools alone held; this one stays
        alive but *fenced*: every local replica stops taking appends (they wait) and tears down
        its pipeline (`Replica.fence`), while reads and the Replicate streams of other primaries
        go on. When a refresh succeeds again, the lease never lapsed (no broker could have taken
        over: assignments live under our lease), and appends resume; when etcd says the lease
        is gone, the broker exits as above.

        Why fence rather than carry on until etcd answers: carrying on would be consistent for
        a journal with peers (a new primary must synchronize the same replicas, whose spools our
        pipeline holds until it ends, and replicas refuse a pipeline built on a route older than
        theirs), but it would keep that new primary waiting as long as our pipeline lives, and a
        journal of replication 1 has no peer to serialize us with its new primary at all: our
        appends after the lapse would be acknowledged in a spool the journal has left behind.
        Fenced, no append is acknowledged here after etcd could have expired the lease (beyond
        one already committing when the fence fell), and our peers are free for the next
        primary at once."""
        loop = asyncio.get_running_loop()
        ttl = float(self.lease_ttl or max(1, round(self.config.etcd_lease)))
        interval = max(0.1, ttl / 3)
        attempt_bound = min(2.0, max(0.5, ttl / 5))
        margin = min(1.0, ttl / 10)
        backoff = lease_retry_backoff()
        failing_since = 0.0
        delay = interval

        def fence_at() -> float:
            return self.lease_valid_until - margin

        while True:
            if not self.fenced:
                delay = min(delay, max(0.0, fence_at() - loop.time()))
            await asyncio.sleep(delay)
            if not self.fenced and loop.time() >= fence_at():
                self._fence(ttl, loop.time() - self.lease_valid_until + ttl)
            sent = loop.time()
            bound = attempt_bound
            if not self.fenced:
                bound = min(bound, max(0.05, fence_at() - sent))
            try:
                # (Not `asyncio.wait_for`: in Python 3.11 it can swallow a cancellation that
                # meets the refresh's end, and this loop would go on through the broker's stop.)
                async with asyncio.timeout(bound):
                    reply = await self.etcd.refresh_lease(self.lease_id)
                error: BaseException | None = None
            except (TimeoutError, etcd_errors.ClientError, grpc.aio.AioRpcError) as exc:
                reply, error = None, exc
            if reply is not None and reply.TTL <= 0:
                raise LeaseLost(f"etcd lease of {self.member_key} expired or was revoked")
            if reply is None:
                metrics.lease_refresh_failures.inc()
                if not failing_since:
                    failing_since = sent
                    log.warning(
                        "refreshing the etcd lease failed (retrying): %s",
                        describe_refresh_failure(error, bound),
                    )
                if not self.fenced and loop.time() >= fence_at():
                    self._fence(ttl, loop.time() - self.lease_valid_until + ttl)
                delay = backoff.next_delay()
                continue
            backoff.reset()
            self.lease_valid_until = sent + reply.TTL
            if failing_since:
                log.info("etcd lease refreshed again after %.1fs", loop.time() - failing_since)
                failing_since = 0.0
            if self.fenced:
                self._unfence()
            delay = interval

    def _fence(self, ttl: float, silent: float) -> None:
        """Our lease may have lapsed in etcd: stop taking appends (see `_keep_lease_alive`)."""
        self.fenced = True
        metrics.fenced.set(1)
        log.warning(
            "etcd answered no lease refresh for %.1fs (TTL %gs): %s may have lost its lease; "
            "appends are paused until etcd answers (the broker exits if etcd says the lease "
            "is gone)",
            silent, ttl, self.member_key,
        )  # fmt: skip
        self._apply_fence()

    def _unfence(self) -> None:
        self.fenced = False
        metrics.fenced.set(0)
        log.warning("etcd lease of %s is alive: appends resume", self.member_key)
        self._apply_fence()

    def _apply_fence(self) -> None:
        replicas = self.service.resolver.replicas if self.service is not None else None
        for replica in (replicas or {}).values():
            if self.fenced:
                replica.fence()
            else:
                replica.unfence()

    def _on_keyspace_update(self, _update: object) -> None:
        if self.fenced:
            self._apply_fence()  # Replicas started meanwhile.

    async def _await_drain(self) -> bool:
        """Until the allocator returns (drained), the timeout passes, or no live member is left
        that could take our journals (then waiting cannot help). Whether the wait ended for
        one of those reasons other than the timeout."""
        assert self._allocator is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while not self._allocator.done():
            if loop.time() >= deadline:
                return False
            others = [
                kv
                for kv in self.ks.prefixed(self.config.etcd_prefix + aks.MEMBERS)
                if kv.key != self.member_key
                and isinstance(kv.decoded, aks.Member)
                and isinstance(kv.decoded.spec, pb.BrokerSpec)
                and not kv.decoded.spec.exiting
            ]
            if not others:
                return True  # Left to the exit flush.
            await asyncio.wait({self._allocator}, timeout=min(0.25, deadline - loop.time()))
        return True

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful exit: mark the member exiting, drain gRPC, revoke the lease, close etcd."""
        # etcd may be the reason we are stopping: bound every call to it.
        bound = max(1.0, min(5.0, self.config.etcd_lease / 2))
        if self.lease_id and self.failure is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.etcd.put(
                        self.member_key.encode(),
                        self.spec(exiting=True).SerializeToString(),
                        lease=self.lease_id,
                    ),
                    bound,
                )
            # Marked exiting, the allocator moves our journals elsewhere (when the cluster has
            # room for them); it returns once we hold none. Wait for that, within a bound.
            drained = self._allocator is None or self._allocator.done() or await self._await_drain()
            if not drained:
                log.warning(
                    "journals not drained from %s within %gs; stopping anyway",
                    self.member_key,
                    self.config.drain_timeout,
                )
            # Journals nobody is left to take over: flushed to their stores and suspended at
            # their end, so that a restarted cluster resumes them without reset-head.
            if self.service is not None:
                with contextlib.suppress(Exception):
                    await self.service.flush_for_exit(
                        min(FLUSH_ON_EXIT_TIMEOUT, self.config.exit_flush_timeout)
                    )
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.stop()
            self.http = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self.service is not None:
            # Its replicas complete their open fragments and the persister puts what they held
            # in the stores (bounded): after a lapsed lease too, as every replica of a journal
            # may be going at once (etcd is often what failed, and the stores still answer).
            with contextlib.suppress(Exception):
                persist = self.config.exit_flush_timeout
                await asyncio.wait_for(self.service.stop(persist), persist + SERVICE_STOP_MARGIN)
            self.service = None
        with contextlib.suppress(ValueError):
            self.ks.remove_observer(self._on_keyspace_update)
        if self._spool_dir is not None:
            self._spool_dir.cleanup()
            self._spool_dir = None
        await self.tasks.close()
        if self.lease_id:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.etcd.revoke_lease(self.lease_id), bound)
            self.lease_id = 0
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.etcd.close(), bound)
        self.done.set()
