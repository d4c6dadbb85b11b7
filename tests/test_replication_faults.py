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
