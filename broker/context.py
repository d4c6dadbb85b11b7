"""What the Append, Read, Replicate and ListFragments handlers and the append FSM depend on: a
small context, not the whole service. It holds the resolver (routes and local replicas), the etcd
client, the dialer of peers, the owner of background tasks, the persister and the limits.
Tests build the FSM and the handlers on it directly."""

from __future__ import annotations

from dataclasses import dataclass, field

import aetcd

from broker.client.dialer import Dialer
from broker.flow_control import RateLimiter
from broker.fragment.persister import Persister
from broker.protocol import protocol_pb2 as pb
from broker.resolver import Resolver
from plumbing.tasks import TaskOwner


@dataclass
class BrokerContext:
    resolver: Resolver
    etcd: aetcd.Client
    dialer: Dialer
    process_id: pb.ProcessSpec.ID
    persister: Persister | None = None
    # Background work of the handlers (pipeline teardowns): joined when the service stops.
    tasks: TaskOwner = field(default_factory=lambda: TaskOwner("journal service"))
    min_append_rate: int = 0  # --broker.min-append-rate: slower clients are aborted.
    append_limiter: RateLimiter = field(default_factory=lambda: RateLimiter(0))  # Broker-wide.
    max_replication: int = 9
    # Journals this broker flushed and suspended at a graceful exit (AppendFSM.flush_and_
    # suspend): it appends to them no more, as their suspension offset must stay their end.
    sealed: set[str] = field(default_factory=set)
    # Set once this broker flushes for its exit: from then on it resumes no suspended journal
    # (another exiting broker may have flushed it; it is resumed after the restart).
    exiting: bool = False

    def unrouted_header(self) -> pb.Header:
        return pb.Header(
            process_id=self.process_id,
            route=pb.Route(primary=-1),
            etcd=self.resolver.etcd_header(),
        )
