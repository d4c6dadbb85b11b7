"""Topology changes as system events: recorded where they are made, replicated with the rest
(filters never drop them), folded by every location into the same view of the network's history;
the rules then judge a change against that view."""

from __future__ import annotations

import itertools

import pytest

from replication.location import Event, Location, replicate
from replication.system import change_of, passes, system_payload, topology_of
from replication.topology import Connected, Disconnected, Filtered, Retired, RuleViolation
from replication.vclock import VectorClock


def test_payloads_round_trip_and_bad_ones_are_refused() -> None:
    for change in (
        Connected("A", "B", "x=1"),
        Disconnected("A", "B"),
        Filtered("A", "B", ""),
        Retired("C"),
    ):
        event = Event("A", VectorClock({"A": 1}), system_payload(change))
        assert change_of(event) == change
    with pytest.raises(ValueError, match=r"system event \('A', 1\): not a topology change"):
        change_of(Event("A", VectorClock({"A": 1}), {"system": {"type": "teleported"}}))


def test_every_location_builds_the_same_view_of_the_history() -> None:
    loc = {n: Location(n) for n in "ABCD"}

    def connect(source: str, target: str, filter: str = "") -> None:
        # Judged against the view of the location making the change, then recorded there.
        view = topology_of(s.event for s in loc[target].log)
        view.check_connect(source, target, filter)
        loc[target].emit(system_payload(Connected(source, target, filter)))

    def sync(filters: dict[tuple[str, str], object] | None = None) -> None:
        for _ in range(3):
            for s, t in itertools.permutations("ABCD", 2):
                if (s, t) in links:
                    replicate(loc[s], loc[t], passes((filters or {}).get((s, t))))  # type: ignore[arg-type]

    links = {("A", "B"), ("B", "A"), ("B", "C"), ("C", "B"), ("C", "D"), ("D", "C")}
    for s, t in sorted(links):
        connect(s, t)
    loc["A"].emit({"n": 1})
    only_red = lambda e: e.payload.get("colour") == "red"  # noqa: E731
    sync({("C", "D"): only_red})  # D's filter drops A's event, never a system event.
    views = {n: topology_of(s.event for s in loc[n].log) for n in "ABCD"}
    assert all(v.current == views["A"].current for v in views.values())
    assert not any("n" in s.event.payload for s in loc["D"].log)

    # Closing the cycle A - B - C through C - A is fine; then a filter on it is refused
    # everywhere, by the same view.
    connect("C", "A")
    connect("A", "C")
    links |= {("C", "A"), ("A", "C")}
    sync()
    for n in "ABCD":
        with pytest.raises(RuleViolation, match="no filter on A -> B: it lies on the cycle"):
            topology_of(s.event for s in loc[n].log).check_filter("A", "B")
