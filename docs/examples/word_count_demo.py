"""The consumer step of the demo: word-count's shards applied and listed, a text's n-grams
published and counted exactly, a query answered by the shard that owns its n-grams, then a
consumer process SIGKILLed and its shards taken over by the other with every count unchanged."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from consumer.examples.word_count import matches, ngrams_of
from gazctl.dev import ClusterState

HERE = Path(__file__).resolve().parent
WORD_COUNT = [sys.executable, "-m", "consumer.examples.word_count"]


def word_count(title: str, *args: str, env: dict[str, str], input: str | None = None) -> str:
    """Run the example's command line as a user would, echoing it and its output."""
    print(f"\n$ python -m consumer.examples.word_count {' '.join(args)}    # {title}", flush=True)
    proc = subprocess.run(
        [*WORD_COUNT, *args], env=env, input=input, stdout=subprocess.PIPE, text=True
    )
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo step failed: word_count {' '.join(args)}")
    return proc.stdout


def query_counts(prefix: str, env: dict[str, str]) -> dict[str, int]:
    """The committed counts a query answers (quietly, for the checks)."""
    proc = subprocess.run(
        [*WORD_COUNT, "query", prefix, "--limit", "0"], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {}
    rows = [line.split(None, 1) for line in proc.stdout.splitlines()[1:]]
    return {gram: int(count) for count, gram in rows}


def wait_exact(prefix: str, expected: collections.Counter[str], env: dict[str, str]) -> None:
    want = {g: c for g, c in expected.items() if matches(g, prefix)}
    deadline = time.monotonic() + 60
    while (got := query_counts(prefix, env)) != want:
        if time.monotonic() > deadline:
            raise SystemExit(f"demo step failed: counts of {prefix!r} are {got}, not {want}")
        time.sleep(0.2)


def run(cluster: str, env: dict[str, str], gazctl: Callable[..., str]) -> None:
    word_count("a deltas journal and a shard for each of 4 partitions", "setup", "--partitions",
               "4", env=env)  # fmt: skip
    gazctl("the shards, on two consumer processes", "shards", "list", "-p", "-r", env=env)
    text = (HERE / "words.txt").read_text()
    word_count("publish a text's n-grams (deltas, committed)", "publish", env=env, input=text)
    expected: collections.Counter[str] = collections.Counter()
    for paragraph in text.split("\n\n"):
        expected.update(ngrams_of(paragraph, 2))
    for prefix in ("the", "river", "stone"):
        wait_exact(prefix, expected, env)
    gazctl("every delta read: no lag", "shards", "list", "--lag", env=env)
    word_count("counts of 'the ...', from the shard that owns them", "query", "the", "--limit",
               "8", env=env)  # fmt: skip

    state = ClusterState.load(Path(cluster))
    assert state is not None and len(state.consumers) == 2
    victim = state.consumers[1]
    print(f"\n$ kill -KILL {victim.pid}    # {victim.role} dies mid-stream", flush=True)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # Its lease expires; the allocator moves its shards to consumer-0.
        listed = subprocess.run(
            [sys.executable, "-m", "gazctl.cli", "shards", "list", "-p"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if listed.returncode == 0 and listed.stdout.count("consumer-0") >= 4:
            break
        if time.monotonic() > deadline:
            raise SystemExit("demo step failed: consumer-1's shards were not taken over")
        time.sleep(0.5)
    gazctl("every shard's primary is now consumer-0", "shards", "list", "-p", env=env)
    for prefix in ("the", "river", "stone", "mill", "water"):
        wait_exact(prefix, expected, env)
    word_count("the same counts, after the take-over", "query", "the", "--limit", "8", env=env)
    print(f"\n{sum(expected.values())} n-gram occurrences counted, each exactly once, across "
          "the take-over", flush=True)  # fmt: skip
