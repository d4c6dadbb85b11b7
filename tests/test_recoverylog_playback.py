"""Recording and playing recovery logs on a real broker: files recorded as they change in a
directory are played back byte for byte into another (from hints, skipping dead files); a log
written here in upstream's layout from the format's description plays back; a standby tails the
log and takes over by a hand-off that fences the old recorder out (its next append fails and it
records nothing more); corrupt logs fail playback with one clear error and leave nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness
from consumer.protocol import cpb
from consumer.recovery import Playback
from consumer.recoverylog import player as player_module
from consumer.recoverylog.fsm import FSM, new_author
from consumer.recoverylog.hints import decode_hints, encode_hints
from consumer.recoverylog.player import PlaybackError, Player
from consumer.recoverylog.recorder import Fenced, Recorder
from tests.helpers.loop import StallProbe
from tests.helpers.recoverylog import LogWriter, create, framed, new_log, unlink, write
from tests.helpers.waiting import until


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Mirror:
    """Changes a directory and records each change, as a store's file layer would."""

    def __init__(self, recorder: Recorder, directory: Path) -> None:
        self.recorder, self.directory = recorder, directory
        self.fnodes: dict[str, int] = {}

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def create(self, name: str, data: bytes = b"") -> None:
        """A new file at `name` (an existing one there is replaced: a new fnode, as the
        recorder models truncation; its other links keep the old content)."""
        Path(self.path(name)).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path(name)).unlink(missing_ok=True)
        Path(self.path(name)).write_bytes(data)
        self.fnodes[name] = self.recorder.record_create(self.path(name))
        if data:
            self.recorder.record_write(self.fnodes[name], data, 0)

    def write_at(self, name: str, data: bytes, offset: int) -> None:
        with open(self.path(name), "r+b") as f:
            f.seek(offset)
            f.write(data)
        self.recorder.record_write(self.fnodes[name], data, offset)

    def rename(self, source: str, target: str) -> None:
        os.replace(self.path(source), self.path(target))
        self.recorder.record_rename(self.path(source), self.path(target))
        self.fnodes[target] = self.fnodes.pop(source)

    def link(self, source: str, target: str) -> None:
        os.link(self.path(source), self.path(target))
        self.recorder.record_link(self.path(source), self.path(target))
        self.fnodes[target] = self.fnodes[source]

    def remove(self, name: str) -> None:
        os.unlink(self.path(name))
        self.recorder.record_remove(self.path(name))
        self.fnodes.pop(name)


async def test_recorded_files_play_back_byte_for_byte(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    source = tmp_path / "source"
    source.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await recorder.start()
        files = Mirror(recorder, source)
        files.create("db", b"page-0" * 1000)
        files.write_at("db", b"PAGE-1" * 500, 4096)
        files.create("db-journal", b"rollback" * 100)
        files.remove("db-journal")  # Dead: its ops are skipped on playback.
        files.create("tmp/MANIFEST-1", b"manifest one")
        files.rename("tmp/MANIFEST-1", "MANIFEST")
        files.link("db", "db.hardlink")
        files.create("db-wal")
        for i in range(50):
            files.write_at("db-wal", os.urandom(512), i * 512)
        files.create("db", b"truncated and rewritten")  # A new fnode at the same path.
        hints = await recorder.build_hints()

    assert [n.fnode for n in hints.live_nodes] == sorted(n.fnode for n in hints.live_nodes)
    assert len(hints.live_nodes) == 4  # db (old, at db.hardlink), MANIFEST, db-wal, db (new)
    # The hints survive etcd's JSON as upstream writes it.
    hints = decode_hints(encode_hints(hints))

    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        target = tmp_path / "played"
        fsm = await player.play(hints, target, lambda: stub, service)
    assert snapshot(target) == snapshot(source)
    assert os.stat(target / "db.hardlink").st_nlink == 1  # Its twin at "db" was truncated.
    assert fsm.next_seq_no == recorder.fsm.next_seq_no
    assert fsm.next_checksum == recorder.fsm.next_checksum


async def test_a_large_playback_does_not_stall_the_event_loop(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """Staged files are created and written, and the previous replica's files removed, on a
    worker thread: playing 10,000 files and 32 MiB of writes into a directory that still
    holds an old replica keeps the loop (every other shard's, lease keep-alives) responsive,
    and plays back byte for byte. (On the loop, it stalled for seconds; the bound leaves room
    for a loaded machine.)"""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker, fragment_length=8 << 20)
    w = LogWriter()
    content: list[bytes] = []

    def add(op: rpb.RecordedOp, data: bytes = b"") -> None:
        body = w.ops[-1][1]
        content.append(b"\x66\x33\x93\x36" + len(body).to_bytes(4, "little") + body + data)

    expected: dict[str, bytes] = {}
    for i in range(10_000):
        add(w.op(0x1234, **create(f"/sst/{i:05d}")))
        expected[f"sst/{i:05d}"] = b""
    db = w.op(0x1234, **create("/db"))
    add(db)
    page = os.urandom(1 << 20)
    for i in range(32):
        add(w.op(0x1234, **write(db.seq_no, i << 20, len(page))), page)
    expected["db"] = page * 32
    await append(stub, log, b"".join(content))

    target = tmp_path / "played"

    def previous_replica() -> None:
        (target / "old").mkdir(parents=True)
        for i in range(2000):
            (target / "old" / str(i)).write_bytes(b"x" * 4096)

    await asyncio.to_thread(previous_replica)
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        async with StallProbe() as probe:
            await player.play(rpb.FSMHints(log=log), target, lambda: stub, service)
    assert await asyncio.to_thread(snapshot, target) == expected
    assert probe.worst < 0.5, f"the loop stalled {probe.worst * 1000:.0f} ms"


async def test_a_cancelled_playback_leaves_no_thread_writing_into_its_directory(
    recovery_broker: BrokerHarness,
    recovery_stub: pb_grpc.JournalStub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled while a batch of staged files is being written (on a slow disk), playback
    ends only once that batch is done and the directory removed: nothing writes into it after
    the cancelled call returned."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    source = tmp_path / "source"
    source.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await recorder.start()
        files = Mirror(recorder, source)
        for i in range(50):
            files.create(f"f{i}", os.urandom(64 << 10))
        hints = await recorder.build_hints()

    applying, applied = threading.Event(), threading.Event()
    apply = player_module._StagedFiles._apply

    def slowly(staged: player_module._StagedFiles, batch: list[Any]) -> None:
        applying.set()
        try:
            time.sleep(0.3)  # A slow disk: the batch is still applying when play is cancelled.
            apply(staged, batch)
        finally:
            applied.set()

    monkeypatch.setattr(player_module._StagedFiles, "_apply", slowly)
    target = tmp_path / "played"
    async with AppendService(stub) as service:
        playing = asyncio.ensure_future(Player().play(hints, target, lambda: stub, service))
        await until(applying.is_set, "a batch applying on the thread", interval=0.005)
        playing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await playing
        assert not target.exists()
        await until(applied.is_set, "the batch in flight ended")
        assert not target.exists()


async def test_a_replicas_directory_is_removed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica's playback stopped (its shard moved, or failed): its directory, a whole
    store, is removed on a worker thread. On a disk where that takes half a second, the loop
    (every other shard's, lease keep-alives) is not stalled meanwhile."""
    rmtree = shutil.rmtree

    def slowly(path: Any, ignore_errors: bool = False) -> None:
        time.sleep(0.5)  # A slow disk: the removal takes this long on its thread.
        rmtree(path, ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", slowly)
    directory = tmp_path / "replica"
    directory.mkdir()
    for i in range(100):
        (directory / f"{i:05d}.sst").write_bytes(b"x" * 4096)
    playback = Playback(cpb.ShardSpec(id="shard-a", recovery_log_prefix="logs"), directory)
    async with StallProbe() as probe:
        await playback.stop()
    assert not directory.exists()
    assert probe.worst < 0.1, f"the loop stalled {probe.worst * 1000:.0f} ms"


async def test_a_stray_append_between_frames_is_skipped_with_a_warning(
    recovery_broker: BrokerHarness,
    recovery_stub: pb_grpc.JournalStub,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bytes that are not a frame (someone appended to the log by mistake) are read past to the
    next frame's marker, with a warning naming where and how many, as upstream's player does:
    a primary or standby that plays the log is not stopped by them."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    source = tmp_path / "source"
    source.mkdir()
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await recorder.start()
        files = Mirror(recorder, source)
        files.create("db", b"page-0" * 1000)
        await recorder.build_hints()  # Its appends so far are written.
        await service.flush()
        await append(stub, log, b'{"oops": "a stray line"}\n\x66\x33')  # Not a frame.
        files.write_at("db", b"PAGE-1" * 500, 4096)
        files.create("MANIFEST", b"manifest")
        hints = await recorder.build_hints()
        await service.flush()
        await append(stub, log, b"trailing junk")  # After the last frame too.

    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        with caplog.at_level("WARNING", logger="consumer.recoverylog.player"):
            fsm = await player.play(hints, tmp_path / "played", lambda: stub, service)
    assert snapshot(tmp_path / "played") == snapshot(source)
    assert fsm.next_seq_no == recorder.fsm.next_seq_no
    skipped = [r.getMessage() for r in caplog.records if "not a frame" in r.getMessage()]
    assert len(skipped) == 2 and "27 bytes" in skipped[0] and "13 bytes" in skipped[1], skipped


async def test_a_log_in_upstreams_layout_plays_back(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """Frames, checksums and hints JSON made here from the format's description alone."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    w = LogWriter()
    content: list[bytes] = []

    def add(op: rpb.RecordedOp, data: bytes = b"") -> None:
        body = w.ops[-1][1]
        content.append(b"\x66\x33\x93\x36" + len(body).to_bytes(4, "little") + body + data)

    add(w.op(0x1234, **create("/CURRENT")))
    add(w.op(0x1234, **write(1, 0, 16)), b"MANIFEST-000001\n")
    add(w.op(0x1234, **create("/000001.log")))
    add(w.op(0x1234, **write(3, 0, 5)), b"hello")
    add(w.op(0x1234, **unlink(3, "/000001.log")))
    add(w.op(0x1234, **create("/000002.sst")))
    add(w.op(0x1234, **write(6, 0, 11)), b"sorted data")
    await append(stub, log, b"".join(content))
    hints_json = (
        b'{"log":"' + log.encode() + b'","live_nodes":['
        b'{"fnode":1,"segments":[{"author":4660,"first_seq_no":1,"last_seq_no":2,"last_offset":'
        + str(len(content[0]) + len(content[1])).encode()
        + b'}]},{"fnode":6,"segments":[{"author":4660,"first_seq_no":6,"first_offset":'
        + str(sum(map(len, content[:5]))).encode()
        + b',"first_checksum":'
        + str(w.ops[5][0].checksum).encode()
        + b',"last_seq_no":7}]}],"properties":null}'
    )
    hints = decode_hints(hints_json)
    assert encode_hints(hints) == hints_json  # As Go's encoding/json writes it.
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        await player.play(hints, tmp_path / "out", lambda: stub, service)
    assert snapshot(tmp_path / "out") == {
        "CURRENT": b"MANIFEST-000001\n",
        "000002.sst": b"sorted data",
    }


async def test_a_standby_tails_then_takes_over_and_fences_the_old_recorder(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    source = tmp_path / "primary"
    source.mkdir()
    async with AppendService(stub) as service:
        old = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await old.start()
        files = Mirror(old, source)
        files.create("state", b"v1")
        hints = await old.build_hints()

        standby = Player()
        target = tmp_path / "standby"
        playing = asyncio.create_task(standby.play(hints, target, lambda: stub, service))
        await asyncio.wait_for(standby.tailing.wait(), 30)
        # The primary goes on while the standby tails.
        files.write_at("state", b"v2-more-bytes", 0)
        files.create("other", b"x" * 10_000)
        await old.sync()

        new_author_ = new_author()
        standby.inject_handoff(new_author_)
        fsm = await asyncio.wait_for(playing, 30)
        assert snapshot(target) == snapshot(source)

        # The old recorder is fenced: its next append is refused, and it records nothing more.
        files.write_at("state", b"zombie", 0)
        with pytest.raises(Fenced, match="REGISTER_MISMATCH"):
            await old.sync()
        with pytest.raises(Fenced):
            old.record_create(str(source / "late"))

        # The new primary records on from the played state, in the same log.
        successor = Recorder(log, fsm, new_author_, str(target), service)
        await successor.start()
        successor.record_write(fsm.links["/other"], b"y" * 10, 0)
        Path(target / "other").write_bytes(b"y" * 10 + b"x" * 9_990)
        final_hints = await successor.build_hints()

    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        await player.play(final_hints, tmp_path / "final", lambda: stub, service)
    # The zombie's write is in the log, but on a dead branch: not played.
    assert snapshot(tmp_path / "final") == snapshot(target)
    assert (tmp_path / "final" / "state").read_bytes() == b"v2-more-bytes"


async def test_corrupt_logs_fail_playback_and_leave_nothing(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    w = LogWriter()
    w.op(1, **create("/f"))
    body = w.ops[0][1]
    frame = b"\x66\x33\x93\x36" + len(body).to_bytes(4, "little") + body
    bogus = b"\xff" * 12  # A frame's marker and length, and a body that is no RecordedOp.
    await append(stub, log, frame + b"\x66\x33\x93\x36" + len(bogus).to_bytes(4, "little") + bogus)
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        with pytest.raises(PlaybackError, match="not a RecordedOp"):
            await player.play(rpb.FSMHints(log=log), tmp_path / "out", lambda: stub, service)
    assert not (tmp_path / "out").exists()

    # Hints naming a segment past the log's end: refused before anything is read.
    hints = rpb.FSMHints(log=log)
    hints.live_nodes.add(fnode=1).segments.add(
        author=1, first_seq_no=1, first_offset=10_000, last_seq_no=1
    )
    async with AppendService(stub) as service:
        with pytest.raises(PlaybackError, match="possible data loss"):
            await Player().play(hints, tmp_path / "out", lambda: stub, service)
    assert not (tmp_path / "out").exists()


async def test_playback_follows_the_hinted_branch_of_a_forked_log(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """Two recorders appended at once (register checks off, as before registers existed): the
    log holds both branches, interleaved; hints of either one play that one."""
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    w = LogWriter()
    w.op(1, **create("/f"))
    w.op(1, **write(1, 0, 4))
    zombie, successor = w.fork(), w.fork()
    zombie.op(1, **write(1, 0, 4))
    successor.op(2, **write(1, 0, 4))
    successor.op(2, **create("/g"))
    zombie.op(1, **create("/z"))
    payloads_a = {2: b"base", 3: b"ZOMB"}
    payloads_b = {2: b"base", 3: b"NEWW"}
    # In the log: the prefix, then the branches' ops interleaved.
    content = (
        framed(w.ops, payloads_a)
        + framed([zombie.ops[0]], payloads_a)
        + framed([successor.ops[0]], payloads_b)
        + framed([successor.ops[1]], payloads_b)
        + framed([zombie.ops[1]], payloads_a)
    )
    await append(stub, log, content)

    def hints_of(branch: LogWriter, author: int) -> rpb.FSMHints:
        hints = rpb.FSMHints(log=log)
        live = {1: [(1, 1, 1), (author, 3, 3)], branch.ops[1][0].seq_no: [(author, 4, 4)]}
        for fnode, segments in sorted(live.items()):
            node = hints.live_nodes.add(fnode=fnode)
            for a, first, last in segments:
                op = ([*w.ops, *branch.ops])[first - 1][0]
                node.segments.add(
                    author=a, first_seq_no=first, last_seq_no=last, first_checksum=op.checksum
                )
        node = hints.live_nodes[0]
        node.segments[0].last_seq_no = 2
        return hints

    async with AppendService(stub) as service:
        for branch, author, expected in (
            (successor, 2, {"f": b"NEWW", "g": b""}),
            (zombie, 1, {"f": b"ZOMB", "z": b""}),
        ):
            player = Player()
            player.finish_at_write_head()
            target = tmp_path / f"branch-{author}"
            await player.play(hints_of(branch, author), target, lambda: stub, service)
            assert snapshot(target) == expected


async def test_a_hinted_op_with_a_wrong_checksum_fails_playback(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    w = LogWriter()
    w.op(1, **create("/f"))
    bad = w.op(1, **write(1, 0, 3))
    body = w.ops[1][1]
    corrupted = rpb.RecordedOp.FromString(body)
    corrupted.checksum ^= 0xFFFF
    w.ops[1] = (bad, corrupted.SerializeToString())
    await append(stub, log, framed(w.ops, {2: b"abc"}))
    hints = rpb.FSMHints(log=log)
    hints.live_nodes.add(fnode=1).segments.add(author=1, first_seq_no=1, last_seq_no=2)
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        with pytest.raises(PlaybackError, match="hints unused"):
            await player.play(hints, tmp_path / "out", lambda: stub, service)
    assert not (tmp_path / "out").exists()


async def test_a_hand_off_that_loses_the_race_injects_again(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """The old recorder appends just before the player's no-op lands: the no-op is out of
    sequence (not applied), so the player reads on and injects again; the files include what
    the old recorder wrote first, and after that it is fenced."""
    from broker.client.append_service import PendingSpan, Registers

    broker, stub = recovery_broker, recovery_stub
    log = await new_log(broker)
    source = tmp_path / "old"
    source.mkdir()
    async with AppendService(stub) as service:
        old = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await old.start()
        fnode = old.record_create(str(source / "f"))
        old.record_write(fnode, b"first", 0)
        hints = await old.build_hints()

        injected: list[bytes] = []

        class Racing(AppendService):
            async def write(
                self, journal: str, data: bytes, registers: Registers | None = None
            ) -> PendingSpan:
                if registers is not None and registers.union is not None:
                    injected.append(data)
                    if len(injected) == 1:  # The old recorder gets in first, once.
                        old.record_write(fnode, b"FIRST, then more", 0)
                        await old.durable()
                return await super().write(journal, data, registers)

        async with Racing(stub) as racing:
            player = Player()
            player.inject_handoff(new_author())
            fsm = await player.play(hints, tmp_path / "new", lambda: stub, racing)
        assert len(injected) == 2  # Lost the first race, won the second.
        assert (tmp_path / "new" / "f").read_bytes() == b"FIRST, then more"
        assert fsm.next_seq_no == old.fsm.next_seq_no + 1  # Past the old ops and its no-op.
        old.record_write(fnode, b"zombie", 0)
        with pytest.raises(Fenced):
            await old.sync()


# ---- Nothing escapes the directory (issue 37, defect 1) ----------------------------------------
#
# Paths of the log and of the hints name files of the played directory, rooted at it ("/db"). A
# path that would land anywhere else, or that no recorder writes (empty, "." or ".." segments,
# NUL, the player's own staging), fails playback with one line naming it; nothing is written
# outside. "{outside}" is the test's outside directory, without its leading slash.

_ESCAPES = [
    pytest.param("/" + "../" * 12 + "{outside}/victim", id="dotdot-chain"),
    pytest.param("/../outside/victim", id="one-dotdot"),
    pytest.param("../outside/victim", id="unrooted-dotdot"),
    pytest.param("/a/../../outside/victim", id="a-then-climb"),
    pytest.param("/a/b/../../../outside/victim", id="deeper-then-climb"),
    pytest.param("/a/../b", id="dotdot-that-stays-inside"),
    pytest.param("//{outside}/victim", id="absolute"),
    pytest.param("/victim\x00/../../outside/victim", id="nul"),
    pytest.param("/a//b", id="empty-segment"),
    pytest.param("/a/", id="trailing-slash"),
    pytest.param("/./a", id="dot-segment"),
    pytest.param("/", id="the-directory-itself"),
    pytest.param("", id="empty"),
    pytest.param("/.fnodes/1", id="the-players-staging"),
]

# Where the escaping path sits: a file created there, a second link of a file, a property
# recorded in the log, a property in the hints.
_KINDS = ["create", "link", "property-op", "hinted-property"]


def _escape_ops(
    kind: str, path: str, log: str, first: tuple[str, ...] = ()
) -> tuple[bytes, rpb.FSMHints]:
    """The log content and hints that put `path` where `kind` says, with the content
    b"pwned" (what an attacker wants written outside), after files created at `first`."""
    from tests.helpers.recoverylog import link as link_op

    w = LogWriter()
    hints = rpb.FSMHints(log=log)
    payloads: dict[int, bytes] = {}
    for earlier in first:
        w.op(1, **create(earlier))
    if kind == "create":
        fnode = w.op(1, **create(path)).seq_no
        payloads[w.op(1, **write(fnode, 0, 5)).seq_no] = b"pwned"
    elif kind == "link":
        fnode = w.op(1, **create("/ok")).seq_no
        payloads[w.op(1, **write(fnode, 0, 5)).seq_no] = b"pwned"
        w.op(1, **link_op(fnode, path))
    elif kind == "property-op":
        w.op(1, property=rpb.Property(path=path, content="pwned"))
    else:
        hints.properties.add(path=path, content="pwned")
        w.op(1, **create("/ok"))
    return framed(w.ops, payloads), hints


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("spelling", _ESCAPES)
async def test_a_path_that_escapes_or_is_unclean_fails_playback_and_writes_nothing_outside(
    recovery_broker: BrokerHarness,
    recovery_stub: pb_grpc.JournalStub,
    tmp_path: Path,
    kind: str,
    spelling: str,
) -> None:
    from broker.protocol.validate import quote

    broker, stub = recovery_broker, recovery_stub
    outside = tmp_path / "outside"
    outside.mkdir()
    path = spelling.replace("{outside}", str(outside).lstrip("/"))
    log = await new_log(broker)
    content, hints = _escape_ops(kind, path, log)
    await append(stub, log, content)
    target = tmp_path / "played"
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        with pytest.raises(PlaybackError) as failed:
            await player.play(hints, target, lambda: stub, service)
    message = str(failed.value)
    assert quote(path) in message and "\n" not in message, message
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]  # played/ is removed too.


_THROUGH = [
    # A symlink on disk, in the played directory (put there while the player tails: by the
    # application, or anyone else who can write there), to a directory outside.
    pytest.param("symlinked-dir", "/sub/victim", id="under-a-symlinked-directory"),
    # The same at the path itself: a symlink to the outside file (dangling).
    pytest.param("symlinked-file", "/victim", id="at-a-symlink"),
    # A path through a file the log created earlier.
    pytest.param("recorded-file", "/sub/victim", id="through-a-recorded-file"),
]


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize(("obstacle", "path"), _THROUGH)
async def test_a_path_through_a_symlink_or_a_file_fails_playback_and_writes_nothing_outside(
    recovery_broker: BrokerHarness,
    recovery_stub: pb_grpc.JournalStub,
    tmp_path: Path,
    kind: str,
    obstacle: str,
    path: str,
) -> None:
    from broker.protocol.validate import quote

    broker, stub = recovery_broker, recovery_stub
    outside = tmp_path / "outside"
    outside.mkdir()
    log = await new_log(broker)
    # "/sub", a file, recorded first: the escaping ops follow it.
    first = ("/sub",) if obstacle == "recorded-file" else ()
    content, hints = _escape_ops(kind, path, log, first)
    await append(stub, log, content)
    target = tmp_path / "played"
    async with AppendService(stub) as service:
        player = Player()
        playing = asyncio.ensure_future(player.play(hints, target, lambda: stub, service))
        await asyncio.wait_for(player.tailing.wait(), 30)  # Every op is staged: none is live.
        if obstacle == "symlinked-dir":
            (target / "sub").symlink_to(outside, target_is_directory=True)
        elif obstacle == "symlinked-file":
            (target / "victim").symlink_to(outside / "victim")
        player.finish_at_write_head()
        with pytest.raises(PlaybackError) as failed:
            await asyncio.wait_for(playing, 30)
    message = str(failed.value)
    assert quote(path) in message and "\n" not in message, message
    assert list(outside.iterdir()) == []
    assert not target.exists()


async def test_rooted_paths_and_property_contents_stay_inside_the_directory(
    recovery_broker: BrokerHarness, recovery_stub: pb_grpc.JournalStub, tmp_path: Path
) -> None:
    """A path is rooted at the played directory: "/tmp/x/victim" (an absolute path, as a
    recorder never writes one) is the file tmp/x/victim in it. A property's content, an
    outside path, is a regular file's content, never followed as a link."""
    broker, stub = recovery_broker, recovery_stub
    outside = tmp_path / "outside"
    outside.mkdir()
    log = await new_log(broker)
    rooted = f"{outside}/victim"
    w = LogWriter()
    w.op(1, **create(rooted))
    w.op(1, **write(1, 0, 5))
    w.op(1, property=rpb.Property(path="/LINK", content=str(outside / "victim")))
    await append(stub, log, framed(w.ops, {2: b"inner"}))
    target = tmp_path / "played"
    async with AppendService(stub) as service:
        player = Player()
        player.finish_at_write_head()
        await player.play(rpb.FSMHints(log=log), target, lambda: stub, service)
    assert list(outside.iterdir()) == []
    assert (target / rooted.lstrip("/")).read_bytes() == b"inner"
    assert not (target / "LINK").is_symlink()
    assert (target / "LINK").read_text() == str(outside / "victim")
    # Private to the consumer's user, as fragments are: a shard's files are its tenant's.
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [target, *target.rglob("*")]}
    assert modes == {
        **{name: "0o700" for name in ["played", *PurePosixPath(rooted).parent.parts[1:]]},
        "victim": "0o600",
        "LINK": "0o600",
    }, modes
