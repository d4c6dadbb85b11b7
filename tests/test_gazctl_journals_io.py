"""`gazctl journals append|read|reset-head` against a real broker process."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import uuid
from pathlib import Path

from broker.testing import EtcdServer, stop_process
from tests.conftest import BrokerProcess, run_cli, start_broker_process
from tests.helpers.gazctl import assert_one_line_error, gazctl

SPEC = "name: {name}\nreplication: 1\nfragment: {{length: 4096, compression_codec: NONE, refresh_interval: 1m0s}}\n"


def create(broker: BrokerProcess, tmp_path: Path, name: str) -> None:
    specs = tmp_path / f"{name.replace('/', '_')}.yaml"
    specs.write_text(SPEC.format(name=name))
    r = gazctl(broker, "journals", "apply", "--specs", str(specs))
    assert r.code == 0, r.err


def test_append_then_read_back(broker_process: BrokerProcess, tmp_path: Path) -> None:
    create(broker_process, tmp_path, "io/lines")
    # At once after the apply: the append waits until the allocator assigns the journal.
    r = gazctl(
        broker_process, "journals", "append", "-l", "name=io/lines", "--framing", "lines",
        input="one\ntwo\nthree",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "appended 14 bytes to io/lines at [0, 14)" in r.err
    r = gazctl(broker_process, "journals", "append", "-l", "name=io/lines", input="four\n")
    assert r.code == 0 and "at [14, 19)" in r.err
    r = gazctl(broker_process, "journals", "read", "-l", "name=io/lines")
    assert r.code == 0, r.err
    assert r.out == "one\ntwo\nthree\nfour\n"
    out = tmp_path / "out.bin"
    r = gazctl(broker_process, "journals", "read", "-l", "name=io/lines", "-o", str(out))
    assert r.code == 0 and out.read_text() == "one\ntwo\nthree\nfour\n"
    r = gazctl(broker_process, "journals", "read", "-l", "name=io/lines", "--tail")
    assert r.code == 0 and r.out == ""

    # From a file, and the head is reset to where it already is (a no-op in a healthy journal).
    data = tmp_path / "data.txt"
    data.write_text("five\n")
    assert (
        gazctl(broker_process, "journals", "append", "-l", "name=io/lines", "-i", str(data)).code
        == 0
    )
    r = gazctl(broker_process, "journals", "reset-head", "-l", "name=io/lines")
    assert r.code == 0, r.err
    assert "reset the head of io/lines to 24" in r.err
    assert gazctl(broker_process, "journals", "read", "-l", "name=io/lines").out.endswith(
        "four\nfive\n"
    )


def test_append_errors(broker_process: BrokerProcess, tmp_path: Path) -> None:
    create(broker_process, tmp_path, "io/multi/a")
    create(broker_process, tmp_path, "io/multi/b")
    r = gazctl(broker_process, "journals", "append", "-l", "prefix=io/multi/", input="x")
    assert_one_line_error(r, "matches 2 journals")
    r = gazctl(broker_process, "journals", "append", "-l", "name=io/none", input="x")
    assert_one_line_error(r, "no journals match")
    r = gazctl(
        broker_process,
        "journals",
        "append",
        "-l",
        "name=io/multi/a",
        "-i",
        str(tmp_path / "missing"),
    )
    assert_one_line_error(r, "missing")
    r = run_cli(
        "gazctl", "journals", "read", "-l", "name=x", env={"BROKER_ADDRESS": "http://127.0.0.1:1"}
    )
    assert_one_line_error(r, "cannot reach broker")


def test_mapped_appends_to_a_partitioned_topic(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    from message.mapping import fnv1a32

    names = [f"topic/part-{i}" for i in range(3)]
    for name in names:
        create(broker_process, tmp_path, name)
    keys = [f"user-{i}" for i in range(12)]
    lines = "".join(f"{key}\nrecord of {key}\n" for key in keys)
    r = gazctl(
        broker_process, "journals", "append", "-l", "prefix=topic/", "--framing", "lines",
        "--mapping", "modulo", input=lines,
    )  # fmt: skip
    assert r.code == 0, r.err
    for index, name in enumerate(names):
        expected = "".join(
            f"record of {key}\n" for key in keys if fnv1a32(key.encode()) % 3 == index
        )
        assert gazctl(broker_process, "journals", "read", "-l", f"name={name}").out == expected

    # direct: each record after its journal's name; a name outside the topic is refused.
    r = gazctl(
        broker_process, "journals", "append", "-l", "prefix=topic/", "-f", "lines", "-m", "direct",
        input="topic/part-2\nhello\n",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert gazctl(broker_process, "journals", "read", "-l", "name=topic/part-2").out.endswith(
        "hello\n"
    )
    r = gazctl(
        broker_process, "journals", "append", "-l", "prefix=topic/", "-f", "lines", "-m", "direct",
        input="elsewhere/journal\nhello\n",
    )  # fmt: skip
    assert_one_line_error(r, "elsewhere/journal")
    r = gazctl(
        broker_process, "journals", "append", "-l", "prefix=topic/", "-m", "modulo", input="k\nv\n"
    )
    assert r.code != 0 and "--framing lines" in r.err


def test_an_append_waits_a_bounded_time_for_brokers_and_says_what_it_waits_for(
    broker_process: BrokerProcess, tmp_path: Path
) -> None:
    """A journal of replication 3 on one broker never gets its replicas: the append waits
    --wait, says once what it waits through, then fails with one line saying why (the broker's
    allocator cannot place the other two), appending nothing."""
    specs = tmp_path / "three.yaml"
    specs.write_text(SPEC.format(name="io/three").replace("replication: 1", "replication: 3"))
    assert gazctl(broker_process, "journals", "apply", "--specs", str(specs)).code == 0
    began = time.monotonic()
    r = gazctl(
        broker_process, "journals", "append", "-l", "name=io/three", "--wait", "3s", input="x\n"
    )
    took = time.monotonic() - began
    assert r.code == 1, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 2, r.err
    assert "INSUFFICIENT_JOURNAL_BROKERS; waiting up to 3s" in lines[0]
    # Why, as the broker sees it: waiting longer would not help.
    assert (
        "INSUFFICIENT_JOURNAL_BROKERS: a replication of 3 asks for more brokers than the 1 "
        "running (after waiting 3s)" in lines[1]
    ), r.err
    assert "Traceback" not in r.err
    assert took >= 2.0  # It waited rather than failing at the first refusal.
    r = gazctl(broker_process, "journals", "append", "-l", "name=io/three", "--wait", "0s",
               input="x\n")  # fmt: skip
    assert r.code == 1 and len(r.err.strip().splitlines()) == 1, r.err  # No wait: no progress.
    r = gazctl(broker_process, "journals", "append", "-l", "name=io/three", "--wait", "soon",
               input="x\n")  # fmt: skip
    assert r.code == 2 and "--wait" in r.err and "Traceback" not in r.err


def test_an_append_right_after_a_graceful_full_restart_waits_for_the_journal_to_resume(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """Both brokers of a replication-2 journal stopped with SIGTERM, then started again one
    after the other: an append sent as soon as the first answers waits until the journal has
    its brokers again, rather than failing with INSUFFICIENT_JOURNAL_BROKERS (as it did)."""
    prefix = f"/gazette-test/{uuid.uuid4().hex[:12]}"

    def start(i: int, run: str) -> BrokerProcess:
        return start_broker_process(
            etcd_server, prefix, tmp_path / f"broker-{i}-{run}.log", broker_id=f"broker-{i}"
        )

    brokers = [start(0, "first"), start(1, "first")]
    try:
        specs = tmp_path / "two.yaml"
        specs.write_text(SPEC.format(name="io/two").replace("replication: 1", "replication: 2"))
        assert gazctl(brokers[0], "journals", "apply", "--specs", str(specs)).code == 0
        r = gazctl(brokers[0], "journals", "append", "-l", "name=io/two", input="before\n")
        assert r.code == 0, r.err
    finally:
        for broker in brokers:
            broker.proc.send_signal(signal.SIGTERM)
        for broker in brokers:
            broker.proc.wait(timeout=30)
    brokers = [start(0, "second")]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Deliberately a second late: the append, sent meanwhile, must wait for it.
            second = pool.submit(lambda: (time.sleep(1.0), start(1, "second"))[1])
            try:
                r = gazctl(brokers[0], "journals", "append", "-l", "name=io/two", input="after\n")
            finally:
                brokers.append(second.result(timeout=60))
        assert r.code == 0, r.err
        assert "appended 6 bytes to io/two" in r.err
        r = gazctl(brokers[0], "journals", "read", "-l", "name=io/two")
        assert r.code == 0 and r.out.endswith("after\n"), r.err
    finally:
        for broker in brokers:
            stop_process(broker.proc)
