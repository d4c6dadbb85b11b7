"""word-count with real processes: a broker (`gazette serve`), word-count consumer processes
(`python -m consumer.examples.word_count serve`) on JSON-file stores or on a real PostgreSQL,
texts published through the NGram service's Publish, and queries answered by the shard that owns
the n-grams, proxied there by whichever process took them; a process SIGKILLed, its shards taken
over with every count unchanged."""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest

from consumer.examples import word_count_pb2 as wpb
from consumer.examples import word_count_pb2_grpc as wpb_grpc
from consumer.examples.word_count import matches, ngrams_of, partition_of, words_of
from consumer.testing import ConsumerProcesses, ConsumerProcessesFactory
from tests.conftest import BrokerProcess, run_cli
from tests.helpers.waiting import until_blocking

EXAMPLE = [sys.executable, "-m", "consumer.examples.word_count"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "It's the fox's den, said the dog. THE END of the story, or the end of the fox?",
    "A dog and a fox and a cat: the cat watches the quick dog and the lazy fox.",
]


def test_ngrams_of_a_text() -> None:
    assert words_of("It's THE fox's den, 2 dogs_x!") == [
        "it's",
        "the",
        "fox's",
        "den",
        "2",
        "dogs",
        "x",
    ]
    counts = ngrams_of("the dog and the dog", 2)
    assert counts == {"the": 2, "dog": 2, "and": 1, "the dog": 2, "dog and": 1, "and the": 1}
    assert ngrams_of("", 2) == {}
    assert matches("the dog", "the") and matches("the", "the")
    assert not matches("there", "the") and not matches("a the", "the")
    # Every n-gram goes where its first word goes: a prefix of whole words finds them together.
    for gram in ("the", "the dog", "the end"):
        assert partition_of(gram, 7) == partition_of("the", 7)


def expected_counts(texts: list[str], n: int = 2) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for text in texts:
        out.update(ngrams_of(text, n))
    return out


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXAMPLE, *args], capture_output=True, text=True, timeout=timeout)


def query(address: str, prefix: str) -> wpb.QueryResponse:
    with grpc.insecure_channel(address.removeprefix("http://")) as channel:
        stub = wpb_grpc.NGramStub(channel)  # type: ignore[no-untyped-call]
        answer: wpb.QueryResponse = stub.Query(wpb.QueryRequest(prefix=prefix), timeout=30)
        return answer


def publish(address: str, text: str) -> int:
    with grpc.insecure_channel(address.removeprefix("http://")) as channel:
        stub = wpb_grpc.NGramStub(channel)  # type: ignore[no-untyped-call]
        return int(stub.Publish(wpb.PublishRequest(text=text), timeout=30).n_grams)


def wait_counts(
    address: str, prefix: str, expected: collections.Counter[str], timeout: float = 60
) -> wpb.QueryResponse:
    """Query until the committed counts of `prefix` are the expected ones (the shards commit
    after Publish returns); fail with the last answer."""
    want = {g: c for g, c in expected.items() if matches(g, prefix)}
    answer, got = wpb.QueryResponse(), dict[str, int]()

    def committed() -> bool:
        nonlocal answer, got
        try:
            answer = query(address, prefix)
            got = {g.n_gram: g.count for g in answer.grams}
        except grpc.RpcError as exc:  # A shard moving between processes: UNAVAILABLE.
            got = {"error": exc.code().name}  # type: ignore[dict-item]
        return got == want

    with contextlib.suppress(AssertionError):  # Late, the assertion below shows the answer.
        until_blocking(committed, f"the committed counts of {prefix!r}", timeout, 0.1)
    assert got == want, f"{prefix!r}: {got} != {want}"
    return answer


@pytest.fixture
def json_counters(
    gazette_consumer_processes: ConsumerProcessesFactory, tmp_path: Path
) -> ConsumerProcesses:
    """word-count processes (the test kit's, stopped by pid as the test ends) dialling the
    module's broker process, their counts in JSON files under the test's folder."""
    (tmp_path / "stores").mkdir()
    return gazette_consumer_processes(
        command=EXAMPLE, args=["--wordcount.store-root", str(tmp_path / "stores")]
    )


@pytest.fixture
def sql_counters(
    gazette_consumer_processes: ConsumerProcessesFactory, postgres_dsn: str
) -> ConsumerProcesses:
    """word-count processes with their counts in the session's PostgreSQL."""
    return gazette_consumer_processes(command=EXAMPLE, args=["--wordcount.postgres", postgres_dsn])


def set_up(group: ConsumerProcesses, broker: BrokerProcess, ids: list[str]) -> None:
    for consumer_id in ids:
        group.start(consumer_id)
    setup = run(
        "setup", "--partitions", "4", "--broker.address", broker.address,
        "--consumer.address", group.address(ids[0]),
        "--deltas", f"test/word-count/{uuid.uuid4().hex[:8]}/",
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr
    assert "4 journal(s) and 4 shard(s) created" in setup.stdout


@pytest.mark.slow
def test_counts_are_queried_where_they_live_and_survive_a_kill(
    json_counters: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    ids = ["counter-a", "counter-b"]
    set_up(json_counters, broker_process, ids)
    a, b = (json_counters.address(i) for i in ids)
    published = sum(publish(a if i % 2 else b, text) for i, text in enumerate(TEXTS))
    expected = expected_counts(TEXTS)
    assert published == sum(len(ngrams_of(t, 2)) for t in TEXTS)

    # Each process answers every prefix: its own shards' from its store, the others' proxied.
    answered_by = set()
    for prefix in ("the", "fox", "dog", "a", "it's", "quick brown"):
        for address in (a, b):
            answer = wait_counts(address, prefix, expected)
            answered_by.add(answer.header.process_id.suffix)
            assert answer.shard.startswith("word-count-")
    assert answered_by == set(ids), "every query was answered by one process: nothing proxied"

    # The CLI: one query, with its rows.
    out = run("query", "the", "--consumer.address", b)
    assert out.returncode == 0, out.stderr
    assert f"{expected['the']:>8}  the" in out.stdout
    assert f"{expected['the fox']:>8}  the fox" in out.stdout
    bad = run("query", "  ...  ", "--consumer.address", b)
    assert bad.returncode != 0 and "holds no word" in bad.stderr
    assert "Traceback" not in bad.stderr

    # counter-a dies; counter-b takes its shards over from their stores: counts unchanged,
    # and what is published afterwards adds to them once.
    json_counters.kill("counter-a")
    for prefix in ("the", "fox", "dog", "a"):
        wait_counts(b, prefix, expected)
    more = "the end of the fox and the dog"
    publish(b, more)
    expected.update(ngrams_of(more, 2))
    for prefix in ("the", "fox", "dog", "end"):
        wait_counts(b, prefix, expected)


@pytest.mark.slow
def test_counts_in_postgresql_are_exact_across_a_graceful_hand_off(
    sql_counters: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    ids = ["sql-counter-a", "sql-counter-b"]
    set_up(sql_counters, broker_process, ids)
    a, b = (sql_counters.address(i) for i in ids)
    publish_out = subprocess.run(
        [*EXAMPLE, "publish", "--consumer.address", a],
        input="\n\n".join(TEXTS), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert publish_out.returncode == 0, publish_out.stderr
    assert "of 3 paragraph(s)" in publish_out.stdout
    expected = expected_counts(TEXTS)
    for prefix in ("the", "fox", "dog"):
        wait_counts(b, prefix, expected)
    assert sql_counters.stop("sql-counter-a") == 0  # Graceful: its shards are handed over.
    for prefix in ("the", "fox", "dog", "a"):
        wait_counts(b, prefix, expected)
    publish(b, TEXTS[0])
    expected.update(ngrams_of(TEXTS[0], 2))
    for prefix in ("the", "fox", "dog"):
        wait_counts(b, prefix, expected)


@pytest.mark.slow
def test_counts_on_recorded_sqlite_survive_a_kill_through_a_hot_standby(
    json_counters: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    group = json_counters
    ids = ["sqlite-counter-a", "sqlite-counter-b"]
    for consumer_id in ids:
        group.start(consumer_id)
    run_id = uuid.uuid4().hex[:8]
    setup = run(
        "setup", "--partitions", "2", "--store", "sqlite", "--hot-standbys", "1",
        "--broker.address", broker_process.address, "--consumer.address", group.address(ids[0]),
        "--deltas", f"test/word-count-sqlite/{run_id}/deltas/",
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr
    assert "4 journal(s) and 2 shard(s) created" in setup.stdout  # Deltas and recovery logs.
    a, b = (group.address(i) for i in ids)
    for text in TEXTS:
        publish(a, text)
    expected = expected_counts(TEXTS)
    for prefix in ("the", "fox", "dog"):
        wait_counts(b, prefix, expected)
    from tests.helpers.consumers import primaries, standbys_tail

    until_blocking(lambda: standbys_tail(group, 2), "the standbys tail their logs")

    assert "sqlite-counter-a" in primaries(group, ids), "a hosts no primary to take over"
    group.kill("sqlite-counter-a")
    for prefix in ("the", "fox", "dog", "a"):
        wait_counts(b, prefix, expected)
    publish(b, TEXTS[1])
    expected.update(ngrams_of(TEXTS[1], 2))
    for prefix in ("the", "fox"):
        wait_counts(b, prefix, expected)
    assert "its standby takes over the log it tails" in group.log("sqlite-counter-b")

    # counter-a comes back as the standby of both shards; then counter-b exits gracefully:
    # the allocator waits for the standbys to tail, and counter-a takes over by a hand-off.
    group.start("sqlite-counter-a")

    def standbys_on_a() -> bool:
        import grpc as grpc_

        from broker.protocol import consumer_pb2_grpc as cpb_grpc
        from consumer.protocol import cpb

        with grpc_.insecure_channel(b.removeprefix("http://")) as channel:
            listed = cpb_grpc.ShardStub(channel).List(cpb.ListRequest(), timeout=5)  # type: ignore[no-untyped-call]
        return all(
            any(
                m.suffix == "sqlite-counter-a" and st.code == cpb.ReplicaStatus.STANDBY
                for m, st in zip(shard.route.members, shard.status, strict=True)
            )
            for shard in listed.shards
        )

    until_blocking(standbys_on_a, "counter-a the standbys", 60, 0.2)
    assert group.stop("sqlite-counter-b") == 0
    a = group.address("sqlite-counter-a")
    for prefix in ("the", "fox", "dog"):
        wait_counts(a, prefix, expected)
    assert group.log("sqlite-counter-a").count("its standby takes over the log it tails") == 2


@pytest.mark.slow
def test_gazctl_reaches_any_live_consumer_and_marks_a_dead_primary(
    json_counters: ConsumerProcesses, broker_process: BrokerProcess
) -> None:
    """CONSUMER_ADDRESS lists every consumer (as `gazctl dev up` exports it): with the first
    SIGKILLed, gazctl reaches the next; `shards list --lag` marks the shards whose primary is
    the dead process, within its lease, rather than failing; a graceful stop logs no traceback."""
    group = json_counters
    ids = ["lag-counter-a", "lag-counter-b"]
    for consumer_id in ids:
        group.start(consumer_id, lease="20s")  # counter-a's shards stay its own once it dies.
    a, b = (group.address(i) for i in ids)
    setup = run(
        "setup", "--partitions", "4", "--broker.address", broker_process.address,
        "--consumer.address", f"{a},{b}", "--deltas", f"test/word-count-lag/{uuid.uuid4().hex[:8]}/",
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr
    publish(b, TEXTS[0])
    wait_counts(b, "the", expected_counts(TEXTS[:1]))
    env = {"CONSUMER_ADDRESS": f"{a},{b}", "BROKER_ADDRESS": broker_process.address}
    listed = run_cli("gazctl", "shards", "list", "-p", "--lag", env=env)
    assert listed.code == 0 and listed.out.count(":PRIMARY") == 4, listed.err
    from tests.helpers.consumers import primaries

    assert ids[0] in primaries(group, ids), "counter-a hosts no primary"

    group.kill(ids[0])
    listed = run_cli("gazctl", "shards", "list", "-p", "--lag", env=env)
    assert listed.code == 0, listed.err
    rows = [line.split() for line in listed.out.splitlines()[1:]]
    assert rows and all(len(row) >= 4 for row in rows), listed.out
    dead = [row for row in rows if row[2] == f"{ids[0]}:PRIMARY"]
    assert dead, listed.out
    for row in dead:
        assert " ".join(row[3:]) == f"<{ids[0]} unreachable>", listed.out
    for row in rows:
        if row not in dead:
            assert row[3].startswith("test/word-count-lag/"), listed.out

    assert group.stop(ids[1]) == 0
    log = group.log(ids[1])
    assert "Traceback" not in log and "AioRpcError" not in log, log[-3000:]
    continued = [line for line in log.splitlines() if line and not line[:4].isdigit()]
    assert not continued, continued[:5]  # Each record one line, timestamped.
