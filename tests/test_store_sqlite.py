"""The SQLite store recorded into a recovery log, on a real broker: committed transactions and
their checkpoint play back into another directory; a transaction cut short after SQLite spilled
pages (its rollback journal recorded) plays back as the last commit; a zombie whose log was taken
by a hand-off cannot commit, and nothing of it is played."""

from __future__ import annotations

import asyncio
from pathlib import Path

import apsw
import pytest

from broker.client.append_service import AppendService
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness
from consumer.protocol import cpb
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.player import Player
from consumer.recoverylog.recorder import Fenced, Recorder
from consumer.store_sqlite import DATABASE, SQLiteStore
from tests.helpers.recoverylog import new_log


def checkpoint(offset: int) -> cpb.Checkpoint:
    out = cpb.Checkpoint()
    out.sources["src/journal"].read_through = offset
    return out


def insert(rows: range, payload: int = 16) -> object:
    def run(db: apsw.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS kv (k INTEGER PRIMARY KEY, v BLOB)")
        db.executemany(
            "INSERT OR REPLACE INTO kv VALUES (?, ?)",
            [(k, bytes([k % 251]) * payload) for k in rows],
        )

    return run


async def play(
    hints: rpb.FSMHints, directory: Path, stub: pb_grpc.JournalStub, service: AppendService
) -> FSM:
    player = Player()
    player.finish_at_write_head()
    return await player.play(hints, directory, lambda: stub, service)


def read_back(directory: Path) -> tuple[list[tuple[int, bytes]], cpb.Checkpoint]:
    db = apsw.Connection(str(directory / DATABASE))
    try:
        rows = [(k, bytes(v)) for k, v in db.execute("SELECT k, v FROM kv ORDER BY k")]
        (blob,) = db.execute("SELECT checkpoint FROM gazette_checkpoint WHERE id = 0").fetchone()
        return rows, cpb.Checkpoint.FromString(bytes(blob))
    finally:
        db.close()


async def test_commits_play_back_with_their_checkpoint(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, 1 << 22)
    primary = tmp_path / "primary"
    primary.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(primary), service)
        await recorder.start()
        store = SQLiteStore(recorder)
        assert await store.restore_checkpoint() == cpb.Checkpoint()
        for txn in range(5):
            await store.run(insert(range(txn * 100, txn * 100 + 150)))
            await store.start_commit(checkpoint(txn + 1))
        hints = await store.build_hints()
        await store.close()

        expected = read_back(primary)
        assert expected[1] == checkpoint(5) and len(expected[0]) == 550
        await play(hints, tmp_path / "played", stub, service)
        assert read_back(tmp_path / "played") == expected
        # The WAL went with the database's close (a checkpoint): only the database is live.
        assert sorted(p.name for p in (tmp_path / "played").iterdir()) == [DATABASE]


async def test_a_store_in_a_directory_reached_through_a_symlink_records_and_plays_back(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """macOS's temporary directory is a symlink: SQLite then resolves the database's name (its
    xFullPathname says SQLITE_OK_SYMLINK), and the resolved name must still be recognised as
    under the recorder's directory, or nothing would be recorded."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, 1 << 22)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    primary = tmp_path / "link" / "primary"
    primary.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(primary), service)
        await recorder.start()
        store = SQLiteStore(recorder)
        assert await store.restore_checkpoint() == cpb.Checkpoint()
        await store.run(insert(range(100)))
        await store.start_commit(checkpoint(7))
        hints = await store.build_hints()
        await store.close()
        assert hints.live_nodes, "the database was recorded"
        expected = read_back(primary)
        await play(hints, tmp_path / "played", stub, service)
        assert read_back(tmp_path / "played") == expected and expected[1] == checkpoint(7)


@pytest.mark.parametrize("journal_mode", ["WAL", "DELETE"])
async def test_a_transaction_cut_short_plays_back_as_the_last_commit(
    recovery_broker: BrokerHarness,
    recovery_stub: pb_grpc.JournalStub,
    tmp_path: Path,
    journal_mode: str,
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, 1 << 22)
    primary = tmp_path / "primary"
    primary.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(primary), service)
        await recorder.start()
        store = SQLiteStore(recorder, journal_mode=journal_mode)
        await store.restore_checkpoint()
        await store.run(insert(range(100)))
        await store.start_commit(checkpoint(1))
        committed = ([(k, bytes([k % 251]) * 16) for k in range(100)], checkpoint(1))

        def spill(db: apsw.Connection) -> None:
            db.execute("PRAGMA cache_size=2")  # Pages spill to the file before the commit.
            insert(range(100, 5000), payload=200)(db)  # type: ignore[operator]

        await store.run(spill)
        hints = await store.build_hints()
        # A hot journal (or WAL frames without a commit), recorded with the spilled pages.
        side = f"{DATABASE}-journal" if journal_mode == "DELETE" else f"{DATABASE}-wal"
        assert side in {p.name for p in primary.iterdir()}
        # The process dies here: no commit. What the log holds is played elsewhere.
        fsm = await play(hints, tmp_path / "played", stub, service)
        assert "/" + side in fsm.links
        assert read_back(tmp_path / "played") == committed  # SQLite rolled it back.
        await store.close()


async def test_a_zombie_store_cannot_commit_after_a_hand_off(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, 1 << 22)
    zombie_dir = tmp_path / "zombie"
    zombie_dir.mkdir()
    async with AppendService(stub) as service:
        zombie = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(zombie_dir), service)
        await zombie.start()
        store = SQLiteStore(zombie)
        await store.restore_checkpoint()
        await store.run(insert(range(10)))
        await store.start_commit(checkpoint(1))
        hints = await store.build_hints()

        # A standby takes the log over: its no-op fences the zombie's author out.
        successor = Player()
        successor.inject_handoff(new_author())
        await successor.play(hints, tmp_path / "successor", lambda: stub, service)

        await store.run(insert(range(10, 20)))
        with pytest.raises((apsw.Error, Fenced)):
            await store.start_commit(checkpoint(2))
        await store.close()
        assert zombie.failure is not None and "REGISTER_MISMATCH" in str(zombie.failure)

        final = await play(hints, tmp_path / "final", stub, service)
        assert final.next_seq_no > 0
        rows, done = read_back(tmp_path / "final")
        assert [k for k, _ in rows] == list(range(10)) and done == checkpoint(1)
        await asyncio.sleep(0)


async def test_compaction_bounds_the_playback_horizon(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """Rows rewritten again and again grow the log, not the database: once the log holds four
    times the database since it was last written whole, a compacted copy replaces it, and the
    hints name only the log from that copy on."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, 1 << 22)
    primary = tmp_path / "primary"
    primary.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(primary), service)
        await recorder.start()
        store = SQLiteStore(recorder, compact_after=1)
        await store.restore_checkpoint()
        for txn in range(12):
            await store.run(insert(range(50), payload=100 + txn))  # The same rows, rewritten.
            await store.start_commit(checkpoint(txn + 1))
        hints = await store.build_hints()
        await store.close()
        assert store.compactions >= 2
        expected = read_back(primary)
        assert expected[1] == checkpoint(12)

        # Every live file (the database, its WAL) begins after the last copy's start.
        assert hints.live_nodes
        for node in hints.live_nodes:
            assert node.segments[0].first_seq_no > 1 and node.segments[0].first_offset > 0
        # A player skips the log before the last copy, and rebuilds the same database.
        await play(hints, tmp_path / "played", stub, service)
        assert read_back(tmp_path / "played") == expected
        assert sorted(p.name for p in (tmp_path / "played").iterdir()) == [DATABASE]
