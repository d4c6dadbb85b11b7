"""The replication scenarios of the fault campaign, briefly (`nox -s faults` runs them whole): a
network of four locations on broker clusters of their own, run by location hosts on loopback,
one cycle of a location fault and the checker's verdict; and the replication checker's own
tests, which feed it hand-made histories breaking each property (a checker that finds nothing
proves nothing)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from tests.faults.replication_checker import (
    FAIL,
    INFO,
    OK,
    Disaster,
    Emit,
    ReplicationHistory,
    check,
)
from tests.faults.replication_scenarios import REPLICATION_SCENARIOS, run_replication_scenario


@pytest.mark.slow
async def test_a_short_replication_fault_scenario_keeps_every_promise(tmp_path: Path) -> None:
    seed = int(os.environ.get("GAZETTE_FAULT_SEED") or secrets.randbelow(1 << 31))
    history, report, _ = await run_replication_scenario(
        REPLICATION_SCENARIOS["location-kill"], seed, tmp_path, cycles=1, namespaces=False,
        say=lambda _: None,
    )  # fmt: skip
    replay = f"python -m tests.faults --scenario location-kill --seed {seed} --loopback"
    assert report.ok, f"{report.summary()}\nreplay: {replay}"
    assert history.cycles == 1, history.notes
    assert report.acked > 0 and report.events_checked > report.acked
    assert set(history.logs) == set("ABCD") and history.topology_check["code"] == 0


# ---- the checker, on hand-made histories -------------------------------------------------------


def event(emitter: str, ts: dict[str, int], uid: str, kind: str = "red") -> dict[str, Any]:
    return {"kind": "event", "emitter": emitter, "ts": ts, "payload": {"kind": kind, "id": uid}}


def emitted(location: str, time: int, uid: str, kind: str = "red", at: float = 1.0) -> Emit:
    return Emit(location, uid, kind, at - 0.1, at, OK, location, time)


VIEW = [{"connected": {"source": "A", "target": "B"}}]


def clean() -> ReplicationHistory:
    """A emits a1 (red) and a2 (blue, after a1); B emits b1 having seen a1. D admits red only:
    it holds a1 and b1 (red), not a2."""
    a1 = event("A", {"A": 1}, "a1")
    a2 = event("A", {"A": 2}, "a2", "blue")
    b1 = event("B", {"A": 1, "B": 1}, "b1")
    history = ReplicationHistory("synthetic", 1, locations=["A", "B", "D"], admits={"D": ["red"]})
    history.emits = [
        emitted("A", 1, "a1"), emitted("A", 2, "a2", "blue", 2.0), emitted("B", 1, "b1", at=3.0),
    ]  # fmt: skip
    history.logs = {"A": [a1, a2, b1], "B": [a1, b1, a2], "D": [a1, b1]}
    history.views = {n: list(VIEW) for n in "ABD"}
    history.topology_check = {"code": 0, "out": ""}
    history.healed = 0.5
    return history


def kinds(history: ReplicationHistory) -> set[str]:
    return {kind for kind, _ in check(history).counts}


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.ok, report.summary()
    assert report.acked == 3 and report.events_checked == 8


def test_an_event_stored_twice() -> None:
    history = clean()
    history.logs["B"].insert(1, history.logs["B"][0])  # Right after itself, as a retried append.
    report = check(history)
    assert report.duplicates == 1 and kinds(history) == {"duplicate"}, report.summary()


def test_an_event_stored_before_its_cause() -> None:
    history = clean()
    a1, a2, b1 = history.logs["A"]
    history.logs["A"] = [b1, a1, a2]  # b1 has seen a1.
    report = check(history)
    assert report.order_violations == 1 and kinds(history) == {"order"}, report.summary()
    # Concurrent events may come in any order: a2 and b1 swapped is fine.
    history.logs["A"] = [a1, b1, a2]
    assert check(history).ok


def test_a_missing_event() -> None:
    history = clean()
    history.logs["D"].pop()  # b1 is red: D must hold it.
    report = check(history)
    assert report.missing == 1 and kinds(history) == {"missing"}, report.summary()
    # An acknowledged event stored nowhere is missing everywhere.
    history = clean()
    history.emits.append(emitted("B", 2, "b2", at=4.0))
    assert check(history).missing == 3


def test_an_event_the_filter_drops_is_not_required_nor_allowed() -> None:
    history = clean()
    history.logs["D"].append(history.logs["A"][1])  # a2 is blue.
    assert kinds(history) == {"not-admitted"}


def test_a_reused_time() -> None:
    history = clean()
    # B's time 1 stored with another payload at D.
    history.logs["D"][1] = event("B", {"A": 1, "B": 1}, "b9")
    history.emits.append(Emit("B", "b9", "red", 3.5, 3.6, INFO))
    report = check(history)
    assert report.reused_times >= 1 and "reused-time" in kinds(history), report.summary()
    # Two acknowledgements of one id.
    history = clean()
    history.emits.append(emitted("A", 2, "a3", at=5.0))
    assert "reused-time" in kinds(history)


def test_an_event_nobody_emitted_or_that_was_refused() -> None:
    history = clean()
    stray = event("A", {"A": 3}, "zz")
    for name in "ABD":
        history.logs[name].append(stray)
    assert kinds(history) == {"unexpected"}
    history.emits.append(Emit("A", "zz", "red", 6.0, 6.1, FAIL, error="FAILED_PRECONDITION"))
    assert kinds(history) == {"refused-present"}


def test_views_that_differ_and_a_failed_topology_check() -> None:
    history = clean()
    history.views["D"] = []
    assert kinds(history) == {"views"}
    history = clean()
    history.topology_check = {"code": 1, "out": "the views differ"}
    assert kinds(history) == {"views"}


def test_a_view_that_differs_from_etcds_history() -> None:
    history = clean()
    history.etcd_history = list(VIEW)
    assert check(history).ok
    history.etcd_history = [*VIEW, {"type": "disconnected", "source": "A", "target": "B", "key": [99, 0, "", 0]}]  # fmt: skip
    assert kinds(history) == {"views"}
    # A `--new-events-only` connection: Status does not report its fields (seen in seed 4 of
    # operator-commands), only etcd's history holds them.
    joined = {"type": "connected", "source": "B", "target": "A", "filter": ""}
    for name in "ABD":
        history.views[name] = [*VIEW, joined | {"key": [7, 0, "", 0]}]
    history.etcd_history = [*VIEW, joined | {"new_events_only": True, "floor": {}, "key": [7, 0, "", 0]}]  # fmt: skip
    assert check(history).ok, check(history).summary()


def test_a_refused_command_that_moved_etcds_head_or_a_forbidden_one_accepted() -> None:
    history = clean()
    forbidden = {"type": "connected", "source": "A", "target": "D", "filter": ""}
    history.commands = [
        {"args": ["connect", "A", "B"], "code": 0, "out": "", "forbidden": None, "head_before": 3, "head_after": 4},
        {"args": ["connect", "A", "D"], "code": 1, "out": "", "forbidden": forbidden, "head_before": 4, "head_after": 4},
    ]  # fmt: skip
    assert check(history).ok
    history.commands[1]["head_after"] = 5
    assert kinds(history) == {"refused-changed"}
    history.commands[1] |= {"head_after": 4, "code": 0}
    assert kinds(history) == {"forbidden-accepted"}
    history.commands[1]["code"] = 1
    history.views["D"] = [*VIEW, forbidden | {"key": [5, 0, "", 0]}]
    assert "forbidden-accepted" in kinds(history)


def test_a_forbidden_command_whose_gazctl_was_killed_is_judged_by_what_was_recorded() -> None:
    """gazctl SIGKILLed mid-command has no answer (exit -9, seen in operator-commands, seed
    2929): the command was refused or never decided, and only a record of its change would
    break the rules."""
    history = clean()
    forbidden = {"type": "filtered", "source": "B", "target": "C", "filter": "kind=red"}
    history.commands = [
        {"args": ["connect", "B", "C", "--filter", "kind=red"], "code": -9, "out": "", "forbidden": forbidden, "head_before": 4, "head_after": 4, "killed": True},
    ]  # fmt: skip
    assert check(history).ok, check(history).summary()
    history.etcd_history = [*history.etcd_history, forbidden | {"key": [5, 0, "", 0]}]
    assert "forbidden-accepted" in kinds(history)


def test_a_location_that_takes_no_emit_after_healing() -> None:
    history = clean()
    history.healed = 2.5  # A's last acknowledged emit was invoked before.
    assert ("unavailable-after-heal", "A") in check(history).counts


def test_a_disaster_forgives_only_the_events_it_lost_at_once() -> None:
    history = clean()
    # A emitted a3 at 9.8 s, acknowledged; its journal was deleted at 10 s before anyone read it.
    history.emits.append(emitted("A", 3, "a3", at=9.8))
    history.disasters.append(Disaster("A", 10.0, 12.0))
    report = check(history)
    assert report.ok and report.lost_to_disaster == 1, report.summary()
    # After recovery, A's clock was not past time 3 (nobody saw it): reusing it is allowed.
    a3 = event("A", {"A": 3}, "a4")
    for name in "ABD":
        history.logs[name].append(a3)
    history.emits.append(emitted("A", 3, "a4", at=13.0))
    report = check(history)
    assert report.ok and report.reused_after_loss == 1, report.summary()
    # An event acknowledged long before the disaster must have been replicated.
    history = clean()
    history.emits.append(emitted("A", 3, "a3", at=2.0))
    history.disasters.append(Disaster("A", 10.0, 12.0))
    assert check(history).missing == 3


def test_a_history_survives_json(tmp_path: Path) -> None:
    history = clean()
    history.disasters.append(Disaster("A", 10.0, 12.0))
    history.save(tmp_path / "h.json")
    again = ReplicationHistory.load(tmp_path / "h.json")
    assert again.emits == history.emits and again.logs == history.logs
    assert check(again).summary() == check(history).summary()


# ---- deletions ---------------------------------------------------------------------------------


def deletion(
    history: ReplicationHistory, code: int, out: str = "", *, through: int = 2, **more: Any
) -> dict[str, Any]:
    """`delete A --through N` as the scenario records it: A held a1 and a2 through N=2 (its
    DVV then {A: 2}), its neighbour B's CVV {A: 2, B: 1} before and after; `more` overrides."""
    record = {
        "location": "A", "through": through, "mode": "allowed", "neighbours": ["B"],
        "before": {"deleted_through": 0, "dvv": {}}, "dvv": {"A": 2},
        "cvv_before": {"B": {"A": 2, "B": 1}}, "events": history.logs["A"][:2],
        "after": {"deleted_through": through if code == 0 else 0, "dvv": {"A": 2} if code == 0 else {}},
        "cvv_after": {"B": {"A": 2, "B": 1}},
    } | more  # fmt: skip
    history.commands.append({"args": ["delete", "A", "--through", str(through)], "code": code, "out": out, "forbidden": None, "head_before": 3, "head_after": 3, "killed": code == -9, "delete": record})  # fmt: skip
    return record


RULE = "A may not delete through 2: its DVV would be {A: 2}, not <= CVV-B {A: 1} (replicate to B first)"  # fmt: skip


def test_a_refused_deletion_that_removed_events_is_flagged() -> None:
    history = clean()
    deletion(history, 1, RULE, cvv_before={"B": {"A": 1}})
    assert check(history).ok, check(history).summary()  # Refused, and A still holds a1, a2.
    history.logs["A"] = history.logs["A"][2:]  # Yet they are gone.
    report = check(history)
    assert kinds(history) == {"refused-changed", "missing"}, report.summary()
    assert report.missing == 2  # a1 and a2 at A: a refusal takes nothing off what A holds.
    # Its deletion state moved, though it said no.
    history = clean()
    deletion(history, 1, RULE, cvv_before={"B": {"A": 1}}, after={"deleted_through": 2, "dvv": {"A": 2}})  # fmt: skip
    assert kinds(history) == {"refused-changed"}


def test_an_accepted_deletion_takes_its_events_off_what_the_location_must_hold_only() -> None:
    history = clean()
    deletion(history, 0, "A: deleted through 2, DVV {A: 2}")
    history.logs["A"] = history.logs["A"][2:]
    assert check(history).ok, check(history).summary()
    # B and D must still hold what A deleted (a1 red, a2 blue: D admits a1 only).
    history.logs["D"].remove(history.logs["B"][0])
    history.logs["B"].pop()  # a2
    report = check(history)
    assert report.missing == 2 and {v.location for v in report.violations} == {"B", "D"}
    # An event A alone held, deleted: still required where it must arrive.
    history = clean()
    a3 = event("A", {"A": 3}, "a3", "blue")
    history.emits.append(Emit("A", "a3", "blue", 4.0, 4.5, INFO))
    deletion(history, 0, through=3, events=[*history.logs["A"], a3], dvv={"A": 3}, cvv_after={"B": {"A": 3, "B": 1}})  # fmt: skip
    history.logs["A"] = []
    report = check(history)
    assert report.missing == 1 and report.violations[0].location == "B", report.summary()
    # Nothing but what it deleted may go: A must still hold b1.
    history = clean()
    deletion(history, 0)
    history.logs["A"] = []
    assert kinds(history) == {"missing"} and check(history).missing == 1


def test_an_accepted_deletion_that_broke_the_rule_or_came_back() -> None:
    history = clean()
    deletion(history, 0, cvv_after={"B": {"A": 1, "B": 1}})  # B had not seen a2, even after.
    history.logs["A"] = history.logs["A"][2:]
    assert kinds(history) == {"delete-rule"}
    history = clean()
    deletion(history, 0)  # Accepted, yet a1 and a2 are read from A at the end.
    assert kinds(history) == {"deleted-back"}
    history = clean()
    deletion(history, 0, after={"deleted_through": 1, "dvv": {"A": 1}})
    history.logs["A"] = history.logs["A"][2:]
    assert kinds(history) == {"delete-unapplied"}


def test_a_deletion_of_unknown_outcome_is_whole_or_not_at_all() -> None:
    for out in ["", "location A is unreachable (UNAVAILABLE): failed to connect to all addresses"]:
        history = clean()
        deletion(history, -9 if not out else 1, out, after=None)
        assert check(history).ok  # Not done.
        a1, _, b1 = history.logs["A"]
        history.logs["A"] = [b1]
        assert check(history).ok  # Done.
        history.logs["A"] = [a1, b1]  # a1 kept, a2 gone.
        assert kinds(history) == {"delete-partial"}, check(history).summary()


def test_a_refusal_for_an_unreachable_neighbour_is_certain() -> None:
    from tests.faults.replication_checker import delete_outcome

    said = "location A is unreachable (UNAVAILABLE): location B is unreachable (UNAVAILABLE): x"
    assert delete_outcome({"code": 1, "out": said, "location": "A"}) == "refused"
    history = clean()
    deletion(history, 1, said)
    history.logs["A"] = history.logs["A"][2:]
    assert "refused-changed" in kinds(history)


def test_a_deletion_the_neighbours_cvvs_allowed_is_not_refused_by_the_rule() -> None:
    history = clean()
    deletion(history, 1, RULE.replace("{A: 1}", "{A: 2, B: 1}"))  # B's CVV covered {A: 2}.
    assert kinds(history) == {"allowed-refused"}
