"""Location processes end to end: `python -m replication serve` per location on a real broker and
etcd, operated with `gazctl replication` as an operator would. A network converges (each event
once per location, storage order a linear extension of causality), a filtered terminal location
gets only what passes, the rules refuse in one line with nothing recorded, a target reads a source
whose process is down from its journal, and a zombie writer is fenced out."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import aetcd
import grpc

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer, stop_process
from replication import location_pb2 as lpb
from replication import location_pb2_grpc as lpb_grpc
from replication.journals import apply_location_journals
from replication.model import Event
from replication.records import encode_event
from replication.registry import endpoint_key
from replication.rpc import LocationClient, LocationError, clock_message
from replication.vclock import VectorClock
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.locations import (
    LocationProcesses,
    _all_events,
    _lose_log,
    assert_causal_order,
    ids,
    refused,
)
from tests.helpers.waiting import until_blocking


def clock_after_recovery(locations: LocationProcesses, name: str, seen: int) -> int:
    """The local time of a location recovered to `seen` (the most any location saw of its
    times), once it holds etcd's topology history again: `seen`, and one more for each change
    of that history it recorded anew (its recovered log lacked it; none of its neighbours held
    it for it), nothing else."""
    until_blocking(lambda: locations.gazctl("topology", "--check").code == 0, f"{name} holds etcd's view")  # fmt: skip
    local = locations.status(name)["local_time"]
    anew = [
        e for e in locations.events(name)
        if e["emitter"] == name and "system" in e["payload"] and e["ts"][name] > seen
    ]  # fmt: skip
    assert local == seen + len(anew), (local, seen, anew)
    return int(local)


def history(locations: LocationProcesses, name: str) -> list[Any]:
    return list(locations.status(name)["history"])


def test_a_network_of_location_processes_converges(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    assert "A -> B: connected" in locations.ok("connect", "A", "B", "--both")
    locations.ok("connect", "B", "C", "--both")
    assert "connected already" in locations.ok("connect", "A", "B")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}')
    locations.ok("emit", "C", '{"num": 3}')
    locations.ok("emit", "B", '{"num": 4}')
    # Every location holds the same four events, each once, in a causal order.
    for name in "ABC":
        until_blocking(lambda n=name: len(ids(locations.events(n))) == 4, f"{name} holds 4 events")
        assert_causal_order(locations.events(name))
    app_ids = {name: ids(locations.events(name)) for name in "ABC"}
    # gazctl prints the same events, one JSON line each (the helpers read them in-process).
    printed = [json.loads(line) for line in locations.ok("events", "B").splitlines()]
    assert printed == locations.events("B")
    assert set(app_ids["A"]) == set(app_ids["B"]) == set(app_ids["C"])
    assert sorted(e for e, _ in app_ids["A"]) == ["A", "A", "B", "C"]

    # Status: B's connections from A and C, each caught up (lag 0) and filtered at the source.
    until_blocking(
        lambda: all(c["lag"] == 0 for c in locations.status("B")["connections"]),
        "B's connections caught up",
    )
    status_b = locations.status("B")
    printed_status = json.loads(locations.ok("status", "B", "--format", "json"))
    assert printed_status.keys() == status_b.keys() and printed_status["cvv"] == status_b["cvv"]
    assert [(c["source"], c["via"], c["state"]) for c in status_b["connections"]] == [
        ("A", "location", "replicating"),
        ("C", "location", "replicating"),
    ]
    emitted = {e: t for e, t in app_ids["B"]}
    assert VectorClock.from_json(status_b["cvv"]) >= VectorClock(emitted)
    table = locations.ok("status", "B")
    assert "A -> B" in table and "C -> B" in table

    # A filter on a connection that would close a cycle is refused, and nothing is recorded.
    before = {n: history(locations, n) for n in "AC"}
    line = refused(locations, "connect", "C", "A", "--filter", "num=1")
    assert "no filter on C -> A" in line and "cycle" in line
    assert {n: history(locations, n) for n in "AC"} == before
    # Unfiltered, it closes the cycle A - B - C; then A -> B may not take a filter.
    locations.ok("connect", "C", "A")
    line = refused(locations, "connect", "A", "B", "--filter", "num=1")
    assert "no filter on A -> B" in line
    topology = locations.ok("topology", "--at", "A")
    assert "C -> A" in topology and "yes" in topology and "history:" in topology
    assert '"C" -> "A"' in locations.ok("topology", "--at", "A", "--format", "dot")
    assert "==>*" in locations.ok("topology", "--at", "A", "--format", "picture")

    # D is a terminal location behind a filtered connection: it gets only what passes, and
    # the system events (topology changes) that every filter lets through.
    locations.ok("connect", "A", "D", "--filter", "num in (2, 6)")
    locations.ok("emit", "A", '{"num": 5}', '{"num": 6}')
    until_blocking(lambda: len(ids(locations.events("D"))) == 2, "D holds the two events that pass")
    payloads = [e["payload"]["num"] for e in locations.events("D") if "num" in e["payload"]]
    assert payloads == [2, 6]
    assert any("system" in e["payload"] for e in locations.events("D"))
    # Each location folds the same connections from its own log, eventually.
    until_blocking(
        lambda: len({json.dumps(sorted(_current(locations, n))) for n in "ABC"}) == 1,
        "A, B and C see the same topology",
    )


def _current(locations: LocationProcesses, name: str) -> list[tuple[str, str, str]]:
    out = json.loads(locations.ok("topology", "--at", name, "--format", "json"))
    return [(c["source"], c["target"], c["filter"]) for c in out["current"]]


def test_bad_input_is_one_line_and_changes_nothing(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "D"))
    for name in "ABD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B", "--both")
    locations.ok("connect", "A", "D", "--filter", "num=2")
    locations.ok("emit", "A", '{"num": 2}', '{"num": 1}')
    until_blocking(lambda: len(ids(locations.events("B"))) == 2, "B holds A's events")
    before = {n: history(locations, n) for n in "ABD"}

    assert "unknown location 'Z'" in refused(locations, "connect", "A", "Z")
    assert "known: A, B, D" in refused(locations, "status", "Z")
    assert "replication filter" in refused(locations, "connect", "B", "D", "--filter", "=x")
    assert "not JSON" in refused(locations, "emit", "A", "{")
    assert "reserved" in refused(locations, "emit", "A", '{"system": {}}')
    assert "a location does not replicate to itself" in refused(locations, "connect", "A", "A")
    assert "not connected" in refused(locations, "disconnect", "B", "D")
    # Deletion past what D has: A's last event ({"num": 1}) never reaches D (filtered), and
    # nothing D stores comes after it, so deleting it would leave DVV-A above CVV-D.
    last_a = locations.status("A")["last_seq"]
    line = refused(locations, "delete", "A", "--through", str(last_a))
    assert f"A may not delete through {last_a}" in line and "CVV-D" in line
    assert locations.status("A")["deleted_through"] == 0
    assert "holds sequence numbers" in refused(locations, "delete", "A", "--through", "999")
    assert {n: history(locations, n) for n in "ABD"} == before

    # D retires: its connections end, and none to or from it is accepted any more.
    assert "D: retired" in locations.ok("retire", "D")
    assert "location D is retired" in refused(locations, "connect", "B", "D")
    assert "D: retired already" in locations.ok("retire", "D")
    assert "is retired" in refused(locations, "emit", "D", '{"num": 9}')
    # With D gone from the topology, A may delete what only B needed (B has it all).
    reply = locations.ok("delete", "A", "--through", str(last_a))
    assert f"A: deleted through {last_a}" in reply
    assert ids(locations.events("A")) == []  # Readers skip deleted events.
    # A stopped location: one line that says how to start it.
    locations.stop("B")
    assert "location B is not running" in refused(locations, "status", "B")


def test_a_source_whose_process_is_down_is_read_from_its_journal(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A", "B"))
    locations.start("A", location_broker.address)
    locations.start("B", location_broker.address)
    locations.ok("connect", "A", "B")
    locations.stop("B")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}', '{"num": 3}')
    locations.kill("A")  # Its log is durable in its journal.
    locations.start("B", location_broker.address)
    until_blocking(lambda: len(ids(locations.events("B"))) == 3, "B read A's journal")
    connection = locations.status("B")["connections"][0]
    assert (connection["source"], connection["via"]) == ("A", "journal")
    assert_causal_order(locations.events("B"))


def test_a_second_process_of_a_location_fences_the_first(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A"))
    locations.start("A", location_broker.address, key="A1")
    old = locations.endpoint("A1")
    locations.ok("emit", "A", '{"num": 1}')
    locations.start("A", location_broker.address, key="A2")  # Takes the log's writer.
    locations.ok("emit", "A", '{"num": 2}')

    async def zombie_emit() -> str:
        async with LocationClient("A", old) as client:
            try:
                await client.emit({"num": "zombie"})
            except LocationError as exc:
                return str(exc)
        return "accepted"

    assert "fenced out" in asyncio.run(zombie_emit())
    assert locations.procs["A1"].wait(timeout=15) == 1
    assert "fenced out" in locations.log("A1")
    assert [e["payload"]["num"] for e in locations.events("A")] == [1, 2]


def test_a_location_that_lost_its_log_recovers_it(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """Metadata recovery, then event recovery over its unfiltered bi-directional connection:
    the recovered location's clock never runs in the past, and it gets its events back."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B"))
    for name in "AB":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B", "--both")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}')
    locations.ok("emit", "B", '{"num": 3}')
    until_blocking(lambda: len(ids(locations.events("A"))) == 3, "A holds B's event")
    until_blocking(lambda: len(ids(locations.events("B"))) == 3, "B holds A's events")
    before = set(ids(locations.events("B")))
    time_seen = locations.status("B")["cvv"]["A"]

    locations.stop("A")
    asyncio.run(_lose_log(location_broker, "A"))
    locations.start("A", location_broker.address)
    # A knows it lost events (B has seen more of it), and refuses to emit until recovered.
    until_blocking(lambda: locations.status("A")["lost"] != "", "A notices its loss")
    line = refused(locations, "emit", "A", '{"num": 4}')
    assert "A lost events" in line and "gazctl replication recover A" in line
    out = locations.ok("recover", "A")
    assert f"local time {time_seen}" in out and "events 1-0 survived" in out
    # Its events and the topology come back from B; its new events come after them.
    until_blocking(lambda: set(ids(locations.events("A"))) == before, "A recovered its events")
    emitted = locations.ok("emit", "A", '{"num": 4}')
    assert VectorClock.from_json(json.loads(json.dumps(locations.events("A")[-1]["ts"])))["A"] > time_seen  # fmt: skip
    assert f"A {{A: {time_seen + 1}" in emitted
    until_blocking(lambda: len(ids(locations.events("B"))) == 4, "B gets A's new event")
    assert_causal_order(locations.events("A"))
    assert_causal_order(locations.events("B"))


def test_recovery_waits_for_every_location_that_may_hold_its_events(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A's last events went only to C (its connection to B filters them out). Recovering A
    with C down would set A's clock below times C holds: refused, in one line; with C up, A's
    clock comes back to the most C saw, and its next event follows it."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "C")
    locations.ok("connect", "A", "B", "--filter", "num=1")
    locations.ok("emit", "A", '{"num": 2}', '{"num": 2}', '{"num": 2}')
    until_blocking(lambda: len(ids(locations.events("C"))) == 3, "C holds A's events")
    seen_by_c = locations.status("C")["cvv"]["A"]
    assert locations.status("B")["cvv"]["A"] < seen_by_c
    locations.stop("A")
    asyncio.run(_lose_log(location_broker, "A"))
    locations.start("A", location_broker.address)
    locations.stop("C")
    line = refused(locations, "recover", "A")
    assert "cannot recover its clock while C does not answer" in line
    locations.start("C", location_broker.address)
    assert f"local time {seen_by_c}" in locations.ok("recover", "A")
    local = clock_after_recovery(locations, "A", seen_by_c)
    out = locations.ok("emit", "A", '{"num": 4}')
    assert f"A: {local + 1}" in out


def test_a_location_emits_only_once_every_location_answered_since_it_started(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A lost its log while C, the one location holding its last events, was down. Started
    again, A must not emit (a time C holds would come again, and C would drop that event as
    seen): its emits and topology changes are refused in one line naming C until C answers;
    then A knows it lost events, is recovered, and its next event follows what C saw."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "C")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}')
    until_blocking(lambda: len(ids(locations.events("C"))) == 2, "C holds A's events")
    seen_by_c = locations.status("C")["cvv"]["A"]
    locations.stop("C")
    locations.stop("A")
    asyncio.run(_lose_log(location_broker, "A"))
    locations.start("A", location_broker.address)
    line = refused(locations, "emit", "A", '{"num": 3}')
    assert "location A has not heard from C since it started" in line
    assert "gazctl replication trust-clock A --without C" in line
    assert "not heard from C" in locations.gazctl("status", "A").out
    assert "has not heard from C" in refused(locations, "connect", "B", "A")
    locations.start("C", location_broker.address)
    until_blocking(lambda: locations.status("A")["lost"] != "", "A learns it lost events")
    assert "A lost events" in refused(locations, "emit", "A", '{"num": 3}')
    locations.ok("recover", "A")
    local = clock_after_recovery(locations, "A", seen_by_c)
    assert f"A: {local + 1}" in locations.ok("emit", "A", '{"num": 3}')


def test_an_operator_lets_a_location_emit_without_one_that_does_not_answer(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """B is down for good when A starts again: A emits only once the operator says so, naming
    B; naming a location A has heard from is refused, and nothing changes."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.stop("B")
    locations.stop("A")
    locations.start("A", location_broker.address)
    assert "has not heard from B" in refused(locations, "emit", "A", '{"num": 1}')
    line = refused(locations, "trust-clock", "A", "--without", "C")
    assert "only a location not heard from can be left out (not heard from: B)" in line
    assert "emits without having heard from B" in locations.ok("trust-clock", "A", "--without", "B")
    assert "A {A: 2}" in locations.ok("emit", "A", '{"num": 1}')  # After its Connected.


def test_recovery_resets_progress_wherever_the_location_was_replicated_to(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A -> B ran and was disconnected; then A lost its log and was recovered from C. B's
    progress for A goes back with A's log, so when A -> B comes back, A's new events reach B."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("connect", "A", "C", "--both")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}')
    until_blocking(lambda: locations.status("B")["progress"].get("A", 0) >= 2, "B read A")
    until_blocking(lambda: len(ids(locations.events("C"))) == 2, "C holds A's events")
    locations.ok("disconnect", "A", "B")
    locations.stop("A")
    asyncio.run(_lose_log(location_broker, "A"))
    locations.start("A", location_broker.address)
    until_blocking(lambda: locations.status("A")["lost"] != "", "A learns it lost events")
    locations.ok("recover", "A")
    assert locations.status("B")["progress"]["A"] == 0
    until_blocking(lambda: len(ids(locations.events("A"))) == 2, "A recovered its events")
    locations.ok("emit", "A", '{"num": 3}')
    locations.ok("connect", "A", "B")
    until_blocking(lambda: [e["payload"].get("num") for e in locations.events("B") if "num" in e["payload"]] == [1, 2, 3], "B holds A's new event")  # fmt: skip


def test_gazctl_replication_pages_deletes_by_id_and_changes_all_or_nothing(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """`events` pages through a log of more than one page; `delete --through` takes an event's
    id; `disconnect --both` with one direction not connected changes neither; a refused
    `connect --new-events-only` leaves the target's vectors as they were (it joins only once
    the connection's checks passed)."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "D"))
    for name in "ABD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ask("A", lambda c: c.emit(*[{"num": i} for i in range(1200)]))
    out = locations.ok("events", "A")
    assert [json.loads(line)["payload"].get("num") for line in out.splitlines()][-1200:] == list(range(1200))  # fmt: skip
    assert len(locations.ok("events", "A", "--limit", "1100").splitlines()) == 1100
    until_blocking(
        lambda: locations.status("B")["cvv"].get("A", 0) >= 1201, "B holds A's events", 60
    )
    seq = next(json.loads(line)["seq"] for line in out.splitlines() if json.loads(line)["payload"].get("num") == 4)  # fmt: skip
    assert f"A: deleted through {seq}, DVV {{A: 6}}" in locations.ok("delete", "A", "--through", "A:6")  # fmt: skip
    assert "event A:99999 is not in A's log" in refused(locations, "delete", "A", "--through", "A:99999")  # fmt: skip
    assert "give a sequence number" in refused(locations, "delete", "A", "--through", "A:x")

    line = refused(locations, "disconnect", "A", "B", "--both")
    assert "B -> A is not connected" in line
    assert ("A", "B") in {(c["source"], "B") for c in locations.status("B")["connections"]}
    assert "A -> B: connected already" in locations.ok("connect", "A", "B")

    until_blocking(lambda: len(history(locations, "D")) == 1, "D holds etcd's history")
    before = locations.status("D")
    refused(locations, "connect", "A", "D", "--filter", "not a selector((", "--new-events-only")
    after = locations.status("D")
    assert (after["cvv"], after["dvv"]) == (before["cvv"], before["dvv"])
    assert "A" not in after["cvv"] and after["dvv"] == {}  # Not joined: A deleted through A:6.


def test_a_filtered_connection_fails_over_once_the_new_source_has_caught_up(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """D takes A's red events. B is behind A: failing D over from A to B is refused while the
    CVV A last sent D is not <= CVV-B; once B has caught up it is accepted, D's connection
    runs from B, and B's new red events reach D."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "D"))
    for name in "ABD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B", "--both")
    locations.ok("connect", "A", "D", "--filter", "colour=red")
    locations.ok("disconnect", "A", "B")  # B falls behind.
    locations.ok("emit", "A", '{"colour": "red"}', '{"colour": "blue"}')
    until_blocking(lambda: len(ids(locations.events("D"))) == 1, "D holds A's red event")
    line = refused(locations, "connect", "B", "D", "--filter", "colour=red",
                   "--fail-over-from", "A")  # fmt: skip
    assert "D may not fail over from A to B yet: CVV-A" in line and "is not <= CVV-B" in line
    assert [c["source"] for c in locations.status("D")["connections"]] == ["A"]
    locations.ok("connect", "A", "B")
    cvv_a = VectorClock.from_json(locations.status("A")["cvv"])
    until_blocking(lambda: VectorClock.from_json(locations.status("B")["cvv"]) >= cvv_a, "B caught up")  # fmt: skip
    out = locations.ok("connect", "B", "D", "--filter", "colour=red", "--fail-over-from", "A")
    assert "D: failed over from A to B" in out
    until_blocking(lambda: [c["source"] for c in locations.status("D")["connections"]] == ["B"], "D reads B")  # fmt: skip
    locations.ok("emit", "B", '{"colour": "red", "from": "B"}', '{"colour": "blue"}')
    until_blocking(lambda: len(ids(locations.events("D"))) == 2, "D holds B's red event")
    assert [e["payload"]["colour"] for e in locations.events("D") if "colour" in e["payload"]] == ["red", "red"]  # fmt: skip
    assert "D failed over from A to B" in locations.ok("topology", "--at", "D")


def test_a_new_location_waits_for_deleted_events_or_joins_for_new_ones(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A deleted events B holds. A new connection A -> E waits (the start rule: DVV-A is not
    <= CVV-E), saying so in `status`; F, connected with --new-events-only, raises its CVV and
    DVV to DVV-A and takes A's events from there on."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "E", "F"))
    for name in "ABEF":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("emit", "A", '{"num": 1}', '{"num": 2}', '{"num": 3}')
    until_blocking(lambda: len(ids(locations.events("B"))) == 3, "B holds A's events")
    last = locations.status("A")["last_seq"]
    locations.ok("delete", "A", "--through", str(last - 1))
    locations.ok("connect", "A", "E")
    until_blocking(
        lambda: locations.status("E")["connections"][0]["state"].startswith("waiting: DVV-A"),
        "E's connection waits",
    )
    assert ids(locations.events("E")) == []
    out = locations.ok("connect", "A", "F", "--new-events-only")
    assert "F: joined for new events" in out
    until_blocking(lambda: len(ids(locations.events("F"))) == 1, "F holds A's last event")
    assert [e["payload"]["num"] for e in locations.events("F") if "num" in e["payload"]] == [3]
    locations.ok("emit", "A", '{"num": 4}')
    until_blocking(lambda: len(ids(locations.events("F"))) == 2, "F holds A's new event")
    assert ids(locations.events("E")) == []  # Still waiting: nothing out of order.


def test_deleted_events_are_removed_from_the_store_and_the_log_still_opens(
    etcd_server: EtcdServer, tmp_path: Path, locations: LocationProcesses
) -> None:
    """Physical deletion: after a deletion, `prune` removes the persisted fragments that hold
    nothing but deleted events; the location's process, started again, opens its log from what
    remains (its checkpoint), goes on with the next sequence number and time, keeps its
    connections, and readers read the log from where it now begins."""
    root = tmp_path / "fragments"
    (root / "replication").mkdir(parents=True)
    broker = start_broker_process(
        etcd_server, f"/gazette-test/{uuid.uuid4().hex[:12]}", tmp_path / "broker.log",
        extra=("--broker.file-root", str(root)),
    )  # fmt: skip
    try:
        asyncio.run(apply_location_journals(broker.address, "A", "B", store="file:///replication/",
                                            fragment_length=1024, refresh_seconds=1))  # fmt: skip
        for name in "AB":
            locations.start(name, broker.address)
        locations.ok("connect", "A", "B", "--both")
        locations.ok("emit", "A", *(json.dumps({"num": i, "pad": "x" * 60}) for i in range(30)))
        until_blocking(lambda: len(ids(locations.events("B"))) == 30, "B holds A's events")
        before = locations.status("A")
        locations.ok("delete", "A", "--through", str(before["last_seq"] - 5))
        until_blocking(lambda: "would remove 0 " not in locations.ok("prune", "A", "--dry-run"), "persisted")  # fmt: skip
        out = locations.ok("prune", "A", "--file-root", str(root))
        removed = int(out.split("removing ")[1].split(" ")[0])
        assert removed > 0, out
        stored = [
            f
            for f in (root / "replication" / "replication" / "A").iterdir()
            if not f.name.startswith(".")
        ]  # Not the health probe.
        assert stored and all(int(f.name.split("-")[0], 16) > 0 for f in stored)  # Offset 0 gone.

        def lists_offset_zero() -> bool:
            with grpc.insecure_channel(broker.address.removeprefix("http://")) as channel:
                stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
                listed = stub.ListFragments(pb.FragmentsRequest(journal="replication/A"), timeout=10)  # fmt: skip
            return any(f.spec.backing_store and f.spec.begin == 0 for f in listed.fragments)

        # The broker lists its store again: its index no longer holds what was pruned.
        until_blocking(lambda: not lists_offset_zero(), "the broker listed its store again")

        locations.kill("A")
        locations.start("A", broker.address)
        after = locations.status("A")
        assert (after["last_seq"], after["local_time"], after["cvv"]) == (
            before["last_seq"], before["local_time"], before["cvv"])  # fmt: skip
        assert [c["source"] for c in after["connections"]] == ["B"]
        kept = [e["payload"]["num"] for e in locations.events("A") if "num" in e["payload"]]
        assert kept == [25, 26, 27, 28, 29]
        locations.ok("emit", "A", '{"num": 30}')
        events = locations.events("A")
        assert events[-1]["seq"] == before["last_seq"] + 1  # No sequence number used twice,
        assert events[-1]["ts"]["A"] == before["local_time"] + 1  # and no time.
        until_blocking(lambda: len(ids(locations.events("B"))) == 31, "B holds A's new event")
    finally:
        locations.stop_all()
        stop_process(broker.proc)


def test_applications_emit_and_read_through_the_async_client(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A"))
    locations.start("A", location_broker.address)

    async def use() -> None:
        async with LocationClient("A", locations.endpoint("A")) as client:
            assert await client.emit({"kind": "x"}, {"kind": "y"}) == [("A", 1), ("A", 2)]
            stored = await client.events()
            assert [(s.seq, s.event.id, s.event.payload) for s in stored] == [
                (1, ("A", 1), {"kind": "x"}), (2, ("A", 2), {"kind": "y"})]  # fmt: skip
            assert [s.seq for s in await client.events(after=1)] == [2]
            started = time.monotonic()
            assert await client.events(after=2, wait=0.3) == []  # Waited for more: none came.
            assert time.monotonic() - started >= 0.25
            assert (await client.status()).last_seq == 2

    asyncio.run(use())


def test_a_terminal_location_recovers_its_own_events_over_a_filtered_connection(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """D is terminal, connected to A only, and A -> D filters (red only); D -> A carries all.
    D loses its log: its own events come back from A although the filter would drop them (the
    filter OR-ed with "emitted at D", the seed's rule for terminal locations), and A's red one."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "D"))
    for name in "AD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "D", "--filter", "colour=red")
    locations.ok("connect", "D", "A")
    locations.ok("emit", "D", '{"colour": "blue", "mine": 1}', '{"colour": "green", "mine": 2}')
    locations.ok("emit", "A", '{"colour": "red"}', '{"colour": "blue"}')
    until_blocking(lambda: len(ids(locations.events("A"))) == 4, "A holds D's events")
    until_blocking(lambda: len(ids(locations.events("D"))) == 3, "D holds A's red event")
    before = sorted(ids(locations.events("D")))
    locations.stop("D")
    asyncio.run(_lose_log(location_broker, "D"))
    locations.start("D", location_broker.address)
    out = locations.ok("recover", "D")
    assert "not from" not in out  # A terminal location recovers over its filtered connection.
    until_blocking(lambda: sorted(ids(locations.events("D"))) == before, "D has its events back")
    assert_causal_order(locations.events("D"))


def test_the_location_service_is_typed_and_refuses_with_status_codes(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """A client built from replication/location.proto alone (the generated stub on a plain
    channel, none of this project's client code) emits, reads and checks changes; a rule's
    refusal is FAILED_PRECONDITION with the rule's reason, a bad request INVALID_ARGUMENT."""
    import grpc

    from replication import location_pb2 as lpb
    from replication import location_pb2_grpc as lpb_grpc

    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    for source, target in ["AB", "BC", "CA"]:
        locations.ok("connect", source, target)
    address = locations.endpoint("A").removeprefix("http://")

    async def use() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = lpb_grpc.LocationStub(channel)  # type: ignore[no-untyped-call]
            emitted = await stub.Emit(lpb.EmitRequest(payloads=[b'{"kind": "typed"}']))
            (event,) = emitted.events
            assert event.emitter == "A" and event.timestamp.times["A"] == event.time
            read = await stub.Read(lpb.ReadRequest(after=0, limit=100))
            lines = [json.loads(line) for line in read.records.decode().splitlines()]
            assert lines[-1]["payload"] == {"kind": "typed"} and read.last_seq == len(lines)
            status = await stub.Status(lpb.StatusRequest())
            assert status.cvv.times["A"] == event.time and status.clock_ok
            # A's view has its own connections at least (B -> C comes by replication).
            assert {(k.change.connected.source, k.change.connected.target) for k in status.history} >= {("A", "B"), ("C", "A")}  # fmt: skip
            # A filter on the cycle A - B - C: the rule's reason, as a status.
            cycle = lpb.Change(filtered=lpb.Change.Connection(source="A", target="B", filter="kind=x"))  # fmt: skip
            try:
                await stub.Change(lpb.ChangeRequest(change=cycle))
                raise AssertionError("a filter on a cycle was accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "cycle" in (exc.details() or "")
            for bad, why in [
                (lpb.EmitRequest(payloads=[b"[1, 2]"]), "payloads[0]: expected a JSON object"),
                (lpb.EmitRequest(payloads=[b"{"]), "payloads[0]: not JSON"),
            ]:
                try:
                    await stub.Emit(bad)
                    raise AssertionError(f"{bad} was accepted")
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert why in (exc.details() or "")
            try:
                await stub.Change(lpb.ChangeRequest())
                raise AssertionError("a change request without a change was accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "no change given" in (exc.details() or "")

    asyncio.run(use())
    # Nothing refused was recorded: B's connection from A is as it was, unfiltered.
    assert [(c["source"], c["filter"]) for c in locations.status("B")["connections"]] == [("A", "")]


def test_a_recovering_hub_guards_its_terminal_neighbours_events_before_its_view_is_back(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """C is in the cycle A - B - C and the hub of the terminal D (C -> D filtered kind=red, D ->
    C not). A emits many blue events, then one red that D gets through C. C loses its log and
    recovers; its new log holds no topology until the system events come back, and meanwhile
    D's log (read from its beginning) must still be written under the group's guard: A's red
    event, written before A's blue ones are back, would raise C's CVV past them and the
    causality filter would drop them for good (found by the disaster-hub fault scenario, seeds
    2 and 20261129: C lacked every blue event of A and B). A's log is long and D's short, so
    D's first batch is usually written first (a race the test makes likely, not certain)."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    for a, b in ["AB", "BC", "CA"]:
        locations.ok("connect", a, b, "--both")
    locations.ok("connect", "C", "D", "--filter", "kind=red")
    locations.ok("connect", "D", "C")
    count = 600
    for start in range(0, count, 200):
        blues = [json.dumps({"kind": "blue", "n": n}) for n in range(start, start + 200)]
        locations.ok("emit", "A", *blues)
    locations.ok("emit", "A", json.dumps({"kind": "red", "n": count}))
    until_blocking(lambda: len(ids(locations.events("D"))) == 1, "D holds A's red event")
    until_blocking(lambda: locations.status("C")["last_seq"] > count, "C holds A's events")
    locations.stop("C")
    asyncio.run(_lose_log(location_broker, "C"))
    locations.start("C", location_broker.address)
    until_blocking(lambda: locations.status("C")["lost"] != "", "C learns it lost events")
    locations.ok("recover", "C")
    until_blocking(
        lambda: (
            not any(
                c["lag"] or c["state"] != "replicating"
                for c in locations.status("C")["connections"]
            )
        ),
        "C reads through its sources",
        timeout=60,
    )
    events = _all_events(locations, "C")
    held = {e["payload"]["n"] for e in events if "n" in e["payload"]}
    lacking = sorted(set(range(count + 1)) - held)
    assert not lacking, f"C lacks {len(lacking)} of A's events: {lacking[:5]} ..."
    assert_causal_order(events)


class _NewLogSource(lpb_grpc.LocationServicer):  # type: ignore[misc]
    """A stand-in for the process of a source whose log was lost and made anew (one state of a
    connection, beside the end-to-end recovery tests): it serves `Read` from its new log, and
    holds the first Read that starts at `hold_after` (the target's progress on the lost log)
    until `release` is set, so that the target's progress can be reset meanwhile, as `recover`
    does. The `after` of every Read it answered, in order, is in `afters`."""

    def __init__(self, name: str, count: int, hold_after: int) -> None:
        self.name, self.hold_after = name, hold_after
        # New events (times past any the lost log held), at the sequence numbers the lost
        # log had used.
        self.lines = [
            encode_event(seq, Event(name, VectorClock({name: 100 + seq}), {"n": seq})).line(seq)
            for seq in range(1, count + 1)
        ]
        self.held, self.release = asyncio.Event(), asyncio.Event()
        self.afters: list[int] = []

    async def Read(self, request: Any, context: Any) -> Any:
        if request.after == self.hold_after and not self.held.is_set():
            self.held.set()
            await self.release.wait()
        self.afters.append(request.after)
        lines = self.lines[request.after : request.after + (request.limit or 1000)]
        if not lines:
            await asyncio.sleep(min(request.wait, 0.2))
        last = len(self.lines)
        through = request.after + len(lines)
        return lpb.ReadResponse(
            through=through, cvv=clock_message({self.name: 100 + last}), dvv=clock_message({}),
            deleted_through=0, last_seq=last, records=b"".join(lines),
        )  # fmt: skip


def test_a_read_in_flight_when_a_recovery_resets_the_progress_does_not_undo_the_reset(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """C -> D; C's log is lost and made anew, reusing its sequence numbers. D's connection has
    a Read in flight from its progress on the lost log when C's recovery resets that progress
    to 0; the Read's reply (events of the new log past the old progress) must not raise the
    progress back over the reset, or D skips the new log's first events for good (found by
    the disaster-hub fault scenario, seed 2929: three events missing at D)."""
    asyncio.run(apply_location_journals(location_broker.address, "C", "D"))
    for name in "CD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "C", "D")
    locations.ok("emit", "C", '{"n": 1}', '{"n": 2}')
    until_blocking(lambda: len(ids(locations.events("D"))) == 2, "D holds C's events")
    old = locations.status("C")["last_seq"]
    until_blocking(lambda: locations.status("D")["progress"].get("C") == old, "D read C's log")
    locations.stop("C")
    d_endpoint = locations.endpoint("D")

    async def scenario() -> tuple[list[int], list[int]]:
        fake = _NewLogSource("C", old + 2, hold_after=old)
        server = grpc.aio.server()
        lpb_grpc.add_LocationServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        etcd = aetcd.Client(host=locations.etcd.host, port=locations.etcd.client_port)
        try:
            body = json.dumps({"endpoint": f"http://127.0.0.1:{port}", "pid": 0})
            await etcd.put(endpoint_key(locations.prefix, "C"), body.encode())
            await asyncio.wait_for(fake.held.wait(), 30)  # D reads from its old progress.
            async with LocationClient("D", d_endpoint) as d:
                assert await d.reset_progress("C", 0) == 0  # What `recover C` does at D.
                fake.release.set()
                deadline = asyncio.get_running_loop().time() + 30
                while len(fake.afters) < 2:
                    assert asyncio.get_running_loop().time() < deadline, fake.afters
                    await asyncio.sleep(0.05)
                while True:
                    records = (await d.read(0, 1000)).records.decode().splitlines()
                    events = [json.loads(line) for line in records]
                    held = [e["ts"]["C"] for e in events if e["emitter"] == "C"]
                    if all(100 + seq in held for seq in range(1, old + 3)):
                        break
                    if asyncio.get_running_loop().time() > deadline:
                        break
                    await asyncio.sleep(0.1)
            return fake.afters, held
        finally:
            await etcd.close()
            await server.stop(None)

    afters, held = asyncio.run(scenario())
    # The held Read's reply came after the reset: it is dropped, and the next Read starts
    # from the reset progress, not from past the old one.
    assert afters[1] == 0, f"D read C's new log after {afters[1]} (its reset progress is 0)"
    missing = [seq for seq in range(1, old + 3) if 100 + seq not in held]
    assert not missing, f"D lacks the new log's events at sequence numbers {missing}"


def test_a_hub_recovers_the_events_its_terminal_neighbour_emitted_while_it_was_down(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """C is in the cycle A - B - C and the hub of the terminal D (C -> D filtered, D -> C not).
    C loses its log while D emits. C recovers its own events from A and B; D -> C is not a
    connection it may recover over (its other direction is filtered), but C's group guard keeps
    the order of what it reads from D, so C reads D's log from its beginning instead of
    skipping to its head: D's events emitted meanwhile reach C, A and B (found by the
    disaster-hub fault scenario: they were skipped for good)."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    for a, b in ["AB", "BC", "CA"]:
        locations.ok("connect", a, b, "--both")
    locations.ok("connect", "C", "D", "--filter", "kind=red")
    locations.ok("connect", "D", "C")
    locations.ok("emit", "A", '{"kind": "red", "n": 0}')
    locations.ok("emit", "D", '{"kind": "blue", "n": 1}')
    until_blocking(lambda: len(ids(locations.events("A"))) == 2, "A holds D's first event")
    until_blocking(lambda: len(ids(locations.events("D"))) == 2, "D holds A's red event")
    locations.stop("C")
    asyncio.run(_lose_log(location_broker, "C"))
    locations.ok("emit", "D", '{"kind": "blue", "n": 2}', '{"kind": "blue", "n": 3}')
    locations.start("C", location_broker.address)
    until_blocking(lambda: locations.status("C")["lost"] != "", "C learns it lost events")
    locations.ok("recover", "C")
    for name in "CAB":
        until_blocking(
            lambda n=name: (
                sorted(e["payload"]["n"] for e in locations.events(n) if "n" in e["payload"])
                == [0, 1, 2, 3]
            ),  # type: ignore[misc]
            f"{name} holds every event",
        )
        assert_causal_order(locations.events(name))
