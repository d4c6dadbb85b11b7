"""stream-sum, upstream's soak test of exactly-once across failures.

A *chunker* publishes committed chunks of random streams, partitioned over the chunk journals
(`PREFIX/chunks/part-NNN`); each chunk carries its stream, its sequence number and a value, and
the last one says so. *Summers*, consumer processes hosting one shard per chunk journal, keep each
stream's running sum in their store and, at its last chunk, publish the stream's sum to
`PREFIX/sums` (in the transaction: committed by its ACK). A chunk applied twice, or skipped, makes
a sum wrong, and a summer that sees a chunk out of sequence fails its shard. The chunker reads the
sums back, read committed, and exits 0 only when every stream's sum arrived exactly right, or
non-zero naming the first wrong or missing one.

A shard keeps its sums in a JSON-file store, or, labelled `store: sqlite` (`setup --store
sqlite`), in a SQLite store recorded into its recovery log, with hot standbys that tail it.

    python -m consumer.examples.stream_sum setup --partitions 2 [--store sqlite]
    python -m consumer.examples.stream_sum serve --etcd.prefix /stream-sum --summer.store-root DIR
    python -m consumer.examples.stream_sum chunker --streams 50 --chunks 20
"""

from __future__ import annotations

import asyncio
import random
import sys
from typing import Any

import click

from broker import config as cfg
from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.client.reader import write_head
from broker.message.framing import DictMessages, JSONLines
from broker.message.mapping import Partition, modulo_mapping
from broker.message.publisher import Publisher, Reader, read_committed
from broker.message.sequencer import Envelope, Sequencer
from broker.protocol import protocol_pb2 as pb
from consumer.client import ShardsClient
from consumer.main import run_command, serve_command
from consumer.protocol import cpb
from consumer.store import JSONFileStore
from consumer.store_sqlite import SQLiteStore, wants_sqlite
from consumer.transaction import Shard

PREFIX = "examples/stream-sum"
NDJSON = "application/x-ndjson"


def chunk_journal(i: int) -> str:
    return f"{PREFIX}/chunks/part-{i:03d}"


SUMS = f"{PREFIX}/sums"


class OutOfSequence(RuntimeError):
    """A chunk that is not the next of its stream: applied twice, or one skipped."""


class Summer:
    """Sums each stream's chunks in the store; publishes the sum at the stream's last chunk."""

    def __init__(self, store_root: str) -> None:
        self.store_root = store_root

    async def new_store(self, shard: Shard) -> JSONFileStore | SQLiteStore:
        if wants_sqlite(shard):
            return SQLiteStore(shard.recorder)
        return JSONFileStore(self.store_root, shard.spec.id)

    async def consume_message(
        self,
        shard: Shard,
        store: JSONFileStore | SQLiteStore,
        envelope: Envelope,
        publisher: Publisher[Any],
    ) -> None:
        chunk = envelope.message
        stream, seq, value, last = chunk["stream"], chunk["seq"], chunk["value"], chunk["last"]
        if isinstance(store, SQLiteStore):
            before, total = await store.run(lambda db: _sum_in_sqlite(db, stream, seq, value, last))
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
            await publisher.publish_uncommitted(
                lambda _m: Partition(SUMS, NDJSON),
                {"stream": stream, "sum": total, "chunks": seq},
            )

    async def finalize_txn(
        self, shard: Shard, store: JSONFileStore, publisher: Publisher[Any]
    ) -> None:
        return None


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


RECOVERY_PREFIX = f"{PREFIX}/recovery"
RECOVERYLOG = "application/x-gazette-recoverylog"


def journal_spec(name: str, replication: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = 1 << 24
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval.seconds = 60
    spec.labels.labels.add(name="content-type", value=NDJSON)
    return spec


async def _setup(
    broker_address: str, consumer_address: str, partitions: int, replication: int, store: str
) -> None:
    names = [chunk_journal(i) for i in range(partitions)] + [SUMS]
    logs = (
        [f"{RECOVERY_PREFIX}/stream-sum-{i:03d}" for i in range(partitions)]
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
        changes = []
        for i in range(partitions):
            shard_id = f"stream-sum-{i:03d}"
            if shard_id in listed:
                continue
            spec = cpb.ShardSpec(
                id=shard_id,
                sources=[cpb.ShardSpec.Source(journal=chunk_journal(i))],
                hot_standbys=1,
            )
            spec.max_txn_duration.FromMilliseconds(500)
            if store == "sqlite":
                spec.recovery_log_prefix = RECOVERY_PREFIX
                spec.hint_prefix = "/gazette/hints"
                spec.hint_backups = 2
                spec.labels.labels.add(name="store", value="sqlite")
            changes.append(cpb.ApplyRequest.Change(upsert=spec))
        if changes:
            await shards.apply(changes)


def _stream_key(message: dict[str, Any]) -> bytes:
    return str(message["stream"]).encode()


async def _chunker(
    broker_address: str, streams: int, chunks: int, seed: int, timeout: float, pace: float
) -> str:
    """Publish the streams, then wait for their sums: "" if all are right, else the first
    problem."""
    rng = random.Random(seed)
    run = f"{seed:x}-{rng.getrandbits(32):08x}"
    async with JournalsClient(broker_address) as journals:
        listed = (await journals.list()).journals
        parts = sorted(j.spec.name for j in listed if j.spec.name.startswith(f"{PREFIX}/chunks/"))
        if not parts:
            return f"no chunk journals under {PREFIX}/chunks/: run `setup` first"
        start = await write_head(journals.stub, SUMS)
        partitions = [Partition(p, NDJSON) for p in parts]
        mapping = modulo_mapping(_stream_key, lambda: partitions)
        expected: dict[str, int] = {}
        async with AppendService(journals.stub) as service:
            publisher = Publisher(service, DictMessages(), JSONLines())
            cursors = {f"{run}-{s:05d}": 0 for s in range(streams)}
            written = 0
            while cursors:
                stream = rng.choice(sorted(cursors))
                seq = cursors[stream] + 1
                value = rng.randint(-1000, 1000)
                expected[stream] = expected.get(stream, 0) + value
                last = seq == chunks
                await publisher.publish_committed(
                    mapping, {"stream": stream, "seq": seq, "value": value, "last": last}
                )
                if last:
                    del cursors[stream]
                else:
                    cursors[stream] = seq
                written += 1
                if pace and written % 100 == 0:
                    await asyncio.sleep(pace)  # Spread over time, to soak across failures.
            await service.flush()
        got: dict[str, int] = {}
        reader = Reader(DictMessages(), JSONLines())
        try:
            async with asyncio.timeout(timeout):
                async for envelope in read_committed(
                    journals.stub, SUMS, reader, Sequencer(), start, block=True
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
    "--store", default="json", type=click.Choice(["json", "sqlite"]), show_default=True,
    help="The shards' store: JSON files, or SQLite recorded into a recovery log per shard",
)  # fmt: skip
def setup(partitions: int, replication: int, store: str, **opts: Any) -> None:
    """Create the chunk and sum journals, and a shard per chunk journal (with a hot standby)."""
    run_command(
        _setup(opts["broker_address"], opts["consumer_address"], partitions, replication, store)
    )


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
def chunker(
    streams: int, chunks: int, seed: int | None, timeout: float, pace: float, **opts: Any
) -> None:
    """Publish the streams' chunks; exit 0 once every sum arrived exactly right."""
    seed = seed if seed is not None else random.randrange(1 << 31)
    problem = run_command(_chunker(opts["broker_address"], streams, chunks, seed, timeout, pace))
    if problem:
        click.echo(f"stream-sum chunker (seed {seed}): {problem}", err=True)
        sys.exit(1)
    click.echo(f"stream-sum chunker (seed {seed}): {streams} sums of {chunks} chunks, all exact")


def _summer(opts: dict[str, Any]) -> Summer:
    return Summer(opts["summer_store_root"])


cli.add_command(
    serve_command(
        "stream-sum",
        _summer,
        click.option(
            "--summer.store-root", "summer_store_root", required=True,
            envvar="SUMMER_STORE_ROOT", show_envvar=True,
            type=click.Path(file_okay=False), help="Directory of the shards' JSON-file stores",
        ),
    )
)  # fmt: skip


if __name__ == "__main__":
    cli(prog_name="stream-sum")
