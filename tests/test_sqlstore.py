"""The SQL store on a real PostgreSQL: the checkpoint commits in the same SQL transaction as the
application's writes, restoring fences out older instances (a zombie's commit fails and its
writes roll back), and a shard on it, stopped anywhere and restarted, applies every message once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from google.protobuf import duration_pb2

from broker.client.append_service import AppendService
from broker.protocol import protocol_pb2_grpc as pb_grpc
from consumer.checkpoint import build_checkpoint, read_through_of
from consumer.protocol import cpb
from consumer.sqlstore import SQLStore
from consumer.store import FencedOut
from consumer.transaction import Shard, Source, run_shard
from message.framing import JSONLines
from message.mapping import Partition
from message.publisher import Publisher
from message.sequencer import Envelope
from message.types import DictMessages
from tests.helpers.consumers import (
    INPUT,
    OUTPUT,
    check_outputs,
    committed_outputs,
    publish_inputs,
    write_head,
)
from tests.helpers.waiting import until


@pytest.fixture
async def table(postgres_dsn: str) -> AsyncIterator[str]:
    """An application table of its own for each test (the server is shared)."""
    name = f"sums_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(postgres_dsn)
    await conn.execute(f"CREATE TABLE {name} (key TEXT PRIMARY KEY, total BIGINT NOT NULL)")
    try:
        yield name
    finally:
        await conn.execute(f"DROP TABLE {name}")
        await conn.close()


async def rows(dsn: str, table: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["key"]: r["total"] for r in await conn.fetch(f"SELECT key, total FROM {table}")}
    finally:
        await conn.close()


async def test_checkpoint_and_writes_commit_together(postgres_dsn: str, table: str) -> None:
    fqn = f"/test/items/{uuid.uuid4().hex[:8]}"
    store = SQLStore(postgres_dsn, fqn)
    assert await store.restore_checkpoint() == cpb.Checkpoint()
    conn = await store.transaction()
    await conn.execute(f"INSERT INTO {table} VALUES ('a', 3)")
    await store.start_commit(build_checkpoint({"in/a": 40}, {}))
    conn = await store.transaction()
    await conn.execute(f"INSERT INTO {table} VALUES ('b', 4)")  # Never committed.
    await store.close()

    again = SQLStore(postgres_dsn, fqn)
    assert read_through_of(await again.restore_checkpoint()) == {"in/a": 40}
    assert await rows(postgres_dsn, table) == {"a": 3}
    await again.close()


async def test_a_zombie_is_fenced_out_and_its_writes_roll_back(
    postgres_dsn: str, table: str
) -> None:
    fqn = f"/test/items/{uuid.uuid4().hex[:8]}"
    zombie = SQLStore(postgres_dsn, fqn)
    await zombie.restore_checkpoint()
    primary = SQLStore(postgres_dsn, fqn)
    await primary.restore_checkpoint()  # A new primary: the fence moves on.

    conn = await zombie.transaction()
    await conn.execute(f"INSERT INTO {table} VALUES ('zombie', 1)")
    with pytest.raises(FencedOut, match="another instance restored it"):
        await zombie.start_commit(build_checkpoint({"in/a": 99}, {}))
    conn = await primary.transaction()
    await conn.execute(f"INSERT INTO {table} VALUES ('primary', 2)")
    await primary.start_commit(build_checkpoint({"in/a": 10}, {}))
    assert await rows(postgres_dsn, table) == {"primary": 2}
    await zombie.close()
    await primary.close()
    reader = SQLStore(postgres_dsn, fqn)
    assert read_through_of(await reader.restore_checkpoint()) == {"in/a": 10}
    await reader.close()


class SQLSummer:
    """Adds each input to its key's row, and publishes the new total (uncommitted)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.consumed = 0

    async def consume_message(
        self, shard: Shard, store: SQLStore, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        conn = await store.transaction()
        total = await conn.fetchval(
            f"INSERT INTO {self.table} VALUES ($1, $2) ON CONFLICT (key)"
            f" DO UPDATE SET total = {self.table}.total + $2 RETURNING total",
            envelope.message["key"],
            envelope.message["n"],
        )
        self.consumed += 1
        await publisher.publish_uncommitted(
            lambda _m: Partition(OUTPUT, "application/x-ndjson"),
            {"key": envelope.message["key"], "sum": total},
        )

    async def finalize_txn(self, shard: Shard, store: SQLStore, publisher: Publisher[Any]) -> None:
        return None


async def test_a_shard_on_postgres_stopped_anywhere_applies_each_input_once(
    sums_stub: pb_grpc.JournalStub, postgres_dsn: str, table: str
) -> None:
    stub = sums_stub
    expected = await publish_inputs(stub, 300, seed=21)
    head = await write_head(stub, INPUT)
    fqn = f"/test/items/{uuid.uuid4().hex[:8]}"
    rng = random.Random(22)

    async def run_once(stop_after: int | None) -> None:
        app = SQLSummer(table)
        store = SQLStore(postgres_dsn, fqn)
        async with AppendService(stub) as service:
            spec = cpb.ShardSpec(
                id="summer-sql", sources=[cpb.ShardSpec.Source(journal=INPUT)],
                max_txn_duration=duration_pb2.Duration(nanos=100_000_000),
            )  # fmt: skip
            shard = Shard(spec, service, Publisher(service, DictMessages(), JSONLines()))
            source = Source(INPUT, DictMessages(), JSONLines())
            task = asyncio.create_task(run_shard(shard, app, store, [source], lambda: stub))
            try:
                if stop_after is None:
                    async with asyncio.timeout(60):
                        await shard.progress.wait_for({INPUT: head})
                else:
                    await until(
                        lambda: app.consumed >= stop_after or task.done(),
                        f"{stop_after} messages consumed",
                        timeout=60,
                        interval=0.001,  # Stopped as soon as it is there: mid-transaction.
                    )
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await store.close()

    for _ in range(6):
        await run_once(rng.randint(1, 60))
    await run_once(None)
    assert await rows(postgres_dsn, table) == dict(expected)
    check_outputs(await committed_outputs(stub), expected)


async def test_stores_of_many_shards_start_together_on_a_new_database(postgres_dsn: str) -> None:
    """Shards of several processes starting at once on a database without the checkpoints
    table: each creates it if missing, and none fails on PostgreSQL's catalog race."""
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_dsn)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        dsn = postgres_dsn.rsplit("/", 1)[0] + f"/{name}"
        stores = [SQLStore(dsn, f"/consumers/items/shard-{i}") for i in range(8)]
        try:
            checkpoints = await asyncio.gather(*(s.restore_checkpoint() for s in stores))
            assert all(c == cpb.Checkpoint() for c in checkpoints)
        finally:
            for store in stores:
                await store.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


def _store_backend(dsn: str) -> int:
    """The pid of the server process of the store's one pooled session."""
    from consumer.local_postgres import postgres_binary

    sql = "SELECT pid FROM pg_stat_activity WHERE application_name = 'gazette-sqlstore-test'"
    done = subprocess.run(
        [postgres_binary("psql"), "-At", "-c", sql, dsn], capture_output=True, text=True, timeout=20
    )
    pids = done.stdout.split()
    assert done.returncode == 0 and len(pids) == 1, done
    return int(pids[0])


@pytest.mark.parametrize("where", ["transaction", "commit"])
async def test_a_store_closes_after_a_transaction_cancelled_as_it_began(
    postgres_dsn: str, where: str
) -> None:
    """A shard that fails (PostgreSQL going down fails its commit) cancels its other tasks; one
    may be beginning the next SQL transaction, or a commit's, waiting on the server. The
    connection it took must go back to the pool, or `close` waits for it for ever: the shard
    never stops, never says FAILED, and stays PRIMARY doing nothing (found by the consumer
    campaign's `consumer-postgres-restart`, seed 20261130: asyncpg's "Pool.close() is taking
    over 60 seconds")."""
    dsn = f"{postgres_dsn}?application_name=gazette-sqlstore-test"
    store = SQLStore(dsn, f"shard-{uuid.uuid4().hex[:8]}")
    await store.restore_checkpoint()
    await store.start_commit(cpb.Checkpoint())  # Its pool's one connection, idle now.
    backend = _store_backend(postgres_dsn)
    os.kill(backend, signal.SIGSTOP)  # The server stops answering that session.
    try:
        if where == "transaction":
            begin: asyncio.Future[Any] = asyncio.ensure_future(store.transaction())
        else:
            begin = asyncio.ensure_future(store.start_commit(cpb.Checkpoint()))
        await asyncio.sleep(0.5)  # A hold: nothing answers the stopped session meanwhile.
        assert not begin.done()
        begin.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await begin
    finally:
        os.kill(backend, signal.SIGCONT)
    await asyncio.wait_for(store.close(), 10)
