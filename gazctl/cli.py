"""`gazctl`: the operator command line for gazette-py, with upstream gazctl's command tree.

Every user error is one line on stderr and a non-zero exit; tracebacks are for bugs only.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import click
import grpc

from broker.client import ApplyConflict, BrokerUnavailable
from broker.client.journals import BrokerAddressError
from broker.protocol.labels import SelectorError
from broker.protocol.validate import ValidationError
from plumbing import config as cfg
from spec import SpecError

INI_NAME = "gazctl.ini"
T = TypeVar("T")


class UserError(click.ClickException):
    """A problem with the user's input or environment, reported as one line."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The synchronous edge: run one library coroutine, translating user-facing failures."""
    try:
        return asyncio.run(coro)
    except (
        BrokerUnavailable, BrokerAddressError, ApplyConflict, SelectorError, ValidationError,
        SpecError,
    ) as exc:  # fmt: skip
        raise UserError(str(exc)) from None
    except grpc.aio.AioRpcError as exc:
        detail = (exc.details() or "").split("\n")[0]
        raise UserError(f"broker refused the request ({exc.code().name}): {detail}") from None


class GazctlGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (
            SelectorError, ValidationError, SpecError, BrokerUnavailable, BrokerAddressError,
            ApplyConflict,
        ) as exc:  # fmt: skip
            raise UserError(str(exc)) from None
        except grpc.aio.AioRpcError as exc:
            # A refusal outside `run` (a Spark job's driver, say): one line all the same.
            detail = (exc.details() or "").split("\n")[0]
            raise UserError(f"broker refused the request ({exc.code().name}): {detail}") from None


# The top-level commands, each imported only when used (a gazctl process pays for the modules of
# the command it runs, not for every command's): name -> (modules to import, in order: the
# later ones add sub-commands to the first's group; the attribute that is the command).
_COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    # journals fragments|prune|store-health|suspend and append|read|reset-head join `journals`.
    "journals": (("gazctl.journals", "gazctl.fragments", "gazctl.journals_io"), "journals"),
    "shards": (("gazctl.shards",), "shards"),
    "replication": (("gazctl.replication",), "replication"),
    "dev": (("gazctl.dev",), "dev"),
    "attach-uuids": (("gazctl.attach_uuids",), "attach_uuids"),
    "spark": (("gazctl.spark.cli",), "spark"),
}


class LazyGazctlGroup(GazctlGroup):
    """The root group: its commands are loaded by name, on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *_COMMANDS})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            modules, attribute = _COMMANDS[cmd_name]
            for module in modules:
                importlib.import_module(module)
            self.add_command(getattr(sys.modules[modules[0]], attribute), cmd_name)
        return self.commands.get(cmd_name)

    def load_all(self) -> LazyGazctlGroup:
        """Every command loaded (for what walks the whole tree: print-config, the reference)."""
        for name in _COMMANDS:
            self.get_command(None, name)
        return self


class _Defaults(dict[str, Any]):
    """The root's click default_map, each command's part built from the INI sections when click
    first asks for it (building it needs the command loaded)."""

    def __init__(self, ini: dict[str, dict[str, str]]) -> None:
        super().__init__(cfg.default_map(cli, ini))
        self.ini = ini

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self and key in _COMMANDS:
            command = cli.get_command(None, key)
            assert command is not None
            nested = cfg.default_map(command, self.ini, (key,))
            if nested:
                self[key] = nested
        return super().get(key, default)


@click.group(cls=LazyGazctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gazette-py", prog_name="gazctl", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """gazctl is a tool for interacting with Gazette brokers and consumer applications.

    A gazctl that seems stuck prints every thread's stack to stderr on `kill -USR1 PID`.
    """
    try:
        _path, ini = cfg.load_ini(INI_NAME)
    except cfg.ConfigFileError as exc:
        raise UserError(str(exc)) from None
    ctx.obj = ini
    ctx.default_map = _Defaults(ini)


@cli.command("print-config")
@click.pass_context
def print_config(ctx: click.Context) -> None:
    """Print the combined configuration (gazctl.ini, environment, defaults) in INI form."""
    click.echo(cfg.render_ini(cli.load_all(), ctx.obj or {}), nl=False)


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck command is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cli(prog_name="gazctl")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
