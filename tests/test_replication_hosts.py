"""Location hosts (`python -m replication host`): locations added with `gazctl replication add`
run as shards of the consumer framework, each with a hot standby on another host that takes
over when its host dies; a lost log is recovered with `gazctl replication` alone; and
`topology --check` compares the views of every running location."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from broker.client import JournalsClient
from broker.protocol import protocol_pb2 as pb
from replication.journals import apply_location_journals
from replication.vclock import VectorClock
from tests.conftest import BrokerProcess
from tests.helpers.locations import LocationProcesses, assert_causal_order, ids, refused
from tests.helpers.waiting import until_blocking


def payloads(events: list[dict[str, object]]) -> list[object]:
    return [e["payload"] for e in events if "system" not in e["payload"]]  # type: ignore[operator]


def test_a_standby_host_takes_over_a_location_whose_host_dies(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    broker = location_broker.address
    for name in "AB":
        out = locations.ok("add", name, "--broker.address", broker)
        assert f"{name}: journal replication/{name} created at {broker}" in out
        assert f"{name}: declared in the registry" in out
        assert "run it (1 hot standby)" in out
    again = locations.ok("add", "A", "--broker.address", broker)
    assert "journal replication/A exists" in again and "declared already" in again
    assert "location hosts run it already" in again
    for host in ("host1", "host2"):
        locations.start_host(host, broker)
    until_blocking(lambda: locations.served_by("A") and locations.served_by("B"), "A and B are served")  # fmt: skip
    locations.ok("connect", "A", "B", "--both")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}')
    until_blocking(lambda: len(ids(locations.events("B"))) == 2, "B holds A's events")

    # A's host dies: the other host's standby takes A over once the dead host's lease expires.
    time_before = locations.status("A")["local_time"]
    victim = locations.served_by("A")
    killed = next(k for k, p in locations.procs.items() if p.pid == victim)
    os.kill(victim, signal.SIGKILL)
    locations.procs[killed].wait()
    started = time.monotonic()
    # At once: gazctl waits for A while no process answers for it (its dead host's endpoint
    # until that lease expires, then none), and emits through the standby that took it over.
    emitted = locations.ok("emit", "A", '{"n": 3}')
    took = time.monotonic() - started
    assert locations.served_by("A") not in (0, victim)
    survivor = next(k for k in ("host1", "host2") if k != killed)
    # The survivor's standby had folded A's log: its primary folded only the rest.
    assert "location A: takes over its log folded through offset" in locations.log(survivor)
    # Its clock went on from the log it took over: no time is reused.
    assert f"A {{A: {time_before + 1}" in emitted, emitted
    until_blocking(lambda: len(ids(locations.events("B"))) == 3, "B holds A's new event")
    assert payloads(locations.events("B")) == [{"n": 1}, {"n": 2}, {"n": 3}]
    for name in "AB":
        assert_causal_order(locations.events(name))
    assert took < 20, f"takeover took {took:.1f}s"  # The lease is 2 s; generous for a busy machine.

    # A new host becomes A's standby; the views agree.
    locations.start_host("host3", broker)
    assert "2 locations hold etcd's view" in locations.ok("topology", "--check")
    assert locations.procs[survivor].poll() is None


def test_a_lost_log_is_recovered_with_gazctl_alone(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A's journal is deleted while its host runs it (a disaster). A's process notices and
    fails; `gazctl replication recover A` makes the journal anew, has a host run A on it,
    recovers A's clock and lets its events come back from B: no hand-made journal, no process
    started by hand."""
    broker = location_broker.address
    for name in "AB":
        locations.ok("add", name, "--broker.address", broker)
    for host in ("host1", "host2"):
        locations.start_host(host, broker)
    until_blocking(lambda: locations.served_by("A") and locations.served_by("B"), "A and B are served")  # fmt: skip
    locations.ok("connect", "A", "B", "--both")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}')
    locations.ok("emit", "B", '{"n": 3}')
    until_blocking(lambda: len(ids(locations.events("A"))) == 3, "A holds B's event")
    until_blocking(lambda: len(ids(locations.events("B"))) == 3, "B holds A's events")
    before = set(ids(locations.events("B")))
    seen = locations.status("B")["cvv"]["A"]

    async def lose() -> None:
        async with JournalsClient(broker) as client:
            await client.apply([pb.ApplyRequest.Change(delete="replication/A", expect_mod_revision=-1)])  # fmt: skip

    asyncio.run(lose())
    out = locations.ok("recover", "A", "--timeout", "60")
    assert "A: its journal replication/A made anew" in out
    assert "restarting its process on a location host" in out
    assert f"local time {seen}" in out and "events 1-0 survived" in out
    until_blocking(lambda: set(ids(locations.events("A"))) == before, "A has its events back")
    emitted = locations.ok("emit", "A", '{"n": 4}')
    assert f"A {{A: {seen + 1}" in emitted, emitted
    until_blocking(lambda: len(ids(locations.events("B"))) == 4, "B gets A's new event")
    for name in "AB":
        assert_causal_order(locations.events(name))
    new = [e for e in locations.events("A") if e["payload"] == {"n": 4}]
    assert VectorClock.from_json(json.loads(json.dumps(new[0]["ts"])))["A"] == seen + 1


def test_topology_check_names_the_changes_a_location_lacks_and_add_refuses_bad_input(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    broker = location_broker.address
    asyncio.run(apply_location_journals(broker, "A", "B", "C", "E"))
    for name in "ABCE":
        locations.start(name, broker)
    # C started again while E is down: it has not heard from E, so it may not record a change
    # (a system event of its own) yet.
    locations.stop("E")
    locations.stop("C")
    locations.start("C", broker)
    locations.ok("connect", "A", "B", "--both")
    until_blocking(
        lambda: len(locations.status("A")["history"]) == len(locations.status("B")["history"]) == 2,
        "A and B hold both changes",
    )
    result = locations.gazctl("topology", "--check")
    assert result.code == 1, result.out
    assert "C lacks 2 of 2 changes:" in result.out
    assert "A -> B connected" in result.out and "B -> A connected" in result.out
    assert "A: holds every change (2)" in result.out
    assert "E: not running" in result.out
    assert "the views differ" in result.err and "Traceback" not in result.err
    locations.start("E", broker)  # C hears from E, and records etcd's history.
    until_blocking(
        lambda: locations.gazctl("topology", "--check").code == 0, "C learns the history"
    )
    assert "4 locations hold etcd's view (2 changes)" in locations.ok("topology", "--check")

    # `add` refuses in one line and declares nothing.
    assert "location name" in refused(locations, "add", "bad name!", "--broker.address", broker)
    line = refused(locations, "add", "D", "--broker.address", "http://127.0.0.1:1")
    assert "location D" in line
    assert "D" not in locations.ok("locations", "--format", "json")
    line = refused(
        locations, "add", "A", "--broker.address", broker, "--journal", "replication/other"
    )
    assert "a location keeps its log" in line


def test_a_paused_host_that_resumes_after_its_standby_took_over_writes_nothing(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """SIGSTOP the host running A for longer than its lease: the standby takes A over. Once the
    paused host resumes, an emit through its old endpoint is refused (its writer was fenced
    out by the new one's register) or finds nothing serving: A's log holds only what was
    acknowledged, each event once."""
    from replication.rpc import LocationClient, LocationError

    broker = location_broker.address
    locations.ok("add", "A", "--broker.address", broker)
    for host in ("host1", "host2"):
        locations.start_host(host, broker)
    until_blocking(lambda: locations.served_by("A"), "A is served")
    locations.ok("emit", "A", '{"n": 1}')
    paused = locations.served_by("A")
    old = locations.status("A")["endpoint"]
    os.kill(paused, signal.SIGSTOP)
    try:
        until_blocking(
            lambda: locations.served_by("A") not in (0, paused), "the standby serves A", 30
        )
        locations.ok("emit", "A", '{"n": 2}')
    finally:
        os.kill(paused, signal.SIGCONT)

    async def zombie_emit() -> str:
        async with LocationClient("A", old, timeout=10) as client:
            try:
                await client.emit({"n": "zombie"})
            except LocationError as exc:
                return str(exc)
        return "accepted"

    answer = asyncio.run(zombie_emit())
    assert answer != "accepted"
    assert "fenced out" in answer or "unreachable" in answer or "no location" in answer, answer
    locations.ok("emit", "A", '{"n": 3}')
    assert payloads(locations.events("A")) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert_causal_order(locations.events("A"))
