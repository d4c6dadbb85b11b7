"""The demo `nox -s demo` runs: a local cluster, the example journal tree applied, listed as a
table and as YAML, an edit of the listing applied back, a stale revision refused, and the cluster
stopped (always, even when a step fails)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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
