"""CoverSet: upstream's cases as examples, and properties against a brute-force model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.fragment.cover_set import CoverSet, IndexedFragment
from broker.fragment.fragments import parse_relative_path
from broker.protocol import protocol_pb2 as pb

JOURNAL = "a/journal"


class _Bytes:
    """Local content whose bytes are the low byte of each offset."""

    def __init__(self, begin: int, end: int) -> None:
        self.begin, self.end = begin, end

    def read(self, offset: int, size: int) -> bytes:
        stop = min(offset + size, self.end)
        return bytes(o & 0xFF for o in range(offset, stop))


def frag(begin: int, end: int, *, mod_time: int = 0, store: str = "") -> IndexedFragment:
    spec = pb.Fragment(
        journal=JOURNAL, begin=begin, end=end, mod_time=mod_time, backing_store=store
    )
    return IndexedFragment(spec)


def spans(cs: CoverSet) -> list[tuple[int, int]]:
    return [(f.begin, f.end) for f in cs]


def build(*pairs: tuple[int, int]) -> CoverSet:
    cs = CoverSet()
    for begin, end in pairs:
        assert cs.add(frag(begin, end))
    return cs


# --- Examples mirroring upstream's cover_set_test.go ----------------------------------------------


def test_insert_at_end_adjacent_and_overlapping() -> None:
    assert spans(build((100, 200), (200, 300), (201, 301))) == [
        (100, 200),
        (200, 300),
        (201, 301),
    ]


def test_replace_range_at_end() -> None:
    cs = build((100, 200), (200, 300), (300, 400), (400, 500), (150, 500))
    assert spans(cs) == [(100, 200), (150, 500)]


def test_replace_one_at_end() -> None:
    assert spans(build((100, 200), (200, 300), (199, 300))) == [(100, 200), (199, 300)]
    # Same begin, larger end.
    assert spans(build((100, 200), (200, 300), (200, 301))) == [(100, 200), (200, 301)]


def test_replace_range_in_middle() -> None:
    cs = build((100, 200), (200, 300), (300, 400), (400, 500), (150, 450))
    assert spans(cs) == [(100, 200), (150, 450), (400, 500)]


def test_replace_one_in_middle() -> None:
    cs = build((100, 200), (200, 300), (300, 400), (150, 350))
    assert spans(cs) == [(100, 200), (150, 350), (300, 400)]


def test_insert_in_middle_at_exact_and_close_boundaries() -> None:
    assert spans(build((100, 200), (300, 400), (200, 300))) == [
        (100, 200),
        (200, 300),
        (300, 400),
    ]
    assert spans(build((100, 200), (300, 400), (201, 299))) == [
        (100, 200),
        (201, 299),
        (300, 400),
    ]


def test_replace_at_beginning() -> None:
    assert spans(build((100, 200), (200, 300), (300, 400), (100, 300))) == [
        (100, 300),
        (300, 400),
    ]
    assert spans(build((100, 200), (200, 300), (300, 400), (99, 200))) == [
        (99, 200),
        (200, 300),
        (300, 400),
    ]


def test_insert_at_beginning() -> None:
    assert spans(build((200, 300), (300, 400), (199, 200))) == [
        (199, 200),
        (200, 300),
        (300, 400),
    ]


def test_overlapping_ranges() -> None:
    cs = build(
        (100, 150),
        (149, 201),
        (200, 250),
        (250, 300),
        (299, 351),
        (350, 400),
        (200, 300),
        (300, 400),
        (100, 200),
    )
    assert spans(cs) == [(100, 200), (149, 201), (200, 300), (299, 351), (300, 400)]


def test_covered_fragments_are_not_added_but_equal_spans_replace() -> None:
    cs = build((100, 200), (200, 300), (300, 400))
    for begin, end in [(101, 200), (100, 199), (201, 300), (200, 299), (301, 400), (150, 160)]:
        assert not cs.add(frag(begin, end)), (begin, end)
    assert spans(cs) == [(100, 200), (200, 300), (300, 400)]

    # An equal span replaces the fragment (as upstream's): here, a persisted copy of a local one.
    persisted = frag(200, 300, mod_time=1234, store="s3://bucket/")
    assert cs.add(persisted)
    assert spans(cs) == [(100, 200), (200, 300), (300, 400)]
    assert cs[1] is persisted
    assert (cs[1].mod_time, cs[1].backing_store) == (1234, "s3://bucket/")


def test_empty_fragments_are_ignored() -> None:
    cs = build((100, 200))
    assert not cs.add(frag(150, 150))
    assert not cs.add(frag(300, 300))
    assert not CoverSet().add(frag(0, 0))
    assert spans(cs) == [(100, 200)]


def test_invalid_fragments_are_refused() -> None:
    cs = build((100, 200))
    with pytest.raises(ValueError, match="begin 300 after end 200"):
        cs.add(frag(300, 200))
    other = IndexedFragment(pb.Fragment(journal="other/journal", begin=200, end=300))
    with pytest.raises(ValueError, match="'other/journal' cannot join the index of journal"):
        cs.add(other)
    assert spans(cs) == [(100, 200)]


def test_offsets() -> None:
    cs = CoverSet()
    assert (cs.begin_offset(), cs.end_offset()) == (0, 0)
    cs.add(frag(100, 150))
    assert (cs.begin_offset(), cs.end_offset()) == (100, 150)
    cs.add(frag(140, 250))
    assert (cs.begin_offset(), cs.end_offset()) == (100, 250)
    cs.add(frag(50, 100))
    assert (cs.begin_offset(), cs.end_offset()) == (50, 250)


def test_longest_overlapping() -> None:
    cs = build((100, 200), (149, 201), (200, 300), (299, 351), (300, 400), (500, 600))
    cases = [
        (0, 0, False),
        (100, 0, True),
        (148, 0, True),
        (149, 1, True),
        (199, 1, True),
        (200, 2, True),
        (298, 2, True),
        (299, 3, True),
        (300, 4, True),
        (350, 4, True),
        (399, 4, True),
        (400, 5, False),
        (401, 5, False),
        (499, 5, False),
        (500, 5, True),
        (599, 5, True),
        (600, 6, False),
    ]
    for offset, index, found in cases:
        assert cs.longest_overlapping(offset) == (index, found), offset
    assert CoverSet().longest_overlapping(10) == (0, False)


def test_difference() -> None:
    b = build((100, 200), (150, 225), (225, 250), (250, 300), (301, 400))
    a = build(
        (99, 105),  # Begins before b's first fragment.
        (100, 110),  # Inside one fragment of b.
        (110, 120),
        (130, 210),  # Covered by two of b's.
        (150, 225),  # Equal to one of b's.
        (151, 300),  # Covered by three of b's.
        (152, 301),  # Not covered: b has a one-byte gap at 300.
        (300, 350),  # Not covered, for the same gap.
        (301, 360),  # Covered.
        (360, 401),  # Runs past b's end.
        (400, 450),  # Entirely after b.
    )
    assert spans(a.difference(b)) == [(99, 105), (152, 301), (300, 350), (360, 401), (400, 450)]
    assert spans(a.difference(CoverSet())) == spans(a)
    assert spans(CoverSet().difference(b)) == []
    assert spans(a.difference(a)) == []


def test_difference_keeps_the_local_fragments_themselves() -> None:
    local = CoverSet()
    content = _Bytes(0, 100)
    local.add(IndexedFragment(pb.Fragment(journal=JOURNAL, begin=0, end=100), content))
    local.add(IndexedFragment(pb.Fragment(journal=JOURNAL, begin=100, end=200), _Bytes(100, 200)))
    remote = build((100, 200))
    kept = local.difference(remote)
    assert spans(kept) == [(0, 100)]
    assert kept[0].file is content
    assert kept[0].file is not None and kept[0].file.read(10, 3) == bytes([10, 11, 12])


def test_parse_with_multiple_overlaps() -> None:
    # Store listings of a journal whose fragments overlap many ways; one is empty.
    zero = "0" * 40
    names = [
        "0000000000000000-00000000400a8d41",
        "00000000400a8d41-00000000595722d7",
        "00000000400a8d41-000000007a3fb5ee",
        "00000000400a8d41-000000007af92e59",
        "00000000595722d7-000000007af92fb4",
        "000000007a3fb5ee-000000007af92fb4",
        "000000007af92e59-000000007af92e59",
    ]
    cs = CoverSet()
    for name in names:
        cs.add(IndexedFragment(parse_relative_path(JOURNAL, f"{name}-{zero}.raw")))
    assert spans(cs) == [(0, 0x400A8D41), (0x400A8D41, 0x7AF92E59), (0x595722D7, 0x7AF92FB4)]
    assert all(f.journal == JOURNAL and f.spec.compression_codec == pb.NONE for f in cs)


def test_indexing_and_iteration() -> None:
    cs = build((0, 10), (5, 20), (30, 40))
    assert len(cs) == 3
    assert [f.begin for f in cs[1:]] == [5, 30]
    assert cs[-1].end == 40
    assert CoverSet([frag(0, 10), frag(0, 20), frag(5, 15)]).__repr__() == "CoverSet([0, 20))"


# --- Properties against a brute-force model --------------------------------------------------------


def _covers(outer: tuple[int, int], inner: tuple[int, int]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _model_add(model: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    """Upstream's rule, stated plainly: skip if strictly covered, else drop what it covers."""
    if span[0] == span[1]:
        return False
    if any(_covers(m, span) and m != span for m in model):
        return False
    model[:] = sorted([m for m in model if not _covers(span, m)] + [span])
    return True


_spans = st.tuples(st.integers(0, 60), st.integers(0, 25)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_spans, max_size=40))
def test_adds_agree_with_model(adds: list[tuple[int, int]]) -> None:
    cs = CoverSet()
    model: list[tuple[int, int]] = []
    for span in adds:
        assert cs.add(frag(*span)) == _model_add(model, span), span
        assert spans(cs) == model

    got = spans(cs)
    # Invariant: ordered on (begin, end), and no member covers another.
    assert got == sorted(got)
    for i, x in enumerate(got):
        for j, y in enumerate(got):
            assert i == j or not _covers(x, y), (x, y)
    # Begins and ends strictly increase (what bisection relies on).
    assert all(x[0] < y[0] and x[1] < y[1] for x, y in itertools.pairwise(got))
    # Every non-empty fragment ever added is covered by some member.
    for span in adds:
        assert span[0] == span[1] or any(_covers(m, span) for m in got), span
    if got:
        assert (cs.begin_offset(), cs.end_offset()) == (got[0][0], got[-1][1])


@settings(max_examples=300, deadline=None)
@given(st.lists(_spans, max_size=40))
def test_longest_overlapping_agrees_with_brute_force(adds: list[tuple[int, int]]) -> None:
    cs = CoverSet(frag(*span) for span in adds)
    got = spans(cs)
    for offset in range(-1, 90):
        covering = [i for i, (b, e) in enumerate(got) if b <= offset < e]
        if covering:
            best = max(covering, key=lambda i: got[i][1])
            assert cs.longest_overlapping(offset) == (best, True), offset
        else:
            after = [i for i, (b, _) in enumerate(got) if b > offset]
            expect = after[0] if after else len(got)
            assert cs.longest_overlapping(offset) == (expect, False), offset


@settings(max_examples=300, deadline=None)
@given(st.lists(_spans, max_size=30), st.lists(_spans, max_size=30))
def test_difference_agrees_with_brute_force(
    a_adds: list[tuple[int, int]], b_adds: list[tuple[int, int]]
) -> None:
    a = CoverSet(frag(*span) for span in a_adds)
    b = CoverSet(frag(*span) for span in b_adds)
    covered = {o for begin, end in spans(b) for o in range(begin, end)}
    expect = [(x, y) for x, y in spans(a) if any(o not in covered for o in range(x, y))]
    out = a.difference(b)
    assert spans(out) == expect
    # The result is itself a valid CoverSet of a's own members.
    assert all(any(f is g for g in a) for f in out)
    assert (out.begin_offset(), out.end_offset()) == (
        (expect[0][0], expect[-1][1]) if expect else (0, 0)
    )
    # Local fragments minus those covered remotely always re-add to the remote set (as the
    # index's ReplaceRemote relies on).
    merged = CoverSet(b)
    for f in out:
        assert merged.add(f)


def test_large_index_queries_by_bisection() -> None:
    # 100k fragments in order, each overlapping the next: queries stay exact at the ends.
    cs = CoverSet(frag(i * 10, i * 10 + 15) for i in range(100_000))
    assert len(cs) == 100_000
    assert cs.longest_overlapping(0) == (0, True)
    assert cs.longest_overlapping(12) == (1, True)
    assert cs.longest_overlapping(999_999) == (99_999, True)
    assert cs.longest_overlapping(1_000_005) == (100_000, False)
    assert cs.add(frag(500_000, 500_100))
    assert len(cs) == 100_000 - 9 + 1
