"""Compaction of persisted fragments: plan runs of adjacent fragments, merge each into one
fragment covering exactly the same offsets, verify it, and only then remove what it covers.

Everything here is plain Python over the stores, so that a Spark task and the single-process
baseline of `spark_compact` run the same code. The steps are ordered for safety:

1. `write_merged`: read every fragment of the run (each SHA-1 verified), recompress into a
   temporary file, put it under its content-addressed name with a no-overwrite precondition
   (an identical fragment already there, from an interrupted run, is kept), then read it back
   whole and check its length and SHA-1.
2. The caller waits until the brokers list the new fragment (their index then prefers it).
3. `remove_covered`: remove the run's fragments (already-removed ones are fine).

A kill anywhere leaves, at worst, the new fragment beside the old ones: readers get identical
bytes from either, and the next run removes the covered ones (`covering` finds them).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from broker.fragment import codecs
from broker.fragment.content import describe, fragment_path
from broker.fragment.fragments import sum_from_digest
from broker.fragment.stores import StoreError
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.journals import JobError, covering, open_store_of, read_verified

# Content is handed to the compressor in batches of this size (one gzip member each).
BATCH = 1 << 20


@dataclass
class Run:
    """Adjacent persisted fragments of one journal, store and path postfix, to merge into one."""

    journal: str
    store: str
    postfix: str
    codec: pb.CompressionCodec
    fragments: list[pb.Fragment]

    @property
    def begin(self) -> int:
        return self.fragments[0].begin

    @property
    def end(self) -> int:
        return self.fragments[-1].end

    @property
    def size(self) -> int:
        return self.end - self.begin


@dataclass
class Plan:
    """What compacting one journal does: `runs` to merge, `redundant` fragments already covered
    by a larger one (left by an interrupted run) to remove, and how many fragments stay as
    they are; `kept` are the fragments that cover the journal (the redundant ones' covers)."""

    journal: str
    runs: list[Run] = field(default_factory=list)
    redundant: list[pb.Fragment] = field(default_factory=list)
    kept: list[pb.Fragment] = field(default_factory=list)
    untouched: int = 0
    too_young: int = 0


def plan_journal(
    spec: pb.JournalSpec,
    fragments: Sequence[pb.Fragment],
    *,
    target_size: int,
    codec: pb.CompressionCodec | None,
    min_age: float,
    now: float,
) -> Plan:
    """Runs of adjacent fragments (same store and postfix, no gap) persisted at least `min_age`
    seconds before `now`, each as long as it can be without passing `target_size` bytes of
    content; a run of one fragment is left alone. `codec` defaults to the journal's."""
    if target_size <= 0:
        raise JobError(f"target size {target_size} must be positive")
    plan = Plan(spec.name)
    kept, plan.redundant = covering(fragments)
    plan.kept = kept
    chosen = spec.fragment.compression_codec if codec is None else codec
    if chosen == pb.INVALID:
        chosen = pb.NONE
    current: list[pb.Fragment] = []

    def close() -> None:
        if len(current) > 1:
            first = current[0]
            plan.runs.append(
                Run(spec.name, first.backing_store, first.path_postfix, chosen, list(current))
            )
        else:
            plan.untouched += len(current)
        current.clear()

    for fragment in kept:
        if now - fragment.mod_time < min_age:
            plan.too_young += 1
            close()
            continue
        if current:
            last = current[-1]
            joins = (
                fragment.begin == last.end
                and fragment.backing_store == last.backing_store
                and fragment.path_postfix == last.path_postfix
                and fragment.end - current[0].begin <= target_size
            )
            if not joins:
                close()
        current.append(fragment)
    close()
    return plan


@dataclass(frozen=True)
class Merged:
    """A run's new fragment, and whether it was already in the store (a re-run)."""

    fragment: pb.Fragment
    existed: bool
    stored_bytes: int


def write_merged(run: Run, file_root: Path | None) -> Merged:
    """Merge the run's fragments into one new fragment in the store, and verify it there."""
    store = open_store_of(run.store, file_root)
    summer = hashlib.sha1()
    with tempfile.TemporaryFile(prefix="gazette-compact-") as tmp:
        with codecs.compressor(run.codec, tmp) as out:
            at = run.begin
            for fragment in run.fragments:
                if fragment.begin != at:
                    raise JobError(
                        f"fragment {describe(fragment)} does not follow offset {at} of its run"
                    )
                pending = 0
                for block in read_verified(store, fragment):
                    summer.update(block)
                    out.write(block)
                    pending += len(block)
                    if pending >= BATCH:
                        out.end_batch()
                        pending = 0
                at = fragment.end
        stored = tmp.tell()
        merged = pb.Fragment(
            journal=run.journal,
            begin=run.begin,
            end=run.end,
            sum=sum_from_digest(summer.digest()),
            compression_codec=run.codec,
            backing_store=run.store,
            path_postfix=run.postfix,
        )
        tmp.seek(0)
        path = fragment_path(merged)
        try:
            written = store.put(
                path, tmp, stored, codecs.content_encoding(merged.compression_codec)
            )
        except StoreError as exc:
            raise JobError(f"cannot write {describe(merged)}: {exc}") from None
    # Verify what the store now holds under that name: all of it, against length and SHA-1
    # (read_verified raises on either).
    for _ in read_verified(store, merged):
        pass
    return Merged(merged, existed=not written, stored_bytes=stored)


def remove_covered(fragments: Sequence[pb.Fragment], file_root: Path | None) -> int:
    """Remove fragments a merged (or larger) fragment covers; returns how many were removed."""
    for fragment in fragments:
        store = open_store_of(fragment.backing_store, file_root)
        try:
            store.remove(fragment_path(fragment))
        except StoreError as exc:
            raise JobError(f"cannot remove {describe(fragment)}: {exc}") from None
    return len(fragments)
