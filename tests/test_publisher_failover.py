"""Exactly-once across a broker failure: a publisher's batch commits on the brokers, the primary
dies before its answer reaches the client, and AppendService retries the batch through another
broker. The journal then holds the batch twice; a read-committed reader sees every message once.

The answer is kept from the client by a TCP proxy that holds the primary's bytes (a real
one-way network fault), so the duplicate happens on every run, not by the luck of timing."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from pathlib import Path

import pytest

from broker.client.append_service import AppendService
from broker.client.dialer import Dialer
from broker.client.reader import read
from broker.testing import EtcdServer, stop_processes
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher, Reader, read_committed, read_uncommitted
from message.types import DictMessages
from tests.conftest import BrokerProcess
from tests.helpers.brokers import placed, start_brokers
from tests.helpers.tcp_proxy import TcpProxy, host_port
from tests.helpers.waiting import until

JOURNAL = "exactly/once"


async def journal_length(dialer: Dialer, address: str) -> int:
    end = 0
    async for chunk in read(dialer.journal_stub(address), JOURNAL, 0, do_not_proxy=True):
        end = chunk.offset + len(chunk.content)
    return end


@pytest.mark.slow
async def test_retried_batch_is_duplicated_in_the_journal_but_read_once(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    brokers: list[BrokerProcess] = []
    dialer = Dialer()
    try:
        start_brokers(etcd_server, tmp_path, brokers)
        route = await placed(brokers[0].address, JOURNAL)
        members = [brokers[int(m.suffix.removeprefix("broker-"))] for m in route.members]
        primary = members[route.primary]
        others = [b for b in members if b is not primary]  # Replicas that hold it all.

        proxy = TcpProxy(host_port(primary.address))
        async with proxy.serving():
            partition = Partition(JOURNAL, "application/x-ndjson")

            def mapping(_msg: object) -> Partition:
                return partition

            messages, framing = DictMessages(), JSONLines()
            async with AppendService(dialer.journal_stub(proxy.address)) as service:
                before = Publisher(service, messages, framing)
                for i in range(20):
                    last = await before.publish_committed(mapping, {"id": f"before-{i}"})
                end_before = (await last).end  # Answered through the proxy: it is up.

                # The batch that will be retried: committed messages and a transaction's, all
                # written before this task yields, so that they make one batch.
                proxy.holding = True
                committed = Publisher(service, messages, framing)
                txn = Publisher(service, messages, framing)
                pending = []
                for i in range(30):
                    pending.append(
                        await committed.publish_committed(mapping, {"id": f"committed-{i}"})
                    )
                    pending.append(await txn.publish_uncommitted(mapping, {"id": f"txn-{i}"}))
                assert len({p.batch for p in pending}) == 1
                batch_end = end_before + pending[-1].offset + pending[-1].length
                commit = asyncio.ensure_future(txn.commit())

                # Once the batch is durable on the brokers (read through another one), the
                # primary dies without its answer ever reaching the client.
                async def durable() -> bool:
                    return await journal_length(dialer, others[0].address) >= batch_end

                await until(durable, "the batch durable on another broker", 20, 0.05)
                assert not commit.done() and not pending[0].done()
                os.kill(primary.proc.pid, signal.SIGKILL)
                primary.proc.wait()
                proxy.upstream = host_port(others[0].address)
                proxy.cut()  # The client sees its call fail, and retries through the proxy.

                async with asyncio.timeout(60):
                    spans = await commit
                assert spans and spans[0].journal == JOURNAL

                after = Publisher(service, messages, framing)
                for i in range(20):
                    await after.publish_committed(mapping, {"id": f"after-{i}"})
                aborted = Publisher(service, messages, framing)
                for i in range(5):
                    await aborted.publish_uncommitted(mapping, {"id": f"aborted-{i}"})
                await service.flush()

        # Read from a replica that was in the route from the start (one that joined after the
        # failure holds only what came after, and this journal has no fragment store).
        stub = dialer.journal_stub(others[0].address)
        reader = Reader(messages, framing)
        raw = [e async for e in read_uncommitted(stub, JOURNAL, reader, do_not_proxy=True)]
        raw_ids = collections.Counter(e.message.get("id") for e in raw if not e.is_ack)
        # The retried batch is in the journal twice.
        assert raw_ids["committed-0"] == raw_ids["txn-29"] == 2
        assert raw_ids["before-0"] == raw_ids["after-0"] == 1

        got = [
            e.message["id"]
            async for e in read_committed(
                stub, JOURNAL, Reader(messages, framing), do_not_proxy=True
            )
            if not e.is_ack
        ]
        expected = (
            [f"before-{i}" for i in range(20)]
            + [f"committed-{i}" for i in range(30)]
            + [f"txn-{i}" for i in range(30)]
            + [f"after-{i}" for i in range(20)]
        )
        assert len(got) == len(set(got)), "a message was read twice"
        assert sorted(got) == sorted(expected)  # No aborted message; every committed one once.
        # In order per producer.
        assert [i for i in got if i.startswith("txn-")] == [f"txn-{i}" for i in range(30)]
        assert not reader.errors
    finally:
        await dialer.close()
        stop_processes(b.proc for b in brokers)
