"""A dev cluster whose every broker stopped gracefully (SIGTERM): the last broker's exit flush
persists each journal and suspends it (PARTIAL, one replica) until the next append. `gazctl dev
up` starts the brokers again and is ready at once, and the journal reads back whole."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest

from broker.client.journals import JournalsClient
from broker.client.reader import read
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from tests.conftest import run_cli
from tests.helpers.dev import JOURNAL, SPEC, dev, exported, stop_every_broker_gracefully


async def library_read(address: str) -> tuple[bytes, pb.JournalSpec.Suspend]:
    """The journal's content through the library's reader, and its spec's suspension."""
    async with JournalsClient(address) as client:
        listed = await client.list()
    (journal,) = [j for j in listed.journals if j.spec.name == JOURNAL]
    channel = grpc.aio.insecure_channel(urlsplit(address).netloc)
    try:
        stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
        content = b"".join([chunk.content async for chunk in read(stub, JOURNAL)])
    finally:
        await channel.close()
    return content, journal.spec.suspend


def test_every_broker_stopped_gracefully_keeps_what_was_acknowledged_and_up_is_ready(
    cluster_dir: Path,
) -> None:
    """The earlier reproduction's flow. Its journal's store directory was never created: the
    append was acknowledged, no broker could persist it, and after the last broker's exit it was
    gone (read: exit 0, nothing). Now the append is refused, naming the directory; once it
    exists, what was appended is in the store after every broker's graceful stop, and reads
    back through gazctl and the library's reader. `dev up` waited for two replicas of the
    suspended journal, which only the next append brings: "journal dev/suspended not ready"."""
    r = dev(cluster_dir, "up", "--brokers", "2")
    assert r.code == 0, r.err
    env = exported(r.out)
    specs = cluster_dir / "journal.yaml"
    specs.write_text(SPEC)
    applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
    assert applied.code == 0, applied.err

    store = cluster_dir / "fragments" / "dev"
    refused = run_cli(
        "gazctl",
        "journals",
        "append",
        "--wait",
        "0s",
        "-l",
        f"name={JOURNAL}",
        input="lost\n",
        env=env,
    )
    assert refused.code == 1, refused.err
    assert "FRAGMENT_STORE_UNHEALTHY" in refused.err and f"{store} does not exist" in refused.err
    assert "Traceback" not in refused.err

    store.mkdir()  # The store takes fragments from its next health check on.
    appended = run_cli(
        "gazctl", "journals", "append", "-l", f"name={JOURNAL}", input="before\n", env=env
    )
    assert appended.code == 0, appended.err
    assert f"appended 7 bytes to {JOURNAL} at [0, 7)" in appended.err
    stop_every_broker_gracefully(cluster_dir)

    again = dev(cluster_dir, "up", "--timeout", "20")
    assert again.code == 0, again.err
    assert "not ready" not in again.err
    # Persisted by the exit flush: in the store, not only in a replica's spool.
    fragments = run_cli("gazctl", "journals", "fragments", "-l", f"name={JOURNAL}", env=env)
    assert fragments.code == 0, fragments.err
    rows = [line.split() for line in fragments.out.splitlines() if line.startswith(JOURNAL)]
    assert [(row[1], row[2], row[-1]) for row in rows] == [("0", "7", "file:///dev/")], rows
    read_ = run_cli("gazctl", "journals", "read", "-l", f"name={JOURNAL}", env=env)
    assert read_.code == 0 and read_.out == "before\n", (read_.out, read_.err)
    broker = env["BROKER_ADDRESS"].split(",")[0]
    content, suspend = asyncio.run(library_read(broker))
    assert content == b"before\n"
    assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.PARTIAL, 7)

    # The next append resumes it.
    appended = run_cli(
        "gazctl", "journals", "append", "-l", f"name={JOURNAL}", input="after\n", env=env
    )
    assert appended.code == 0, appended.err
    assert "at [7, 13)" in appended.err
    read_ = run_cli("gazctl", "journals", "read", "-l", f"name={JOURNAL}", env=env)
    assert read_.out == "before\nafter\n", (read_.out, read_.err)
    assert dev(cluster_dir, "down").code == 0


def chunker(broker: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer.examples.stream_sum", "chunker", "--broker.address",
         broker, "--streams", "3", "--chunks", "2", "--timeout", "60"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


@pytest.mark.slow
def test_up_with_stream_sum_after_down_is_ready(cluster_dir: Path) -> None:
    """`dev down` stops the brokers together, and the exit flush persists and suspends each
    written journal that has a store (PARTIAL). `dev up --app stream-sum` again: the wait
    after its setup, for every journal of the cluster, counts the suspended one ready with its
    one replica (it waited for two: "journal dev/suspended not ready"); its content reads back,
    and the chunker's sums are exact."""
    args = ("up", "--brokers", "2", "--app", "stream-sum", "--timeout", "30")
    r = dev(cluster_dir, *args, timeout=180)
    assert r.code == 0, r.err
    env = exported(r.out)
    specs = cluster_dir / "journal.yaml"
    specs.write_text(SPEC)
    (cluster_dir / "fragments" / "dev").mkdir()
    applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
    assert applied.code == 0, applied.err
    appended = run_cli(
        "gazctl", "journals", "append", "-l", f"name={JOURNAL}", input="before\n", env=env
    )
    assert appended.code == 0, appended.err
    down = dev(cluster_dir, "down")
    assert down.code == 0, down.err
    # What a broker's log says of its exit flush (AppendFSM.state_update_suspend).
    logs = "".join((cluster_dir / f"broker-{i}.log").read_text() for i in range(2))
    assert f"journal {JOURNAL} suspension is now PARTIAL at offset 7" in logs

    again = dev(cluster_dir, *args, timeout=180)
    assert again.code == 0, again.err
    assert "not ready" not in again.err
    read_ = run_cli("gazctl", "journals", "read", "-l", f"name={JOURNAL}", env=env)
    assert read_.code == 0 and read_.out == "before\n", (read_.out, read_.err)
    ran = chunker(env["BROKER_ADDRESS"])
    assert ran.returncode == 0, ran.stderr
    assert dev(cluster_dir, "down").code == 0
