"""The fragment index of one journal replica: what a broker can serve reads from.

It is the union of *local* fragments (the spool's committed head, and fragments the spool completed
that are not yet known to be persisted) and *remote* fragments listed from the journal's fragment
stores, kept as a CoverSet (larger fragments are preferred; no fragment is covered by another).
Readers query it by offset and wait here for commits at the write head; appends wait for the first
listing of the stores before they trust the index's end offset.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from broker.fragment.cover_set import CoverSet, IndexedFragment, Readable
from broker.fragment.spool import CompletedFragment
from broker.protocol import protocol_pb2 as pb
from plumbing.tasks import Event, wait_any

# A read of an offset no fragment covers may jump forward to the next *persisted* fragment only
# if the read starts before every fragment, or that fragment was persisted this long ago: a
# younger gap may be a fragment still being persisted by another broker.
OFFSET_JUMP_AGE = 6 * 3600


@dataclass(frozen=True, slots=True)
class Found:
    """The outcome of a query: the read offset (moved forward over a gap or a skipped old
    fragment), and the fragment with the most content at it, if any."""

    offset: int
    fragment: IndexedFragment | None


class Index:
    def __init__(self, journal: str) -> None:
        self.journal = journal
        self._set = CoverSet()  # Local and remote.
        self._local = CoverSet()  # Local only: each has a `file`.
        self._changed = Event()
        self.first_refresh = Event()
        self.refresh_error = ""  # Of the last failed listing of the stores.
        # Set to ask the refresh daemon for a listing now (a persist completed, or a read met
        # a range below the write head that nothing here covers).
        self.refresh_requested = Event()
        self._listed = Event()  # Set at the next listing (replaced by a fresh one).
        self._closed = False
        # An offset the journal is known to have been written up to, whatever fragments are
        # left (its spec's suspension offset): the write head is never below it.
        self._head_floor = 0

    # ---- spool observer -----------------------------------------------------------------------

    def on_commit(self, fragment: pb.Fragment, source: Readable) -> None:
        """The spool committed: its fragment, readable from the spool, covers the last one."""
        self._add_local(IndexedFragment(_copy(fragment), source))

    def on_complete(self, fragment: pb.Fragment, source: Readable) -> None:
        """The spool rolled: the completed fragment's content is now read from `source` (the
        spool's head entry for the same span is replaced)."""
        entry = IndexedFragment(_copy(fragment), source)
        if entry.begin == entry.end:
            return
        if self._closed:
            _close(entry)
            return
        self._local = _replace(self._local, entry)
        self._set = _replace(self._set, entry)
        self._signal()

    def _add_local(self, entry: IndexedFragment) -> None:
        if entry.begin == entry.end:
            return
        self._local.add(entry)
        self._set.add(entry)
        self._signal()

    # ---- remote fragments ---------------------------------------------------------------------

    def replace_remote(self, remote: Iterable[pb.Fragment]) -> None:
        """Take a fresh listing of the stores: it replaces every remote fragment, and local
        fragments it covers are dropped (their files closed once reads in flight finish)."""
        self._install_remote(remote)
        self.first_refresh.set()
        self._listed.set()
        self._listed = Event()

    async def listing(self, timeout: float) -> bool:
        """Ask for a listing of the stores now, and wait for it (up to `timeout` seconds);
        whether one came."""
        if self._closed:
            return False  # The replica stopped, and its refresh daemon with it.
        listed = self._listed
        self.refresh_requested.set()
        try:
            await asyncio.wait_for(listed.wait(), timeout)
        except TimeoutError:
            return False
        return not self._closed

    async def first_listing(self, timeout: float) -> None:
        """Until the first listing of the stores is in (or none is needed: a journal without
        stores), the index closes, or `timeout` seconds pass. Asks for no listing."""
        await wait_any(self.first_refresh, self._listed, timeout=timeout)

    def add_remote(self, fragment: pb.Fragment) -> None:
        """A fragment this broker just persisted. Its local copy now names its store (readers
        are given its URL) but stays, as upstream keeps it, until a listing of the stores
        covers it: a listing that began before the persist completed does not list it, and
        dropping the copy then would leave a hole a read from 0 jumps over."""
        persisted = _copy(fragment)
        for entry in self._local:
            if entry.begin == persisted.begin and entry.end == persisted.end:
                named = IndexedFragment(persisted, entry.file)
                self._local = _replace(self._local, named)
                self._set = _replace(self._set, named)
                self._signal()
                self.refresh_requested.set()  # A new listing soon releases the copy.
                return
        # No local copy (the replica is closing): nothing to keep.

    def _install_remote(self, remote: Iterable[pb.Fragment]) -> None:
        listed = CoverSet()
        for fragment in remote:
            listed.add(IndexedFragment(_copy(fragment)))
        kept = self._local.difference(listed)
        kept_ids = {id(entry) for entry in kept}
        for entry in self._local:
            if id(entry) not in kept_ids:
                _close(entry)
        self._local = kept
        for entry in kept:
            listed.add(entry)
        self._set = listed
        self._signal()

    # ---- queries ------------------------------------------------------------------------------

    @property
    def write_head(self) -> int:
        """The end of the last fragment, or the known floor of the journal's head when the
        fragments end below it (content lost with every replica): reads below it meet a hole
        there rather than an empty journal."""
        return max(self._set.end_offset(), self._head_floor)

    def raise_head_floor(self, offset: int) -> None:
        """The journal was written up to `offset` (see `write_head`)."""
        if offset > self._head_floor:
            self._head_floor = offset
            self._signal()  # Waiting reads see the head move.

    def end_offset(self) -> int:
        """The largest offset any fragment reaches (the index's max offset)."""
        return self._set.end_offset()

    def persisted_through(self, end: int, over_holes: bool = False) -> bool:
        """Whether fragments in stores cover every offset the index holds below `end` (local
        copies of persisted fragments name their store). With `over_holes`, ranges that no
        fragment covers (`holes`) do not count: only what the index holds must be persisted."""
        covered = self._set.begin_offset()
        for entry in self._set:
            if entry.begin >= end:
                break
            if not entry.backing_store or (entry.begin > covered and not over_holes):
                return False
            covered = max(covered, entry.end)
        return covered >= end

    def begin_offset(self) -> int:
        return self._set.begin_offset()

    def holes(self) -> list[tuple[int, int]]:
        """The ranges [begin, end) between the index's first and last offsets that no fragment
        covers, local or persisted: committed content nobody holds (lost with every replica
        that held it, or gone from the store), or not listed yet."""
        out: list[tuple[int, int]] = []
        covered: int | None = None
        for entry in self._set:
            if covered is not None and entry.begin > covered:
                out.append((covered, entry.begin))
            covered = entry.end if covered is None else max(covered, entry.end)
        return out

    def summary(self) -> tuple[int, int, int]:
        """(begin, end, mod_time of the last fragment: 0 if it is local)."""
        if not len(self._set):
            return 0, 0, 0
        last = self._set[len(self._set) - 1]
        return self._set.begin_offset(), self._set.end_offset(), last.mod_time

    def fragments(self) -> list[IndexedFragment]:
        return list(self._set)

    def local_fragments(self) -> list[IndexedFragment]:
        return list(self._local)

    def query(self, offset: int, begin_mod_time: int = 0, now: float | None = None) -> Found:
        """The fragment to read `offset` from, as upstream: the covering fragment with the most
        content after it; else a jump forward to the next persisted fragment when the read
        starts before every fragment or that fragment is older than OFFSET_JUMP_AGE; fragments
        persisted before `begin_mod_time` are skipped over."""
        while True:
            at, found = self._set.longest_overlapping(offset)
            if not found and at < len(self._set):
                following = self._set[at]
                jump_before = (now if now is not None else time.time()) - OFFSET_JUMP_AGE
                if following.mod_time != 0 and (at == 0 or following.mod_time < jump_before):
                    offset, found = following.begin, True
            if not found:
                return Found(offset, None)
            entry = self._set[at]
            if entry.mod_time != 0 and entry.mod_time < begin_mod_time:
                offset = entry.end  # Persisted before the requested bound: skip its content.
                continue
            return Found(offset, entry)

    async def wait_for_change(self) -> None:
        await self._changed.wait()

    @property
    def changed(self) -> asyncio.Event:
        """Set at the index's next change (each change replaces it with a fresh one)."""
        return self._changed

    def _signal(self) -> None:
        self._changed.set()
        self._changed = Event()

    def close(self) -> None:
        """Release local fragment files (the replica is going away)."""
        self._closed = True
        for entry in self._local:
            _close(entry)
        self._local = CoverSet()
        self._signal()
        self._listed.set()  # No listing comes any more: release those waiting for one.


def _replace(cover: CoverSet, entry: IndexedFragment) -> CoverSet:
    """`cover` with the fragment of `entry`'s exact span replaced by `entry` (or added)."""
    out = CoverSet()
    for f in cover:
        if f.begin == entry.begin and f.end == entry.end:
            continue
        out.add(f)
    out.add(entry)
    return out


def _close(entry: IndexedFragment) -> None:
    # The spool itself is not closed here (its owner does): only completed fragments are.
    if isinstance(entry.file, CompletedFragment):
        entry.file.close()


def _copy(fragment: pb.Fragment) -> pb.Fragment:
    out = pb.Fragment()
    out.CopyFrom(fragment)
    return out
