"""The deployment examples (deploy/, docs/deployment.md) name only real flags, environment
variables and INI keys: the INI files are read by the real commands' print-config, the systemd
units parse and their ExecStart flags are options of the command they run, and the environment
file sets only variables the consumer reads."""

from __future__ import annotations

import configparser
import os
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from broker.main import cli as gazette_cli
from consumer.examples.word_count import cli as word_count_cli
from gazctl.cli import cli as gazctl_cli
from plumbing import config as cfg

gazctl_cli.load_all()  # Its sub-commands load lazily.

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def dotted_keys(command: click.Command) -> set[tuple[str, str]]:
    return {(section, key) for section, key, _ in cfg.iter_dotted_options(command)}


def ini_entries(path: Path) -> list[tuple[str, str, str]]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(path.read_text())
    return [(s, k, v) for s in parser.sections() for k, v in parser.items(s)]


def print_config(module: str, env: dict[str, str], cwd: Path) -> str:
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    for name in list(full_env):
        if name.startswith(("BROKER_", "CONSUMER_", "ETCD_", "LOG_")):
            del full_env[name]  # Only the file under test configures the command.
    done = subprocess.run(
        [sys.executable, "-m", module, "print-config"],
        env=full_env, cwd=cwd, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def assert_printed(printed: str, entries: list[tuple[str, str, str]]) -> None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(printed)
    for section, key, value in entries:
        assert parser.get(section, key) == value, f"[{section}] {key}"


def test_the_broker_ini_names_real_options_and_gazette_reads_it(tmp_path: Path) -> None:
    entries = ini_entries(DEPLOY / "gazette.ini")
    unknown = {(s, k) for s, k, _ in entries} - dotted_keys(gazette_cli)
    assert not unknown, f"not options of gazette serve: {sorted(unknown)}"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "gazette.ini").write_text((DEPLOY / "gazette.ini").read_text())
    printed = print_config(
        "broker.main",
        {"APPLICATION_CONFIG_ROOT": str(tmp_path / "etc"), "HOME": str(tmp_path)},
        tmp_path,
    )
    assert_printed(printed, entries)


def test_the_gazctl_ini_names_real_options_and_gazctl_reads_it(tmp_path: Path) -> None:
    entries = ini_entries(DEPLOY / "gazctl.ini")
    unknown = {(s, k) for s, k, _ in entries} - dotted_keys(gazctl_cli)
    assert not unknown, f"not options of gazctl: {sorted(unknown)}"
    home = tmp_path / "home"
    (home / ".config" / "gazette").mkdir(parents=True)
    (home / ".config" / "gazette" / "gazctl.ini").write_text((DEPLOY / "gazctl.ini").read_text())
    printed = print_config("gazctl.cli", {"HOME": str(home)}, tmp_path)
    assert_printed(printed, entries)


@pytest.mark.parametrize(
    ("unit", "command"),
    [
        ("gazette-broker.service", gazette_cli.commands["serve"]),
        ("word-count.service", word_count_cli.commands["serve"]),
    ],
)
def test_units_parse_and_run_real_commands_with_real_flags(
    unit: str, command: click.Command
) -> None:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((DEPLOY / unit).read_text())
    assert {"Unit", "Service", "Install"} <= set(parser.sections())
    argv = shlex.split(parser.get("Service", "ExecStart"))
    assert "serve" in argv, "the unit runs a server"
    flags = [a for a in argv[argv.index("serve") + 1 :] if a.startswith("--")]
    known = {opt for param in command.params for opt in param.opts}
    assert flags and set(flags) <= known, f"not flags of serve: {set(flags) - known}"
    if unit == "word-count.service":
        assert argv[1:4] == ["-m", "consumer.examples.word_count", "serve"]
        env_file = parser.get("Service", "EnvironmentFile").rsplit("/", 1)[1]
        names = {
            line.split("=", 1)[0]
            for line in (DEPLOY / env_file).read_text().splitlines()
            if line and not line.startswith("#")
        }
        envvars = {p.envvar for p in command.params if isinstance(p.envvar, str)}
        assert names <= envvars, f"not read by word-count serve: {names - envvars}"
    else:
        assert Path(argv[0]).name == "gazette"
        assert parser.get("Service", "Environment") == "APPLICATION_CONFIG_ROOT=/etc/gazette"


def test_the_deployment_guide_names_real_flags() -> None:
    """Every `--section.name` flag the guide writes is an option of gazette, gazctl or a
    consumer application's serve."""
    import re

    text = (ROOT / "docs" / "deployment.md").read_text()
    known = {
        opt
        for command in (
            gazette_cli.commands["serve"],
            word_count_cli.commands["serve"],
            *cfg_commands(gazctl_cli),
        )
        for param in command.params
        for opt in param.opts
    }
    named = set(re.findall(r"--(?:broker|consumer|etcd|log|debug|wordcount)\.[a-z.-]+[a-z]", text))
    assert named, "the guide names flags"
    assert named <= known, f"not flags of any command: {sorted(named - known)}"


def cfg_commands(group: click.Command) -> list[click.Command]:
    out = [group]
    if isinstance(group, click.Group):
        for sub in group.commands.values():
            out.extend(cfg_commands(sub))
    return out
