"""Which journals a Spark job reads, and their persisted fragments, found with or without brokers.

Journals come from a broker's List (`broker`) or, with no broker at all, from a specs file as
`gazctl journals list -o yaml` writes it (`specs`). Fragments always come straight from each
journal's stores: they are the durable history, and a store listing needs no broker. Where a
listing overlaps (a compaction interrupted between writing its fragment and removing the ones it
covers), the larger fragment wins, as in a broker's index."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

from broker.client import JournalsClient, ListSnapshot
from broker.fragment.content import FragmentCorrupt, describe, open_in_store
from broker.fragment.cover_set import CoverSet, IndexedFragment
from broker.fragment.stores import FragmentStore, StoreError, open_store
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from spec import decode_journals


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
    try:
        yield from open_in_store(store, fragment, fragment.begin, verify=True)
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


def covering(fragments: Sequence[pb.Fragment]) -> tuple[list[pb.Fragment], list[pb.Fragment]]:
    """The fragments that cover the journal (larger ones preferred, as a broker's index does),
    and the redundant rest, each covered by one of the first."""
    cover = CoverSet()
    for fragment in fragments:
        cover.add(IndexedFragment(fragment))
    kept = [f.spec for f in cover]
    ids = {id(f) for f in kept}
    return kept, [f for f in fragments if id(f) not in ids]
