"""`python -m consumer serve --app module:Name`: a consumer process of any application.

`Name` in `module` is the application's class (or a factory), called without arguments; it
reads what it needs from its environment (`gazctl dev up` sets CONSUMER_STORE_ROOT, a directory
for JSON-file stores, and POSTGRES_DSN when it runs PostgreSQL). The examples have command lines
of their own (`python -m consumer.examples.word_count`, `...stream_sum`)."""

from __future__ import annotations

import importlib
from typing import Any

import click

from consumer.hooks import AppHooks, HookError
from consumer.main import serve_command
from consumer.runtime import ConsumerApplication


def load_application(target: str) -> ConsumerApplication:
    """The application `module:Name` names, made; a bad name is one line."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise click.UsageError(f"--app {target!r}: give it as module:Name (a class or factory)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.UsageError(f"--app {target!r}: cannot import {module_name}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise click.UsageError(f"--app {target!r}: {module_name} has no class or factory {attr}")
    try:
        app = factory()
    except Exception as exc:
        raise click.UsageError(f"--app {target!r}: {attr}() failed: {exc}") from None
    for method in ("new_store", "consume_message", "finalize_txn"):
        if not callable(getattr(app, method, None)):
            raise click.UsageError(
                f"--app {target!r}: {attr}() is not a consumer application (no {method} method)"
            )
    try:
        AppHooks.of(app)
    except HookError as exc:
        raise click.UsageError(f"--app {target!r}: {exc}") from None
    return app  # type: ignore[no-any-return]


def _application(opts: dict[str, Any]) -> ConsumerApplication:
    return load_application(opts["app"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """A consumer process of an application named module:Name."""


cli.add_command(
    serve_command(
        "consumer",
        _application,
        click.option(
            "--app", required=True, envvar="CONSUMER_APP", show_envvar=True,
            help="The application, as module:Name (a class or factory taking no arguments)",
        ),
    )
)  # fmt: skip


if __name__ == "__main__":
    cli(prog_name="consumer")
