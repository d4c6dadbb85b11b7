"""`gazctl shards apply|list` as the user runs them (a subprocess), against a consumer process
and a broker: the shardspace applied after its journals are checked, listed back as the same
YAML, in a table with statuses, replicas and lag, and bad input in one line with nothing applied."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import pytest

from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc
from broker.protocol import recorded_op_pb2 as rpb
from broker.testing import BrokerHarness, EtcdServer
from consumer.runtime import Consumer, ConsumerConfig
from gazctl.shards import RECOVERY_LOG_CONTENT_TYPE
from tests.conftest import Result, run_cli
from tests.helpers.consumers import INPUT, StoredSummer, publish_inputs, spec, write_head
from tests.helpers.journals import routed
from tests.helpers.waiting import until

SHARDSPACE = """\
common:
  sources:
  - journal: sums/input
  max_txn_duration: 1s
  labels:
  - name: app
    value: summer
shards:
- id: sum-a
- id: sum-b
  hot_standbys: 1
  labels:
  - name: tier
    value: gold
"""


def one_shard(source: str, max_txn: str = "1s") -> str:
    return (
        f"shards:\n- id: sum-a\n  sources:\n  - journal: {source}\n  max_txn_duration: {max_txn}\n"
    )


class PoisonableSummer(StoredSummer):
    """Fails every transaction while `poisoned`: its shards go FAILED."""

    poisoned = False

    async def consume_message(self, *args: Any) -> None:
        if self.poisoned:
            raise RuntimeError("poisoned: cannot sum this")
        await super().consume_message(*args)


@pytest.fixture
async def consumer(
    etcd_server: EtcdServer,
    sums_broker: BrokerHarness,
    tmp_path: Path,
) -> AsyncIterator[Consumer]:
    broker = sums_broker
    root = f"/gazette-test-consumers/{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        id="consumer-0",
        broker_address=broker.endpoint,
        etcd_address=etcd_server.endpoint,
        etcd_prefix=root,
        etcd_lease=5.0,
    )
    c = Consumer(config, PoisonableSummer(tmp_path / "stores"))
    await c.start()
    try:
        yield c
    finally:
        await c.stop()
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as client:
            await client.delete_prefix(root.encode())


async def gazctl(
    consumer: Consumer, broker: BrokerHarness, *args: str, input: str | None = None
) -> Result:
    env = {"CONSUMER_ADDRESS": consumer.endpoint, "BROKER_ADDRESS": broker.endpoint}
    return await asyncio.to_thread(run_cli, "gazctl", "shards", *args, input=input, env=env)


def one_line_error(r: Result) -> str:
    assert r.code != 0, r
    assert "Traceback" not in r.err, r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1, r.err
    return lines[0]


async def test_apply_checks_journals_then_lists_back_the_same_shardspace(
    consumer: Consumer, sums_broker: BrokerHarness
) -> None:
    broker = sums_broker
    # A source that does not exist, one that is not framed, a bad spec: refused, nothing
    # applied.
    error = one_line_error(await gazctl(consumer, broker, "apply", input=one_shard("sums/nope")))
    assert "shard sum-a: source journal sums/nope does not exist" in error
    async with broker.client() as client:
        raw = spec("sums/raw")
        raw.labels.Clear()
        raw.labels.labels.add(name="content-type", value="application/octet-stream")
        await client.apply([pb.ApplyRequest.Change(upsert=raw)])
    error = one_line_error(await gazctl(consumer, broker, "apply", input=one_shard("sums/raw")))
    assert "shard sum-a: source journal sums/raw: unknown content-type" in error
    bad = one_shard("sums/input", max_txn="0s")
    error = one_line_error(await gazctl(consumer, broker, "apply", input=bad))
    assert "shard sum-a (line 2): max_txn_duration" in error
    listed = await gazctl(consumer, broker, "list", "-o", "json")
    assert listed.code == 0 and listed.out == ""

    dry = await gazctl(consumer, broker, "apply", "--dry-run", input=SHARDSPACE)
    assert dry.code == 0 and "create" in dry.out and "dry run" in dry.err
    applied = await gazctl(consumer, broker, "apply", input=SHARDSPACE)
    assert applied.code == 0, applied
    assert "applied: 2 create" in applied.err

    as_yaml = await gazctl(consumer, broker, "list", "-o", "yaml")
    assert as_yaml.code == 0, as_yaml
    without_revisions = (
        "\n".join(
            line for line in as_yaml.out.splitlines() if not line.strip().startswith("revision:")
        )
        + "\n"
    )
    assert without_revisions == SHARDSPACE
    # Applied again as listed (with its revisions): nothing changes.
    again = await gazctl(consumer, broker, "apply", input=as_yaml.out)
    assert again.code == 0 and "applied: 2 unchanged" in again.err
    # With a stale revision the dry run predicts the conflict, and the apply refuses.
    stale = as_yaml.out.replace("revision: ", "revision: 1", 1)
    predicted = await gazctl(consumer, broker, "apply", "--dry-run", input=stale)
    assert predicted.code == 1 and "conflict" in predicted.out
    error = one_line_error(await gazctl(consumer, broker, "apply", input=stale))
    assert "revision conflict" in error

    lines = (await gazctl(consumer, broker, "list", "-o", "json")).out.splitlines()
    assert [json.loads(line)["spec"]["id"] for line in lines] == ["sum-a", "sum-b"]


async def test_more_shards_than_etcd_takes_in_one_transaction_are_refused_whole(
    consumer: Consumer, sums_broker: BrokerHarness
) -> None:
    """etcd takes 128 operations in a transaction: 130 shards in one are refused in one line
    that says what to do, with nothing applied."""
    many = "shards:\n" + "".join(
        f"- id: many-{i:03d}\n  sources:\n  - journal: sums/input\n  max_txn_duration: 1s\n"
        for i in range(130)
    )
    error = one_line_error(await gazctl(consumer, sums_broker, "apply", input=many))
    assert "130 changes" in error and "--max-txn-ops" in error, error
    assert "nothing was applied" in error and "--max-txn-size 64" in error, error
    assert "UNKNOWN" not in error and "aetcd" not in error, error
    listed = await gazctl(consumer, sums_broker, "list", "-o", "json")
    assert listed.code == 0 and listed.out == ""


async def test_list_shows_statuses_replicas_labels_and_lag(
    consumer: Consumer,
    sums_broker: BrokerHarness,
    sums_stub: pb_grpc.JournalStub,
) -> None:
    broker, stub = sums_broker, sums_stub
    applied = await gazctl(consumer, broker, "apply", input=SHARDSPACE)
    assert applied.code == 0, applied
    expected = await publish_inputs(stub, 30, seed=9)
    head = await write_head(stub, INPUT)
    table = None

    async def caught_up() -> bool:
        nonlocal table
        table = await gazctl(consumer, broker, "list", "-p", "-r", "--rf", "-L", "tier", "--lag")
        assert table.code == 0, table
        return table.out.count(f"{INPUT}:0") == 2

    await until(caught_up, "both shards listed with no lag", timeout=30, interval=0.2)
    assert table is not None
    rows = [line.split() for line in table.out.splitlines()]
    assert rows[0] == ["ID", "Status", "RF", "Primary", "Replicas", "tier", "Lag"]
    by_id = {row[0]: row for row in rows[1:]}
    # One consumer process: sum-b's standby cannot be placed, its primary runs all the same.
    assert by_id["sum-a"][1:4] == ["PRIMARY", "1", "consumer-0:PRIMARY"]
    assert by_id["sum-b"][1:4] == ["PRIMARY", "2", "consumer-0:PRIMARY"]
    assert by_id["sum-b"][-2:] == ["gold", f"{INPUT}:0"] and by_id["sum-a"][-2:] == [
        "<none>",
        f"{INPUT}:0",
    ]
    assert head > 0 and sum(expected.values()) > 0


async def test_unassign_restarts_a_failed_shard(
    consumer: Consumer, sums_broker: BrokerHarness, sums_stub: pb_grpc.JournalStub
) -> None:
    broker = sums_broker
    app = consumer.app
    assert isinstance(app, PoisonableSummer)
    app.poisoned = True
    assert (await gazctl(consumer, broker, "apply", input=SHARDSPACE)).code == 0
    await publish_inputs(sums_stub, 5, seed=11)

    async def statuses() -> dict[str, str]:
        table = await gazctl(consumer, broker, "list")
        assert table.code == 0, table
        return {row.split()[0]: row.split()[1] for row in table.out.splitlines()[1:]}

    async def both_failed() -> bool:
        return await statuses() == {"sum-a": "FAILED", "sum-b": "FAILED"}

    await until(both_failed, "both shards FAILED", timeout=30, interval=0.2)
    as_json = await gazctl(consumer, broker, "list", "-o", "json")
    errors = [json.loads(line)["status"][0].get("errors") for line in as_json.out.splitlines()]
    assert all(e and "poisoned: cannot sum this" in e[0] for e in errors), errors

    dry = await gazctl(consumer, broker, "unassign", "-l", "id=sum-a", "--failed", "--dry-run")
    assert dry.code == 0 and dry.out.split() == ["sum-a"], dry
    assert "would be unassigned" in dry.err
    assert (await statuses())["sum-a"] == "FAILED"

    app.poisoned = False  # The cause is gone: unassigning restarts the shard.
    done = await gazctl(consumer, broker, "unassign", "-l", "id=sum-a", "--failed")
    assert done.code == 0 and done.out.split() == ["sum-a"], done

    async def restarted() -> bool:
        return (await statuses())["sum-a"] == "PRIMARY"

    await until(restarted, "sum-a PRIMARY again", timeout=30, interval=0.2)
    assert (await statuses())["sum-b"] == "FAILED"  # Only what the selector named.
    missing = await gazctl(consumer, broker, "unassign")
    assert missing.code == 2 and "--selector" in missing.err


SHARD_EDITOR = """\
import sys, pathlib
path = pathlib.Path(sys.argv[1])
state = pathlib.Path(sys.argv[0] + ".count")
n = int(state.read_text()) if state.exists() else 0
state.write_text(str(n + 1))
text = path.read_text()
if n == 0:
    path.write_text(text.replace("hot_standbys: 1", "hot_standby: 2"))  # a typo first
else:
    path.write_text(text.replace("hot_standby: 2", "hot_standbys: 2"))
"""


async def test_edit_applies_and_reopens_on_error(
    consumer: Consumer, sums_broker: BrokerHarness, tmp_path: Path
) -> None:
    broker = sums_broker
    assert (await gazctl(consumer, broker, "apply", input=SHARDSPACE)).code == 0
    editor = tmp_path / "editor.py"
    editor.write_text(SHARD_EDITOR)
    env = {
        "CONSUMER_ADDRESS": consumer.endpoint,
        "BROKER_ADDRESS": broker.endpoint,
        "GAZ_EDITOR": f"{sys.executable} {editor}",
        "EDITOR": "false",
    }
    r = await asyncio.to_thread(run_cli, "gazctl", "shards", "edit", "-l", "id=sum-b", env=env)
    assert r.code == 0, r.err
    assert int((tmp_path / "editor.py.count").read_text()) == 2
    assert "hot_standby" in r.err  # The error was shown before re-opening.
    lines = (await gazctl(consumer, broker, "list", "-l", "id=sum-b", "-o", "json")).out
    assert json.loads(lines)["spec"]["hot_standbys"] == 2

    nothing = await asyncio.to_thread(
        run_cli, "gazctl", "shards", "edit", "-l", "id=none-such", env={**env, "GAZ_EDITOR": "true"}
    )
    assert "no shards match" in one_line_error(nothing)
    prune = await gazctl(consumer, broker, "prune", "-l", "id=sum-b")  # It has no log.
    assert prune.code == 0 and "removed 0 of 0 fragment(s)" in prune.err, prune


async def test_recover_plays_a_shards_log_into_a_directory(
    consumer: Consumer, sums_broker: BrokerHarness, tmp_path: Path
) -> None:
    """`shards recover` plays the shard's recovery log from its hints (the primary's, else a
    backup's, else the log's start) to the write head; a shard without a log, or unknown, is
    one line."""
    from broker.client.append_service import AppendService
    from broker.client.journals import dial
    from broker.protocol import protocol_pb2_grpc as pb_grpc
    from broker.protocol import recorded_op_pb2 as rpb
    from consumer.recoverylog.fsm import FSM, new_author
    from consumer.recoverylog.recorder import Recorder

    broker = sums_broker
    log = "recovery/logs/sum-r"
    async with broker.client() as client:
        log_spec = spec(log)
        log_spec.labels.Clear()
        log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
        await client.apply([pb.ApplyRequest.Change(upsert=log_spec)])
        await routed(client, log, 1)
    # A log recorded by a primary of the shard before this process hosts it (whose recovery
    # then plays it, hands off, and stores its hints).
    source = tmp_path / "recorded"
    source.mkdir()
    channel = dial(broker.endpoint)
    stub = pb_grpc.JournalStub(channel)  # type: ignore[no-untyped-call]
    async with AppendService(stub) as service:
        recorder = Recorder(log, FSM(rpb.FSMHints(log=log)), new_author(), str(source), service)
        await recorder.start()
        fnode = recorder.record_create(str(source / "data.db"))
        recorder.record_write(fnode, b"checkpointed state", 0)
        dead = recorder.record_create(str(source / "scratch"))
        recorder.record_write(dead, b"x" * 1000, 0)
        recorder.record_remove(str(source / "scratch"))
        await recorder.sync()
    await channel.close()
    shardspace = (
        "shards:\n- id: sum-r\n  sources:\n  - journal: sums/input\n"
        "  recovery_log_prefix: recovery/logs\n  hint_backups: 1\n"
        "  max_txn_duration: 1s\n"
    )
    assert (await gazctl(consumer, broker, "apply", input=shardspace)).code == 0

    out = await gazctl(consumer, broker, "recover", "--id", "sum-r", "--dir", str(tmp_path / "a"))
    assert out.code == 0, out.err
    assert "recovered shard sum-r from recovery/logs/sum-r" in out.err and "1 file(s)" in out.err
    assert (tmp_path / "a" / "data.db").read_bytes() == b"checkpointed state"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["data.db"]

    bad = await gazctl(consumer, broker, "recover", "--id", "nope", "--dir", str(tmp_path / "b"))
    assert "no shard exists with id nope" in one_line_error(bad)
    assert (await gazctl(consumer, broker, "apply", input=one_shard("sums/input"))).code == 0
    bad = await gazctl(consumer, broker, "recover", "--id", "sum-a", "--dir", str(tmp_path / "b"))
    assert "shard sum-a has no recovery log" in one_line_error(bad)
    assert not (tmp_path / "b").exists()


async def test_a_shard_whose_hints_name_another_log_fails_with_the_reason(
    consumer: Consumer, sums_broker: BrokerHarness, etcd_server: EtcdServer
) -> None:
    """Hints in etcd for another log: the primary does not play anything; the shard is FAILED
    with one line saying whose hints they are, and the process serves on."""
    from consumer.recoverylog.hints import encode_hints

    broker = sums_broker
    log = "recovery/logs/sum-h"
    async with broker.client() as client:
        log_spec = spec(log)
        log_spec.labels.Clear()
        log_spec.labels.labels.add(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE)
        await client.apply([pb.ApplyRequest.Change(upsert=log_spec)])
        await routed(client, log, 1)
    wrong = rpb.FSMHints(log="recovery/logs/someone-else")
    async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as etcd:
        await etcd.put(f"{consumer.root}/hints/sum-h.primary".encode(), encode_hints(wrong))
    shardspace = (
        "shards:\n- id: sum-h\n  sources:\n  - journal: sums/input\n"
        "  recovery_log_prefix: recovery/logs\n  max_txn_duration: 1s\n"
    )
    assert (await gazctl(consumer, broker, "apply", input=shardspace)).code == 0
    status: dict[str, Any] = {}

    async def failed() -> bool:
        nonlocal status
        listed = await gazctl(consumer, broker, "list", "-o", "json")
        status = json.loads(listed.out.splitlines()[0])["status"][0] if listed.out else {}
        return status.get("code") == "FAILED"

    await until(failed, "the shard FAILED", timeout=30, interval=0.1)
    (error,) = status["errors"]
    assert "\n" not in error and "someone-else" in error and "recovery/logs/sum-h" in error


@pytest.mark.parametrize(
    "address, needle",
    [
        ("http://localhost:1,http://127.0.0.1:2", "takes IP addresses, and localhost is a name"),
        ("http://127.0.0.1:1,https://127.0.0.1:2", "mixes http:// and https://"),
        ("http://127.0.0.1:1,ftp://127.0.0.1:2", "expected http://HOST:PORT"),
    ],
)
def test_a_bad_list_of_consumer_addresses_is_one_line(address: str, needle: str) -> None:
    r = run_cli("gazctl", "shards", "list", env={"CONSUMER_ADDRESS": address})
    assert needle in one_line_error(r) and "consumer address" in r.err, r.err
