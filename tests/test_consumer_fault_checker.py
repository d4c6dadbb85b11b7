"""The consumer campaign's checker, on hand-made histories: a clean one passes, and each broken
promise (a sum off by a chunk applied twice, a stream summed twice, a sum missing, a sum of a
stream never completed, a zombie's commit after its successor's, a shard left FAILED, a chunk out
of sequence) is caught; a FAILED shard is excused only with a reason and a fault of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.consumer_checker import (
    FAIL,
    OK,
    ChunkOp,
    ConsumerHistory,
    FaultRecord,
    ShardStatus,
    SumRead,
    check,
)


def chunk(stream: str, seq: int, value: int, last: bool, at: float) -> ChunkOp:
    return ChunkOp(stream, seq, value, last, "c/0", at, at + 0.01, OK, offset=int(at * 100))


def clean() -> ConsumerHistory:
    """Two streams of three chunks on shard s-0, summed once each by instances of fences 1
    then 2 (a take-over between them); a third stream still in progress, never summed."""
    h = ConsumerHistory(scenario="hand-made", seed=1, store="json", cycles=1, healed=10.0)
    for i, (stream, values) in enumerate([("a", [1, 2, 3]), ("b", [10, -20, 30])]):
        for seq, value in enumerate(values, 1):
            h.chunks.append(chunk(stream, seq, value, seq == 3, 1.0 + i + seq / 10))
    h.chunks.append(chunk("c", 1, 5, False, 3.0))
    h.sums.append(SumRead("a", 6, 3, "s-0", 1, 1.0, 100, 0, 0))
    h.sums.append(SumRead("b", 20, 3, "s-0", 2, 5.0, 200, 300, 1))
    h.faults.append(FaultRecord("SIGKILL", "summer-0", 4.0, 4.5))
    h.statuses.append(ShardStatus("s-0", "summer-1", "PRIMARY", [], 12.0))
    return h


def kinds(h: ConsumerHistory) -> list[str]:
    return [v.kind for v in check(h).violations]


def test_a_clean_history_passes_and_is_counted() -> None:
    report = check(clean())
    assert report.ok, report.summary()
    assert (report.streams, report.exact, report.sums, report.chunks) == (2, 2, 2, 7)


def test_a_chunk_applied_twice_is_a_wrong_sum() -> None:
    h = clean()
    h.sums[0].sum = 8  # Chunk 2 counted twice.
    assert kinds(h) == ["wrong-sum"]


def test_a_sum_over_another_number_of_chunks_is_wrong() -> None:
    h = clean()
    h.sums[0].chunks = 4
    assert kinds(h) == ["wrong-sum"]


def test_a_stream_summed_twice_is_a_duplicate() -> None:
    h = clean()
    h.sums.append(SumRead("a", 6, 3, "s-0", 2, 5.0, 200, 400, 2))
    assert kinds(h) == ["duplicate-sum"]


def test_an_acknowledged_stream_without_a_sum_is_missing() -> None:
    h = clean()
    del h.sums[1]
    assert kinds(h) == ["missing-sum"]


def test_a_stream_with_a_chunk_in_doubt_is_not_required_to_be_summed() -> None:
    h = clean()
    h.chunks[1].outcome, h.chunks[1].offset = FAIL, -1
    del h.sums[0]
    report = check(h)
    assert report.ok, report.summary()
    assert report.indeterminate == 1 and report.streams == 1


def test_a_sum_of_a_stream_never_completed_is_unexpected() -> None:
    h = clean()
    h.sums.append(SumRead("c", 5, 1, "s-0", 2, 5.0, 200, 400, 2))
    assert kinds(h) == ["unexpected-sum"]
    h = clean()
    h.sums.append(SumRead("zz", 5, 1, "s-0", 2, 5.0, 200, 400, 2))
    assert kinds(h) == ["unexpected-sum"]


def test_a_zombie_commit_after_its_successors_is_caught() -> None:
    h = clean()
    # Fence 1's instance commits stream c's sum after fence 2's committed b's.
    h.chunks.append(chunk("c", 2, 1, True, 3.5))
    h.sums.append(SumRead("c", 6, 2, "s-0", 1, 1.0, 100, 500, 2))
    assert kinds(h) == ["zombie-commit"]


def test_without_fences_instances_are_ordered_by_their_restore() -> None:
    h = clean()
    h.sums[0].fence = h.sums[1].fence = None
    assert check(h).ok
    h.sums[0].restored, h.sums[1].restored = 6.0, 5.0
    assert kinds(h) == ["zombie-commit"]


def test_a_failed_shard_after_healing_is_a_violation() -> None:
    h = clean()
    h.statuses.append(ShardStatus("s-0", "summer-2", "FAILED", ["boom"], 12.0))
    assert kinds(h) == ["failed-shard"]


@pytest.mark.parametrize(
    ("errors", "own", "fault", "excused"),
    [
        (["connection to postgres lost"], ["postgres-restart"], "postgres-restart", True),
        ([], ["postgres-restart"], "postgres-restart", False),  # Its status must say why.
        (["connection lost"], ["postgres-restart"], "SIGKILL", False),  # Not its own fault.
        (["connection lost"], [], "postgres-restart", False),
    ],
)
def test_a_failed_shard_is_excused_only_with_a_reason_and_a_fault_of_its_own(
    errors: list[str], own: list[str], fault: str, excused: bool
) -> None:
    h = clean()
    h.own_faults = own
    h.faults = [FaultRecord(fault, "postgres", 4.0, 5.0)]
    h.failures.append(ShardStatus("s-0", "summer-1", "FAILED", errors, 11.0))
    report = check(h)
    assert report.ok is excused, report.summary()
    assert report.failed_excused == int(excused)


def test_a_shard_failed_for_an_etcd_error_is_never_excused() -> None:
    """Issue 38: etcd's faults are no shard's own. In a scenario where PostgreSQL restarts
    (its shards' own fault) and etcd is killed, a shard FAILED for a refused etcd call is a
    violation, where one FAILED for PostgreSQL's error is excused."""
    h = clean()
    h.own_faults = ["postgres-restart"]
    h.faults = [
        FaultRecord("postgres-restart", "postgres", 4.0, 5.0),
        FaultRecord("etcd-kill", "etcd", 6.0, 6.8),
    ]
    refused = (
        "ConnectionFailedError: failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.0.0.2:2379: Failed to connect to remote host: Connection refused"
    )
    h.failures.append(ShardStatus("s-0", "summer-1", "FAILED", [refused], 7.0))
    h.failures.append(ShardStatus("s-1", "summer-2", "FAILED", ["ConnectionRefusedError"], 5.0))
    report = check(h)
    assert [v.kind for v in report.violations] == ["failed-shard"], report.summary()
    assert "an etcd error" in report.violations[0].detail
    assert "s-0" in report.violations[0].detail
    assert report.failed_excused == 1


def test_a_chunk_out_of_sequence_in_a_summers_log_is_a_violation() -> None:
    h = clean()
    h.log_problems.append("summer-0.1.log: OutOfSequence: stream a: chunk 3 after chunk 1")
    assert kinds(h) == ["out-of-sequence"]


def test_a_history_saved_and_loaded_checks_the_same(tmp_path: Path) -> None:
    h = clean()
    h.sums[0].sum = 8
    h.save(tmp_path / "history.json")
    again = ConsumerHistory.load(tmp_path / "history.json")
    assert [v.kind for v in check(again).violations] == ["wrong-sum"]
    assert again.chunks == h.chunks and again.sums == h.sums
