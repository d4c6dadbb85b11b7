"""`gazctl journals append|read|reset-head`: content in and out of journals."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import click
import grpc

from broker.client.appender import AppendError, reset_head
from broker.client.dialer import Dialer
from broker.client.reader import ReadError, read_retrying, write_head
from broker.client.routes import append_routed, waiting
from broker.fragment.content import FragmentCorrupt
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from gazctl.journals import journals
from gazctl.options import broker_options, client_of, file_root_option, wait_option
from gazctl.render import err_console, note

# An append of stdin is cut at this many bytes (at a line end with --framing lines), so an
# endless input streams as a sequence of bounded transactions.
APPEND_BATCH = 4 << 20
FULLY_SUSPENDED = pb.JournalSpec.Suspend.FULL


async def matching(opts: dict[str, Any], selector: str) -> list[pb.ListResponse.Journal]:
    async with client_of(opts) as client:
        snapshot = await client.list(labels.parse_selector(selector))
    if not snapshot.journals:
        raise click.ClickException(f"no journals match the selector {selector!r}")
    return list(snapshot.journals)


def _read_some(stream: BinaryIO) -> bytes:
    read1 = getattr(stream, "read1", None)
    return read1(APPEND_BATCH) if read1 is not None else stream.read(APPEND_BATCH)


async def _input_batches(stream: BinaryIO, framing: str) -> AsyncIterator[bytes]:
    """The input as append-sized batches; with `lines`, each batch ends at a line end."""
    loop = asyncio.get_running_loop()
    pending = b""
    while data := await loop.run_in_executor(None, _read_some, stream):
        pending += data
        if framing == "none":
            yield pending
            pending = b""
        elif (cut := pending.rfind(b"\n") + 1) > 0:
            yield pending[:cut]
            pending = pending[cut:]
        elif len(pending) >= APPEND_BATCH:
            yield pending  # A single line longer than a batch.
            pending = b""
    if pending:
        if framing == "lines" and not pending.endswith(b"\n"):
            pending += b"\n"  # A final unterminated line is still one whole record.
        yield pending


async def _append(
    opts: dict[str, Any], selector: str, source: BinaryIO, framing: str
) -> tuple[str, int, int, int]:
    journals_ = await matching(opts, selector)
    if len(journals_) != 1:
        names = ", ".join(j.spec.name for j in journals_[:5])
        raise click.ClickException(
            f"the selector {selector!r} matches {len(journals_)} journals ({names}...): "
            "appending needs exactly one (partitioned appends come with --mapping)"
        )
    name = journals_[0].spec.name
    dialer = Dialer()
    stub = dialer.journal_stub(opts["broker_address"])
    first, last, total = -1, -1, 0
    try:
        async for batch in _input_batches(source, framing):
            response = await append_routed(stub, name, batch, wait=opts["wait"], on_wait=note)
            if first < 0:
                first = response.commit.begin
            last = response.commit.end
            total += len(batch)
    except AppendError as exc:
        raise click.ClickException(
            f"{exc}{_waited(exc, opts)}; {total} bytes were appended before it"
        ) from None
    except grpc.aio.AioRpcError as exc:
        detail = (exc.details() or "").split("\n")[0]
        if getattr(exc, "commit_sent", False):
            raise click.ClickException(
                f"append to {name}: the call failed after its commit was sent ({exc.code().name}"
                f": {detail}): it may have landed, so read the journal to check before appending "
                f"it again; {total} bytes were appended before it"
            ) from None
        raise click.ClickException(
            f"append to {name}: {exc.code().name}: {detail}{_waited(exc, opts)}; {total} bytes "
            "were appended before it"
        ) from None
    finally:
        await dialer.close()
    return name, first, last, total


def _waited(exc: BaseException, opts: dict[str, Any]) -> str:
    """ " (after waiting 30s)" when the failure was a transient one waited through."""
    from broker.client.routes import transient_reason

    if transient_reason(exc) is None or not opts["wait"]:
        return ""
    if getattr(exc, "why", ""):  # The broker said why: waiting longer will not help.
        return f" (after waiting {opts['wait']:g}s)"
    return f" (still, after waiting {opts['wait']:g}s: raise --wait to wait longer)"


async def _append_mapped(
    opts: dict[str, Any], selector: str, source: BinaryIO, mapping: str, base64_keys: bool
) -> dict[str, int]:
    """Records (lines) mapped to the selected journals: for modulo and rendezvous each record
    follows its partition-key line, for direct its journal-name line (as upstream). Records of
    one journal keep their order; returns the records appended per journal."""
    import base64
    import binascii

    from broker.client.append_service import AppendService
    from message import mapping as maps

    partitions = maps.partitions_of(await matching(opts, selector))
    names = {p.journal for p in partitions}
    route: Callable[[bytes], maps.Partition] = maps.random_mapping(lambda: partitions)
    if mapping == "modulo":
        route = maps.modulo_mapping(bytes, lambda: partitions)
    elif mapping == "rendezvous":
        route = maps.rendezvous_mapping(bytes, lambda: partitions)
    counts: dict[str, int] = {}
    # Each batch's outcome, and the journal and number of records it holds.
    batches: dict[asyncio.Future[int], tuple[str, int]] = {}
    dialer = Dialer()
    stub = dialer.journal_stub(opts["broker_address"])
    loop = asyncio.get_running_loop()
    try:
        # Raw records carry no UUIDs to de-duplicate them by: a batch whose commit may have
        # landed is never sent again (its outcome is unknown, and said so).
        async with AppendService(stub, max_wait=opts["wait"], at_least_once=False) as service:
            number = 0
            while True:
                key_line = b""
                if mapping != "random":
                    key_line = await loop.run_in_executor(None, source.readline)
                    number += 1
                    if not key_line:
                        break
                record = await loop.run_in_executor(None, source.readline)
                number += 1
                if not record:
                    if key_line:
                        raise click.ClickException(
                            f"input line {number - 1}: a partition key with no record after it"
                        )
                    break
                if not record.endswith(b"\n"):
                    record += b"\n"
                key = key_line.rstrip(b"\r\n")
                if mapping == "direct":
                    journal = key.decode("utf-8", "replace")
                    if journal not in names:
                        raise click.ClickException(
                            f"input line {number - 1}: journal {journal!r} is not one the "
                            f"selector {selector!r} matches"
                        )
                else:
                    if base64_keys:
                        try:
                            key = base64.b64decode(key, validate=True)
                        except binascii.Error:
                            raise click.ClickException(
                                f"input line {number - 1}: the partition key is not base64"
                            ) from None
                    journal = route(key).journal
                pending = await service.write(journal, record)
                held = batches.get(pending.batch, (journal, 0))[1]
                batches[pending.batch] = (journal, held + 1)
            await service.flush()
    finally:
        await dialer.close()
    failed: list[tuple[str, BaseException]] = []
    for batch, (journal, count) in batches.items():
        error = batch.exception() if not batch.cancelled() else asyncio.CancelledError()
        if error is None:
            counts[journal] = counts.get(journal, 0) + count
        else:
            failed.append((journal, error))
    if failed:
        journal, error = failed[0]
        raise click.ClickException(_mapped_failure(journal, error, len(failed), counts, opts))
    return counts


def _mapped_failure(
    journal: str, error: BaseException, batches: int, counts: dict[str, int], opts: dict[str, Any]
) -> str:
    """One line for `append --mapping` whose batches failed: the first failure, what to do
    about it, and the records that were appended."""
    from broker.client.append_service import AppendOutcomeUnknown

    if isinstance(error, AppendOutcomeUnknown):
        said = f"{error}: read {error.journal} to check before appending them again"
    elif isinstance(error, grpc.aio.AioRpcError):
        detail = (error.details() or "").split("\n")[0]
        said = f"append to {journal}: {error.code().name}: {detail}{_waited(error, opts)}"
    elif isinstance(error, AppendError):
        said = f"{error}{_waited(error, opts)}"
    else:
        said = f"append to {journal}: {error or type(error).__name__}"
    more = f" ({batches} batches failed)" if batches > 1 else ""
    done = ", ".join(f"{n} to {j}" for j, n in sorted(counts.items())) or "none"
    return f"{said}{more}; records appended: {done}"


@journals.command("append")
@broker_options
@wait_option
@click.option("-l", "--selector", required=True, help="Label selector of the journal to append to")
@click.option(
    "-i", "--input", "input_path", default="-", show_default=True, help="Input file (- for stdin)"
)
@click.option("-f", "--framing", type=click.Choice(["none", "lines"]), default="none", show_default=True,
              help="none: bytes as they come; lines: appends end at line boundaries")  # fmt: skip
@click.option("-m", "--mapping", type=click.Choice(["random", "modulo", "rendezvous", "direct"]),
              default=None, help="Map each record (line) to one of the selected journals: by a "
              "partition-key line before it (modulo, rendezvous), a journal-name line (direct), "
              "or at random")  # fmt: skip
@click.option("--base64", "base64_keys", is_flag=True,
              help="Partition keys are base64 (modulo and rendezvous)")  # fmt: skip
def append_cmd(
    selector: str,
    input_path: str,
    framing: str,
    mapping: str | None,
    base64_keys: bool,
    **opts: Any,
) -> None:
    """Append the input to a journal: each batch of up to 4 MiB is one all-or-nothing append.

    With --mapping (and --framing lines), records are appended to the journals the selector
    matches (a partitioned topic): each record is a line, preceded by its partition-key line for
    modulo and rendezvous, or its journal-name line for direct. Records mapped to one journal keep
    their order.

    Each record is appended at most once: an append whose answer is lost after its commit was
    sent (the broker died, the connection dropped) is not sent again, and the command says
    which journal to read to learn whether it landed.
    """
    from gazctl.cli import run

    if mapping is not None and framing != "lines":
        raise click.UsageError("--mapping needs --framing lines (each record is a line)")
    if base64_keys and mapping not in ("modulo", "rendezvous"):
        raise click.UsageError("--base64 needs --mapping modulo or rendezvous")

    try:
        source: BinaryIO = sys.stdin.buffer if input_path == "-" else open(input_path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise click.ClickException(f"--input {input_path}: {exc.strerror or exc}") from None
    if mapping is not None:
        with source:
            counts = run(_append_mapped(opts, selector, source, mapping, base64_keys))
        for journal, count in sorted(counts.items()):
            err_console.print(f"appended {count} records to {journal}")
        if not counts:
            err_console.print("nothing to append: the input was empty")
        return
    with source:
        name, first, last, total = run(_append(opts, selector, source, framing))
    if total:
        err_console.print(f"appended {total} bytes to {name} at [{first}, {last})")
    else:
        err_console.print(f"nothing to append to {name}: the input was empty")


def load_offsets(path: str) -> dict[str, int]:
    """The --offsets file: a JSON object of journal name to the offset to read from."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise click.ClickException(f"--offsets {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise click.ClickException(f"--offsets {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise click.ClickException(
            f"--offsets {path}: expected a JSON object of journal name to offset"
        )
    for name, offset in doc.items():
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise click.ClickException(
                f"--offsets {path}: the offset of {name} is {json.dumps(offset)}: "
                "expected an integer >= 0"
            )
    return doc


def save_offsets(path: str, offsets: dict[str, int]) -> None:
    """Write --offsets-out atomically (a temporary file renamed into place)."""
    temp = f"{path}.temp"
    try:
        with open(temp, "w") as out:
            out.write(json.dumps(offsets, sort_keys=True) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except OSError as exc:
        raise click.ClickException(f"--offsets-out {path}: {exc.strerror or exc}") from None


@dataclass
class ReadOptions:
    block: bool = False
    tail: bool = False
    start: dict[str, int] = field(default_factory=dict)  # From --offsets.
    begin_mod_time: int = 0
    file_root: Path | None = None
    wait: float = 30.0  # --wait: seconds to wait through transient refusals.


async def _read(
    opts: dict[str, Any], selector: str, options: ReadOptions, out: BinaryIO,
    next_offsets: dict[str, int],
) -> None:  # fmt: skip
    """Read the selected journals to `out`, keeping `next_offsets` (journal -> the offset
    after the content written out) current as chunks are written."""
    journals_ = await matching(opts, selector)
    dialer = Dialer()
    stub = dialer.journal_stub(opts["broker_address"])
    lock = asyncio.Lock()

    async def one(spec: pb.JournalSpec) -> None:
        name = spec.name
        if name in options.start:
            offset = options.start[name]
        elif options.tail:
            offset = await waiting(
                lambda: write_head(stub, name), f"read of {name}", wait=options.wait,
                on_wait=note,
            )  # fmt: skip
        else:
            offset = 0
        next_offsets[name] = offset
        # Persisted fragments are read from their stores through signed URLs. file:// URLs
        # need the file root: without it, journals on file stores are read through brokers.
        direct = options.file_root is not None or not any(
            store.startswith("file:") for store in spec.fragment.stores
        )

        def skipped(begin: int, end: int) -> None:
            note(
                f"{name}: skipped [{begin}, {end}): no broker holds it and no store of its spec "
                "lists it (if a store was dropped from the spec, list it again after the new one)"
            )
            next_offsets[name] = end

        chunks = read_retrying(
            lambda: stub, name, offset, block=options.block, wait=options.wait,
            on_wait=note, direct=direct, file_root=options.file_root,
            begin_mod_time=options.begin_mod_time, on_hole=skipped,
        )  # fmt: skip
        async for chunk in chunks:
            async with lock:  # Whole chunks from one journal at a time.
                out.write(chunk.content)
                out.flush()
                next_offsets[name] = chunk.offset + len(chunk.content)

    try:
        await asyncio.gather(
            *(one(j.spec) for j in journals_ if j.spec.suspend.level != FULLY_SUSPENDED)
        )
    except ReadError as exc:
        raise click.ClickException(f"{exc}{_waited(exc, {'wait': options.wait})}") from None
    except FragmentCorrupt as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        await dialer.close()


@journals.command("read")
@broker_options
@wait_option
@click.option("-l", "--selector", required=True, help="Label selector of journals to read")
@click.option("-b", "--block", is_flag=True, help="Keep reading as new content commits")
@click.option("--tail", is_flag=True, help="Start at the write head instead of the beginning")
@click.option("-o", "--output", default="-", show_default=True, help="Output file (- for stdout)")
@click.option(
    "--offsets",
    "offsets_path",
    default=None,
    help="JSON file of journal name to the offset to start reading it from",
)
@click.option(
    "--offsets-out",
    "offsets_out",
    default=None,
    help="JSON file to write each journal's next offset to when the read ends",
)
@click.option(
    "--from",
    "from_unix",
    type=int,
    default=None,
    help="Skip fragments persisted before this time (unix seconds)",
)
@file_root_option("Directory that roots file:// fragment stores, to read them directly")
def read_cmd(
    selector: str, block: bool, tail: bool, output: str, offsets_path: str | None,
    offsets_out: str | None, from_unix: int | None, file_root: Path | None, **opts: Any,
) -> None:  # fmt: skip
    """Read the selected journals' content to the output (several journals: interleaved by
    chunk). Without --block, stops at each journal's current write head.

    Reads start at offset 0, or at the write head with --tail, or where --offsets says
    (journals it does not name start as without it). --offsets-out records where each
    journal's read ended, also on Ctrl-C: pass it back as --offsets (the same file may be
    both) to continue with new content only. Persisted fragments are read directly from
    their stores through signed URLs; for file:// stores give --file-root.
    """
    from gazctl.cli import run

    if from_unix is not None and from_unix < 0:
        raise click.ClickException(f"--from {from_unix}: give unix seconds since the epoch")
    start = load_offsets(offsets_path) if offsets_path else {}
    options = ReadOptions(block, tail, start, from_unix or 0, file_root, opts["wait"])
    try:
        out: BinaryIO = sys.stdout.buffer if output == "-" else open(output, "wb")  # noqa: SIM115
    except OSError as exc:
        raise click.ClickException(f"--output {output}: {exc.strerror or exc}") from None
    # Journals read here are updated as their content is written; the others keep theirs.
    next_offsets = dict(start)
    try:
        run(_read(opts, selector, options, out, next_offsets))
    except KeyboardInterrupt:
        pass
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        if offsets_out:
            save_offsets(offsets_out, next_offsets)


async def _reset_head(opts: dict[str, Any], selector: str) -> list[tuple[str, int]]:
    journals_ = await matching(opts, selector)
    dialer = Dialer()
    stub = dialer.journal_stub(opts["broker_address"])
    done: list[tuple[str, int]] = []
    try:
        for journal in journals_:
            if journal.spec.suspend.level == pb.JournalSpec.Suspend.FULL:
                continue  # Fully suspended journals have no head to reset.
            name = journal.spec.name
            try:
                response = await waiting(
                    lambda name=name: reset_head(stub, name), f"reset of {name}",  # type: ignore[misc]
                    wait=opts["wait"], on_wait=note,
                )  # fmt: skip
            except (AppendError, ReadError) as exc:
                raise click.ClickException(
                    f"{exc}{_waited(exc, opts)} (journals reset before it: {len(done)})"
                ) from None
            done.append((journal.spec.name, response.commit.end))
    finally:
        await dialer.close()
    return done


@journals.command("reset-head")
@broker_options
@wait_option
@click.option("-l", "--selector", required=True, help="Label selector of journals to reset")
def reset_head_cmd(selector: str, **opts: Any) -> None:
    """Disaster recovery: let appends continue at each journal's largest known offset.

    When journal consistency was lost (too many broker or etcd failures), brokers refuse
    appends with INDEX_HAS_GREATER_OFFSET rather than risk writing an offset twice. After
    confirming every earlier broker has exited, run this to append zero bytes at the largest
    offset the fragment index knows, which clears the condition.
    """
    from gazctl.cli import run

    for name, offset in run(_reset_head(opts, selector)):
        err_console.print(f"reset the head of {name} to {offset}")
