"""Group commit: small appends to one journal, received whole while its pipeline is busy, are
committed together in one replication round, and each is answered as it would be alone (its own
contiguous span, SHA-1 and registers; its own refusal)."""

from __future__ import annotations

import asyncio
import hashlib

import aetcd
import grpc
import pytest

from broker.client.appender import append
from broker.fragment.fragments import digest_of
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.replica import Replica
from broker.testing import BrokerHarness
from plumbing import metrics
from tests.helpers.journals import IDS, journal_spec, read_all, set_journal, started_brokers, stub
from tests.helpers.waiting import until


def commits() -> float:
    return metrics.spool_commits._value.get()  # type: ignore[attr-defined,no-any-return]


# The two forms of a small append: one message with the whole content (what `append` sends for
# content in one piece), and the protocol's stream of parameters, content and an empty commit.
FORMS = {"one message": lambda p: p, "streamed": lambda p: [p]}


@pytest.mark.parametrize("form", FORMS)
async def test_concurrent_small_appends_commit_in_groups_each_answered_as_alone(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client, form: str
) -> None:
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(etcd, etcd_prefix, journal_spec("group/one"), [("local", i) for i in IDS])
        primary: BrokerHarness = brokers[0]
        await append(stub(primary), "group/one", b"first\n")  # The pipeline is built.
        before = commits()
        payloads = [f"append {i:03d}\n".encode() * (1 + i % 3) for i in range(120)]
        as_form = FORMS[form]
        answers = await asyncio.gather(
            *(append(stub(primary), "group/one", as_form(p)) for p in payloads)
        )
        # Every spool (primary and two peers) commits once per round: fewer rounds than appends.
        rounds = (commits() - before) / 3
        assert rounds < len(payloads) / 2, rounds
        spans = sorted((a.commit.begin, a.commit.end, i) for i, a in enumerate(answers))
        at = len(b"first\n")
        for begin, end, i in spans:
            assert (begin, end) == (at, at + len(payloads[i]))  # Contiguous, none overlapping.
            assert digest_of(answers[i].commit.sum) == hashlib.sha1(payloads[i]).digest()
            at = end
        content = await read_all(primary, "group/one")
        assert content == b"first\n" + b"".join(payloads[i] for _, _, i in spans)
        for h in brokers[1:]:
            assert await read_all(h, "group/one") == content


@pytest.mark.parametrize("form", FORMS)
async def test_a_grouped_append_is_checked_against_the_registers_the_group_leaves(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client, form: str
) -> None:
    """Appends that each require a register absent and then set it: in a group, the first one
    sets it and the others are refused REGISTER_MISMATCH, as they would be one by one."""
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(
            etcd, etcd_prefix, journal_spec("group/regs"), [("local", i) for i in IDS]
        )
        primary = brokers[0]
        await append(
            stub(primary), "group/regs", b"init\n",
            union_registers=labels.label_set(("owner", "nobody")),
        )  # fmt: skip
        check = labels.selector(include=labels.label_set(("owner", "nobody")))

        async def claim(i: int) -> pb.AppendResponse:
            return await append(
                stub(primary), "group/regs", FORMS[form](f"claim {i}\n".encode()), check=False,
                check_registers=check,
                subtract_registers=labels.label_set(("owner", "nobody")),
                union_registers=labels.label_set(("owner", f"writer-{i}")),
            )  # fmt: skip

        answers = await asyncio.gather(*(claim(i) for i in range(40)))
        won = [a for a in answers if a.status == pb.OK]
        lost = [a for a in answers if a.status == pb.REGISTER_MISMATCH]
        assert len(won) == 1 and len(won) + len(lost) == len(answers)
        owner = [lb.value for lb in won[0].registers.labels if lb.name == "owner"]
        assert owner and owner[0].startswith("writer-")
        assert all(lb.value != "nobody" for a in lost for lb in a.registers.labels if lb.name == "owner")  # fmt: skip
        content = await read_all(primary, "group/regs")
        assert content.count(b"claim") == 1


async def test_a_group_whose_write_fails_commits_none_of_its_appends(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primary's spool fails (ENOSPC) on a group's content write: every append of that group
    fails, none of it is ever read back, and the appends after it commit."""
    import errno

    from broker.fragment.spool import Spool

    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(
            etcd, etcd_prefix, journal_spec("group/torn"), [("local", i) for i in IDS]
        )
        primary = brokers[0]
        await append(stub(primary), "group/torn", b"kept\n")
        original = Spool.apply_content
        failed_once = False

        def failing(self: Spool, content: bytes, content_delta: int) -> pb.ReplicateResponse:
            nonlocal failed_once
            if not failed_once and content.count(b"\n") > 1:  # A group's write.
                failed_once = True
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return original(self, content, content_delta)

        monkeypatch.setattr(Spool, "apply_content", failing)
        payloads = [f"torn {i:03d}\n".encode() for i in range(60)]
        answers = await asyncio.gather(
            *(append(stub(primary), "group/torn", p) for p in payloads), return_exceptions=True
        )
        monkeypatch.setattr(Spool, "apply_content", original)
        assert failed_once
        ok = sorted(
            (a.commit.begin, payloads[i]) for i, a in enumerate(answers) if isinstance(a, pb.AppendResponse)
        )  # fmt: skip
        failed = [a for a in answers if not isinstance(a, pb.AppendResponse)]
        assert failed and ok  # The failed group's appends, and those after it.
        after = await append(stub(primary), "group/torn", b"after\n")
        content = await read_all(primary, "group/torn")
        assert content == b"kept\n" + b"".join(p for _, p in ok) + b"after\n"
        assert after.commit.end == len(content)
        for h in brokers[1:]:
            assert await read_all(h, "group/torn") == content


# ---- hostile workloads (issue 38) -------------------------------------------------------------


def replica_of(h: BrokerHarness, journal: str) -> Replica:
    return h.broker.service.resolver.replicas[journal]  # type: ignore[index,no-any-return]


def waiting(replica: Replica) -> int:
    """How many appends read whole wait for the replica's pipeline (or for adoption)."""
    return len(replica.group_commit)


HELD = b"h" * (2 << 20)


async def hold_pipeline(h: BrokerHarness, journal: str) -> grpc.aio.StreamStreamCall:  # type: ignore[type-arg]
    """A streamed append too large to be read whole (2 MiB: the broker's flow policing then
    allows it 33 s of waiting for us), which holds the journal's pipeline until it is committed
    (`commit_held`) or cancelled."""
    call = stub(h).Append()
    await call.write(pb.AppendRequest(journal=journal))
    await call.write(pb.AppendRequest(content=HELD))
    await until(replica_of(h, journal).pipeline_queue.empty, timeout=60)
    return call


async def commit_held(call: grpc.aio.StreamStreamCall) -> pb.AppendResponse:  # type: ignore[type-arg]
    await call.write(pb.AppendRequest())
    await call.done_writing()
    response: pb.AppendResponse = await call
    assert response.status == pb.OK, response
    return response


async def assert_replicas_agree(
    brokers: list[BrokerHarness], journal: str, committed: list[tuple[int, bytes]], end: int
) -> None:
    """Every replica serves exactly the committed content (by its spans), and nothing else,
    and every replica's write head is at `end`."""
    expected = b"".join(content for _, content in sorted(committed))
    at = 0
    for begin, content in sorted(committed):
        assert begin == at, f"a hole or an overlap at {at}: next committed span begins at {begin}"
        at += len(content)
    assert at == end
    for h in brokers:
        assert replica_of(h, journal).index.end_offset() == end, h.broker.id
        served = await read_all(h, journal)
        assert len(served) == len(expected), (h.broker.id, len(served), len(expected))
        assert served == expected, h.broker.id


async def test_a_group_larger_than_a_peer_takes_in_one_message_commits_whole(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    """A slow round (a large append holding the pipeline) lets 99 appends of 60 KiB gather: the
    next group's content is about 6 MB, past the 4 MiB a peer takes in one message. Every one
    of them commits, and every replica serves the same content."""
    journal = "group/large"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
        primary = brokers[0]
        first = await append(stub(primary), journal, b"first\n")
        held = await hold_pipeline(primary, journal)
        payloads = [bytes([65 + i % 26]) * (60 * 1024 - 1) + b"\n" for i in range(99)]
        writers = [
            asyncio.ensure_future(append(stub(primary), journal, p, check=False)) for p in payloads
        ]
        try:
            await until(lambda: waiting(replica_of(primary, journal)) == len(payloads), timeout=60)
        except AssertionError:
            done = [w for w in writers if w.done()]
            raise AssertionError(
                f"{waiting(replica_of(primary, journal))} of {len(payloads)} appends wait for the "
                f"held pipeline after 60s; {len(done)} writers ended, first: "
                f"{(done[0].exception() or done[0].result()) if done else None!r}"
            ) from None
        holder = await commit_held(held)
        answers = await asyncio.gather(*writers, return_exceptions=True)
        committed = [(first.commit.begin, b"first\n"), (holder.commit.begin, HELD)]
        committed += [
            (a.commit.begin, payloads[i])
            for i, a in enumerate(answers)
            if isinstance(a, pb.AppendResponse) and a.status == pb.OK
        ]
        failed = [a for a in answers if not isinstance(a, pb.AppendResponse)]
        # Whatever failed left nothing behind: the next append follows the committed content.
        after = await append(stub(primary), journal, b"after\n")
        committed.append((after.commit.begin, b"after\n"))
        await assert_replicas_agree(brokers, journal, committed, after.commit.end)
        assert not failed, f"{len(failed)} of {len(payloads)} failed, first: {failed[0]!r}"


async def test_many_writers_under_a_rate_limit_each_commit_once(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    """100 writers, each making 3 appends of 60 KiB (one-message and streamed forms), to a
    journal with a `max_append_rate`: the pipeline is held while the limit delays a group, so
    the next one gathers nearly every writer (about 6 MB). Every append commits once, and every
    replica serves exactly what was committed."""
    journal = "group/rated"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        spec = journal_spec(journal, length=1 << 24)
        spec.max_append_rate = 4 << 20
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        primary = brokers[0]
        rounds_before = commits()

        async def writer(w: int) -> list[tuple[int, bytes]]:
            done = []
            for k in range(3):
                payload = f"{w:03d}.{k} ".encode() * (60 * 1024 // 6)
                answer = await append(
                    stub(primary), journal, payload if w % 2 else [payload], timeout=120
                )
                done.append((answer.commit.begin, payload))
            return done

        results = await asyncio.gather(*(writer(w) for w in range(100)), return_exceptions=True)
        failed = [r for r in results if not isinstance(r, list)]
        committed = [span for r in results if isinstance(r, list) for span in r]
        after = await append(stub(primary), journal, b"after\n")
        committed.append((after.commit.begin, b"after\n"))
        await assert_replicas_agree(brokers, journal, committed, after.commit.end)
        assert not failed, f"{len(failed)} of 100 writers failed, first: {failed[0]!r}"
        assert (commits() - rounds_before) / 3 < 300 / 2  # Grouped.


# ---- appends whose client left while they waited for the pipeline ---------------------------


async def gone_one_message(h: BrokerHarness, journal: str, payload: bytes) -> None:
    """A one-message append whose client times out while it waits for the pipeline."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await append(stub(h), journal, payload, timeout=1.0)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def gone_streamed(h: BrokerHarness, journal: str, payload: bytes) -> None:
    """A streamed append (parameters, content, the empty commit, then the end of the stream, as
    upstream's Go client sends it) whose client cancels while it waits for the pipeline."""
    call = stub(h).Append()
    await call.write(pb.AppendRequest(journal=journal))
    for at in range(0, len(payload), 32 * 1024):
        await call.write(pb.AppendRequest(content=payload[at : at + 32 * 1024]))
    await call.write(pb.AppendRequest())
    await call.done_writing()
    replica = replica_of(h, journal)
    if len(payload) < 64 * 1024:
        await until(lambda: waiting(replica) == 1, timeout=60)
    call.cancel()


async def assert_left(replica: Replica, timeout: float = 10.0) -> None:
    try:
        await until(lambda: waiting(replica) == 0, timeout=timeout)
    except TimeoutError:
        raise AssertionError("the append whose client left still waits for the pipeline") from None


LEAVE = {"one message timed out": gone_one_message, "streamed cancelled": gone_streamed}


@pytest.mark.parametrize("size", [100, 100 * 1024], ids=["small", "100KiB"])
@pytest.mark.parametrize("leave", LEAVE)
async def test_an_append_whose_client_left_while_it_waited_for_the_pipeline_is_not_committed(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client, leave: str, size: int
) -> None:
    """Upstream aborts an append whose client is gone once it has the pipeline: it is never
    proposed. A small one is read whole before it waits (so no read of the client tells that
    it left), a 100 KiB one is not (the client's departure fails its next read)."""
    journal = "group/left"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(etcd, etcd_prefix, journal_spec(journal), [("local", i) for i in IDS])
        primary = brokers[0]
        first = await append(stub(primary), journal, b"first\n")
        held = await hold_pipeline(primary, journal)
        gone = b"gone " * (size // 5)
        await LEAVE[leave](primary, journal, gone)
        if size < 64 * 1024:
            await assert_left(replica_of(primary, journal))
        holder = await commit_held(held)
        after = await append(stub(primary), journal, b"after\n")
        committed = [
            (first.commit.begin, b"first\n"),
            (holder.commit.begin, HELD),
            (after.commit.begin, b"after\n"),
        ]
        await assert_replicas_agree(brokers, journal, committed, after.commit.end)


async def test_appends_whose_clients_leave_while_their_group_waits_for_the_rate_limit_are_not_committed(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    """The append holding the pipeline adopts those waiting, then waits for the journal's rate
    limit (a second for every KiB here) before it sends their content: clients that time out
    meanwhile (0.3 s), the holder's own among them, are not proposed; the others commit."""
    journal = "group/rated-left"
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        spec = journal_spec(journal)
        spec.max_append_rate = 1024
        await set_journal(etcd, etcd_prefix, spec, [("local", i) for i in IDS])
        primary = brokers[0]
        first = await append(stub(primary), journal, b"f" * 2048)  # Spends the rate's burst.

        async def leaver(i: int) -> None:
            payload = f"left {i} ".encode() * 100
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await append(stub(primary), journal, payload if i % 2 else [payload], timeout=0.3)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        leavers = [asyncio.ensure_future(leaver(i)) for i in range(4)]
        # The first holds it while the others wait; on a loaded machine all four may have left
        # before a poll sees one waiting; what follows still checks that none of them landed.
        await until(
            lambda: (
                waiting(replica_of(primary, journal)) >= 1 or all(task.done() for task in leavers)
            ),
            timeout=60,
        )
        payloads = [f"stays {i} ".encode() * 100 for i in range(3)]
        answers = await asyncio.gather(*(append(stub(primary), journal, p) for p in payloads))
        await asyncio.gather(*leavers)
        committed = [(first.commit.begin, b"f" * 2048)]
        committed += [(a.commit.begin, p) for a, p in zip(answers, payloads, strict=True)]
        await assert_replicas_agree(brokers, journal, committed, max(a.commit.end for a in answers))


def marked(i: int, size: int) -> bytes:
    """A payload that names itself: `#<i>:<size>|` then filler, `size` bytes in all."""
    head = f"#{i:05d}:{size:06d}|".encode()
    return head + b"." * (size - len(head))


def parse_marked(content: bytes) -> list[tuple[int, int, int]]:
    """The (begin, end, i) of each payload `marked` wrote, in the order they lie."""
    out, at = [], 0
    while at < len(content):
        i, size = int(content[at + 1 : at + 6]), int(content[at + 7 : at + 13])
        out.append((at, at + size, i))
        at += size
    return out


async def test_writers_whose_clients_leave_at_random_points_commit_each_append_at_most_once(
    etcd_server: object, etcd_prefix: str, etcd: aetcd.Client
) -> None:
    """80 writers of 1 to 64 KiB appends (one message and streamed), a third of them with
    deadlines of a few milliseconds to half a second, so that clients leave while their append
    is read, waits for the pipeline, is adopted, or is being acknowledged. Every append
    answered OK is read back once where its answer says; one that failed is there at most
    once (its outcome was unknown once its commit was sent); every replica serves the same."""
    import random

    journal = "group/random-left"
    rng = random.Random(38)
    async with started_brokers(etcd_server.endpoint, etcd_prefix, IDS) as brokers:  # type: ignore[attr-defined]
        await set_journal(
            etcd, etcd_prefix, journal_spec(journal, length=1 << 24), [("local", i) for i in IDS]
        )
        primary = brokers[0]
        plan = [
            (i, rng.randint(16, 64 * 1024), rng.uniform(0.005, 0.5) if i % 3 == 0 else None)
            for i in range(240)
        ]

        async def writer(w: int) -> list[tuple[int, pb.AppendResponse | BaseException]]:
            out: list[tuple[int, pb.AppendResponse | BaseException]] = []
            for i, size, timeout in plan[w::80]:
                payload = marked(i, size)
                content = payload if i % 2 else [payload[: size // 2], payload[size // 2 :]]
                try:
                    out.append((i, await append(stub(primary), journal, content, timeout=timeout)))
                except grpc.aio.AioRpcError as exc:
                    assert timeout is not None, exc
                    out.append((i, exc))
            return out

        results = [r for rs in await asyncio.gather(*(writer(w) for w in range(80))) for r in rs]
        end = (await append(stub(primary), journal, marked(99999, 20))).commit.begin
        content = await read_all(primary, journal, end=end)
        spans = parse_marked(content)
        found = {i: (begin, end) for begin, end, i in spans}
        assert len(found) == len(spans), "an append was written twice"
        for i, result in results:
            if isinstance(result, pb.AppendResponse):
                assert found[i] == (result.commit.begin, result.commit.end), i
        for h in brokers[1:]:
            assert replica_of(h, journal).index.end_offset() == end + 20
            assert await read_all(h, journal, end=end) == content
