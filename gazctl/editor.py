"""The edit loop of `journals edit` and `shards edit`: specs opened in $GAZ_EDITOR (or
$EDITOR) and applied when the editor exits, re-opened with the error at the top when they do
not decode or apply."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import click

from gazctl import render


def editor_command() -> list[str]:
    editor = os.environ.get("GAZ_EDITOR") or os.environ.get("EDITOR") or "vi"
    return shlex.split(editor)


def run_editor(path: Path) -> None:
    cmd = [*editor_command(), str(path)]
    try:
        result = subprocess.run(cmd, check=False)
    except FileNotFoundError:
        raise click.ClickException(
            f"editor {cmd[0]!r} not found: set $GAZ_EDITOR or $EDITOR"
        ) from None
    if result.returncode != 0:
        raise click.ClickException(
            f"editor {cmd[0]!r} exited with status {result.returncode}; nothing applied"
        )


async def edit_and_apply(
    original: str,
    filename: str,
    apply_text: Callable[[str], Awaitable[list[render.PlannedChange]]],
) -> list[render.PlannedChange]:
    """Open `original` in the editor and apply what comes back; when that fails, re-open the
    editor with the error at the top, keeping the user's edits. Unchanged or empty: nothing."""
    with tempfile.TemporaryDirectory(prefix="gazctl-edit-") as tmp:
        path = Path(tmp) / filename
        path.write_text(original)
        while True:
            run_editor(path)
            body = strip_error_comments(path.read_text())
            if not body.strip() or body == strip_error_comments(original):
                click.echo("no changes to apply", err=True)
                return []
            try:
                return await apply_text(body)
            except click.ClickException as exc:
                path.write_text(f"{ERROR_MARK} {exc.message}\n{body}")
                click.echo(f"error: {exc.message} (re-opening the editor)", err=True)


ERROR_MARK = "# ERROR:"


def strip_error_comments(text: str) -> str:
    return "".join(
        line for line in text.splitlines(keepends=True) if not line.startswith(ERROR_MARK)
    )
