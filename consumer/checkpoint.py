"""Checkpoints as upstream builds them: per source journal, the offset read through and the state
of each producer seen in it, and per journal the ACK intent to append once the checkpoint is
committed (`Checkpoint` of consumer.proto). A checkpoint is committed atomically with the
store's state, so a shard that restarts from it applies every message exactly once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from consumer.protocol import cpb
from message.sequencer import JournalProducer, ProducerState

__all__ = ["build_checkpoint", "producer_states_of", "read_through_of"]


def build_checkpoint(
    read_through: Mapping[str, int],
    producer_states: Mapping[JournalProducer, ProducerState],
    ack_intents: Iterable[tuple[str, bytes]] = (),
) -> cpb.Checkpoint:
    """A Checkpoint of the offsets read through, the producers' states (a producer's journal is
    a source even if no offset was recorded for it) and the ACK intents to append."""
    out = cpb.Checkpoint()
    for journal, offset in read_through.items():
        out.sources[journal].read_through = offset
    for key in sorted(producer_states):
        state = producer_states[key]
        entry = out.sources[key.journal].producers.add(id=bytes(key.producer))
        entry.state.last_ack = state.last_ack
        entry.state.begin = state.begin
    for journal, intent in ack_intents:
        out.ack_intents[journal] = intent
    return out


def read_through_of(checkpoint: cpb.Checkpoint) -> dict[str, int]:
    """Per source journal, where reading resumes."""
    return {journal: source.read_through for journal, source in checkpoint.sources.items()}


def producer_states_of(checkpoint: cpb.Checkpoint) -> dict[JournalProducer, ProducerState]:
    """The producers' states, to resume a Sequencer with."""
    out: dict[JournalProducer, ProducerState] = {}
    for journal, source in checkpoint.sources.items():
        for entry in source.producers:
            out[JournalProducer(journal, bytes(entry.id))] = ProducerState(
                entry.state.last_ack, entry.state.begin
            )
    return out
