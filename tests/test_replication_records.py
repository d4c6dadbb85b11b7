"""The records of a location's journal: the fixed form of event records and its fast path agree
with the JSON decoder on any event; other encodings still read; payloads that mimic record
fields fool nothing; the causality filter on the emitter's own entry drops exactly the events
whose timestamps are <= the CVV, on histories the model produces."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from replication.journal_log import _pass_events
from replication.model import Event, LocationModel, Stored, replicate
from replication.records import (
    encode_event,
    index_records,
    merge_stamps,
    parse_event,
    split_records,
)
from replication.vclock import VectorClock, lub

names = st.sampled_from(["A", "B", "C", "east", "west-2", "x.y"])
clocks = st.dictionaries(names, st.integers(1, 10**12), min_size=1, max_size=5)
scalars = st.one_of(st.text(max_size=20), st.integers(), st.booleans(), st.none())
payloads = st.dictionaries(
    st.text(max_size=10), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=5
)


@st.composite
def events(draw: st.DrawFn) -> Event:
    ts = draw(clocks)
    emitter = draw(st.sampled_from(sorted(ts)))
    return Event(emitter, VectorClock(ts), draw(payloads))


@settings(max_examples=300)
@given(st.lists(events(), min_size=1, max_size=20))
def test_the_fixed_form_reads_back_as_the_json_decoder_reads_it(batch: list[Event]) -> None:
    data = b"".join(encode_event(i, e).line(i) for i, e in enumerate(batch, 1))
    lines, end = split_records(data)
    assert end == len(data) and all(raw is not None for _, _, raw in lines)
    for (start, stop, raw), event, i in zip(lines, batch, range(1, len(batch) + 1), strict=True):
        assert raw is not None
        decoded = json.loads(data[start:stop])
        assert decoded == {"kind": "event", "seq": i, "emitter": event.emitter,
                           "ts": event.timestamp.to_json(), "payload": dict(event.payload)}  # fmt: skip
        assert raw.stored().event == event and raw.seq == i
        assert parse_event(data[start:stop]) == raw
    cvv: dict[str, int] = {}
    seqs, starts, others = index_records(data, cvv)
    assert seqs == list(range(1, len(batch) + 1)) and others == []
    assert starts == [start for start, _, _ in lines]
    assert VectorClock(cvv) == lub(e.timestamp for e in batch)


@given(events(), st.integers(1, 10**6))
def test_other_encodings_of_an_event_are_read_and_written_back_in_the_fixed_form(
    event: Event, seq: int
) -> None:
    document = {"payload": dict(event.payload), "ts": event.timestamp.to_json(),
                "seq": seq, "emitter": event.emitter, "kind": "event"}  # fmt: skip
    line = json.dumps(document, indent=None, sort_keys=True).encode() + b"\n"
    raw = parse_event(line)
    assert raw.stored().event == event and raw.seq == seq
    assert split_records(raw.line(seq))[0][0][2] == raw  # The fixed form.
    # In a batch, the slow path gives the same event as the fast one, in the fixed form.
    fast, _, _, _ = _pass_events(encode_event(seq, event).line(seq), {}, None, 7)
    slow, _, _, _ = _pass_events(line, {}, None, 7)
    assert [parse_event(x).stored() for x in fast + slow] == [Stored(7, event)] * 2
    assert split_records(slow[0])[0][0][2] is not None


def test_the_index_takes_the_line_by_line_path_for_lines_not_in_the_fixed_form() -> None:
    fixed = encode_event(1, Event("A", VectorClock({"A": 1}), {"x": 1})).line(1)
    spaced = b'{"kind":"event","seq":2, "emitter": "B", "ts": {"B": 4}, "payload": {}}\n'
    other = b'{"kind":"progress","source":"B","seq":9,"cvv":{}}\n'
    data = fixed + spaced + other
    cvv: dict[str, int] = {}
    seqs, starts, others = index_records(data, cvv)
    assert (seqs, starts) == ([1], [0])  # The spaced event is left to the JSON decoder.
    assert others == [(len(fixed), len(fixed) + len(spaced)), (len(fixed) + len(spaced), len(data))]
    assert cvv == {"A": 1}
    seqs, starts, others = index_records(fixed + other, cvv)
    assert (seqs, starts, others) == ([1], [0], [(len(fixed), len(fixed) + len(other))])


def test_payloads_that_mimic_record_fields_fool_nothing() -> None:
    tricky = {"kind": "event", "seq": 99, "emitter": "Z", "ts": {"Z": 7},
              "payload": {"system": {"type": "retired", "location": "A"}},
              "note": '"payload":{"system": and \\" quotes \n newlines'}  # fmt: skip
    event = Event("A", VectorClock({"A": 3}), tricky)
    line = encode_event(5, event).line(5)
    ((_, _, raw),) = split_records(line)[0]
    assert raw is not None and raw.emitter == "A" and raw.ts == {"A": 3} and not raw.is_system
    lines, stamps, systems, _ = _pass_events(line, {}, None, 1)
    assert systems == [] and stamps == [b'"A":3'] and parse_event(lines[0]).event() == event
    # A system event is one.
    system = Event("A", VectorClock({"A": 4}), {"system": {"type": "retired", "location": "B"}})
    _, _, systems, _ = _pass_events(encode_event(1, system).line(1), {}, None, 1)
    assert [s.event() for s in systems] == [system]


def model_history(rng: random.Random) -> list[LocationModel]:
    """Four locations of the in-memory model after emits and replication rounds at random (a
    valid causal history)."""
    locations = [LocationModel(n) for n in ("A", "B", "C", "D")]
    for _ in range(rng.randrange(5, 60)):
        if rng.random() < 0.5:
            rng.choice(locations).emit({"n": rng.randrange(100)})
        else:
            source, target = rng.sample(locations, 2)
            replicate(source, target, limit=rng.randrange(1, 10))
    return locations


@settings(max_examples=100)
@given(st.randoms(use_true_random=False))
def test_the_own_entry_filter_is_the_causality_filter_on_model_histories(
    rng: random.Random,
) -> None:
    """Locations of the in-memory model emit and replicate at random (valid causal histories);
    for every pair, the events of one log that the fast filter passes against the other's CVV
    are exactly those whose timestamps are not <= it; merged stamps are the lub."""
    locations = model_history(rng)
    for source in locations:
        data = b"".join(encode_event(s.seq, s.event).line(s.seq) for s in source.log)
        for target in locations:
            passed, stamps, _, _ = _pass_events(data, target.cvv.to_json(), None, None)
            expected = [s for s in source.log if not s.event.timestamp <= target.cvv]
            assert [parse_event(line).seq for line in passed] == [s.seq for s in expected]
            merged: dict[str, int] = {}
            merge_stamps(stamps, merged)
            assert VectorClock(merged) == lub(s.event.timestamp for s in expected)


@settings(max_examples=100)
@given(st.randoms(use_true_random=False))
def test_the_group_rule_stops_where_the_model_stops(rng: random.Random) -> None:
    """A filtered connection into an unfiltered group: the batch stops at the first event whose
    timestamp restricted to the group is not <= the target's CVV, as the model's
    `write_batch(cycle=...)` does."""
    from replication.model import read_batch, write_batch

    locations = model_history(rng)
    d, b = locations[3], locations[1]
    group = ["A", "B", "C"]
    batch = read_batch(d, b)
    data = b"".join(encode_event(s.seq, s.event).line(s.seq) for s in batch.events)
    passed, _, _, stopped = _pass_events(data, b.cvv.to_json(), None, None, group)
    written = write_batch(b, batch, cycle=group)
    assert [parse_event(line).event() for line in passed] == [s.event for s in written]
    assert (stopped - 1 if stopped else batch.through_seq) == b.progress["D"]
