"""The replication connections into a location: each reads its source (from the source's
process, filtered there, or from the source's journal when that process is down) and writes
what it reads with its progress in one append (`replicate`); what each is doing, for Status
(`ConnectionState`, its `Phase`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from broker.client import BrokerUnavailable
from broker.client.appender import AppendError
from broker.client.reader import ReadError
from plumbing.backoff import Backoff
from replication import location_pb2 as lpb
from replication import registry
from replication.filters import parse_filter
from replication.journal_log import LineBatch, SourceReader, select_lines
from replication.model import EventFilter
from replication.rpc import LocationError, clock_of
from replication.system import passes

if TYPE_CHECKING:
    from replication.process import LocationProcess

RETRY = 0.5  # At most this many seconds between attempts of a loop that waits or fails.
LOOKUP_EVERY = 5.0  # Seconds a connection goes on with its source's registry entry.


def retry_backoff() -> Backoff:
    """Between attempts of a connection (or round) that waits or fails: soon at first, then
    every `RETRY` seconds; reset once it makes progress."""
    return Backoff(initial=0.05, maximum=RETRY)


def raise_if_cancelling(exc: BaseException) -> None:
    """Re-raise the cancellation of the current task if one is under way: a call that ends in
    the same moment as its task is cancelled can surface as its own error (a gRPC call as
    CANCELLED), and a loop that took it for a failure would go on as a zombie."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


def batch_of(source: str, reply: lpb.ReadResponse) -> LineBatch:
    """The batch a Read reply carries."""
    return LineBatch(source, reply.records, reply.through, clock_of(reply.cvv, "cvv"))


class Phase(enum.Enum):
    """What a connection into this location is doing."""

    STARTING = "starting"
    REPLICATING = "replicating"
    WAITING = "waiting"  # For what its `why` says.
    RETRYING = "retrying"  # After the error its `error` says.


@dataclass
class ConnectionState:
    """What a connection into this location is doing, for Status."""

    source: str
    filter: str
    phase: Phase = Phase.STARTING
    why: str = ""  # What a WAITING connection waits for.
    via: str = ""  # "location" (filtered at the source) or "journal" (its process is down).
    source_last_seq: int = 0
    read: int = 0
    written: int = 0
    error: str = ""

    def enter(self, phase: Phase, why: str = "", error: str = "") -> None:
        self.phase, self.why, self.error = phase, why, error

    @property
    def state(self) -> str:
        """As Status shows it: the phase, and what a waiting connection waits for."""
        return f"{self.phase.value}: {self.why}" if self.why else self.phase.value

    def message(self, progress: int) -> lpb.ConnectionStatus:
        return lpb.ConnectionStatus(
            source=self.source, filter=self.filter, state=self.state, via=self.via,
            progress=progress, source_last_seq=self.source_last_seq,
            lag=max(0, self.source_last_seq - progress), read=self.read, written=self.written,
            error=self.error,
        )  # fmt: skip


async def replicate(location: LocationProcess, state: ConnectionState) -> None:
    """The connection state.source -> this location, until cancelled."""
    assert location.log is not None
    target = location.log
    source = state.source
    direct: SourceReader | None = None  # Reading the source's journal (its process down).
    pending: Awaitable[Any] | None = None  # The last round's append, committing.
    entry: registry.LocationEntry | None = None  # The source, as registered (re-read now
    looked_up = 0.0  # and then, and after any failure).
    backoff = retry_backoff()
    loop = asyncio.get_running_loop()
    while True:
        try:
            if entry is None or loop.time() - looked_up > LOOKUP_EVERY:
                entry = (await registry.lookup(location.etcd_client(), location.config.prefix, source))[0]  # fmt: skip
                looked_up = loop.time()
            or_here = location.terminal() and bool(state.filter)
            # A connection from outside this location's unfiltered group (filtered or not)
            # writes only what the group's part of its timestamp allows (redundant
            # filtered connections; an event from outside may carry the group's events
            # that a filter on the way out left behind).
            group = target.topology.guard_for(source, location.name)
            group |= location.adopted_guards.get(source, frozenset())
            after = target.progress.get(source, 0)
            if entry.endpoint:
                direct = None
                reply = await location.ask(entry).read(
                    after, location.config.batch, cvv=target._cvv, filter=state.filter,
                    or_emitter=location.name if or_here else "",
                    wait=0.0 if pending is not None else 1.0,
                )  # fmt: skip
                state.via = "location"
                batch = batch_of(source, reply)
                dvv = clock_of(reply.dvv, "dvv")
                deleted_through, last_seq = reply.deleted_through, reply.last_seq
            else:
                if direct is None:
                    direct = SourceReader(location.broker(entry.broker), entry.journal)
                state.via = "journal"
                if direct.last_seq <= after:
                    await direct.refresh()
                keep = event_filter(state.filter, location.name if or_here else "")
                selected = await select_lines(source, direct, after, target._cvv, keep, location.config.batch)  # fmt: skip
                batch = selected or LineBatch(source, b"", after, direct.cvv)
                dvv, deleted_through, last_seq = direct.dvv, direct.deleted_through, direct.last_seq  # fmt: skip
            state.source_last_seq = last_seq
            if after < deleted_through and not dvv <= target.cvv:
                state.enter(
                    Phase.WAITING,
                    f"DVV-{source} {dvv} is not <= CVV-{location.name} {target.cvv} "
                    f"(events {source} deleted are not all here)",
                )
                await backoff.sleep()
                continue
            state.enter(Phase.REPLICATING)
            if batch.through_seq > after or batch.data:
                # Staged: the next round reads while this one's append commits. Only if
                # the progress is still the one it was read from: `recover` of the
                # source may have reset it while the read was under way.
                written, commit = await target.stage_lines(batch, group=group, after=after)
                if pending is not None:
                    await pending
                pending = commit
                now = target.progress.get(source, 0)
                if now < after:
                    continue  # Reset: the batch was dropped; read again from `now`.
                state.read += now - after
                state.written += len(written)
                if now == after:
                    state.enter(
                        Phase.WAITING,
                        f"the next event from {source} follows events of "
                        f"{','.join(sorted(group))} that are not here yet",
                    )
                    await backoff.sleep()
                else:
                    backoff.reset()
            else:
                if pending is not None:
                    await pending
                    pending = None
                elif not entry.endpoint:
                    await backoff.sleep()  # The source's journal, polled.
        except AppendError as exc:
            raise_if_cancelling(exc)
            location.writer_failed(exc)
            return
        except (
            LocationError, BrokerUnavailable, ReadError, grpc.aio.AioRpcError,
            registry.UnknownLocation, ValueError,
        ) as exc:  # fmt: skip
            raise_if_cancelling(exc)
            # The source unreachable, its journal gone or made anew: read it afresh.
            direct, entry = None, None
            state.enter(Phase.RETRYING, error=str(exc).split("\n")[0])
            await backoff.sleep()


def event_filter(text: str, or_emitter: str) -> EventFilter | None:
    """A connection's filter: system events always pass; with `or_emitter`, so do events that
    location emitted (event recovery of a terminal location over a filtered connection)."""
    keep = parse_filter(text)
    if keep is None:
        return None
    if or_emitter:
        inner = keep
        keep = lambda e: e.emitter == or_emitter or inner(e)  # noqa: E731
    return passes(keep)
