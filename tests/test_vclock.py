"""Vector clocks, property-tested for their algebra: the causal order is a partial order that
`compare` describes exactly; `merge` is the least upper bound (commutative, associative,
idempotent, an upper bound, the least one); `tick` moves strictly after; restriction and
retirement drop entries; JSON round-trips; bad clocks are refused in one line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replication.vclock import Order, VectorClock, lub

LOCATIONS = ["A", "B", "C", "D"]
clocks = st.dictionaries(st.sampled_from(LOCATIONS), st.integers(0, 4)).map(VectorClock)


@given(clocks, clocks)
def test_compare_describes_the_order(a: VectorClock, b: VectorClock) -> None:
    order = a.compare(b)
    le = all(a[x] <= b[x] for x in LOCATIONS)
    ge = all(a[x] >= b[x] for x in LOCATIONS)
    expected = {
        (True, True): Order.EQUAL,
        (True, False): Order.BEFORE,
        (False, True): Order.AFTER,
        (False, False): Order.CONCURRENT,
    }[(le, ge)]
    assert order is expected
    assert (a <= b) == le and (a < b) == (le and not ge) and a.concurrent(b) == (not le and not ge)
    assert b.compare(a) is {Order.BEFORE: Order.AFTER, Order.AFTER: Order.BEFORE}.get(order, order)
    assert (a == b) == (order is Order.EQUAL) and (hash(a) == hash(b) or a != b)


@given(clocks, clocks, clocks)
def test_the_order_is_partial(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    assert a <= a
    if a <= b and b <= a:
        assert a == b
    if a <= b and b <= c:
        assert a <= c


@given(clocks, clocks, clocks)
def test_merge_is_the_least_upper_bound(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    m = a.merge(b)
    assert m == b.merge(a) and a.merge(a) == a
    assert a.merge(b, c) == a.merge(b).merge(c) == a.merge(b.merge(c)) == lub([a, b, c])
    assert a <= m and b <= m
    if a <= c and b <= c:
        assert m <= c  # The least such bound.
    assert lub([]) == VectorClock()


@given(clocks, st.sampled_from(LOCATIONS))
def test_tick_moves_strictly_after(a: VectorClock, location: str) -> None:
    t = a.tick(location)
    assert a < t and t[location] == a[location] + 1
    assert a.compare(t) is Order.BEFORE


@given(clocks)
def test_restriction_retirement_and_json(a: VectorClock) -> None:
    part = a.restrict(["A", "B"])
    assert set(part) <= {"A", "B"} and part <= a
    assert a.without(["A", "B"]).merge(part) == a
    assert VectorClock.from_json(a.to_json()) == a


def test_bad_clocks_are_refused() -> None:
    with pytest.raises(ValueError, match="vector clock time of A: -1 is not a count"):
        VectorClock({"A": -1})
    with pytest.raises(ValueError, match="location ''"):
        VectorClock({"": 1})
    with pytest.raises(ValueError, match=r"event\.clock: expected a JSON object"):
        VectorClock.from_json([1], field="event.clock")
    with pytest.raises(ValueError, match=r"event\.clock: vector clock time of B: True"):
        VectorClock.from_json({"B": True}, field="event.clock")
    assert (
        VectorClock({"A": 0, "B": 2}) == VectorClock({"B": 2}) and len(VectorClock({"A": 0})) == 0
    )
