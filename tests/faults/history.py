"""A fault run's history: every operation the workload invoked with its outcome, everything its
readers saw, what each replica and store held at the end, and the faults, all timed in seconds
from the run's start. The checker (`tests/faults/checker.py`) reads nothing else, so a history
saved as JSON can be checked again, and hand-made ones test the checker itself.

Outcomes follow Jepsen: `ok` (acknowledged), `fail` (known not to have happened: the broker
refused it with a status, or the client abandoned it before its commit) and `info` (unknown: the
call failed or timed out after the request may have reached the broker)."""

from __future__ import annotations

import base64
import gzip
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

OK, FAIL, INFO = "ok", "fail", "info"

# Kinds of raw appends. `takeover` sets the register `owner` to its client (and removes the
# other owners); `checked` appends only while `owner` is its client; `torn` streams part of its
# content and then abandons the call, which must roll back on every replica; `probe` is a
# zero-byte append after the faults healed; `reset` is the operator's `reset-head`. `crowd` is
# one of many concurrent small appends (1 to 64 KiB) to a rate-limited journal; `left` is a
# small append whose client gave up (a deadline, or a cancelled stream) while a `held` append
# (streamed, larger than what brokers group) held the journal's pipeline; `retry` is the same
# record written again through AppendService once its client had left.
PLAIN, TAKEOVER, CHECKED, TORN, PROBE, RESET = (
    "plain",
    "takeover",
    "checked",
    "torn",
    "probe",
    "reset",
)
CROWD, LEFT, HELD, RETRY = "crowd", "left", "held", "retry"


@dataclass
class AppendOp:
    """One Append RPC of a raw-journal client: `payload` is exactly the content sent (one line
    ending in a newline, unique across the run, or nothing for probes)."""

    journal: str
    client: str
    payload: bytes
    kind: str = PLAIN
    invoked: float = 0.0
    completed: float = 0.0
    outcome: str = INFO
    begin: int = -1  # The acknowledged span, when ok.
    end: int = -1
    error: str = ""
    # When its commit was sent (a lower bound on when the broker had all of it; -1: when it
    # was invoked): a held append sends its commit long after its first content.
    committing: float = -1.0
    # When its client gave up on it (a deadline, a cancelled call; -1: it did not): from then
    # on a broker that has not proposed it must not (upstream aborts it as it acquires the
    # pipeline), so it is in the journal only if it was proposed before.
    left: float = -1.0

    @property
    def commit_sent_at(self) -> float:
        return self.invoked if self.committing < 0 else self.committing


@dataclass
class ReadChunk:
    """A tailing reader saw `content` at `offset`, at time `at`."""

    reader: str
    journal: str
    offset: int
    content: bytes
    at: float = 0.0


@dataclass
class Observation:
    """What one source held after the run: `read` is the journal read through a broker from 0
    (the canonical content), `replica:<broker>` a replica's local fragments, `store:<name>` one
    persisted fragment read whole from its store."""

    source: str
    journal: str
    offset: int
    content: bytes
    at: float = 0.0


@dataclass
class Publish:
    """A message published through AppendService: committed at once (`txn` empty) or within a
    transaction; `ok` once its batch was acknowledged."""

    id: str
    producer: str
    journal: str
    txn: str = ""
    invoked: float = 0.0
    completed: float = 0.0
    outcome: str = INFO
    error: str = ""


@dataclass
class Txn:
    """A transaction: `committed` or `aborted` once its ACKs were acknowledged, else `info`."""

    id: str
    producer: str
    intent: str  # "commit" or "abort"
    invoked: float = 0.0
    completed: float = 0.0
    outcome: str = INFO
    error: str = ""


@dataclass
class Delivery:
    """A read-committed stream delivered message `id` (read at `offset`)."""

    stream: str
    journal: str
    id: str
    offset: int
    at: float = 0.0


@dataclass
class ResetHead:
    """The operator reset `journal`'s head to `offset` (what its store held) at time `at`,
    after every replica of it was lost: acknowledged bytes past `offset` went with them."""

    journal: str
    offset: int
    at: float = 0.0


@dataclass
class SpoolsRenewed:
    """Every broker went down within moments of the others, so every replica of `journal`
    started with a new spool at time `at`: its registers may be empty from `offset` on. With
    `lossy` (some broker did not stop gracefully), what the old spools held and no store had
    yet may be lost with every replica, which the seed allows (R faults)."""

    journal: str
    offset: int
    at: float = 0.0
    lossy: bool = True


@dataclass
class HeadSample:
    """The write head each replica of `journal` reported (`heads`: broker id to offset), read
    without proxying at time `at`, once every append the workload made to the journal since
    `since` had returned and nothing else was appending to it."""

    journal: str
    since: float
    at: float
    heads: dict[str, int] = field(default_factory=dict)


@dataclass
class Fault:
    kind: str
    target: str
    begin: float
    end: float = -1.0  # When it healed.
    detail: str = ""


_BYTES = {"payload", "content"}


def _encode(item: Any) -> dict[str, Any]:
    out = asdict(item)
    for name in _BYTES & out.keys():
        out[name] = base64.b64encode(out[name]).decode()
    return out


def _decode(cls: type[Any], data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in data.items() if k in names}
    for name in _BYTES & values.keys():
        values[name] = base64.b64decode(values[name])
    return cls(**values)


_LISTS: dict[str, type[Any]] = {
    "appends": AppendOp,
    "reads": ReadChunk,
    "observations": Observation,
    "publishes": Publish,
    "txns": Txn,
    "deliveries": Delivery,
    "resets": ResetHead,
    "spools_renewed": SpoolsRenewed,
    "faults": Fault,
    "head_samples": HeadSample,
}


@dataclass
class History:
    scenario: str = ""
    seed: int = 0
    raw_journals: list[str] = field(default_factory=list)
    message_journals: list[str] = field(default_factory=list)
    register_journal: str = ""  # Where `takeover` and `checked` appends go.
    # Raw journals whose appends come in rounds (crowds, held appends and leavers), not
    # steadily: no unavailability is measured on them.
    round_journals: list[str] = field(default_factory=list)
    cycles: int = 0
    workload_began: float = 0.0
    workload_ended: float = 0.0
    healed: float = 0.0  # Every fault healed and every broker running again.
    appends: list[AppendOp] = field(default_factory=list)
    reads: list[ReadChunk] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    publishes: list[Publish] = field(default_factory=list)
    txns: list[Txn] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    resets: list[ResetHead] = field(default_factory=list)
    spools_renewed: list[SpoolsRenewed] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    head_samples: list[HeadSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def note(self, text: str) -> None:
        self.notes.append(f"{self.now():8.3f} {text}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            out[f.name] = [_encode(v) for v in value] if f.name in _LISTS else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> History:
        history = cls()
        for f in fields(cls):
            if f.name.startswith("_") or f.name not in data:
                continue
            value = data[f.name]
            if f.name in _LISTS:
                value = [_decode(_LISTS[f.name], v) for v in value]
            setattr(history, f.name, value)
        return history

    def save(self, path: Path) -> None:
        """As JSON; gzipped when `path` ends in `.gz` (the crowds' records are large)."""
        data = json.dumps(self.to_json()).encode()
        path.write_bytes(gzip.compress(data, 6) if path.suffix == ".gz" else data)

    @classmethod
    def load(cls, path: Path) -> History:
        return cls.from_json(json.loads(read_json_bytes(path)))


def read_json_bytes(path: Path) -> bytes:
    """A saved history's JSON, gzipped or not."""
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
