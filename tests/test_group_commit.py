"""Group commit: small appends to one journal, received whole while its pipeline is busy, are
committed together in one replication round, and each is answered as it would be alone (its own
contiguous span, SHA-1 and registers; its own refusal)."""

from __future__ import annotations

import asyncio
import hashlib

import aetcd
import pytest

from broker.client.appender import append
from broker.fragment.fragments import digest_of
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.testing import BrokerHarness
from plumbing import metrics
from tests.journals_testing import journal_spec, set_journal, started_brokers
from tests.test_append_e2e import IDS, read_all, stub


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
