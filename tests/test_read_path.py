"""The data path of reads: content responses parsed by hand as protobuf parses them, a broker
reading persisted fragments into buffers it takes again, and fragments of several blocks read
whole, verified, through the broker that holds them and through one that proxies to it, with
the dialer's stub (content parsed by hand) and the generated one."""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.client.journals import JournalStub, dial
from broker.client.reader import read
from broker.fragment import codecs
from broker.fragment.content import (
    READ_SIZE,
    Buffers,
    FragmentCorrupt,
    fragment_path,
    open_in_store,
)
from broker.fragment.fragments import sum_from_digest
from broker.fragment.stores import open_store
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import wire
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import journal_spec, set_journal, started_brokers
from tests.helpers.waiting import until

STORE = "file:///fragments/"
JOURNAL = "reads/journal"


# ---- content responses parsed by hand -------------------------------------------------------


@given(offset=st.integers(min_value=0, max_value=2**63 - 1), content=st.binary(max_size=300))
def test_content_responses_parse_by_hand_as_protobuf_parses_them(offset: int, content: bytes) -> None:  # fmt: skip
    raw = wire.read_content(offset, content)
    parsed = wire.parse_read_response(raw)
    expected = pb.ReadResponse.FromString(raw)
    assert (parsed.status, parsed.offset, parsed.content) == (pb.OK, offset, content)
    assert (parsed.write_head, parsed.fragment_url) == (expected.write_head, "")
    assert not parsed.HasField("fragment") and not parsed.HasField("header")
    assert parsed.SerializeToString() == raw
    if content:  # An empty one is protobuf's own (nothing of it to copy).
        assert isinstance(parsed, wire.ReadContent) and parsed.raw is raw


@pytest.mark.parametrize(
    "message",
    [
        pb.ReadResponse(),
        pb.ReadResponse(status=pb.OFFSET_NOT_YET_AVAILABLE, offset=5, write_head=9),
        pb.ReadResponse(offset=3, write_head=10, fragment=pb.Fragment(journal="a", end=10)),
        pb.ReadResponse(offset=3, content=b"x", write_head=4),  # Content, and more.
        pb.ReadResponse(header=pb.Header(process_id=pb.ProcessSpec.ID(zone="z", suffix="b"))),
        pb.ReadResponse(offset=-1, content=b"x"),  # A negative offset (a ten-byte varint).
    ],
)
def test_other_responses_are_protobufs(message: pb.ReadResponse) -> None:
    parsed = wire.parse_read_response(message.SerializeToString())
    assert isinstance(parsed, pb.ReadResponse) and parsed == message


def test_content_before_its_offset_is_parsed_by_protobuf() -> None:
    # Fields in another order than ours (another encoder's): still what protobuf reads.
    raw = b"\x3a\x02hi\x18\x05"
    parsed = wire.parse_read_response(raw)
    assert isinstance(parsed, pb.ReadResponse) and (parsed.offset, parsed.content) == (5, b"hi")


# ---- reading into buffers taken again ----------------------------------------------------------


def test_a_buffer_is_taken_again_once_no_view_of_it_is_left() -> None:
    buffers = Buffers(16)
    first = buffers.take()
    view = memoryview(first)[2:5]
    piece = view[1:]  # A view of the view: the buffer is still exported through it.
    del view
    second = buffers.take()
    assert second is not first and len(buffers) == 2
    del piece
    assert buffers.take() is first
    assert len(first) == 16 and len(buffers) == 2


def persist(root: Path, begin: int, content: bytes, codec: int = pb.NONE) -> pb.Fragment:
    """A fragment of `content` at `begin` put straight into the file store, as a broker would."""
    fragment = pb.Fragment(
        journal=JOURNAL, begin=begin, end=begin + len(content),
        sum=sum_from_digest(hashlib.sha1(content).digest()), compression_codec=codec,
        backing_store=STORE, mod_time=int(time.time()),
    )  # fmt: skip
    body = content if codec == pb.NONE else codecs.compress(codec, content)
    (root / "fragments").mkdir(exist_ok=True)
    assert open_store(STORE, file_root=root).put(fragment_path(fragment), io.BytesIO(body), len(body))  # fmt: skip
    return fragment


@pytest.mark.parametrize("at", [0, 1000, READ_SIZE + 7])
def test_blocks_read_into_buffers_are_the_fragments_content(tmp_path: Path, at: int) -> None:
    content = os.urandom(2 * READ_SIZE + 12345)
    fragment = persist(tmp_path, 0, content)
    store = open_store(STORE, file_root=tmp_path)
    buffers = Buffers()
    got = bytearray()
    for block in open_in_store(store, fragment, at, verify=False, buffers=buffers):
        assert isinstance(block, memoryview)
        got += block  # Copied out before the next block is read, as a broker does.
        del block
    assert got == content[at:]
    assert len(buffers) <= 2


def test_compressed_or_verified_blocks_are_their_own(tmp_path: Path) -> None:
    content = b"compressible " * 1000
    zipped = persist(tmp_path, 0, content, pb.GZIP)
    store = open_store(STORE, file_root=tmp_path)
    blocks = list(open_in_store(store, zipped, 0, verify=False, buffers=Buffers()))
    assert all(isinstance(b, bytes) for b in blocks) and b"".join(blocks) == content
    plain = persist(tmp_path, len(content), content)
    blocks = list(open_in_store(store, plain, plain.begin, verify=True, buffers=Buffers()))
    assert all(isinstance(b, bytes) for b in blocks) and b"".join(blocks) == content


def test_verified_blocks_are_hashed_beside_the_reading_and_the_last_waits_for_the_check(
    tmp_path: Path,
) -> None:
    content = os.urandom(3 * READ_SIZE + 5)
    good = persist(tmp_path, 0, content)
    store = open_store(STORE, file_root=tmp_path)
    assert b"".join(open_in_store(store, good, 0)) == content
    # The same name over other bytes (one flipped in the second block): every block but the
    # last may come out, then FragmentCorrupt; the last never does.
    path = tmp_path / "fragments" / fragment_path(good)
    flipped = bytearray(content)
    flipped[READ_SIZE + 1] ^= 1
    path.write_bytes(flipped)
    delivered = 0
    with pytest.raises(FragmentCorrupt, match="SHA-1"):
        for block in open_in_store(store, good, 0):
            delivered += len(block)
    assert delivered == 3 * READ_SIZE


# ---- whole fragments through brokers -----------------------------------------------------------


@pytest.fixture
async def brokers(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[list[BrokerHarness], Path]]:
    root = tmp_path / "root"
    (root / "fragments").mkdir(parents=True)
    ids = ["broker-a", "broker-b"]
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ids, file_root=str(root)
    ) as harnesses:
        yield harnesses, root


async def test_fragments_of_several_blocks_read_whole_through_a_replica_or_a_proxy(
    brokers: tuple[list[BrokerHarness], Path], etcd: aetcd.Client, etcd_prefix: str
) -> None:
    harnesses, root = brokers
    first = os.urandom(2 * READ_SIZE + 3)  # Blocks of 4 MiB, in responses of 256 KiB.
    second = os.urandom(1000)
    persist(root, 0, first)
    persist(root, len(first), second)
    end = len(first) + len(second)
    spec = journal_spec(JOURNAL, replication=1)
    spec.fragment.stores.append(STORE)
    await set_journal(etcd, etcd_prefix, spec, [("local", "broker-a")])
    replica = harnesses[0].broker.service.dialer.journal_stub(harnesses[0].endpoint)

    async def listed_store() -> bool:
        listed = await replica.ListFragments(pb.FragmentsRequest(journal=JOURNAL))
        return bool(listed.status == pb.OK and len(listed.fragments) == 2)

    await until(listed_store, "the replica listed the store", timeout=10, interval=0.05)

    # The dialer's stub parses content responses by hand; other responses are protobuf's.
    assert isinstance(replica, JournalStub)
    request = pb.ReadRequest(journal=JOURNAL, offset=0, end_offset=3 << 18)
    responses = [r async for r in replica.Read(request)]
    assert isinstance(responses[0], pb.ReadResponse) and responses[0].HasField("fragment")
    assert [type(r) for r in responses[1:]] == [wire.ReadContent] * 3

    for harness in harnesses:  # The replica, then a broker proxying to it.
        for stub in (
            harness.broker.service.dialer.journal_stub(harness.endpoint),
            pb_grpc.JournalStub(dial(harness.endpoint)),  # type: ignore[no-untyped-call]
        ):
            chunks = [c async for c in read(stub, JOURNAL, 0)]
            assert b"".join(c.content for c in chunks) == first + second
            assert [c.offset for c in chunks][:2] == [0, 1 << 18]
            assert {c.fragment.end for c in chunks if c.fragment} == {len(first), end}
            # From an offset inside a block (nothing to verify), and to an end offset.
            tail = [
                c.content async for c in read(stub, JOURNAL, READ_SIZE + 5, end_offset=end - 10)
            ]
            assert b"".join(tail) == (first + second)[READ_SIZE + 5 : end - 10]
