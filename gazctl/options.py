"""The options and option groups gazctl's commands share, and the helpers that go with them.

- `broker_options` (`--broker.address` and the rest of upstream's Broker group, with the
  client's TLS and token flags) and `consumer_options` (`--consumer.address` before the same);
- `file_root_option` (`--file-root`, as brokers' `--broker.file-root`), `wait_option`
  (`--wait`), `max_txn_size_option` (`--max-txn-size`);
- `parse_selector` (`-l`/`--selector`), `client_of` (a JournalsClient of `--broker.address`),
  `read_specs` (`--specs`, a path or - for stdin);
- `conflict_error` and `too_large_error`: the one line of an apply that etcd refused.

Commands import these from here; a command group's own module (`journals.py`, `shards.py`, ...)
holds its commands only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from broker.client import ApplyConflict, ApplyTooLarge, JournalsClient
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from plumbing import config as cfg

F = TypeVar("F", bound=Callable[..., Any])


def _broker_group() -> list[Callable[[F], F]]:
    """Upstream gazctl's Broker option group (and its logging flags), in their help order."""
    return [
        cfg.option("--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"),
        cfg.option("--broker.cache.size", default=0, type=int, help="Size of client route cache (0 disables it: the broker proxies)"),
        cfg.option("--broker.cache.ttl", default="1m", help="Time-to-live of route cache entries"),
        cfg.option("--zone", env="ZONE", default="local", help="Availability zone within which this process is running"),
        cfg.option("--log.level", default="warn", type=click.Choice(["trace", "debug", "info", "warn", "error", "fatal"]), help="Logging level"),
        cfg.option("--log.format", default="text", type=click.Choice(["json", "text", "color"]), help="Logging output format"),
    ]  # fmt: skip


def broker_options(f: F) -> F:
    """The Broker option group of upstream gazctl's `journals` commands."""
    for decorator in reversed(_broker_group()):
        f = decorator(f)
    return cfg.client_credentials("broker")(cfg.logging_from_options(f))


def consumer_options(f: F) -> F:
    """The Consumer and Broker option groups of upstream gazctl's `shards` commands."""
    for decorator in reversed(
        [
            cfg.option("--consumer.address", default="http://localhost:8080", help="Service address of a Gazette consumer"),
            *_broker_group(),
        ]
    ):  # fmt: skip
        f = decorator(f)
    return cfg.client_credentials("consumer", "broker")(cfg.logging_from_options(f))


def file_root_option(help_: str) -> Callable[[F], F]:
    """--file-root: the directory that roots file:// fragment stores, as brokers' own
    --broker.file-root, and read from the same environment variable ($BROKER_FILE_ROOT, which
    `gazctl dev up` prints)."""
    return click.option(
        "--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
        envvar="BROKER_FILE_ROOT", show_envvar=True, help=help_,
    )  # fmt: skip


def _wait_seconds(_ctx: click.Context, _param: click.Parameter, value: str) -> float:
    from spec.durations import DurationError, parse_go_duration

    try:
        seconds = parse_go_duration(str(value)) / 1e9
    except DurationError as exc:
        raise click.BadParameter(f"{exc} (a duration such as 30s or 2m)") from None
    if seconds < 0:
        raise click.BadParameter(f"{value} is negative: give a duration such as 30s, or 0s")
    return seconds


wait_option = click.option(
    "--wait",
    default="30s",
    show_default=True,
    callback=_wait_seconds,
    help="How long to wait through a journal that has no primary or too few brokers yet (just "
    "created or moving) or an unreachable broker, before giving up (0s: do not wait)",
)


max_txn_size_option = click.option(
    "--max-txn-size",
    default=0,
    type=int,
    show_default=True,
    help=(
        "Maximum changes per etcd transaction (0: all in one, all-or-nothing; etcd takes 128 "
        "by default)"
    ),
)


def parse_selector(text: str) -> pb.LabelSelector:
    return labels.parse_selector(text) if text else pb.LabelSelector()


def client_of(opts: dict[str, Any]) -> JournalsClient:
    try:
        return JournalsClient(opts["broker_address"])
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def read_specs(path: str) -> tuple[str, str]:
    if path == "-":
        return "stdin", sys.stdin.read()
    try:
        return path, Path(path).read_text()
    except OSError as exc:
        raise click.ClickException(f"--specs {path}: {exc.strerror or exc}") from None


def some_names(names: list[str], shown: int = 3) -> str:
    """The first few of `names` and how many more: a refusal naming thousands stays short."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def conflict_error(kind: str, names: list[str], exc: ApplyConflict) -> click.ClickException:
    """The one line of an apply whose transaction failed on a revision (`kind`: journals or
    shards): how many conflict, the first few by name, and what to do."""
    detail = f" ({len(names)} {kind}: {some_names(names)})" if len(names) > 1 else ""
    detail = f": {names[0]}" if len(names) == 1 else detail
    return click.ClickException(
        f"revision conflict{detail} changed since the specs were read; nothing in the "
        f"failed transaction was applied (batch {exc.batch + 1}). List the {kind} "
        f"again (`gazctl {kind} list -o yaml`) and re-apply, or use revision: -1"
    )


def too_large_error(exc: ApplyTooLarge, fits: int) -> click.ClickException:
    """The one line of an apply that etcd refused as too large (ApplyTooLarge): what was
    applied, and the flag that applies it in batches (`fits`: a batch size that fits)."""
    if exc.batch == 0:
        where = f"{exc}."
    else:
        where = f"batch {exc.batch + 1}: {exc}; the {exc.batch} batch(es) before it were applied."
    return click.ClickException(
        f"{where} Apply in batches with --max-txn-size {fits} (or fewer; each batch is then "
        "all-or-nothing, not the whole apply: a failed batch stops the run and the batches "
        "before it stay applied), or raise etcd's --max-txn-ops"
    )
