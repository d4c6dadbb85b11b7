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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aetcd
import grpc

from allocator import MemberKeyMissing, allocate, drained
from allocator import keyspace as aks
from broker.client.dialer import Dialer
from broker.fragment import spool
from broker.fragment.persister import FINAL_ATTEMPT_TIMEOUT, Persister
from broker.keyspace import broker_keyspace, broker_rules
from broker.protocol import protocol_pb2 as pb
from broker.protocol import validate
from broker.service import JournalService, add_journal_service
from plumbing import auth, metrics
from plumbing import etcd as etcdx
from plumbing.credentials import Credentials
from plumbing.http_config import HTTPConfig
from plumbing.membership import LeaseLost, LeasePolicy, Membership, ProcessTasks
from plumbing.servers import SERVER_OPTIONS
from plumbing.tls import ClientTLS, ServerTLS

if TYPE_CHECKING:
    from plumbing.debug_http import HTTPServers

log = logging.getLogger(__name__)

# At a graceful exit, how long flushing the journals nobody else can take over may last.
FLUSH_ON_EXIT_TIMEOUT = 20.0
# How long stopping the journal service may last beyond the persister's last attempts at what
# the spools held (BrokerConfig.exit_flush_timeout): its replicas' own stops (each bounded).
SERVICE_STOP_MARGIN = 20.0


PEER_TLS_FLAGS = ("--broker.peer-cert-file", "--broker.peer-cert-key-file", "--broker.peer-ca-file")


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


class Broker:
    """One broker's runtime. Every background task it starts is owned here and awaited on stop."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.process_id = pb.ProcessSpec.ID(zone=config.zone, suffix=config.id)
        self.etcd: aetcd.Client = etcdx.connect(config.etcd_address, tls=config.etcd_tls)
        self.ks = broker_keyspace(config.etcd_prefix, apply_delay=config.watch_delay)
        self.server: grpc.aio.Server | None = None
        self.service: JournalService | None = None
        self._spool_dir: tempfile.TemporaryDirectory[str] | None = None
        self.port = 0
        # The member key under a lease. Past the TTL without etcd's answer, the broker is
        # fenced: its replicas take no append (see `_on_fence`).
        self.membership = Membership(
            self.etcd,
            self.member_key,
            config.etcd_lease,
            LeasePolicy.FENCE,
            conflict="give this broker a different --broker.id or stop the other one",
            on_fence=self._on_fence,
        )
        # Keyspace watch, lease keep-alive, allocator: a failure of any stops the broker.
        self.tasks = ProcessTasks("broker", translate=self._name_failure)
        self.done = self.tasks.done
        self._allocator: asyncio.Task[None] | None = None
        self.http: HTTPServers | None = None

    @property
    def failure(self) -> BaseException | None:
        return self.tasks.failure

    @property
    def lease_id(self) -> int:
        return self.membership.lease_id

    @property
    def fenced(self) -> bool:
        return self.membership.fenced

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
            self.tasks.spawn(self.ks.watch(self.etcd), "keyspace watch")
            deadline = self.membership.start_deadline()
            await self.membership.grant(deadline)
            self.tasks.spawn(self.membership.keep_alive(), "lease keep-alive")
            await self.membership.announce(
                self.spec().SerializeToString(), deadline, applied=self.ks.wait_for_revision
            )
            await self.server.start()
            await self._start_http()
            if self.config.run_allocator:
                self._allocator = self.tasks.spawn(
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
        metrics.lease_remaining.set_function(
            lambda: max(0.0, self.membership.valid_until - loop.time())
        )
        metrics.watch_revision.set_function(lambda: self.ks.revision)
        metrics.spool_disk_bytes.set_function(spool.disk_bytes)
        if not self.config.http.enabled:
            return
        # Imported only here: a broker with no HTTP port loads no HTTP stack.
        from broker.gateway import Gateway
        from plumbing.debug_http import HTTPServers

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

    def _name_failure(self, exc: BaseException) -> BaseException:
        if isinstance(exc, MemberKeyMissing):  # The allocator noticed first.
            return LeaseLost(
                f"member key {self.member_key} vanished: its etcd lease expired or was revoked"
            )
        return exc

    def _on_fence(self, _fenced: bool) -> None:
        """Our lease may have lapsed in etcd (or is alive again): every local replica stops
        (or resumes) taking appends.

        Upstream's broker exits once the TTL passes without a keep-alive answer, losing what
        its spools alone held; this one stays alive but fenced: every local replica stops
        taking appends (they wait) and tears down its pipeline (`Replica.fence`), while reads
        and the Replicate streams of other primaries go on. When a refresh succeeds again, the
        lease never lapsed (no broker could have taken over: assignments live under our
        lease), and appends resume; when etcd says the lease is gone, the broker exits, once
        its spools are persisted (`stop`).

        Why fence rather than carry on until etcd answers: carrying on would be consistent for
        a journal with peers (a new primary must synchronize the same replicas, whose spools our
        pipeline holds until it ends, and replicas refuse a pipeline built on a route older than
        theirs), but it would keep that new primary waiting as long as our pipeline lives, and a
        journal of replication 1 has no peer to serialize us with its new primary at all: our
        appends after the lapse would be acknowledged in a spool the journal has left behind.
        Fenced, no append is acknowledged here after etcd could have expired the lease (beyond
        one already committing when the fence fell), and our peers are free for the next
        primary at once."""
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

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful exit: mark the member exiting, drain gRPC, revoke the lease, close etcd."""
        # etcd may be the reason we are stopping: bound every call to it.
        bound = max(1.0, min(5.0, self.config.etcd_lease / 2))
        if self.lease_id and self.failure is None:
            await self.membership.mark_exiting(self.spec(exiting=True).SerializeToString(), bound)
            # Marked exiting, the allocator moves our journals elsewhere (when the cluster has
            # room for them); it returns once we hold none. Wait for that, within a bound.
            allocator = self._allocator
            if allocator is not None and not await drained(
                allocator,
                self.ks,
                self.config.etcd_prefix,
                self.member_key,
                self.config.drain_timeout,
            ):
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
        await self.membership.revoke(bound)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.etcd.close(), bound)
        self.done.set()
