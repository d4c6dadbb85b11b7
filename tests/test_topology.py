"""The topology history and its rules: cycles of the projected history (checked against brute
force on generated histories), the seed's examples of where filters are allowed, a connection
filtered once counting as filtered for good, and retired locations leaving the topology."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replication.topology import (
    Connected,
    Disconnected,
    FailedOver,
    Filtered,
    Retired,
    RuleViolation,
    Topology,
)

LOCATIONS = "ABCDEF"


def both(a: str, b: str, filter: str = "") -> list[Connected]:
    return [Connected(a, b, filter), Connected(b, a)]


def on_cycle_brute(links: set[tuple[str, str]], a: str, b: str) -> bool:
    """Whether a simple cycle of 3+ locations contains the link a-b: try every path."""
    others = sorted({x for link in links for x in link} - {a, b})
    for n in range(1, len(others) + 1):
        for path in itertools.permutations(others, n):
            walk = [b, *path, a]
            if all(tuple(sorted(step)) in links for step in itertools.pairwise(walk)):
                return True
    return False


@given(
    st.lists(
        st.tuples(st.sampled_from(LOCATIONS), st.sampled_from(LOCATIONS), st.booleans()),
        max_size=12,
    )
)
def test_cycles_of_the_projected_history_match_brute_force(
    changes: list[tuple[str, str, bool]],
) -> None:
    history: list[Connected | Disconnected] = []
    for a, b, keep in changes:
        if a != b:
            history.append(Connected(a, b))
            if not keep:
                history.append(Disconnected(a, b))  # Gone now, but in the history for good.
    view = Topology.of(history)
    links = view.links()
    for a, b in links:
        assert (view.cycle_through(a, b) is not None) == on_cycle_brute(links, a, b), (a, b)


def test_the_seeds_examples_of_where_filters_are_allowed() -> None:
    # A - B - C a cycle, D attached to C, E attached to B.
    view = Topology.of(
        [*both("A", "B"), *both("B", "C"), *both("C", "A"), *both("C", "D"), *both("B", "E")]
    )
    view.check_filter("C", "D")
    view.check_filter("B", "E")
    with pytest.raises(RuleViolation, match="no filter on A -> B: it lies on the cycle"):
        view.check_filter("A", "B")
    # E replaced by a cycle XYZ: B - X still allowed, X - Y not (a cycle) ...
    for a, b in (("B", "X"), ("X", "Y"), ("Y", "Z"), ("Z", "X")):
        view.apply(Connected(a, b))
    view.check_filter("B", "X")
    with pytest.raises(RuleViolation, match="cycle"):
        view.check_filter("X", "Y")
    # ... and removing Y - Z now does not help: the history remembers it.
    view.apply(Disconnected("Y", "Z"))
    with pytest.raises(RuleViolation, match="cycle"):
        view.check_filter("X", "Y")


def test_a_history_made_cyclic_over_time_and_filters_kept_for_good() -> None:
    # t1: A - B - C; t2: A - C - B. Projected: the cycle ABC, although never at one time.
    view = Topology.of([*both("A", "B"), *both("B", "C")])
    view.check_connect("C", "A")
    for change in (Disconnected("A", "B"), Disconnected("B", "A"), *both("C", "A")):
        view.apply(change)
    assert view.cycle_through("A", "B") == ["A", "C", "B"]
    with pytest.raises(RuleViolation, match="no filter on A -> B"):
        view.check_connect("A", "B", filter="type=x")

    # D filtered from A; then the filter removed: D - A still counts as filtered.
    view.apply(Connected("A", "D", "type=x"))
    view.apply(Filtered("A", "D", ""))
    with pytest.raises(RuleViolation, match=r"would close the cycle .* through A -> D, which is"):
        view.check_connect("B", "D")


def test_retired_locations_leave_the_topology() -> None:
    view = Topology.of([*both("A", "B"), *both("B", "C"), *both("C", "A"), *both("C", "D")])
    with pytest.raises(RuleViolation):
        view.check_filter("A", "B")
    view.apply(Retired("C"))
    view.check_filter("A", "B")  # Without C, no cycle.
    assert ("C", "D") not in view.current
    with pytest.raises(RuleViolation, match="location C is retired"):
        view.check_connect("C", "A")
    with pytest.raises(RuleViolation, match="does not replicate to itself"):
        view.check_connect("A", "A")


def abc() -> list[Connected]:
    return [*both("A", "B"), *both("B", "C"), *both("C", "A")]


def test_redundant_filtered_connections_into_an_unfiltered_cycle() -> None:
    """D joins the cycle ABC by filtered connections to A and B (and C): a cycle ABD with
    filters, allowed because they are redundant: the same filter from D into ABC, the same from
    ABC into D. A different filter, a filter inside ABC, or an unfiltered link that makes D part
    of the cycle is refused."""
    view = Topology.of([*abc(), Connected("D", "A", "kind=x"), Connected("A", "D", "kind=y")])
    view.check_connect("D", "B", "kind=x")
    view.apply(Connected("D", "B", "kind=x"))
    view.check_connect("B", "D", "kind=y")
    view.apply(Connected("B", "D", "kind=y"))
    view.validate()
    assert view.group_of("A") == {"A", "B", "C"} and view.group_of("D") == {"D"}
    with pytest.raises(RuleViolation, match=r"D -> C must filter as D -> A does \('kind=x'\)"):
        view.check_connect("D", "C", "kind=z")
    with pytest.raises(RuleViolation, match=r"D -> C would close the cycle .* through A -> D"):
        view.check_connect("D", "C")  # Unfiltered, it makes D part of the cycle.
    with pytest.raises(RuleViolation, match="no filter on A -> B: it lies on the cycle"):
        view.check_filter("A", "B")
    view.check_connect("C", "E")
    view.apply(Connected("C", "E"))  # E joins the group ABC ...
    with pytest.raises(RuleViolation, match=r"E -> D would close the cycle .* \(or was\)"):
        view.check_connect("E", "D")  # ... and E - D unfiltered would put D - A in a cycle.


def test_a_composite_location_joined_to_another_by_redundant_connections() -> None:
    """The seed's two data centres: the unfiltered cycle DEF joined to ABC by D - A and E - B,
    the same filter each way; a third group joined to both by filters would close a cycle of
    groups, refused."""
    def_ = [*both("D", "E"), *both("E", "F"), *both("F", "D")]
    links = [Connected("D", "A", "app=1"), Connected("A", "D", "app=2"),
             Connected("E", "B", "app=1"), Connected("B", "E", "app=2")]  # fmt: skip
    view = Topology.of([*abc(), *def_])
    for change in links:
        view.check_connect(change.source, change.target, change.filter)
        view.apply(change)
    view.validate()
    assert view.group_of("E") == {"D", "E", "F"}
    with pytest.raises(RuleViolation, match="E -> B must filter as"):
        view.check_filter("E", "B", "app=3")
    view.apply(Connected("G", "A", "g"))
    with pytest.raises(RuleViolation, match="cycle of filtered connections across"):
        view.check_connect("G", "F", "g")


def test_a_connection_failed_over_leaves_the_projected_history() -> None:
    """A and B joined by a filtered connection (two groups); D filtered from A. Connecting D
    from B as well would make a cycle of groups (A - B - D), refused; failing D over from A to
    B is not: the old connection is not projected any more, as the seed's fail-over says."""
    view = Topology.of([Connected("A", "B", "x=1"), Connected("A", "D", "x=2")])
    with pytest.raises(RuleViolation, match="cycle of filtered connections"):
        view.check_connect("B", "D", "x=2")
    view.check_fail_over("A", "B", "D", "x=2")
    view.apply(FailedOver("A", "B", "D", "x=2"))
    assert view.current == {("A", "B"): "x=1", ("B", "D"): "x=2"}
    assert view.links() == {("A", "B"), ("B", "D")}
    view.validate()
    view.apply(Connected("C", "E"))
    with pytest.raises(RuleViolation, match="C -> E is not a filtered connection"):
        view.check_fail_over("C", "A", "E", "")  # Only a filtered connection fails over.
    with pytest.raises(RuleViolation, match="C -> D is not a filtered connection"):
        view.check_fail_over("C", "A", "D", "x=2")  # Nor one that does not exist.


def test_redundant_connections_filter_alike_over_the_history() -> None:
    """D -> B filtered `kind=two` ran, then was disconnected: its events are in ABC still. D -> A
    filtered `kind=one` would be redundant with it over the history (an event that went
    D -> B -> A makes A's causality filter drop an earlier one that passes `kind=one`), so it
    must filter as D -> B did; with the same filter it is accepted."""
    view = Topology.of([*abc(), Connected("D", "B", "kind=two"), Disconnected("D", "B")])
    with pytest.raises(RuleViolation, match=r"D -> A must filter as D -> B did \('kind=two'\)"):
        view.check_connect("D", "A", "kind=one")
    view.check_connect("D", "A", "kind=two")
    # One connection alone between two groups may change its filter: nothing is redundant.
    single = Topology.of([*abc(), Connected("D", "B", "kind=two")])
    single.check_filter("D", "B", "kind=three")


def test_every_connection_into_a_group_from_outside_it_is_guarded() -> None:
    """A -> D and B -> D filtered, D -> A and D -> B not: D is a group of its own, and events
    from D into ABC carry ABC's parts (A's e2 passed A -> D's filter, its cause e1 did not). The
    group write guard holds for D -> A and D -> B although they have no filter; inside a group,
    nothing is guarded."""
    view = Topology.of(
        [*abc(), Connected("A", "D", "k=x"), Connected("B", "D", "k=x"),
         Connected("D", "A"), Connected("D", "B")]
    )  # fmt: skip
    view.validate()
    assert view.guard_for("D", "B") == {"A", "B", "C"} == view.guard_for("D", "A")
    assert view.guard_for("A", "B") == frozenset() and view.guard_for("A", "D") == frozenset()
