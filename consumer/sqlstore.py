"""A store on PostgreSQL, with upstream's fence (`store-sqlstore`).

The shard's checkpoint lives in `gazette_checkpoints(shard_fqn PRIMARY KEY, fence, checkpoint)`.
Restoring increments the row's fence, and each commit updates the checkpoint only `WHERE fence`
is the one this instance restored with, in the same SQL transaction as the application's own
writes: a zombie primary's commit finds no row, fails with FencedOut, and everything it wrote in
that transaction is rolled back.

The application writes through `await store.transaction()`, the connection of the consumer
transaction in progress (begun on first use). `start_commit` takes that SQL transaction as the
commit: the next consumer transaction gets a new one, once this one has committed (so it reads
what this one wrote). `await store.pool()` is the connection pool, for reads of what is committed
(queries) and for schema changes. Needs the `sql` extra (asyncpg).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any

from consumer.protocol import cpb
from consumer.store import FencedOut

__all__ = ["SQLStore", "ensure_table"]

# Serializes CREATE TABLE IF NOT EXISTS across processes (an advisory lock's key).
_DDL_LOCK = 0x67617A65747465

TABLE = "gazette_checkpoints"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    shard_fqn  TEXT PRIMARY KEY NOT NULL,
    fence      INTEGER NOT NULL,
    checkpoint BYTEA NOT NULL
)"""


async def ensure_table(pool: Any, ddl: str) -> None:
    """Run a `CREATE TABLE IF NOT EXISTS`, under a lock: PostgreSQL's own check is not safe
    against concurrent creators (one fails on a unique index of its catalog)."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _DDL_LOCK)
        await conn.execute(ddl)


class SQLStore:
    def __init__(self, dsn: str, shard_fqn: str) -> None:
        self.dsn = dsn
        self.shard_fqn = shard_fqn
        self._pool: Any = None
        self._fence: int | None = None
        self._current: tuple[Any, Any] | None = None  # (connection, SQL transaction)
        self._committing: asyncio.Future[None] | None = None

    async def _connect(self) -> Any:
        if self._pool is None:
            import asyncpg

            self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=3)
            await ensure_table(self._pool, _SCHEMA)
        return self._pool

    @property
    def fence(self) -> int | None:
        """The fence this instance restored with (None before `restore_checkpoint`): each
        restore of the shard's checkpoint takes a greater one."""
        return self._fence

    async def pool(self) -> Any:
        """The store's asyncpg pool: its connections see only what is committed."""
        return await self._connect()

    async def restore_checkpoint(self) -> cpb.Checkpoint:
        pool = await self._connect()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                f"INSERT INTO {TABLE} (shard_fqn, fence, checkpoint) VALUES ($1, 0, '')"
                " ON CONFLICT (shard_fqn) DO NOTHING",
                self.shard_fqn,
            )
            row = await conn.fetchrow(
                f"UPDATE {TABLE} SET fence = fence + 1 WHERE shard_fqn = $1"
                " RETURNING fence, checkpoint",
                self.shard_fqn,
            )
        self._fence = int(row["fence"])
        return cpb.Checkpoint.FromString(bytes(row["checkpoint"]))

    async def transaction(self) -> Any:
        """The connection of the consumer transaction in progress, inside its SQL transaction:
        the application's reads and writes go through it."""
        if self._fence is None:
            raise RuntimeError("transaction before restore_checkpoint: the store is not fenced yet")
        if self._current is None:
            if self._committing is not None:
                # The previous consumer transaction commits first: this one reads its writes.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._committing)
            self._current = await self._begin()
        return self._current[0]

    async def _begin(self) -> tuple[Any, Any]:
        """A pooled connection inside a new SQL transaction. If beginning fails or is
        cancelled (the server going down, the shard stopping), the connection is dropped, so
        that it goes back to the pool and `close` does not wait for it."""
        pool = await self._connect()
        conn = await pool.acquire()
        try:
            txn = conn.transaction()
            await txn.start()
        except BaseException:
            conn.terminate()
            raise
        return conn, txn

    def start_commit(
        self, checkpoint: cpb.Checkpoint, wait_for: Sequence[Awaitable[object]] = ()
    ) -> Awaitable[None]:
        if self._fence is None:
            raise RuntimeError("commit before restore_checkpoint: the store is not fenced yet")
        current, self._current = self._current, None
        committing = asyncio.ensure_future(
            self._commit(current, self._fence, checkpoint.SerializeToString(), wait_for)
        )
        self._committing = committing
        return committing

    async def _commit(
        self,
        current: tuple[Any, Any] | None,
        fence: int,
        checkpoint: bytes,
        wait_for: Sequence[Awaitable[object]],
    ) -> None:
        pool = await self._connect()
        conn, txn = current if current is not None else await self._begin()
        try:
            for awaitable in wait_for:
                await awaitable
            status = await conn.execute(
                f"UPDATE {TABLE} SET checkpoint = $1 WHERE shard_fqn = $2 AND fence = $3",
                checkpoint,
                self.shard_fqn,
                fence,
            )
            if status != "UPDATE 1":
                raise FencedOut(
                    f"shard {self.shard_fqn}: another instance restored it (fence {fence} is "
                    "no longer current); this one must stop, and its transaction is rolled back"
                )
            await txn.commit()
        except BaseException:
            await _roll_back(txn, conn)
            raise
        finally:
            if not conn.is_closed():
                await pool.release(conn)

    async def close(self) -> None:
        if self._current is not None:
            conn, txn = self._current
            self._current = None
            await _roll_back(txn, conn)
            if not conn.is_closed():
                with contextlib.suppress(Exception):
                    await self._pool.release(conn)
        if self._committing is not None:
            with contextlib.suppress(BaseException):
                await self._committing
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), _CLOSE_TIMEOUT)
            except TimeoutError:  # A connection still busy: drop them all.
                pool.terminate()
        self._fence = None


# Seconds a rollback or the pool's graceful close may take before connections are dropped
# (the server then rolls back what they had begun).
_CLOSE_TIMEOUT = 5.0


async def _roll_back(txn: Any, conn: Any) -> None:
    """Roll back `txn`, or, if that fails, is cancelled or hangs (the server gone, or the
    connection busy with an operation a cancelled task left), drop the connection."""
    if conn.is_closed():
        return
    try:
        await asyncio.wait_for(txn.rollback(), _CLOSE_TIMEOUT)
    except asyncio.CancelledError:
        conn.terminate()
        raise
    except Exception:
        conn.terminate()
