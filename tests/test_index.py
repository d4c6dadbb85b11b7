"""The fragment index: local and remote fragments, upstream's query rules (longest overlap, offset
jumps over gaps only to old or leading persisted fragments, begin_mod_time skips), and listings
that replace remote fragments and drop the local ones they cover."""

from __future__ import annotations

import asyncio

from broker.fragment.index import OFFSET_JUMP_AGE, Index
from broker.protocol import protocol_pb2 as pb

JOURNAL = "a/journal"
NOW = 1_800_000_000.0


class Content:
    """A local fragment's content source that remembers being closed."""

    def __init__(self) -> None:
        self.closed = False

    def read(self, offset: int, size: int) -> bytes:
        return b"x" * size

    def close(self) -> None:
        self.closed = True


def fragment(begin: int, end: int, mod_time: int = 0) -> pb.Fragment:
    out = pb.Fragment(journal=JOURNAL, begin=begin, end=end, mod_time=mod_time)
    if mod_time:
        out.backing_store = "file:///store/"
    return out


def test_queries_take_the_fragment_with_most_content_after_the_offset() -> None:
    index = Index(JOURNAL)
    index.replace_remote([fragment(0, 100, 5), fragment(50, 300, 5), fragment(300, 400, 5)])
    found = index.query(60, now=NOW)
    assert found.fragment is not None and (found.fragment.begin, found.fragment.end) == (50, 300)
    assert found.offset == 60
    assert index.query(400, now=NOW).fragment is None  # The write head: nothing yet.
    assert index.write_head == 400 and index.begin_offset() == 0


def test_offsets_jump_gaps_only_to_leading_or_old_persisted_fragments() -> None:
    old = int(NOW - OFFSET_JUMP_AGE - 10)
    young = int(NOW - 60)
    index = Index(JOURNAL)
    # A read before every fragment jumps to the first one, whatever its age.
    index.replace_remote([fragment(100, 200, young), fragment(300, 400, young)])
    assert index.query(0, now=NOW).offset == 100
    # A young gap in the middle may be a fragment still being persisted: no jump.
    assert index.query(250, now=NOW).fragment is None
    # An old one is a hole (e.g. pruned): the read skips it.
    index.replace_remote([fragment(100, 200, young), fragment(300, 400, old)])
    found = index.query(250, now=NOW)
    assert found.offset == 300 and found.fragment is not None
    # Only persisted fragments are jumped to: a local one after a gap is not.
    index = Index(JOURNAL)
    index.on_commit(fragment(500, 600), Content())
    assert index.query(0, now=NOW).fragment is None


def test_begin_mod_time_skips_older_fragments() -> None:
    index = Index(JOURNAL)
    index.replace_remote([fragment(0, 100, 10), fragment(100, 200, 20), fragment(200, 300, 30)])
    found = index.query(0, begin_mod_time=20, now=NOW)
    assert found.offset == 100 and found.fragment is not None and found.fragment.end == 200


def test_listings_replace_remote_fragments_and_drop_covered_local_ones() -> None:
    from broker.fragment.spool import CompletedFragment

    index = Index(JOURNAL)
    assert not index.first_refresh.is_set()
    index.replace_remote([])
    assert index.first_refresh.is_set()

    closed: list[int] = []

    class Completed(CompletedFragment):
        def __init__(self, begin: int) -> None:  # A stand-in holding no file.
            self.begin_ = begin

        def read(self, offset: int, size: int) -> bytes:
            return b""

        def close(self) -> None:
            closed.append(self.begin_)

    index.on_complete(fragment(0, 100), Completed(0))
    index.on_complete(fragment(100, 200), Completed(100))
    assert [f.file is not None for f in index.fragments()] == [True, True]
    # The store now lists the first one: its local copy is dropped and closed.
    index.replace_remote([fragment(0, 100, 5)])
    assert closed == [0]
    assert [(f.begin, f.end, f.file is None) for f in index.fragments()] == [
        (0, 100, True),
        (100, 200, False),
    ]
    # A fragment this broker persisted keeps its local copy (now naming its store) until a
    # listing covers it; then remote fragments are exactly the listing.
    index.add_remote(fragment(100, 200, 6))
    assert closed == [0]
    assert [(f.begin, f.backing_store, f.file is None) for f in index.fragments()] == [
        (0, "file:///store/", True),
        (100, "file:///store/", False),
    ]
    index.replace_remote([fragment(0, 200, 7)])
    assert closed == [0, 100]
    assert [(f.begin, f.end) for f in index.fragments()] == [(0, 200)]


def test_a_persisted_fragment_survives_a_listing_that_began_before_its_persist() -> None:
    """Issue 12, defect 4: a store listing that began before a persist completed must not
    drop the just-persisted fragment, else a read from 0 jumps over committed content."""
    from broker.fragment.spool import CompletedFragment

    closed: list[int] = []

    class Completed(CompletedFragment):
        def __init__(self, begin: int) -> None:  # A stand-in holding no file.
            self.begin_ = begin

        def read(self, offset: int, size: int) -> bytes:
            return b"y" * size

        def close(self) -> None:
            closed.append(self.begin_)

    index = Index(JOURNAL)
    index.replace_remote([])
    index.on_complete(fragment(0, 100), Completed(0))
    index.on_complete(fragment(100, 200), Completed(100))
    index.add_remote(fragment(0, 100, int(NOW)))
    index.add_remote(fragment(100, 200, int(NOW)))
    # A listing that began before both persists: it lists neither.
    index.replace_remote([])
    assert [(f.begin, f.end, f.file is None) for f in index.fragments()] == [
        (0, 100, False),
        (100, 200, False),
    ]
    # The next one saw the second persist, not the first (it was still under way).
    index.replace_remote([fragment(100, 200, int(NOW))])
    found = index.query(0, now=NOW)
    assert found.offset == 0 and found.fragment is not None
    assert (found.fragment.begin, found.fragment.end) == (0, 100)
    assert found.fragment.file is not None and closed == [100]
    # Once a listing covers it, the local copy goes.
    index.replace_remote([fragment(0, 100, int(NOW)), fragment(100, 200, int(NOW))])
    assert closed == [100, 0]
    assert [f.file is None for f in index.fragments()] == [True, True]


def test_holes_are_the_offsets_no_fragment_covers() -> None:
    index = Index(JOURNAL)
    index.replace_remote(
        [fragment(0, 10, 100), fragment(10, 20, 100), fragment(5, 15, 100), fragment(30, 40, 100)]
    )
    index.on_complete(fragment(35, 50), Content())
    index.on_commit(fragment(60, 70), Content())
    assert index.holes() == [(20, 30), (50, 60)]
    assert Index(JOURNAL).holes() == []


def test_persisted_through_over_holes_counts_only_what_the_index_holds() -> None:
    index = Index(JOURNAL)
    index.replace_remote([fragment(0, 10, 100), fragment(20, 40, 100)])
    index.on_commit(fragment(40, 60), Content())
    assert not index.persisted_through(60, over_holes=True)  # [40, 60) is local only.
    persisted = fragment(40, 60, 200)
    index.add_remote(persisted)
    assert index.persisted_through(60, over_holes=True)
    assert not index.persisted_through(60)  # [10, 20): a hole.
    assert index.persisted_through(10)


async def test_a_wait_for_a_listing_ends_when_the_index_closes() -> None:
    """A read at a hole waits for a listing: once the replica stops (and its refresh daemon
    with it), none comes, and the wait ends with the index rather than run out its timeout."""
    index = Index(JOURNAL)
    waiting = asyncio.ensure_future(index.listing(30))
    await asyncio.sleep(0)
    assert index.refresh_requested.is_set()
    index.close()
    assert await asyncio.wait_for(waiting, 1) is False
    assert await asyncio.wait_for(index.listing(30), 1) is False
