"""Protocol validation: each rule accepts its boundary value and rejects the one just past it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from google.protobuf import duration_pb2

from broker.protocol import protocol_pb2 as pb
from broker.protocol.labels import label_set
from broker.protocol.validate import (
    ValidationError,
    clean_path,
    validate_apply_request,
    validate_broker_spec,
    validate_endpoint,
    validate_fragment_store,
    validate_header,
    validate_journal_name,
    validate_journal_spec,
    validate_label,
    validate_label_selector,
    validate_label_set,
    validate_list_request,
    validate_process_id,
    validate_route,
    validate_shard_id,
)

SECOND = 1_000_000_000


def duration(ns: int) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(ns)
    return out


def rejected(check: Callable[[], Any], field: str, *named: str) -> ValidationError:
    """Run `check`, expecting a ValidationError at `field` whose message contains `named`."""
    with pytest.raises(ValidationError) as info:
        check()
    err = info.value
    assert err.field == field, str(err)
    for text in named:
        assert text in str(err)
    assert "\n" not in str(err)
    assert str(err).startswith(f"{field}: " if field else "")
    return err


def journal_spec(**changes: Any) -> pb.JournalSpec:
    spec = pb.JournalSpec(
        name="a/journal",
        replication=3,
        labels=label_set(("aaa", "bbb")),
        fragment=pb.JournalSpec.Fragment(
            length=1 << 18,
            compression_codec=pb.GZIP,
            stores=["s3://bucket/path/", "gs://other-bucket/path/"],
            refresh_interval=duration(300 * SECOND),
            retention=duration(365 * 24 * 3600 * SECOND),
            path_postfix_template='date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}',
        ),
        flags=pb.JournalSpec.O_RDWR,
        max_append_rate=12345,
    )
    for path, value in changes.items():
        target: Any = spec
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            del getattr(target, leaf)[:]
            getattr(target, leaf).extend(value)
        elif isinstance(value, pb.LabelSet | duration_pb2.Duration):
            getattr(target, leaf).CopyFrom(value)
        else:
            setattr(target, leaf, value)
    return spec


def test_error_is_one_line_with_field_and_value() -> None:
    err = rejected(
        lambda: validate_journal_spec(journal_spec(fragment__length=100)),
        "fragment.length",
    )
    assert str(err) == "fragment.length: 100 is below the minimum 1024 (1 KiB)"
    assert err.value == 100
    assert isinstance(err, ValueError)
    # Values are quoted with what would break the line escaped (found by tests/test_fuzz.py:
    # NEL and the Unicode line separators end lines for str.splitlines and some terminals).
    err = rejected(lambda: validate_journal_name("a/b\u2028c\x85"), "journal")
    assert '"a/b\\u2028c\\u0085"' in str(err) and len(str(err).splitlines()) == 1


def test_valid_journal_spec() -> None:
    validate_journal_spec(journal_spec())


# --- Journal names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "abcd",  # Shortest.
        "a" * 512,  # Longest.
        "a/valid/path/to/a/journal",
        "with=equals%20and+plus_under.dot",
        "ünï/cødé",
        "../abc",  # Clean and not rooted, so upstream allows it.
    ],
)
def test_journal_name_accepted(name: str) -> None:
    validate_journal_name(name)


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("abc", '"abc" is too short (3 bytes; expected 4 to 512 bytes)'),
        ("a" * 513, "is too long (513 bytes"),
        ("é" * 257, "is too long (514 bytes"),  # Lengths are in UTF-8 bytes.
        ("/leading/slash", "\"/leading/slash\" must not begin with '/'"),
        (
            "trailing/slash/",
            '"trailing/slash/" is not a clean path (it cleans to "trailing/slash")',
        ),
        ("extra-middle//slash", '"extra-middle//slash" is not a clean path'),
        ("a/./b/c", "is not a clean path"),
        ("not a valid token", 'has the character " " at index 3'),
        ("a#bc", 'has the character "#"'),
        ("foo/bar;baz", 'has a metadata segment ";baz", which is not allowed here'),
    ],
)
def test_journal_name_rejected(name: str, named: str) -> None:
    rejected(lambda: validate_journal_name(name), "journal", named)


def test_journal_name_metadata_segment_where_allowed() -> None:
    validate_journal_name("foo/bar;baz/bing", allow_meta=True)
    validate_journal_name(
        "foo/bar/webhook;foo/bar/webhook/http%3A%2F%2Fexample.com%3A9000%2F", allow_meta=True
    )
    rejected(
        lambda: validate_journal_name("foo/bar;", allow_meta=True),
        "journal",
        'metadata segment of "foo/bar;"',
        "too short (0 bytes",
    )
    rejected(
        lambda: validate_journal_name("foo/bar;disallowed#rune", allow_meta=True),
        "journal",
        "metadata segment",
        '"#"',
    )
    rejected(lambda: validate_journal_name("foo/bar;a;b", allow_meta=True), "journal", '";"')
    rejected(
        lambda: validate_journal_spec(journal_spec(name="a/journal;meta")),
        "name",
        '";meta"',
    )


def test_clean_path_follows_go() -> None:
    assert clean_path("") == "."
    assert clean_path("a//b/./c/..") == "a/b"
    assert clean_path("a/../..") == ".."
    assert clean_path("/../a") == "/a"
    assert clean_path("//a/") == "/a"


# --- Labels ---------------------------------------------------------------------------------------


def test_label_bounds() -> None:
    validate_label(pb.Label(name="ab", value=""))
    validate_label(pb.Label(name="a" * 64, value="v" * 1024))
    validate_label(pb.Label(name="é" * 32, value="a%20value=x"))
    validate_label(pb.Label(name="a/label-x_y+z.w", value="a-value"))
    rejected(lambda: validate_label(pb.Label(name="a")), "label.name", '"a" is too short (1 byte')
    rejected(lambda: validate_label(pb.Label(name="a" * 65)), "label.name", "too long (65 bytes")
    rejected(lambda: validate_label(pb.Label(name="é" * 33)), "label.name", "too long (66 bytes")
    rejected(
        lambda: validate_label(pb.Label(name="ab", value="v" * 1025)),
        "label.value",
        "too long (1025 bytes; expected at most 1024 bytes)",
    )
    rejected(lambda: validate_label(pb.Label(name="a|label")), "label.name", '"|" at index 1')
    rejected(lambda: validate_label(pb.Label(name="a=b")), "label.name", '"="')
    rejected(lambda: validate_label(pb.Label(name="a%b")), "label.name", '"%"')
    rejected(
        lambda: validate_label(pb.Label(name="ab", value="a|value")), "label.value", '"a|value"'
    )
    rejected(
        lambda: validate_label(pb.Label(name="a-label:prefix", value="x")), "label.name", '":"'
    )


def test_label_prefix_only_in_selectors() -> None:
    prefixed = pb.LabelSet(labels=[pb.Label(name="ddd", value="666", prefix=True)])
    rejected(
        lambda: validate_label_set(prefixed),
        "labels[0].prefix",
        '"ddd" is a prefix match',
    )
    validate_label_set(prefixed, allow_prefix=True)
    validate_label_selector(pb.LabelSelector(include=prefixed))


def test_label_set_order_and_uniqueness() -> None:
    def labels(*items: tuple[str, str]) -> pb.LabelSet:
        return pb.LabelSet(labels=[pb.Label(name=n, value=v) for n, v in items])

    validate_label_set(labels(("aaa", "222"), ("aaa", "333"), ("bbb", ""), ("ccc", "1")))
    rejected(
        lambda: validate_label_set(labels(("bad label", "111"))),
        "labels[0].name",
        '"bad label"',
    )
    rejected(
        lambda: validate_label_set(labels(("bbb", "1"), ("aaa", "2"))),
        "labels[1].name",
        '"aaa" follows "bbb"',
    )
    rejected(
        lambda: validate_label_set(labels(("aaa", "444"), ("aaa", "333"))),
        "labels[1].value",
        '"333" follows "444"',
    )
    rejected(
        lambda: validate_label_set(labels(("aaa", "4"), ("aaa", "4"))),
        "labels[1].value",
        '"4" follows "4"',
    )
    rejected(
        lambda: validate_label_set(labels(("ccc", ""), ("ccc", "555"))),
        "labels[1].value",
        'has both the empty value and the value "555"',
    )


def test_label_selector_paths() -> None:
    bad = pb.LabelSet(labels=[pb.Label(name="bad label")])
    rejected(lambda: validate_label_selector(pb.LabelSelector(include=bad)), "include[0].name")
    rejected(
        lambda: validate_label_selector(pb.LabelSelector(exclude=bad), field="selector"),
        "selector.exclude[0].name",
        '"bad label"',
    )


@pytest.mark.parametrize(
    "labels",
    [
        [("aaa", "bar"), ("aaa", "baz"), ("content-type", "a/type")],
        [("app.gazette.dev/message-type", "T"), ("content-type", "application/x-ndjson")],
        [
            ("app.gazette.dev/message-subtype", "S"),
            ("app.gazette.dev/message-type", "T"),
            ("content-type", "application/x-ndjson"),
        ],
        [("content-type", "text")],  # A bare type parses, as in Go's mime package.
        [("content-type", "Text/X-Custom+json.v1%2")],
        [("app.gazette.dev/tag", "a"), ("app.gazette.dev/tag", "b")],  # Tags are multi-valued.
    ],
)
def test_journal_labels_accepted(labels: list[tuple[str, str]]) -> None:
    validate_journal_spec(journal_spec(labels=label_set(*labels)))


@pytest.mark.parametrize(
    ("labels", "field", "named"),
    [
        ([("name", "x")], "labels[0].name", '"name" is a meta-label'),
        ([("name", "")], "labels[0].name", '"name" is a meta-label'),  # Even when empty.
        ([("aaa", "x"), ("prefix", "a/")], "labels[1].name", '"prefix" is a meta-label'),
        (
            [("content-type", "a/type"), ("content-type", "other/type")],
            "labels[1].value",
            'label "content-type" may have only one value, but also has "other/type"',
        ),
        (
            [("app.gazette.dev/instance", "a"), ("app.gazette.dev/instance", "b")],
            "labels[1].value",
            '"b"',
        ),
        (
            [("content-type", "invalid/content/type")],
            "labels[0].value",
            '"invalid/content/type" is not a valid content-type (unexpected content',
        ),
        ([("content-type", "")], "labels[0].value", '"" is not a valid content-type (no media'),
        ([("content-type", "text/")], "labels[0].value", "expected a subtype"),
        ([("content-type", "text=x")], "labels[0].value", "expected '/' after the type"),
        ([("content-type", "text/x=y")], "labels[0].value", '"text/x=y"'),
        ([("content-type", "tëxt/plain")], "labels[0].value", "expected '/' after the type"),
        ([("content-type", "é/plain")], "labels[0].value", "no media type"),
        (
            [("app.gazette.dev/message-type", "T")],
            "labels[0].name",
            'label "app.gazette.dev/message-type" requires a "content-type" label',
        ),
        (
            [("app.gazette.dev/message-subtype", "S")],
            "labels[0].name",
            'requires a "app.gazette.dev/message-type" label',
        ),
        (
            [("app.gazette.dev/message-subtype", "S"), ("app.gazette.dev/message-type", "T")],
            "labels[1].name",
            'requires a "content-type" label',
        ),
    ],
)
def test_journal_labels_rejected(labels: list[tuple[str, str]], field: str, named: str) -> None:
    rejected(lambda: validate_journal_spec(journal_spec(labels=label_set(*labels))), field, named)


# --- Journal specs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"replication": 1},
        {"replication": 5},
        {"fragment__length": 1024},
        {"fragment__length": 1 << 34},
        {"fragment__compression_codec": pb.NONE},
        {"fragment__compression_codec": pb.GZIP_OFFLOAD_DECOMPRESSION},
        {"fragment__stores": []},
        {"fragment__stores": ["s3://bucket/?profile=x&endpoint=http%3A%2F%2Fminio%3A9000"]},
        {"fragment__stores": ["gs://bucket/a%2F"]},  # The decoded path ends in '/'.
        {"fragment__stores": ["s3://b/p/", "file:///mnt/path/"]},
        {
            "fragment__compression_codec": pb.GZIP_OFFLOAD_DECOMPRESSION,
            "fragment__stores": ["s3://b/p/", "file:///mnt/path/"],
        },
        {"fragment__refresh_interval": duration(SECOND)},
        {"fragment__refresh_interval": duration(24 * 3600 * SECOND)},
        {"fragment__flush_interval": duration(0)},
        {"fragment__flush_interval": duration(60 * SECOND)},
        {"fragment__retention": duration(-SECOND)},
        {"fragment__path_postfix_template": ""},
        {"fragment__path_postfix_template": "}} stray closer is text"},
        {"flags": pb.JournalSpec.NOT_SPECIFIED},
        {"flags": pb.JournalSpec.O_RDONLY},
        {"flags": pb.JournalSpec.O_WRONLY},
        {"max_append_rate": 0},
        {"suspend__level": pb.JournalSpec.Suspend.FULL, "suspend__offset": 1234},
        {"suspend__offset": 0},
    ],
)
def test_journal_spec_accepted(changes: dict[str, Any]) -> None:
    validate_journal_spec(journal_spec(**changes))


@pytest.mark.parametrize(
    ("changes", "field", "named"),
    [
        ({"name": "/bad/name"}, "name", '"/bad/name"'),
        ({"replication": 0}, "replication", "0 is outside the allowed range 1 to 5"),
        ({"replication": 6}, "replication", "6 is outside"),
        ({"replication": -1}, "replication", "-1 is outside"),
        ({"fragment__length": 1023}, "fragment.length", "1023 is below the minimum 1024 (1 KiB)"),
        (
            {"fragment__length": (1 << 34) + 1},
            "fragment.length",
            "17179869185 is above the maximum 17179869184 (16 GiB)",
        ),
        (
            {"fragment__compression_codec": pb.INVALID},
            "fragment.compression_codec",
            "INVALID is not a valid compression codec (expected one of NONE, GZIP,",
        ),
        ({"fragment__compression_codec": 9999}, "fragment.compression_codec", "9999 is not"),
        (
            {"fragment__stores": ["s3://b/p/", "invalid"]},
            "fragment.stores[1]",
            '"invalid" is not a valid fragment store: it is not an absolute URL',
        ),
        (
            {
                "fragment__compression_codec": pb.GZIP_OFFLOAD_DECOMPRESSION,
                "fragment__stores": ["file:///a/root/"],
            },
            "fragment.stores[0]",
            '"file:///a/root/" is a file:// store, which GZIP_OFFLOAD_DECOMPRESSION cannot use',
        ),
        (
            {"fragment__refresh_interval": duration(SECOND - 1)},
            "fragment.refresh_interval",
            "999.999999ms is below the minimum 1s",
        ),
        (
            {"fragment__refresh_interval": duration(1_000_000)},
            "fragment.refresh_interval",
            "1ms is below the minimum 1s",
        ),
        (
            {"fragment__refresh_interval": duration(0)},
            "fragment.refresh_interval",
            "0s is below the minimum 1s",
        ),
        (
            {"fragment__refresh_interval": duration(25 * 3600 * SECOND)},
            "fragment.refresh_interval",
            "25h0m0s is above the maximum 24h0m0s",
        ),
        (
            {"fragment__refresh_interval": duration(24 * 3600 * SECOND + 1)},
            "fragment.refresh_interval",
            "24h0m0.000000001s is above",
        ),
        (
            {"fragment__flush_interval": duration(59 * SECOND)},
            "fragment.flush_interval",
            "59s is below the minimum 1m0s",
        ),
        (
            {"fragment__flush_interval": duration(-SECOND)},
            "fragment.flush_interval",
            "-1s is below",
        ),
        (
            {"fragment__path_postfix_template": "{{ bad template"},
            "fragment.path_postfix_template",
            '"{{ bad template" is not a valid template: the action opened at index 0',
        ),
        ({"flags": 3}, "flags", "3 is not a permitted flag combination"),
        ({"flags": 6}, "flags", "6 is not"),
        ({"flags": 8}, "flags", "8 is not"),
        ({"max_append_rate": -1}, "max_append_rate", "-1 is negative"),
        ({"suspend__level": 3}, "suspend.level", "3 is not a suspension level"),
        ({"suspend__offset": -1}, "suspend.offset", "-1 is negative"),
    ],
)
def test_journal_spec_rejected(changes: dict[str, Any], field: str, named: str) -> None:
    rejected(lambda: validate_journal_spec(journal_spec(**changes)), field, named)


# --- Fragment stores and endpoints ----------------------------------------------------------------


@pytest.mark.parametrize(
    "store",
    [
        "s3://my-bucket/?query",
        "s3://my-bucket/subpath/?query",
        "S3://my-bucket/",  # Schemes are case-insensitive.
        "gs://bucket/a/",
        "azure://container/prefix/",
        "azure-ad://tenant-id/account/container/",
        "azure-ad://tenant-id/account/container/prefix/",
        "file:///mnt/path/",
        "file:///mnt/path/?query",
        "file:/mnt/path/",
    ],
)
def test_fragment_store_accepted(store: str) -> None:
    validate_fragment_store(store)


@pytest.mark.parametrize(
    ("store", "named"),
    [
        ("s3://my-bucket", "its path \"\" does not end in '/'"),
        ("s3://my-bucket/subpath?query", "its path \"/subpath\" does not end in '/'"),
        (":garbage: :garbage:", "missing a scheme"),
        ("foobar://baz/", 'scheme "foobar" is not one of s3, gs, azure, azure-ad, file'),
        ("/baz/bing/", "not an absolute URL"),
        ("gs:///baz/bing/", "names no bucket"),
        ("s3://user@/baz/", "names no bucket"),
        ("file://host/mnt/path/", "a file:// store cannot have a host"),
        ("file:///mnt/path", "does not end in '/'"),
        ("file:mnt/path/", "does not end in '/'"),  # Opaque: no path at all.
        ("azure-ad:///account/container/", "names no tenant ID"),
        ("azure-ad://tenant//container/", "names no storage account"),
        ("azure-ad://tenant/account/", "names no storage container"),
        ("azure-ad://tenant/account", "names no storage container"),
        ("azure-ad://tenant", "names no storage account"),
        ("s3://bucket/%zz/", 'invalid escape "%zz" in its path'),
        ("s3://bu cket/", 'its host has the invalid character " "'),
        ("s3://bucket:x/", 'its port "x" is not a number'),
        ("s3://bucket/\x00/", "control character"),
    ],
)
def test_fragment_store_rejected(store: str, named: str) -> None:
    rejected(lambda: validate_fragment_store(store), "store", named)


def test_endpoint() -> None:
    validate_endpoint("http://host:1234/path?query")
    validate_endpoint("unix://localhost/tmp/gazette.sock")
    validate_endpoint("http://[::1]:8080")
    rejected(lambda: validate_endpoint(":garbage: :garbage:"), "endpoint", '":garbage: :garbage:"')
    rejected(lambda: validate_endpoint("/baz/bing"), "endpoint", "not an absolute URL")
    rejected(lambda: validate_endpoint("http:///baz/bing"), "endpoint", "it has no host")
    rejected(lambda: validate_endpoint(""), "endpoint", '"" is not a valid endpoint')
    rejected(lambda: validate_endpoint("http://host:80x"), "endpoint", 'port "80x"')


# --- Processes, brokers, routes, headers ----------------------------------------------------------


def test_process_id_bounds() -> None:
    validate_process_id(pb.ProcessSpec.ID(zone="z", suffix="abcd"))
    validate_process_id(pb.ProcessSpec.ID(zone="z" * 32, suffix="s" * 128))
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="", suffix="abcd")), "id.zone", '""'
    )
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="z" * 33, suffix="abcd")),
        "id.zone",
        "too long (33 bytes; expected 1 to 32 bytes)",
    )
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="z", suffix="abc")),
        "id.suffix",
        '"abc" is too short (3 bytes; expected 4 to 128 bytes)',
    )
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="z", suffix="s" * 129)),
        "id.suffix",
        "too long (129 bytes",
    )
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="a#b", suffix="abcd")),
        "id.zone",
        '"#"',
    )
    rejected(
        lambda: validate_process_id(pb.ProcessSpec.ID(zone="ab", suffix="ab=cd")),
        "id.suffix",
        '"="',
    )


def broker_spec(**changes: Any) -> pb.BrokerSpec:
    spec = pb.BrokerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone="us-east", suffix="broker-1"),
            endpoint="http://broker-1:8080",
        ),
        journal_limit=1024,
    )
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def test_broker_spec() -> None:
    validate_broker_spec(broker_spec())
    validate_broker_spec(broker_spec(journal_limit=131072))
    rejected(
        lambda: validate_broker_spec(broker_spec(journal_limit=131073)),
        "journal_limit",
        "131073 is above the maximum 131072",
    )
    no_endpoint = broker_spec()
    no_endpoint.process_spec.endpoint = "/not/absolute"
    rejected(
        lambda: validate_broker_spec(no_endpoint),
        "process_spec.endpoint",
        '"/not/absolute"',
    )
    bad_zone = broker_spec()
    bad_zone.process_spec.id.zone = ""
    rejected(lambda: validate_broker_spec(bad_zone), "process_spec.id.zone")


def member(zone: str, suffix: str) -> pb.ProcessSpec.ID:
    return pb.ProcessSpec.ID(zone=zone, suffix=suffix)


def test_route() -> None:
    members = [
        member("zone-a", "member-1"),
        member("zone-a", "member-2"),
        member("zone-b", "member-3"),
    ]
    validate_route(pb.Route(primary=-1))
    validate_route(pb.Route(members=members, primary=2, endpoints=["http://a", "", "http://c"]))
    rejected(
        lambda: validate_route(pb.Route(members=[members[1], members[0]], primary=-1)),
        "members[1]",
        '"zone-a#member-1" follows "zone-a#member-2"',
    )
    rejected(
        lambda: validate_route(pb.Route(members=[members[0], members[0]], primary=-1)),
        "members[1]",
    )
    rejected(
        lambda: validate_route(pb.Route(members=[member("zone", "bad")], primary=-1)),
        "members[0].suffix",
    )
    rejected(
        lambda: validate_route(pb.Route(members=members, primary=3)),
        "primary",
        "3 is not -1 or the index of one of the 3 members",
    )
    rejected(lambda: validate_route(pb.Route(primary=-2)), "primary", "-2 is not")
    rejected(
        lambda: validate_route(pb.Route(members=members, primary=0, endpoints=["http://a"])),
        "endpoints",
        "1 endpoints for 3 members",
    )
    rejected(
        lambda: validate_route(
            pb.Route(members=members, primary=0, endpoints=["http://a", "bad", ""])
        ),
        "endpoints[1]",
        '"bad"',
    )


def header(**etcd: int) -> pb.Header:
    fields = {"cluster_id": 12, "member_id": 34, "revision": 56, "raft_term": 78} | etcd
    return pb.Header(
        process_id=member("zone", "broker-1"),
        route=pb.Route(members=[member("zone", "broker-1")], primary=0),
        etcd=pb.Header.Etcd(**fields),
    )


def test_header() -> None:
    validate_header(header())
    validate_header(header(revision=1))
    unset_process = header()
    unset_process.ClearField("process_id")  # An unset process ID is not checked.
    validate_header(unset_process)
    for name in ("cluster_id", "member_id", "raft_term"):
        rejected(
            partial(validate_header, header(**{name: 0})),
            f"etcd.{name}",
            "0 is not valid (expected non-zero)",
        )
    rejected(lambda: validate_header(header(revision=0)), "etcd.revision", "0 is not positive")
    rejected(lambda: validate_header(header(revision=-1)), "etcd.revision", "-1 is not positive")
    bad = header()
    bad.process_id.suffix = "x"
    rejected(lambda: validate_header(bad), "process_id.suffix", '"x"')
    bad = header()
    bad.route.primary = 1
    rejected(lambda: validate_header(bad, field="header"), "header.route.primary")


# --- Requests -------------------------------------------------------------------------------------


def test_list_request() -> None:
    def request(include: pb.LabelSet, exclude: pb.LabelSet | None = None) -> pb.ListRequest:
        return pb.ListRequest(selector=pb.LabelSelector(include=include, exclude=exclude))

    validate_list_request(pb.ListRequest())
    validate_list_request(request(label_set(("prefix", "a/b/")), label_set(("prefix", "a/c/"))))
    # A watch_resume header is not validated, as upstream: only its revision is used.
    validate_list_request(pb.ListRequest(watch=True, watch_resume=pb.Header()))

    bad_name = pb.LabelSet(labels=[pb.Label(name="a invalid name", value="foo")])
    rejected(
        lambda: validate_list_request(request(bad_name)),
        "selector.include[0].name",
        '"a invalid name"',
    )
    rejected(
        lambda: validate_list_request(request(label_set(("bar", "x"), ("prefix", "no/slash")))),
        "selector.include[1].value",
        "\"no/slash\" is not a valid prefix (it must end in '/')",
    )
    rejected(
        lambda: validate_list_request(request(label_set(), label_set(("prefix", "")))),
        "selector.exclude[0].value",
        '""',
    )


def upsert(revision: int, spec: pb.JournalSpec | None = None) -> pb.ApplyRequest.Change:
    return pb.ApplyRequest.Change(expect_mod_revision=revision, upsert=spec or journal_spec())


def delete(revision: int, name: str = "a/journal") -> pb.ApplyRequest.Change:
    return pb.ApplyRequest.Change(expect_mod_revision=revision, delete=name)


def test_apply_request_accepted() -> None:
    validate_apply_request(pb.ApplyRequest())
    validate_apply_request(
        pb.ApplyRequest(
            changes=[
                upsert(0),
                upsert(-1, journal_spec(name="a/second")),
                upsert(7, journal_spec(name="a/third")),
                delete(1, "a/bc"),
                delete(-1, "a/de"),
                delete(9, "a/bc;m"),  # Another key than a/bc's.
            ]
        )
    )


@pytest.mark.parametrize(
    ("change", "field", "named"),
    [
        (
            pb.ApplyRequest.Change(),
            "changes[1]",
            "neither upsert nor delete is set (expected exactly one)",
        ),
        (
            pb.ApplyRequest.Change(upsert=journal_spec(), delete="a/journal"),
            "changes[1]",
            "both upsert and delete are set",
        ),
        (
            upsert(-2),
            "changes[1].expect_mod_revision",
            "-2 is invalid for an upsert (expected >= 0, or -1 to skip the check)",
        ),
        (
            delete(0),
            "changes[1].expect_mod_revision",
            "0 is invalid for a delete (expected > 0, or -1 to skip the check)",
        ),
        (delete(-2), "changes[1].expect_mod_revision", "-2 is invalid for a delete"),
        (delete(1, "/rooted"), "changes[1].delete", '"/rooted"'),
        (
            upsert(
                0,
                journal_spec(labels=pb.LabelSet(labels=[pb.Label(name="aa"), pb.Label(name="b")])),
            ),
            "changes[1].upsert.labels[1].name",
            '"b" is too short',
        ),
        (
            upsert(0, journal_spec(fragment__length=1)),
            "changes[1].upsert.fragment.length",
            "1 is below the minimum",
        ),
        # One etcd transaction cannot hold two operations on one key (found by tests/test_fuzz.py:
        # etcd refused the transaction and the broker answered UNKNOWN).
        (
            delete(-1),
            "changes[1].delete",
            '"a/journal" is also changed by changes[0] (expected each journal at most once)',
        ),
        (upsert(-1), "changes[1].upsert.name", '"a/journal" is also changed by changes[0]'),
    ],
)
def test_apply_request_rejected(change: pb.ApplyRequest.Change, field: str, named: str) -> None:
    req = pb.ApplyRequest(changes=[upsert(0), change])
    rejected(lambda: validate_apply_request(req), field, named)


def test_shard_id_bounds() -> None:
    validate_shard_id("abcd")
    validate_shard_id("s" * 512)
    validate_shard_id("shard/part-000+x_y.z")
    rejected(lambda: validate_shard_id("abc"), "id", '"abc" is too short')
    rejected(lambda: validate_shard_id("s" * 513), "id", "too long (513 bytes")
    rejected(lambda: validate_shard_id("a=bcd"), "id", '"=" at index 1')
    rejected(
        lambda: validate_shard_id("a bcd", field="changes[0].upsert.id"), "changes[0].upsert.id"
    )
