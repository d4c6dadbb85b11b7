"""Stores and checkpoints: the JSON-file store commits state and checkpoint atomically, restores
them, and fences out a zombie instance; checkpoints carry a Sequencer's offsets and producer
states and the ACK intents, as upstream's."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumer.checkpoint import build_checkpoint, producer_states_of, read_through_of
from consumer.protocol import cpb
from consumer.store import FencedOut, JSONFileStore
from message.sequencer import JournalProducer, ProducerState, Sequencer

P1, P2 = b"\x01" * 6, b"\x02" * 6


def example_checkpoint() -> cpb.Checkpoint:
    states = {
        JournalProducer("in/a", P2): ProducerState(last_ack=7, begin=-1),
        JournalProducer("in/a", P1): ProducerState(last_ack=3, begin=120),
        JournalProducer("in/b", P1): ProducerState(last_ack=9, begin=-1),
    }
    return build_checkpoint(
        {"in/a": 200, "in/c": 5}, states, [("out/x", b'{"ack":1}\n'), ("out/y", b"")]
    )


def test_a_checkpoint_carries_offsets_producers_and_intents() -> None:
    checkpoint = example_checkpoint()
    assert read_through_of(checkpoint) == {"in/a": 200, "in/b": 0, "in/c": 5}
    states = producer_states_of(checkpoint)
    assert states[JournalProducer("in/a", P1)] == ProducerState(3, 120)
    assert states[JournalProducer("in/b", P1)] == ProducerState(9, -1)
    assert len(states) == 3
    assert dict(checkpoint.ack_intents) == {"out/x": b'{"ack":1}\n', "out/y": b""}
    # Producers are listed in a stable order, so equal states make equal bytes.
    assert [p.id for p in checkpoint.sources["in/a"].producers] == [P1, P2]
    # A Sequencer resumes from it.
    sequencer = Sequencer(producer_states_of(checkpoint), offsets=read_through_of(checkpoint))
    assert sequencer.offsets == {"in/a": 200, "in/b": 0, "in/c": 5}
    assert sequencer.producer_state("in/a", P1) == ProducerState(3, 120)


async def test_the_json_file_store_commits_and_restores(tmp_path: Path) -> None:
    store = JSONFileStore(tmp_path, "shard/one")
    assert await store.restore_checkpoint() == cpb.Checkpoint()
    store.state["count"] = 3
    await store.commit(example_checkpoint())
    store.state["count"] = 4  # Not committed: lost with the process.

    again = JSONFileStore(tmp_path, "shard/one")
    assert await again.restore_checkpoint() == example_checkpoint()
    assert again.state == {"count": 3}
    # Shard ids may hold '/': one directory per shard all the same.
    assert [p.name for p in tmp_path.iterdir()] == ["shard%2Fone"]


async def test_a_zombie_store_is_fenced_out(tmp_path: Path) -> None:
    zombie = JSONFileStore(tmp_path, "shard-1")
    await zombie.restore_checkpoint()
    zombie.state["n"] = 1
    await zombie.commit(build_checkpoint({"in/a": 10}, {}))

    primary = JSONFileStore(tmp_path, "shard-1")
    assert read_through_of(await primary.restore_checkpoint()) == {"in/a": 10}
    zombie.state["n"] = 99
    with pytest.raises(FencedOut, match="another instance restored this shard"):
        await zombie.commit(build_checkpoint({"in/a": 99}, {}))
    primary.state["n"] = 2
    await primary.commit(build_checkpoint({"in/a": 20}, {}))

    reader = JSONFileStore(tmp_path, "shard-1")
    assert read_through_of(await reader.restore_checkpoint()) == {"in/a": 20}
    assert reader.state == {"n": 2}


async def test_a_commit_needs_a_restore_and_a_broken_file_says_what_to_do(tmp_path: Path) -> None:
    store = JSONFileStore(tmp_path, "shard-1")
    with pytest.raises(RuntimeError, match="before restore_checkpoint"):
        await store.commit(cpb.Checkpoint())
    (tmp_path / "shard-1").mkdir()
    (tmp_path / "shard-1" / "state.json").write_text("{torn")
    with pytest.raises(ValueError, match="move it away") as caught:
        await store.restore_checkpoint()
    assert "\n" not in str(caught.value)
    # A temporary file left by a crash before its rename changes nothing.
    (tmp_path / "shard-1" / "state.json").unlink()
    (tmp_path / "shard-1" / ".state.json.123.tmp").write_text('{"fence": 7}')
    assert await store.restore_checkpoint() == cpb.Checkpoint()


async def test_start_commit_snapshots_at_once_and_waits_for_the_appends(tmp_path: Path) -> None:
    """The next transaction changes the state while the previous one commits: the commit holds
    the state as it was when it started, and is durable only after the appends it waits for."""
    import asyncio

    store = JSONFileStore(tmp_path, "shard-1")
    await store.restore_checkpoint()
    store.state["n"] = 1
    appended = asyncio.get_running_loop().create_future()
    committing = asyncio.ensure_future(
        store.start_commit(build_checkpoint({"in/a": 10}, {}), [appended])
    )
    store.state["n"] = 2  # The next transaction, already at work.
    await asyncio.sleep(0.1)  # A hold: the commit is not durable before its appends.
    assert not committing.done()
    assert not (tmp_path / "shard-1" / "state.json").read_text().count('"n"')
    appended.set_result(None)
    await committing
    reader = JSONFileStore(tmp_path, "shard-1")
    assert read_through_of(await reader.restore_checkpoint()) == {"in/a": 10}
    assert reader.state == {"n": 1}
