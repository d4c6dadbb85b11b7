"""The bounded exhaustive check of the replication rules (`replication.modelcheck`) at a small
bound: no violation with every rule in place; and, for each rule left out, the checker finds the
anomaly the rule exists for, with the shortest trace to it (a checker that finds nothing when a
rule is removed would prove nothing). The larger bound runs in `nox -s modelcheck`."""

from __future__ import annotations

import pytest

from replication.modelcheck import Bound, Checker, Report, Rules, Violation, main

SMALL = Bound(locations=3, events=2, filters=1, changes=1)


def first(report: Report) -> Violation:
    assert report.violations, "\n".join(report.lines())
    return report.violations[0]


def test_every_interleaving_at_a_small_bound_keeps_every_promise() -> None:
    report = Checker(Bound(3, 2, 1, 1, deletions=1)).run()
    assert report.violation_states == 0, "\n\n".join(map(str, report.violations))
    assert report.complete
    # The figures of this bound (deterministic: the exploration does not depend on hashing
    # order); a change in the model or the checker that shrinks the space shows here.
    assert report.states > 10_000
    assert report.quiescent > 1_000
    assert report.histories > 5  # The start network and connections, filters, disconnections.
    assert report.refused > 1_000  # The rules refuse changes and deletions along the way.
    assert report.held > 0  # The start rule holds connections after deletions.


# Fail-over needs a terminal location that only receives (else the fail-over closes a cycle
# through its filtered link); crashes between a write and its progress are left to the others.
FAIL_OVER = Bound(3, 2, 1, 1, fail_over=True, crashes=False, topology="ring-in")


def test_fail_over_at_a_small_bound_keeps_every_promise() -> None:
    report = Checker(FAIL_OVER).run()
    assert report.violation_states == 0, "\n\n".join(map(str, report.violations))
    assert report.states > 5_000


def test_without_the_topology_rules_a_filtered_cycle_loses_an_event() -> None:
    """The seed's first anomaly: an unfiltered connection A -> C closes the cycle A - B - C
    through the filtered B -> C; an event of B's that C got over the filter carries A's event
    into C's causal past, and C drops it when it comes over A -> C."""
    found = first(Checker(SMALL, Rules.without("topology"), stop_at_first=True).run())
    assert found.kind == "lost"
    assert any(step.startswith("connect A->C ''") for step in found.trace)  # Refused, with
    # the rules.
    assert any(step.startswith("B->C: writes") for step in found.trace)
    assert "C never stored it" in found.message


def test_without_the_guard_a_redundant_filtered_connection_loses_an_event() -> None:
    """Redundant filtered connections (B -> C and A -> C, one filter, into the terminal C),
    and C -> B out of it: without the group write guard, an event that passed the filter goes
    back into the group ahead of its cause, which the filter held back."""
    found = first(Checker(SMALL, Rules.without("guard"), stop_at_first=True).run())
    assert found.kind == "lost"
    # Accepted with the rules too: redundant with B -> C, one filter.
    assert any(step.startswith("connect A->C 'kind=two'") for step in found.trace)
    assert any(step.startswith("C->B: writes") for step in found.trace)


def test_without_the_start_rule_a_new_connection_loses_deleted_events() -> None:
    """The location-addition anomaly: A deletes an event B has, a new connection A -> C
    replicates at once what A kept, and then the deleted event, coming from B, is in C's
    causal past."""
    bound = Bound(3, 2, 1, 1, deletions=1)
    found = first(Checker(bound, Rules.without("start"), stop_at_first=True).run())
    assert found.kind == "lost"
    steps = " / ".join(found.trace)
    assert "A deletes through seq 1" in steps and "connect A->C" in steps
    assert steps.index("deletes") < steps.index("connect A->C")


def test_without_the_deletion_rule_a_neighbour_waits_for_deleted_events_for_good() -> None:
    """Deleting what a directly connected location has not read: the start rule (which the
    location process applies to every connection behind the source's deletions) then holds the
    connection back for good, so no event is lost to the causality filter, but the deleted
    ones never arrive."""
    bound = Bound(3, 2, 1, 0, deletions=1, topology="cycle")
    found = first(Checker(bound, Rules.without("deletion"), stop_at_first=True).run())
    assert found.kind == "held"
    assert any("deletes" in step for step in found.trace)


def test_without_the_deletion_and_start_rules_the_cyclic_deletion_anomaly_appears() -> None:
    bound = Bound(3, 2, 1, 0, deletions=1, topology="cycle")
    rules = Rules.without("deletion", "start")
    found = first(Checker(bound, rules, stop_at_first=True).run())
    assert found.kind == "lost"
    assert any("deletes" in step for step in found.trace)


def test_without_the_fail_over_rule_nothing_is_found_at_this_bound() -> None:
    """The cached-CVV rule of fail-over guards against losses like the filtered cycle's; here
    the terminal location only receives, so nothing it stores flows back into the cycle, and
    the checker finds no anomaly without the rule: the rule is not shown necessary by this
    model (a limit of the check, written down rather than hidden)."""
    report = Checker(FAIL_OVER, Rules.without("fail-over")).run()
    assert report.violation_states == 0


NO_CRASHES = Bound(3, 2, 1, 1, crashes=False)


@pytest.mark.parametrize(
    ("bound", "rules"),
    [
        (NO_CRASHES, Rules()),
        (NO_CRASHES, Rules.without("guard")),
        (Bound(3, 2, 1, 0, deletions=1), Rules()),
        (Bound(3, 1, 1, 1, fail_over=True, topology="ring-in"), Rules()),
    ],
    ids=["rules", "no-guard", "deletion", "fail-over"],
)
def test_the_reduction_reaches_the_same_states_at_rest(bound: Bound, rules: Rules) -> None:
    """`Checker.settle` takes progress-only steps at once: with and without it, the same
    quiescent states (less their progress) are reached, and the same violations found. (The
    bounds are the small ones whose full graphs take a second or two: crashes between a
    write and its progress multiply the full graph's states.)"""
    reduced = Checker(bound, rules, collect=True)
    full = Checker(bound, rules, collect=True, reduce=False)
    a, b = reduced.run(), full.run()
    assert reduced.at_rest == full.at_rest and reduced.at_rest
    assert b.states > 2 * a.states  # It does reduce.
    assert bool(a.violation_states) == bool(b.violation_states) == (rules != Rules())
    assert {v.kind for v in a.violations} == {v.kind for v in b.violations} <= {"lost"}


def test_the_command_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--locations", "2", "--events", "2", "--filters", "1", "--changes", "1"]) == 0
    out = capsys.readouterr().out
    for figure in ("states explored:", "transitions:", "max depth:", "elapsed:", "violations: 0"):
        assert figure in out
    assert main(["--locations", "3", "--events", "2", "--filters", "1", "--changes", "1",
                 "--without", "guard", "--show", "1"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "violations: 0" not in out and "\nlost: " in out and "\n  1. A emits" in out
