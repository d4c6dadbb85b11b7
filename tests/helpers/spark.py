"""Spark jobs' inputs and outputs in the tests: a journal's content and specs file for
compaction, offline sequencing and local events for replay, and the addresses a process
listens on (Spark's, which must be loopback's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from broker.fragment.content import open_in_store
from broker.fragment.stores import FragmentStore, open_store
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.journals import covering
from message.framing import FrameReader, JSONLines
from message.publisher import Reader
from message.sequencer import Sequencer
from message.types import DictMessages
from message.uuid import Flags, build, new_producer_id
from tests.helpers.fragment_history import STORE, Cluster, History, cluster, history  # noqa: F401
from tests.helpers.fragments import put_pieces

JOURNAL = "compact/events"


def journal_bytes(store: FragmentStore, journal: str) -> bytes:
    """The journal's whole content as a reader gets it from the store: covering fragments."""
    kept, _ = covering(store.list_fragments(journal))
    out = bytearray()
    for fragment in kept:
        assert fragment.begin <= len(out), f"a gap before {fragment.begin}"
        for block in open_in_store(store, fragment, len(out)):
            out += block
    return bytes(out)


def specs_file(tmp_path: Path, store_url: str, codec: str = "ZSTANDARD") -> Path:
    path = tmp_path / "specs.yaml"
    path.write_text(
        f"name: {JOURNAL}\nreplication: 1\nfragment:\n  length: 1048576\n"
        f'  compression_codec: {codec}\n  stores: ["{store_url}"]\n'
    )
    return path


def content(size: int, seed: int = 7) -> bytes:
    rng = random.Random(seed)
    lines = []
    total = 0
    while total < size:
        line = f'{{"n": {len(lines)}, "v": "{rng.getrandbits(64):x}"}}\n'.encode()
        lines.append(line)
        total += len(line)
    return b"".join(lines)[:size]


def sequenced_offline(data: bytes, journal: str) -> list[tuple[str, int, str]]:
    """What the read-committed iterator delivers for these bytes (its Reader and Sequencer)."""
    reader = Reader(DictMessages(), JSONLines())
    frames = FrameReader(JSONLines())
    seq = Sequencer()
    out = []
    _, base, lines = frames.feed_lines(0, data)
    for envelope in reader.envelopes_of_lines(journal, base, lines):
        seq.queue_uncommitted(envelope)
        while (committed := seq.step()) is not None:
            if not committed.is_ack:
                out.append((journal, committed.begin, committed.message["id"]))
    return out


def committed_history() -> tuple[bytes, list[int]]:
    """Committed (OUTSIDE_TXN) messages of two producers, messages without a UUID, and a
    transaction long enough to span fragments; then the cuts between fragments, one of them
    inside a retried append of committed messages (so that the fragment after it starts with
    duplicates only the one before can tell)."""
    messages, framing = DictMessages(), JSONLines()
    producers = [new_producer_id(), new_producer_id()]
    clock = 1 << 60
    lines: list[bytes] = []

    def add(doc: dict[str, Any], producer: bytes | None, flags: Flags) -> None:
        nonlocal clock
        if producer is not None:
            clock += 16
            messages.set_uuid(doc, build(producer, clock, flags))
        out = bytearray()
        framing.marshal(messages.encode(doc), out)
        lines.append(bytes(out))

    for i in range(300):
        add({"id": i}, producers[i % 2], Flags.OUTSIDE_TXN)
        if i % 50 == 0:
            add({"id": 10_000 + i}, None, Flags.OUTSIDE_TXN)
    for i in range(120):  # A transaction over three fragments, then its ACK.
        add({"id": 1_000 + i}, producers[0], Flags.CONTINUE_TXN)
    add({"id": 1_999}, producers[0], Flags.ACK_TXN)
    retried = lines[160:190]  # Appended again: all duplicates (none without a UUID).
    lines = lines[:300] + retried + lines[300:]
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    cuts = [offsets[100], offsets[310], offsets[360], offsets[400]]  # 310: inside the retry.
    return b"".join(lines), cuts


def local_events(tmp_path: Path, codec: int) -> tuple[bytes, list[pb.Fragment], Path]:
    """`committed_history()` as journal local/events in a file:// store under `tmp_path`: its
    bytes, its fragments and its specs file."""
    data, cuts = committed_history()
    (tmp_path / "store").mkdir()
    store = open_store("file:///store/", file_root=tmp_path)
    fragments = put_pieces(store, "local/events", data, cuts, codec=codec)
    specs = tmp_path / "specs.yaml"
    specs.write_text(
        "name: local/events\nreplication: 1\nlabels:\n  - name: content-type\n"
        '    value: application/x-ndjson\nfragment:\n  stores: ["file:///store/"]\n'
    )
    return data, fragments, specs


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) a process listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue  # Closed meanwhile.
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.add(fields[1].rsplit(":", 1)[0])
    return out


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
