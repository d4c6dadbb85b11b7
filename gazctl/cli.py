"""`gazctl`: the operator command line for gazette-py, with upstream gazctl's command tree.

Every user error is one line on stderr and a non-zero exit; tracebacks are for bugs only.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import click
import grpc

from broker import config as cfg
from broker.client import ApplyConflict, BrokerUnavailable
from broker.client.journals import BrokerAddressError
from broker.protocol.labels import SelectorError
from broker.protocol.validate import ValidationError
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


@click.group(cls=GazctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    ctx.default_map = cfg.default_map(cli, ini)


@cli.command("print-config")
@click.pass_context
def print_config(ctx: click.Context) -> None:
    """Print the combined configuration (gazctl.ini, environment, defaults) in INI form."""
    click.echo(cfg.render_ini(cli, ctx.obj or {}), nl=False)


def _register() -> None:
    # Registers journals fragments|prune|store-health|suspend.
    import gazctl.fragments
    import gazctl.journals_io  # noqa: F401  (registers journals append|read|reset-head)
    from gazctl.attach_uuids import attach_uuids
    from gazctl.dev import dev
    from gazctl.journals import journals
    from gazctl.replication import replication
    from gazctl.shards import shards
    from gazctl.spark.cli import spark

    cli.add_command(journals)
    cli.add_command(shards)
    cli.add_command(replication)
    cli.add_command(dev)
    cli.add_command(attach_uuids)
    cli.add_command(spark)


_register()


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck command is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cli(prog_name="gazctl")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
