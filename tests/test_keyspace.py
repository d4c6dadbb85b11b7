"""KeySpace against a real etcd: load, watch, decode errors, batching, restarts and compaction."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from broker.testing import EtcdServer
from keyspace import IN_PLACE_RATIO, EtcdHeader, KeySpace, KeyValue, Update
from tests.helpers.waiting import until


def decode(key: str, value: bytes) -> str:
    if value.startswith(b"bad"):
        raise ValueError(f"undecodable value for {key}")
    return value.decode()


@contextlib.asynccontextmanager
async def watching(ks: KeySpace, client: aetcd.Client) -> AsyncIterator[asyncio.Task[None]]:
    """Run `ks.watch(client)` in a task for the block; cancel and reap it afterwards.

    Reaping re-raises anything the watch died of, so a crashed watch fails the test.
    """
    task: asyncio.Task[None] = asyncio.create_task(ks.watch(client))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def put(client: aetcd.Client, key: str, value: bytes, lease: int | None = None) -> int:
    rsp = await client.put(key.encode(), value, lease=lease)
    revision: int = rsp.header.revision
    return revision


async def delete(client: aetcd.Client, key: str) -> int:
    rsp = await client.delete(key.encode())
    assert rsp is not None, f"{key} did not exist"
    revision: int = rsp.header.revision
    return revision


async def etcd_state(client: aetcd.Client, prefix: str) -> list[tuple[str, bytes, int, int]]:
    rng = await client.get_prefix(prefix.encode(), sort_order="ascend")
    return [(kv.key.decode(), kv.value, kv.mod_revision, kv.version) for kv in rng]


def mirror_state(ks: KeySpace) -> list[tuple[str, bytes, int, int]]:
    return [(kv.key, kv.raw, kv.mod_revision, kv.version) for kv in ks.items]


async def warm_up(ks: KeySpace, client: aetcd.Client, root: str) -> None:
    """Return once the watch stream is live.

    Until then, writes are replayed by etcd as one catch-up response, which would batch them
    whatever `apply_delay` is.
    """
    rev = await put(client, f"{root}~warm-up", b"")
    await ks.wait_for_revision(rev, timeout=5)
    await ks.wait_for_revision(await delete(client, f"{root}~warm-up"), timeout=5)


@pytest.fixture
def root(etcd_prefix: str) -> str:
    # The KeySpace prefix; `{etcd_prefix}-sibling` is outside it yet still cleaned by `etcd`.
    return f"{etcd_prefix}/"


@pytest.fixture(scope="module")
def private_etcd() -> Iterator[EtcdServer]:
    """An etcd of our own, for tests that restart or compact it (the session etcd is shared)."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
async def private_client(private_etcd: EtcdServer, etcd_prefix: str) -> AsyncIterator[aetcd.Client]:
    # gRPC's default reconnect backoff grows to minutes; the restart test needs seconds.
    options = {"grpc.initial_reconnect_backoff_ms": 50, "grpc.max_reconnect_backoff_ms": 250}
    client = aetcd.Client(host=private_etcd.host, port=private_etcd.client_port, options=options)
    await client.connect()
    try:
        yield client
    finally:
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


async def test_load_mirrors_prefix_at_one_revision(etcd: aetcd.Client, root: str) -> None:
    await put(etcd, f"{root}b/2", b"b2")
    await put(etcd, f"{root}a", b"a")
    await put(etcd, f"{root}b/1", b"b1")
    await put(etcd, f"{root}b", b"b")
    await put(etcd, f"{root}b0", b"b0")
    await put(etcd, f"{root}c", b"bad value")
    await put(etcd, root.rstrip("/") + "-sibling", b"outside the prefix")
    last = await put(etcd, f"{root}d", b"d")

    ks = KeySpace(root, decode)
    assert ks.revision == 0 and ks.header == EtcdHeader()
    await ks.load(etcd)

    assert ks.revision == last
    assert ks.header.revision == last
    assert ks.header.cluster_id != 0 and ks.header.member_id != 0 and ks.header.raft_term != 0
    # Sorted, decoded, the bad value and the sibling left out.
    assert [(kv.key[len(root) :], kv.decoded) for kv in ks.items] == [
        ("a", "a"), ("b", "b"), ("b/1", "b1"), ("b/2", "b2"), ("b0", "b0"), ("d", "d"),
    ]  # fmt: skip
    assert mirror_state(ks) == [s for s in await etcd_state(etcd, root) if s[0] != f"{root}c"]

    got = ks.get(f"{root}b/1")
    assert got is not None and got.raw == b"b1" and got.version == 1
    assert ks.get(f"{root}c") is None and ks.get(f"{root}zzz") is None
    assert [kv.key for kv in ks.prefixed(f"{root}b/")] == [f"{root}b/1", f"{root}b/2"]
    assert [kv.key for kv in ks.prefixed(f"{root}b")] == [
        f"{root}b", f"{root}b/1", f"{root}b/2", f"{root}b0",
    ]  # fmt: skip
    assert ks.prefixed(f"{root}x") == []
    assert len(ks.prefixed("")) == len(ks) == 6
    assert [kv.key for kv in ks.range(f"{root}b/", f"{root}b0")] == [f"{root}b/1", f"{root}b/2"]


async def test_load_pages_through_large_prefixes(etcd: aetcd.Client, root: str) -> None:
    # More keys than one range page (1000), so later pages must continue at the same revision.
    txn = etcd.transactions
    for start in range(0, 1300, 100):
        ops = [txn.put(f"{root}{i:05d}".encode(), b"v") for i in range(start, start + 100)]
        await etcd.transaction(compare=[], success=ops, failure=[])  # failure=None crashes aetcd
    ks = KeySpace(root, decode)
    await ks.load(etcd)
    assert [kv.key for kv in ks.items] == [f"{root}{i:05d}" for i in range(1300)]


async def test_watch_applies_puts_updates_and_deletes(etcd: aetcd.Client, root: str) -> None:
    await put(etcd, f"{root}keep", b"k")
    ks = KeySpace(root, decode, apply_delay=0.0)
    await ks.load(etcd)
    async with watching(ks, etcd):
        rev = await put(etcd, f"{root}new", b"1")
        await ks.wait_for_revision(rev, timeout=5)
        kv = ks.get(f"{root}new")
        assert kv == KeyValue(f"{root}new", b"1", "1", rev, rev, 1, 0)
        assert ks.header.revision == ks.revision == rev

        rev2 = await put(etcd, f"{root}new", b"2")
        await ks.wait_for_revision(rev2, timeout=5)
        assert ks.get(f"{root}new") == KeyValue(f"{root}new", b"2", "2", rev, rev2, 2, 0)

        lease = await etcd.lease(60)
        try:
            rev3 = await put(etcd, f"{root}leased", b"l", lease=lease.id)
            await ks.wait_for_revision(rev3, timeout=5)
            leased = ks.get(f"{root}leased")
            assert leased is not None and leased.lease == lease.id
        finally:
            await lease.revoke()  # Deletes the leased key, through the watch too.

        rev4 = await delete(etcd, f"{root}new")
        await ks.wait_for_revision(rev4, timeout=5)
        assert ks.get(f"{root}new") is None
        assert ks.get(f"{root}leased") is None
        assert mirror_state(ks) == await etcd_state(etcd, root)

        # A write outside the prefix neither shows up nor breaks anything.
        await put(etcd, root.rstrip("/") + "-sibling", b"x")
        rev5 = await put(etcd, f"{root}last", b"z")
        await ks.wait_for_revision(rev5, timeout=5)
        assert [kv.key for kv in ks.items] == [f"{root}keep", f"{root}last"]


async def test_watch_loads_first_when_never_loaded(etcd: aetcd.Client, root: str) -> None:
    rev = await put(etcd, f"{root}a", b"a")
    ks = KeySpace(root, decode)
    async with watching(ks, etcd):
        await ks.wait_for_revision(rev, timeout=5)
        assert [kv.decoded for kv in ks.items] == ["a"]


async def test_decode_errors_leave_key_out_and_mirror_alive(
    etcd: aetcd.Client, root: str, caplog: pytest.LogCaptureFixture
) -> None:
    await put(etcd, f"{root}bad-at-load", b"bad")
    await etcd.put(f"{root}".encode() + b"\xff-not-utf8", b"fine")
    ks = KeySpace(root, decode, apply_delay=0.0)
    updates: list[Update] = []
    ks.add_observer(updates.append)
    await ks.load(etcd)
    assert len(ks) == 0

    with caplog.at_level(logging.ERROR, logger="keyspace"):
        async with watching(ks, etcd):
            rev = await put(etcd, f"{root}k", b"bad one")
            await ks.wait_for_revision(rev, timeout=5)
            assert ks.get(f"{root}k") is None and ks.revision == rev

            rev = await put(etcd, f"{root}k", b"good")
            await ks.wait_for_revision(rev, timeout=5)
            good = ks.get(f"{root}k")
            assert good is not None and good.decoded == "good" and good.version == 2

            # A bad update removes the key rather than leaving a stale value behind.
            rev = await put(etcd, f"{root}k", b"bad again")
            await ks.wait_for_revision(rev, timeout=5)
            assert ks.get(f"{root}k") is None
            assert updates[-1].changes[0].before == good and updates[-1].changes[0].after is None

            await etcd.put(f"{root}".encode() + b"\xfe-not-utf8", b"fine")
            rev = await put(etcd, f"{root}k", b"fixed")
            await ks.wait_for_revision(rev, timeout=5)
            fixed = ks.get(f"{root}k")
            assert fixed is not None and fixed.decoded == "fixed" and fixed.version == 4
            assert [kv.key for kv in ks.items] == [f"{root}k"]

            # Deleting a key that never decoded is not a change.
            n = len(updates)
            rev = await delete(etcd, f"{root}bad-at-load")
            await ks.wait_for_revision(rev, timeout=5)
            assert updates[n:] and all(u.changes == () for u in updates[n:])

    failed = [r.getMessage() for r in caplog.records if "failed to decode" in r.getMessage()]
    assert any("bad-at-load" in m for m in failed)
    assert sum(f"{root}k" in m for m in failed) == 2
    assert any("non-UTF-8" in r.getMessage() for r in caplog.records)


async def test_wait_for_revision(etcd: aetcd.Client, root: str) -> None:
    ks = KeySpace(root, decode, apply_delay=0.0)
    await ks.load(etcd)
    await ks.wait_for_revision(ks.revision, timeout=0)  # Already there: no wait at all.
    async with watching(ks, etcd):
        with pytest.raises(TimeoutError):
            await ks.wait_for_revision(ks.revision + 1, timeout=0.2)

        target = ks.revision + 2
        waiter = asyncio.create_task(ks.wait_for_revision(target, timeout=5))
        # A cancelled waiter must not disturb others waiting on the same update.
        doomed = asyncio.create_task(ks.wait_for_revision(target))
        await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed

        await ks.wait_for_revision(await put(etcd, f"{root}a", b"1"), timeout=5)
        # One short of the target must not release it (absence has no event to wait on). The
        # etcd is shared with other tests: a lease of a broker killed earlier may expire now and
        # move the revision on, which releases the waiter rightly, but only at the target.
        done, _ = await asyncio.wait((waiter,), timeout=0.05)
        assert not done or ks.revision >= target, (ks.revision, target)
        rev = await put(etcd, f"{root}b", b"2")
        assert rev >= target
        await waiter
        assert ks.revision >= target and ks.get(f"{root}b") is not None


async def test_apply_delay_batches_events_for_observers(etcd: aetcd.Client, root: str) -> None:
    ks = KeySpace(root, decode, apply_delay=0.3)
    await ks.load(etcd)
    batches: list[Update] = []
    ks.add_observer(batches.append)

    def broken(update: Update) -> None:
        raise RuntimeError("observer bug")

    ks.add_observer(broken)  # Its failure must not stop the mirror or other observers.
    async with watching(ks, etcd):
        await warm_up(ks, etcd, root)
        batches.clear()
        await put(etcd, f"{root}a", b"1")
        await put(etcd, f"{root}b", b"2")
        await put(etcd, f"{root}a", b"3")
        last = await delete(etcd, f"{root}b")
        next_update = asyncio.create_task(ks.wait_for_update(timeout=5))
        await ks.wait_for_revision(last, timeout=5)
        update = await next_update

    assert batches == [update]
    assert update.events == 4 and update.revision == last and not update.reload
    # Net effect per key: "b" came and went, so only "a" changed.
    assert [(c.key, c.before, c.after and c.after.decoded) for c in update.changes] == [
        (f"{root}a", None, "3")
    ]


async def test_zero_apply_delay_applies_each_response(etcd: aetcd.Client, root: str) -> None:
    ks = KeySpace(root, decode, apply_delay=0.0)
    await ks.load(etcd)
    batches: list[Update] = []
    ks.add_observer(batches.append)
    async with watching(ks, etcd):
        await warm_up(ks, etcd, root)
        batches.clear()
        revs = [await put(etcd, f"{root}{i}", b"v") for i in range(3)]
        await ks.wait_for_revision(revs[-1], timeout=5)
    assert [(u.revision, u.events) for u in batches] == [(r, 1) for r in revs]


async def test_cancelling_watch_leaves_no_tasks(etcd: aetcd.Client, root: str) -> None:
    ks = KeySpace(root, decode)
    before = asyncio.all_tasks()
    task = asyncio.create_task(ks.watch(etcd))
    rev = await put(etcd, f"{root}a", b"1")
    await ks.wait_for_revision(rev, timeout=5)
    assert len(asyncio.all_tasks() - before) >= 2  # The watch and its pending read.
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # Nothing of ours survives the cancellation...
    left = asyncio.all_tasks() - before
    assert all("_handle_status_once_received" in repr(t) for t in left), left
    # ...and grpc's own per-call task ends once the stream is torn down, which it only is if
    # the watch cancelled its call. It finishes via grpc's poller thread, hence a bounded wait.
    await until(
        lambda: not asyncio.all_tasks() - before, "grpc's call task ended", 5, interval=0.001
    )


async def test_watch_fails_when_client_closed_underneath(
    etcd_server: EtcdServer, root: str
) -> None:
    client = aetcd.Client(host=etcd_server.host, port=etcd_server.client_port)
    ks = KeySpace(root, decode)
    await ks.load(client)
    task = asyncio.create_task(ks.watch(client))
    await warm_up(ks, client, root)
    await client.close()
    with pytest.raises(RuntimeError, match="client was closed"):
        await asyncio.wait_for(task, 5)


async def test_watch_survives_etcd_restart(
    private_etcd: EtcdServer,
    private_client: aetcd.Client,
    root: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = private_client
    await put(client, f"{root}gone", b"0")
    ks = KeySpace(root, decode, apply_delay=0.01, max_retry_delay=0.2)
    await ks.load(client)
    events = 0

    def count(update: Update) -> None:
        nonlocal events
        events += update.events

    ks.add_observer(count)
    writes = 0
    with caplog.at_level(logging.WARNING, logger="keyspace"):
        async with watching(ks, client):
            rev = await put(client, f"{root}before", b"1")
            writes += 1
            await ks.wait_for_revision(rev, timeout=5)

            await asyncio.to_thread(private_etcd.restart)
            # Etcd answers health checks before our channel has reconnected to it.
            await asyncio.wait_for(client.channel.channel_ready(), 10)
            # Written as soon as etcd is back, likely before the watch has re-attached.
            await put(client, f"{root}after", b"2")
            await put(client, f"{root}before", b"1b")
            rev = await delete(client, f"{root}gone")
            writes += 3
            await ks.wait_for_revision(rev, timeout=10)
            assert mirror_state(ks) == await etcd_state(client, root)

            rev = await put(client, f"{root}later", b"3")
            writes += 1
            await ks.wait_for_revision(rev, timeout=5)
            assert [(kv.key[len(root) :], kv.decoded) for kv in ks.items] == [
                ("after", "2"), ("before", "1b"), ("later", "3"),
            ]  # fmt: skip
            assert mirror_state(ks) == await etcd_state(client, root)

    # Every write was applied exactly once, and the stream really did break.
    assert events == writes
    messages = [r.getMessage() for r in caplog.records]
    assert any("watch failed" in m for m in messages)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), messages


async def test_restarted_watch_resumes_after_its_revision(
    etcd: aetcd.Client, root: str, caplog: pytest.LogCaptureFixture
) -> None:
    ks = KeySpace(root, decode, apply_delay=0.0)
    await ks.load(etcd)
    updates: list[Update] = []
    ks.add_observer(updates.append)
    async with watching(ks, etcd):
        await ks.wait_for_revision(await put(etcd, f"{root}a", b"1"), timeout=5)
    assert ks.revision == updates[-1].revision

    # Missed while no watch runs; the next watch must replay exactly these, from revision + 1.
    await put(etcd, f"{root}b", b"2")
    await put(etcd, f"{root}a", b"1b")
    rev = await delete(etcd, f"{root}b")
    updates.clear()
    with caplog.at_level(logging.WARNING, logger="keyspace"):
        async with watching(ks, etcd):
            await ks.wait_for_revision(rev, timeout=5)
            assert mirror_state(ks) == await etcd_state(etcd, root)
    assert sum(u.events for u in updates) == 3
    assert not any(u.reload for u in updates)
    assert caplog.records == []


async def test_watch_reloads_after_compaction(
    private_client: aetcd.Client, root: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = private_client
    for key in ("a", "b", "c"):
        await put(client, f"{root}{key}", key.encode())
    ks = KeySpace(root, decode, apply_delay=0.0)
    await ks.load(client)
    updates: list[Update] = []
    ks.add_observer(updates.append)
    async with watching(ks, client):
        rev = await put(client, f"{root}a", b"a2")
        await ks.wait_for_revision(rev, timeout=5)
    stopped_at = ks.revision

    # While no watch runs: deletions, a created-then-deleted key, an update, a creation.
    await delete(client, f"{root}b")
    await put(client, f"{root}tmp", b"t")
    await delete(client, f"{root}tmp")
    await put(client, f"{root}c", b"c2")
    await put(client, f"{root}d", b"d")
    compact_at = await put(client, root.rstrip("/") + "-sibling", b"moves the revision")
    await client.compact(compact_at, physical=True)
    assert compact_at > stopped_at + 1

    n = len(updates)
    with caplog.at_level(logging.WARNING, logger="keyspace"):
        async with watching(ks, client):
            await ks.wait_for_revision(compact_at, timeout=5)
            assert mirror_state(ks) == await etcd_state(client, root)
            assert [(kv.key[len(root) :], kv.decoded) for kv in ks.items] == [
                ("a", "a2"), ("c", "c2"), ("d", "d"),
            ]  # fmt: skip

            reload = updates[n]
            assert reload.reload and reload.revision == compact_at
            assert [(c.key[len(root) :], c.before is None, c.after is None) for c in reload.changes] == [
                ("b", False, True), ("c", False, False), ("d", True, False),
            ]  # fmt: skip

            # The watch carries on from the reloaded revision.
            rev = await put(client, f"{root}e", b"e")
            await ks.wait_for_revision(rev, timeout=5)
            assert mirror_state(ks) == await etcd_state(client, root)
    assert any("compacted" in r.getMessage() for r in caplog.records)


def _kv(key: str, revision: int) -> KeyValue:
    return KeyValue(key, b"", None, revision, revision, 1, 0)


def test_a_batch_merged_in_place_matches_one_merged_into_a_new_list() -> None:
    """Small batches go into the mirror's list in place when nothing else holds it, larger
    ones (or any, while `items` is held) into a new list: the mirror and the changes are the
    same either way, for puts of new keys, puts over old ones and deletes of present or
    absent keys."""
    rng = random.Random(20261126)
    mirrors = [KeySpace("/p/", lambda key, raw: None) for _ in range(2)]
    for mirror in mirrors:
        mirror._kvs = [_kv(f"/p/{i:04d}", 1) for i in range(0, 2000, 2)]
    for revision in range(2, 200):
        size = rng.choice((1, 3, 20, 300))
        pending: dict[str, KeyValue | None] = {
            f"/p/{rng.randrange(2000):04d}": (_kv("", revision) if rng.random() < 0.7 else None)
            for _ in range(size)
        }
        pending = {k: (None if v is None else _kv(k, revision)) for k, v in pending.items()}
        held = mirrors[1].items  # Held: this mirror's batches all go into a new list.
        lists = [m._kvs for m in mirrors]
        in_place = len(pending) * IN_PLACE_RATIO < len(lists[0])
        del lists
        ids = [id(m._kvs) for m in mirrors]
        changes = [m._merge(dict(pending)) for m in mirrors]
        assert (id(mirrors[0]._kvs) == ids[0]) == in_place
        assert mirrors[1]._kvs is not held
        assert changes[0] == changes[1]
        assert mirrors[0].items == mirrors[1].items
        keys = [kv.key for kv in mirrors[0].items]
        assert keys == sorted(set(keys))
        del held


def test_a_list_handed_out_by_items_stays_a_snapshot() -> None:
    mirror = KeySpace("/p/", lambda key, raw: None)
    mirror._kvs = [_kv(f"/p/{i:04d}", 1) for i in range(100)]
    snapshot = mirror.items
    before = list(snapshot)
    mirror._merge({"/p/0005": _kv("/p/0005", 2), "/p/0200": _kv("/p/0200", 2), "/p/0007": None})
    assert list(snapshot) == before  # Unchanged for whoever holds it...
    assert mirror.get("/p/0005").mod_revision == 2  # type: ignore[union-attr]
    assert mirror.get("/p/0007") is None and mirror.get("/p/0200") is not None
    del snapshot
    mirror._merge({"/p/0006": _kv("/p/0006", 3)})  # ...and in place once nobody does.
    assert mirror.get("/p/0006").mod_revision == 3  # type: ignore[union-attr]
    assert len(mirror) == 100
