"""Messages in and out of journals for tests: JSON documents published committed (or in one
transaction), and the committed documents of a journal read back, as an application's reader
sees them (read-committed, each once)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterable
from typing import Any, cast

from broker.client.append_service import AppendService
from broker.client.routes import Router
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Envelope, Sequencer
from message.types import DictMessages

NDJSON = "application/x-ndjson"


def _without_meta(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "_meta"}


async def publish(
    broker_address: str,
    journal: str,
    messages: Iterable[dict[str, Any]],
    *,
    transaction: bool = False,
) -> int:
    """Publish JSON `messages` to `journal` (JSON lines) through the brokers at
    `broker_address`, each committed at once, or with `transaction` all pending until one
    commit. Returns once every message committed; returns how many there were."""
    to_journal = Partition(journal, NDJSON)
    router = Router(broker_address)
    try:
        async with AppendService(router) as service:
            publisher = Publisher(service, DictMessages(), JSONLines())
            count = 0
            for message in messages:
                if transaction:
                    await publisher.publish_uncommitted(lambda _m: to_journal, dict(message))
                else:
                    await publisher.publish_committed(lambda _m: to_journal, dict(message))
                count += 1
            if transaction:
                await publisher.commit()
            await service.flush()
    finally:
        await router.close()
    return count


async def read_committed_messages(
    broker_address: str,
    journal: str,
    *,
    count: int | None = None,
    timeout: float = 30.0,
    with_meta: bool = False,
) -> list[dict[str, Any]]:
    """The committed JSON messages of `journal` from its start, each once, in order per
    producer (ACKs left out, and `_meta` unless `with_meta`).

    Without `count`: those committed up to the journal's write head now. With `count`: wait
    (blocking reads) until that many arrived, and fail with a TimeoutError saying how many
    did after `timeout` seconds."""
    router = Router(broker_address)
    reader = Reader(DictMessages(), JSONLines())
    out: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            envelopes = cast(
                AsyncGenerator[Envelope, None],
                read_committed(
                    router.stub_for(journal), journal, reader, Sequencer(), block=count is not None
                ),
            )
            async with contextlib.aclosing(envelopes):
                async for envelope in envelopes:
                    if envelope.is_ack:
                        continue
                    message = envelope.message
                    out.append(message if with_meta else _without_meta(message))
                    if count is not None and len(out) >= count:
                        break
    except TimeoutError:
        raise TimeoutError(
            f"{journal}: {len(out)} committed message(s) after {timeout:g}s, expected {count}"
        ) from None
    finally:
        await router.close()
    return out
