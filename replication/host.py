"""Location hosts: location processes with hot standbys, run by the consumer framework.

A location host is a consumer process (`python -m replication host`) of one application whose
shards are locations: shard `location/NAME` in the shard keyspace `PREFIX/hosts` of the
replication network's registry. The framework's allocator assigns each location a primary and
standbys among the hosts, by the same leases, slots and statuses as any consumer's shards:

* the primary runs the location's process (`LocationProcess`: it takes the log's writer, fencing
  out any earlier one, serves the Location service and runs the connections into it) and is
  advertised PRIMARY only once it serves;
* a standby folds the location's log as it grows (its vectors, progress and topology view), so
  that when the primary's host dies and its lease expires, the standby promoted takes the writer
  and folds only what was appended since.

Fencing is the log's, as for a location process started by hand: the new writer's register
refuses the old one's next append, so a host that lost its lease but still runs (paused,
partitioned) cannot write once another took over; its Location service then stops.

`gazctl replication add` declares a location in the registry, creates its log's journal and
its shard; `gazctl replication recover` restarts a location whose log was lost."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aetcd
from aetcd import transactions

from allocator import keyspace as aks
from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from consumer.protocol import cpb
from plumbing import etcd as etcdx
from plumbing.tasks import first_of
from plumbing.tls import ServerTLS
from replication import registry
from replication.journal_log import JournalEventLog
from replication.journals import journal_created
from replication.process import LocationConfig, LocationProcess

if TYPE_CHECKING:
    from consumer.runtime import Consumer

__all__ = [
    "SHARD_PREFIX",
    "HostSettings",
    "LocationHost",
    "add_location",
    "hosts_prefix",
    "location_of_shard",
    "shard_of_location",
    "shard_spec",
]

log = logging.getLogger("replication")

SHARD_PREFIX = "location/"
_FOLD_EVERY = 0.25  # Seconds between a standby's folds of the log's new records.


def hosts_prefix(prefix: str) -> str:
    """The shard keyspace of a replication network's location hosts."""
    return f"{prefix.rstrip('/')}/hosts"


def shard_of_location(name: str) -> str:
    return SHARD_PREFIX + name


def location_of_shard(shard_id: str) -> str:
    if not shard_id.startswith(SHARD_PREFIX):
        raise ValueError(f"shard {shard_id} is not a location's ({SHARD_PREFIX}NAME)")
    return registry.check_name(shard_id.removeprefix(SHARD_PREFIX))


def shard_spec(name: str, standbys: int = 1) -> cpb.ShardSpec:
    """The shard of location `name`: no sources and no recovery log (its state is its log),
    `standbys` hot standbys."""
    spec = cpb.ShardSpec(id=shard_of_location(name), hot_standbys=standbys)
    spec.max_txn_duration.seconds = 1  # Unused (a location runs no transactions); required.
    return spec


@dataclass
class HostSettings:
    """What a host gives each location it runs (the `--replication.*` flags)."""

    prefix: str = registry.DEFAULT_PREFIX
    batch: int = 1000
    lease: float = 10.0  # The TTL of each location's endpoint in the registry.
    server_tls: ServerTLS = field(default_factory=lambda: ServerTLS(prefix="--replication.server"))
    auth_keys: str = ""


class LocationHost:
    """The application of a location host (see the module). Its shards run no transactions:
    the framework calls `run_primary` and `run_standby` instead."""

    def __init__(self, settings: HostSettings) -> None:
        self.settings = settings
        # Each location's log as this host's standby folded it, for its primary to take over.
        self._folded: dict[str, JournalEventLog] = {}
        self.servers: dict[str, LocationProcess] = {}  # The locations it runs as primary.

    async def _entry(self, consumer: Consumer, name: str) -> registry.LocationEntry:
        return (await registry.lookup(consumer.etcd, self.settings.prefix, name))[0]

    def _config(self, consumer: Consumer, entry: registry.LocationEntry) -> LocationConfig:
        s = self.settings
        return LocationConfig(
            entry.name, entry.broker, consumer.config.etcd_address, prefix=s.prefix,
            journal=entry.journal, host=consumer.config.host, lease=s.lease, batch=s.batch,
            server_tls=s.server_tls, auth_keys=s.auth_keys,
        )  # fmt: skip

    async def run_primary(
        self, consumer: Consumer, spec: cpb.ShardSpec, ready: Callable[[], Awaitable[None]]
    ) -> None:
        """Run the location's process until cancelled, or until its writer fails (another took
        the log: this one was fenced out); `ready()` once it serves."""
        name = location_of_shard(spec.id)
        entry = await self._entry(consumer, name)
        server = LocationProcess(self._config(consumer, entry))
        folded = self._folded.pop(name, None)
        if folded is not None and folded.journal == entry.journal:
            server.folded = folded
        stop, up = asyncio.Event(), asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            running = tasks.create_task(server.run(stop, up), name=f"location {name}")
            await first_of(running, up.wait())
            if not up.is_set():
                return  # It failed to start: the task group raises its error.
            self.servers[name] = server
            try:
                await ready()
                log.info("location %s serving at %s (host %s)", name, server.endpoint, consumer.config.id)  # fmt: skip
                await asyncio.shield(running)
            finally:
                self.servers.pop(name, None)
                stop.set()  # Cancelled (or it failed): it stops serving, revoking its endpoint,
                await asyncio.wait([running], timeout=5)  # before the task group cancels it.

    async def run_standby(self, consumer: Consumer, spec: cpb.ShardSpec) -> None:
        """Fold the location's log as it grows, until the replica stops or is promoted (its
        primary then takes the folded log, if its journal is still the same one)."""
        name = location_of_shard(spec.id)
        entry = await self._entry(consumer, name)
        async with JournalsClient(entry.broker) as client:
            while True:
                try:
                    await self._fold(name, entry.journal, client)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Its broker away, its journal gone: try again.
                    log.warning("standby of location %s: folding its log: %s", name, str(exc).split("\n")[0])  # fmt: skip
                await asyncio.sleep(_FOLD_EVERY)

    async def _fold(self, name: str, journal: str, client: JournalsClient) -> None:
        created = await journal_created(client, journal)
        folded = self._folded.get(name)
        if folded is None or (folded.journal, folded.created) != (journal, created):
            # The first fold, or its journal was made anew (a lost log): from its beginning.
            folded = JournalEventLog(name, journal, lambda: client.stub, None, author=0)
            folded.created = created
            self._folded[name] = folded
        if created:
            await folded.fold()

    # A location runs no transactions: the framework calls the methods above instead.

    async def new_store(self, shard: Any) -> Any:
        raise NotImplementedError("a location host runs no transactions")

    async def consume_message(self, *args: Any) -> None:
        raise NotImplementedError("a location host runs no transactions")

    async def finalize_txn(self, *args: Any) -> None:
        raise NotImplementedError("a location host runs no transactions")


async def add_location(
    etcd: aetcd.Client, prefix: str, name: str, broker: str, journal: pb.JournalSpec, standbys: int
) -> tuple[bool, bool]:
    """Declare location `name` in the registry (its log's journal, broker, and what its journal
    is made with) and create its shard for the hosts, each unless it exists: in one etcd
    transaction. Whether each was made now. ValueError if it is declared with another journal
    or broker (a location keeps its log)."""
    mine = (await registry.read_locations(etcd, prefix)).get(name)
    if mine is not None and (mine.journal, mine.broker) != (journal.name, broker):
        raise ValueError(
            f"location {name} is registered with journal {mine.journal} at {mine.broker}, "
            f"not {journal.name} at {broker}: a location keeps its log"
        )
    spec, _ = await location_shard(etcd, prefix, name)
    compare, puts = [], []
    if mine is None:
        key = registry.location_key(prefix, name)
        store = journal.fragment.stores[0] if journal.fragment.stores else ""
        body = {"journal": journal.name, "broker": broker, "store": store, "replication": journal.replication}  # fmt: skip
        compare.append(transactions.Version(key) == 0)
        puts.append(transactions.Put(key, json.dumps(body).encode()))
    if spec is None:
        key = aks.item_key(hosts_prefix(prefix), shard_of_location(name)).encode()
        compare.append(transactions.Version(key) == 0)
        puts.append(transactions.Put(key, shard_spec(name, standbys).SerializeToString()))
    if puts and not (await etcdx.txn(etcd, compare, puts)).succeeded:
        raise ValueError(f"location {name}: its registry entry changed meanwhile; run the command again")  # fmt: skip
    return mine is None, spec is None


# ---- the hosts' keyspace, for gazctl ----------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """An assignment of a location's shard to a host."""

    key: str
    host: str  # zone#suffix of the consumer process.
    slot: int  # 0: the primary.
    status: cpb.ReplicaStatus
    mod_revision: int


async def location_shard(
    etcd: aetcd.Client, prefix: str, name: str
) -> tuple[cpb.ShardSpec | None, list[Replica]]:
    """Location `name`'s shard spec in the hosts' keyspace (None: no host runs it), and its
    assignments."""
    root = hosts_prefix(prefix)
    shard = shard_of_location(name)
    got = await etcd.get(aks.item_key(root, shard).encode())
    spec = cpb.ShardSpec.FromString(got.value) if got is not None else None
    replicas = []
    base = f"{root}{aks.ASSIGNMENTS}{shard}{aks.SEP}"
    for kv in await etcd.get_prefix(base.encode()):
        key = kv.key.decode()
        zone, suffix, slot = key[len(base) :].split(aks.SEP)
        status = cpb.ReplicaStatus.FromString(kv.value) if kv.value else cpb.ReplicaStatus()
        replicas.append(Replica(key, f"{zone}{aks.SEP}{suffix}", int(slot), status, int(kv.mod_revision)))  # fmt: skip
    return spec, sorted(replicas, key=lambda r: r.slot)


async def restart_location(etcd: aetcd.Client, prefix: str, name: str) -> list[Replica]:
    """Take location `name` from the host that runs it (its primary's assignment, and any that
    FAILED, removed in one transaction): the allocator assigns it afresh, a standby first.
    The replicas removed."""
    _, replicas = await location_shard(etcd, prefix, name)
    gone = [r for r in replicas if r.slot == 0 or r.status.code == cpb.ReplicaStatus.FAILED]
    if gone:
        result = await etcdx.txn(
            etcd,
            [transactions.Mod(r.key.encode()) == r.mod_revision for r in gone],
            [transactions.Delete(r.key.encode()) for r in gone],
        )
        if not result.succeeded:
            return []  # It changed meanwhile (the allocator moved it): the caller looks again.
    return gone
