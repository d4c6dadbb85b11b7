"""The `gazette` Spark data source on real Spark (local[2]): raw blocks and framed messages from
fragments in a store, the covering fragments only, bad frames skipped or failing the job, and
one-line errors for a corrupt fragment, an unreachable store and missing Java."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.fragment.content import fragment_path
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from gazctl.spark.columns import hex_ids, uuid_columns, uuid_texts
from message.types import DictMessages
from message.uuid import Flags, build, new_producer_id, parse_text
from tests.helpers.fragments import put_fragment, put_pieces

JOURNAL = "source/events"


def setup(tmp_path: Path, data: bytes, cuts: list[int]) -> tuple[Path, Path, list[pb.Fragment]]:
    root = tmp_path / "root"
    (root / "store").mkdir(parents=True)
    store = open_store("file:///store/", file_root=root)
    fragments = put_pieces(store, JOURNAL, data, cuts, codec=pb.GZIP)
    specs = tmp_path / "specs.yaml"
    specs.write_text(
        f"name: {JOURNAL}\nreplication: 1\nlabels:\n  - name: content-type\n"
        '    value: application/x-ndjson\nfragment:\n  stores: ["file:///store/"]\n'
    )
    return root, specs, fragments


def load(spark: Any, root: Path, specs: Path, **options: str) -> Any:
    reader = spark.read.format("gazette").option("selector", f"name={JOURNAL}")
    reader = reader.option("specs", str(specs)).option("file_root", str(root))
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load()


def messages_bytes() -> tuple[bytes, list[dict[str, Any]]]:
    producer = new_producer_id()
    docs = []
    out = bytearray()
    for i in range(60):
        doc: dict[str, Any] = {"i": i}
        if i % 7:  # Some without a UUID.
            DictMessages().set_uuid(doc, build(producer, (i + 1) << 8, Flags.OUTSIDE_TXN))
        docs.append(doc)
        out += json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    return bytes(out), docs


@pytest.mark.slow
def test_raw_blocks_and_messages_with_uuid_fields(spark: Any, tmp_path: Path) -> None:
    data, docs = messages_bytes()
    cuts = [i for i in range(1, len(data)) if data[i - 1 : i] == b"\n"][::13]
    root, specs, fragments = setup(tmp_path, data, cuts)
    # A larger fragment covering the first two: only it is read.
    store = open_store("file:///store/", file_root=root)
    put_fragment(store, JOURNAL, 0, data[: fragments[1].end], pb.ZSTANDARD)

    raw = load(spark, root, specs).orderBy("offset").collect()
    assert b"".join(r.content for r in raw) == data
    assert len({(r.begin, r.end) for r in raw}) == len(fragments) - 1

    # Fragments persisted before --from-time are skipped: all of them, an hour from now.
    assert load(spark, root, specs, from_time=str(time.time() + 3600)).count() == 0
    assert load(spark, root, specs, from_time=str(time.time() - 3600)).count() == len(raw)

    rows = load(spark, root, specs, framing="auto").orderBy("offset").collect()
    assert [json.loads(r.content) for r in rows] == docs
    assert [(r.offset, r.end) for r in rows][:2] == [
        (0, len(json.dumps(docs[0], separators=(",", ":"))) + 1),
        (rows[1].offset, rows[2].offset),
    ]
    for row, doc in zip(rows, docs, strict=True):
        if "_meta" in doc:
            assert row.uuid == doc["_meta"]["uuid"] and row.flags == 0
            assert row.clock == (doc["i"] + 1) << 8 and len(row.producer) == 12
        else:
            assert row.uuid is None and row.producer is None and row.clock == 0
            assert row.timestamp is None
    # The UUID's time, and option json_schema's columns, parsed from each message.
    parsed = load(spark, root, specs, framing="auto", json_schema="i LONG, gone STRING")
    rows = parsed.orderBy("offset").collect()
    assert [(r.i, r.gone) for r in rows] == [(d["i"], None) for d in docs]
    assert all((r.timestamp is None) == (r.uuid is None) for r in rows)


@pytest.mark.slow
def test_bad_frames_skipped_or_failing(spark: Any, tmp_path: Path) -> None:
    data = b'{"a":1}\n{not json\n{"a":2}\n'
    root, specs, _ = setup(tmp_path, data, [])
    rows = load(spark, root, specs, framing="lines").collect()
    assert sorted(json.loads(r.content)["a"] for r in rows) == [1, 2]
    with pytest.raises(Exception, match="bad frame at offset 8"):
        load(spark, root, specs, framing="lines", bad_frames="fail").collect()


@pytest.mark.slow
def test_a_corrupt_fragment_fails_naming_it(spark: Any, tmp_path: Path) -> None:
    data, _ = messages_bytes()
    root, specs, fragments = setup(tmp_path, data, [200])
    path = root / "store" / fragment_path(fragments[1])
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(Exception) as info:
        load(spark, root, specs).collect()
    assert fragment_path(fragments[1]) in str(info.value)


def gazctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gazctl.cli", *args], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_missing_java_and_unreachable_stores_are_one_line(tmp_path: Path) -> None:
    data, _ = messages_bytes()
    root, specs, _ = setup(tmp_path, data, [])
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # No java on it.
    result = gazctl("spark", "replay", "-l", f"name={JOURNAL}", "--specs", str(specs),
                    "--file-root", str(root), "--to", f"parquet:{tmp_path / 'out'}", env=env)  # fmt: skip
    assert result.returncode == 1
    assert (
        result.stderr.startswith("Error: Java is not installed") and result.stderr.count("\n") == 1
    )

    unreachable = tmp_path / "s3.yaml"
    unreachable.write_text(
        f"name: {JOURNAL}\nreplication: 1\nfragment:\n  stores: "
        '["s3://bucket/p/?endpoint=http%3A%2F%2F127.0.0.1%3A9&region=us-east-1"]\n'
    )
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    result = gazctl("spark", "compact", "-l", f"name={JOURNAL}", "--specs", str(unreachable),
                    "--dry-run", env=env)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: cannot list the fragments of {JOURNAL}")
    assert result.stderr.count("\n") == 1, result.stderr


# Lists of (producer, Clock, flags) a UUID carries.
UUID_PARTS = st.lists(
    st.tuples(
        st.binary(min_size=6, max_size=6), st.integers(1, (1 << 63) - 1), st.integers(0, 0x3FF)
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(uuids=UUID_PARTS, upper=st.booleans())
def test_uuid_columns_parse_as_parse_text(uuids: list[tuple[bytes, int, int]], upper: bool) -> None:
    texts = [str(build(producer, clock, flags)) for producer, clock, flags in uuids]
    if upper:
        texts = [t.upper() for t in texts]
    parsed = uuid_columns(texts)
    assert parsed is not None
    nodes, clocks, flags = parsed
    want = [parse_text(t) for t in texts]
    assert [int(n).to_bytes(6, "big") for n in nodes] == [w[0] for w in want]
    assert clocks.tolist() == [w[1] for w in want]
    assert flags.tolist() == [w[2] for w in want]
    assert list(hex_ids(nodes)) == [w[0].hex() for w in want]


@settings(max_examples=300, deadline=None)
@given(uuids=UUID_PARTS)
def test_uuid_texts_format_as_build(uuids: list[tuple[bytes, int, int]]) -> None:
    """The stream source's columns: each UUID's text and producer, formatted all at once."""
    import numpy as np

    texts, producers = uuid_texts(
        b"".join(u[0] for u in uuids),
        np.array([u[1] for u in uuids], np.int64),
        np.array([u[2] for u in uuids], np.int32),
    )
    assert [t.decode() for t in texts] == [str(build(*u)) for u in uuids]
    assert [p.decode() for p in producers] == [u[0].hex() for u in uuids]


@pytest.mark.parametrize(
    "bad",
    [
        "0b1c0a9e-8a2d-11ef-8000-0123456789a",  # short
        "0b1c0a9e-8a2d-11ef-8000-0123456789abc",  # long
        "0b1c0a9e_8a2d-11ef-8000-0123456789ab",  # no hyphen
        "0b1c0a9g-8a2d-11ef-8000-0123456789ab",  # not hex
        "0b1c0a9e-8a2d-21ef-8000-0123456789ab",  # version 2
        "0b1c0a9e-8a2d-11ef-c000-0123456789ab",  # another variant
        "0b1c0a9é-8a2d-11ef-8000-0123456789ab",  # not ASCII
        "0b1c0a9e-8a2d-11ef-8000-0123456789ab\x00",  # a trailing NUL
        "0b1c0a9e-8a2d-11ef-8000-0123456789a\x00",  # a NUL for a digit
    ],
)
def test_uuid_columns_refuse_what_parse_text_refuses(bad: str) -> None:
    good = "0b1c0a9e-8a2d-11ef-8000-0123456789ab"
    assert uuid_columns([good]) is not None
    assert uuid_columns([good, bad]) is None
    with pytest.raises(ValueError):
        parse_text(bad)


@pytest.mark.parametrize(
    "lines",
    [
        [b'{"_meta":{"uuid":"%s"}},{"a":1}' % str(build(bytes(range(1, 7)), 100, 0)).encode(),
         b'{"_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 101, 0)).encode()],
        [b'{"_meta":{"uuid":"%s"}, "x": [1' % str(build(bytes(range(1, 7)), 100, 0)).encode(),
         b"2]}", b'{"_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 101, 0)).encode()],
        [b'{"_meta":{"uuid":"%s"}},{"a":1}' % str(build(bytes(range(1, 7)), 98, 0)).encode(),
         b'{"_meta":{"uuid":"%s"}, "x": [{"a": 1}' % str(build(bytes(range(1, 7)), 99, 0)).encode(),
         b'{"b": 2}]}',
         b'{"_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 101, 0)).encode()],
        [b'{"x":"\xff\xfe","_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 99, 0)).encode(),
         b'{"_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 101, 0)).encode()],
        [b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}",
         b'{"_meta":{"uuid":"%s"}}' % str(build(bytes(range(1, 7)), 101, 0)).encode()],
    ],
    ids=["two documents on one line", "one document over two lines", "both: as many as lines",
         "not UTF-8 outside the UUID", "nested too deep"],
)  # fmt: skip
def test_json_lines_that_are_not_one_document_each_are_bad_frames(lines: list[bytes]) -> None:
    """The batch source's chunk path, on lines that decode to another number of documents
    than there are lines: each odd line is a bad frame, the good one a message at its offsets
    (found by review of the stream source's same path: the batch failed on mismatched column
    lengths)."""
    from gazctl.spark.source import FragmentPartition, _json_line_batches

    data = b"".join(line + b"\n" for line in lines)
    fragment = pb.Fragment(journal=JOURNAL, begin=0, end=len(data), compression_codec=pb.NONE)
    part = FragmentPartition(fragment.SerializeToString(), "lines", None, "_meta.uuid",
                             "skip", 0, len(data))  # fmt: skip
    rows = [r for b in _json_line_batches(fragment, iter([data]), part, 0) for r in b.to_pylist()]
    last = len(data) - len(lines[-1]) - 1
    assert [(r["offset"], r["clock"]) for r in rows if r["clock"]] == [(last, 101)], rows
