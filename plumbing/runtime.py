"""Process-wide settings of a long-running server (a broker, a consumer)."""

from __future__ import annotations

import gc

# Allocations between young collections. CPython's default, 700, suits short scripts: a broker
# holding 10,000 journal replicas keeps millions of long-lived objects, and at that threshold
# the collector ran so often that it took a third of the CPU of placing journals (three
# brokers in one process placing 3,000 journals: 12.6 s of 35 s in collections, a full one
# 0.46 s, a pause of the event loop that also delays the etcd lease's keep-alive). With this
# threshold the same placement spent 0.55 s collecting. Cyclic garbage waits a little longer
# for its collection; reference counting frees everything else at once, as before.
YOUNG_COLLECTION_THRESHOLD = 50_000


def tune_gc() -> None:
    """Collect cyclic garbage less often, as a server with a large, long-lived heap should: the
    young generation every YOUNG_COLLECTION_THRESHOLD allocations (the older ones keep their
    default ratios)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)
