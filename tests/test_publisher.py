"""Publishing and reading messages on a real broker: committed and transactional messages, an
aborted transaction, duplicates from re-written appends, and corrupt frames, through the
read-uncommitted and read-committed iterators."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from broker.client.append_service import AppendService
from broker.client.appender import append
from broker.client.journals import dial
from broker.client.reader import read
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.testing import EtcdServer
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import (
    Publisher,
    Reader,
    read_committed,
    read_committed_batches,
    read_uncommitted,
)
from message.sequencer import Sequencer
from message.types import DictMessages
from message.uuid import Clock
from tests.helpers.journals import routed, started_brokers

JOURNALS = ["events/part-000", "events/part-001"]


def spec(name: str) -> pb.JournalSpec:
    out = pb.JournalSpec(name=name, replication=1)
    out.fragment.length = 1 << 20
    out.fragment.compression_codec = pb.NONE
    out.fragment.refresh_interval.seconds = 60
    return out


async def test_read_committed_sees_each_committed_message_once(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True) as (
        broker,
    ):
        async with broker.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(j)) for j in JOURNALS])
            for journal in JOURNALS:
                await routed(client, journal, 1)
        stub = pb_grpc.JournalStub(dial(broker.endpoint))  # type: ignore[no-untyped-call]
        partitions = [Partition(j, "application/x-ndjson") for j in JOURNALS]
        mapping = modulo_mapping(lambda m: str(m["key"]).encode(), lambda: partitions)
        messages = DictMessages()

        async with AppendService(stub) as service:
            committed = Publisher(service, messages, JSONLines())
            for i in range(6):
                await committed.publish_committed(mapping, {"key": i, "kind": "committed"})
            txn = Publisher(service, messages, JSONLines())
            for i in range(6):
                await txn.publish_uncommitted(mapping, {"key": i, "kind": "txn"})
            await txn.commit()
            aborted = Publisher(service, messages, JSONLines())
            for i in range(4):
                await aborted.publish_uncommitted(mapping, {"key": i, "kind": "aborted"})
            await service.flush()
            # The aborted publisher restarts (same producer) and acknowledges an earlier clock:
            # what it had pending is rolled back.
            restarted = Publisher(service, messages, JSONLines(), producer=aborted.producer)
            restarted._pending.update(dict.fromkeys(JOURNALS, 1))
            restarted.clock = Clock(1)
            await restarted.commit()
            # A publisher aborts a transaction itself, then carries on with a committed one.
            quitter = Publisher(service, messages, JSONLines())
            for i in range(5):
                await quitter.publish_uncommitted(mapping, {"key": i, "kind": "aborted"})
            await quitter.abort()
            for i in range(3):
                await quitter.publish_uncommitted(mapping, {"key": i, "kind": "after-abort"})
            await quitter.commit()
            await service.flush()

        # A retried append re-writes the transaction's bytes: duplicates in the journal.
        reader = Reader(messages, JSONLines())
        uncommitted: dict[str, list[Any]] = {}
        for journal in JOURNALS:
            uncommitted[journal] = [e async for e in read_uncommitted(stub, journal, reader)]
            txn_bytes = b"".join(
                (json.dumps(e.message) + "\n").encode()
                for e in uncommitted[journal]
                if e.message.get("kind") == "txn"
            )
            await append(stub, journal, txn_bytes)

        seen = []
        for journal in JOURNALS:
            one_by_one = []
            async for env in read_committed(stub, journal, reader, Sequencer()):
                if not env.is_ack:
                    seen.append((env.message["kind"], env.message["key"]))
                    one_by_one.append(env)
            # The bulk iterator delivers the same envelopes, ACKs left out; a ring of 1 makes
            # commits replay from the journal.
            for ring_size in (8192, 1):
                batches = read_committed_batches(
                    stub, journal, reader, Sequencer(ring_size=ring_size)
                )
                assert [e async for b in batches for e in b] == one_by_one
        assert sorted(seen) == sorted(
            [("committed", i) for i in range(6)]
            + [("txn", i) for i in range(6)]
            + [("after-abort", i) for i in range(3)]
        )
        # Read uncommitted shows what is really in the journals: pending, aborted, duplicates.
        kinds = [e.message.get("kind") for e in itertools.chain(*uncommitted.values())]
        assert kinds.count("aborted") == 4 + 5 and kinds.count("txn") == 6
        assert not reader.errors


async def test_corrupt_frames_are_reported_and_skipped(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True) as (
        broker,
    ):
        async with broker.client() as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec(JOURNALS[0]))])
            await routed(client, JOURNALS[0], 1)
        stub = pb_grpc.JournalStub(dial(broker.endpoint))  # type: ignore[no-untyped-call]
        good = b'{"n": 1}\n'
        bad = b"{not json\n"
        await append(stub, JOURNALS[0], good + bad + good)
        reader = Reader(DictMessages(), JSONLines())
        envelopes = [e async for e in read_uncommitted(stub, JOURNALS[0], reader)]
        assert [e.message for e in envelopes] == [{"n": 1}, {"n": 1}]
        assert [e.begin for e in envelopes] == [0, len(good) + len(bad)]
        (error,) = reader.errors
        assert error.offset == len(good)


async def test_one_producer_publishes_to_journals_of_different_content_types(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A publisher and the one it shares its identity with (`sharing`) write JSON lines and
    fixed-frame protobuf under one ProducerID and Clock; one set of ACK intents, each framed as
    its journal's messages, commits both journals' messages, and an abort rolls back both."""
    from google.protobuf import descriptor_pb2

    from message.framing import FixedProtobuf
    from message.types import ProtobufMessages
    from tests.helpers.messages import _proto_class

    lines, protos = "mixed/lines", "mixed/protos"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True) as (
        broker,
    ):
        async with broker.client() as client:
            specs = [spec(lines), spec(protos)]
            specs[0].labels.labels.add(name="content-type", value="application/x-ndjson")
            specs[1].labels.labels.add(name="content-type", value="application/x-protobuf-fixed")
            await client.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
            for journal in (lines, protos):
                await routed(client, journal, 1)
        stub = pb_grpc.JournalStub(dial(broker.endpoint))  # type: ignore[no-untyped-call]
        count = _proto_class(descriptor_pb2.FieldDescriptorProto.TYPE_BYTES)
        to_lines = lambda _m: Partition(lines, "application/x-ndjson")  # noqa: E731
        to_protos = lambda _m: Partition(protos, "application/x-protobuf-fixed")  # noqa: E731
        async with AppendService(stub) as service:
            dicts = Publisher(service, DictMessages(), JSONLines())
            counts = dicts.sharing(ProtobufMessages(count), FixedProtobuf())
            assert counts.producer == dicts.producer and counts.clock is dicts.clock
            await dicts.publish_uncommitted(to_lines, {"n": 1})
            await counts.publish_uncommitted(to_protos, count(ngram="one", count=1))
            await dicts.commit()  # Commits what `counts` published too.
            await counts.publish_uncommitted(to_protos, count(ngram="two", count=2))
            await dicts.publish_uncommitted(to_lines, {"n": 2})
            await counts.abort()  # Rolls back both.
            await dicts.publish_uncommitted(to_lines, {"n": 3})
            await counts.publish_uncommitted(to_protos, count(ngram="three", count=3))
            await counts.commit()
            await service.flush()

        async def committed(journal: str, reader: Reader[Any]) -> list[Any]:
            out = []
            async for envelope in read_committed(stub, journal, reader, Sequencer()):
                assert envelope.producer == dicts.producer
                if not envelope.is_ack:
                    out.append(envelope.message)
            return out

        got_lines = await committed(lines, Reader(DictMessages(), JSONLines()))
        assert [m["n"] for m in got_lines] == [1, 3]
        got_protos = await committed(protos, Reader(ProtobufMessages(count), FixedProtobuf()))
        assert [(m.ngram, m.count) for m in got_protos] == [("one", 1), ("three", 3)]


async def test_publishing_a_list_writes_what_publishing_each_message_writes(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """`publish_committed_many` and `publish_uncommitted_many` stamp one Clock tick per message
    in list order and write each journal's messages as one record: the bytes are those of the
    one-at-a-time path with the same clocks, the spans cover them, a transaction published as a
    list commits and aborts as one, and a message that cannot be encoded fails the call with
    nothing written or left pending."""
    from message.framing import CSV
    from message.types import CSVMessages
    from message.uuid import TICK, Flags, build, parse_text

    csv_journal = "events/csv"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, ["bk-0"], run_allocator=True) as (
        broker,
    ):
        async with broker.client() as client:
            await client.apply(
                [pb.ApplyRequest.Change(upsert=spec(j)) for j in [*JOURNALS, csv_journal]]
            )
            for journal in [*JOURNALS, csv_journal]:
                await routed(client, journal, 1)
        stub = pb_grpc.JournalStub(dial(broker.endpoint))  # type: ignore[no-untyped-call]
        partitions = [Partition(j, "application/x-ndjson") for j in JOURNALS]
        mapping = modulo_mapping(lambda m: str(m["key"]).encode(), lambda: partitions)
        messages, framing = DictMessages(), JSONLines()

        async with AppendService(stub) as service:
            publisher = Publisher(service, messages, framing)
            docs = [{"key": i % 3, "n": i} for i in range(10)]
            before = publisher.clock.value
            spans = await publisher.publish_committed_many(mapping, docs)
            assert publisher.clock.value > before
            # One span per journal, in the order of each journal's first message.
            order = list(dict.fromkeys(mapping(d).journal for d in docs))
            assert len(order) == 2
            assert [s.journal for s in spans] == order
            committed = [await s for s in spans]
            assert await publisher.publish_committed_many(mapping, []) == []

            # The clocks are TICK apart in list order; the bytes are the one-at-a-time path's.
            uuids = [messages.get_uuid(d) for d in docs]
            first = publisher.clock.value - (len(docs) - 1) * TICK
            assert [str(u) for u in uuids] == [
                str(build(publisher.producer, first + i * TICK, Flags.OUTSIDE_TXN))
                for i in range(len(docs))
            ]
            for span in committed:
                expected = bytearray()
                for doc in docs:
                    if mapping(doc).journal == span.journal:
                        framing.marshal(messages.encode(doc), expected)
                content = bytearray()
                async for chunk in read(stub, span.journal, 0, end_offset=span.end):
                    content += chunk.content
                assert bytes(content[span.begin : span.end]) == bytes(expected)

            # A transaction published as a list: committed by one ACK, or rolled back by one.
            txn = Publisher(service, messages, framing)
            await txn.publish_uncommitted_many(
                mapping, [{"key": i, "kind": "txn"} for i in range(4)]
            )
            await txn.commit()
            aborted = Publisher(service, messages, framing)
            await aborted.publish_uncommitted_many(
                mapping, [{"key": i, "kind": "aborted"} for i in range(4)]
            )
            await aborted.abort()

            # A message that cannot be encoded: the call fails, nothing is written or pending.
            failing = Publisher(service, messages, framing)
            heads = [await service.barrier(j) for j in JOURNALS]
            with pytest.raises(TypeError):
                await failing.publish_uncommitted_many(
                    mapping, [{"key": 1, "n": 1}, {"key": 2, "bad": object()}]
                )
            assert failing.build_ack_intents() == []
            assert [await service.barrier(j) for j in JOURNALS] == heads

            # Another framing and type (CSV rows): the generic path, the same bytes.
            rows = Publisher(service, CSVMessages(), CSV())
            to_csv = lambda _m: Partition(csv_journal, "text/csv")  # noqa: E731
            (csv_span,) = await rows.publish_committed_many(
                to_csv, [["", w] for w in ("a", "b,c", 'd"e')]
            )
            csv_done = await csv_span
            await service.flush()

        reader = Reader(messages, framing)
        kinds = []
        for journal in JOURNALS:
            async for envelope in read_committed(stub, journal, reader, Sequencer()):
                if not envelope.is_ack and "kind" in envelope.message:
                    kinds.append(envelope.message["kind"])
        assert sorted(kinds) == ["txn"] * 4
        content = bytearray()
        async for chunk in read(stub, csv_journal, 0, end_offset=csv_done.end):
            content += chunk.content
        lines = content.decode().splitlines()
        assert [parse_text(line.split(",", 1)[0])[0] for line in lines] == [rows.producer] * 3
        assert [line.split(",", 1)[1] for line in lines] == [
            "a",
            '"b,c"',
            '"d""e"',
        ]
