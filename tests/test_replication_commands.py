"""Operator commands over a network of location processes, checked against the whole topology
history and recorded all or nothing (issue 38, items 7 to 9): a command is checked against etcd's
history, not an endpoint's partial view; a refused one changes nothing anywhere (no record at
one end, no join); a change etcd recorded reaches every location, even when the gazctl that made
it died before telling them; and a network that already holds a change the rules forbid can be
repaired with gazctl."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.testing import EtcdServer
from replication.journals import apply_location_journals
from tests.conftest import BrokerProcess
from tests.helpers.locations import LocationProcesses, refused
from tests.helpers.waiting import until_blocking


def history(locations: LocationProcesses, name: str) -> list[Any]:
    return list(locations.status(name)["history"])


def connections(locations: LocationProcesses, name: str) -> list[str]:
    return [c["source"] for c in locations.status(name)["connections"]]


def test_a_filtered_cycle_is_refused_although_no_endpoint_sees_it(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """Issue 38, item 7: A and C only send, so neither learns of B <-> D by replication; the
    filtered A -> C closes the cycle A - B - D - C - A all the same, and is refused, with
    nothing recorded anywhere."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("connect", "C", "D")
    locations.ok("connect", "B", "D", "--both")
    for name in "ABCD":  # Each records etcd's history, A and C too.
        until_blocking(lambda n=name: len(history(locations, n)) == 4, f"{name} holds the four changes")  # fmt: skip
    before = {n: history(locations, n) for n in "ABCD"}
    line = refused(locations, "connect", "A", "C", "--filter", "kind=x")
    assert "A -> C" in line and "cycle" in line, line
    assert {n: history(locations, n) for n in "ABCD"} == before
    assert connections(locations, "C") == []
    # Unfiltered, it is one more link of the unfiltered group: accepted.
    locations.ok("connect", "A", "C")
    until_blocking(lambda: connections(locations, "C") == ["A"], "C reads A")


def test_a_refused_connect_changes_nothing_at_either_end(
    location_broker: BrokerProcess, locations: LocationProcesses
) -> None:
    """Issue 38, items 8 and 9: C stopped and A restarted, A has not heard from C. `connect A D`
    is refused in one line naming C, and D records nothing (no connection, no change in its
    history); with --new-events-only, D's CVV and DVV stay as they were although A deleted
    events. Once C answers, the same command is accepted, and D joins."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}', '{"n": 3}')
    until_blocking(lambda: locations.status("B")["cvv"].get("A", 0) >= 4, "B holds A's events")
    locations.ok("delete", "A", "--through", "3")
    dvv_a = locations.status("A")["dvv"]
    assert dvv_a.get("A", 0) >= 2, dvv_a
    locations.stop("C")
    locations.stop("A")
    locations.start("A", location_broker.address)
    before = locations.status("D")
    for extra in ([], ["--new-events-only"]):
        line = refused(locations, "connect", "A", "D", *extra)
        assert "A has not heard from C" in line, line
        after = locations.status("D")
        assert after["history"] == before["history"]
        assert after["connections"] == []
        assert (after["cvv"], after["dvv"]) == (before["cvv"], before["dvv"])
    # Nothing to repair: `disconnect` finds no connection, and no view differs.
    assert "A -> D is not connected" in refused(locations, "disconnect", "A", "D")
    locations.start("C", location_broker.address)
    until_blocking(lambda: locations.status("A")["clock"] == "ok", "A heard from C")
    out = locations.ok("connect", "A", "D", "--new-events-only")
    assert "D: joined for new events" in out
    assert locations.status("D")["dvv"].get("A", 0) >= dvv_a["A"]
    until_blocking(lambda: connections(locations, "D") == ["A"], "D reads A")
    until_blocking(lambda: locations.gazctl("topology", "--check").code == 0, "the views agree")


def test_a_change_etcd_recorded_reaches_every_location_though_gazctl_died(
    location_broker: BrokerProcess, locations: LocationProcesses, etcd_server: EtcdServer
) -> None:
    """A command recorded in etcd's history and delivered to no location (its gazctl died right
    after the record) still takes effect: each location reads etcd's history, B at once, C when
    it starts again; `topology --check` then finds every view equal to etcd's."""
    from replication import commands
    from replication.topology import Connected

    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C"))
    for name in "ABC":
        locations.start(name, location_broker.address)
    locations.stop("C")

    async def record_only() -> None:
        etcd = commands.connect_etcd(etcd_server.endpoint)
        try:
            recorded = await commands.command(etcd, locations.prefix, lambda view: [Connected("A", "B"), Connected("B", "C")])  # fmt: skip
            assert [c for _, c in recorded.recorded] == [Connected("A", "B"), Connected("B", "C")]
        finally:
            await etcd.close()

    asyncio.run(record_only())
    until_blocking(lambda: connections(locations, "B") == ["A"], "B reads A")
    until_blocking(lambda: len(history(locations, "A")) == 2, "A holds both changes")
    locations.ok("emit", "A", '{"n": 1}')
    locations.start("C", location_broker.address)
    until_blocking(lambda: connections(locations, "C") == ["B"], "C reads B")
    until_blocking(lambda: any(e["payload"].get("n") == 1 for e in locations.events("C")), "C holds A's event")  # fmt: skip
    out = locations.ok("topology", "--check")
    assert "3 locations hold etcd's view (2 changes)" in out, out


def test_a_network_that_holds_a_forbidden_change_is_repaired_with_gazctl(
    location_broker: BrokerProcess, locations: LocationProcesses, etcd_server: EtcdServer
) -> None:
    """Issue 38, item 7's way out: the history already holds the filtered A -> C that closes
    the cycle A - B - D - C - A (recorded before commands were checked whole). Commands that
    do not make it worse are accepted (B -> A and D -> C add no link, A -> C's disconnection
    none), one that does is refused; every location learns the history."""
    from replication import commands
    from replication.topology import Connected

    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("connect", "C", "D")
    locations.ok("connect", "B", "D", "--both")

    async def forbidden() -> None:
        etcd = commands.connect_etcd(etcd_server.endpoint)
        try:
            history = await commands.read_history(etcd, locations.prefix)
            assert await commands.record(etcd, locations.prefix, history, [Connected("A", "C", "kind=x")])  # fmt: skip
        finally:
            await etcd.close()

    asyncio.run(forbidden())
    until_blocking(lambda: connections(locations, "C") == ["A"], "C reads A, filtered")
    locations.ok("connect", "B", "A")
    locations.ok("connect", "D", "C")
    line = refused(locations, "connect", "A", "D", "--filter", "kind=x")
    assert "A -> D" in line and "cycle" in line, line
    locations.ok("disconnect", "A", "C")
    until_blocking(lambda: connections(locations, "C") == ["D"], "C reads D only")
    until_blocking(
        lambda: locations.gazctl("topology", "--check").code == 0, "every view is etcd's"
    )


def test_a_history_that_breaks_a_rule_takes_only_commands_that_make_it_no_worse() -> None:
    """The way out, on the view alone: with the forbidden filtered A -> C in the history, a
    connection over a link that exists already, a filter change that adds no filtered link to
    a group, and any disconnection or retirement are allowed; a new filtered link inside the
    group, or one that merges groups around a filtered link, is refused as before."""
    from replication.topology import (
        Connected,
        Disconnected,
        Filtered,
        Retired,
        RuleViolation,
        Topology,
    )

    base = [Connected("A", "B"), Connected("C", "D"), Connected("B", "D"), Connected("D", "B")]
    clean = Topology.of(base)
    assert clean.violations() == set()
    try:
        clean.check_change(Connected("A", "C", "kind=x"))
        raise AssertionError("the filtered cycle was accepted")
    except RuleViolation as exc:
        assert "no filter on A -> C: it lies on the cycle A - B - D - C - A" in str(exc)
    broken = Topology.of([*base, Connected("A", "C", "kind=x")])
    assert broken.violations() == {("cycle", "A", "C")}
    for harmless in [
        Connected("B", "A"), Connected("D", "C"), Disconnected("A", "C"),
        Filtered("A", "C", "kind=y"), Retired("C"),
    ]:  # fmt: skip
        assert broken.check_change(harmless), harmless
    for worse in [Connected("A", "D", "kind=x"), Connected("B", "C", "kind=z")]:
        try:
            broken.check_change(worse)
            raise AssertionError(f"{worse} was accepted")
        except RuleViolation as exc:
            assert "cycle" in str(exc)
    assert broken.check_change(Connected("A", "B")) is False  # In effect already.
    try:
        broken.check_change(Disconnected("C", "A"))
        raise AssertionError("a disconnection of no connection was accepted")
    except RuleViolation as exc:
        assert "C -> A is not connected" in str(exc)


def joined_records(broker: str, name: str) -> list[dict[str, Any]]:
    """The `joined` records of location `name`'s log, read from its journal."""
    from broker.client import JournalsClient
    from replication.journal_log import scan_records

    async def go() -> list[dict[str, Any]]:
        async with JournalsClient(broker) as client:
            records = await scan_records(lambda: client.stub, f"replication/{name}")
        return [rec for _, _, raw, rec in records if raw is None and rec.get("kind") == "joined"]

    return asyncio.run(go())


def record_straight_into_etcd(etcd_server: EtcdServer, prefix: str, change: Any) -> int:
    """Record `change` in etcd's history as a gazctl does, then tell no location: a gazctl
    SIGKILLed right after its record (or one whose live checks passed before a location
    restarted). Its op."""
    from replication import commands

    async def go() -> int:
        etcd = commands.connect_etcd(etcd_server.endpoint)
        try:
            done = await commands.command(etcd, prefix, lambda view: [change])
            assert [c for _, c in done.recorded] == [change]
            return done.recorded[0][0]
        finally:
            await etcd.close()

    return asyncio.run(go())


def new_events_only(source: str, target: str, dvv: dict[str, int]) -> Any:
    """The change `connect SOURCE TARGET --new-events-only` records, its floor `dvv` (SOURCE's
    DVV as gazctl checked the command)."""
    from replication.topology import Connected

    return Connected(source, target, new_only=True, floor=tuple(sorted(dvv.items())))


def op_records(locations: LocationProcesses, name: str, op: int) -> list[str]:
    """The emitters of the system events in `name`'s log that record op `op`."""
    events = locations.events(name)
    return [e["emitter"] for e in events if e["payload"].get("system", {}).get("op") == op]


def nums(locations: LocationProcesses, name: str) -> list[int]:
    return [e["payload"]["n"] for e in locations.events(name) if "n" in e["payload"]]


def test_new_events_only_joins_where_etcd_catch_up_records_it_though_gazctl_died(
    location_broker: BrokerProcess, locations: LocationProcesses, etcd_server: EtcdServer
) -> None:
    """`connect A D --new-events-only` recorded in etcd, and then its gazctl died: no delivery,
    no join step. A deleted events (B holds them). D records the change from etcd's history and
    joins in the same step, so its connection from A replicates at once (not waiting on DVV-A
    <= CVV-D for events that will never come) and takes A's new events only. A's own record of
    the same op, replicated to D later, does not join again."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "D"))
    for name in "ABD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}', '{"n": 3}')
    until_blocking(lambda: locations.status("B")["cvv"].get("A", 0) >= 4, "B holds A's events")
    locations.ok("delete", "A", "--through", "3")  # A's system event, n 1 and n 2.
    dvv_a = locations.status("A")["dvv"]
    assert dvv_a == {"A": 3}, dvv_a
    op = record_straight_into_etcd(etcd_server, locations.prefix, new_events_only("A", "D", dvv_a))  # fmt: skip
    until_blocking(lambda: connections(locations, "D") == ["A"], "D reads A")
    until_blocking(
        lambda: locations.status("D")["connections"][0]["state"] == "replicating",
        f"D's connection from A replicates ({locations.status('D')['connections']})",
    )
    locations.ok("emit", "A", '{"n": 4}')
    until_blocking(lambda: 4 in nums(locations, "D"), "D holds A's new event")
    # A's events after the floor, those it still holds (n 3, n 4): not those it deleted.
    assert nums(locations, "D") == nums(locations, "A") == [3, 4]
    assert locations.status("D")["dvv"] == dvv_a
    # A's system event for the op (A recorded it too) reaches D by A -> D: no second join.
    until_blocking(lambda: "A" in op_records(locations, "D", op), "D holds A's record of the op")
    assert [r["floor"] for r in joined_records(location_broker.address, "D")] == [dvv_a]
    # The join is in D's log: D's process, started again, folds it back.
    locations.stop("D")
    locations.start("D", location_broker.address)
    assert locations.status("D")["dvv"] == dvv_a
    out = locations.ok("topology", "--check")
    assert "3 locations hold etcd's view" in out, out


def test_new_events_only_joins_where_replication_brings_the_change_first(
    location_broker: BrokerProcess, locations: LocationProcesses, etcd_server: EtcdServer
) -> None:
    """D cannot record etcd's history itself (it restarted and has not heard from C, so it may
    not emit), but B -> D brings B's record of `connect A D --new-events-only`: D joins as that
    record enters its log, and its connection from A takes A's new events only. Once C is back
    and D records etcd's history itself, the op is held already: no second join."""
    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "C", "D"))
    for name in "ABCD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "C")
    locations.ok("connect", "B", "D")
    # gazctl tells B and D of B -> D; A records it from etcd's history when its poll sees the
    # head move. Waited for, so that A's log holds both system events before n 1 to n 3 and the
    # deletion through 3 takes n 1 only (were the emit first, it would take n 1 and n 2 and
    # leave n 3 first: the same DVV, A:3).
    until_blocking(lambda: len(history(locations, "A")) == 2, "A holds etcd's history")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}', '{"n": 3}')
    until_blocking(lambda: locations.status("C")["cvv"].get("A", 0) >= 5, "C holds A's events")
    locations.ok("delete", "A", "--through", "3")
    dvv_a = locations.status("A")["dvv"]
    assert dvv_a == {"A": 3}, dvv_a
    assert nums(locations, "A") == [2, 3], nums(locations, "A")
    until_blocking(lambda: len(history(locations, "D")) == 2, "D holds etcd's history")
    locations.stop("C")
    locations.stop("D")
    locations.start("D", location_broker.address)
    assert locations.status("D")["clock"] != "ok", locations.status("D")  # Not heard from C.
    op = record_straight_into_etcd(etcd_server, locations.prefix, new_events_only("A", "D", dvv_a))  # fmt: skip
    until_blocking(lambda: connections(locations, "D") == ["A", "B"], "D reads A and B")
    # In D's log order: B's record first (replication from B brought it; A's comes by the
    # connection from A, which that record started).
    assert op_records(locations, "D", op)[0] == "B", op_records(locations, "D", op)
    until_blocking(
        lambda: locations.status("D")["connections"][0]["state"] == "replicating",
        f"D's connection from A replicates ({locations.status('D')['connections']})",
    )
    locations.ok("emit", "A", '{"n": 4}')
    until_blocking(lambda: 4 in nums(locations, "D"), "D holds A's new event")
    # A's log: its two system events, then n 1 to n 3; through 3 deleted: n 1 only. D holds
    # every event A holds (its new events, from n 2 on).
    assert nums(locations, "A") == [2, 3, 4], nums(locations, "A")
    assert nums(locations, "D") == nums(locations, "A"), nums(locations, "D")
    assert locations.status("D")["dvv"] == dvv_a
    locations.start("C", location_broker.address)
    until_blocking(lambda: locations.status("D")["clock"] == "ok", "D heard from C")
    until_blocking(
        lambda: locations.gazctl("topology", "--check").code == 0, "every view is etcd's"
    )
    assert [r["floor"] for r in joined_records(location_broker.address, "D")] == [dvv_a]


def test_new_events_only_on_a_connection_made_already_joins_at_once(
    location_broker: BrokerProcess, locations: LocationProcesses, etcd_server: EtcdServer
) -> None:
    """A network of before joins were recorded with the change: its gazctl recorded A -> D and
    died before its join step, so D's connection waits on DVV-A <= CVV-D. The same command,
    repeated, finds the connection made and asks D to join now, as it did then."""
    from replication.topology import Connected

    asyncio.run(apply_location_journals(location_broker.address, "A", "B", "D"))
    for name in "ABD":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}', '{"n": 3}')
    until_blocking(lambda: locations.status("B")["cvv"].get("A", 0) >= 4, "B holds A's events")
    locations.ok("delete", "A", "--through", "3")
    record_straight_into_etcd(etcd_server, locations.prefix, Connected("A", "D"))
    until_blocking(lambda: connections(locations, "D") == ["A"], "D reads A")
    until_blocking(
        lambda: locations.status("D")["connections"][0]["state"].startswith("waiting: DVV-A"),
        "D's connection from A waits",
    )
    out = locations.ok("connect", "A", "D", "--new-events-only")
    assert "A -> D: connected already" in out and "D: joined for new events" in out, out
    locations.ok("emit", "A", '{"n": 4}')
    until_blocking(lambda: 4 in nums(locations, "D"), "D holds A's new event")
    assert nums(locations, "D") == nums(locations, "A") == [3, 4]
