"""Structured logs: `--log.level` and `--log.format json|text|color`, each record carrying the
journal, shard and RPC it concerns (when known) as fields.

Fields live in a context variable: `bind(journal=..., rpc=...)` sets them for the current task
and every task it starts afterwards (asyncio copies the context into new tasks), so a replica's
work, an RPC handler's, or a shard's transaction loop logs with them without passing them
around. Nothing secret goes into a field: tokens and keys are never bound, and messages never
include request metadata.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

FIELDS = ("journal", "shard", "rpc")
LEVELS = {
    "trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
    "warn": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL,
}  # fmt: skip

_NONE: Mapping[str, str] = MappingProxyType({})
_fields: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("gazette_log_fields", default=_NONE)  # fmt: skip


def bind(**fields: str) -> None:
    """Add fields to every record logged from here on, in this task and the tasks it starts."""
    merged = dict(_fields.get())
    merged.update({k: v for k, v in fields.items() if v})
    _fields.set(merged)


@contextlib.contextmanager
def bound(**fields: str) -> Iterator[None]:
    """`bind` for the duration of a block."""
    token = _fields.set({**_fields.get(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _fields.reset(token)


class _AddFields(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        fields = _fields.get()
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, fields.get(name, ""))
        return True


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg, the fields, and err for a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, "")
            if value:
                doc[name] = value
        if record.exc_info:
            doc["err"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


_COLORS = {
    logging.DEBUG: "\x1b[37m", logging.INFO: "\x1b[36m", logging.WARNING: "\x1b[33m",
    logging.ERROR: "\x1b[31m", logging.CRITICAL: "\x1b[35m",
}  # fmt: skip


class TextFormatter(logging.Formatter):
    """`time level logger: msg journal=... shard=... rpc=...`, colored by level if asked."""

    def __init__(self, color: bool = False) -> None:
        super().__init__()
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname
        if self.color:
            level = f"{_COLORS.get(record.levelno, '')}{level}\x1b[0m"
        line = f"{_timestamp(record)} {level} {record.name}: {record.getMessage()}"
        extra = " ".join(
            f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, "")
        )
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def setup(level: str, fmt: str) -> None:
    """Log at `level` to stderr in format `fmt` (json, text or color), as servers do."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter(color=fmt == "color"))
    handler.addFilter(_AddFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
