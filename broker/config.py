"""One source of truth per setting: a flag, its environment variable and its INI key.

Options are named as upstream (`--broker.zone`, `$BROKER_ZONE`); the INI file (`gazette.ini` for
the broker, `gazctl.ini` for the CLI) is searched in `.`, `~/.config/gazette/` and
`$APPLICATION_CONFIG_ROOT`, with a `[broker]` section holding `zone = ...`. Precedence is flag,
then environment, then INI file, then default.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def option(flag: str, *, env: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """A click option named after an upstream dotted flag, bound to its environment variable."""
    dest = flag.lstrip("-").replace(".", "_").replace("-", "_")
    if env is None:
        env = dest.upper()
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", "default" in kwargs)
    return click.option(flag, dest, envvar=env, **kwargs)


def ini_search_paths(name: str) -> list[Path]:
    roots = [Path(".")]
    for var in ("HOME", "UserProfile"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]) / ".config" / "gazette")
    if os.environ.get("APPLICATION_CONFIG_ROOT"):
        roots.append(Path(os.environ["APPLICATION_CONFIG_ROOT"]))
    return [root / name for root in roots]


class ConfigFileError(click.ClickException):
    pass


def load_ini(name: str) -> tuple[Path | None, dict[str, dict[str, str]]]:
    """The first INI file found, as {section: {key: value}} with lower-cased names."""
    for path in ini_search_paths(name):
        if not path.is_file():
            continue
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as exc:
            message = str(exc).splitlines()[0]
            raise ConfigFileError(f"config file {path}: {message}") from exc
        sections = {
            section.lower(): {k.lower(): v for k, v in parser.items(section)}
            for section in parser.sections()
        }
        return path, sections
    return None, {}


def _dotted(param: click.Parameter) -> tuple[str, str] | None:
    for opt in param.opts:
        if opt.startswith("--") and "." in opt:
            section, _, key = opt[2:].partition(".")
            return section.lower(), key.lower()
    return None


def default_map(
    command: click.Command, ini: dict[str, dict[str, str]], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A click default_map for `command` and its sub-commands from INI sections. A section may
    be scoped to a command path (`[journals.broker]`), which wins over the plain `[broker]`."""
    out: dict[str, Any] = {}
    for param in command.params:
        dotted = _dotted(param)
        if dotted is None or param.name is None:
            continue
        section, key = dotted
        # The most specific scope wins: [journals.list.broker], [journals.broker], [broker].
        scopes = [".".join((*path[:n], section)) for n in range(len(path), -1, -1)]
        for scope in scopes:
            if key in ini.get(scope, {}):
                out[param.name] = ini[scope][key]
                break
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            nested = default_map(sub, ini, (*path, name))
            if nested:
                out[name] = nested
    return out


def iter_dotted_options(command: click.Command) -> Iterator[tuple[str, str, click.Option]]:
    seen: set[tuple[str, str]] = set()
    stack = [command]
    while stack:
        cmd = stack.pop(0)
        for param in cmd.params:
            dotted = _dotted(param)
            if dotted and dotted not in seen and isinstance(param, click.Option):
                seen.add(dotted)
                yield dotted[0], dotted[1], param
        if isinstance(cmd, click.Group):
            stack.extend(cmd.commands.values())


def render_ini(command: click.Command, ini: dict[str, dict[str, str]]) -> str:
    """The combined configuration (environment, then INI, then defaults) in INI form."""
    sections: dict[str, list[str]] = {}
    for section, key, param in sorted(iter_dotted_options(command), key=lambda t: (t[0], t[1])):
        envvar = param.envvar if isinstance(param.envvar, str) else None
        if envvar and envvar in os.environ:
            value: Any = os.environ[envvar]
        elif key in ini.get(section, {}):
            value = ini[section][key]
        else:
            value = param.default() if callable(param.default) else param.default
        if value is None:
            value = ""
        elif isinstance(value, bool):
            value = "true" if value else "false"
        comment = f"; {param.help}" if param.help else ""
        lines = sections.setdefault(section, [])
        if comment:
            lines.append(comment)
        lines.append(f"{key} = {value}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


LOG_LEVELS = ["trace", "debug", "info", "warn", "error", "fatal"]
LOG_FORMATS = ["json", "text", "color"]


def log_options(f: F) -> F:
    """`--log.level` and `--log.format`, as upstream's servers take them."""
    f = option("--log.format", default="text", type=click.Choice(LOG_FORMATS), help="Logging output format")(f)  # fmt: skip
    return option("--log.level", default="info", type=click.Choice(LOG_LEVELS), help="Logging level")(f)  # fmt: skip


def setup_logging(level: str, fmt: str) -> None:
    """Logging as `--log.level` and `--log.format` ask, on stderr (servers and consumers)."""
    import logging
    import sys

    levels = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
              "warn": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}  # fmt: skip
    if fmt == "json":
        format_ = (
            '{"time":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}'
        )
    else:
        format_ = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=levels[level], format=format_, stream=sys.stderr)
