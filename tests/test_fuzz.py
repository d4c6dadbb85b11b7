"""Fuzzed inputs against one live broker (issue 12): every input answered with a status or a
clear gRPC error, the broker alive and every journal intact afterwards.

Hypothesis generates requests for every RPC of `protocol.Journal` (List, Apply, Read, Append
streams, Replicate streams from a rogue peer, ListFragments, FragmentStoreHealth), and raw bytes
sent as each method's request body (most of them not valid protobuf). All go to one `gazette
serve` process with a file:// store, real etcd, journals written before the fuzzing (some
persisted), and a journal replicated from a "ghost" primary that runs no broker, so that a rogue
Replicate stream can take a replica's spool. Then store contents (fragment file names found in a
store, corrupt fragment content) and gazctl inputs (spec YAML, selectors) against the same broker.

How many: GAZETTE_FUZZ_INPUTS is the number of RPC inputs, spread over the 14 RPC tests (7
methods, messages and raw bytes): 350 by default, for `nox -s tests`; `nox -s fuzz` asks for
10,500. Store and gazctl tests, which wait for a store listing or a subprocess, run a fiftieth as
many examples as each RPC test (at least 2). The counts per RPC, kind and outcome are printed when the
broker stops (`pytest -s`, as `nox -s fuzz` runs it).

An acceptable answer is a response (any status) or a gRPC error whose code is neither UNKNOWN nor
INTERNAL and whose details are clear (see `is_clear`). DEADLINE_EXCEEDED is acceptable only for a
request that waits by design: a blocking read, a watching list, a header or revision this broker
has not seen yet, a Replicate to a spool that a primary's pipeline owns. Those get a short
deadline; every other call gets 30 s, and not being answered by then is a failure.

A journal written before the fuzzing is intact when, afterwards: its spec is unchanged (except
`suspend`, which fuzzed appends may legitimately set); reading it from offset 0 gives exactly the
content appended before the fuzzing followed by what fuzzed appends committed (each recorded
from its OK response: no other byte is ever readable); every file it had in the store is still
there with the same bytes; and it takes one more append (resuming it if a fuzzed append
suspended it). Reads during the fuzzing are checked the same way. Fuzzed Applies go to names of
their own, never to these journals. The ghosted journal is not protected: a peer presenting its
route is, by the protocol's design, its primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aetcd
import grpc
import pytest
from google.protobuf import duration_pb2, json_format
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator import keyspace as aks
from broker.client import dial
from broker.client.reader import read
from broker.fragment import codecs
from broker.fragment.content import FragmentCorrupt, fragment_path
from broker.fragment.fragments import content_name, digest_of, parse_relative_path, sum_of
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol.validate import ValidationError
from broker.testing import EtcdServer, stop_process
from gazctl.spark.journals import listed_fragments
from spec import decode_tree, flatten
from tests.conftest import BrokerProcess, start_broker_process
from tests.helpers.gazctl import assert_one_line_error, gazctl
from tests.helpers.journals import set_journal
from tests.helpers.mutations import mutated_bytes, mutated_text, mutated_yaml
from tests.helpers.waiting import until_blocking

RPC_TESTS = 14  # Seven methods, as messages and as raw bytes.
INPUTS = int(os.environ.get("GAZETTE_FUZZ_INPUTS", "350"))
EXAMPLES = max(1, math.ceil(INPUTS / RPC_TESTS))
SLOW_EXAMPLES = max(2, INPUTS // 50 // RPC_TESTS)

SHORT = 0.5  # Deadline of a call that may wait by design, in seconds.
LONG = 30.0  # Deadline of every other call: unanswered by then, the broker is stuck.

STORE = "file:///fuzz-store/"
KEPT = ("fuzz/kept/raw", "fuzz/kept/zstd", "fuzz/kept/local")
GHOSTED = "fuzz/ghosted"
NAMES = "fuzz/names"
CORRUPT = "fuzz/corrupt"
APPLIED = tuple(f"fuzz/applied/{i}" for i in range(6))  # Where fuzzed Applies write.
EDGE = "fuzz/edge/max-offset"  # Of a test below.
TARGETS = (*KEPT, GHOSTED, NAMES, CORRUPT)

BROKER_ID = pb.ProcessSpec.ID(zone="local", suffix="broker-0")
GHOST_ID = pb.ProcessSpec.ID(zone="local", suffix="ghost")
GHOST_ENDPOINT = "http://127.0.0.1:1"  # Nothing listens there.

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

METHODS: dict[str, tuple[str, type[Message], type[Message]]] = {
    "List": ("unary_stream", pb.ListRequest, pb.ListResponse),
    "Apply": ("unary_unary", pb.ApplyRequest, pb.ApplyResponse),
    "Read": ("unary_stream", pb.ReadRequest, pb.ReadResponse),
    "Append": ("stream_unary", pb.AppendRequest, pb.AppendResponse),
    "Replicate": ("stream_stream", pb.ReplicateRequest, pb.ReplicateResponse),
    "ListFragments": ("unary_unary", pb.FragmentsRequest, pb.FragmentsResponse),
    "FragmentStoreHealth": (
        "unary_unary",
        pb.FragmentStoreHealthRequest,
        pb.FragmentStoreHealthResponse,
    ),
}


def is_clear(details: str | None) -> bool:
    """Whether gRPC error details are a clear message: one line a user can act on. Not empty,
    no line break, at most 1,000 characters, and not how gRPC renders an exception that a
    handler let escape ("Unexpected <class ...>: ...", "Exception calling application: ...")."""
    if not details or len(details.splitlines()) != 1 or len(details) > 1000:
        return False
    return not details.startswith(("Unexpected <class ", "Exception calling application"))


@dataclass(frozen=True)
class KnownDefect:
    """A defect found here whose fix belongs to a module under change elsewhere: the answers
    and broker log records it excuses, and its xfail test, which turns red once it is fixed
    (then remove it here)."""

    name: str
    test: str
    log: re.Pattern[str] | None = None
    answer: re.Pattern[str] | None = None  # Matched against "CODE: details".


# None left: the four found here were fixed (see the tests at the end of this module).
KNOWN_DEFECTS: tuple[KnownDefect, ...] = ()


def known_defect(code: grpc.StatusCode, details: str | None) -> str | None:
    answer = f"{code.name}: {details}"
    for defect in KNOWN_DEFECTS:
        if defect.answer is not None and defect.answer.fullmatch(answer):
            return defect.name
    return None


# ---- the live broker ----------------------------------------------------------------------------


@dataclass
class Tally:
    """Inputs by (rpc, kind) and their outcomes."""

    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    began: float = field(default_factory=time.monotonic)

    def record(self, rpc: str, kind: str, outcome: str) -> None:
        self.outcomes[(rpc, kind, outcome)] += 1

    def inputs(self) -> Counter[tuple[str, str]]:
        out: Counter[tuple[str, str]] = Counter()
        for (rpc, kind, _), n in self.outcomes.items():
            out[(rpc, kind)] += n
        return out

    def table(self) -> str:
        inputs = self.inputs()
        lines = [
            f"fuzzed inputs: {sum(inputs.values()):,} against one broker in "
            f"{time.monotonic() - self.began:.0f} s",
            f"{'rpc':<22}{'kind':<10}{'inputs':>8}  outcomes",
        ]
        for rpc, kind in sorted(inputs):
            outcomes = sorted(
                ((o, n) for (r, k, o), n in self.outcomes.items() if (r, k) == (rpc, kind)),
                key=lambda item: -item[1],
            )
            shown = " · ".join(f"{o} {n}" for o, n in outcomes)
            lines.append(f"{rpc:<22}{kind:<10}{inputs[(rpc, kind)]:>8}  {shown}")
        return "\n".join(lines)


@dataclass
class Live:
    broker: BrokerProcess
    root: Path  # The broker's --broker.file-root.
    channel: grpc.Channel
    etcd: pb.Header.Etcd  # The broker's etcd header, as it answered before the fuzzing.
    routes: dict[str, pb.Route]  # Of the journals created before the fuzzing.
    specs: dict[str, pb.JournalSpec]
    content: dict[str, bytearray]  # Of each KEPT journal: every byte that may be read.
    stored: dict[str, bytes]  # Files of the KEPT journals in the store before the fuzzing.
    tally: Tally = field(default_factory=Tally)
    revision: int = 0  # The highest etcd revision seen in an answer.
    rogue_offset: int = 1 << 30  # Past every offset a rogue Replicate proposed to GHOSTED.
    markers: int = 0  # Marker fragments written into NAMES' directory.
    names_appends: list[int] = field(default_factory=list)  # Offsets appended to NAMES.
    corrupt_offset: int = 1 << 40  # Where the next corrupt fragment of CORRUPT begins.

    @property
    def endpoint(self) -> str:
        return self.broker.address

    def header_of(self, journal: str) -> pb.Header:
        """What a primary would send this broker about `journal`."""
        return pb.Header(process_id=BROKER_ID, route=self.routes[journal], etcd=self.etcd)


def spec_of(name: str, codec: int = pb.NONE, stores: Sequence[str] = (STORE,)) -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=1)
    spec.fragment.length = 1024
    spec.fragment.compression_codec = codec  # type: ignore[assignment]
    spec.fragment.stores.extend(stores)
    spec.fragment.refresh_interval.seconds = 1
    return spec


def _etcd_client(etcd_server: EtcdServer) -> aetcd.Client:
    return aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)


async def _add_ghost(etcd_server: EtcdServer, prefix: str) -> None:
    """A member that runs no broker (its limit filled by GHOSTED), primary of GHOSTED, of which
    this broker is the other replica: its spool is free for a rogue Replicate stream."""
    client = _etcd_client(etcd_server)
    await client.connect()
    try:
        lease = await client.lease(24 * 3600)
        ghost = pb.BrokerSpec(
            process_spec=pb.ProcessSpec(id=GHOST_ID, endpoint=GHOST_ENDPOINT), journal_limit=1
        )
        await client.put(
            aks.member_key(prefix, GHOST_ID.zone, GHOST_ID.suffix).encode(),
            ghost.SerializeToString(),
            lease=lease.id,
        )
        ghosted = spec_of(GHOSTED)
        ghosted.replication = 2
        members = [(GHOST_ID.zone, GHOST_ID.suffix), (BROKER_ID.zone, BROKER_ID.suffix)]
        await set_journal(client, prefix, ghosted, members)
    finally:
        await client.close()


async def _forget(etcd_server: EtcdServer, prefix: str) -> None:
    client = _etcd_client(etcd_server)
    await client.connect()
    try:
        await client.delete_prefix(prefix.encode())
    finally:
        await client.close()


def payload(message: Message) -> bytes:
    return message.SerializeToString()


def invoke(
    channel: grpc.Channel, rpc: str, payloads: Sequence[bytes], timeout: float
) -> tuple[list[bytes], grpc.RpcError | None]:
    """Send `payloads` as they are (no serializer: raw bytes go on the wire unparsed) and
    collect the raw responses until the end of the call or its error."""
    shape = METHODS[rpc][0]
    path = f"/protocol.Journal/{rpc}"
    responses: list[bytes] = []
    try:
        if shape == "unary_unary":
            responses.append(channel.unary_unary(path)(payloads[0], timeout=timeout))
        elif shape == "unary_stream":
            responses.extend(channel.unary_stream(path)(payloads[0], timeout=timeout))
        elif shape == "stream_unary":
            responses.append(channel.stream_unary(path)(iter(payloads), timeout=timeout))
        else:
            responses.extend(channel.stream_stream(path)(iter(payloads), timeout=timeout))
    except grpc.RpcError as exc:
        return responses, exc
    return responses, None


def call(
    live: Live,
    rpc: str,
    kind: str,
    payloads: Sequence[bytes],
    *,
    may_wait: bool,
) -> tuple[list[Any], grpc.RpcError | None]:
    """One fuzzed input: send it, check the answer is acceptable, tally its outcome, check the
    broker still runs. Returns the parsed responses and the error, if any."""
    raw, error = invoke(live.channel, rpc, payloads, SHORT if may_wait else LONG)
    response_type = METHODS[rpc][2]
    responses = [response_type.FromString(r) for r in raw]
    for response in responses:
        if response.HasField("header"):
            live.revision = max(live.revision, response.header.etcd.revision)
    sent = describe_input(rpc, payloads)
    if error is None:
        statuses = [pb.Status.Name(r.status) for r in responses if r.status != pb.OK]
        outcome = statuses[-1] if statuses else ("OK" if responses else "no response")
    else:
        code, details = error.code(), error.details()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert may_wait, f"{rpc} was not answered within {LONG:.0f}s: {sent}"
            outcome = "waited until the deadline"
        elif code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and is_clear(details):
            outcome = code.name
        elif (defect := known_defect(code, details)) is not None:
            outcome = f"{code.name} (known defect: {defect})"
        else:
            raise AssertionError(f"{rpc} answered {code.name}: {details!r}; input: {sent}")
    live.tally.record(rpc, kind, outcome)
    assert live.broker.proc.poll() is None, f"the broker exited after {rpc}: {sent}"
    return responses, error


def describe_input(rpc: str, payloads: Sequence[bytes]) -> str:
    request_type = METHODS[rpc][1]
    parts = []
    for data in payloads:
        try:
            parts.append(repr(request_type.FromString(data)).replace("\n", " ")[:400])
        except DecodeError:
            parts.append(repr(data[:200]))
    return " | ".join(parts)


@pytest.fixture(scope="module")
def live(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    where = tmp_path_factory.mktemp("fuzz")
    root = where / "root"
    (root / "fuzz-store").mkdir(parents=True)
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"
    broker = start_broker_process(
        etcd_server, prefix, where / "broker.log", extra=("--broker.file-root", str(root))
    )
    channel = grpc.insecure_channel(broker.address.removeprefix("http://"))
    tally = Tally()
    try:
        # The ghost first, so that its limit of one journal is GHOSTED's before others exist.
        asyncio.run(_add_ghost(etcd_server, prefix))
        specs = {GHOSTED: pb.JournalSpec()}
        specs.update(
            {
                KEPT[0]: spec_of(KEPT[0]),
                KEPT[1]: spec_of(KEPT[1], pb.ZSTANDARD),
                KEPT[2]: spec_of(KEPT[2], stores=()),
                NAMES: spec_of(NAMES),
                CORRUPT: spec_of(CORRUPT),
            }
        )
        request = pb.ApplyRequest(
            changes=[
                pb.ApplyRequest.Change(upsert=s, expect_mod_revision=0)
                for name, s in specs.items()
                if name != GHOSTED
            ]
        )
        applied = pb.ApplyResponse.FromString(
            channel.unary_unary("/protocol.Journal/Apply")(payload(request), timeout=LONG)
        )
        assert applied.status == pb.OK
        routed = wait_routed(channel, TARGETS)
        specs[GHOSTED] = routed[GHOSTED].spec
        content = {name: bytearray() for name in KEPT}
        for round_ in range(5):
            for name in KEPT:
                data = bytes(f"{name} {round_}: ", "ascii") + os.urandom(300).hex().encode()
                append_ok(channel, name, data, content)
        for name in KEPT[:2]:
            wait_persisted(channel, name, 2)
        live = Live(
            broker=broker,
            root=root,
            channel=channel,
            etcd=listing(channel, KEPT[0])[0].header.etcd,
            routes={name: journal.route for name, journal in routed.items()},
            specs=specs,
            content=content,
            stored=stored_files(root),
            tally=tally,
        )
        live.revision = live.etcd.revision
        yield live
    finally:
        print("\n" + tally.table())
        channel.close()
        stop_process(broker.proc)
        asyncio.run(_forget(etcd_server, prefix))


def listing(channel: grpc.Channel, name: str) -> list[pb.ListResponse]:
    request = pb.ListRequest(selector=pb.LabelSelector(include=labels.label_set(("name", name))))
    return [
        pb.ListResponse.FromString(r)
        for r in channel.unary_stream("/protocol.Journal/List")(payload(request), timeout=LONG)
    ]


def wait_routed(channel: grpc.Channel, names: Sequence[str]) -> dict[str, pb.ListResponse.Journal]:
    """Each journal as listed once it has a primary."""
    out = {}

    def routed() -> bool:
        for name in names:
            if name not in out:
                journals = listing(channel, name)[0].journals
                if not journals or journals[0].route.primary == -1:
                    return False
                out[name] = journals[0]
        return True

    until_blocking(routed, f"{', '.join(names)} assigned", 30, 0.05)
    return out


def append_request(journal: str, data: bytes, **first: Any) -> list[bytes]:
    stream = [pb.AppendRequest(journal=journal, **first)]
    if data:
        stream.append(pb.AppendRequest(content=data))
    stream.append(pb.AppendRequest())
    return [payload(m) for m in stream]


def append_ok(
    channel: grpc.Channel,
    journal: str,
    data: bytes,
    content: dict[str, bytearray],
    **first: Any,
) -> pb.AppendResponse:
    """One append of a routed journal, which must be accepted; the commit is recorded."""
    raw, error = invoke(channel, "Append", append_request(journal, data, **first), LONG)
    assert error is None, f"append to {journal}: {error.code().name}: {error.details()}"
    response = pb.AppendResponse.FromString(raw[0])
    assert response.status == pb.OK, f"append to {journal}: {pb.Status.Name(response.status)}"
    record_commit(content, journal, response, data)
    return response


def record_commit(
    content: dict[str, bytearray], journal: str, response: pb.AppendResponse, data: bytes
) -> None:
    """What an OK append to a kept journal committed: readable from now on, at its offsets."""
    journal = journal.split(";", 1)[0]
    if journal not in content:
        return
    commit = response.commit
    assert commit.end - commit.begin == len(data), f"commit {commit} of {len(data)} bytes"
    known = content[journal]
    assert commit.begin == len(known) or not data, (
        f"{journal}: an append committed at {commit.begin}, but its content so far ends at "
        f"{len(known)}"
    )
    known.extend(data)


def wait_persisted(channel: grpc.Channel, journal: str, count: int) -> None:

    def persisted() -> bool:
        raw, error = invoke(
            channel, "ListFragments", [payload(pb.FragmentsRequest(journal=journal))], LONG
        )
        assert error is None, error
        listed = pb.FragmentsResponse.FromString(raw[0]).fragments
        return sum(1 for f in listed if f.spec.backing_store) >= count

    until_blocking(persisted, f"{count} fragments of {journal} persisted", 30, 0.1)


def stored_files(root: Path) -> dict[str, bytes]:
    base = root / "fuzz-store"
    out = {}
    for name in KEPT:
        directory = base / name
        if directory.is_dir():
            for path in sorted(directory.rglob("*")):
                if path.is_file():
                    out[str(path.relative_to(base))] = path.read_bytes()
    return out


# ---- strategies ---------------------------------------------------------------------------------

INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
UINT32 = st.integers(0, (1 << 32) - 1)
UINT64 = st.integers(0, (1 << 64) - 1)
MAX64 = (1 << 63) - 1


class Fields:
    """Draws each field of a request from its usual values or from odd ones. A request is all
    usual (it gets past validation, into the machinery), has one odd field (probing one rule),
    or is mixed (each field odd one time in four)."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self.draw = draw
        self.mode = draw(st.sampled_from(["usual", "usual", "one odd", "one odd", "mixed"]))
        self.odd_one = draw(st.integers(0, 11))
        self.index = -1

    def __call__(self, usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> Any:
        self.index += 1
        if self.mode == "mixed":
            odd_here = self.draw(st.integers(0, 3)) == 0
        else:
            odd_here = self.mode == "one odd" and self.index == self.odd_one
        return self.draw(odd if odd_here else usual)

    def flag(self) -> bool:
        """A field that is usually off."""
        return bool(self(st.just(False), st.just(True)))


offsets = st.one_of(
    st.integers(0, 5000), INT64, st.sampled_from([-1, MAX64, MAX64 - 10, 1 << 40, 1 << 62])
)

PATH_CHARS = "abz09/-_.=%;+ :é\u00a0"
texts = st.one_of(st.text(st.sampled_from(PATH_CHARS), max_size=24), st.text(max_size=16))
odd_names = st.one_of(
    texts,
    st.sampled_from(["", "/", "a", "x" * 600, "fuzz/", "fuzz//x", "fuzz/kept/raw/"]),
    st.sampled_from(TARGETS).map(lambda name: name + ";meta"),
)

USUAL_LABELS = [("app", "fuzz"), ("content-type", "application/x-ndjson"), ("env", "")]
odd_labels = st.lists(
    st.builds(pb.Label, name=texts, value=texts, prefix=st.booleans()), min_size=1, max_size=3
).map(lambda ls: pb.LabelSet(labels=ls))
label_sets = st.lists(st.sampled_from(USUAL_LABELS), max_size=2).map(
    lambda pairs: labels.label_set(*sorted(set(pairs)))
)
odd_label_sets = st.one_of(odd_labels, odd_labels.map(labels.normalize))
usual_selector_labels = st.lists(
    st.sampled_from(
        [
            ("name", KEPT[0]),
            ("name", GHOSTED),
            ("prefix", "fuzz/"),
            ("prefix", "fuzz/kept/"),
            ("app", "fuzz"),
            ("content-type", ""),
        ]
    ),
    max_size=2,
).map(lambda pairs: labels.label_set(*sorted(set(pairs))))
selectors = st.builds(
    pb.LabelSelector, include=usual_selector_labels, exclude=usual_selector_labels
)
odd_selectors = st.builds(
    pb.LabelSelector,
    include=st.one_of(odd_label_sets, usual_selector_labels),
    exclude=st.one_of(odd_label_sets, usual_selector_labels),
)

process_ids = st.one_of(
    st.sampled_from([BROKER_ID, GHOST_ID]), st.builds(pb.ProcessSpec.ID, zone=texts, suffix=texts)
)
routes = st.builds(
    pb.Route,
    members=st.lists(process_ids, max_size=3),
    primary=st.one_of(st.integers(-1, 2), INT32),
    endpoints=st.lists(st.one_of(st.sampled_from(["", GHOST_ENDPOINT]), texts), max_size=3),
)
durations = st.builds(
    duration_pb2.Duration,
    seconds=st.one_of(st.integers(0, 100_000), INT64),
    nanos=st.one_of(st.integers(0, 999_999_999), INT32),
)
odd_codecs = st.one_of(st.sampled_from([0, 6]), INT32)
sums = st.builds(pb.SHA1Sum, part1=UINT64, part2=UINT64, part3=UINT32)


def headers(live: Live, *, future: bool = True) -> st.SearchStrategy[pb.Header]:
    """Real headers (for any journal created before the fuzzing) and random ones. Without
    `future`, no revision later than what the broker answered before the fuzzing."""
    revisions = st.integers(0, live.etcd.revision)
    if future:
        revisions = st.one_of(revisions, INT64)
    etcd = st.builds(
        pb.Header.Etcd,
        cluster_id=st.one_of(st.just(live.etcd.cluster_id), UINT64),
        member_id=st.one_of(st.just(live.etcd.member_id), UINT64),
        revision=revisions,
        raft_term=st.one_of(st.just(live.etcd.raft_term), UINT64),
    )
    return st.one_of(
        st.sampled_from(sorted(live.routes)).map(live.header_of),
        st.builds(pb.Header, process_id=process_ids, route=routes, etcd=etcd),
    )


def waits_for_revision(live: Live, header: pb.Header | None, revision: int = 0) -> bool:
    """Whether a request names an etcd revision this broker may not have reached yet."""
    named = max(revision, header.etcd.revision if header is not None else 0)
    return named > live.revision


def header_of(request: Message) -> pb.Header | None:
    return request.header if request.HasField("header") else None  # type: ignore[attr-defined]


# ---- the RPCs, as messages ----------------------------------------------------------------------


@FUZZ_SETTINGS
@given(data=st.data())
def test_list(live: Live, data: st.DataObject) -> None:
    f = Fields(data.draw)
    request = pb.ListRequest(selector=f(selectors, odd_selectors), watch=f.flag())
    resume = f(st.none(), headers(live))
    if resume is not None:
        request.watch_resume.CopyFrom(resume)
    waits = request.watch or (resume is not None and resume.etcd.revision >= live.revision)
    call(live, "List", "messages", [payload(request)], may_wait=waits)


apply_names = st.sampled_from(APPLIED)
odd_apply_names = odd_names.filter(lambda name: name.split(";")[0] not in TARGETS)
store_urls = st.sampled_from([STORE, "file:///fuzz-missing/", STORE + "?find=fuzz&replace=zz"])
# Never a usable gs:// or s3:// store: the broker would go out to the cloud.
odd_store_urls = texts.filter(lambda url: not re.match(r"\s*(gs|s3)\s*:", url, re.IGNORECASE))
LAYOUT = st.text(st.sampled_from([*"2006-01-02T15:04:05.000000Z07:00 MonJanPMpm_/.=", "é"]))
templates = st.sampled_from(
    [
        "",
        'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}',
        "{{ .JournalSpec.Name }}",
        "{{ .Spool.Begin }}",
        "{{/* comment */}}x",
    ]
)
odd_templates = st.one_of(
    LAYOUT.map(lambda layout: f'd={{{{ .Spool.FirstAppendTime.Format "{layout}" }}}}'),
    texts.map(lambda inner: "{{" + inner + "}}"),
    texts,
)


@st.composite
def journal_specs(draw: st.DrawFn) -> pb.JournalSpec:
    f = Fields(draw)
    spec = pb.JournalSpec(
        name=f(apply_names, odd_apply_names),
        replication=f(st.integers(1, 3), INT32),
        labels=f(label_sets, odd_label_sets),
        flags=f(st.sampled_from([0, 1, 2, 4]), UINT32),
        max_append_rate=f(st.sampled_from([0, 1 << 20]), INT64),
    )
    fragment = spec.fragment
    fragment.length = f(st.sampled_from([1024, 1 << 20]), INT64)
    fragment.compression_codec = f(st.integers(1, 4), odd_codecs)
    fragment.stores.extend(f(st.lists(store_urls, max_size=2), st.lists(odd_store_urls)))
    fragment.refresh_interval.CopyFrom(f(st.just(duration_pb2.Duration(seconds=1)), durations))
    for name in ("retention", "flush_interval"):
        duration = f(st.none(), durations)
        if duration is not None:
            getattr(fragment, name).CopyFrom(duration)
    fragment.path_postfix_template = f(templates, odd_templates)
    if f.flag():
        spec.suspend.level = f(st.integers(0, 2), INT32)
        spec.suspend.offset = draw(offsets)
    return spec


@st.composite
def changes(draw: st.DrawFn) -> pb.ApplyRequest.Change:
    f = Fields(draw)
    change = pb.ApplyRequest.Change(expect_mod_revision=f(st.just(-1), INT64))
    which = draw(st.sampled_from(["upsert", "upsert", "delete", "neither"]))
    if which == "upsert":
        change.upsert.CopyFrom(draw(journal_specs()))
    elif which == "delete":
        change.delete = f(apply_names, odd_apply_names)
    return change


@FUZZ_SETTINGS
@given(request=st.builds(pb.ApplyRequest, changes=st.lists(changes(), max_size=3)))
def test_apply(live: Live, request: pb.ApplyRequest) -> None:
    call(live, "Apply", "messages", [payload(request)], may_wait=False)


read_names = st.one_of(odd_names, st.sampled_from(APPLIED))
# Not NAMES or CORRUPT, which the store tests below lay out themselves.
odd_append_names = odd_names.filter(lambda name: name.split(";")[0] not in (NAMES, CORRUPT))


@FUZZ_SETTINGS
@given(data=st.data())
def test_read(live: Live, data: st.DataObject) -> None:
    f = Fields(data.draw)
    request = pb.ReadRequest(
        journal=f(st.sampled_from((*KEPT, GHOSTED)), read_names),
        offset=f(st.integers(-1, 4000), offsets),
        block=f.flag(),
        do_not_proxy=data.draw(st.booleans()),
        metadata_only=f.flag(),
        end_offset=f(st.just(0), offsets),
        begin_mod_time=f(st.just(0), INT64),
        min_etcd_revision=f(st.just(0), INT64),
    )
    header = f(st.none(), headers(live))
    if header is not None:
        request.header.CopyFrom(header)
    waits = request.block or waits_for_revision(live, header, request.min_etcd_revision)
    responses, _ = call(live, "Read", "messages", [payload(request)], may_wait=waits)
    check_read(live, request.journal, responses)


def check_read(live: Live, journal: str, responses: Sequence[pb.ReadResponse]) -> None:
    """Every byte read from a kept journal is one that was committed there, at its offset."""
    known = live.content.get(journal.split(";", 1)[0])
    if known is None:
        return
    for response in responses:
        if response.content:
            at = response.offset
            assert bytes(known[at : at + len(response.content)]) == response.content, (
                f"{journal}: read {len(response.content)} bytes at {at} that were never "
                "committed there"
            )


def known_head(live: Live, journal: str) -> int:
    return len(live.content.get(journal.split(";", 1)[0], b""))


@st.composite
def append_streams(draw: st.DrawFn, live: Live) -> list[pb.AppendRequest]:
    f = Fields(draw)
    journal = f(st.sampled_from((*KEPT, GHOSTED, *APPLIED)), odd_append_names)
    first = pb.AppendRequest(
        journal=journal,
        do_not_proxy=draw(st.booleans()),
        offset=f(st.sampled_from([0, known_head(live, journal)]), offsets),
        suspend=f(st.sampled_from([0, 0, 0, 1, 2, 3, 4]), INT32),
        # No revision the broker may not have reached: an append that waits for one could
        # commit after its deadline, leaving what a kept journal holds unknown.
        min_etcd_revision=f(st.just(0), st.integers(0, live.etcd.revision)),
    )
    header = f(st.none(), headers(live, future=False))
    if header is not None:
        first.header.CopyFrom(header)
    if f.flag():
        first.check_registers.CopyFrom(draw(st.one_of(selectors, odd_selectors)))
    for name in ("union_registers", "subtract_registers"):
        if f.flag():
            getattr(first, name).CopyFrom(draw(st.one_of(label_sets, odd_label_sets)))
    first.content = f(st.just(b""), st.binary(min_size=1, max_size=8))
    stream = [first]
    stream += [
        pb.AppendRequest(content=chunk)
        for chunk in draw(st.lists(st.binary(min_size=1, max_size=300), max_size=4))
    ]
    ending = f(st.just("commit"), st.sampled_from(["eof", "commit and more"]))
    if ending != "eof":
        stream.append(pb.AppendRequest())
    if ending == "commit and more":
        stream.append(draw(st.sampled_from([pb.AppendRequest(content=b"x"), first])))
    return stream


@FUZZ_SETTINGS
@given(data=st.data())
def test_append(live: Live, data: st.DataObject) -> None:
    stream = data.draw(append_streams(live))
    send_append(live, "messages", [payload(m) for m in stream])


def send_append(live: Live, kind: str, payloads: Sequence[bytes]) -> None:
    parsed = parse_all(pb.AppendRequest, payloads)
    first = parsed[0] if parsed else None
    waits = first is not None and waits_for_revision(
        live, header_of(first), first.min_etcd_revision
    )
    responses, _ = call(live, "Append", kind, payloads, may_wait=waits)
    if first is not None and responses and responses[0].status == pb.OK:
        # A first message with content is the whole append (the one-message form: the broker
        # refuses a stream that goes on after it); otherwise the content messages up to the
        # first empty one.
        committed = first.content
        for message in [] if first.content else parsed[1:]:
            if not message.content:
                break
            committed += message.content
        record_commit(live.content, first.journal, responses[0], committed)


def parse_all(message_type: type[Any], payloads: Sequence[bytes]) -> list[Any]:
    """The messages of `payloads` as the broker parses them, as far as they parse."""
    out = []
    for data in payloads:
        try:
            out.append(message_type.FromString(data))
        except DecodeError:
            break
    return out


@st.composite
def replicate_streams(draw: st.DrawFn, live: Live) -> list[pb.ReplicateRequest]:
    """A rogue peer: a coherent replication (roll the spool to an offset, stream content,
    commit it), bent by odd fields, with the journal's real header or a random one."""
    f = Fields(draw)
    journal = f(st.just(GHOSTED), st.one_of(st.sampled_from(TARGETS), odd_names))
    first = pb.ReplicateRequest(acknowledge=not f.flag())
    header = f(st.just(journal), st.sampled_from([GHOSTED, "random", "none"]))
    if header in live.routes:
        first.header.CopyFrom(live.header_of(header))
    elif header == "random":
        first.header.CopyFrom(draw(headers(live)))
    # Usually past every offset rogues used before: the spool rolls there.
    at = f(st.integers(0, 100).map(lambda k: live.rogue_offset + k), offsets)
    first.proposal.CopyFrom(
        f(
            st.just(pb.Fragment(journal=journal, begin=at, end=at, compression_codec=pb.NONE)),
            st.builds(
                pb.Fragment,
                journal=st.one_of(st.just(journal), odd_names),
                begin=offsets,
                end=offsets,
                sum=sums,
                compression_codec=st.one_of(st.integers(1, 4), odd_codecs),
                backing_store=st.one_of(st.just(""), texts),
                mod_time=st.one_of(st.just(0), INT64),
                path_postfix=st.one_of(st.just(""), texts),
            ),
        )
    )
    first.registers.CopyFrom(f(label_sets, odd_label_sets))
    stream = [first]
    chunks = draw(st.lists(st.binary(min_size=1, max_size=200), max_size=3))
    delta = 0
    for chunk in chunks:
        stream.append(pb.ReplicateRequest(content=chunk, content_delta=f(st.just(delta), INT64)))
        delta += len(chunk)
    begin = first.proposal.end
    if not f.flag() and 0 <= begin <= MAX64 - delta:
        commit = pb.Fragment(
            journal=journal,
            begin=begin,
            end=begin + delta,
            sum=sum_of(b"".join(chunks)) if chunks else None,
            compression_codec=first.proposal.compression_codec,
        )
        stream.append(
            pb.ReplicateRequest(
                proposal=commit, registers=first.registers, acknowledge=not f.flag()
            )
        )
    stream += f(
        st.just([]),
        st.lists(
            st.builds(
                pb.ReplicateRequest,
                proposal=st.none() | st.builds(pb.Fragment, journal=st.just(journal), end=offsets),
                content=st.binary(max_size=20),
                content_delta=st.one_of(st.just(delta), INT64),
                acknowledge=st.booleans(),
                header=st.none() | headers(live),
            ),
            min_size=1,
            max_size=2,
        ),
    )
    return stream


@FUZZ_SETTINGS
@given(data=st.data())
def test_replicate(live: Live, data: st.DataObject) -> None:
    stream = data.draw(replicate_streams(live))
    send_replicate(live, "messages", [payload(m) for m in stream])


def send_replicate(live: Live, kind: str, payloads: Sequence[bytes]) -> None:
    parsed = parse_all(pb.ReplicateRequest, payloads)
    first = parsed[0] if parsed else None
    # A replica's spool is taken for as long as a primary's pipeline runs: a Replicate to
    # any journal but GHOSTED (whose primary is the ghost) may wait for it until its deadline.
    waits = first is not None and (
        first.proposal.journal != GHOSTED or waits_for_revision(live, header_of(first))
    )
    call(live, "Replicate", kind, payloads, may_wait=waits)
    ends = [m.proposal.end for m in parsed if m.proposal.end < MAX64 - (1 << 20)]
    live.rogue_offset = max([live.rogue_offset, *ends]) + 1


@FUZZ_SETTINGS
@given(data=st.data())
def test_list_fragments(live: Live, data: st.DataObject) -> None:
    f = Fields(data.draw)
    request = pb.FragmentsRequest(
        journal=f(st.sampled_from(TARGETS), read_names),
        begin_mod_time=f(st.just(0), INT64),
        end_mod_time=f(st.just(0), INT64),
        next_page_token=f(st.just(0), offsets),
        page_limit=f(st.integers(0, 3), INT32),
        do_not_proxy=data.draw(st.booleans()),
    )
    ttl = f(st.one_of(st.none(), st.just(duration_pb2.Duration(seconds=60))), durations)
    if ttl is not None:
        request.signatureTTL.CopyFrom(ttl)
    header = f(st.none(), headers(live))
    if header is not None:
        request.header.CopyFrom(header)
    waits = waits_for_revision(live, header)
    call(live, "ListFragments", "messages", [payload(request)], may_wait=waits)


@st.composite
def health_requests(draw: st.DrawFn) -> pb.FragmentStoreHealthRequest:
    f = Fields(draw)
    return pb.FragmentStoreHealthRequest(
        fragment_store=f(store_urls, odd_store_urls),
        check_delete=draw(st.booleans()),
        check_delete_prefix=f(st.sampled_from(["", "a/", "fuzz/x/"]), texts),
    )


@FUZZ_SETTINGS
@given(request=health_requests())
def test_fragment_store_health(live: Live, request: pb.FragmentStoreHealthRequest) -> None:
    call(live, "FragmentStoreHealth", "messages", [payload(request)], may_wait=False)


# ---- the RPCs, as raw bytes ---------------------------------------------------------------------


def garbled(data: bytes) -> st.SearchStrategy[bytes]:
    """A message's bytes as they are, mutated, or replaced by random bytes."""
    return st.one_of(mutated_bytes(data), st.binary(max_size=64), st.just(data))


UNARY_SOURCES: dict[str, st.SearchStrategy[Message]] = {
    "List": st.builds(pb.ListRequest, selector=selectors, watch=st.booleans()),
    "Apply": st.builds(pb.ApplyRequest, changes=st.lists(changes(), max_size=2)),
    "Read": st.builds(pb.ReadRequest, journal=st.sampled_from(TARGETS), offset=offsets),
    "ListFragments": st.builds(pb.FragmentsRequest, journal=st.sampled_from(TARGETS)),
    "FragmentStoreHealth": health_requests(),
}


@pytest.mark.parametrize("rpc", list(METHODS))
@FUZZ_SETTINGS
@given(data=st.data())
def test_raw_bytes(live: Live, rpc: str, data: st.DataObject) -> None:
    """Each method's request bodies, garbled: most are not valid protobuf at all; streams
    begin as a valid stream of the method, some of whose messages are garbled."""
    if rpc == "Append":
        stream = [payload(m) for m in data.draw(append_streams(live))]
        send_append(live, "raw bytes", [data.draw(garbled(p)) for p in stream])
        return
    if rpc == "Replicate":
        stream = [payload(m) for m in data.draw(replicate_streams(live))]
        send_replicate(live, "raw bytes", [data.draw(garbled(p)) for p in stream])
        return
    body = data.draw(
        st.one_of(st.binary(max_size=64), UNARY_SOURCES[rpc].map(payload).flatmap(mutated_bytes))
    )
    parsed = parse_all(METHODS[rpc][1], [body])
    request = parsed[0] if parsed else None
    waits = False
    if isinstance(request, pb.ListRequest):
        waits = request.watch or request.HasField("watch_resume")
    elif isinstance(request, pb.ReadRequest):
        waits = request.block or waits_for_revision(
            live, header_of(request), request.min_etcd_revision
        )
    elif isinstance(request, pb.FragmentsRequest):
        waits = waits_for_revision(live, header_of(request))
    responses, _ = call(live, rpc, "raw bytes", [body], may_wait=waits)
    if isinstance(request, pb.ReadRequest):
        check_read(live, request.journal, responses)


# ---- fragment files found in a store ------------------------------------------------------------

SLOW_SETTINGS = settings(FUZZ_SETTINGS, max_examples=SLOW_EXAMPLES)
HEXES = "0123456789abcdefABCDEF"
hex_offsets = st.one_of(
    st.integers(0, 1 << 16).map("{:016x}".format),
    st.sampled_from([MAX64, MAX64 - 1, 1 << 62]).map("{:016x}".format),
    st.text(st.sampled_from([*HEXES, "-", "+", "x"]), min_size=1, max_size=18),
)
name_segments = st.one_of(
    st.sampled_from(["date=2024-01-01", "é", "a b", "x=1%2F", ".partial-x"]).map(os.fsencode),
    st.text(min_size=1, max_size=8).map(os.fsencode),
    st.binary(min_size=1, max_size=6),  # Not UTF-8, as another tool may name a file.
)


@st.composite
def store_file_names(draw: st.DrawFn) -> bytes:
    """A file's path under a journal's directory: mostly fragment names (of valid, huge or
    inverted offsets, odd sums and extensions), some under postfix directories."""
    segments = draw(st.lists(name_segments, max_size=2))
    if draw(st.integers(0, 3)) == 0:
        return b"/".join([*segments, draw(name_segments)])
    name = draw(
        st.builds(
            "{}-{}-{}{}".format,
            hex_offsets,
            hex_offsets,
            st.one_of(
                st.text(st.sampled_from("0123456789abcdef"), min_size=40, max_size=40),
                st.text(st.sampled_from(HEXES), min_size=38, max_size=42),
            ),
            st.sampled_from(["", ".raw", ".gz", ".GZIP", ".zst", ".sz", ".gzod", ".lz4"]),
        ).map(os.fsencode)
    )
    return b"/".join([*segments, name])


def write_under(directory: Path, relative: bytes, content: bytes) -> bool:
    """Write `content` at `relative` under `directory` (bytes: names need not be UTF-8), skipping
    segments that would leave it; False where the file system refuses the name."""
    parts = [p for p in relative.split(b"/") if p and p not in (b".", b"..") and b"\0" not in p]
    if not parts:
        return False
    path = os.path.join(os.fsencode(directory), *parts)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
    except OSError:
        return False  # A name over the file system's limit, or a file where a directory is.
    return True


def fragments_in(directory: Path, journal: str) -> list[pb.Fragment]:
    """Every file under the journal's directory that is a fragment, as a listing reads it."""
    found = []
    for dirpath, _, filenames in os.walk(directory):
        for filename in filenames:
            relative = os.path.relpath(os.path.join(dirpath, filename), directory)
            with contextlib.suppress(ValidationError):
                found.append(parse_relative_path(journal, relative))
    return found


def key(fragment: pb.Fragment) -> tuple[int, int, str, bytes]:
    return (fragment.begin, fragment.end, fragment.path_postfix, digest_of(fragment.sum))


def persisted_listing(live: Live, journal: str, kind: str) -> list[pb.Fragment]:
    responses, error = call(
        live, "ListFragments", kind, [payload(pb.FragmentsRequest(journal=journal))], may_wait=False
    )
    assert error is None and responses[0].status == pb.OK, (error, responses)
    return [f.spec for f in responses[0].fragments if f.spec.backing_store]


@SLOW_SETTINGS
@given(names=st.lists(store_file_names(), min_size=1, max_size=12), data=st.data())
def test_fragment_files_found_in_a_store(
    live: Live, names: list[bytes], data: st.DataObject
) -> None:
    """Files of any name under a journal's directory: the broker's listing and Spark's (straight
    from the store) skip what is not a fragment, in one logged line each; gazctl lists the
    rest; a read answers, as does an append at the listed end."""
    directory = live.root / "fuzz-store" / NAMES
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for name in names:
        write_under(directory, name, data.draw(st.binary(max_size=64)))
    # A fragment no other name is likely to cover: once listed, the broker listed these files.
    live.markers += 1
    marker = pb.Fragment(journal=NAMES, begin=(1 << 61) + 2 * live.markers)
    marker.end = marker.begin + 1
    marker.sum.CopyFrom(sum_of(b"m"))
    marker.compression_codec = pb.NONE
    assert write_under(directory, os.fsencode(content_name(marker)), b"m")
    present = {key(f) for f in fragments_in(directory, NAMES)}
    spark = listed_fragments(live.specs[NAMES], live.root)
    assert {key(f) for f in spark} <= present, "Spark's listing holds a fragment no file holds"
    assert key(marker) in {key(f) for f in spark}
    # The broker's index follows its next listing: only fragments that files hold, one of them
    # covering the marker.
    # (Fragments of what the test appended are the broker's own: it keeps its copy of one it
    # persisted until a listing shows it, which the directory's removal may prevent.)
    listed: list[pb.Fragment] = []

    def follows() -> bool:
        nonlocal listed
        listed = persisted_listing(live, NAMES, "store files")
        theirs = [f for f in listed if not any(f.begin <= at < f.end for at in live.names_appends)]
        stale = {key(f) for f in theirs} - present
        return not stale and any(
            f.begin <= marker.begin and f.end >= marker.end and key(f) in present for f in listed
        )

    until_blocking(follows, "the broker lists the marker and no fragment of removed files", 20, 0.2)

    r = gazctl(live.broker, "journals", "fragments", "-l", f"name={NAMES}", "-o", "json")
    assert r.code == 0 and "Traceback" not in r.err, r.err
    read = pb.ReadRequest(journal=NAMES, offset=min(f.begin for f in listed))
    call(live, "Read", "store files", [payload(read)], may_wait=False)
    end = max(f.end for f in listed)
    responses, _ = call(
        live, "Append", "store files", append_request(NAMES, b"x", offset=end), may_wait=False
    )
    if responses and responses[0].status == pb.OK:
        live.names_appends.append(responses[0].commit.begin)


# ---- corrupt fragment content -------------------------------------------------------------------


@st.composite
def corruptions(draw: st.DrawFn, stored: bytes) -> bytes:
    """`stored` (a fragment's compressed content) cut short, with bytes flipped or appended, or
    replaced."""
    how = draw(st.sampled_from(["cut", "flip", "append", "replace", "empty"]))
    if how == "cut":
        return stored[: draw(st.integers(0, max(0, len(stored) - 1)))]
    if how == "flip":
        return bytes(draw(mutated_bytes(stored)))
    if how == "append":
        return stored + draw(st.binary(min_size=1, max_size=16))
    if how == "replace":
        return draw(st.binary(min_size=1, max_size=len(stored) + 8))
    return b""


@SLOW_SETTINGS
@given(
    codec=st.sampled_from([pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY]),
    content=st.binary(min_size=1, max_size=4000),
    data=st.data(),
)
def test_corrupt_fragment_content(
    live: Live, codec: pb.CompressionCodec.ValueType, content: bytes, data: st.DataObject
) -> None:
    """A fragment under its valid name whose stored bytes are not what the name says: read
    through the broker, straight from the store, or by gazctl, the content comes back exact
    (a harmless change, such as a gzip header's) or the read fails in one line naming the
    fragment (DATA_LOSS from the broker); never other bytes."""
    fragment = pb.Fragment(
        journal=CORRUPT,
        begin=live.corrupt_offset,
        end=live.corrupt_offset + len(content),
        sum=sum_of(content),
        compression_codec=codec,
    )
    live.corrupt_offset = fragment.end  # The next example's follows this one.
    stored = data.draw(corruptions(codecs.compress(codec, content)))
    assert write_under(live.root / "fuzz-store", os.fsencode(fragment_path(fragment)), stored)
    until_blocking(
        lambda: key(fragment) in {key(f) for f in persisted_listing(live, CORRUPT, "corrupt")},
        "the broker lists the fragment",
        20,
        0.2,
    )

    # The broker streams it unverified (a reader checks what it reads whole): its answer is
    # some bytes or DATA_LOSS, and the client library's read is the content or FragmentCorrupt.
    request = pb.ReadRequest(journal=CORRUPT, offset=fragment.begin, end_offset=fragment.end)
    call(live, "Read", "corrupt", [payload(request)], may_wait=False)
    for direct in (False, True):
        try:
            got = asyncio.run(read_range(live, fragment, direct=direct))
        except FragmentCorrupt as exc:
            assert "\n" not in str(exc) and fragment_path(fragment) in str(exc)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DATA_LOSS and is_clear(exc.details()), exc
        else:
            assert got == content, f"read {len(got)} wrong bytes of a corrupt fragment"

    offsets = live.root.parent / "offsets.json"
    offsets.write_text(json.dumps({CORRUPT: fragment.begin}))
    r = gazctl(
        live.broker, "journals", "read", "-l", f"name={CORRUPT}", "--offsets", str(offsets),
        "--file-root", str(live.root), "-o", str(live.root.parent / "read.out"),
    )  # fmt: skip
    if r.code == 0:
        assert (live.root.parent / "read.out").read_bytes() == content
    else:
        assert_one_line_error(r, fragment_path(fragment))


async def read_range(live: Live, fragment: pb.Fragment, *, direct: bool) -> bytes:
    channel = dial(live.broker.address)
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        out = b""
        async for chunk in read(
            stub, CORRUPT, fragment.begin, end_offset=fragment.end, direct=direct,
            file_root=live.root,
        ):  # fmt: skip
            out += chunk.content
        return out
    finally:
        await channel.close(None)


# ---- gazctl: spec YAML and selectors ------------------------------------------------------------

SPECS = """\
name: fuzz/yaml/
replication: 1
labels:
  - name: app
    value: fuzz
fragment:
  length: 1024
  compression_codec: GZIP
  stores:
    - file:///fuzz-store/
  refresh_interval: 1s
  retention: 1h
children:
  - name: fuzz/yaml/a
  - name: fuzz/yaml/b
    fragment:
      compression_codec: NONE
      path_postfix_template: 'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}'
"""


def journals_now(live: Live) -> dict[str, tuple[int, pb.JournalSpec]]:
    raw, error = invoke(live.channel, "List", [payload(pb.ListRequest())], LONG)
    assert error is None, error
    out = {}
    for data in raw:
        for journal in pb.ListResponse.FromString(data).journals:
            out[journal.spec.name] = (journal.mod_revision, journal.spec)
    return out


@SLOW_SETTINGS
@given(text=mutated_yaml(SPECS))
def test_gazctl_apply_of_fuzzed_specs_is_all_or_nothing(live: Live, text: str) -> None:
    before = journals_now(live)
    r = gazctl(live.broker, "journals", "apply", "--specs", "-", input=text)
    after = journals_now(live)
    changed = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
    if r.code != 0:
        assert_one_line_error(r)
        assert not changed, f"a failed apply changed {sorted(changed)}"
        return
    assert "Traceback" not in r.err
    entries = {e.spec.name: e for e in flatten(decode_tree(text))}
    assert changed <= set(entries), f"the apply changed {sorted(changed - set(entries))} too"
    for name, entry in entries.items():
        if entry.delete:
            assert name not in after
        else:
            assert after[name][1] == entry.spec, f"{name} was applied otherwise"
    # Put back what it created.
    undo = pb.ApplyRequest(
        changes=[
            pb.ApplyRequest.Change(delete=name, expect_mod_revision=-1)
            for name in changed
            if name not in before
        ]
    )
    if undo.changes:
        _, error = invoke(live.channel, "Apply", [payload(undo)], LONG)
        assert error is None, error


selector_texts = st.one_of(
    mutated_text(
        st.sampled_from(
            [
                f"name={KEPT[0]}",
                "prefix=fuzz/kept/",
                "app in (fuzz, other), !deprecated",
                "name:prefix=fuzz/, app notin (x)",
                "content-type=application/x-ndjson",
            ]
        )
    ),
    st.text(max_size=40).filter(lambda text: "\0" not in text),
)


@SLOW_SETTINGS
@given(text=selector_texts)
def test_gazctl_list_with_fuzzed_selectors(live: Live, text: str) -> None:
    r = gazctl(live.broker, "journals", "list", f"--selector={text}", "-o", "json")
    if r.code != 0:
        assert_one_line_error(r)
        return
    assert "Traceback" not in r.err
    matcher = labels.JournalMatcher(labels.rewrite_prefix_meta_label(labels.parse_selector(text)))
    for line in r.out.splitlines():
        spec = json_format.ParseDict(json.loads(line)["spec"], pb.JournalSpec())
        assert matcher.matches(spec), f"{spec.name} does not match {text!r}"


# ---- defects found by fuzzing (issue 12), fixed ------------------------------------------------


@pytest.mark.parametrize("rpc", list(METHODS))
def test_a_request_that_is_not_protobuf_is_invalid_argument(live: Live, rpc: str) -> None:
    _, error = invoke(live.channel, rpc, [b"\xff\xff\xff"], LONG)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "not a valid protobuf message" in (error.details() or "")


def test_an_append_with_another_clusters_header_is_refused_cleanly(live: Live) -> None:
    header = live.header_of(KEPT[0])
    header.etcd.cluster_id ^= 1
    stream = append_request(KEPT[0], b"never", header=header)
    before = len(unhandled_errors(live.broker.log.read_text(errors="replace"), known=False))
    _, error = invoke(live.channel, "Append", stream, LONG)
    assert error is not None and error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    assert "etcd cluster" in (error.details() or "")
    # A hold: a traceback would reach the log of the broker (another process) meanwhile; the
    # test holds that none does, and absence has no event to wait for.
    time.sleep(0.2)  # The hold.
    after = len(unhandled_errors(live.broker.log.read_text(errors="replace"), known=False))
    assert after == before, "the broker logged a traceback"


def test_an_append_past_the_largest_offset_is_refused_cleanly(live: Live) -> None:
    spec = spec_of(EDGE, stores=())
    # Suspended where the journal's next write begins: its first append resumes it there.
    spec.suspend.level = pb.JournalSpec.Suspend.PARTIAL
    spec.suspend.offset = MAX64 - 1
    applied = pb.ApplyRequest(changes=[pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=-1)])
    _, error = invoke(live.channel, "Apply", [payload(applied)], LONG)
    assert error is None, error
    wait_routed(live.channel, [EDGE])
    before = len(unhandled_errors(live.broker.log.read_text(errors="replace"), known=False))
    raw, error = invoke(live.channel, "Append", append_request(EDGE, b"xy"), LONG)
    assert error is not None, pb.AppendResponse.FromString(raw[0])
    assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE), error
    # A hold: a traceback would reach the log of the broker (another process) meanwhile; the
    # test holds that none does, and absence has no event to wait for.
    time.sleep(0.2)  # The hold.
    after = len(unhandled_errors(live.broker.log.read_text(errors="replace"), known=False))
    assert after == before, "the broker logged a traceback"


def test_a_replicate_header_with_an_invalid_process_id_is_refused_in_one_line(live: Live) -> None:
    header = live.header_of(GHOSTED)
    header.process_id.suffix = "broker\r0"
    first = pb.ReplicateRequest(
        header=header, proposal=pb.Fragment(journal=GHOSTED), acknowledge=True
    )
    _, error = invoke(live.channel, "Replicate", [payload(first)], LONG)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert is_clear(error.details())


# ---- afterwards ---------------------------------------------------------------------------------


def read_all(live: Live, journal: str) -> dict[int, bytes]:
    """Every content chunk of `journal` from offset 0 to its write head, by offset."""
    request = pb.ReadRequest(journal=journal, offset=0)
    raw, error = invoke(live.channel, "Read", [payload(request)], LONG)
    assert error is None, f"reading {journal}: {error}"
    chunks = {}
    for data in raw:
        response = pb.ReadResponse.FromString(data)
        assert response.status in (pb.OK, pb.OFFSET_NOT_YET_AVAILABLE), response
        if response.content:
            chunks[response.offset] = response.content
    return chunks


UNHANDLED = re.compile(r"Traceback|raised by servicer method")


def unhandled_errors(log: str, *, known: bool = True) -> list[str]:
    """Log records (a timestamped line and what follows it) with a traceback or an exception
    that gRPC caught from a handler, except (unless `known` is False) those of known defects."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", log)
    return [
        r
        for r in records
        if UNHANDLED.search(r)
        and not (known and any(d.log and d.log.search(r) for d in KNOWN_DEFECTS))
    ]


def test_afterwards_the_broker_runs_and_every_journal_is_intact(live: Live) -> None:
    assert live.broker.proc.poll() is None, "the broker exited"
    for name in KEPT:
        journals = listing(live.channel, name)[0].journals
        assert len(journals) == 1, f"{name} is gone"
        spec, expected = pb.JournalSpec(), pb.JournalSpec()
        spec.CopyFrom(journals[0].spec)
        expected.CopyFrom(live.specs[name])
        spec.ClearField("suspend")
        assert spec == expected, f"{name}'s spec changed"
        # It takes an append (resumed, if a fuzzed append suspended it).
        append_ok(
            live.channel,
            name,
            b"after the fuzzing\n",
            live.content,
            suspend=pb.AppendRequest.SUSPEND_RESUME,
        )
        chunks = read_all(live, name)
        read = b"".join(chunks[at] for at in sorted(chunks))
        assert sorted(chunks) == [
            sum(len(chunks[b]) for b in sorted(chunks) if b < at) for at in sorted(chunks)
        ], f"{name}: content has gaps: {sorted(chunks)}"
        assert read == bytes(live.content[name]), f"{name} does not read back as written"
    stored = stored_files(live.root)
    for path, data in live.stored.items():
        assert stored.get(path) == data, f"{path} was removed or changed in the store"
    errors = unhandled_errors(live.broker.log.read_text(errors="replace"))
    assert not errors, f"the broker logged {len(errors)} unhandled errors, as:\n" + "\n".join(
        "\n".join([*e.splitlines()[:2], "  ...", *e.splitlines()[-1:]]) for e in errors[:3]
    )
    tests = [(rpc, kind) for rpc in METHODS for kind in ("messages", "raw bytes")]
    inputs = live.tally.inputs()
    if all(test in inputs for test in tests):  # Every RPC test ran (no -k selection).
        fuzzed = sum(inputs[test] for test in tests)
        assert fuzzed >= INPUTS, f"only {fuzzed} of {INPUTS} inputs were fuzzed"
