"""The demo `nox -s demo` runs: a local cluster, the example journal tree applied, listed as a
table and as YAML, and the cluster stopped (always, even when a step fails)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GAZCTL = [sys.executable, "-m", "gazctl.cli"]


def step(title: str, *args: str, env: dict[str, str] | None = None) -> None:
    print(f"\n$ gazctl {' '.join(args)}    # {title}", flush=True)
    subprocess.run([*GAZCTL, *args], check=True, env=env)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gazette-demo-") as tmp:
        cluster = str(Path(tmp) / "cluster")
        env = dict(os.environ)
        try:
            up = subprocess.run(
                [*GAZCTL, "dev", "up", "--dir", cluster, "--brokers", "3"],
                check=True, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            print(up.stdout, end="")
            address = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
            env["BROKER_ADDRESS"] = address
            specs = str(HERE / "journals.yaml")
            step("preview the change", "journals", "apply", "--specs", specs, "--dry-run", env=env)
            step("apply the example tree", "journals", "apply", "--specs", specs, env=env)
            step(
                "list as a table",
                "journals",
                "list",
                "--rf",
                "--stores",
                "-L",
                "content-type",
                env=env,
            )
            step(
                "list as a YAML hierarchy",
                "journals",
                "list",
                "-l",
                "prefix=examples/",
                "-o",
                "yaml",
                env=env,
            )
            step(
                "re-applying is a no-op",
                "journals",
                "apply",
                "--specs",
                specs,
                "--dry-run",
                env=env,
            )
        finally:
            step("stop the cluster", "dev", "down", "--dir", cluster)


if __name__ == "__main__":
    main()
