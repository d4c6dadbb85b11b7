"""Replication filters: label selectors (the grammar of journal and shard selectors) over an
event's attributes.

An event's attributes are its payload's top-level fields whose values are strings, numbers or
booleans (each as a label of that name and its text: `true`/`false` for booleans), and
`emitter`, the location that emitted it (which a payload field of that name does not override).
`type=order, region in (eu, us)` keeps orders of those regions; `!internal` drops events that
have an `internal` field. The empty filter is no filter. System events (topology changes) pass
every filter (`system.passes`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from replication.model import Event, EventFilter

__all__ = ["FilterError", "attributes", "parse_filter"]


class FilterError(ValueError):
    """A replication filter that does not parse; the message names it and the problem."""


def _text(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return None


def attributes(event: Event) -> pb.LabelSet:
    """The labels a filter sees of `event`."""
    have: dict[str, str] = {}
    payload: Mapping[str, Any] = event.payload
    for name, value in payload.items():
        text = _text(value)
        if text is not None and isinstance(name, str):
            have[name] = text
    have["emitter"] = event.emitter
    return labels.label_set(*sorted(have.items()))


def parse_filter(text: str) -> EventFilter | None:
    """The predicate of a filter's text (None for the empty filter); FilterError if it does
    not parse."""
    if not text.strip():
        return None
    try:
        selector = labels.parse_selector(text)
    except labels.SelectorError as exc:
        raise FilterError(
            f"replication filter {text!r}: {exc.problem} (at {exc.position})"
        ) from None
    return lambda event: labels.matches(selector, attributes(event))
