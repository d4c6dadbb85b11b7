"""Prometheus metrics of brokers and consumers, served at `/debug/metrics` (see plumbing.debug_http).

Names are upstream's where upstream has the metric (`gazette_journal_server_*`,
`gazette_write_head`, `gazette_spool_*`, `gazette_store_*`, `gazette_allocator_*`,
`gazette_shard_*`); the others are ours, under the same `gazette_` prefix. Labels are bounded:
operations and statuses are enum names, journals and shards are those this process serves, and
no label ever carries a token, a request's text or an error message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import prometheus_client
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

# Upstream exposes no `_created` series.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


class RawCounter:
    """A counter exposed under exactly its name: upstream's `..._totals` counters, which
    prometheus_client would expose as `..._totals_total`."""

    def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        _RAW.append(self)

    def labels(self, *values: str) -> _RawChild:
        return _RawChild(self, tuple(values))

    def _inc(self, key: tuple[str, ...], amount: float) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, *values: str) -> float:
        return self._values.get(tuple(values), 0.0)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        for key, value in items:
            pairs = ",".join(
                f'{n}="{_escape(v)}"' for n, v in zip(self.labelnames, key, strict=True)
            )
            lines.append(f"{self.name}{{{pairs}}} {float(value)!r}")
        return "\n".join(lines) + "\n"


class _RawChild:
    __slots__ = ("_counter", "_key")

    def __init__(self, counter: RawCounter, key: tuple[str, ...]) -> None:
        self._counter, self._key = counter, key

    def inc(self, amount: float = 1.0) -> None:
        self._counter._inc(self._key, amount)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


_RAW: list[RawCounter] = []


def exposition() -> bytes:
    """Every metric of this process, in Prometheus' text format."""
    raw = "".join(c.render() for c in _RAW).encode()
    return prometheus_client.generate_latest(REGISTRY) + raw


# ---- the Journal service (upstream's) ----------------------------------------------------------

journal_server_started = RawCounter(
    "gazette_journal_server_started_totals",
    "Total number of started JournalServer RPC invocations, by operation.",
    ["operation"],
)
journal_server_completed = RawCounter(
    "gazette_journal_server_completed_totals",
    "Total number of completed JournalServer RPC invocations, by operation & response status.",
    ["operation", "status"],
)
write_head = Gauge(
    "gazette_write_head",
    "Current write head of the journal (i.e., next byte offset to be written).",
    ["journal"],
)
# With --broker.metrics-journal-labels=false, no series names a journal (nor a store's bucket
# and prefix): write heads are summed over the journals instead.
write_heads_sum = Gauge(
    "gazette_write_heads_sum",
    "Sum of the write heads of the journals this broker appended to as primary (ours; in place of gazette_write_head with --broker.metrics-journal-labels=false).",
)  # fmt: skip
write_heads_journals = Gauge(
    "gazette_write_heads_journals",
    "Journals this broker appended to as primary (ours; with --broker.metrics-journal-labels=false).",
)  # fmt: skip
_journal_labels = True
_heads: dict[str, int] = {}
_heads_lock = threading.Lock()


def set_journal_labels(enabled: bool) -> None:
    """Whether series may carry journal names and store URLs (`--broker.metrics-journal-labels`):
    a process-wide setting, made once as the process starts."""
    global _journal_labels
    _journal_labels = enabled


def record_write_head(journal: str, head: int) -> None:
    """A journal's write head after an append this broker served as primary."""
    if _journal_labels:
        write_head.labels(journal).set(head)
        return
    with _heads_lock:
        before = _heads.get(journal, 0)
        _heads[journal] = head
        write_heads_sum.inc(head - before)
        write_heads_journals.set(len(_heads))


def store_label(url: str) -> str:
    """A store as a metric label: its URL without the query (which may name a profile), or
    only its scheme when journal labels are off (a bucket or prefix may name a tenant)."""
    if not _journal_labels:
        return url.split(":", 1)[0]
    return url.split("?", 1)[0]


# ---- appends, replication and reads (ours) -----------------------------------------------------

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

append_bytes = Counter(
    "gazette_journal_server_append_bytes_total",
    "Bytes of Append RPCs served by this broker as primary, by response status.",
    ["status"],
)
append_seconds = Histogram(
    "gazette_journal_server_append_seconds",
    "Duration of Append RPCs served by this broker as primary, by response status.",
    ["status"],
    buckets=_LATENCY,
)
replication_seconds = Histogram(
    "gazette_replication_commit_seconds",
    "From a primary's commit proposal to every replica's acknowledgement.",
    buckets=_LATENCY,
)
read_bytes = Counter(
    "gazette_journal_server_read_bytes_total",
    "Content bytes served by Read RPCs (from spools and stores).",
)

# ---- spools and persisting (upstream's) --------------------------------------------------------

spool_commits = Counter("gazette_spool_commits_total", "Total number of commits of journal fragment spools.")  # fmt: skip
spool_commit_bytes = Counter("gazette_spool_commit_bytes_total", "Total number of bytes committed to journal fragment spools.")  # fmt: skip
spool_rollbacks = Counter("gazette_spool_rollbacks_total", "Total number of rollbacks of journal fragment spools.")  # fmt: skip
spool_rollback_bytes = Counter("gazette_spool_rollback_bytes_total", "Total number of bytes rolled-back from journal fragment spools.")  # fmt: skip
spool_completed = Counter("gazette_spool_completed_total", "Total number of journal fragment spools which have been completed, and are ready for persisting.")  # fmt: skip
spool_persisted = Counter("gazette_spool_persisted_total", "Total number of journal fragment spools which were persisted (by this server, or by another and then verified by this server).")  # fmt: skip
spool_disk_bytes = Gauge("gazette_spool_disk_bytes", "Bytes of spool files on this broker's disk (ours).")  # fmt: skip

store_operation_seconds = Histogram(
    "gazette_store_operation_duration_seconds",
    "Duration of store operations in seconds",
    ["store", "operation", "status"],
    buckets=(0.01, 0.04, 0.16, 0.64, 2.56, 10.24, 40.96),
)
store_operations = Counter(
    "gazette_store_operation_total",
    "Total number of store operations",
    ["store", "operation", "status"],
)
store_put_bytes = Counter(
    "gazette_store_put_bytes_total", "Total number of bytes put to the store", ["store", "encoding"]
)

# ---- the allocator (upstream's) ----------------------------------------------------------------

allocator_converge = Counter("gazette_allocator_converge_total", "Cumulative number of converge iterations.")  # fmt: skip
allocator_assignment_added = Counter("gazette_allocator_assignment_added_total", "Cumulative number of item / member assignments added by the allocator.")  # fmt: skip
allocator_assignment_removed = Counter("gazette_allocator_assignment_removed_total", "Cumulative number of item / member assignments removed by the allocator.")  # fmt: skip
allocator_max_flow_seconds = Histogram("gazette_allocator_max_flow_runtime_seconds", "Duration required to re-solve for maximum assignment.", buckets=_LATENCY)  # fmt: skip
allocator_items = Gauge("gazette_allocator_items", "Number of items known to the allocator.")
allocator_members = Gauge("gazette_allocator_members", "Number of members known to the allocator.")

# ---- etcd (ours) -------------------------------------------------------------------------------

lease_remaining = Gauge(
    "gazette_etcd_lease_remaining_seconds",
    "Seconds until the etcd lease could have expired, counted from the last refresh etcd answered.",
)
lease_refresh_failures = Counter(
    "gazette_etcd_lease_refresh_failures_total", "Lease refreshes etcd did not answer in time."
)
fenced = Gauge("gazette_broker_fenced", "1 while appends are paused for a lease etcd may have expired.")  # fmt: skip
watch_revision = Gauge("gazette_etcd_watch_revision", "etcd revision this process's keyspace has applied.")  # fmt: skip
watch_restarts = Counter("gazette_etcd_watch_restarts_total", "Keyspace watches of etcd started again after a failure.")  # fmt: skip

# ---- consumers (upstream's, and lag) -----------------------------------------------------------

shard_transactions = Counter("gazette_shard_transactions_total", "Total number of consumer transactions.", ["shard"])  # fmt: skip
shard_read_messages = Counter("gazette_shard_read_messages_total", "Total number of messages processed by completed consumer transactions.", ["shard"])  # fmt: skip
shard_read_bytes = Counter("gazette_shard_read_bytes_total", "Total byte-length of messages processed by completed consumer transactions.", ["shard"])  # fmt: skip
shard_read_head = Gauge("gazette_shard_read_head", "Current read head of the consumer (i.e., next journal byte offset to be read).", ["shard", "journal"])  # fmt: skip
shard_lag_bytes = Gauge("gazette_shard_lag_bytes", "Bytes of a source journal written but not yet read by the shard (ours).", ["shard", "journal"])  # fmt: skip
shard_transaction_seconds = Histogram("gazette_shard_transaction_seconds", "Duration of consumer transactions, from the first message to the commit (ours).", ["shard"], buckets=_LATENCY)  # fmt: skip


def status_name(status: int, names: Callable[[int], str]) -> str:
    """An enum status as a label: OK as upstream writes it (`ok`), others by name."""
    return "ok" if status == 0 else names(status)


class Timer:
    """Seconds since it was made (monotonic)."""

    __slots__ = ("start",)

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start
