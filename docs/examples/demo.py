"""The demo `nox -s demo` runs: a local cluster, the example journal tree applied and listed,
lines appended to a journal replicated on three brokers and read back, an edit of the listing
applied back, a stale revision refused; then a journal persisted to the file:// store: its
fragments, a suspension that flushes it, every process stopped and started again, and the same
bytes read back; and the cluster stopped (always, even on failure). Between them, the
exactly-once step (`exactly_once.py`): transactions published into a partitioned topic, one
aborted, an append duplicated, and each committed message read once, then the topic replayed by
Spark from its fragments into Parquet (`gazctl spark replay`); and the persisted journal's small
fragments merged by `gazctl spark compact` before the restart. Last, the consumer step
(`word_count_demo.py`): word-count's shards on two consumer processes with PostgreSQL, a text
counted, a query answered, a consumer killed and its shards taken over, the counts unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import word_count_demo  # Beside this file (the script's folder is on sys.path).

HERE = Path(__file__).resolve().parent
GAZCTL = [sys.executable, "-m", "gazctl.cli"]
UP = [
    "dev",
    "up",
    "--brokers",
    "3",
    "--app",
    "word-count",
    "--consumers",
    "2",
    "--postgres",
    "--dir",
]


def gazctl(title: str, *args: str, env: dict[str, str], check: bool = True) -> str:
    """Run one gazctl command as a user would, echoing it and its output."""
    print(f"\n$ gazctl {' '.join(args)}    # {title}", flush=True)
    proc = subprocess.run([*GAZCTL, *args], env=env, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"demo step failed: gazctl {' '.join(args)}")
    return proc.stdout


def exports(up: str) -> dict[str, str]:
    """The variables `gazctl dev up` prints to export (BROKER_ADDRESS, BROKER_FILE_ROOT)."""
    lines = [line.removeprefix("export ") for line in up.splitlines() if line.startswith("export ")]
    return dict(line.split("=", 1) for line in lines)


def append_lines(journal: str, lines: str, env: dict[str, str]) -> None:
    args = ["journals", "append", "-l", f"name={journal}", "--framing", "lines"]
    print(
        f"\n$ printf ... | gazctl {' '.join(args)}    # append {lines.count(chr(10))} lines",
        flush=True,
    )
    # (A journal the allocator is still placing is waited for: `--wait`, 30s by default.)
    proc = subprocess.run([*GAZCTL, *args], env=env, input=lines, text=True, capture_output=True)
    print(proc.stderr, end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo step failed: gazctl {' '.join(args)}")


def main() -> None:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="gazette-demo-") as tmp:
        cluster = str(Path(tmp) / "cluster")
        try:
            up = gazctl("etcd, 3 brokers, PostgreSQL and 2 word-count consumers", *UP, cluster,
                        env=env)  # fmt: skip
            env.update(exports(up))

            # The example tree's file:// store, as the README's `mkdir -p`: its directory must
            # exist (a missing mount is not created). Without it the appends below could not
            # be persisted, and each broker spent its exit retrying until it was SIGKILLed.
            (Path(cluster) / "fragments" / "examples" / "fragments").mkdir(parents=True)
            specs = str(HERE / "journals.yaml")
            gazctl("preview", "journals", "apply", "--specs", specs, "--dry-run", env=env)
            gazctl("apply the example tree", "journals", "apply", "--specs", specs, env=env)
            gazctl(
                "as a table", "journals", "list", "--rf", "--stores", "-L", "content-type", env=env
            )

            # Appends: the allocator assigns each journal to three brokers within moments.
            journal = "examples/bike-share/cycles/part-000"
            lines = "".join(f'{{"ride": {i}, "minutes": {7 * i % 40}}}\n' for i in range(5))
            append_lines(journal, lines, env)
            append_lines(journal, '{"ride": 5, "minutes": 12}\n', env)
            gazctl("read them back", "journals", "read", "-l", f"name={journal}", env=env)
            gazctl(
                "routes: primary and replicas", "journals", "list", "-l", "prefix=examples/bike-share/",
                "-p", "-r", env=env,
            )  # fmt: skip
            listing = gazctl(
                "as a YAML hierarchy", "journals", "list", "-l", "prefix=examples/", "-o", "yaml",
                env=env,
            )  # fmt: skip

            # The listing carries each journal's revision: edit it and apply it back.
            edited = Path(tmp) / "edited.yaml"
            edited.write_text(listing.replace("replication: 1\n", "replication: 2\n"))
            gazctl(
                "apply an edit of the listing", "journals", "apply", "--specs", str(edited), env=env
            )
            gazctl(
                "the same edit again is stale: refused, nothing applied",
                "journals", "apply", "--specs", str(edited), env=env, check=False,
            )  # fmt: skip

            exactly_once(tmp, cluster, env)
            persisted(tmp, cluster, env)
            word_count_demo.run(cluster, env, gazctl)
        finally:
            gazctl("stop every process by pid, and remove the cluster's data", "dev", "down",
                   "--purge", "--dir", cluster, env=env)  # fmt: skip


def exactly_once(tmp: str, cluster: str, env: dict[str, str]) -> None:
    """Transactions into a partitioned topic, one aborted, a retried append: read committed;
    then the same replayed by Spark from the fragment store into Parquet."""
    # A file:// store's directory must exist (as upstream: a missing mount is not created).
    fragments = Path(cluster) / "fragments"
    (fragments / "demo").mkdir(parents=True, exist_ok=True)
    gazctl("a topic of three partitions", "journals", "apply", "--specs",
           str(HERE / "orders.yaml"), env=env)  # fmt: skip
    gazctl("its journals", "journals", "list", "-l", "topic=orders", "-L", "content-type",
           env=env)  # fmt: skip
    script = HERE / "exactly_once.py"
    print(
        f"\n$ python docs/examples/{script.name}    # publish, abort, duplicate, read", flush=True
    )
    # (Until the allocator has placed the new journals, its appends wait and retry.)
    if subprocess.run([sys.executable, str(script)], env=env).returncode != 0:
        raise SystemExit("demo step failed: read committed did not see each message once")

    gazctl("persist the topic: suspending rolls and persists each spool", "journals", "suspend",
           "-l", "topic=orders", "--force", env=env)  # fmt: skip
    parquet = Path(tmp) / "orders.parquet"
    gazctl("Spark reads the store and replays read-committed into Parquet", "spark", "replay",
           "-l", "topic=orders", "--to", f"parquet:{parquet}", "--flatten", "--file-root",
           str(fragments), env=env)  # fmt: skip
    show = HERE / "show_parquet.py"
    print(f"\n$ python docs/examples/{show.name} {parquet.name}    # a few rows", flush=True)
    if subprocess.run([sys.executable, str(show), str(parquet)], env=env).returncode != 0:
        raise SystemExit("demo step failed: the Parquet replay is not what was committed")


def persisted(tmp: str, cluster: str, env: dict[str, str]) -> None:
    """Fragments in a store outlive the brokers: append, flush, compact, restart everything,
    read."""
    specs = str(HERE / "persisted.yaml")
    gazctl("a journal persisted in 1 KiB zstd fragments", "journals", "apply", "--specs", specs,
           env=env)  # fmt: skip
    journal = "demo/persisted/events"
    events = [f'{{"event": {i}, "kind": "{("view", "click", "buy")[i % 3]}"}}\n' for i in range(90)]
    for at in range(0, len(events), 15):
        append_lines(journal, "".join(events[at : at + 15]), env)
    selector = f"name={journal}"
    gazctl("its fragments: persisted, and the one still in the spools", "journals", "fragments",
           "-l", selector, env=env)  # fmt: skip
    gazctl("suspend it: the spool is rolled and persisted, one replica stays", "journals",
           "suspend", "-l", selector, "--force", env=env)  # fmt: skip
    gazctl("every fragment is in the store now", "journals", "fragments", "-l", selector,
           env=env)  # fmt: skip
    root = str(Path(cluster) / "fragments")
    gazctl("Spark merges the small fragments into larger ones", "spark", "compact", "-l",
           selector, "--file-root", root, "--min-age", "0s", "--target-size", "8KiB",
           env=env)  # fmt: skip
    gazctl("fewer, larger fragments, the same offsets", "journals", "fragments", "-l", selector,
           env=env)  # fmt: skip

    gazctl(
        "stop every process (consumers, brokers, PostgreSQL, etcd)",
        "dev",
        "down",
        "--dir",
        cluster,
        env=env,
    )
    up = gazctl("start them again (on the same addresses)", *UP, cluster, env=env)
    env.update(exports(up))
    out = Path(tmp) / "events.ndjson"
    # (A broker that has not yet listed the store waits for that listing before it answers.)
    gazctl("read it back", "journals", "read", "-l", selector, "-o", str(out), env=env)
    same = out.read_text() == "".join(events)
    print(f"\n{len(events)} events, {out.stat().st_size} bytes read back after the restart: "
          f"{'the same bytes' if same else 'DIFFERENT BYTES'}", flush=True)  # fmt: skip
    if not same:
        raise SystemExit("demo step failed: the journal read back differs from what was appended")


if __name__ == "__main__":
    main()
