"""Process-wide settings of the servers (plumbing.runtime)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from plumbing import runtime


@pytest.fixture
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_a_server_collects_the_young_generation_less_often(thresholds: None) -> None:
    gc.set_threshold(700, 10, 10)
    runtime.tune_gc()
    assert gc.get_threshold() == (runtime.YOUNG_COLLECTION_THRESHOLD, 10, 10)
    # Young collections now come after that many allocations, not 700.
    gc.collect()
    before = gc.get_stats()[0]["collections"]
    garbage = [[] for _ in range(5_000)]
    assert gc.get_stats()[0]["collections"] == before
    del garbage
