"""word-count: n-gram counts kept by shards, with a query answered by the shard that owns them.

In the shape of upstream's word-count example. `Publish` (an RPC any consumer process answers)
splits a text into words and counts its n-grams (of 1 to N words); each distinct n-gram goes as a
committed delta `{"ngram": ..., "count": ...}` to the deltas journal its first word maps to
(`examples/word-count/deltas/part-NNN` unless `setup --deltas` names another prefix). A shard per
deltas journal adds the deltas into its store: a
JSON-file store, or PostgreSQL (`--wordcount.postgres DSN`: a `word_counts` table written in the
SQL transaction that commits the shard's checkpoint). `Query` answers the committed counts of the
n-grams that are the prefix or begin with it and a space, from the shard its first word maps to:
any process takes the query and proxies it to that shard's primary.

    python -m consumer.examples.word_count setup --partitions 4
    python -m consumer.examples.word_count serve --wordcount.store-root DIR
    python -m consumer.examples.word_count publish < book.txt
    python -m consumer.examples.word_count query "the"
"""

from __future__ import annotations

import collections
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import click
import grpc

from broker.client.append_service import AppendService
from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from consumer.client import ShardsClient
from consumer.examples import word_count_pb2 as wpb
from consumer.examples import word_count_pb2_grpc as wpb_grpc
from consumer.main import run_command, serve_command
from consumer.protocol import cpb
from consumer.runtime import Consumer
from consumer.sqlstore import SQLStore, ensure_table
from consumer.store import JSONFileStore, Store
from consumer.store_sqlite import SQLiteStore, wants_sqlite
from consumer.transaction import Shard
from message.framing import JSONLines
from message.mapping import Partition, fnv1a32
from message.publisher import Publisher
from message.sequencer import Envelope
from message.types import DictMessages
from plumbing import config as cfg
from plumbing import credentials

PREFIX = "examples/word-count"
DELTAS = f"{PREFIX}/deltas/"
NDJSON = "application/x-ndjson"
RECOVERYLOG = "application/x-gazette-recoverylog"
SHARD_PREFIX = "word-count-"
TABLE = "word_counts"
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
# Upstream's word-count publishes n-grams of this many words.
DEFAULT_N = 2


def deltas_journal(i: int, prefix: str = DELTAS) -> str:
    return f"{prefix}part-{i:03d}"


def words_of(text: str) -> list[str]:
    """The text's words, lower-cased (letters and digits, with inner apostrophes)."""
    return _WORD.findall(text.lower())


def ngrams_of(text: str, n: int) -> collections.Counter[str]:
    """Counts of the text's n-grams of 1 to `n` words (words joined by one space)."""
    words = words_of(text)
    out: collections.Counter[str] = collections.Counter()
    for size in range(1, n + 1):
        for i in range(len(words) - size + 1):
            out[" ".join(words[i : i + size])] += 1
    return out


def partition_of(ngram: str, partitions: int) -> int:
    """The partition (and so the shard) of an n-gram: by its first word, so that every n-gram a
    prefix of whole words can match lives on one shard."""
    first = ngram.split(" ", 1)[0]
    return fnv1a32(first.encode()) % partitions


def matches(ngram: str, prefix: str) -> bool:
    return ngram == prefix or ngram.startswith(prefix + " ")


class Counter:
    """The word-count application: shards add n-gram deltas into their stores; the NGram
    service (Publish, Query) runs in every process."""

    def __init__(self, store_root: str | None, postgres: str | None, n: int = DEFAULT_N) -> None:
        if not store_root and not postgres:
            raise ValueError("give --wordcount.store-root DIR or --wordcount.postgres DSN")
        self.store_root, self.postgres, self.n = store_root, postgres, n
        self.consumer: Consumer | None = None
        self.service: AppendService | None = None
        # Per shard, deltas of the open transaction (SQL store: written at finalize).
        self.deltas: dict[str, collections.Counter[str]] = {}

    # ---- the application ---------------------------------------------------------------------

    async def init_application(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.service = AppendService(consumer.router)
        assert consumer.server is not None
        wpb_grpc.add_NGramServicer_to_server(_NGramServicer(self), consumer.server)  # type: ignore[no-untyped-call]

    async def close_application(self) -> None:
        if self.service is not None:
            await self.service.close()
            self.service = None

    async def new_store(self, shard: Shard) -> Store:
        if wants_sqlite(shard):
            return SQLiteStore(shard.recorder)
        if self.postgres:
            store = SQLStore(self.postgres, shard.fqn or shard.spec.id)
            await ensure_table(
                await store.pool(),
                f"CREATE TABLE IF NOT EXISTS {TABLE} (shard TEXT NOT NULL, ngram TEXT NOT NULL,"
                " count BIGINT NOT NULL, PRIMARY KEY (shard, ngram))",
            )
            return store
        assert self.store_root is not None
        return JSONFileStore(self.store_root, shard.spec.id)

    async def consume_message(
        self, shard: Shard, store: Any, envelope: Envelope, publisher: Publisher[Any]
    ) -> None:
        message = envelope.message
        ngram, count = message.get("ngram"), message.get("count")
        if not isinstance(ngram, str) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"{envelope.journal}:{envelope.begin}: not an n-gram delta (want "
                '{"ngram": str, "count": int >= 0})'
            )
        if isinstance(store, JSONFileStore):
            store.state[ngram] = store.state.get(ngram, 0) + count
        else:
            self.deltas.setdefault(shard.spec.id, collections.Counter())[ngram] += count

    async def finalize_txn(self, shard: Shard, store: Any, publisher: Publisher[Any]) -> None:
        deltas = self.deltas.pop(shard.spec.id, None)
        if deltas and isinstance(store, SQLiteStore):
            rows = list(deltas.items())
            await store.run(lambda db: _add_in_sqlite(db, rows))
        elif deltas and isinstance(store, SQLStore):
            conn = await store.transaction()
            await conn.executemany(
                f"INSERT INTO {TABLE} (shard, ngram, count) VALUES ($1, $2, $3)"
                f" ON CONFLICT (shard, ngram) DO UPDATE SET count = {TABLE}.count + $3",
                [(shard.fqn or shard.spec.id, ngram, count) for ngram, count in deltas.items()],
            )

    # ---- the NGram service ---------------------------------------------------------------------

    def _partitions(self) -> list[str]:
        """The deltas journals, by name: the sources of this application's shards."""
        assert self.consumer is not None
        journals: set[str] = set()
        for spec in self.consumer.state.specs():
            journals.update(s.journal for s in spec.sources)
        return sorted(journals)

    def shard_of(self, prefix: str) -> str:
        """The shard that reads the deltas journal the prefix's first word maps to."""
        assert self.consumer is not None
        partitions = self._partitions()
        if not partitions:
            raise LookupError("no word-count shards: run `setup` first")
        journal = partitions[partition_of(prefix, len(partitions))]
        for spec in self.consumer.state.specs():
            if any(s.journal == journal for s in spec.sources):
                return spec.id
        raise LookupError(f"no shard reads {journal}")

    async def publish(self, text: str) -> int:
        assert self.service is not None
        counts = ngrams_of(text, self.n)
        partitions = self._partitions()
        if not partitions:
            raise LookupError("no word-count shards: run `setup` first")
        publisher = Publisher(self.service, DictMessages(), JSONLines())
        spans = []
        for ngram, count in sorted(counts.items()):
            journal = partitions[partition_of(ngram, len(partitions))]
            spans.append(
                await publisher.publish_committed(_to(journal), {"ngram": ngram, "count": count})
            )
        for span in spans:
            await span
        return len(counts)

    async def query_local(self, store: Store, shard_fqn: str, prefix: str) -> list[tuple[str, int]]:
        """Committed counts of the n-grams matching `prefix` in the store of a shard whose
        primary is here (on SQLite, read through the store's connection: a transaction between
        its finalize and its commit is seen)."""
        if isinstance(store, SQLiteStore):
            return await store.run(lambda db: _query_sqlite(db, prefix))
        if isinstance(store, SQLStore):
            pool = await store.pool()
            rows = await pool.fetch(
                f"SELECT ngram, count FROM {TABLE} WHERE shard = $1 AND (ngram = $2 OR"
                " starts_with(ngram, $3))",
                shard_fqn,
                prefix,
                prefix + " ",
            )
            return [(row["ngram"], int(row["count"])) for row in rows]
        assert isinstance(store, JSONFileStore)
        committed = store.committed
        if committed is None:
            raise _Unavailable(f"shard {shard_fqn} is recovering its store: retry")
        return [(g, int(c)) for g, c in committed.items() if matches(g, prefix)]


_SQLITE_TABLE = "CREATE TABLE IF NOT EXISTS counts (ngram TEXT PRIMARY KEY, count INTEGER NOT NULL)"


def _add_in_sqlite(db: Any, rows: list[tuple[str, int]]) -> None:
    db.execute(_SQLITE_TABLE)
    db.executemany(
        "INSERT INTO counts VALUES (?, ?) ON CONFLICT (ngram) DO UPDATE SET count = count + ?",
        [(ngram, count, count) for ngram, count in rows],
    )


def _query_sqlite(db: Any, prefix: str) -> list[tuple[str, int]]:
    db.execute(_SQLITE_TABLE)
    rows = db.execute(
        "SELECT ngram, count FROM counts WHERE ngram = ? OR substr(ngram, 1, ?) = ?",
        (prefix, len(prefix) + 1, prefix + " "),
    )
    return [(str(g), int(c)) for g, c in rows]


def _to(journal: str) -> Callable[[Any], Partition]:
    partition = Partition(journal, NDJSON)
    return lambda _m: partition


class _Unavailable(Exception):
    """The query cannot be answered now; a retry may be."""


def _sorted_grams(grams: list[tuple[str, int]]) -> list[wpb.NGramCount]:
    return [
        wpb.NGramCount(n_gram=g, count=c) for g, c in sorted(grams, key=lambda gc: (-gc[1], gc[0]))
    ]


class _NGramServicer(wpb_grpc.NGramServicer):
    def __init__(self, app: Counter) -> None:
        self.app = app

    async def Publish(self, request: wpb.PublishRequest, context: Any) -> wpb.PublishResponse:
        try:
            count = await self.app.publish(request.text)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return wpb.PublishResponse(n_grams=count)

    async def Query(self, request: wpb.QueryRequest, context: Any) -> wpb.QueryResponse:
        consumer = self.app.consumer
        assert consumer is not None
        prefix = " ".join(words_of(request.prefix))
        if not prefix:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"prefix {request.prefix!r} holds no word"
            )
        try:
            shard_id = request.shard or self.app.shard_of(prefix)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        resolution = consumer.resolve(shard_id, proxied=request.HasField("header"))
        if resolution.status != cpb.OK:
            code = (
                grpc.StatusCode.NOT_FOUND
                if resolution.status == cpb.SHARD_NOT_FOUND
                else grpc.StatusCode.UNAVAILABLE
            )
            await context.abort(code, f"shard {shard_id}: {cpb.Status.Name(resolution.status)}")
        replica = resolution.replica
        if replica is None:
            proxied = wpb.QueryRequest(prefix=prefix, shard=shard_id, header=resolution.header)
            stub = wpb_grpc.NGramStub(consumer.channel_to(resolution.endpoint))  # type: ignore[no-untyped-call]
            try:
                answer: wpb.QueryResponse = await stub.Query(proxied, timeout=30)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            return answer
        store = replica.store
        try:
            if store is None:
                raise _Unavailable(f"shard {shard_id} is starting: retry")
            assert replica.shard is not None
            grams = await self.app.query_local(store, replica.shard.fqn, prefix)
        except _Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return wpb.QueryResponse(
            header=resolution.header, grams=_sorted_grams(grams), shard=shard_id
        )


# ---- the command line ---------------------------------------------------------------------------


def journal_spec(name: str, replication: int) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=replication)
    spec.fragment.length = 1 << 24
    spec.fragment.compression_codec = pb.GZIP
    spec.fragment.refresh_interval.seconds = 60
    spec.labels.labels.add(name="content-type", value=NDJSON)
    return spec


async def _setup(
    broker_address: str,
    consumer_address: str,
    partitions: int,
    replication: int,
    standbys: int,
    deltas: str,
    store: str = "json",
) -> str:
    names = [deltas_journal(i, deltas) for i in range(partitions)]
    recovery_prefix = deltas.rstrip("/").rsplit("/", 1)[0] + "/recovery"
    logs = [f"{recovery_prefix}/{SHARD_PREFIX}{i:03d}" for i in range(partitions)]
    async with JournalsClient(broker_address) as journals:
        have = {j.spec.name for j in (await journals.list()).journals}
        missing = [n for n in names if n not in have]
        specs = [journal_spec(n, replication) for n in missing]
        for name in logs if store == "sqlite" else []:
            if name not in have:
                missing.append(name)
                log_spec = journal_spec(name, replication)
                log_spec.labels.labels[0].value = RECOVERYLOG
                specs.append(log_spec)
        if specs:
            await journals.apply([pb.ApplyRequest.Change(upsert=s) for s in specs])
    async with ShardsClient(consumer_address) as shards:
        listed = {s.spec.id for s in (await shards.list()).shards}
        changes = []
        for i in range(partitions):
            shard_id = f"{SHARD_PREFIX}{i:03d}"
            if shard_id in listed:
                continue
            spec = cpb.ShardSpec(
                id=shard_id,
                sources=[cpb.ShardSpec.Source(journal=names[i])],
                hot_standbys=standbys,
            )
            spec.max_txn_duration.FromMilliseconds(500)
            spec.labels.labels.add(name="app.gazette.dev/example", value="word-count")
            if store == "sqlite":
                spec.recovery_log_prefix = recovery_prefix
                # No hint_prefix: the consumer keeps hints under its own root (<etcd prefix>/hints).
                spec.hint_backups = 2
                spec.labels.labels.add(name="store", value="sqlite")
            changes.append(cpb.ApplyRequest.Change(upsert=spec))
        if changes:
            await shards.apply(changes)
    return f"{len(missing)} journal(s) and {len(changes)} shard(s) created"


def _channel(address: str) -> grpc.aio.Channel:
    return credentials.default("consumer").open_channel(address, what="consumer address")


async def _publish(consumer_address: str, texts: list[str]) -> int:
    async with _channel(consumer_address) as channel:
        stub = wpb_grpc.NGramStub(channel)  # type: ignore[no-untyped-call]
        total = 0
        for text in texts:
            response = await stub.Publish(wpb.PublishRequest(text=text), timeout=60)
            total += response.n_grams
        return total


async def _query(consumer_address: str, prefix: str, shard: str) -> wpb.QueryResponse:
    async with _channel(consumer_address) as channel:
        stub = wpb_grpc.NGramStub(channel)  # type: ignore[no-untyped-call]
        answer: wpb.QueryResponse = await stub.Query(
            wpb.QueryRequest(prefix=prefix, shard=shard), timeout=60
        )
        return answer


consumer_address_option = cfg.option(
    "--consumer.address",
    default="http://localhost:8080",
    help="Service address of a word-count consumer",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """word-count: n-gram counts in shards, queried where they live."""


@cli.command()
@cfg.option(
    "--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"
)
@consumer_address_option
@click.option(
    "--partitions", default=4, type=click.IntRange(1, 999), show_default=True,
    help="Deltas journals (and shards)",
)  # fmt: skip
@click.option(
    "--replication", default=1, type=click.IntRange(1), show_default=True,
    help="Replication of the journals",
)  # fmt: skip
@click.option(
    "--hot-standbys", default=0, type=click.IntRange(0), show_default=True,
    help="Hot standbys of each shard",
)  # fmt: skip
@click.option(
    "--deltas", default=DELTAS, show_default=True, help="Prefix of the deltas journals' names"
)
@click.option(
    "--store", default="json", type=click.Choice(["json", "sqlite"]), show_default=True,
    help="The shards' store: JSON files (or PostgreSQL, by serve's flag), or SQLite recorded "
    "into a recovery log per shard (under the deltas' parent/recovery/)",
)  # fmt: skip
def setup(
    partitions: int, replication: int, hot_standbys: int, deltas: str, store: str, **opts: Any
) -> None:
    """Create the deltas journals and a shard per journal (where missing)."""
    if not deltas.endswith("/"):
        raise click.BadParameter(f"{deltas!r} must end with '/'", param_hint="--deltas")
    click.echo(
        run_command(
            _setup(
                opts["broker_address"], opts["consumer_address"], partitions, replication,
                hot_standbys, deltas, store,
            )
        )
    )  # fmt: skip


@cli.command()
@consumer_address_option
@click.argument("files", nargs=-1, type=click.File("r"))
def publish(files: tuple[Any, ...], **opts: Any) -> None:
    """Publish the n-grams of each FILE's text (standard input without one), a paragraph at a
    time; returns once their deltas are committed."""
    texts: list[str] = []
    for f in files:
        texts.extend(_paragraphs(f.read()))
    if not files:
        texts.extend(_paragraphs(sys.stdin.read()))
    count = run_command(_publish(opts["consumer_address"], texts))
    click.echo(f"published {count} n-gram(s) of {len(texts)} paragraph(s)")


@cli.command()
@consumer_address_option
@click.option("--shard", default="", help="Ask this shard (default: the one owning the prefix)")
@click.option("--limit", default=20, type=click.IntRange(0), show_default=True, help="Rows shown")
@click.argument("prefix")
def query(prefix: str, shard: str, limit: int, **opts: Any) -> None:
    """Committed counts of the n-grams that are PREFIX or begin with it."""
    answer = run_command(_query(opts["consumer_address"], prefix, shard))
    click.echo(f"shard {answer.shard}: {len(answer.grams)} n-gram(s)")
    for gram in answer.grams[: limit or None]:
        click.echo(f"{gram.count:>8}  {gram.n_gram}")


def from_environment() -> Counter:
    """A Counter configured by the environment `gazctl dev up` gives consumer processes:
    POSTGRES_DSN if set, else CONSUMER_STORE_ROOT (`--app
    consumer.examples.word_count:from_environment`)."""
    return Counter(os.environ.get("CONSUMER_STORE_ROOT"), os.environ.get("POSTGRES_DSN"))


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _counter(opts: dict[str, Any]) -> Counter:
    try:
        return Counter(
            opts["wordcount_store_root"], opts["wordcount_postgres"], opts["wordcount_n"]
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


cli.add_command(
    serve_command(
        "word-count",
        _counter,
        click.option(
            "--wordcount.store-root", "wordcount_store_root", default=None,
            envvar="WORDCOUNT_STORE_ROOT", show_envvar=True, type=click.Path(file_okay=False),
            help="Directory of the shards' JSON-file stores",
        ),
        click.option(
            "--wordcount.postgres", "wordcount_postgres", default=None,
            envvar="WORDCOUNT_POSTGRES", show_envvar=True,
            help="PostgreSQL DSN: keep the counts there (SQL store) instead",
        ),
        click.option(
            "--wordcount.n", "wordcount_n", default=DEFAULT_N, show_default=True,
            type=click.IntRange(1, 8), help="Count n-grams of 1 to N words",
        ),
    )
)  # fmt: skip


if __name__ == "__main__":
    cli(prog_name="word-count")
    sys.exit(0)
