"""The recovery-log tests' shared parts. A pytest plugin (registered in conftest): one in-process
broker, a Journal stub to it, and fresh recovery-log journals on it. Then a writer of
hand-made logs (`LogWriter`: create, write, link and unlink operations, framed as a recorder
frames them)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from broker.client.journals import dial
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness, EtcdServer
from tests.helpers.journals import routed, started_brokers

RECOVERYLOG = "application/x-gazette-recoverylog"


@pytest.fixture
async def recovery_broker(
    etcd_server: EtcdServer, etcd_prefix: str
) -> AsyncIterator[BrokerHarness]:
    async with started_brokers(
        etcd_server.endpoint, etcd_prefix, ["bk-recovery"], run_allocator=True
    ) as (harness,):
        yield harness


@pytest.fixture
async def recovery_stub(recovery_broker: BrokerHarness) -> AsyncIterator[pb_grpc.JournalStub]:
    channel = dial(recovery_broker.endpoint)
    try:
        yield pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()


async def new_log(broker: BrokerHarness, fragment_length: int = 1 << 20) -> str:
    """A new recovery-log journal, placed."""
    name = f"recovery/logs/{uuid.uuid4().hex[:8]}"
    spec = pb.JournalSpec(name=name, replication=1)
    spec.fragment.length = fragment_length
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    spec.labels.labels.add(name="content-type", value=RECOVERYLOG)
    async with broker.client() as client:
        await client.apply([pb.ApplyRequest.Change(upsert=spec)])
        await routed(client, name, 1)
    return name


LOG = "recovery/logs/shard-a"


def crc32c_bitwise(crc: int, data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing `crc`, bit by bit."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@dataclass
class LogWriter:
    """Writes ops as a recorder would, from the format alone: each op gets the next sequence
    number and the checksum chained over the previous ops' bytes of its branch."""

    seq_no: int = 1
    checksum: int = 0
    offset: int = 0
    ops: list[tuple[rpb.RecordedOp, bytes]] = field(default_factory=list)

    def fork(self) -> LogWriter:
        return LogWriter(self.seq_no, self.checksum, self.offset, [])

    def op(self, author: int, **kind: object) -> rpb.RecordedOp:
        op = rpb.RecordedOp(seq_no=self.seq_no, checksum=self.checksum, author=author, **kind)  # type: ignore[arg-type]
        body = op.SerializeToString()
        length = 8 + len(body) + (op.write.length if op.HasField("write") else 0)
        meta = rpb.RecordedOp()
        meta.CopyFrom(op)
        meta.first_offset, meta.last_offset, meta.log = self.offset, self.offset + length, LOG
        self.ops.append((meta, body))
        self.seq_no += 1
        self.checksum = crc32c_bitwise(self.checksum, body)
        self.offset += length
        return meta


def create(path: str) -> dict[str, object]:
    return {"create": rpb.RecordedOp.Create(path=path)}


def write(fnode: int, offset: int, length: int) -> dict[str, object]:
    return {"write": rpb.RecordedOp.Write(fnode=fnode, offset=offset, length=length)}


def unlink(fnode: int, path: str) -> dict[str, object]:
    return {"unlink": rpb.RecordedOp.Link(fnode=fnode, path=path)}


def link(fnode: int, path: str) -> dict[str, object]:
    return {"link": rpb.RecordedOp.Link(fnode=fnode, path=path)}


def framed(ops: list[tuple[rpb.RecordedOp, bytes]], payloads: dict[int, bytes]) -> bytes:
    """The log bytes of `ops` (each op's frame, then its write's data from `payloads` by seq)."""
    out = b""
    for op, body in ops:
        out += b"\x66\x33\x93\x36" + len(body).to_bytes(4, "little") + body
        if op.HasField("write"):
            out += payloads[op.seq_no]
    return out
