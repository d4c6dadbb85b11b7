"""Which fragments of a recovery log no hints still need (`gazctl shards prune`).

Every set of hints of every shard using a log (the primary's and each backup) names segments of
it; a fragment is needed if it holds any offset of any of them. The last segment of each set of
hints is taken as unbounded (playback reads on from it to the write head), so the open end of the
log is never pruned. A log is pruned only when every shard using it has every one of its hints
(a shard that has not written them all may need anything), and a fragment not yet persisted that
no segment needs means the selector left out a shard using the log: nothing is pruned then."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from consumer.recoverylog.fsm import live_log_segments
from consumer.recoverylog.segments import Segment

__all__ = ["LogSegments", "PruneRefused", "overlaps", "prunable"]


class PruneRefused(Exception):
    """Pruning would be unsafe: nothing may be removed."""


@dataclass
class LogSegments:
    """The hinted segments of each log, and the logs that must not be pruned (with why)."""

    segments: dict[str, list[Segment]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def add_hints(self, log: str, hints: Iterable[rpb.FSMHints | None], shard: str) -> None:
        """Fold in one shard's hints (None where a set is missing)."""
        for h in hints:
            if h is None:
                self.skipped.setdefault(
                    log,
                    f"shard {shard} has not written all its hints yet (a primary writes them "
                    "once recovered, then every hints_interval, 5 min), so nothing of the log is "
                    "removed: prune again once its primary has run that long",
                )
                return
            if not h.live_nodes:
                self.skipped.setdefault(
                    log,
                    f"shard {shard}'s hints name no live files (its store held none when they "
                    "were written), so they cannot say which fragments it needs and nothing of "
                    "the log is removed: prune again once the shard has committed and written "
                    "its hints again (every hints_interval, 5 min)",
                )
                return
            _, found = live_log_segments(h)
            last = replace(found[-1], last_offset=0)  # Playback reads on past the last one.
            for segment in [*found[:-1], last]:
                self.segments.setdefault(segment.log, []).append(segment)


def overlaps(segments: Sequence[Segment], fragment: pb.Fragment) -> bool:
    """Whether any segment holds an offset of the fragment (a last offset of 0 is unbounded)."""
    if not segments:
        return True  # No live segments known: keep everything.
    return any(
        (s.first_offset < fragment.end or fragment.end == 0)
        and (s.last_offset > fragment.begin or s.last_offset == 0)
        for s in segments
    )


def prunable(fragments: Sequence[pb.Fragment], segments: Sequence[Segment]) -> list[pb.Fragment]:
    """The persisted fragments no segment needs; PruneRefused if an unpersisted one is not
    needed either (some shard using the log was left out)."""
    out = []
    for f in fragments:
        if overlaps(segments, f):
            continue
        if not f.backing_store or not f.mod_time:
            raise PruneRefused(
                f"{f.journal}: fragment {f.begin}-{f.end} is not persisted yet and no hints need "
                "it: the selector leaves out a shard that uses this log; include every shard "
                "that uses it"
            )
        out.append(f)
    return out
