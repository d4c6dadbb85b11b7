"""Shared by the message benchmarks: 200-byte JSON documents, and journals of them built
without a publisher (so that setting a journal up is not what a benchmark measures)."""

from __future__ import annotations

from typing import Any

from message.framing import JSONLines
from message.types import DictMessages
from message.uuid import Flags, build, new_producer_id

MESSAGE_SIZE = 200
_BODY = "x" * 108  # With the id, key and _meta.uuid: 200 bytes framed, newline included.


def document(i: int) -> dict[str, Any]:
    return {"id": i, "key": f"key-{i % 1000:04d}", "body": _BODY}


def transactions(count: int, per_txn: int, producers: int = 4) -> tuple[bytes, int]:
    """`count` messages in transactions of `per_txn` (an ACK after each, from one of
    `producers` producers in turn), framed as JSON lines: the bytes, and the number of ACKs."""
    messages, framing = DictMessages(), JSONLines()
    ids = [new_producer_id() for _ in range(producers)]
    clock = 1 << 60
    out = bytearray()
    acks = 0
    for i in range(count):
        producer = ids[(i // per_txn) % producers]
        clock += 16
        doc = document(i)
        messages.set_uuid(doc, build(producer, clock, Flags.CONTINUE_TXN))
        framing.marshal(messages.encode(doc), out)
        if i % per_txn == per_txn - 1 or i == count - 1:
            clock += 16
            ack = messages.new_acknowledgement("")
            messages.set_uuid(ack, build(producer, clock, Flags.ACK_TXN))
            framing.marshal(messages.encode(ack), out)
            acks += 1
    return bytes(out), acks
