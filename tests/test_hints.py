"""FSMHints in etcd as upstream writes them (Go's encoding/json of the message), read back from
JSON or protobuf, and upstream's rules for them."""

from __future__ import annotations

import pytest

from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import ValidationError
from consumer.recoverylog.hints import decode_hints, encode_hints, validate_hints

# Written from the format's description: keys in field order, zero values left out, empty
# repeated fields as null, no spaces.
UPSTREAM_JSON = (
    b'{"log":"example/log","live_nodes":[{"fnode":1018,"segments":[{"author":3418428788,'
    b'"first_seq_no":1018,"first_offset":129100,"first_checksum":2628272215,'
    b'"last_seq_no":1024}]}],"properties":null}'
)


def example() -> rpb.FSMHints:
    hints = rpb.FSMHints(log="example/log")
    hints.live_nodes.add(fnode=1018).segments.add(
        author=3418428788,
        first_seq_no=1018,
        first_offset=129100,
        first_checksum=2628272215,
        last_seq_no=1024,
    )
    return hints


def test_hints_encode_as_upstream_writes_them() -> None:
    assert encode_hints(example()) == UPSTREAM_JSON
    assert encode_hints(rpb.FSMHints()) == b'{"live_nodes":null,"properties":null}'
    with_property = rpb.FSMHints(log="l/og", properties=[rpb.Property(path="/a", content="x")])
    assert encode_hints(with_property) == (
        b'{"log":"l/og","live_nodes":null,"properties":[{"path":"/a","content":"x"}]}'
    )


def test_hints_escape_html_characters_as_go_does() -> None:
    """Go's json.Marshal escapes <, > and & (and U+2028, U+2029) in strings as \\u00XX, lower
    case; other characters stay as UTF-8. Hints written here must be byte for byte upstream's."""
    hints = rpb.FSMHints(
        log="l/og", properties=[rpb.Property(path="/a&b", content='<x>\u2028\u2029é\n"')]
    )
    assert encode_hints(hints) == (
        b'{"log":"l/og","live_nodes":null,"properties":[{"path":"/a\\u0026b",'
        b'"content":"\\u003cx\\u003e\\u2028\\u2029\xc3\xa9\\n\\""}]}'
    )
    assert decode_hints(encode_hints(hints)) == hints


def test_hints_decode_from_json_in_any_layout_and_from_protobuf() -> None:
    assert decode_hints(UPSTREAM_JSON) == example()
    indented = b'{\n  "log": "example/log",\n  "live_nodes": [{"fnode": 1018, "segments": [\n'
    indented += b'    {"author": 3418428788, "first_seq_no": 1018, "first_offset": 129100,\n'
    indented += b'     "first_checksum": 2628272215, "last_seq_no": 1024}]}],\n'
    indented += b'  "properties": null\n}'
    assert decode_hints(indented) == example()
    assert decode_hints(example().SerializeToString()) == example()
    assert decode_hints(b"") == rpb.FSMHints()  # An empty protobuf.


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"log": 7}', "hints.log: expected a JSON str"),
        (b'{"live_nodes": {}}', "hints.live_nodes: expected a JSON list"),
        (b'{"live_nodes": [{"segments": [{"author": -1}]}]}', "author: -1 is out of range"),
        (b'{"live_nodes": [{"fnode": "7"}]}', 'fnode: expected an integer, got "7"'),
        (b'{"log": "a"', "not valid JSON"),
        (b"\xff\xff\xff", "neither JSON nor protobuf"),
    ],
)
def test_bad_hints_are_one_clear_error(raw: bytes, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        decode_hints(raw)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_hints_follow_upstreams_rules() -> None:
    validate_hints(example())
    inherited = example()
    inherited.live_nodes[0].segments[0].log = "other/log"
    validate_hints(inherited)  # A segment may name another log.
    cases = [
        ("log", "example/log", "repeats the hints' own log"),
        ("author", 0, "author is zero"),
        ("first_seq_no", 0, "first_seq_no 0 is not positive"),
        ("first_offset", -1, "first_offset -1 is negative"),
        ("last_seq_no", 1000, "last_seq_no 1000 is below"),
        ("last_offset", 129100, "last_offset 129100 is not past"),
    ]
    for name, value, words in cases:
        hints = example()
        setattr(hints.live_nodes[0].segments[0], name, value)
        with pytest.raises(ValidationError) as caught:
            validate_hints(hints)
        assert words in str(caught.value), (name, str(caught.value))
        assert caught.value.field.startswith("hints.live_nodes[0].segments[0]")
    nameless = example()
    nameless.log = ""
    with pytest.raises(ValidationError) as caught:
        validate_hints(nameless)
    assert caught.value.field == "hints.live_nodes[0].segments[0].log"


def test_recovery_picks_the_primary_hints_then_the_first_backup_then_none() -> None:
    from consumer.protocol import cpb
    from consumer.recoverylog.hints import pick_first_hints

    log = "recovery/logs/a"
    primary = rpb.FSMHints(log=log)
    primary.live_nodes.add(fnode=1).segments.add(author=1, first_seq_no=1, last_seq_no=2)
    backup = rpb.FSMHints(log=log)
    response = cpb.GetHintsResponse()
    assert pick_first_hints(response, log) == rpb.FSMHints(log=log)
    response.backup_hints.add()  # Unset.
    response.backup_hints.add(hints=backup)
    assert pick_first_hints(response, log) is not None
    assert pick_first_hints(response, log) == backup
    response.primary_hints.hints.CopyFrom(primary)
    assert pick_first_hints(response, log) == primary


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/" + "../" * 12 + "tmp/victim", "has a '..' segment"),
        ("/a/../../victim", "has a '..' segment"),
        ("../victim", "has a '..' segment"),
        ("//etc/victim", "an empty or '.' segment"),
        ("/a//b", "an empty or '.' segment"),
        ("/./a", "an empty or '.' segment"),
        ("/a\x00b", "holds a NUL character"),
        ("/", "names the directory itself"),
        ("", "names the directory itself"),
        ("/.fnodes/3", "the player's own staging"),
    ],
)
def test_a_property_path_that_could_leave_the_shards_directory_is_invalid(
    path: str, words: str
) -> None:
    """Stricter than upstream (a shard is a tenant boundary): a property's path is rooted at
    the shard's directory, spelled cleanly, and never leaves it; the error names the field and
    the path, on one line."""
    from broker.protocol.validate import quote

    hints = example()
    hints.properties.add(path="/IDENTITY", content="fine")
    hints.properties.add(path=path, content="pwned")
    with pytest.raises(ValidationError) as caught:
        validate_hints(hints, field="changes[0].primary_hints")
    assert caught.value.field == "changes[0].primary_hints.properties[1].path"
    message = str(caught.value)
    assert words in message and quote(path) in message and "\n" not in message, message
    for fine in ("/IDENTITY", "IDENTITY", "/a/b.c/..d/...", "/tmp/victim"):  # Rooted: inside.
        validate_hints(rpb.FSMHints(log="l/og", properties=[rpb.Property(path=fine)]))
