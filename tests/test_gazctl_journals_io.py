"""`gazctl journals append|read|reset-head` against a real broker process."""

from __future__ import annotations

import time
from pathlib import Path

from tests.conftest import BrokerProcess, run_cli
from tests.test_gazctl_journals import assert_one_line_error, gazctl

SPEC = "name: {name}\nreplication: 1\nfragment: {{length: 4096, compression_codec: NONE, refresh_interval: 1m0s}}\n"


def create(broker: BrokerProcess, tmp_path: Path, name: str) -> None:
    specs = tmp_path / f"{name.replace('/', '_')}.yaml"
    specs.write_text(SPEC.format(name=name))
    r = gazctl(broker, "journals", "apply", "--specs", str(specs))
    assert r.code == 0, r.err


def append_retrying(broker: BrokerProcess, *args: str, input: str) -> object:
    """The allocator assigns a new journal within moments; until then appends are refused."""
    deadline = time.monotonic() + 20
    while True:
        r = gazctl(broker, "journals", "append", *args, input=input)
        if r.code == 0 or time.monotonic() > deadline:  # type: ignore[attr-defined]
            return r
        time.sleep(0.2)


def test_append_then_read_back(broker_process: BrokerProcess, tmp_path: Path) -> None:
    create(broker_process, tmp_path, "io/lines")
    r = append_retrying(
        broker_process, "-l", "name=io/lines", "--framing", "lines", input="one\ntwo\nthree"
    )
    assert r.code == 0, r.err  # type: ignore[attr-defined]
    assert "appended 14 bytes to io/lines at [0, 14)" in r.err  # type: ignore[attr-defined]
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
    from broker.message.mapping import fnv1a32

    names = [f"topic/part-{i}" for i in range(3)]
    for name in names:
        create(broker_process, tmp_path, name)
    keys = [f"user-{i}" for i in range(12)]
    lines = "".join(f"{key}\nrecord of {key}\n" for key in keys)
    r = append_retrying(
        broker_process, "-l", "prefix=topic/", "--framing", "lines", "--mapping", "modulo",
        input=lines,
    )  # fmt: skip
    assert r.code == 0, r.err  # type: ignore[attr-defined]
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
