"""`gazctl replication ...`: operate a replication network through its location processes, found
in the replication registry in etcd.

A topology change (connect, disconnect, a filter change, retire) is checked by every location
it involves against that location's view of the topology's history, and only then recorded at
each of them as a system event; a refusal is one line naming the rule and the vectors, and then
nothing was recorded anywhere."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import click
from rich.table import Table

from broker.protocol import protocol_pb2 as pb
from gazctl import render
from gazctl.options import file_root_option
from plumbing import config as cfg
from plumbing import etcd as etcdx
from replication import commands, registry
from replication import location_pb2 as lpb
from replication.rpc import Document, LocationClient, LocationError, clock_of, status_document
from replication.system import topology_of_documents
from replication.topology import (
    Change,
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    Retired,
    RuleViolation,
    Topology,
)
from replication.vclock import VectorClock

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

UserError = click.ClickException  # One line on stderr, exit 1 (gazctl.cli.UserError's base).


def run(coro: Coroutine[Any, Any, T]) -> T:
    from gazctl.cli import run as run_

    return run_(coro)


def replication_options(f: F) -> F:
    for decorator in reversed(
        [
            cfg.option("--etcd.address", default="http://localhost:2379", help="etcd service address of the replication registry"),
            cfg.option("--replication.prefix", default=registry.DEFAULT_PREFIX, help="etcd prefix of the replication registry"),
        ]
    ):  # fmt: skip
        f = decorator(f)
    return cfg.client_credentials("etcd")(f)


@click.group()
def replication() -> None:
    """Operate replication networks: locations, connections, deletion, recovery."""


# Seconds a command waits for a location that hosts run to be served again: a move between
# hosts, or a standby's take-over once its primary's host lease expired.
HOSTED_WAIT = 30.0


class Network:
    """The registry and clients of the locations' processes, for one command."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.prefix = opts["replication_prefix"].rstrip("/")
        try:
            self.etcd: aetcd.Client = etcdx.connect(opts["etcd_address"], timeout=10)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        self.clients: dict[str, LocationClient] = {}

    async def __aenter__(self) -> Network:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients.values():
            await client.close()
        await self.etcd.close()

    async def locations(self) -> dict[str, registry.LocationEntry]:
        try:
            return await registry.read_locations(self.etcd, self.prefix)
        except Exception as exc:
            raise UserError(f"cannot read the replication registry: {exc}") from None

    async def entries(self, *names: str) -> list[registry.LocationEntry]:
        try:
            return await registry.lookup(self.etcd, self.prefix, *names)
        except registry.UnknownLocation as exc:
            raise UserError(str(exc)) from None

    async def client(self, name: str) -> LocationClient:
        """The client of the process that serves location `name` now (UserError if none). A
        location that hosts run and that is between hosts (the allocator moves it, or a standby
        takes it over from a host that died, whose endpoint no one answers at) is waited for,
        up to HOSTED_WAIT seconds; nothing is sent before a process answers, so no call is
        made twice."""
        entry = (await self.entries(name))[0]
        hosted = await self._hosted(name)
        if hosted:
            import asyncio

            loop = asyncio.get_running_loop()
            deadline = loop.time() + HOSTED_WAIT
            dead = ""
            while loop.time() < deadline:
                if entry.endpoint and entry.endpoint != dead:
                    if await self._answers(name, entry.endpoint):
                        break
                    dead = entry.endpoint  # Its host died: its lease has yet to expire.
                await asyncio.sleep(0.1)
                entry = (await self.entries(name))[0]
            else:
                entry = registry.LocationEntry(name, entry.journal, entry.broker)
        if not entry.endpoint:
            raise UserError(
                f"location {name} is not running: no process serves it (start a location host, "
                f"`python -m replication host`, or `python -m replication serve --location {name}`)"
            )
        client = self.clients.get(name)
        if client is not None and client.endpoint != entry.endpoint:
            await client.close()  # Another process serves it now.
            client = None
        if client is None:
            client = self.clients[name] = LocationClient(name, entry.endpoint)
        return client

    async def _answers(self, name: str, endpoint: str) -> bool:
        """Whether a process answers at `endpoint` (its channel connects within a second)."""
        import asyncio

        client = self.clients.get(name)
        if client is None or client.endpoint != endpoint:
            if client is not None:
                await client.close()
            client = self.clients[name] = LocationClient(name, endpoint)
        try:
            await asyncio.wait_for(client.channel.channel_ready(), 1.0)
            return True
        except TimeoutError:
            return False

    async def _hosted(self, name: str) -> bool:
        """Whether hosts are about to serve location `name`: assigned to some, none of them
        FAILED (a failed one waits for `recover` or an operator)."""
        from consumer.protocol import cpb
        from replication.host import location_shard

        spec, replicas = await location_shard(self.etcd, self.prefix, name)
        failed = any(r.status.code == cpb.ReplicaStatus.FAILED for r in replicas)
        return spec is not None and bool(replicas) and not failed

    async def ask(self, name: str, call: Callable[[LocationClient], Awaitable[T]]) -> T:
        """`call` made with location `name`'s client; its refusal as a UserError."""
        client = await self.client(name)
        try:
            return await call(client)
        except LocationError as exc:
            raise UserError(str(exc)) from None

    async def status(self, name: str) -> Document:
        """Location `name`'s Status, as `status --format json` prints it."""
        return status_document(await self.ask(name, lambda c: c.status()))

    async def command(
        self,
        plan: Callable[[Topology], Sequence[Change]],
        names: Sequence[str],
        live: bool = True,
    ) -> commands.Command:
        """One topology command, all or nothing: `plan(view)` gives its changes on etcd's whole
        history; they are checked there, then (with `live`) at each location they involve,
        which must be running (may it record them now; a fail-over's cached CVV), and recorded
        in one etcd transaction. Then each location they involve is told to record them; one
        that cannot now records them once it can (it follows etcd's history), so that is said,
        not refused. A refusal is one line, and then nothing was recorded anywhere."""
        await self.entries(*names)

        async def live_check(changes: Sequence[Change]) -> None:
            if live:
                for change in changes:
                    for name in _involved(change):
                        await self._change(name, change)

        try:
            done = await commands.command(self.etcd, self.prefix, plan, live_check)
        except (RuleViolation, ValueError) as exc:
            raise UserError(str(exc)) from None
        except aetcd.exceptions.ClientError as exc:
            raise UserError(f"cannot read or record the topology's history in etcd: {exc}") from None  # fmt: skip
        if done.recorded:
            last = done.recorded[-1][0]
            told = {n for _, c in done.recorded for n in _names(c)}
            for name in sorted(told):
                try:
                    await self._change(name, done.recorded[-1][1], record=True, op=last)
                except UserError as exc:
                    click.echo(f"{name}: records it once it can ({exc.message})")
        return done

    async def _change(self, name: str, change: Change, record: bool = False, op: int = 0) -> None:
        client = await self.client(name)
        try:
            await client.change(change, record=record, op=op)
        except LocationError as exc:
            raise UserError(str(exc)) from None


def _names(change: Change) -> list[str]:
    if isinstance(change, Retired):
        return [change.location]
    if isinstance(change, FailedOver):
        return [change.previous, change.source, change.target]
    return [change.source, change.target]


def _involved(change: Change) -> list[str]:
    """The locations whose live state a change needs (and which are told of it first)."""
    if isinstance(change, Retired):
        return []
    if isinstance(change, FailedOver):
        return [change.target, change.source, change.previous]
    if isinstance(change, Disconnected):
        return []  # Always allowed: its ends record it when they can.
    return [change.target, change.source]


def _vector(clock: Mapping[str, int] | None) -> str:
    return str(VectorClock(clock or {}))


# ---- locations, status -----------------------------------------------------------------------


@replication.command("locations")
@click.option(
    "--format", "fmt", default="table", type=click.Choice(["table", "json"]), help="Output format"
)
@replication_options
def locations_cmd(fmt: str, **opts: Any) -> None:  # fmt: skip
    """List the registered locations, whether a process serves each, and its CVV."""

    async def go() -> None:
        async with Network(opts) as net:
            rows = []
            for entry in (await net.locations()).values():
                status: Document = {}
                if entry.endpoint:
                    try:
                        status = await net.status(entry.name)
                    except UserError:
                        status = {}
                rows.append((entry, status))
        if fmt == "json":
            for entry, status in rows:
                click.echo(json.dumps({"name": entry.name, "journal": entry.journal, "broker": entry.broker, "endpoint": entry.endpoint, "cvv": status.get("cvv"), "last_seq": status.get("last_seq")}))  # fmt: skip
            return
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("Location", "Journal", "Broker", "Process", "Events", "CVV"):
            table.add_column(column)
        for entry, status in rows:
            process = entry.endpoint or "<down>"
            if status.get("lost"):
                process += " (needs recovery)"
            elif status.get("clock", "ok") != "ok":
                process += f" ({status['clock']})"
            table.add_row(entry.name, entry.journal, entry.broker, process, str(status.get("last_seq", "")), _vector(status.get("cvv")) if status else "")  # fmt: skip
        render.console.print(table)

    run(go())


@replication.command("status")
@click.argument("names", nargs=-1)
@click.option(
    "--format", "fmt", default="table", type=click.Choice(["table", "json"]), help="Output format"
)
@replication_options
def status_cmd(names: tuple[str, ...], fmt: str, **opts: Any) -> None:  # fmt: skip
    """Each location's CVV, DVV, local time and events, and its connections' progress and lag
    (every running location, or those named)."""

    async def go() -> list[Document]:
        async with Network(opts) as net:
            if names:
                await net.entries(*names)
                chosen = list(names)
            else:
                chosen = [e.name for e in (await net.locations()).values() if e.endpoint]
            return [await net.status(n) for n in chosen]

    statuses = run(go())
    if fmt == "json":
        for status in statuses:
            click.echo(json.dumps(status, sort_keys=True))
        return
    for status in statuses:
        name = status["location"]
        click.echo(
            f"{name}: events 1-{status['last_seq']} (deleted through {status['deleted_through']}), "
            f"local time {status['local_time']}, CVV {_vector(status['cvv'])}, "
            f"DVV {_vector(status['dvv'])}"
        )
        if status.get("lost"):
            click.echo(f"  {status['lost']}")
        elif status.get("recovering"):
            click.echo(f"  emits nothing yet: {status['recovering']}")
        elif status.get("clock", "ok") != "ok":
            click.echo(f"  emits nothing yet: {status['clock']} since it started")
        if not status["connections"]:
            click.echo("  no connections into it")
            continue
        table = Table(box=None, header_style="bold", pad_edge=True)
        for column in ("Connection", "Filter", "State", "Via", "Progress", "Lag", "Written"):
            table.add_column(column)
        for c in status["connections"]:
            state = c["state"] + (f" ({c['error']})" if c["error"] else "")
            table.add_row(f"{c['source']} -> {name}", c["filter"] or "-", state, c["via"] or "-", str(c["progress"]), str(c["lag"]), str(c["written"]))  # fmt: skip
        render.console.print(table)


# ---- topology changes -------------------------------------------------------------------------


@replication.command("connect")
@click.argument("source")
@click.argument("target")
@click.option(
    "--filter",
    "filter_",
    default="",
    help="Replication filter: a label selector over event attributes (payload fields and `emitter`)",
)
@click.option(
    "--both",
    is_flag=True,
    help="Also connect TARGET -> SOURCE (bi-directional, as two connections)",
)
@click.option(
    "--fail-over-from", "previous", default="",
    help="Switch TARGET's filtered connection from this location to SOURCE (allowed once the CVV it last sent is <= SOURCE's)",
)  # fmt: skip
@click.option(
    "--new-events-only", "new_only", is_flag=True,
    help="TARGET takes only SOURCE's new events: its CVV and DVV raised to SOURCE's DVV as it records the connection",
)  # fmt: skip
@replication_options
def connect_cmd(
    source: str, target: str, filter_: str, both: bool, previous: str, new_only: bool,
    **opts: Any,
) -> None:  # fmt: skip
    """Replicate SOURCE's events to TARGET (a filter change, if it is connected already).

    A new connection replicates only once DVV-SOURCE <= CVV-TARGET (until then `status` shows
    it waiting); --new-events-only makes that hold at once, for a location that does not need
    what SOURCE deleted."""

    async def floor(net: Network) -> tuple[tuple[str, int], ...]:
        # SOURCE's DVV now, before the command is checked: the floor TARGET joins to as it
        # records the connection (recorded with it, so the join needs no live SOURCE later).
        # DVVs only grow: events SOURCE deletes after this read raise DVV-SOURCE past the
        # floor, and the start rule (DVV-SOURCE <= CVV-TARGET) holds the connection back, as
        # it does any other, until TARGET has them or joins again (this command, repeated).
        if not new_only:
            return ()
        status = await net.ask(source, lambda c: c.status())
        return tuple(sorted(clock_of(status.dvv, "dvv").to_json().items()))

    async def join(net: Network, done: commands.Command) -> None:
        """Say TARGET's join for new events: made as TARGET recorded the connection (whichever
        route brought it there), or, for a connection made already (by a gazctl of before joins
        were recorded with it, which died before its join step; or a filter change), asked of
        TARGET now. Only once etcd recorded the command: a refused one changes nothing."""
        if not new_only:
            return
        joining = [op for op, c in done.recorded if isinstance(c, Connected | FailedOver) and c.new_only]  # fmt: skip
        if joining:
            status = await net.ask(target, lambda c: c.status())
            if any(k.key.revision == joining[0] for k in status.history):
                click.echo(f"{target}: joined for new events (CVV {_vector(status.cvv.times)})")
            else:
                click.echo(f"{target}: joins for new events as it records the connection")
            return
        try:
            reply = await net.ask(target, lambda c: c.join([source]))
        except UserError as exc:
            raise UserError(
                f"{source} -> {target} is connected, but {target} did not join for new "
                f"events ({exc.message}): run this command again"
            ) from None
        click.echo(f"{target}: joined for new events (CVV {_vector(reply.cvv.times)})")

    async def go() -> None:
        async with Network(opts) as net:
            if previous:
                if both:
                    raise UserError("--fail-over-from switches one connection: leave out --both")
                change = FailedOver(previous, source, target, filter_, new_only, await floor(net))  # fmt: skip
                done = await net.command(lambda _view: [change], [previous, source, target])
                if done.recorded:
                    click.echo(f"{target}: failed over from {previous} to {source}")
                else:
                    click.echo(f"{target}: failed over from {previous} to {source} already")
                await join(net, done)
                return
            pairs = [(source, target)] + ([(target, source)] if both else [])
            said: list[str] = []
            joins = await floor(net)

            def plan(view: Topology) -> list[Change]:
                # Planned on etcd's view, as checked: planned again if the command is retried.
                said.clear()
                changes: list[Change] = []
                for s, t in pairs:
                    if view.current.get((s, t)) == filter_:
                        said.append(f"{s} -> {t}: connected already")
                    elif (s, t) in view.current:
                        changes.append(Filtered(s, t, filter_))
                        said.append(f"{s} -> {t}: filter changed to {filter_ or '(none)'}")
                    else:
                        # TARGET joins as it records it: SOURCE -> TARGET only.
                        only = new_only and (s, t) == (source, target)
                        changes.append(Connected(s, t, filter_, only, joins if only else ()))
                        said.append(f"{s} -> {t}: connected" + (f" (filter {filter_})" if filter_ else ""))  # fmt: skip
                return changes

            # Both directions are checked and recorded in one transaction: both or neither.
            done = await net.command(plan, [source, target])
            for line in said:
                click.echo(line)
            await join(net, done)

    run(go())


def _view(status: Document) -> Topology:
    return topology_of_documents(status["history"])


@replication.command("disconnect")
@click.argument("source")
@click.argument("target")
@click.option("--both", is_flag=True, help="Also disconnect TARGET -> SOURCE")
@replication_options
def disconnect_cmd(source: str, target: str, both: bool, **opts: Any) -> None:
    """Stop replicating SOURCE's events to TARGET (it stays in the topology's history)."""

    async def go() -> None:
        async with Network(opts) as net:
            pairs = [(source, target)] + ([(target, source)] if both else [])
            # Always allowed (a way out of any topology), so checked on etcd's history only;
            # both directions in one transaction: both or neither.
            await net.command(lambda _view: [Disconnected(s, t) for s, t in pairs], [source, target])  # fmt: skip
            for s, t in pairs:
                click.echo(f"{s} -> {t}: disconnected")

    run(go())


@replication.command("retire")
@click.argument("name")
@replication_options
def retire_cmd(name: str, **opts: Any) -> None:
    """Retire a location for good: it leaves the topology (its connections end) and takes no
    new ones. Recorded in etcd's topology history, which every location follows."""

    async def go() -> None:
        async with Network(opts) as net:
            done = await net.command(lambda _view: [Retired(name)], [name])
            click.echo(f"{name}: retired" if done.recorded else f"{name}: retired already")

    run(go())


@replication.command("trust-clock")
@click.argument("name")
@click.option(
    "--without", required=True,
    help="Locations (comma-separated) NAME has not heard from since it started, to emit without",
)  # fmt: skip
@replication_options
def trust_clock_cmd(name: str, without: str, **opts: Any) -> None:
    """Let NAME emit although the locations named have not answered since its process started.

    A location emits only once every registered location has answered (one of them may hold a
    time of NAME's that NAME's log lost). Use this when one of them is gone for long: if it
    does hold such a time, it will drop NAME's new events that reuse it."""
    names = [n.strip() for n in without.split(",") if n.strip()]
    if not names:
        raise UserError("--without: name the locations not heard from (comma-separated)")

    async def go() -> lpb.TrustClockResponse:
        async with Network(opts) as net:
            await net.entries(*names)
            return await net.ask(name, lambda c: c.trust_clock(names))

    reply = run(go())
    if reply.clock_ok:
        click.echo(f"{name}: emits without having heard from {', '.join(names)}")
    else:
        unheard = ", ".join(reply.unheard)
        raise UserError(f"{name}: still not heard from {unheard}: name them too, or start them")


# ---- deletion, recovery, events --------------------------------------------------------------


@replication.command("delete")
@click.argument("name")
@click.option(
    "--through",
    required=True,
    help="Delete events through this sequence number, or through this event (EMITTER:TIME, "
    "its id: where it is stored here)",
)
@replication_options
def delete_cmd(name: str, through: str, **opts: Any) -> None:  # fmt: skip
    """Delete a location's events through a sequence number or an event: allowed only if
    afterwards its DVV is <= the CVV of every directly connected location."""
    emitter, colon, time = through.rpartition(":")
    try:
        number = int(time)
        if number < 1 or (colon and not emitter):
            raise ValueError
    except ValueError:
        raise UserError(
            f"--through {through!r}: give a sequence number (1 or more) or an event's id, "
            "EMITTER:TIME (as `events` shows it)"
        ) from None

    async def go() -> lpb.DeleteResponse:
        async with Network(opts) as net:
            seq = await _seq_of(net, name, emitter, number) if colon else number
            return await net.ask(name, lambda c: c.delete(seq))

    reply = run(go())
    click.echo(f"{name}: deleted through {reply.deleted_through}, DVV {_vector(reply.dvv.times)}")


async def _seq_of(net: Network, name: str, emitter: str, time: int) -> int:
    """Where the event EMITTER:TIME is stored at location `name` (UserError if it is not)."""
    from replication.records import split_records

    async for data in _pages(net, name, 0, None):
        for _, _, raw in split_records(data)[0]:
            if raw is not None and raw.emitter == emitter and raw.ts.get(emitter) == time:
                return raw.seq
    raise UserError(
        f"event {emitter}:{time} is not in {name}'s log (deleted already, not replicated there, "
        "or never emitted): `gazctl replication events` lists what is"
    )


@replication.command("prune")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="Show what would be removed, and remove nothing")
@file_root_option("Directory that roots file:// fragment stores (as brokers' --broker.file-root)")
@replication_options
def prune_cmd(name: str, dry_run: bool, file_root: Path | None, **opts: Any) -> None:
    """Physically delete a location's deleted events: remove the persisted fragments of its
    journal that hold nothing but them (before its last checkpoint and its first kept event)."""
    from broker.client import JournalsClient
    from gazctl.fragment_ops import list_fragments, remove_all, stores_of

    async def plan() -> tuple[str, int, list[Any], int]:
        async with Network(opts) as net:
            entry = (await net.entries(name))[0]
            status = await net.ask(name, lambda c: c.status())
        bound = status.prunable_before
        async with JournalsClient(entry.broker) as journals:
            listed = [f.spec for f in await list_fragments(journals.stub, entry.journal)]
        doomed = [f for f in listed if f.end <= bound and f.backing_store]
        return entry.journal, bound, doomed, len(listed)

    journal, bound, doomed, listed = run(plan())
    if not bound:
        click.echo(f"{name}: nothing to prune (no events were deleted)")
        return
    size = sum(f.end - f.begin for f in doomed)
    verb = "would remove" if dry_run else "removing"
    click.echo(f"{name}: {verb} {len(doomed)} of {listed} fragments of {journal} ({size} bytes, before offset {bound})")  # fmt: skip
    if not dry_run and doomed:
        remove_all(doomed, stores_of(doomed, file_root))


@replication.command("recover")
@click.argument("name")
@click.option(
    "--timeout", default=60.0, type=click.FloatRange(1), show_default=True,
    help="Seconds to wait for a location host to serve the location again",
)  # fmt: skip
@replication_options
def recover_cmd(name: str, timeout: float, **opts: Any) -> None:
    """Disaster recovery of a location whose log lost events: its clock and its neighbours'
    progress first, then events from the neighbours allowed to give them back.

    A journal that is gone is made anew first (as `add` made it), and a location hosts run is
    restarted on its new log (its process fails once its journal is deleted or made anew); one
    started by hand (`python -m replication serve`) must be started again by hand."""

    async def go() -> lpb.RecoverResponse:
        async with Network(opts) as net:
            entry = (await net.entries(name))[0]
            created = await _journal_made(entry)
            status = await _status_if_serving(net, name)
            if status is None or status["journal_created"] != created:
                from replication.host import location_shard, restart_location

                spec, _ = await location_shard(net.etcd, net.prefix, name)
                if spec is None:
                    doing = "is not running" if status is None else "still serves the log it lost"
                    raise UserError(
                        f"location {name}: its process {doing}; start it again (`python -m "
                        f"replication serve --location {name}`), then run this again"
                    )
                await restart_location(net.etcd, net.prefix, name)
                click.echo(f"{name}: restarting its process on a location host, on its new log")
                await _wait_serving(net, name, created, timeout)
            return await net.ask(name, lambda c: c.recover())

    reply = run(go())
    skipped = list(reply.not_recovered_from)
    click.echo(
        f"{name}: recovered metadata (events 1-{reply.survivors} survived, local time "
        f"{reply.local_time}); events come back over its connections"
        + (f"; not from {', '.join(skipped)} (filtered, and not terminal)" if skipped else "")
    )


async def _journal_made(entry: registry.LocationEntry) -> int:
    """The etcd revision that created the location's journal, made anew first if it is gone
    (as `add` declared it)."""
    from broker.client import BrokerUnavailable, JournalsClient
    from replication.journals import journal_created, location_journal_spec

    try:
        async with JournalsClient(entry.broker) as journals:
            created = await journal_created(journals, entry.journal)
            if created:
                return created
            if not entry.replication:
                raise UserError(
                    f"location {entry.name}: its journal {entry.journal} does not exist at "
                    f"{entry.broker}, and the registry does not say how to make it (the "
                    "location was not added with `gazctl replication add`): create it with "
                    "`gazctl journals apply`, then run this again"
                )
            spec = location_journal_spec(entry.name, entry.store, entry.replication, name=entry.journal)  # fmt: skip
            await journals.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)])
            click.echo(f"{entry.name}: its journal {entry.journal} made anew at {entry.broker}")
            return await journal_created(journals, entry.journal)
    except (BrokerUnavailable, ValueError) as exc:
        raise UserError(f"location {entry.name}: {exc}") from None


async def _status_if_serving(net: Network, name: str) -> Document | None:
    """The location's Status, or None if no process answers for it."""
    try:
        return await net.status(name)
    except UserError:
        return None


async def _wait_serving(net: Network, name: str, created: int, timeout: float) -> None:
    """Until a process serves location `name` on the journal made at revision `created`."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        status = await _status_if_serving(net, name)
        if status is not None and status["journal_created"] == created:
            return
        if loop.time() > deadline:
            raise UserError(
                f"location {name}: no location host served it on its new log within "
                f"{timeout:g}s (are hosts running? `gazctl replication locations` shows where it "
                "stands); run this again once one does"
            )
        await asyncio.sleep(0.2)


@replication.command("add")
@click.argument("name")
@cfg.option("--broker.address", required=True, show_default=False, help="Service address of a broker of the cluster that holds the location's log")  # fmt: skip
@click.option("--journal", default="", help="Journal of the location's log (default: replication/NAME)")  # fmt: skip
@click.option("--fragment-store", default="", help="Fragment store of the journal (file:///..., s3://..., gs://...; default: the brokers' spools only)")  # fmt: skip
@click.option("--journal-replication", default=1, show_default=True, type=click.IntRange(1, 5), help="Replication factor of the journal")  # fmt: skip
@click.option("--standbys", default=1, show_default=True, type=click.IntRange(0, 4), help="Hot standbys of the location's process, on other location hosts")  # fmt: skip
@replication_options
def add_cmd(
    name: str, broker_address: str, journal: str, fragment_store: str, journal_replication: int,
    standbys: int, **opts: Any,
) -> None:  # fmt: skip
    """Add a location that location hosts run (`python -m replication host`): create its log's
    journal (unless it exists), declare it in the registry, and create its shard, which the
    hosts' allocator gives a primary and hot standbys. Nothing is declared if the journal
    cannot be made."""
    from broker.client import BrokerUnavailable, JournalsClient
    from replication.host import add_location, hosts_prefix
    from replication.journals import journal_created, location_journal_spec

    try:
        registry.check_name(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    spec = location_journal_spec(name, fragment_store, journal_replication, name=journal)
    broker = broker_address

    async def go() -> None:
        async with Network(opts) as net:
            known = (await net.locations()).get(name)
            if known is not None and (known.journal, known.broker) != (spec.name, broker):
                raise UserError(
                    f"location {name} is registered with journal {known.journal} at "
                    f"{known.broker}: a location keeps its log (choose another name)"
                )
            try:
                async with JournalsClient(broker) as journals:
                    if await journal_created(journals, spec.name):
                        said = f"{name}: journal {spec.name} exists at {broker}"
                    else:
                        await journals.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=0)])  # fmt: skip
                        said = f"{name}: journal {spec.name} created at {broker}"
            except (BrokerUnavailable, ValueError) as exc:
                raise UserError(f"location {name}: {exc}") from None
            try:
                declared, sharded = await add_location(net.etcd, net.prefix, name, broker, spec, standbys)  # fmt: skip
            except ValueError as exc:
                raise UserError(str(exc)) from None
            click.echo(said)
            click.echo(f"{name}: {'declared' if declared else 'declared already'} in the registry")
            standby = f"{standbys} hot standb{'y' if standbys == 1 else 'ies'}"
            if sharded:
                click.echo(f"{name}: location hosts under {hosts_prefix(net.prefix)} run it ({standby})")  # fmt: skip
            else:
                click.echo(f"{name}: location hosts run it already")

    run(go())


@replication.command("emit")
@click.argument("name")
@click.argument("payloads", nargs=-1, required=True)
@replication_options
def emit_cmd(name: str, payloads: tuple[str, ...], **opts: Any) -> None:
    """Emit events at a location, each PAYLOAD a JSON object."""
    documents = []
    for i, text in enumerate(payloads, 1):
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise UserError(f"payload {i}: not JSON ({exc})") from None
        if not isinstance(document, dict):
            raise UserError(f"payload {i}: expected a JSON object, got {text!r}")
        documents.append(document)

    request = lpb.EmitRequest(payloads=[json.dumps(d).encode() for d in documents])

    async def go() -> lpb.EmitResponse:
        async with Network(opts) as net:
            reply: lpb.EmitResponse = await net.ask(name, lambda c: c.invoke("Emit", request))
            return reply

    for event in run(go()).events:
        click.echo(f"{event.emitter} {_vector(event.timestamp.times)}")


@replication.command("events")
@click.argument("name")
@click.option(
    "--after", default=0, type=click.IntRange(0), help="Events after this sequence number"
)
@click.option(
    "--limit", default=None, type=click.IntRange(1), help="At most this many (default: every one)"
)
@replication_options
def events_cmd(name: str, after: int, limit: int | None, **opts: Any) -> None:  # fmt: skip
    """A location's stored events in storage order, as JSON lines (read page by page, through
    the last committed one)."""

    async def go() -> None:
        async with Network(opts) as net:
            async for data in _pages(net, name, after, limit):
                click.echo(data.decode(), nl=False)

    run(go())


PAGE = 1000  # Events per Read of `events` and `delete --through EMITTER:TIME`.


async def _pages(net: Network, name: str, after: int, limit: int | None) -> AsyncIterator[bytes]:
    """A location's event records after `after`, page by page, through its last committed
    event (at most `limit` events)."""
    left = limit
    while left is None or left > 0:
        page = PAGE if left is None else min(PAGE, left)
        client = await net.client(name)
        try:
            reply = await client.read(after, page)
        except LocationError as exc:
            raise UserError(str(exc)) from None
        if reply.records:
            yield reply.records
            if left is not None:
                left -= reply.records.count(b"\n")
        if reply.through <= after or reply.through >= reply.last_seq:
            return
        after = reply.through


# ---- topology ---------------------------------------------------------------------------------


@replication.command("topology")
@click.option("--at", default="", help="Whose view to show (default: the first running location)")
@click.option(
    "--format",
    "fmt",
    default="table",
    type=click.Choice(["table", "dot", "picture", "json"]),
    help="A table of the connections and the history, Graphviz dot, a terminal picture, or JSON",
)
@click.option(
    "--check", is_flag=True,
    help="Compare every running location's view instead, and name the changes where they "
    "differ (exit 1 if they do)",
)  # fmt: skip
@replication_options
def topology_cmd(at: str, fmt: str, check: bool, **opts: Any) -> None:  # fmt: skip
    """The replication network as a location sees it: its connections (those on a cycle of the
    projected history marked) and the topology's whole history."""
    if check:
        _check_views(opts)
        return

    async def go() -> Document:
        async with Network(opts) as net:
            name = at
            if not name:
                running = [e.name for e in (await net.locations()).values() if e.endpoint]
                if not running:
                    raise UserError(f"no location is running under {net.prefix}: nothing to ask")
                name = running[0]
            return await net.status(name)

    status = run(go())
    view = _view(status)
    cycles = view.cycles()
    if fmt == "json":
        click.echo(json.dumps({"at": status["location"], "current": [{"source": s, "target": t, "filter": f, "on_cycle": (min(s, t), max(s, t)) in cycles} for (s, t), f in sorted(view.current.items())], "history": status["history"], "retired": sorted(view.retired)}, sort_keys=True))  # fmt: skip
    elif fmt == "dot":
        click.echo(dot(view), nl=False)
    elif fmt == "picture":
        click.echo(picture(view), nl=False)
    else:
        click.echo(f"as seen at {status['location']}:")
        table = Table(box=None, header_style="bold", pad_edge=True)
        for column in ("Connection", "Filter", "On a cycle", "Ever filtered"):
            table.add_column(column)
        for (s, t), f in sorted(view.current.items()):
            table.add_row(f"{s} -> {t}", f or "-", "yes" if (min(s, t), max(s, t)) in cycles else "-", "yes" if (s, t) in view.ever_filtered else "-")  # fmt: skip
        render.console.print(table)
        if view.retired:
            click.echo(f"retired: {', '.join(sorted(view.retired))}")
        click.echo("history:")
        for i, change in enumerate(view.history, 1):
            click.echo(f"  {i}. {describe(change)}")


def _check_views(opts: dict[str, Any]) -> None:
    """`topology --check`: every running location's view against etcd's history (the
    authoritative one) and against each other's."""

    async def go() -> tuple[Topology, dict[str, Topology], list[str]]:
        async with Network(opts) as net:
            try:
                history = await commands.read_history(net.etcd, net.prefix)
            except (ValueError, aetcd.exceptions.ClientError) as exc:
                raise UserError(f"cannot read the topology's history in etcd: {exc}") from None
            views, down = {}, []
            for entry in (await net.locations()).values():
                status = await _status_if_serving(net, entry.name)
                if status is None:
                    down.append(entry.name)
                else:
                    views[entry.name] = _view(status)
            return history.view(), views, down

    etcd_view, views, down = run(go())
    if not views:
        raise UserError("no location is running: there is no view to compare")
    retired = etcd_view.retired.union(*(v.retired for v in views.values()))
    for name in down:
        if name not in retired:
            click.echo(f"{name}: not running (its view is not compared)")
    for name in sorted(set(views) & retired):
        # It records etcd's history through its own retirement, and nothing after.
        click.echo(f"{name}: retired (its view is not compared)")
        del views[name]
    authoritative = set(etcd_view.keyed())
    every = authoritative.union(*(set(v.keyed()) for v in views.values()))
    unknown = sorted(every - authoritative, key=lambda kc: kc[0])
    lacking = {n: sorted(every - set(v.keyed()), key=lambda kc: kc[0]) for n, v in views.items()}
    if not unknown and not any(lacking.values()):
        click.echo(f"{len(views)} locations hold etcd's view ({len(authoritative)} changes): {', '.join(sorted(views))}")  # fmt: skip
        return
    for name, missing in sorted(lacking.items()):
        if missing:
            click.echo(f"{name} lacks {len(missing)} of {len(every)} changes:")
            for key, change in missing:
                click.echo(f"  [{_order(key)}] {describe(change)}")
        else:
            click.echo(f"{name}: holds every change ({len(every)})")
    if unknown:
        click.echo(f"etcd's history lacks {len(unknown)} changes that locations hold (recorded without it):")  # fmt: skip
        for key, change in unknown:
            click.echo(f"  [{_order(key)}] {describe(change)}")
    raise UserError(
        "the views differ: a location records etcd's history once it may emit (see `status`); "
        "a change etcd lacks was recorded by an older gazctl, and stays in the logs that hold it"
    )


def _order(key: tuple[int, int, str, int]) -> str:
    return f"op {key[0]}" if key[0] else f"{key[2]}:{key[3]}"


def describe(change: Change) -> str:
    if isinstance(change, Retired):
        return f"{change.location} retired"
    if isinstance(change, Connected):
        return f"{change.source} -> {change.target} connected" + (f" (filter {change.filter})" if change.filter else "")  # fmt: skip
    if isinstance(change, Disconnected):
        return f"{change.source} -> {change.target} disconnected"
    if isinstance(change, FailedOver):
        return f"{change.target} failed over from {change.previous} to {change.source} (filter {change.filter})"  # fmt: skip
    return f"{change.source} -> {change.target} filter {change.filter or '(none)'}"


def dot(view: Topology) -> str:
    """Graphviz dot of the current network: filtered connections dashed and labelled, those on a
    cycle of the projected history bold, retired locations grey; links of the history that are
    no longer connected dotted."""
    cycles = view.cycles()
    lines = ["digraph replication {", "  rankdir=LR;", "  node [shape=box];"]
    for name in sorted(view.locations):
        style = ' [color=grey, fontcolor=grey, label="' + name + ' (retired)"]' if name in view.retired else ""  # fmt: skip
        lines.append(f'  "{name}"{style};')
    for s, t in sorted(view.ever):
        attrs = []
        if (s, t) in view.current:
            f = view.current[(s, t)]
            if f:
                attrs += ["style=dashed", f'label="{_escape(f)}"']
            if (min(s, t), max(s, t)) in cycles:
                attrs.append("penwidth=2")
        else:
            attrs += ["style=dotted", "color=grey"]
        lines.append(f'  "{s}" -> "{t}"' + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def picture(view: Topology) -> str:
    """A terminal picture: a matrix of sources (rows) by targets (columns). `==>` a connection,
    `~~>` a filtered one, `*` on a cycle of the projected history, `..` a connection of the
    history no longer there."""
    names = sorted(view.locations - view.retired)
    cycles = view.cycles()
    width = max([4, *(len(n) for n in names)]) + 1
    out = [" " * width + "".join(n.rjust(width) for n in names)]
    for s in names:
        row = s.ljust(width)
        for t in names:
            if s == t:
                cell = "-"
            elif (s, t) in view.current:
                cell = ("~~>" if view.current[(s, t)] else "==>") + ("*" if (min(s, t), max(s, t)) in cycles else "")  # fmt: skip
            elif (s, t) in view.ever:
                cell = ".."
            else:
                cell = ""
            row += cell.rjust(width)
        out.append(row.rstrip())
    out.append(
        "rows: sources, columns: targets; ==> connected, ~~> filtered, * on a cycle, .. past"
    )
    if view.retired:
        out.append(f"retired: {', '.join(sorted(view.retired))}")
    return "\n".join(out) + "\n"
