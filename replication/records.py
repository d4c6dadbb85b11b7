"""The records of a location's journal, and a fast path for its events.

An event record is written with its fields in one order:

    {"kind":"event","seq":S,"emitter":"E","ts":{"A":1,"B":2},"payload":{...}}

so that a reader finds its sequence number, emitter and timestamp without decoding the payload,
and a connection writes it to the target as the source's bytes with only the sequence number
changed. Any other JSON encoding of a record (other field orders, spaces, escapes) is read too,
through the JSON decoder, and written back in this form. Other kinds of records are rare and
always decoded."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from replication.model import Event, Stored
from replication.vclock import VectorClock

__all__ = [
    "EVENT_LINE",
    "RawEvent",
    "encode_event",
    "event_of",
    "index_records",
    "merge_stamps",
    "parse_event",
    "record_line",
    "split_records",
]

_PREFIX = b'{"kind":"event","seq":'
_EMITTER = b'"emitter":"'
_TS = b',"ts":{'
_PAYLOAD = b',"payload":'
_SYSTEM = b'{"system":'
# A timestamp's entries in the fixed form: "LOCATION":TIME, comma-separated, times positive.
_STAMP = rb'(?:"[^"\\,:\n]+":[1-9]\d*(?:,"[^"\\,:\n]+":[1-9]\d*)*)?'
# A whole line: an event record in the fixed form (seq, body from the emitter, emitter, the
# timestamp's entries), or any other line.
_LINE = re.compile(
    rb'\{"kind":"event","seq":(\d+),("emitter":"([^"\\\n]*)","ts":\{('
    + _STAMP
    + rb')\},"payload":)'
    rb"[^\n]*\n|[^\n]*\n"
)
_TS_ENTRY = re.compile(rb'"([^"\\,:]+)":([1-9]\d*)')
_TS_KEY = re.compile(rb'"([^"\\,:]+)":')
# A whole line: an event record in the fixed form (seq; its body from the emitter on; the
# emitter; its own entry in the timestamp; the timestamp's entries), or any other line.
EVENT_LINE = re.compile(
    rb'\{"kind":"event","seq":(\d+),("emitter":"([^"\\\n]*)","ts":\{'
    rb'(?=(?:[^}\n]*,)?"\3":(\d+)[,}])(' + _STAMP + rb')\},"payload":[^\n]*\n)'
    rb"|[^\n]*\n"
)
# A whole line, for an index: an event record in the fixed form (seq, the timestamp's entries),
# or any other line.
_INDEX = re.compile(
    rb'\{"kind":"event","seq":(\d+),"emitter":"[^"\\\n]*","ts":\{(' + _STAMP + rb')\},"payload":'
    rb"[^\n]*\n|[^\n]*\n"
)


def record_line(document: Mapping[str, Any]) -> bytes:
    """A record other than an event, as one line."""
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode() + b"\n"


class RawEvent(NamedTuple):
    """A stored event as read: its sequence number, emitter and timestamp (a dict of positive
    counts), and `body`, its record's bytes after the sequence number (through the newline).
    A tuple of plain values, which the garbage collector stops tracking: a reader keeps many."""

    seq: int
    emitter: str
    ts: dict[str, int]
    body: bytes
    payload_at: int  # Where the payload begins in `body`.

    def line(self, seq: int) -> bytes:
        """Its record with sequence number `seq` (as the target stores it)."""
        return b"%s%d,%s" % (_PREFIX, seq, self.body)

    @property
    def is_system(self) -> bool:
        return self.body.startswith(_SYSTEM, self.payload_at)

    def payload(self) -> dict[str, Any]:
        value = json.loads(self.body[self.payload_at : self.body.rindex(b"}")])
        if not isinstance(value, dict):
            raise ValueError(f"event {self.emitter}/{self.seq}: payload is not an object")
        return value

    def event(self) -> Event:
        return Event(self.emitter, VectorClock(self.ts), self.payload())

    def stored(self) -> Stored:
        return Stored(self.seq, self.event())


_new_raw = tuple.__new__
_RAW = RawEvent


def encode_event(seq: int, event: Event) -> RawEvent:
    """An event's record, in the fixed field order."""
    ts = event.timestamp.to_json()
    head = b'"emitter":%s,"ts":%s,"payload":' % (
        json.dumps(event.emitter).encode(),
        json.dumps(ts, separators=(",", ":"), sort_keys=True).encode(),
    )
    payload = json.dumps(dict(event.payload), separators=(",", ":")).encode()
    return RawEvent(seq, event.emitter, ts, head + payload + b"}\n", len(head))


def _parse_ts(inner: bytes) -> dict[str, int] | None:
    """The entries of a timestamp in the fixed form (None if it is not)."""
    if not inner:
        return {}
    entries = _TS_ENTRY.findall(inner)
    if len(entries) != inner.count(b",") + 1:
        return None
    return {key.decode(): int(time) for key, time in entries}


def split_records(data: bytes) -> tuple[list[tuple[int, int, RawEvent | None]], int]:
    """The whole lines of `data`, each (start, end, its event, or None for another record or an
    event not in the fixed form: `parse_event` or the JSON decoder reads those); and the end of
    the last whole line."""
    out: list[tuple[int, int, RawEvent | None]] = []
    end = 0
    for match in _LINE.finditer(data):
        start, end = match.span()
        seq = match.group(1)
        if seq is not None:
            ts = _parse_ts(match.group(4))
            if ts is not None:
                body = match.start(2)
                raw = _new_raw(_RAW, (int(seq), match.group(3).decode(), ts, data[body:end], match.end(2) - body))  # fmt: skip
                out.append((start, end, raw))
                continue
        out.append((start, end, None))
    return out, end


def parse_event(line: bytes) -> RawEvent:
    """An event record (its line, with or without the newline); ValueError if it is not one."""
    if not line.endswith(b"\n"):
        line += b"\n"
    if line.startswith(_PREFIX):
        try:
            comma = line.index(b",", len(_PREFIX))
            seq = int(line[len(_PREFIX) : comma])
            body = line[comma + 1 :]
            if body.startswith(_EMITTER):
                quote = body.index(b'"', len(_EMITTER))
                emitter = body[len(_EMITTER) : quote]
                if b"\\" not in emitter and body.startswith(_TS, quote + 1):
                    end = body.index(b"}", quote + 1 + len(_TS))
                    ts = _parse_ts(body[quote + 1 + len(_TS) : end])
                    if ts is not None and body.startswith(_PAYLOAD, end + 1):
                        return RawEvent(seq, emitter.decode(), ts, body, end + 1 + len(_PAYLOAD))
        except ValueError:
            pass  # Not in the fixed form: the JSON decoder says what it is.
    record = json.loads(line)
    if not isinstance(record, dict) or record.get("kind") != "event":
        raise ValueError("not an event record")
    return event_of(record)


def event_of(record: Mapping[str, Any]) -> RawEvent:
    """An event record decoded by the JSON decoder, in the fixed form."""
    try:
        clock = VectorClock.from_json(record["ts"], field="event.ts")
        payload = record["payload"]
        if not isinstance(payload, dict):
            raise ValueError("event.payload: expected an object")
        return encode_event(int(record["seq"]), Event(str(record["emitter"]), clock, payload))
    except KeyError as exc:
        raise ValueError(f"event record without {exc}") from None


def index_records(
    data: bytes, cvv: dict[str, int]
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Index whole lines without keeping them: the seq and start of each event in the fixed
    form, their timestamps merged into `cvv`; and the (start, end) of every other line (and of
    events not in the fixed form: the caller decodes those)."""
    seqs: list[int] = []
    starts: list[int] = []
    others: list[tuple[int, int]] = []
    stamps: list[bytes] = []
    for match in _INDEX.finditer(data):
        seq = match.group(1)
        if seq is not None:
            seqs.append(int(seq))
            starts.append(match.start())
            stamps.append(match.group(2))
        else:
            others.append(match.span())
    merge_stamps(stamps, cvv)
    return seqs, starts, others


def _keys(joined: bytes) -> list[bytes]:
    """The distinct locations of timestamps' entries: one search each (there are few)."""
    keys: list[bytes] = []
    pattern = _TS_KEY
    while (found := pattern.search(joined)) is not None:
        keys.append(found.group(1))
        known = b"|".join(re.escape(k) for k in keys)
        pattern = re.compile(rb'"(?!(?:' + known + rb')")([^"\\,:]+)":')
    return keys


def merge_stamps(stamps: list[bytes], cvv: dict[str, int]) -> None:
    """Merge timestamps' entries into `cvv`: stamps in the fixed form, without braces (as the
    patterns above capture them, and `encode_event` writes them).

    The greatest time of each location is found by the regex engine, a few passes over the
    joined stamps per location (there are few), with no Python step per entry: the length of
    the longest time by a binary search, then the greatest of that length."""
    joined = b",".join(stamps)
    if not joined:
        return
    for key in _keys(joined):
        entry = rb'"' + re.escape(key) + rb'":'
        shortest, longest = 1, 1  # A time of `longest` digits exists; find the most.
        while re.search(entry + rb"\d{%d}" % (longest * 2), joined):
            shortest, longest = longest * 2, longest * 2
        high = longest * 2  # No time has this many digits.
        while high - shortest > 1:
            middle = (shortest + high) // 2
            if re.search(entry + rb"\d{%d}" % middle, joined):
                shortest = middle
            else:
                high = middle
        # Without leading zeros, the greatest of the longest is the greatest (as bytes).
        time = int(max(re.findall(entry + rb"(\d{%d})(?!\d)" % shortest, joined)))
        location = key.decode()
        if time > cvv.get(location, 0):
            cvv[location] = time
