"""Resolution of a journal to its current Route at an etcd revision, and the local replicas.

The resolver observes the keyspace: journals assigned to this broker get a `Replica`, which is
signalled (invalidated) whenever the journal's assignments change, and stopped when unassigned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from allocator import keyspace as aks
from broker.protocol import protocol_pb2 as pb
from broker.replica import Replica
from keyspace import KeySpace, KeyValue, Update
from plumbing import logs
from plumbing.auth import Claims
from plumbing.tasks import TaskOwner

if TYPE_CHECKING:
    from allocator.state import State

log = logging.getLogger(__name__)


class ResolveError(RuntimeError):
    """A request's header contradicts this broker (another etcd cluster, or another process)."""


def strip_meta(journal: str) -> str:
    """Journal names in Read and Append may carry a `;meta` suffix, which routing ignores."""
    return journal.split(";", 1)[0]


def desired_replication(spec: pb.JournalSpec, max_replication: int = 9) -> int:
    if spec.suspend.level == pb.JournalSpec.Suspend.FULL:
        return 0
    if spec.suspend.level == pb.JournalSpec.Suspend.PARTIAL:
        return 1
    return min(spec.replication, max_replication)


@dataclass
class Resolution:
    status: pb.Status
    local_id: pb.ProcessSpec.ID
    header: pb.Header
    journal: str
    item: KeyValue | None = None
    spec: pb.JournalSpec | None = None
    assignments: tuple[KeyValue, ...] = ()
    replica: Replica | None = None
    # Set when the resolution is stale: the journal's assignments changed since.
    invalidated: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def route(self) -> pb.Route:
        return self.header.route

    @property
    def is_local(self) -> bool:
        return self.header.process_id == self.local_id


class Resolver:
    def __init__(
        self,
        ks: KeySpace,
        root: str,
        local_id: pb.ProcessSpec.ID,
        new_replica: Callable[[str], Replica],
        *,
        max_replication: int = 9,
    ) -> None:
        self.ks = ks
        self.root = root
        self.local_id = local_id
        self.new_replica = new_replica
        self.max_replication = max_replication
        self.replicas: dict[str, Replica] | None = {}
        self.tasks = TaskOwner("resolver")  # Replicas stopping or being demoted.
        ks.add_observer(self._on_update)

    def placement_shortfall(self) -> str | None:
        """Why some journals' replicas cannot be placed, from the allocator's own view (etcd):
        the members' --broker.limit slots are fewer than the replicas wanted, or a journal's
        replication asks for more brokers than there are. None when neither is so."""
        from allocator.state import State
        from broker.keyspace import broker_rules

        state = State.from_keyspace(self.ks, self.root, "", broker_rules(self.max_replication))
        return shortfall_of(state)

    def _member(self, zone: str, suffix: str) -> aks.Member | None:
        kv = self.ks.get(aks.member_key(self.root, zone, suffix))
        return kv.decoded if kv is not None and isinstance(kv.decoded, aks.Member) else None

    def assignments_of(self, journal: str) -> tuple[KeyValue, ...]:
        return tuple(self.ks.prefixed(f"{self.root}{aks.ASSIGNMENTS}{journal}{aks.SEP}"))

    def route_of(self, assignments: Sequence[KeyValue]) -> pb.Route:
        return aks.build_route(assignments, self._member)

    def etcd_header(self) -> pb.Header.Etcd:
        h = self.ks.header
        return pb.Header.Etcd(
            cluster_id=h.cluster_id,
            member_id=h.member_id,
            revision=self.ks.revision,
            raft_term=h.raft_term,
        )

    async def resolve(
        self,
        journal: str,
        *,
        may_proxy: bool,
        require_primary: bool,
        min_etcd_revision: int = 0,
        proxy_header: pb.Header | None = None,
        claims: Claims | None = None,
    ) -> Resolution:
        """The journal's route and this broker's part in it. A journal `claims` (the caller's
        verified authorization) do not select is resolved as if it did not exist."""
        journal = strip_meta(journal)
        if proxy_header is not None and proxy_header.HasField("etcd"):
            if (
                proxy_header.etcd.cluster_id
                and proxy_header.etcd.cluster_id != self.ks.header.cluster_id
            ):
                raise ResolveError(
                    f"request etcd cluster {proxy_header.etcd.cluster_id} is not ours "
                    f"({self.ks.header.cluster_id})"
                )
            pid = proxy_header.process_id
            if (pid.zone or pid.suffix) and pid != self.local_id:
                raise ResolveError(
                    f"request is for process {pid.zone + '/' + pid.suffix!r}, not this broker "
                    f"({self.local_id.zone + '/' + self.local_id.suffix!r})"
                )
            min_etcd_revision = max(min_etcd_revision, proxy_header.etcd.revision)
        if min_etcd_revision > self.ks.revision:
            await self.ks.wait_for_revision(min_etcd_revision)

        # Everything below is synchronous: one consistent view of the keyspace.
        res = Resolution(
            status=pb.OK,
            local_id=self.local_id,
            header=pb.Header(etcd=self.etcd_header()),
            journal=journal,
        )
        item_kv = self.ks.get(aks.item_key(self.root, journal))
        if item_kv is not None and isinstance(item_kv.decoded, aks.Item):
            spec = item_kv.decoded.spec
            if isinstance(spec, pb.JournalSpec) and (claims is None or claims.sees_journal(spec)):
                res.item, res.spec = item_kv, spec
        res.assignments = self.assignments_of(journal) if res.spec is not None else ()
        route = self.route_of(res.assignments)
        res.header.route.CopyFrom(route)

        members = list(route.members)
        if require_primary and route.primary != -1:
            res.header.process_id.CopyFrom(members[route.primary])
        elif not require_primary and self.local_id in members:
            res.header.process_id.CopyFrom(self.local_id)
        elif not require_primary and members:
            # Not a replica: a reader is proxied to the primary, else any member.
            target = members[route.primary] if route.primary != -1 else members[0]
            res.header.process_id.CopyFrom(target)

        if self.replicas is not None and (replica := self.replicas.get(journal)) is not None:
            res.replica = replica
            res.invalidated = replica.invalidated

        if res.spec is None:
            res.status = pb.JOURNAL_NOT_FOUND
        elif res.spec.suspend.level == pb.JournalSpec.Suspend.FULL:
            res.status = pb.SUSPENDED
        elif require_primary and route.primary == -1:
            res.status = pb.NO_JOURNAL_PRIMARY_BROKER
        elif not members:
            res.status = pb.INSUFFICIENT_JOURNAL_BROKERS
        elif not may_proxy and res.header.process_id != self.local_id:
            res.status = pb.NOT_JOURNAL_PRIMARY_BROKER if require_primary else pb.NOT_JOURNAL_BROKER
        elif res.header.process_id == self.local_id and res.replica is None:
            # Assigned in etcd, but this broker is stopping (or has not caught up).
            res.status = pb.NOT_JOURNAL_BROKER
        if res.status != pb.OK:
            res.header.process_id.CopyFrom(self.local_id)
        return res

    # ---- local replicas -----------------------------------------------------------------

    def _on_update(self, update: Update) -> None:
        if update.reload or self.replicas is None:
            self.update_replicas()
            return
        # Only the journals whose item or assignments changed: a pass over every assignment
        # at each update made placing N journals O(N^2), and pulsed every journal at once.
        items, assigns = self.root + aks.ITEMS, self.root + aks.ASSIGNMENTS
        journals: set[str] = set()
        for change in update.changes:
            key = change.key
            if key.startswith(assigns):
                journals.add(key[len(assigns) :].split(aks.SEP, 1)[0])
            elif key.startswith(items):
                journals.add(key[len(items) :])
            elif key.startswith(self.root + aks.MEMBERS):
                # A member's endpoint is part of every route it is in.
                self.update_replicas()
                return
        if journals:
            self.update_replicas(journals)

    def update_replicas(self, journals: set[str] | None = None) -> None:
        """Start, signal, promote or demote, and stop local replicas to match the keyspace:
        of every journal, or of `journals` only."""
        if self.replicas is None:
            return
        local = (self.local_id.zone, self.local_id.suffix)
        mine: dict[str, aks.Assignment] = {}
        if journals is None:
            candidates = self.ks.prefixed(self.root + aks.ASSIGNMENTS)
        else:
            candidates = [kv for j in sorted(journals) for kv in self.assignments_of(j)]
        for kv in candidates:
            a = kv.decoded
            if isinstance(a, aks.Assignment) and (a.member_zone, a.member_suffix) == local:
                mine.setdefault(a.item_id, a)

        current = self.replicas
        kept: set[str] = set()
        for journal, assignment in mine.items():
            item_kv = self.ks.get(aks.item_key(self.root, journal))
            if item_kv is None:
                continue  # An orphaned assignment: the allocator will remove it.
            self._update_one(journal, assignment, item_kv, current)
            kept.add(journal)
        scope = list(current) if journals is None else [j for j in journals if j in current]
        for journal in scope:
            if journal not in kept:
                self._stop(current.pop(journal))

    def _update_one(
        self,
        journal: str,
        assignment: aks.Assignment,
        item_kv: KeyValue,
        current: dict[str, Replica],
    ) -> None:
        primary = assignment.slot == 0
        assignments = self.assignments_of(journal)
        replica = current.get(journal)
        if replica is not None and replica.create_revision != item_kv.create_revision:
            # The journal was deleted and re-created: start afresh.
            self._stop(replica)
            replica = None
        if replica is not None and replica.primary and not primary:
            # Demoted: the pipeline goes (the new primary builds its own); the spool and
            # index stay, so content committed here remains readable here.
            self.tasks.spawn(replica.demote(), f"demoting {journal}")
        if replica is None:
            replica = self.new_replica(journal)
            with logs.bound(journal=journal):  # Its tasks log with the journal.
                log.info("starting local replica of %s (primary: %s)", journal, primary)
                replica.start()
            replica.create_revision = item_kv.create_revision
            replica.assignments = assignments
        elif _revisions(assignments) != _revisions(replica.assignments):
            replica.assignments = assignments
            replica.signal()
        replica.primary = primary
        item = item_kv.decoded
        if isinstance(item, aks.Item) and isinstance(item.spec, pb.JournalSpec):
            replica.set_spec(item.spec)
        replica.on_route_change()
        current[journal] = replica

    def _stop(self, replica: Replica) -> None:
        log.info("stopping local replica of %s", replica.journal)
        replica.signal()
        self.tasks.spawn(replica.shutdown(), f"stopping {replica.journal}")

    async def stop_serving(self) -> None:
        """Stop every local replica (on broker exit) and wait for them."""
        if self.replicas is not None:
            for replica in self.replicas.values():
                self._stop(replica)
            self.replicas = None
        self.ks.remove_observer(self._on_update)
        await self.tasks.join()  # Each shutdown is bounded.
        await self.tasks.close()


def _revisions(kvs: tuple[KeyValue, ...]) -> list[tuple[str, int]]:
    return [(kv.key, kv.mod_revision) for kv in kvs]


def shortfall_of(state: State) -> str | None:
    """See Resolver.placement_shortfall: one clause, for a client's one-line error."""
    wanted, members = state.item_slots, len(state.members)
    if not wanted:
        return None
    if not members:
        return "no broker is running"
    slots = state.member_slots
    if wanted > slots:
        limits = set(state.limits)
        brokers = f"{members} broker{'' if members == 1 else 's'}"
        if len(limits) == 1:
            (limit,) = limits
            brokers += f" of {limit} journal{'' if limit == 1 else 's'} each"
        return (
            f"the brokers' --broker.limit slots are all taken ({brokers}: {slots} slots for "
            f"{wanted} replicas)"
        )
    most = max(state.replication)
    if most > members:
        return f"a replication of {most} asks for more brokers than the {members} running"
    return None
