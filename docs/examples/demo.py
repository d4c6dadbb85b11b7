"""The demo `nox -s demo` runs: a local cluster, the example journal tree applied and listed,
lines appended to a journal replicated on three brokers and read back, an edit of the listing
applied back, a stale revision refused, and the cluster stopped (always, even on failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GAZCTL = [sys.executable, "-m", "gazctl.cli"]


def gazctl(title: str, *args: str, env: dict[str, str], check: bool = True) -> str:
    """Run one gazctl command as a user would, echoing it and its output."""
    print(f"\n$ gazctl {' '.join(args)}    # {title}", flush=True)
    proc = subprocess.run([*GAZCTL, *args], env=env, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"demo step failed: gazctl {' '.join(args)}")
    return proc.stdout


def append_lines(journal: str, lines: str, env: dict[str, str]) -> None:
    args = ["journals", "append", "-l", f"name={journal}", "--framing", "lines"]
    print(
        f"\n$ printf ... | gazctl {' '.join(args)}    # append {lines.count(chr(10))} lines",
        flush=True,
    )
    deadline = time.monotonic() + 30
    while True:
        proc = subprocess.run(
            [*GAZCTL, *args], env=env, input=lines, text=True, capture_output=True
        )
        if proc.returncode == 0:
            print(proc.stderr, end="", flush=True)
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"demo step failed: {proc.stderr.strip()}")
        time.sleep(0.2)  # Not yet assigned: the allocator is placing the journal.


def main() -> None:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="gazette-demo-") as tmp:
        cluster = str(Path(tmp) / "cluster")
        try:
            up = gazctl(
                "etcd + 3 brokers", "dev", "up", "--dir", cluster, "--brokers", "3", env=env
            )
            env["BROKER_ADDRESS"] = up.strip().splitlines()[-1].split("=", 1)[1]

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
        finally:
            gazctl("stop every process by pid", "dev", "down", "--dir", cluster, env=env)


if __name__ == "__main__":
    main()
