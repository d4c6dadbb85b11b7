"""stream-sum, upstream's soak test of exactly-once across failures.

A *chunker* publishes committed chunks of random streams, partitioned over the chunk journals
(`PREFIX/chunks/part-NNN`); each chunk carries its stream, its sequence number and a value, and
the last one says so. A few streams are in progress at once (`--concurrent`), so streams complete
all through the run, not all at its end. *Summers*, consumer processes hosting one shard per chunk
journal, keep each stream's running sum in their store and, at its last chunk, publish the
stream's sum to `PREFIX/sums` (the shard's label `stream-sum/sums` names it; in the transaction:
committed by its ACK). A chunk applied twice, or skipped, makes a sum wrong, and a summer that
sees a chunk out of sequence fails its shard. The chunker reads the sums back, read committed,
and exits 0 only when every stream's sum arrived exactly right, or non-zero naming the first
wrong or missing one.

`setup --store` picks the shards' store: `json` (a JSON file per shard under
`--summer.store-root`), `postgres` (a `stream_sums` table and upstream's fenced checkpoints in the
PostgreSQL of `--summer.postgres DSN`), or `sqlite` (SQLite recorded into the shard's recovery
log). `--standbys` sets each shard's hot standbys, and `--prefix` names the journals
(`PREFIX/...`) and shards (`NAME-NNN`, NAME being the prefix below `examples/`, slashes made
dashes), so that two runs can share a cluster.

    python -m consumer.examples.stream_sum setup --partitions 2 [--store sqlite] [--prefix P]
    python -m consumer.examples.stream_sum serve --etcd.prefix /stream-sum --summer.store-root DIR
    python -m consumer.examples.stream_sum chunker --streams 50 --chunks 20 [--prefix P]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from typing import Any

import click

from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.client.reader import write_head
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from consumer.client import ShardsClient
from consumer.main import run_command, serve_command
from consumer.protocol import cpb
from consumer.sqlstore import SQLStore, ensure_table
from consumer.store import JSONFileStore
from consumer.store_sqlite import SQLiteStore, wants_sqlite
from consumer.transaction import Shard
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Envelope, Sequencer
from message.types import DictMessages
from plumbing import config as cfg

PREFIX = "examples/stream-sum"
NDJSON = "application/x-ndjson"
SUMS_LABEL = "stream-sum/sums"  # On each shard: the journal its sums go to.
STORES = ("json", "postgres", "sqlite")
TABLE = "stream_sums"

Store = JSONFileStore | SQLiteStore | SQLStore


def chunk_journal(i: int, prefix: str = PREFIX) -> str:
    return f"{prefix}/chunks/part-{i:03d}"


def sums_journal(prefix: str = PREFIX) -> str:
    return f"{prefix}/sums"


def shard_id(i: int, prefix: str = PREFIX) -> str:
    """`stream-sum-000` for the default prefix; below `examples/`, or else the whole prefix,
    with dashes for slashes."""
    return f"{prefix.removeprefix('examples/').replace('/', '-')}-{i:03d}"


SUMS = sums_journal()


class OutOfSequence(RuntimeError):
    """A chunk that is not the next of its stream: applied twice, or one skipped."""


class Summer:
    """Sums each stream's chunks in the store; publishes the sum at the stream's last chunk.

    Each sum says which shard published it and which restore of the shard's store did
    (`fence`, for the stores that fence; `restored`, the wall-clock time the store was made):
    a fault campaign tells a zombie's commit from its successor's by them."""

    def __init__(self, store_root: str | None, postgres: str | None = None) -> None:
        self.store_root, self.postgres = store_root, postgres
        self._restored: dict[str, float] = {}

    async def new_store(self, shard: Shard) -> Store:
        self._restored[shard.spec.id] = time.time()
        if wants_sqlite(shard):
            return SQLiteStore(shard.recorder)
        if labels.value_of(shard.spec.labels, "store") == "postgres":
            if not self.postgres:
                raise ValueError(
                    f"shard {shard.spec.id} keeps its sums in PostgreSQL (label store: postgres):"
                    " start the summer with --summer.postgres DSN"
                )
            store = SQLStore(self.postgres, shard.fqn or shard.spec.id)
            await ensure_table(
                await store.pool(),
                f"CREATE TABLE IF NOT EXISTS {TABLE} (shard TEXT NOT NULL, stream TEXT NOT NULL,"
                " seq INTEGER NOT NULL, total BIGINT NOT NULL, PRIMARY KEY (shard, stream))",
            )
            return store
        if not self.store_root:
            raise ValueError(
                f"shard {shard.spec.id} keeps its sums in JSON files: start the summer with "
                "--summer.store-root DIR"
            )
        return JSONFileStore(self.store_root, shard.spec.id)

    async def consume_message(
        self, shard: Shard, store: Store, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        chunk = envelope.message
        stream, seq, value, last = chunk["stream"], chunk["seq"], chunk["value"], chunk["last"]
        if isinstance(store, SQLiteStore):
            before, total = await store.run(lambda db: _sum_in_sqlite(db, stream, seq, value, last))
        elif isinstance(store, SQLStore):
            before, total = await _sum_in_postgres(
                await store.transaction(), shard.spec.id, stream, seq, value, last
            )
        else:
            state = store.state.setdefault(stream, {"seq": 0, "sum": 0})
            before, total = state["seq"], state["sum"] + value
            if seq == before + 1:
                state["seq"], state["sum"] = seq, total
                if last:
                    del store.state[stream]
        if seq != before + 1:
            raise OutOfSequence(
                f"stream {stream}: chunk {seq} after chunk {before} (at {envelope.journal}"
                f":{envelope.begin})"
            )
        if last:
            sums = labels.value_of(shard.spec.labels, SUMS_LABEL) or SUMS
            fence = getattr(store, "fence", None)
            await publisher.publish_uncommitted(
                lambda _m: Partition(sums, NDJSON),
                {
                    "stream": stream, "sum": total, "chunks": seq, "shard": shard.spec.id,
                    "pid": os.getpid(), "fence": fence,
                    "restored": self._restored.get(shard.spec.id, 0.0),
                },
            )  # fmt: skip

    async def finalize_txn(self, shard: Shard, store: Store, publisher: Publisher[Any]) -> None:
        return None


async def _sum_in_postgres(
    conn: Any, shard: str, stream: str, seq: int, value: int, last: bool
) -> tuple[int, int]:
    """In the consumer transaction's SQL transaction: as `_sum_in_sqlite`."""
    row = await conn.fetchrow(
        f"SELECT seq, total FROM {TABLE} WHERE shard = $1 AND stream = $2", shard, stream
    )
    before, total = (int(row["seq"]), int(row["total"])) if row else (0, 0)
    if seq != before + 1:
        return before, total
    total += value
    if last:
        await conn.execute(f"DELETE FROM {TABLE} WHERE shard = $1 AND stream = $2", shard, stream)
    else:
        await conn.execute(
            f"INSERT INTO {TABLE} (shard, stream, seq, total) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (shard, stream) DO UPDATE SET seq = $3, total = $4",
            shard, stream, seq, total,
        )  # fmt: skip
    return before, total


def _sum_in_sqlite(db: Any, stream: str, seq: int, value: int, last: bool) -> tuple[int, int]:
    """On the store's thread: add a chunk to its stream's row (removed at the last chunk);
    the stream's sequence number before it, and its sum with it."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS sums (stream TEXT PRIMARY KEY, seq INTEGER, total INTEGER)"
    )
    row = db.execute("SELECT seq, total FROM sums WHERE stream = ?", (stream,)).fetchone()
    before, total = (row[0], row[1]) if row else (0, 0)
    if seq != before + 1:
        return before, total
    total += value
    if last:
        db.execute("DELETE FROM sums WHERE stream = ?", (stream,))
    else:
        db.execute("INSERT OR REPLACE INTO sums VALUES (?, ?, ?)", (stream, seq, total))
    return before, total


RECOVERYLOG = "application/x-gazette-recoverylog"


def journal_spec(name: str, replication: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = 1 << 24
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    spec.labels.labels.add(name="content-type", value=NDJSON)
    return spec


def shard_spec(i: int, prefix: str, standbys: int, store: str) -> cpb.ShardSpec:
    spec = cpb.ShardSpec(
        id=shard_id(i, prefix),
        sources=[cpb.ShardSpec.Source(journal=chunk_journal(i, prefix))],
        hot_standbys=standbys,
    )
    spec.max_txn_duration.FromMilliseconds(500)
    spec.labels.labels.add(name=SUMS_LABEL, value=sums_journal(prefix))
    if store == "sqlite":
        spec.recovery_log_prefix = f"{prefix}/recovery"
        # No hint_prefix: the consumer keeps hints under its own root (<etcd prefix>/hints).
        spec.hint_backups = 2
    if store != "json":
        spec.labels.labels.add(name="store", value=store)
    spec.labels.labels.sort(key=lambda label: (label.name, label.value))
    return spec


async def _setup(
    broker_address: str,
    consumer_address: str,
    partitions: int,
    replication: int,
    store: str,
    prefix: str = PREFIX,
    standbys: int = 1,
) -> None:
    names = [chunk_journal(i, prefix) for i in range(partitions)] + [sums_journal(prefix)]
    logs = (
        [f"{prefix}/recovery/{shard_id(i, prefix)}" for i in range(partitions)]
        if store == "sqlite"
        else []
    )
    async with JournalsClient(broker_address) as journals:
        have = {j.spec.name for j in (await journals.list()).journals}
        missing = [
            pb.ApplyRequest.Change(upsert=journal_spec(n, replication))
            for n in names
            if n not in have
        ]
        for name in logs:
            if name not in have:
                log_spec = journal_spec(name, replication)
                log_spec.labels.labels[0].value = RECOVERYLOG
                missing.append(pb.ApplyRequest.Change(upsert=log_spec))
        if missing:
            await journals.apply(missing)
    async with ShardsClient(consumer_address) as shards:
        listed = {s.spec.id for s in (await shards.list()).shards}
        changes = [
            cpb.ApplyRequest.Change(upsert=shard_spec(i, prefix, standbys, store))
            for i in range(partitions)
            if shard_id(i, prefix) not in listed
        ]
        if changes:
            await shards.apply(changes)


def _stream_key(message: dict[str, Any]) -> bytes:
    return str(message["stream"]).encode()


def chunk_schedule(
    rng: random.Random, run: str, streams: int, chunks: int, concurrent: int
) -> list[tuple[str, int, int, bool]]:
    """Every chunk, in publishing order: (stream, seq, value, last). At most `concurrent`
    streams are in progress at once, a new one starting as one ends, so that streams complete
    all through the run (and a fault early in it meets streams that end); chunks of the
    streams in progress interleave at random."""
    waiting = [f"{run}-{s:05d}" for s in range(streams)]
    waiting.reverse()
    cursors: dict[str, int] = {}
    out: list[tuple[str, int, int, bool]] = []
    while waiting or cursors:
        while waiting and len(cursors) < concurrent:
            cursors[waiting.pop()] = 0
        stream = rng.choice(sorted(cursors))
        seq = cursors[stream] + 1
        last = seq == chunks
        out.append((stream, seq, rng.randint(-1000, 1000), last))
        if last:
            del cursors[stream]
        else:
            cursors[stream] = seq
    return out


async def _chunker(
    broker_address: str,
    streams: int,
    chunks: int,
    seed: int,
    timeout: float,
    pace: float,
    prefix: str = PREFIX,
    concurrent: int = 4,
) -> str:
    """Publish the streams, then wait for their sums: "" if all are right, else the first
    problem."""
    rng = random.Random(seed)
    run = f"{seed:x}-{rng.getrandbits(32):08x}"
    sums = sums_journal(prefix)
    async with JournalsClient(broker_address) as journals:
        listed = (await journals.list()).journals
        parts = sorted(j.spec.name for j in listed if j.spec.name.startswith(f"{prefix}/chunks/"))
        if not parts:
            return f"no chunk journals under {prefix}/chunks/: run `setup` first"
        start = await write_head(journals.stub, sums)
        partitions = [Partition(p, NDJSON) for p in parts]
        mapping = modulo_mapping(_stream_key, lambda: partitions)
        expected: dict[str, int] = {}
        async with AppendService(journals.stub) as service:
            publisher = Publisher(service, DictMessages(), JSONLines())
            schedule = chunk_schedule(rng, run, streams, chunks, concurrent)
            for written, (stream, seq, value, last) in enumerate(schedule, 1):
                expected[stream] = expected.get(stream, 0) + value
                await publisher.publish_committed(
                    mapping, {"stream": stream, "seq": seq, "value": value, "last": last}
                )
                if pace and written % 100 == 0:
                    await asyncio.sleep(pace)  # Spread over time, to soak across failures.
            await service.flush()
        got: dict[str, int] = {}
        reader = Reader(DictMessages(), JSONLines())
        try:
            async with asyncio.timeout(timeout):
                async for envelope in read_committed(
                    journals.stub, sums, reader, Sequencer(), start, block=True
                ):
                    message = envelope.message
                    stream = message.get("stream", "")
                    if envelope.is_ack or stream not in expected:
                        continue
                    if stream in got:
                        return (
                            f"stream {stream}: a second sum {message['sum']} (first {got[stream]})"
                        )
                    got[stream] = message["sum"]
                    if got[stream] != expected[stream]:
                        return f"stream {stream}: sum {got[stream]}, expected {expected[stream]}"
                    if len(got) == len(expected):
                        return ""
        except TimeoutError:
            pass
        missing = sorted(set(expected) - set(got))
        return f"stream {missing[0]}: no sum within {timeout:g}s ({len(missing)} of {len(expected)} missing)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """stream-sum: exactly-once soak test of consumers."""


@cli.command()
@cfg.option(
    "--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"
)
@cfg.option(
    "--consumer.address",
    default="http://localhost:8080",
    help="Service address of a stream-sum consumer",
)
@click.option(
    "--partitions",
    default=2,
    type=click.IntRange(1, 999),
    show_default=True,
    help="Chunk journals (and shards)",
)
@click.option(
    "--replication",
    default=1,
    type=click.IntRange(1),
    show_default=True,
    help="Replication of the journals",
)
@click.option(
    "--store", default="json", type=click.Choice(STORES), show_default=True,
    help="The shards' store: JSON files, PostgreSQL (the summers' --summer.postgres), or SQLite "
    "recorded into a recovery log per shard",
)  # fmt: skip
@click.option(
    "--standbys", default=1, type=click.IntRange(0), show_default=True,
    help="Hot standbys of each shard",
)  # fmt: skip
@click.option(
    "--prefix", default=PREFIX, show_default=True, callback=lambda _c, _p, v: _valid_prefix(v),
    help="Name prefix of the journals (PREFIX/...) and shards, so that runs can share a cluster",
)  # fmt: skip
def setup(
    partitions: int, replication: int, store: str, standbys: int, prefix: str, **opts: Any
) -> None:
    """Create the chunk and sum journals, and a shard per chunk journal."""
    run_command(
        _setup(
            opts["broker_address"], opts["consumer_address"], partitions, replication, store,
            prefix, standbys,
        )
    )  # fmt: skip


def _valid_prefix(prefix: str) -> str:
    from broker.protocol.validate import ValidationError, validate_journal_name

    try:
        validate_journal_name(f"{prefix}/sums")
    except ValidationError as exc:
        raise click.BadParameter(f"{prefix!r} is not a journal name prefix ({exc})") from None
    return prefix.rstrip("/")


@cli.command()
@cfg.option(
    "--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"
)
@click.option(
    "--streams", default=20, type=click.IntRange(1), show_default=True, help="Streams to publish"
)
@click.option(
    "--chunks", default=10, type=click.IntRange(1), show_default=True, help="Chunks per stream"
)
@click.option("--seed", default=None, type=int, help="Random seed (default: a new one)")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the sums")
@click.option(
    "--pace", default=0.0, show_default=True, help="Seconds to pause after every 100 chunks"
)
@click.option(
    "--concurrent", default=4, type=click.IntRange(1), show_default=True,
    help="Streams in progress at once (a new one starts as one ends)",
)  # fmt: skip
@click.option(
    "--prefix", default=PREFIX, show_default=True, callback=lambda _c, _p, v: _valid_prefix(v),
    help="Name prefix of the journals, as given to setup",
)  # fmt: skip
def chunker(
    streams: int,
    chunks: int,
    seed: int | None,
    timeout: float,
    pace: float,
    concurrent: int,
    prefix: str,
    **opts: Any,
) -> None:
    """Publish the streams' chunks; exit 0 once every sum arrived exactly right."""
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 31)
    problem = run_command(
        _chunker(opts["broker_address"], streams, chunks, seed, timeout, pace, prefix, concurrent)
    )
    if problem:
        click.echo(f"stream-sum chunker (seed {seed}): {problem}", err=True)
        sys.exit(1)
    click.echo(f"stream-sum chunker (seed {seed}): {streams} sums of {chunks} chunks, all exact")


def _summer(opts: dict[str, Any]) -> Summer:
    return Summer(opts["summer_store_root"], opts["summer_postgres"])


cli.add_command(
    serve_command(
        "stream-sum",
        _summer,
        click.option(
            "--summer.store-root", "summer_store_root", required=True,
            envvar="SUMMER_STORE_ROOT", show_envvar=True,
            type=click.Path(file_okay=False), help="Directory of the shards' JSON-file stores",
        ),
        click.option(
            "--summer.postgres", "summer_postgres", default=None,
            envvar="SUMMER_POSTGRES", show_envvar=True,
            help="PostgreSQL DSN of the shards labelled store: postgres",
        ),
    )
)  # fmt: skip


if __name__ == "__main__":
    cli(prog_name="stream-sum")
