"""Which journals a Spark job reads, and their persisted fragments, found with or without brokers.

Journals come from a broker's List (`broker`) or, with no broker at all, from a specs file as
`gazctl journals list -o yaml` writes it (`specs`). Fragments always come straight from each
journal's stores: they are the durable history, and a store listing needs no broker. Where a
listing overlaps (a compaction interrupted between writing its fragment and removing the ones it
covers), the larger fragment wins, as in a broker's index. Content that brokers hold past the
store's end is not persisted yet: with a broker to ask, `unpersisted` names those journals."""

from __future__ import annotations

import asyncio
import difflib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from broker.client import JournalsClient, ListSnapshot
from broker.client.reader import ReadError, write_head
from broker.fragment.content import FragmentCorrupt, describe, open_in_store
from broker.fragment.cover_set import CoverSet, IndexedFragment
from broker.fragment.stores import FragmentStore, StoreError, open_store
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from spec import decode_journals

FULLY_SUSPENDED = pb.JournalSpec.Suspend.FULL  # No replicas: everything is persisted.
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def known_options(options: Mapping[str, object], names: Sequence[str], what: str) -> dict[str, str]:
    """The options given (empty ones left out), keyed by their names as `names` spell them
    (Spark passes them case-insensitively); an unknown one is a JobError line naming the
    closest known one."""
    known = {name.lower(): name for name in names}
    given: dict[str, str] = {}
    for key, value in options.items():
        name = known.get(str(key).lower())
        if name is None:
            close = difflib.get_close_matches(str(key).lower(), list(known), n=1)
            hint = f" (did you mean {known[close[0]]}?)" if close else ""
            raise JobError(f"unknown option {key!r} for {what}{hint}; it takes {', '.join(names)}")
        if value is not None and str(value) != "":
            given[name] = str(value)
    return given


def size_in_bytes(text: str) -> int | None:
    """`512MiB`, `1GB`, `4096`: a positive size in bytes, or None if `text` is not one."""
    match = _SIZE.match(text)
    if not match or int(match.group(1)) <= 0:
        return None
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


class JobError(Exception):
    """A problem a Spark job reports as one line: no journals match, a store cannot be reached,
    a fragment does not match its name, Java or PySpark missing."""


def select_journals(
    selector: str, *, broker: str | None = None, specs: Path | None = None
) -> list[pb.JournalSpec]:
    """The specs of the journals `selector` matches, ordered by name."""
    sel = labels.rewrite_prefix_meta_label(labels.parse_selector(selector))
    if specs is not None:
        try:
            text = specs.read_text()
        except OSError as exc:
            raise JobError(f"cannot read the specs file {specs}: {exc.strerror}") from None
        matcher = labels.JournalMatcher(sel)
        found = [e.spec for e in decode_journals(text) if matcher.matches(e.spec)]
    elif broker is not None:
        found = [j.spec for j in asyncio.run(_list(broker, sel)).journals]
    else:
        raise JobError(
            "name a broker (--broker.address) or a specs file (--specs) to find journals"
        )
    if not found:
        where = f"the specs in {specs}" if specs is not None else f"broker {broker}"
        raise JobError(f"no journals match the selector {selector!r} (asked {where})")
    return sorted(found, key=lambda s: s.name)


async def _list(broker: str, sel: pb.LabelSelector) -> ListSnapshot:
    async with JournalsClient(broker) as client:
        return await client.list(sel)


def store_of(spec: pb.JournalSpec, file_root: Path | None) -> FragmentStore:
    """The journal's durable home: its first fragment store."""
    if not spec.fragment.stores:
        raise JobError(f"journal {spec.name} has no fragment store: its history is only in brokers")
    url = spec.fragment.stores[0]
    if url.startswith("file:") and file_root is None:
        raise JobError(
            f"journal {spec.name} is stored in {url}: give --file-root, the directory that "
            "brokers' --broker.file-root names"
        )
    return open_store_of(url, file_root, f" of {spec.name}")


def open_store_of(url: str, file_root: Path | None, whose: str = "") -> FragmentStore:
    """The fragment store at `url`; JobError (one line) if it cannot be opened."""
    try:
        return open_store(url, file_root=file_root)
    except (StoreError, ValueError) as exc:
        raise JobError(f"cannot open the fragment store {url}{whose}: {exc}") from None


def read_verified(store: FragmentStore, fragment: pb.Fragment) -> Iterator[bytes]:
    """The fragment's whole content, its length and SHA-1 checked; failures as JobError
    naming the fragment (the job fails rather than use wrong bytes)."""
    return read_from(store, fragment, fragment.begin, verify=True)


def read_from(
    store: FragmentStore, fragment: pb.Fragment, offset: int, verify: bool
) -> Iterator[bytes]:
    """The fragment's content from `offset`; without `verify` its SHA-1 is not checked (a
    split of a fragment that another split reads whole and checks); failures as JobError."""
    try:
        yield from open_in_store(store, fragment, offset, verify=verify)
    except FragmentCorrupt as exc:
        raise JobError(str(exc)) from None
    except StoreError as exc:
        raise JobError(f"cannot read {describe(fragment)}: {exc}") from None


def listed_fragments(spec: pb.JournalSpec, file_root: Path | None) -> list[pb.Fragment]:
    """Every fragment persisted in the journal's first store, in (begin, end) order."""
    store = store_of(spec, file_root)
    try:
        return store.list_fragments(spec.name)
    except StoreError as exc:
        raise JobError(f"cannot list the fragments of {spec.name}: {exc}") from None


def stores_end(fragments: Sequence[pb.Fragment]) -> int:
    """Where what a store holds of a journal ends (0 if it holds nothing)."""
    return max((f.end for f in fragments), default=0)


@dataclass(frozen=True)
class Unpersisted:
    """A journal whose brokers hold content past the end of its store, not persisted yet: a
    job that reads the store leaves it out. `problem` says why the write head is unknown."""

    journal: str
    stores_end: int
    write_head: int = -1
    problem: str = ""

    def note(self) -> str:
        flush = f"gazctl journals suspend -l name={self.journal} --force"
        if self.problem:
            return (
                f"{self.journal}: its write head could not be read ({self.problem}): content "
                f"past offset {self.stores_end}, where its store ends, may not be persisted yet, "
                f"and this job leaves it out; to persist it: {flush}"
            )
        return (
            f"{self.journal}: content from offset {self.stores_end} to the write head at "
            f"{self.write_head} is not persisted yet (its store ends at {self.stores_end}), so "
            f"this job leaves it out; to persist it: {flush}"
        )


def unpersisted(
    broker: str, journals: Sequence[pb.JournalSpec], ends: Mapping[str, int]
) -> list[Unpersisted]:
    """The journals (of those in `ends`: name -> where their store ends) whose write head, as
    a broker reads it, is past the end of their store."""
    checked = [s for s in journals if s.name in ends and s.suspend.level != FULLY_SUSPENDED]

    async def check(client: JournalsClient, limit: asyncio.Semaphore, name: str) -> Unpersisted:
        async with limit:
            try:
                head = await write_head(client.stub, name)
            except ReadError as exc:
                return Unpersisted(name, ends[name], problem=pb.Status.Name(exc.status))
            except grpc.aio.AioRpcError as exc:
                return Unpersisted(name, ends[name], problem=exc.code().name)
        return Unpersisted(name, ends[name], head)

    async def check_all() -> list[Unpersisted]:
        limit = asyncio.Semaphore(32)
        async with JournalsClient(broker) as client:
            return await asyncio.gather(*(check(client, limit, s.name) for s in checked))

    found = asyncio.run(check_all()) if checked else []
    return [u for u in found if u.problem or u.write_head > u.stores_end]


def covering(fragments: Sequence[pb.Fragment]) -> tuple[list[pb.Fragment], list[pb.Fragment]]:
    """The fragments that cover the journal (larger ones preferred, as a broker's index does),
    and the redundant rest, each covered by one of the first."""
    cover = CoverSet()
    for fragment in fragments:
        cover.add(IndexedFragment(fragment))
    kept = [f.spec for f in cover]
    ids = {id(f) for f in kept}
    return kept, [f for f in fragments if id(f) not in ids]
