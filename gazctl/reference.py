"""Render the gazctl command reference (docs/gazctl.md) from the command tree itself, so the
reference cannot drift from the code: `python -m gazctl.reference > docs/gazctl.md`."""

from __future__ import annotations

import inspect

import click

from gazctl.cli import cli

HEADER = """\
# gazctl reference

Generated from the command tree by `python -m gazctl.reference > docs/gazctl.md`; a test fails
when this file is stale. Every option can also come from its environment variable, or from
`gazctl.ini` (searched in `.`, `~/.config/gazette/`, `$APPLICATION_CONFIG_ROOT`): an option
`--broker.address` of `gazctl journals list` is read from section `[journals.list.broker]`,
`[journals.broker]` or `[broker]`, key `address`. Precedence: flag, environment, INI, default.

A broker (or consumer) address is `http://HOST:PORT` (or a bare `HOST:PORT`), dialled in
plaintext, or `https://HOST:PORT`, dialled with TLS: the server is verified against
`--broker.trusted-ca-file` (else the system's roots) and, when the server asks for one, the
client presents `--broker.cert-file` with `--broker.cert-key-file`. An https:// address is never
dialled in plaintext. Against brokers that verify tokens (`--broker.auth-keys` on `gazette
serve`), give the same keys (`--broker.auth-keys`: gazctl signs a short-lived token per call
with the first) or a token made for you (`--broker.auth-token`). `--consumer.*` likewise for
`gazctl shards`.
"""


def _option_row(param: click.Parameter) -> str:
    names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    env = (
        f"`${param.envvar}`"
        if isinstance(param, click.Option) and isinstance(param.envvar, str)
        else ""
    )
    default = ""
    if isinstance(param, click.Option) and isinstance(param.show_default, str):
        default = f"({param.show_default})"  # A default computed where it runs, e.g. hostname.
    elif (
        isinstance(param, click.Option)
        and not param.is_flag
        and param.default not in (None, "", ())
        and "UNSET" not in str(param.default)  # click >= 8.3's marker for "no default".
    ):
        default = f"`{param.default}`"
    help_ = (param.help or "") if isinstance(param, click.Option) else ""
    if isinstance(param, click.Option) and param.required:
        help_ = f"(required) {help_}"
    return f"| {names} | {env} | {default} | {help_} |"


def render(command: click.Command = cli, path: tuple[str, ...] = ("gazctl",)) -> str:
    out: list[str] = []
    ctx = click.Context(command, info_name=" ".join(path))
    title = " ".join(path)
    if path == ("gazctl",):
        out.append(HEADER)
    else:
        out.append(f"\n{'#' * min(len(path), 4)} `{title}`\n")
    doc = inspect.cleandoc(command.help or "")
    if doc and len(path) > 1:
        out.append(doc.replace("\b\n", "") + "\n")
    usage = command.collect_usage_pieces(ctx)
    out.append(f"```\n{title} {' '.join(usage)}\n```\n")
    params = [p for p in command.params if isinstance(p, click.Option)]
    if params:
        out.append("| option | env | default | description |\n|---|---|---|---|")
        out.extend(_option_row(p) for p in params)
        out.append("")
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            out.append(render(command.commands[name], (*path, name)))
    return "\n".join(out)


def full() -> str:
    """The gazctl tree, then the broker's own `gazette` command."""
    from broker.main import cli as gazette

    cli.load_all()  # Its commands are loaded on first use: the reference shows every one.
    broker = render(gazette, ("gazette",)).replace(HEADER, "")
    intro = (
        "\n---\n\n# gazette (the broker)\n\nSettings come from flags, environment, then "
        "`gazette.ini` (section `[broker]`, `[etcd]` or `[log]`, key without the prefix).\n"
    )
    return render() + intro + broker


def main() -> None:
    click.echo(full(), nl=False)


if __name__ == "__main__":
    main()
