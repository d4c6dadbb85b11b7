"""Message UUIDs: upstream's bit layout, clock arithmetic and monotonicity."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from message import uuid as mu
from message.uuid import Clock, Flags

producers = st.binary(min_size=6, max_size=6)
clocks = st.integers(min_value=0, max_value=2**64 - 1)
flag_values = st.integers(min_value=0, max_value=0x3FF)

SECOND = 1_000_000_000


@given(producers, clocks, flag_values)
def test_round_trip_over_the_whole_range(producer: bytes, clock: int, flags: int) -> None:
    u = mu.build(producer, clock, flags)
    assert mu.producer_of(u) == producer
    assert mu.clock_of(u) == clock
    assert mu.flags_of(u) == flags
    assert mu.parse(u) == (producer, clock, flags)
    assert mu.is_message_uuid(u)
    # Independent decoding by the standard library's reading of RFC 4122 fields.
    assert u.version == 1
    assert u.variant == uuid.RFC_4122
    assert u.time == clock >> 4
    assert u.node == int.from_bytes(producer, "big")
    assert u.clock_seq == ((clock & 0xF) << 10) | flags


def test_bit_positions_against_hand_computed_bytes() -> None:
    # clock = timestamp 0x123456789ABCDEF, counter 5; flags 0b1010101010.
    u = mu.build(bytes([1, 2, 3, 4, 5, 6]), 0x123456789ABCDEF5, 0x2AA)
    assert u.bytes == bytes.fromhex("89abcdef4567112396aa010203040506")
    b = u.bytes
    assert b[0:4] == bytes.fromhex("89abcdef")  # time_low: clock bits 4..35
    assert b[4:6] == bytes.fromhex("4567")  # time_mid: clock bits 36..51
    assert b[6] >> 4 == 1  # version nibble
    assert int.from_bytes(b[6:8], "big") & 0x0FFF == 0x123  # time_hi: clock bits 52..63
    word = int.from_bytes(b[8:10], "big")
    assert word >> 14 == 0b10  # RFC 4122 variant
    assert (word >> 10) & 0xF == 5  # sequence counter
    assert word & 0x3FF == 0x2AA  # flags
    assert b[10:16] == bytes([1, 2, 3, 4, 5, 6])  # producer


@pytest.mark.parametrize("bit", range(10))
def test_each_flag_bit_lands_in_its_own_position(bit: int) -> None:
    u = mu.build(bytes(6), 0, 1 << bit)
    assert int.from_bytes(u.bytes, "big") == (0x1000 << 64) | ((0x8000 | 1 << bit) << 48)
    assert mu.flags_of(u) == 1 << bit


@pytest.mark.parametrize("counter", range(16))
def test_each_counter_value_lands_in_bits_13_to_10(counter: int) -> None:
    u = mu.build(bytes(6), counter, 0)
    assert u.bytes[8:10] == (0x8000 | counter << 10).to_bytes(2, "big")
    assert u.bytes[:8] == bytes.fromhex("0000000000001000")
    assert mu.clock_of(u) == counter


def test_flag_values_match_upstream() -> None:
    assert (Flags.OUTSIDE_TXN, Flags.CONTINUE_TXN, Flags.ACK_TXN) == (0, 1, 2)
    u = mu.build(mu.new_producer_id(), 1 << 4, Flags.ACK_TXN)
    assert mu.flags_of(u) is Flags.ACK_TXN
    assert mu.flags_of(mu.build(bytes(6), 0, 0x3FF)) == 0x3FF


def test_upstream_uuid_building_vector() -> None:
    # From upstream's message/uuid_test.go TestUUIDBuilding: Update(time.Unix(1567304621,
    # 981273734)), two Ticks, flags 682; time read back is 1567304621 s + 981275700 ns.
    clock = Clock()
    clock.update_ns(1567304621 * SECOND + 981273734)
    clock.tick()
    clock.tick()
    expected_clock = ((1567304621 * 10**7 + 9812737 + mu.GREGORIAN_OFFSET) << 4) + 320
    assert clock.value == expected_clock == 0x1E9CC5F83FC2F950
    producer = bytes.fromhex("0123456789ab")
    u = mu.build(producer, clock.value, 682)
    # Expected UUID assembled from RFC 4122 fields with the standard library.
    ts = expected_clock >> 4
    assert u == uuid.UUID(
        fields=(
            ts & 0xFFFFFFFF,
            (ts >> 32) & 0xFFFF,
            (ts >> 48) | 0x1000,
            0x82,
            0xAA,
            0x0123456789AB,
        )
    )
    assert str(u) == "83fc2f95-cc5f-11e9-82aa-0123456789ab"
    assert u.time == clock.value >> 4  # as upstream's check against uuid.Time
    assert mu.to_unix_ns(mu.clock_of(u)) == 1567304621 * SECOND + 981275700
    assert mu.to_time(mu.clock_of(u)) == datetime(2019, 9, 1, 2, 23, 41, 981275, tzinfo=UTC)
    assert mu.parse(u) == (producer, expected_clock, 682)


def test_upstream_clock_vector() -> None:
    # Upstream's TestUUIDClock, with time.Unix(s, ns) as s * 1e9 + ns.
    clock = Clock()
    assert clock.tick() == 160
    assert clock.tick() == 320

    clock.update_ns(12 * SECOND + 300)
    assert clock.value == mu.from_unix_ns(12 * SECOND + 399)  # precise to 100 ns
    assert mu.to_unix_ns(clock.value) == 12 * SECOND + 300
    assert clock.value < mu.from_unix_ns(12 * SECOND + 400)
    assert clock.value > mu.from_unix_ns(12 * SECOND + 299)

    clock.tick()  # one microsecond
    assert mu.to_unix_ns(clock.value) == 12 * SECOND + 1300
    assert clock.value > mu.from_unix_ns(12 * SECOND + 1299)
    assert clock.value < mu.from_unix_ns(12 * SECOND + 1400)

    clock.update_ns(11 * SECOND + 100)  # never backwards
    assert mu.to_unix_ns(clock.value) == 12 * SECOND + 1300

    clock.update_ns(12 * SECOND + 5000)  # forwards resets the counter
    assert clock.value == mu.from_unix_ns(12 * SECOND + 5000)
    assert clock.value & 0xF == 0


def test_tick_is_one_microsecond_and_keeps_the_counter() -> None:
    clock = Clock(mu.from_unix_ns(0) | 7)
    assert clock.tick() == mu.from_unix_ns(1000) | 7
    assert mu.TICK == 160


def test_update_accepts_datetimes_and_unix_seconds() -> None:
    at = datetime(2024, 2, 29, 12, 0, 0, 123456, tzinfo=UTC)
    ns = int(at.timestamp()) * SECOND + 123456000
    assert mu.from_time(at) == mu.from_unix_ns(ns)
    assert mu.from_time(at.astimezone(timezone(timedelta(hours=-5)))) == mu.from_unix_ns(ns)
    assert mu.from_time(12.0000003) == mu.from_unix_ns(12 * SECOND + 300)
    assert mu.from_time(0.0) == mu.GREGORIAN_OFFSET << 4
    assert mu.to_time(mu.from_time(at)) == at
    clock = Clock()
    clock.update(at)
    assert clock.value == mu.from_time(at)
    clock.update(at.timestamp() - 1)
    assert clock.value == mu.from_time(at)
    before = time.time_ns()
    clock.update()
    assert mu.from_unix_ns(before) <= clock.value <= mu.from_unix_ns(time.time_ns())


def test_times_round_trip_to_100ns() -> None:
    cases = {
        0: 0,
        1: 0,
        99: 0,
        100: 100,
        12 * SECOND + 399: 12 * SECOND + 300,
        -SECOND: -SECOND,
        -150: -100,  # truncated toward zero, as Go's integer division
        1_700_000_000 * SECOND + 123_456_789: 1_700_000_000 * SECOND + 123_456_700,
    }
    for ns, expected in cases.items():
        assert mu.to_unix_ns(mu.from_unix_ns(ns)) == expected


@given(st.lists(st.integers(min_value=-(10**18), max_value=4 * 10**18), max_size=40))
def test_update_never_moves_back(times: list[int]) -> None:
    clock = Clock()
    high = 0
    for ns in times:
        clock.update_ns(ns)
        high = max(high, mu.from_unix_ns(ns))
        assert clock.value == high


def test_clocks_strictly_increase_across_ticks_and_updates() -> None:
    clock = Clock()
    last = -1
    now = time.time_ns()
    for i in range(20_000):
        if i % 7 == 0:
            clock.update()  # wall time: usually behind the ticked clock, so a no-op
        elif i % 11 == 0:
            clock.update_ns(now - i * 1000)  # the past: must not move the clock back
        elif i % 101 == 0:
            clock.update_ns(now + i * 5000)  # the future: jumps ahead
        value = clock.tick()
        assert value > last
        last = value
        assert mu.clock_of(mu.build(bytes(6), value, 0)) == value


def test_ticks_from_threads_are_unique() -> None:
    clock = Clock()
    seen: list[list[int]] = [[] for _ in range(4)]

    def run(out: list[int]) -> None:
        for _ in range(5_000):
            out.append(clock.tick())

    threads = [threading.Thread(target=run, args=(out,)) for out in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = [v for out in seen for v in out]
    assert len(set(values)) == 20_000
    assert clock.value == 20_000 * mu.TICK
    assert all(a < b for out in seen for a, b in itertools.pairwise(out))


def test_producer_ids_are_random_with_multicast_bit() -> None:
    ids = {mu.new_producer_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(p) == 6 and p[0] & 0x01 for p in ids)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((bytes(5), 0, 0), "must be 6 bytes"),
        ((bytes(7), 0, 0), "must be 6 bytes"),
        (("abcdef", 0, 0), "must be 6 bytes"),
        ((bytes(6), 0, 0x400), "0x3ff"),
        ((bytes(6), 0, -1), "0x3ff"),
        ((bytes(6), -1, 0), "out of range"),
        ((bytes(6), 2**64, 0), "out of range"),
    ],
)
def test_build_rejects_bad_input(args: tuple[object, int, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        mu.build(*args)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "u",
    [
        uuid.UUID("6f1c2a3e-9d4b-4c7e-8a1f-2b3c4d5e6f70"),  # version 4
        uuid.UUID(int=0),
        uuid.UUID("00000000-0000-1000-c000-000000000000"),  # v1, Microsoft variant
        uuid.UUID("00000000-0000-1000-0000-000000000000"),  # v1, NCS variant
        uuid.uuid5(uuid.NAMESPACE_DNS, "gazette.dev"),
    ],
)
def test_parsing_rejects_uuids_that_are_not_v1_rfc4122(u: uuid.UUID) -> None:
    assert not mu.is_message_uuid(u)
    for fn in (mu.producer_of, mu.clock_of, mu.flags_of, mu.parse):
        with pytest.raises(ValueError, match="not a message UUID") as err:
            fn(u)
        assert "\n" not in str(err.value)


def test_stdlib_v1_uuids_parse() -> None:
    u = uuid.uuid1(node=0x010203040506, clock_seq=0x1ABC)
    assert mu.producer_of(u) == bytes([1, 2, 3, 4, 5, 6])
    assert mu.clock_of(u) >> 4 == u.time
    assert mu.clock_of(u) & 0xF == (0x1ABC >> 10) & 0xF
    assert mu.flags_of(u) == 0x1ABC & 0x3FF


def test_time_range_and_naive_datetimes_are_rejected() -> None:
    with pytest.raises(ValueError, match="naive"):
        mu.from_time(datetime(2024, 1, 1))
    with pytest.raises(ValueError, match="outside the UUID clock range"):
        mu.from_time(datetime(1500, 1, 1, tzinfo=UTC))
    with pytest.raises(ValueError, match="finite"):
        mu.from_time(float("nan"))
    with pytest.raises(ValueError, match="out of range"):
        Clock(-1)


@given(producers, clocks, flag_values)
def test_parse_text_agrees_with_parse(producer: bytes, clock: int, flags: int) -> None:
    u = mu.build(producer, clock, flags)
    assert mu.parse_text(str(u)) == (producer, clock, flags)


@pytest.mark.parametrize(
    "text",
    [
        "6f1c2a3e-9d4b-4c7e-8a1f-2b3c4d5e6f70",  # not version 1 (version 4)
        "00000000-0000-1000-c000-000000000000",  # v1, Microsoft variant
        " 0075bcd-0000-1000-9402-010203040507",  # int() would take the space
        "0075bcd1-0000-1000-9402-0102030405_7",  # and the underscore
        "+075bcd1-0000-1000-9402-010203040507",  # and a sign
        "0075bcd1-0000-1000-9402-01020304050\u0663",  # and an Arabic-Indic digit
        "0075bcd1-0000-1000-9402-01020304050g",
        "0075bcd1-0000-1000-9402-0102030405070",  # 37 characters
        "0075bcd100001000940201020304050700000",  # no hyphens
        "0075bcd1-0000-1000-9402-01020304-507",  # a hyphen out of place
        "0x75bcd1-0000-1000-9402-010203040507",  # and a 0x (found by review)
    ],
)
def test_parse_text_rejects_what_is_not_a_canonical_message_uuid(text: str) -> None:
    with pytest.raises(ValueError) as err:
        mu.parse_text(text)
    assert "\n" not in str(err.value)
    # The stream parser too, also once the text's tail is known from a good UUID.
    parser = mu.TextParser()
    good = "0075bcd1" + text[8:]
    if len(text) == 36 and text[8:] == "-0000-1000-9402-010203040507":
        parser.fields(good)
    with pytest.raises(ValueError):
        parser.fields(text)


@given(producers, st.lists(st.tuples(clocks, flag_values), min_size=1, max_size=20))
def test_text_formatting_equals_the_uuid_text(
    producer: bytes, stamps: list[tuple[int, int]]
) -> None:
    formatter = mu.TextFormatter(producer)
    # Runs of ticks from each clock, as a publisher stamps them (the cached part then repeats).
    for start, flags in stamps:
        for clock in range(start, min(start + 5 * mu.TICK, mu.MAX_CLOCK + 1), mu.TICK):
            text = str(mu.build(producer, clock, flags))
            assert mu.text_of(producer.hex(), clock, flags) == text
            assert formatter.text(clock, flags) == text


@given(
    producers,
    flag_values,
    st.integers(min_value=0, max_value=(1 << 28) - 1),
    st.integers(min_value=0, max_value=15),
    st.integers(min_value=1, max_value=300),
    st.integers(min_value=-40, max_value=40),
)
def test_texts_of_a_run_of_ticks_equal_each_text(
    producer: bytes, flags: int, high: int, counter: int, count: int, shift: int
) -> None:
    # Runs that start near where the clock's bits above the first eight hex digits change (the
    # formatter's cached tail must change there), and runs that do not.
    start = max(0, (high << 36) + shift * mu.TICK) | counter
    if start + count * mu.TICK > mu.MAX_CLOCK:
        start = mu.MAX_CLOCK - count * mu.TICK
    texts = mu.TextFormatter(producer).texts(start, count, flags)
    assert texts == [str(mu.build(producer, start + i * mu.TICK, flags)) for i in range(count)]


def test_advance_many_reserves_distinct_increasing_clocks() -> None:
    clock = mu.Clock()
    first = clock.advance_many(5)
    # The five are first, first + TICK, ... first + 4 * TICK; the next begins after them.
    assert clock.value == first + 4 * mu.TICK
    after = clock.advance()
    assert after > first + 4 * mu.TICK
    ahead = mu.Clock(1 << 62)  # Ahead of wall time: it only ticks.
    assert ahead.advance_many(3) == (1 << 62) + mu.TICK
    assert ahead.value == (1 << 62) + 3 * mu.TICK
