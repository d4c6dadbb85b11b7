"""`gazctl attach-uuids`: attach a fresh message UUID to each input line (as upstream).

Every run is one new producer; each line gets the next clock, flagged OUTSIDE_TXN (committed), so
readers process each record exactly once even if the append that follows is retried.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import BinaryIO

import click

from message.uuid import Clock, Flags, build, new_producer_id

DEFAULT_TEMPLATE = "{{.UUID}},{{.Line}}\n"
# The fields of upstream's template data, with Go's whitespace-trimming markers.
_ACTION = re.compile(r"\{\{(-\s+)?\s*\.(UUID|Line)\s*(\s+-)?\}\}")


def compile_template(template: str) -> Callable[[str, str], str]:
    """A renderer of upstream's attach-uuids template: text with `{{.UUID}}` and `{{.Line}}`."""
    pieces: list[str | tuple[str]] = []
    at = 0
    for match in _ACTION.finditer(template):
        text = template[at : match.start()]
        if match.group(1):
            text = text.rstrip(" \t\r\n")
        if "{{" in text or "}}" in text:
            break
        pieces.append(text)
        pieces.append((match.group(2),))
        at = match.end()
        if match.group(3):
            rest = template[at:]
            at += len(rest) - len(rest.lstrip(" \t\r\n"))
    tail = template[at:]
    if "{{" in tail or "}}" in tail:
        bad = tail[tail.find("{{") :].split("}}")[0] + "}}" if "{{" in tail else "}}"
        raise click.BadParameter(
            f"{bad!r} is not supported: a template may use {{{{.UUID}}}} and {{{{.Line}}}}",
            param_hint="--template",
        )
    pieces.append(tail)

    def render(uuid: str, line: str) -> str:
        return "".join(
            (uuid if p[0] == "UUID" else line) if isinstance(p, tuple) else p for p in pieces
        )

    return render


def attach(
    inputs: list[tuple[str, BinaryIO]],
    out: BinaryIO,
    template: str,
    max_length: int,
    skip_header: bool,
) -> int:
    render = compile_template(template)
    producer = new_producer_id()
    clock = Clock()
    written = 0
    for name, source in inputs:
        skip = skip_header
        for number, raw in enumerate(source, 1):
            line = raw[:-1] if raw.endswith(b"\n") else raw
            line = line[:-1] if line.endswith(b"\r") else line
            if len(line) > max_length:
                raise click.ClickException(
                    f"{name}: line {number} is {len(line)} bytes, over --max-length {max_length}"
                )
            if skip:
                skip = False
                continue
            if written % 1024 == 0:
                clock.update()  # Follow the wall clock; ticks keep each UUID unique.
            uuid = build(producer, clock.tick(), Flags.OUTSIDE_TXN)
            text = line.decode("utf-8", "surrogateescape")
            out.write(render(str(uuid), text).encode("utf-8", "surrogateescape"))
            written += 1
    return written


@click.command("attach-uuids")
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--template", default=DEFAULT_TEMPLATE, show_default=True,
              help="Output template: text with {{.UUID}} and {{.Line}}")  # fmt: skip
@click.option("--max-length", default=4194304, show_default=True, type=click.IntRange(1),
              help="Maximum allowed byte-length of an input line")  # fmt: skip
@click.option("--skip-header", is_flag=True, help="Omit the first line of each input file")
def attach_uuids(paths: tuple[str, ...], template: str, max_length: int, skip_header: bool) -> None:
    """Generate and attach UUIDs to text input records.

    For each line of each input file (stdin if none), write the --template with a new v1 UUID
    and the line to stdout. Each run is a new producer, and UUIDs are flagged as committed. To
    append files exactly once, attach UUIDs into new files first, then append those: a
    restarted append then carries the same UUIDs, which readers de-duplicate.
    """
    compile_template(template)  # Refuse a bad template before reading anything.
    inputs: list[tuple[str, BinaryIO]] = []
    try:
        for path in paths:
            try:
                inputs.append((path, open(path, "rb")))  # noqa: SIM115
            except OSError as exc:
                raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
        if not inputs:
            inputs.append(("stdin", sys.stdin.buffer))
        attach(inputs, sys.stdout.buffer, template, max_length, skip_header)
        sys.stdout.buffer.flush()
    finally:
        for name, source in inputs:
            if name != "stdin":
                source.close()
