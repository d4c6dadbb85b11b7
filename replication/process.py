"""A location process: it owns the writer of one location's local event log, serves the Location
service, and runs the location's inbound replication connections.

Starting, it takes the log's writer (fencing out any earlier one: a zombie process is refused its
next append) and folds the log into the location's state and its view of the topology's history.
It declares the location in the registry and its endpoint under an etcd lease.

Its connections are those of its topology view that end here (`source -> this location`), each a
task of one TaskGroup, started and cancelled as system events change the view. A connection asks
the source's process for batches (`Read`, with this location's CVV and the connection's filter,
so that most events are filtered at the source; a batch carries the source's CVV, cached here for
fail-over) and writes each with its replication progress in one append: a crash and retry never
stores an event twice. When the source's process is down it reads the source's journal through
the source's broker instead and filters here: the log is durable whether its process runs or not.

Rules enforced here, each refusal one line naming the rule and the vectors:
* a connection reads events the source deleted (its progress is behind the source's deletions)
  only once DVV-source <= CVV-target (location addition, and event recovery in rounds);
* `Change` checks a topology change against this location's view (filters off cycles of the
  projected history, no connection to or from a retired location, known locations only);
* `Delete` checks DVV <= CVV-i for every directly connected location i, asking each for its CVV;
* `Recover` runs metadata recovery (the local clock set to the most any location saw of it,
  every registered one answering; its neighbours' progress for it reset to its last surviving
  event) and lets event recovery proceed only
  over unfiltered bi-directional connections, or a filtered one into a terminal location with the
  filter OR-ed with "emitted here"; it emits nothing until those have given its events back.
  Another source outside the location's unfiltered group is read from its beginning under the
  group's write guard (which keeps the order); the others resume from their current head.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aetcd
import grpc

from broker.client import BrokerUnavailable, JournalsClient
from broker.client.append_service import AppendService
from broker.client.appender import AppendError
from broker.protocol import protocol_pb2 as pb
from plumbing import auth
from plumbing import etcd as etcdx
from plumbing.backoff import Backoff
from plumbing.membership import LeasePolicy, Membership
from plumbing.servers import SERVER_OPTIONS
from plumbing.tasks import first_of
from plumbing.tls import ServerTLS
from replication import commands, registry
from replication import location_pb2 as lpb
from replication.connections import (
    RETRY,
    ConnectionState,
    event_filter,
    replicate,
    retry_backoff,
)
from replication.filters import parse_filter
from replication.journal_log import JournalEventLog, LineBatch, SourceReader, select_lines
from replication.journals import journal_listed
from replication.model import check_fail_over
from replication.rpc import (
    LocationClient,
    LocationError,
    change_message,
    change_of_message,
    clock_message,
    clock_of,
    key_message,
    topology_of_status,
)
from replication.service import CALLER, LocationService
from replication.system import system_payload
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    Retired,
    RuleViolation,
    Topology,
    command_key,
)
from replication.vclock import VectorClock, lub

__all__ = [
    "LocationConfig",
    "LocationProcess",
    "StartError",
    "WriterFailed",
]

log = logging.getLogger("replication")


# Seconds a call waits for another location's journal to be listed, to authorize naming it.
_AUTHORIZE_LISTING = 5.0
_NEIGHBOUR_WAIT = 5.0  # Seconds a deletion waits for a neighbour's vectors before refusing.


class StartError(RuntimeError):
    """The process cannot serve the location; the message says why and what to do."""


class WriterFailed(RuntimeError):
    """The location's writer failed an append (another process took the log: this one is a
    zombie, fenced out), so this process stops serving it."""


def _writer_failure(name: str, exc: AppendError) -> str:
    if exc.status == pb.REGISTER_MISMATCH:
        return f"location {name}: another process took its log's writer (this one is fenced out)"
    if exc.status == pb.INDEX_HAS_GREATER_OFFSET:
        return (
            f"location {name}: its journal lost content with every replica that held it "
            "(INDEX_HAS_GREATER_OFFSET): `gazctl journals reset-head` it, then `gazctl "
            f"replication recover {name}`"
        )
    return f"location {name}: an append to its log failed: {exc}"


@dataclass
class LocationConfig:
    location: str
    broker_address: str
    etcd_address: str
    prefix: str = registry.DEFAULT_PREFIX
    journal: str = ""  # Default: replication/<location>.
    host: str = "127.0.0.1"
    port: int = 0
    lease: float = 10.0
    batch: int = 1000  # Events per replication batch.
    # TLS of the Location service (`--replication.server-*`) and the keys that verify its
    # callers' tokens (`--replication.auth-keys`). Its own calls (to brokers, etcd, other
    # locations) go with the process's client credentials ($BROKER_CERT_FILE ...).
    server_tls: ServerTLS = field(default_factory=lambda: ServerTLS(prefix="--replication.server"))
    auth_keys: str = ""

    def __post_init__(self) -> None:
        registry.check_name(self.location)
        self.journal = self.journal or f"replication/{self.location}"


# The most events one Read reply carries, whatever its `limit` (the rest comes with the next).
MAX_READ_EVENTS = 10_000


@dataclass
class _Neighbour:
    entry: registry.LocationEntry
    cvv: VectorClock
    dvv: VectorClock
    status: lpb.StatusResponse = field(default_factory=lpb.StatusResponse)

    @property
    def name(self) -> str:
        return self.entry.name


class LocationProcess:
    """One location's process. `run` serves until `stop` is set; nothing runs before it."""

    def __init__(self, config: LocationConfig) -> None:
        self.config = config
        self.verifier = auth.verifier_of(config.auth_keys, "--replication.auth-keys")
        self.name = config.location
        self.log: JournalEventLog | None = None
        self.port = 0
        self.endpoint = ""
        # The log journal's spec, as last listed: its labels authorize the service's callers.
        self.log_spec = pb.JournalSpec(name=config.journal)
        self.connections: dict[str, ConnectionState] = {}
        # Why this location must be recovered before it emits or replicates ("" if not): a
        # neighbour has seen more of its events than its log holds (a disaster).
        self.lost = ""
        # Whether it may emit: only once every registered location (not retired) has answered
        # since this process started, none of them having seen more of its times than its log
        # holds, or the operator waived those that did not answer (`trust-clock`). Until then,
        # `unheard` names those not heard from.
        self.clock_ok = False
        self.unheard: list[str] = []
        self._heard: set[str] = set()
        self._waived: set[str] = set()
        self._peers: dict[str, LocationClient] = {}
        self._etcd: aetcd.Client | None = None
        self._client: JournalsClient | None = None
        self._brokers: dict[str, JournalsClient] = {}
        self._reader: SourceReader | None = None
        self._reader_lock = asyncio.Lock()
        self._topology_changed = asyncio.Event()
        self._failed = asyncio.Event()  # The writer failed (e.g. fenced): stop serving.
        self.failure = ""
        # The endpoint's key under a lease (discovery only: the log's writer is fenced by the
        # journal's register, not by this lease).
        self.membership: Membership | None = None
        # Connections into this location taken from its neighbours' views by Recover (its own
        # view was lost with its log), until its own view has them again.
        self._adopted: dict[str, str] = {}
        # The write guard of each adopted connection, from the same view: its own view, empty
        # after the loss, would guard nothing until the system events are back.
        self.adopted_guards: dict[str, frozenset[str]] = {}
        self._recovered_neighbours: set[str] = set()  # Its neighbours, as Recover found them.
        # Event recovery under way: each source it recovers its own events from, and the
        # sequence number (the source's last at Recover) its connection must read through.
        self._recovering: dict[str, int] = {}
        self._sync_lock = asyncio.Lock()  # One round at a time records etcd's history.
        self._disagreed: set[int] = set()  # Ops its log holds otherwise than etcd (warned).
        # Its log as a standby folded it (a location host's): `run` folds only the rest.
        self.folded: JournalEventLog | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve the location until `stop` is set (StartError if it cannot start)."""
        cfg = self.config
        async with contextlib.AsyncExitStack() as stack:
            try:
                self._etcd = etcdx.connect(cfg.etcd_address, timeout=10)
            except ValueError as exc:
                raise StartError(str(exc)) from None
            stack.push_async_callback(self._etcd.close)
            self._client = JournalsClient(cfg.broker_address)
            stack.push_async_callback(self._close_clients)
            created = await self._check_journal()
            service = await stack.enter_async_context(AppendService(lambda _j: self._stub()))
            author = random.SystemRandom().getrandbits(62) or 1
            log_ = self.folded
            if log_ is not None and log_.created == created:
                log_.bind(self._stub, service, author)  # Folded by its standby: the rest only.
                log.info("location %s: takes over its log folded through offset %d by its standby", self.name, log_.folded_to)  # fmt: skip
            else:
                log_ = JournalEventLog(self.name, cfg.journal, self._stub, service, author)
                log_.created = created
            self.folded = None
            await log_.open()
            self.log = log_
            self._reader = SourceReader(self._stub, cfg.journal)
            server = grpc.aio.server(
                options=SERVER_OPTIONS,
                interceptors=auth.call_bounds(self.verifier),  # A call ends when its token does.
            )
            server.add_generic_rpc_handlers((LocationService(self).handlers(),))
            bind = f"{cfg.host}:{cfg.port}"
            if cfg.server_tls.enabled:
                self.port = server.add_secure_port(bind, cfg.server_tls.grpc_credentials())
            else:
                self.port = server.add_insecure_port(bind)
            if not self.port:
                raise StartError(f"cannot listen on {cfg.host}:{cfg.port}: the port is taken")
            scheme = "https" if cfg.server_tls.enabled else "http"
            self.endpoint = f"{scheme}://{cfg.host}:{self.port}"
            await server.start()
            stack.push_async_callback(server.stop, 1.0)
            membership = await self._register()
            await self._clock_round()  # Before it says it is ready: whether it may emit.
            async with asyncio.TaskGroup() as tasks:
                background = [
                    tasks.create_task(membership.keep_alive(), name="lease keep-alive"),
                    tasks.create_task(self._watch_clock(), name="clock check"),
                    tasks.create_task(self._watch_journal(), name="journal check"),
                    tasks.create_task(self._run_connections(), name="connections"),
                    tasks.create_task(self._follow_topology(), name="topology history"),
                ]
                if ready is not None:
                    ready.set()
                try:
                    await first_of(stop.wait(), self._failed.wait())
                    if self.failure:
                        log.warning("%s: stopping", self.failure)
                finally:
                    for task in background:
                        task.cancel()
            # Revoking the lease deletes the endpoint only if it is still ours (a process that
            # took the location over put its own).
            await membership.revoke(2.0)
        if self.failure:
            raise WriterFailed(self.failure)

    def writer_failed(self, exc: AppendError) -> str:
        """The log's writer failed (fenced out by another process, say): the process stops
        serving the location; what it says why."""
        self.failure = _writer_failure(self.name, exc)
        self._failed.set()
        return self.failure

    def _stub(self) -> Any:
        assert self._client is not None
        return self._client.stub

    async def _close_clients(self) -> None:
        for client in [self._client, *self._brokers.values(), *self._peers.values()]:
            if client is not None:
                await client.close()

    async def _check_journal(self) -> int:
        """The etcd revision that created the location's journal (StartError if it does not
        exist)."""
        assert self._client is not None
        cfg = self.config
        try:
            found = await journal_listed(self._client, cfg.journal)
        except BrokerUnavailable as exc:
            raise StartError(str(exc)) from None
        if found is not None and found.create_revision:
            self.log_spec = found.spec
            return int(found.create_revision)
        raise StartError(
            f"journal {cfg.journal} does not exist at {cfg.broker_address}: apply it first "
            "(gazctl replication add creates it; so does gazctl dev up --locations)"
        )

    async def _register(self) -> Membership:
        assert self._etcd is not None
        cfg = self.config
        known = await registry.read_locations(self._etcd, cfg.prefix)
        mine = known.get(self.name)
        if mine is not None and (mine.journal, mine.broker) != (cfg.journal, cfg.broker_address):
            raise StartError(
                f"location {self.name} is registered with journal {mine.journal} at "
                f"{mine.broker}, not {cfg.journal} at {cfg.broker_address}: a location keeps its "
                "log (start it with those, or choose another name)"
            )
        if mine is None:  # Declared by its first start (`gazctl replication add` declares more).
            declaration = {"journal": cfg.journal, "broker": cfg.broker_address}
            await self._etcd.put(registry.location_key(cfg.prefix, self.name), json.dumps(declaration).encode())  # fmt: skip
        # Its endpoint, under a lease: it replaces another process's (the newest process is
        # the location's), and when the lease is lost (etcd was away, or this process paused,
        # past its TTL) it is put again under a new one, unless another process put its own
        # meanwhile (it took the location over).
        self.membership = Membership(
            self._etcd,
            registry.endpoint_key(cfg.prefix, self.name).decode(),
            cfg.lease,
            LeasePolicy.RENEW,
            take_over=True,
        )
        deadline = self.membership.start_deadline()
        await self.membership.grant(deadline)
        body = json.dumps({"endpoint": self.endpoint, "pid": os.getpid()}).encode()
        await self.membership.announce(body, deadline)
        return self.membership

    # ---- connections -----------------------------------------------------------------------------

    def _wanted(self) -> dict[str, str]:
        """The connections into this location in the current view: source -> filter."""
        assert self.log is not None
        view = self.log.topology
        if self.name in view.retired:
            return {}
        own = {s: f for (s, t), f in view.current.items() if t == self.name and s not in view.retired}  # fmt: skip
        for source in [s for s in self._adopted if (s, self.name) in view.ever]:
            del self._adopted[source]  # Its own view has it again (connected, or not any more).
            self.adopted_guards.pop(source, None)
        return {**self._adopted, **own}

    async def _others(
        self, known: Mapping[str, registry.LocationEntry] | None = None
    ) -> list[_Neighbour]:
        """Every other location (of `known`, or of the registry) whose process answers, with
        its vectors and view."""
        if known is None:
            known = await registry.read_locations(self.etcd_client(), self.config.prefix)
        out = []
        for entry in known.values():
            if entry.name == self.name or not entry.endpoint:
                continue
            try:
                out.append(await self._vectors(entry, timeout=5))
            except LocationError:
                continue  # Not reachable now.
        return out

    async def _clock_round(self) -> None:
        """One round of the clock check: ask every registered location not heard from yet. Has
        one seen more of this location's times than its log holds? Then it lost events (its
        view of the topology perhaps with them), and waits for Recover. Once every one has
        answered (or was waived), it may emit."""
        assert self.log is not None
        if self.clock_ok or self.lost:
            return
        known = await registry.read_locations(self.etcd_client(), self.config.prefix)
        pending = {n: e for n, e in known.items() if n not in self._heard | {self.name}}
        others = await self._others(pending)
        for other in others:
            if other.cvv[self.name] > self.log.local_time:
                self.lost = (
                    f"location {self.name} lost events: {other.name} has seen its time "
                    f"{other.cvv[self.name]}, its log only {self.log.local_time}; run `gazctl "
                    f"replication recover {self.name}` before it emits or replicates"
                )
                log.warning("%s", self.lost)
                self._topology_changed.set()  # Its connections stop until it is recovered.
                return
            self._heard.add(other.name)
        retired = self.log.topology.retired.union(*(o.status.retired for o in others))
        self.unheard = sorted(
            n for n in known if n not in self._heard | retired | self._waived | {self.name}
        )
        if not self.unheard:
            self.clock_ok = True

    async def _watch_journal(self) -> None:
        """Stop serving if the log's journal is deleted or made anew (its log was lost): this
        process's state is that of a log that no longer exists."""
        assert self.log is not None and self._client is not None
        journal = self.config.journal
        while True:
            await asyncio.sleep(max(1.0, self.config.lease / 3))
            try:
                found = await journal_listed(self._client, journal)
            except Exception as exc:  # Its broker away: ask again at the next round.
                log.warning("%s: checking its journal: %s", self.name, str(exc).split("\n")[0])
                continue
            created = int(found.create_revision) if found is not None else 0
            if found is not None:
                self.log_spec = found.spec  # Its labels authorize the service's callers.
            if created != self.log.created:
                self.failure = (
                    f"location {self.name}: its journal {journal} was "
                    f"{'made anew' if created else 'deleted'} (its log was lost): run `gazctl "
                    f"replication recover {self.name}`"
                )
                self._failed.set()
                return

    async def _watch_clock(self) -> None:
        """Clock rounds until it may emit (or knows it lost events)."""
        backoff = retry_backoff()
        while not (self.clock_ok or self.lost):
            await backoff.sleep()
            try:
                await self._clock_round()
            except (aetcd.exceptions.ClientError, LocationError) as exc:
                log.warning("%s: checking its clock: %s", self.name, str(exc).split("\n")[0])

    async def _check_may_emit(self) -> None:
        """RuleViolation unless this location may emit (a new event, or a system event). Those
        not heard from yet are asked again first: one that has just started answers now."""
        if not (self.clock_ok or self.lost):
            await self._clock_round()
        if self.lost:
            raise RuleViolation(self.lost)
        left = self._recovery_left()
        if left:
            raise RuleViolation(
                f"location {self.name} is {left}: it emits once they are back (an event "
                "emitted now would put its older ones in its causal past, and the causality "
                "filter would drop them)"
            )
        if not self.clock_ok:
            shown = await self._shown(self.unheard)  # The caller's: none hidden from it.
            if shown != self.unheard:
                raise RuleViolation(
                    f"location {self.name} has not heard from every registered location since "
                    "it started: one of them may hold a time of its that its clock has not "
                    "reached (an operator starts them, retires them, or trusts its clock)"
                )
            names = ", ".join(self.unheard) or "the registered locations"
            raise RuleViolation(
                f"location {self.name} has not heard from {names} since it started: one of "
                "them may hold a time of its that its clock has not reached (start them or "
                f"retire them, or run `gazctl replication trust-clock {self.name} --without "
                f"{','.join(self.unheard)}` to emit without them)"
            )

    def _recovery_left(self) -> str:
        """What event recovery still has to read ("" once done): each source it recovers from
        that is still connected, until its connection has read through the source's last
        event as of Recover."""
        if not self._recovering:
            return ""
        assert self.log is not None
        wanted = self._wanted()
        left = []
        for source, through in list(self._recovering.items()):
            done = self.log.progress.get(source, 0)
            if done >= through or source not in wanted:
                del self._recovering[source]
            else:
                left.append(f"{source} (through {done} of {through})")
        return f"recovering its events from {', '.join(left)}" if left else ""

    async def _run_connections(self) -> None:
        assert self.log is not None
        running: dict[str, tuple[str, asyncio.Task[None]]] = {}
        async with asyncio.TaskGroup() as group:
            while True:
                self._topology_changed.clear()
                wanted = {} if self.lost else self._wanted()
                for source, (filter_text, task) in list(running.items()):
                    if wanted.get(source) != filter_text:
                        task.cancel()
                        # Waited for, not awaited: its CancelledError is its own, and one
                        # cancelling this loop still reaches it.
                        await asyncio.wait([task])
                        del running[source]
                        self.connections.pop(source, None)
                for source, filter_text in wanted.items():
                    if source not in running:
                        state = ConnectionState(source, filter_text)
                        self.connections[source] = state
                        task = group.create_task(replicate(self, state), name=f"{source}->{self.name}")  # fmt: skip
                        running[source] = (filter_text, task)
                await first_of(self._topology_changed.wait(), self.log.grown())

    def terminal(self) -> bool:
        """Connected to exactly one other location (in either direction)."""
        assert self.log is not None
        return len(self.neighbour_names()) == 1

    def neighbour_names(self) -> list[str]:
        assert self.log is not None
        view = self.log.topology
        names = {s if t == self.name else t for (s, t) in view.current if self.name in (s, t)}
        # Recover's neighbours stand in only until its own view has their connection again
        # (connected, or not any more): kept after, a location disconnected since was still
        # asked by `delete`, and counted by `terminal`.
        self._recovered_neighbours = {
            n for n in self._recovered_neighbours
            if (n, self.name) not in view.ever and (self.name, n) not in view.ever
        }  # fmt: skip
        return sorted((names | self._recovered_neighbours) - {self.name})

    def etcd_client(self) -> aetcd.Client:
        assert self._etcd is not None
        return self._etcd

    def ask(self, entry: registry.LocationEntry) -> LocationClient:
        client = self._peers.get(entry.endpoint)
        if client is None:
            client = self._peers[entry.endpoint] = LocationClient(entry.name, entry.endpoint)
        return client

    def _journals(self, address: str) -> JournalsClient:
        client = self._brokers.get(address)
        if client is None:
            client = self._brokers[address] = JournalsClient(address)
        return client

    def broker(self, address: str) -> Any:
        stub = self._journals(address).stub
        return lambda: stub

    # ---- the Location service ----------------------------------------------------------------------

    async def selects(self, claims: auth.Claims, entry: registry.LocationEntry) -> bool:
        """Whether `claims` select the log journal of location `entry`, its labels as its
        brokers list it now. False when that cannot be shown (the journal is not listed, or
        its brokers do not answer): an authorization fails closed."""
        if claims.unrestricted:
            return True
        if entry.name == self.name:
            return claims.sees_journal(self.log_spec)
        try:
            async with asyncio.timeout(_AUTHORIZE_LISTING):
                found = await journal_listed(self._journals(entry.broker), entry.journal)
        except Exception as exc:  # Any failure to list it: not shown to be selected.
            log.info("%s: cannot list %s's journal %s to authorize a call: %s", self.name, entry.name, entry.journal, str(exc).split("\n")[0])  # fmt: skip
            return False
        return found is not None and claims.sees_journal(found.spec)

    async def _shown(self, names: list[str]) -> list[str]:
        """Of these registered locations' names (the registry's, not this log's), those the
        caller of the call being served may see: a list in an answer (those not heard from)
        names no location hidden from it."""
        claims = CALLER.get()
        if claims.unrestricted or not names:
            return names
        known = await registry.read_locations(self.etcd_client(), self.config.prefix)
        return [n for n in names if n in known and await self.selects(claims, known[n])]

    async def status(self, request: lpb.StatusRequest) -> lpb.StatusResponse:
        assert self.log is not None and self._reader is not None
        lg = self.log
        view = lg.topology
        prunable = 0  # The journal's content before it holds only deleted events.
        if lg.checkpoint_offset:
            async with self._reader_lock:
                await self._reader.catch_up()
            prunable = min(lg.checkpoint_offset, self._reader.offset_after(lg.deleted_through))
        return lpb.StatusResponse(
            location=self.name, journal=self.config.journal, endpoint=self.endpoint,
            cvv=clock_message(lg.committed_cvv), dvv=clock_message(lg.dvv),
            last_seq=lg.committed_seq, deleted_through=lg.deleted_through,
            local_time=lg.local_time, progress=dict(lg.progress),
            cached_cvv={s: clock_message(c) for s, c in lg.cached_cvv.items()},
            connections=[c.message(lg.progress.get(s, 0)) for s, c in sorted(self.connections.items())],
            history=[lpb.KeyedChange(key=key_message(k), change=change_message(c)) for k, c in view.keyed()],
            retired=sorted(view.retired), lost=self.lost, prunable_before=prunable,
            clock_ok=self.clock_ok, unheard=await self._shown(self.unheard),
            journal_created=lg.created, recovering=self._recovery_left(),
        )  # fmt: skip

    async def emit(self, request: lpb.EmitRequest) -> lpb.EmitResponse:
        assert self.log is not None
        payloads = [_json_object(p, f"payloads[{i}]") for i, p in enumerate(request.payloads)]
        if any("system" in p for p in payloads):
            raise ValueError("payloads: the field 'system' is reserved for topology changes")
        if self.name in self.log.topology.retired:
            raise RuleViolation(f"location {self.name} is retired: it emits no events")
        await self._check_may_emit()
        events = await self.log.emit(payloads)
        return lpb.EmitResponse(
            events=[
                lpb.EventId(
                    emitter=e.emitter, time=e.timestamp[e.emitter],
                    timestamp=clock_message(e.timestamp),
                )
                for e in events
            ]
        )  # fmt: skip

    async def read(self, request: lpb.ReadRequest) -> lpb.ReadResponse:
        """A replication batch for a target: events after `after`, less those ≤ the target's
        `cvv` and those its `filter` drops (OR `emitter` = `or_emitter`), waiting up to `wait`
        seconds for some. The reply carries the events' records as stored here, and this
        location's vectors."""
        assert self.log is not None and self._reader is not None
        after = request.after
        limit = min(request.limit or 1000, MAX_READ_EVENTS)
        cvv = clock_of(request.cvv, "cvv").to_json()
        keep = event_filter(request.filter, request.or_emitter)
        wait = min(max(request.wait, 0.0), 10.0)
        reader = self._reader
        async with self._reader_lock:
            await reader.catch_up()
        if reader.last_seq <= after and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.log.grown(), wait)
            async with self._reader_lock:
                await reader.catch_up()
        batch = await select_lines(self.name, reader, after, cvv, keep, limit)
        return lpb.ReadResponse(
            through=batch.through_seq if batch else after,
            cvv=clock_message(reader.cvv), dvv=clock_message(reader.dvv),
            deleted_through=reader.deleted_through, last_seq=reader.last_seq,
            records=batch.data if batch else b"",
        )  # fmt: skip

    async def change(self, request: lpb.ChangeRequest) -> lpb.ChangeResponse:
        """A topology change. Without `record`: the live checks of this location (may it record
        a system event now; for the target of a fail-over, the cached CVV of the old source),
        which change nothing; the rules are checked on etcd's whole history by the command. With
        `record` and the `op` etcd recorded it at: this location records what etcd's history
        holds and its log lacks (refused if etcd does not hold `op`). With `record` and no `op`:
        the whole command here (checked on etcd's history, recorded there, then here)."""
        assert self.log is not None
        change = change_of_message(request.change)
        if request.op < 0:
            raise ValueError(f"op {request.op}: a command's order is a number of etcd's history")
        if isinstance(change, Connected | Filtered | FailedOver):
            parse_filter(change.filter)  # FilterError (a ValueError) if it does not parse.
        if not request.record:
            # Checked on etcd's whole history (would a command be accepted?), then here.
            history = await commands.read_history(self.etcd_client(), self.config.prefix)
            commands.check(history.view(), change)
            await self._live_check(change)
            return lpb.ChangeResponse(change=request.change, recorded=False)
        if request.op:
            recorded = await self._sync_topology(request.op)
            return lpb.ChangeResponse(change=request.change, recorded=recorded)
        await registry.lookup(self.etcd_client(), self.config.prefix, *_names(change))

        async def live_check(changes: Any) -> None:
            for each in changes:
                await self._live_check(each)

        def plan(view: Topology) -> list[Change]:
            # A disconnection made already is in effect (one call at each end records once).
            if isinstance(change, Disconnected):
                key = (change.source, change.target)
                if key in view.ever and key not in view.current:
                    return []
            return [change]

        done = await commands.command(self.etcd_client(), self.config.prefix, plan, live_check)
        if done.recorded:
            await self._sync_topology(done.recorded[-1][0])
        return lpb.ChangeResponse(change=request.change, recorded=bool(done.recorded))

    async def _live_check(self, change: Change) -> None:
        """What only this location knows, checked for `change` (RuleViolation if it fails)."""
        assert self.log is not None
        await self._check_may_emit()  # It records the change as an event of its own.
        if isinstance(change, FailedOver) and change.target == self.name:
            # The rule of the cached CVV: the new source has seen what the old one sent here.
            entry = (await registry.lookup(self.etcd_client(), self.config.prefix, change.source))[0]  # fmt: skip
            check_fail_over(self.log, change.previous, await self._vectors(entry))

    async def _sync_topology(self, require: int = 0) -> bool:
        """Record, as system events of this location, every change of etcd's history its log
        lacks, in op order (through its own retirement; a retired location records nothing
        more). Whether it recorded any. RuleViolation if it may not emit now (it records them
        once it may), or if etcd's history does not hold `require`."""
        assert self.log is not None
        async with self._sync_lock:
            history = await commands.read_history(self.etcd_client(), self.config.prefix)
            if require and all(op != require for op, _ in history.changes):
                raise RuleViolation(
                    f"op {require} is not in etcd's topology history under {self.config.prefix}: "
                    "only a change recorded there is recorded here"
                )
            view = self.log.topology
            missing = []
            for op, change in history.changes:
                held = view.changes.get(command_key(op))
                if held is None:
                    missing.append((op, change))
                elif held != change and op not in self._disagreed:
                    # Its log's record of that op stays (events are never rewritten): `topology
                    # --check` names it. Said once.
                    self._disagreed.add(op)
                    log.warning("%s: its log holds %s at op %d, etcd's history %s", self.name, held, op, change)  # fmt: skip
            if not missing or self.name in view.retired:
                return False
            await self._check_may_emit()
            payloads = []
            for op, change in missing:
                payloads.append(system_payload(change, op))
                if isinstance(change, Retired) and change.location == self.name:
                    break
            await self.log.emit(payloads)
            self._topology_changed.set()
            return True

    async def _follow_topology(self) -> None:
        """Read etcd's topology history when the process starts and whenever its head moves
        (polled every RETRY seconds), and record what the log lacks; a round that fails (etcd
        away, this location may not emit yet) is tried again after the one backoff."""
        assert self.log is not None
        etcd = self.etcd_client()
        head = commands.head_key(self.config.prefix)
        synced = -1  # The head's mod revision as of the last round that recorded everything.
        backoff = Backoff(initial=RETRY, maximum=5.0)
        while True:
            try:
                current, _ = await etcdx.get_current(etcd, [head])
                if current[0].mod_revision != synced:
                    await self._sync_topology()
                    synced = current[0].mod_revision
                backoff.reset()
                await asyncio.sleep(RETRY)  # Its head, polled.
            except (RuleViolation, ValueError, aetcd.exceptions.ClientError, AppendError, LocationError) as exc:  # fmt: skip
                log.info("%s: recording etcd's topology history: %s", self.name, str(exc).split("\n")[0])  # fmt: skip
                await backoff.sleep()

    async def _vectors(self, entry: registry.LocationEntry, timeout: float | None = None) -> _Neighbour:  # fmt: skip
        """A location's CVV, DVV and status, asked of its process (LocationError if it is down:
        a rule that needs them cannot be checked without)."""
        if not entry.endpoint:
            raise LocationError(entry.name, grpc.StatusCode.UNAVAILABLE, "no process serves it")
        status = await self.ask(entry).status(timeout=timeout)
        return _Neighbour(entry, clock_of(status.cvv, "cvv"), clock_of(status.dvv, "dvv"), status)

    async def _vectors_of(self, *names: str) -> list[_Neighbour]:
        entries = await registry.lookup(self.etcd_client(), self.config.prefix, *names)
        return [await self._vectors(entry) for entry in entries]

    async def delete(self, request: lpb.DeleteRequest) -> lpb.DeleteResponse:
        assert self.log is not None
        through = request.through
        if through < 1 or through >= self.log.next_seq:
            raise ValueError(f"through {through}: this log holds sequence numbers 1-{self.log.next_seq - 1}")  # fmt: skip
        if through <= self.log.deleted_through:
            raise ValueError(f"through {through}: deleted through {self.log.deleted_through} already")  # fmt: skip
        try:
            entries = await registry.lookup(self.etcd_client(), self.config.prefix, *self.neighbour_names())  # fmt: skip
            neighbours = [await self._vectors(e, timeout=_NEIGHBOUR_WAIT) for e in entries]
        except LocationError as exc:
            # A refusal, certain and at once: this location answers (UNAVAILABLE would say it
            # did not, which reads as "perhaps deleted"), and a neighbour that drops packets
            # must not hold the command until the caller's deadline.
            raise RuleViolation(
                f"{self.name} may not delete through {through} now: the rule needs the CVV of "
                f"every directly connected location, and {exc} (start it, or mend the network, "
                "and try again)"
            ) from None
        dvv = await self.log.delete(through, neighbours)
        return lpb.DeleteResponse(dvv=clock_message(dvv), deleted_through=through)

    async def trust_clock(self, request: lpb.TrustClockRequest) -> lpb.TrustClockResponse:
        """The operator's decision: this location may emit without hearing from `without` (each
        a location it has not heard from since it started); the others must still answer."""
        without = list(request.without)
        if self.lost:
            raise RuleViolation(self.lost)
        strangers = sorted(set(without) - set(self.unheard))
        if strangers and not self.clock_ok:
            shown = await self._shown(self.unheard)
            raise ValueError(
                f"without {', '.join(strangers)}: only a location not heard from can be left "
                f"out (not heard from: {', '.join(shown) or 'none'})"
            )
        self._waived |= set(without)
        await self._clock_round()
        if self.clock_ok and without:
            log.warning("%s: emitting without having heard from %s (the operator's decision)", self.name, ", ".join(without))  # fmt: skip
        return lpb.TrustClockResponse(
            clock_ok=self.clock_ok, unheard=await self._shown(self.unheard)
        )

    async def join(self, request: lpb.JoinRequest) -> lpb.JoinResponse:
        """Only new events from `sources`: this location's CVV and DVV raised to the least
        upper bound of their DVVs (location addition)."""
        assert self.log is not None
        sources = list(request.sources)
        if not sources:
            raise ValueError("sources: expected the names of the new neighbours")
        floor = lub(n.dvv for n in await self._vectors_of(*sources))
        await self.log.join(floor)
        return lpb.JoinResponse(cvv=clock_message(self.log.cvv), dvv=clock_message(self.log.dvv))

    async def reset_progress(self, request: lpb.ResetProgressRequest) -> lpb.ResetProgressResponse:
        assert self.log is not None
        source, seq = request.source, request.seq
        if seq < self.log.progress.get(source, 0):
            await self.log.reset_progress(source, seq)
        return lpb.ResetProgressResponse(progress=self.log.progress.get(source, 0))

    async def recover(self, request: lpb.RecoverRequest) -> lpb.RecoverResponse:
        """Disaster recovery of this location, after its log lost events (see the module). Every
        registered location must answer (any may hold its latest times). Its directly connected
        locations are those whose views connect them with it (its own view may be lost with its
        log); the connections into it are taken from their views until its own has them again
        (their system events come back with the other events)."""
        assert self.log is not None
        lg = self.log
        known = await registry.read_locations(self.etcd_client(), self.config.prefix)
        others = await self._others(known)
        retired = set().union(*(o.status.retired for o in others))
        answered = {o.name for o in others}
        missing = sorted(n for n in known if n not in answered | retired | {self.name})
        if missing:
            raise RuleViolation(
                f"{self.name}: cannot recover its clock while {', '.join(missing)} "
                f"{'does' if len(missing) == 1 else 'do'} not answer: any location may hold "
                "its latest events (start them, or retire them, first)"
            )
        if not self.lost and all(
            o.cvv[self.name] <= lg.local_time
            and o.status.progress.get(self.name, 0) <= lg.committed_seq
            for o in others
        ):
            # No location has seen more of its times, nor read more of its log, than its log
            # holds: it lost nothing. Recovery would move its progress on a neighbour it may not
            # recover from to that neighbour's head, skipping what it has not read yet, for good
            # (an operator on a stale view, or `recover` run again after one that completed).
            raise RuleViolation(
                f"{self.name} lost no events (no location has seen more of its times, or read "
                "more of its log, than its log holds): recover is for a location whose log was "
                "lost; nothing was done"
            )
        neighbours = []
        for other in others:
            view = topology_of_status(other.status)
            if (other.name, self.name) in view.current or (self.name, other.name) in view.current:
                neighbours.append((other, view))
        if not neighbours:
            raise RuleViolation(
                f"{self.name}: no running location is connected with it, so there is nothing "
                "to recover from (start its neighbours first)"
            )
        survivors = lg.next_seq - 1
        # The clock: the most any location saw of it (not only its neighbours of now: a past
        # connection may have carried its events further).
        await lg.set_local_time(max([lg.local_time, *(o.cvv[self.name] for o in others)]))
        # Progress for it is reset wherever it was ever replicated to, not only at its
        # neighbours of now: a past connection that comes back would skip its new events.
        readers = {n.name: n for n, _ in neighbours}
        for other in others:
            if (self.name, other.name) in topology_of_status(other.status).ever:
                readers.setdefault(other.name, other)
        for n in readers.values():
            await self.ask(n.entry).reset_progress(self.name, survivors)
        terminal = len(neighbours) == 1
        self._recovered_neighbours = {n.name for n, _ in neighbours}
        skipped = []
        for n, view in neighbours:
            inbound = view.current.get((n.name, self.name))
            outbound = view.current.get((self.name, n.name))
            if inbound is None:
                continue
            self._adopted[n.name] = inbound
            self.adopted_guards[n.name] = view.guard_for(n.name, self.name)
            if (inbound == "" and outbound == "") or terminal:
                # Event recovery from n: the connection reads from its progress; this location
                # emits nothing until it has read through n's last event of now.
                self._recovering[n.name] = n.status.last_seq
                continue
            if view.guard_for(n.name, self.name):
                # Not a connection to recover over, but one into this location's unfiltered
                # group from outside it: the group's write guard holds back every event of n's
                # whose part of its timestamp from the group is not here yet (this location's
                # own events among them, until they are back from the group), so n's log is
                # read from its beginning: n's own events emitted while this location was down
                # are not skipped.
                continue
            # Not allowed to recover from n: resume at its head, skipping what it holds now.
            last = n.status.last_seq
            if lg.progress.get(n.name, 0) < last:
                await lg.write_lines(LineBatch(n.name, b"", last, n.cvv))
            skipped.append(n.name)
        self.lost = ""
        self.clock_ok = True  # Every location answered above, and its clock is past theirs.
        self._topology_changed.set()  # Its connections start (again), from their progress.
        return lpb.RecoverResponse(
            survivors=survivors, local_time=lg.local_time, not_recovered_from=skipped
        )


def _names(change: Change) -> list[str]:
    """The locations a change names."""
    if isinstance(change, Retired):
        return [change.location]
    if isinstance(change, FailedOver):
        return [change.previous, change.source, change.target]
    return [change.source, change.target]


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    """A payload: a JSON object (ValueError naming `what` if it is not one)."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return value
