"""Path postfix templates: the forms users write, Go time layouts, and what is refused."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.fragment.postfix import (
    GO_ZERO_TIME,
    TemplateError,
    compile_template,
    format_go_time,
    validate_template,
)
from broker.protocol import protocol_pb2 as pb

SPEC = pb.JournalSpec(
    name="examples/stream-sum/chunks",
    replication=3,
    max_append_rate=4096,
    fragment=pb.JournalSpec.Fragment(length=1 << 28, compression_codec=pb.ZSTANDARD),
)
FRAGMENT = pb.Fragment(
    journal="examples/stream-sum/chunks",
    begin=0x1000,
    end=0x2345,
    compression_codec=pb.SNAPPY,
    mod_time=0,
)
WHEN = datetime(2019, 11, 19, 22, 5, 7, 123456, tzinfo=UTC)  # A Tuesday; day 323 of the year.
DATE_HOUR = (
    'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}'
    '/hour={{ .Spool.FirstAppendTime.Format "15" }}'
)


def render(
    template: str,
    when: datetime | None = WHEN,
    *,
    spec: pb.JournalSpec = SPEC,
    fragment: pb.Fragment = FRAGMENT,
) -> str:
    return compile_template(template).render(spec=spec, fragment=fragment, first_append_time=when)


# --- Templates as users write them ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # The protocol's documented example, and its form split over lines.
        (DATE_HOUR, "date=2019-11-19/hour=22"),
        (
            'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}/hour={{\n'
            '    .Spool.FirstAppendTime.Format "15" }}',
            "date=2019-11-19/hour=22",
        ),
        # Without spaces inside the braces.
        (
            'utc_date={{.Spool.FirstAppendTime.Format "2006-01-02"}}'
            '/utc_hour={{.Spool.FirstAppendTime.Format "15"}}',
            "utc_date=2019-11-19/utc_hour=22",
        ),
        ('{{.Spool.FirstAppendTime.Format "2006"}}', "2019"),
        ("foo={{ .Spool.Begin }}", "foo=4096"),
        ("nanos={{ .Spool.FirstAppendTime.Nanosecond }}", "nanos=123456000"),
        ("", ""),
        ("static/part", "static/part"),
    ],
)
def test_templates_users_write(template: str, expected: str) -> None:
    assert render(template) == expected
    validate_template(template)


def test_zero_time_when_the_spool_has_no_first_append() -> None:
    # As upstream's spec validation evaluates templates: against Go's zero time.Time.
    assert render(DATE_HOUR, None) == "date=0001-01-01/hour=00"
    assert render("{{ .Spool.FirstAppendTime.Unix }}", None) == "-62135596800"
    assert render("{{ .Spool.FirstAppendTime.Weekday }}", None) == "Monday"
    assert datetime(1, 1, 1, tzinfo=UTC) == GO_ZERO_TIME


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        (".Spool.Journal", FRAGMENT.journal),
        (".Spool.Begin", str(FRAGMENT.begin)),
        (".Spool.End", str(FRAGMENT.end)),
        (".Spool.ModTime", "0"),
        (".Spool.CompressionCodec", "SNAPPY"),
        (".JournalSpec.Name", SPEC.name),
        (".JournalSpec.Replication", "3"),
        (".JournalSpec.MaxAppendRate", "4096"),
        (".JournalSpec.Fragment.Length", str(1 << 28)),
        (".JournalSpec.Fragment.CompressionCodec", "ZSTANDARD"),
        # The spec is embedded in upstream's data: its fields are also reachable directly.
        (".Name", SPEC.name),
        (".Replication", "3"),
        (".MaxAppendRate", "4096"),
    ],
)
def test_fields(field: str, expected: str) -> None:
    assert render(f"{{{{ {field} }}}}") == expected


def test_fields_of_zero_values_and_unnamed_codecs() -> None:
    empty = pb.Fragment(journal="a/journal")
    assert render("{{ .Spool.CompressionCodec }}", fragment=empty) == "INVALID"
    odd = pb.Fragment(journal="a/journal", compression_codec=99)
    assert render("{{ .Spool.CompressionCodec }}", fragment=odd) == "99"


_TIME_ACCESSORS: list[tuple[str, Callable[[datetime], str]]] = [
    ("Year", lambda t: str(t.year)),
    ("Month", lambda t: t.strftime("%B")),
    ("Day", lambda t: str(t.day)),
    ("Hour", lambda t: str(t.hour)),
    ("Minute", lambda t: str(t.minute)),
    ("Second", lambda t: str(t.second)),
    ("Nanosecond", lambda t: str(t.microsecond * 1000)),
    ("YearDay", lambda t: str(int(t.strftime("%j")))),
    ("Weekday", lambda t: t.strftime("%A")),
    ("Unix", lambda t: str(int(t.timestamp()))),
]


@pytest.mark.parametrize(("method", "expect"), _TIME_ACCESSORS)
def test_time_accessors(method: str, expect: Callable[[datetime], str]) -> None:
    for when in [
        WHEN,
        datetime(2024, 2, 29, 0, 0, 59, tzinfo=UTC),
        datetime(1999, 12, 31, 23, 59, 0, 7, tzinfo=UTC),
    ]:
        assert render(f"x={{{{ .Spool.FirstAppendTime.{method} }}}}", when) == f"x={expect(when)}"


def test_times_are_rendered_in_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    assert render(DATE_HOUR, datetime(2020, 1, 1, 1, 30, tzinfo=plus_two)) == (
        "date=2019-12-31/hour=23"
    )
    with pytest.raises(ValueError, match="has no timezone"):
        render(DATE_HOUR, datetime(2020, 1, 1))


def test_registers_are_accepted() -> None:
    registers = pb.LabelSet(labels=[pb.Label(name="owner", value="me")])
    out = compile_template(DATE_HOUR).render(
        spec=SPEC, fragment=FRAGMENT, first_append_time=WHEN, registers=registers
    )
    assert out == "date=2019-11-19/hour=22"


# --- Go reference-time layouts --------------------------------------------------------------------

_T = WHEN


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("2006", _T.strftime("%Y")),
        ("06", _T.strftime("%y")),
        ("01", _T.strftime("%m")),
        ("1", str(_T.month)),
        ("Jan", _T.strftime("%b")),
        ("January", _T.strftime("%B")),
        ("Mon", _T.strftime("%a")),
        ("Monday", _T.strftime("%A")),
        ("02", _T.strftime("%d")),
        ("2", str(_T.day)),
        ("002", _T.strftime("%j")),
        ("15", _T.strftime("%H")),
        ("03", _T.strftime("%I")),
        ("3", str(int(_T.strftime("%I")))),
        ("04", _T.strftime("%M")),
        ("4", str(_T.minute)),
        ("05", _T.strftime("%S")),
        ("5", str(_T.second)),
        ("PM", _T.strftime("%p")),
        ("pm", _T.strftime("%p").lower()),
        ("MST", "UTC"),
        ("-0700", "+0000"),
        ("-07", "+00"),
        ("-070000", "+000000"),
        ("Z0700", "Z"),
        ("Z07:00", "Z"),
        ("Z07", "Z"),
        ("Z070000", "Z"),
        ("Z07:00:00", "Z"),
        (".000", "." + _T.strftime("%f")[:3]),
        (".000000000", "." + _T.strftime("%f") + "000"),
        (".999999999", "." + _T.strftime("%f").rstrip("0")),
        (".9", ".1"),
        # Not elements: "Jan"/"Mon" before a lower-case letter, "_" before "2006", digits after
        # a fractional run, and the digits Go gives no meaning.
        ("Janet", "Janet"),
        ("Monk", "Monk"),
        ("_2006", "_" + _T.strftime("%Y")),
        (".0001", ".00" + _T.strftime("%m")),
        ("789", "789"),
        ("0", "0"),
        ("2006=01=02/15", _T.strftime("%Y=%m=%d/%H")),
    ],
)
def test_go_layouts(layout: str, expected: str) -> None:
    assert format_go_time(WHEN, layout) == expected
    assert render(f'{{{{ .Spool.FirstAppendTime.Format "{layout}" }}}}') == expected


def test_go_layouts_for_twelve_hour_clock_and_small_values() -> None:
    morning = datetime(2021, 3, 4, 0, 7, 9, tzinfo=UTC)
    assert format_go_time(morning, "3=03=PM=pm=4=5=1=2=002") == "12=12=AM=am=7=9=3=4=063"
    noon = datetime(2021, 3, 4, 12, 0, 0, tzinfo=UTC)
    assert format_go_time(noon, "3PM") == "12PM"
    # Trimmed fractions print nothing, separator included, when they are all zero.
    assert format_go_time(noon, "05.999") == "00"
    assert format_go_time(noon, "05.000") == "00.000"


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        # Go's own layout constants, formatting the Go playground's time (2009-11-10 23:00 UTC),
        # with the outputs Go's documentation shows.
        ("2006-01-02T15:04:05Z07:00", "2009-11-10T23:00:00Z"),  # time.RFC3339
        ("Mon Jan _2 15:04:05 2006", "Tue Nov 10 23:00:00 2009"),  # time.ANSIC
        ("Mon Jan _2 15:04:05 MST 2006", "Tue Nov 10 23:00:00 UTC 2009"),  # time.UnixDate
        ("02 Jan 06 15:04 -0700", "10 Nov 09 23:00 +0000"),  # time.RFC822Z
        ("Mon, 02 Jan 2006 15:04:05 MST", "Tue, 10 Nov 2009 23:00:00 UTC"),  # time.RFC1123
        ("3:04PM", "11:00PM"),  # time.Kitchen
        ("2006-01-02 15:04:05.999999999 -0700 MST", "2009-11-10 23:00:00 +0000 UTC"),
        ("-07:00 -07:00:00", "+00:00 +00:00:00"),
        ("Jan _2 __2 ,000", "Nov 10 314 ,000"),
    ],
)
def test_go_layout_constants(layout: str, expected: str) -> None:
    assert format_go_time(datetime(2009, 11, 10, 23, 0, 0, tzinfo=UTC), layout) == expected


def test_space_padding_layouts() -> None:
    early = datetime(2009, 1, 5, tzinfo=UTC)
    assert format_go_time(early, "_2|__2") == " 5|  5"


_ELEMENTS: list[tuple[str, Callable[[datetime], str]]] = [
    ("2006", lambda t: t.strftime("%Y")),
    ("06", lambda t: t.strftime("%y")),
    ("01", lambda t: t.strftime("%m")),
    ("1", lambda t: str(t.month)),
    ("Jan", lambda t: t.strftime("%b")),
    ("January", lambda t: t.strftime("%B")),
    ("Mon", lambda t: t.strftime("%a")),
    ("Monday", lambda t: t.strftime("%A")),
    ("02", lambda t: t.strftime("%d")),
    ("2", lambda t: str(t.day)),
    ("002", lambda t: t.strftime("%j")),
    ("15", lambda t: t.strftime("%H")),
    ("03", lambda t: t.strftime("%I")),
    ("3", lambda t: str(int(t.strftime("%I")))),
    ("04", lambda t: t.strftime("%M")),
    ("4", lambda t: str(t.minute)),
    ("05", lambda t: t.strftime("%S")),
    ("5", lambda t: str(t.second)),
    ("PM", lambda t: t.strftime("%p")),
    ("pm", lambda t: t.strftime("%p").lower()),
    ("MST", lambda t: t.strftime("%Z")),
    ("-0700", lambda t: t.strftime("%z")),
    ("Z07", lambda _: "Z"),
    (".000", lambda t: "." + t.strftime("%f")[:3]),
    (".000000", lambda t: "." + t.strftime("%f")),
    (".999", lambda t: ("." + t.strftime("%f")[:3].rstrip("0")).rstrip(".")),
]
# strftime pads %Y to four digits only from year 1000 on (glibc).
_TIMES = st.datetimes(min_value=datetime(1000, 1, 1), max_value=datetime(9999, 12, 31)).map(
    lambda t: t.replace(tzinfo=UTC)
)


@settings(max_examples=300, deadline=None)
@given(_TIMES)
def test_date_hour_template_matches_strftime(when: datetime) -> None:
    assert render(DATE_HOUR, when) == when.strftime("date=%Y-%m-%d/hour=%H")


@settings(max_examples=300, deadline=None)
@given(_TIMES, st.lists(st.sampled_from(_ELEMENTS), min_size=1, max_size=8))
def test_layouts_match_strftime(
    when: datetime, elements: list[tuple[str, Callable[[datetime], str]]]
) -> None:
    layout = "=".join(go for go, _ in elements)
    expected = "=".join(expect(when) for _, expect in elements)
    assert format_go_time(when, layout) == expected
    assert render(f"t={{{{ .Spool.FirstAppendTime.Format `{layout}` }}}}", when) == f"t={expected}"


# --- Trimming, comments and strings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("a  {{- .Spool.Begin -}}  /b", "a4096/b"),
        ("x=\n\t {{- .Spool.Begin }}", "x=4096"),
        ("{{ .Spool.Begin -}}\r\n\t /y", "4096/y"),
        ("a{{- .Spool.Begin}}", "a4096"),  # Nothing to trim.
        ("a{{/* a comment, with spaces */}}b", "ab"),
        ("a {{- /* trimmed\n on both sides */ -}} b", "ab"),
        ("d={{ .Spool.FirstAppendTime.Format `2006` }}", "d=2019"),
        ('d={{ .Spool.FirstAppendTime.Format "\\u00412006\\x2d01" }}', "d=A2019-11"),
    ],
)
def test_trimming_comments_and_strings(template: str, expected: str) -> None:
    assert render(template) == expected


def test_right_delimiter_inside_a_string_does_not_close_the_action() -> None:
    with pytest.raises(TemplateError, match=r"the layout '}}' writes '}'"):
        compile_template('{{ .Spool.FirstAppendTime.Format "}}" }}')


# --- Refused templates ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{{ bad template", 'the action at index 0 is never closed with "}}"'),
        ("a/{{ .Spool.Begin", "never closed"),
        ("{{}}", "is empty"),
        ("{{ }}", "is empty"),
        ("{{ .Spool }}", "the field .Spool is not supported"),
        ("{{ .Spool.Sum }}", "the field .Spool.Sum is not supported (supported: .Spool.Journal"),
        ("{{ .Spool.Registers }}", "the field .Spool.Registers is not supported"),
        ("{{ .spool.Begin }}", "the field .spool.Begin is not supported"),
        ("{{ .Foo }}", "the field .Foo is not supported"),
        ("{{ .Spool.FirstAppendTime }}", "alone prints with spaces"),
        ("{{ .Spool.FirstAppendTime.Format }}", "Format takes one layout string"),
        ('{{ .Spool.FirstAppendTime.Format "2006" "01" }}', "Format takes one layout string"),
        ("{{ .Spool.FirstAppendTime.Format .Spool.Begin }}", "the argument '.Spool.Begin'"),
        ("{{ .Spool.FirstAppendTime.Zone }}", "the method .Spool.FirstAppendTime.Zone is not"),
        ('{{ .Spool.FirstAppendTime.Year "x" }}', "takes no arguments"),
        ("{{ .Spool.FirstAppendTime.UTC.Year }}", ".UTC.Year is not supported"),
        ('{{ .Spool.Begin "x" }}', ".Spool.Begin is a field and takes no arguments"),
        ('{{ printf "%d" .Spool.Begin }}', "the function 'printf' is not supported"),
        ("{{ if .Name }}x{{ end }}", "the control keyword 'if' is not supported"),
        ("{{ $x := 1 }}", "the variable '$x' is not supported"),
        ("{{ . }}", "the data itself '.' is not supported"),
        ('{{ "text" }}', "the string constant 'text' is not supported"),
        ("{{ .Spool.Begin | printf }}", "pipelines and parentheses are not supported"),
        ("{{ (.Spool.Begin) }}", "'(.Spool.Begin)' is not supported"),
        ("{{-3}}", "'-3' is not supported"),
        ("{{.Spool.Begin-}}", "'.Spool.Begin-' is not supported"),
        ('{{.Spool.FirstAppendTime.Format"2006"}}', "is not supported"),
        ("{{ /* spaced comment */ }}", "'/*' is not supported"),
        ("{{/* unclosed }}", "the comment at index 0 is never closed with '*/'"),
        ("{{/* comment */ }}", "must end with '*/}}'"),
        ('{{ .Spool.FirstAppendTime.Format "2006 }}', "the string starting at index 33 is never"),
        ('{{ .Spool.FirstAppendTime.Format "20\n06" }}', "is never closed"),
        ('{{ .Spool.FirstAppendTime.Format "\\q" }}', "has an unknown or malformed escape \\q"),
        ('{{ .Spool.FirstAppendTime.Format "\\xff" }}', "is not a supported character"),
        # Output no fragment path can hold (fragments written there could not be listed back).
        ("a b", "the text 'a b' holds ' '"),
        ("x}}y", "holds '}'"),
        ("date:{{ .Spool.Begin }}", "holds ':'"),
        ('{{ .Spool.FirstAppendTime.Format "2006-01-02 15:04" }}', "writes ' '"),
        ('{{ .Spool.FirstAppendTime.Format "_2" }}', "pads with spaces"),
        ('{{ .Spool.FirstAppendTime.Format "__2" }}', "pads with spaces"),
        ('{{ .Spool.FirstAppendTime.Format "-07:00" }}', "with ':'"),
        ('{{ .Spool.FirstAppendTime.Format "05,000" }}', "with ','"),
        # Text that makes every rendered postfix one no fragment can be persisted under (found by
        # tests/test_fuzz.py: applied, then every persist of the journal failed, forever).
        ("../../other/journal", "must not hold '.' or '..' segments"),
        ("a/./{{ .Spool.Begin }}", "not a clean path"),
        ("a//b", "not a clean path"),
        ("date={{ .Spool.Begin }}/", "not a clean path"),
        ("/{{ .Spool.Begin }}", "must not begin with '/'"),
        (".", "must not hold '.' or '..' segments"),
    ],
)
def test_unsupported_templates_are_refused(template: str, problem: str) -> None:
    with pytest.raises(TemplateError) as caught:
        compile_template(template)
    message = str(caught.value)
    assert problem in message
    assert message.startswith(f"path postfix template {template!r}:")
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)
    with pytest.raises(TemplateError):
        validate_template(template)


def test_long_templates_are_shortened_in_messages() -> None:
    template = "x" * 300 + "{{ .Nope }}"
    with pytest.raises(TemplateError) as caught:
        compile_template(template)
    assert "(311 characters)" in str(caught.value)


@pytest.mark.parametrize(
    ("template", "name", "problem"),
    [
        ("{{ .JournalSpec.Name }}/x", "", "must not begin with '/'"),
        ("a/{{ .JournalSpec.Name }}", "", "not a clean path"),
        ("a/{{ .JournalSpec.Name }}", "/b", "not a clean path"),
        ("a/{{ .JournalSpec.Name }}/b", "..", "not a clean path"),
        ("{{ .JournalSpec.Name }}", "..", "must not hold '.' or '..' segments"),
        ("{{ .JournalSpec.Name }}/x", "../..", "must not hold '.' or '..' segments"),
        ("{{ .JournalSpec.Name }}", ".", "must not hold '.' or '..' segments"),
        ("{{ .JournalSpec.Name }}", "x" * 513, "too long"),
        ("{{ .JournalSpec.Name }}", "a b", "not allowed"),
    ],
)
def test_rendered_postfix_must_be_a_clean_relative_path(
    template: str, name: str, problem: str
) -> None:
    with pytest.raises(TemplateError) as caught:
        render(template, spec=pb.JournalSpec(name=name))
    message = str(caught.value)
    assert problem in message
    assert message.startswith(f"path postfix template {template!r} rendered ")


def test_rendered_postfix_may_contain_dots_within_segments() -> None:
    assert render("{{ .JournalSpec.Name }}", spec=pb.JournalSpec(name="..a/b..")) == "..a/b.."
    assert render("{{ .JournalSpec.Name }}", spec=pb.JournalSpec(name="x" * 512)) == "x" * 512
