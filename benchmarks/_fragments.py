"""Persisted fragments for the read benchmarks: a journal's content written straight into a
file:// store as content-addressed fragment files, exactly as a broker persists them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from broker.fragment.content import fragment_path
from broker.fragment.fragments import sum_from_digest
from broker.protocol import protocol_pb2 as pb

STORE = "file:///fragments/"


def write_fragments(root: Path, journal: str, total: int, fragment_size: int) -> Path:
    """Fragments of `journal` covering [0, total) in `fragment_size` pieces (NONE codec) under
    `root`; returns the directory holding them."""
    block = os.urandom(1 << 20)
    offset = 0
    directory = root / "fragments" / journal
    while offset < total:
        size = min(fragment_size, total - offset)
        # Distinct content per fragment: a rotated random block, repeated.
        turn = (offset // fragment_size) * 4099 % len(block)
        unit = block[turn:] + block[:turn]
        content = (unit * (size // len(unit) + 1))[:size]
        fragment = pb.Fragment(
            journal=journal,
            begin=offset,
            end=offset + size,
            sum=sum_from_digest(hashlib.sha1(content).digest()),
            compression_codec=pb.NONE,
        )
        path = root / "fragments" / fragment_path(fragment)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        offset += size
    return directory


def read_spec(journal: str) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=journal, replication=1)
    spec.fragment.length = 1 << 30
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.stores.append(STORE)
    spec.fragment.refresh_interval.seconds = 60
    return spec
