"""The release artifacts: an sdist and a wheel built from the project's files (`uv build`, as
`python -m build` would), the wheel installed into a fresh virtualenv, not editable, and run
from outside the source tree: every command and example a user reaches is there, generated code
and data files included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _project_version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel, the wheel built from the sdist (as `uv build` does)."""
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("source")
    # The project's tracked files only (a checkout's untracked files are not the release).
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        path = Path(os.fsdecode(name))
        if (ROOT / path).is_file():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    subprocess.run(
        [sys.executable, "-m", "uv", "build", "--quiet", "--out-dir", str(out), str(source)],
        check=True, timeout=600,
    )  # fmt: skip
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def test_the_sdist_holds_every_package_and_what_the_suite_needs(built: tuple[Path, Path]) -> None:
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        top = {Path(name).parts[1] for name in archive.getnames() if len(Path(name).parts) > 1}
    for part in (
        "broker",
        "plumbing",
        "consumer",
        "gazctl",
        "replication",
        "spec",
        "tests",
        "docs",
    ):
        assert part in top, f"the sdist lacks {part}/"
    assert {"CHANGELOG.md", "README.md", "noxfile.py", "pyproject.toml"} <= top


def test_the_wheel_installed_in_a_fresh_venv_runs_every_command(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for needed in (
        "replication/location_pb2.py",
        "broker/protocol/protocol_pb2.py",
        "consumer/examples/word_count_pb2.py",
        "gazctl/spark/log4j2.properties",
    ):
        assert needed in names, f"the wheel lacks {needed}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "uv", "venv", "--quiet", "--python", sys.executable,
                    str(venv)], check=True, timeout=300)  # fmt: skip
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", str(python),
               f"{wheel}[sqlite]"]  # fmt: skip
    # From uv's cache alone when it holds every dependency, as the noxfile installs: PyPI has
    # pyspark as a source distribution only, which uv otherwise builds again (20 s of CPU).
    offline = subprocess.run([*install, "--offline"], capture_output=True, timeout=600)
    if offline.returncode != 0:
        subprocess.run(install, check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    def run(*argv: str) -> str:
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
        return done.stdout

    version = _project_version()
    assert run("gazette", "--version").strip() == f"gazette {version}"
    assert run("gazctl", "--version").strip() == f"gazctl {version}"
    # Imported from the venv, not the source tree.
    where = run(str(python), "-c", "import broker; print(broker.__file__)")
    assert str(venv) in where
    for argv in (
        ("gazette", "serve", "--help"),
        ("gazctl", "journals", "append", "--help"),
        ("gazctl", "shards", "list", "--help"),
        ("gazctl", "replication", "topology", "--help"),
        ("gazctl", "spark", "--help"),
        ("gazctl", "dev", "up", "--help"),
        (str(python), "-m", "replication", "--help"),
        (str(python), "-m", "consumer.examples.word_count", "--help"),
        (str(python), "-m", "consumer.examples.stream_sum", "--help"),
    ):
        assert "Usage:" in run(*argv), argv
    # Generated code imports (the protocol stubs, the word-count service).
    run(str(python), "-c", "import replication.location_pb2_grpc, consumer.examples.word_count")
