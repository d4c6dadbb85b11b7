"""`gazctl attach-uuids`: one new producer per run, committed UUIDs with increasing clocks, upstream's
template, --skip-header per file, --max-length, and one-line errors."""

from __future__ import annotations

import uuid
from pathlib import Path

from message.uuid import Flags, parse
from tests.conftest import run_cli


def parsed(line: str) -> tuple[bytes, int, int]:
    return parse(uuid.UUID(line.split(",", 1)[0]))


def test_each_line_gets_a_committed_uuid_of_one_producer(tmp_path: Path) -> None:
    one = tmp_path / "one.csv"
    two = tmp_path / "two.csv"
    one.write_text("name,n\nalpha,1\nbeta,2\n")
    two.write_text("name,n\ngamma,3\r\n")
    result = run_cli("gazctl", "attach-uuids", "--skip-header", str(one), str(two))
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert [line.split(",", 1)[1] for line in lines] == ["alpha,1", "beta,2", "gamma,3"]
    fields = [parsed(line) for line in lines]
    assert len({producer for producer, _, _ in fields}) == 1
    assert fields[0][0][0] & 0x01  # The multicast bit of a ProducerID.
    clocks = [clock for _, clock, _ in fields]
    assert clocks == sorted(clocks) and len(set(clocks)) == 3
    assert all(flags == Flags.OUTSIDE_TXN for _, _, flags in fields)
    # Another run is another producer.
    again = run_cli("gazctl", "attach-uuids", str(one))
    assert parsed(again.out.splitlines()[0])[0] != fields[0][0]
    assert again.out.splitlines()[0].endswith(",name,n")  # No --skip-header: kept.


def test_templates_and_stdin() -> None:
    result = run_cli(
        "gazctl", "attach-uuids", "--template", '{"uuid": "{{ .UUID }}", "record": {{.Line}}}\n',
        input='{"a": 1}\n{"a": 2}\n',
    )  # fmt: skip
    assert result.code == 0, result.err
    import json

    records = [json.loads(line) for line in result.out.splitlines()]
    assert [r["record"] for r in records] == [{"a": 1}, {"a": 2}]
    assert all(parse(uuid.UUID(r["uuid"]))[2] == Flags.OUTSIDE_TXN for r in records)


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    bad_template = run_cli(
        "gazctl", "attach-uuids", "--template", "{{.Line}} {{.When}}\n", input="x\n"
    )
    assert bad_template.code != 0 and not bad_template.out
    assert "{{.When}}" in bad_template.err and "Traceback" not in bad_template.err

    missing = run_cli("gazctl", "attach-uuids", str(tmp_path / "nope.csv"))
    assert missing.code == 1 and "nope.csv" in missing.err
    assert len(missing.err.strip().splitlines()) == 1

    long = run_cli("gazctl", "attach-uuids", "--max-length", "5", input="short\ntoo long\n")
    assert long.code == 1 and "line 2" in long.err and "--max-length 5" in long.err
    assert len(long.err.strip().splitlines()) == 1
