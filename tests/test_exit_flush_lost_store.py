"""A journal whose store fails between an acknowledged append and the graceful stop of every
broker: no replica can persist what it holds, and every spool goes with its broker. The content
is lost (every replica of it left), but the journal fails to safety: the last broker's exit
flush still records the journal's end in etcd (its suspension offset), so the restarted cluster
hands out no offset below it, and a read of the lost range names it instead of ending quietly."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from broker.client.journals import JournalsClient
from broker.protocol import protocol_pb2 as pb
from broker.testing import EtcdServer, start_broker_process, stop_process
from tests.conftest import run_cli
from tests.helpers.dev import (
    JOURNAL,
    SPEC,
    append_held,
    dev,
    exported,
    stop_every_broker_gracefully,
)


async def suspension(address: str) -> pb.JournalSpec.Suspend:
    async with JournalsClient(address) as client:
        listed = await client.list()
    (journal,) = [j for j in listed.journals if j.spec.name == JOURNAL]
    return journal.spec.suspend


def test_exit_flush_that_cannot_persist_keeps_offsets_and_reports_the_hole(
    cluster_dir: Path,
) -> None:
    """`before\\n` is acknowledged at [0, 7) while the store is healthy; then the store's
    directory goes away and every broker is stopped gracefully, then the directory comes back.
    Before: `dev up` and a read both exited 0, the read with nothing, and the next append
    landed at [0, 6), writing offset 0 twice; broker-0's log said the journal would need
    `gazctl journals reset-head` after a restart, which nothing enforced."""
    r = dev(cluster_dir, "up", "--brokers", "2")
    assert r.code == 0, r.err
    env = exported(r.out)
    store = cluster_dir / "fragments" / "dev"
    store.mkdir()
    specs = cluster_dir / "journal.yaml"
    specs.write_text(SPEC)
    applied = run_cli("gazctl", "journals", "apply", "--specs", str(specs), env=env)
    assert applied.code == 0, applied.err
    appended = run_cli(
        "gazctl", "journals", "append", "-l", f"name={JOURNAL}", input="before\n", env=env
    )
    assert appended.code == 0, appended.err
    assert f"appended 7 bytes to {JOURNAL} at [0, 7)" in appended.err

    away = cluster_dir / "fragments" / "away"
    store.rename(away)  # Healthy at the append, failing at every broker's exit.
    stop_every_broker_gracefully(cluster_dir)
    away.rename(store)

    again = dev(cluster_dir, "up", "--timeout", "30")
    assert again.code == 0, again.err
    read_ = run_cli("gazctl", "journals", "read", "-l", f"name={JOURNAL}", env=env)
    assert read_.code == 0, read_.err
    assert read_.out == ""
    assert f"{JOURNAL}: skipped [0, 7)" in read_.err, read_.err

    appended = run_cli(
        "gazctl", "journals", "append", "-l", f"name={JOURNAL}", input="after\n", env=env
    )
    assert appended.code == 0, appended.err
    assert f"appended 6 bytes to {JOURNAL} at [7, 13)" in appended.err, appended.err

    # (The broker's index moves a read from before every fragment to the first persisted one,
    # as upstream's does for fragments removed by retention: once [7, 13) is persisted, this
    # read starts there, and whether it still names [0, 7) depends on the persist's timing.)
    read_ = run_cli("gazctl", "journals", "read", "-l", f"name={JOURNAL}", env=env)
    assert read_.code == 0, read_.err
    assert read_.out == "after\n", (read_.out, read_.err)

    # The journal's end was recorded (its suspension offset) although its content could not
    # be persisted; the append resumed it from there.
    suspend = asyncio.run(suspension(env["BROKER_ADDRESS"].split(",")[0]))
    assert (suspend.level, suspend.offset) == (pb.JournalSpec.Suspend.NONE, 7), suspend

    # What the last broker's log says is what happened: the range lost, the offset kept.
    logs = "".join((cluster_dir / f"broker-{i}.log").read_text() for i in range(2))
    lost = [line for line in logs.splitlines() if "[0, 7)" in line and "lost" in line]
    assert lost and "resumes at offset 7" in lost[0], logs[-3000:]
    assert "after a restart it needs `gazctl journals reset-head`" not in logs, logs[-3000:]
    assert dev(cluster_dir, "down").code == 0


def test_a_stopping_broker_gives_up_on_a_failing_store_after_its_exit_flush_timeout(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """`--broker.exit-flush-timeout` bounds how long a SIGTERMed broker keeps trying to persist
    what it holds: with 5 s (the least it takes), a broker whose store went away exits well
    within the 30 s it would otherwise try for, and says what it could not persist."""
    root = tmp_path / "fragments"
    (root / "flush").mkdir(parents=True)
    log = tmp_path / "broker.log"
    broker = start_broker_process(
        etcd_server, etcd_prefix, log,
        extra=("--broker.file-root", str(root), "--broker.exit-flush-timeout", "5s"),
    )  # fmt: skip
    try:
        append_held(broker.address, tmp_path)
        (root / "flush").rename(root / "away")
        broker.proc.send_signal(signal.SIGTERM)
        # Without the flag's bound, the exit flush and the persister's last attempts take
        # 30 s and more: the wait's own timeout is the check.
        broker.proc.wait(timeout=20)
        text = log.read_text()
        assert "flush/j: could not persist [0, 5)" in text, text[-3000:]
    finally:
        stop_process(broker.proc)
