"""The tenant boundary, field by field. Every field of every request (Journal, Shard and Location
services), of the specs they carry, and of the recovery log's hints and ops is classified here:
either it names a resource (a journal, a store, a path, an etcd key, a shard, a location), and
then it has a row of the threat model's table (docs/architecture.md, "What names a resource")
with the check that guards it and the tests that try to escape through it as a `team=x` token
over the wire; or it names nothing a tenant could reach through, and says why.

The classification is driven by the protocol's descriptors, as the authorization walk is: a field
added without a row or a reason fails `test_every_field_is_classified`. The escape attempts
themselves live in `tests/escape_*.py`, one module for each area, and are collected here."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.descriptor import Descriptor

from broker.protocol import consumer_pb2 as cpb
from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from replication import location_pb2 as lpb
from tests.escape_names import *  # noqa: F403

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    """One row of the threat model's table: fields that name a resource, what they name, the check
    that guards them, and the escape tests that try them (functions of this module)."""

    title: str
    fields: tuple[str, ...]
    names: str
    guard: str
    tests: tuple[str, ...]


ROWS: tuple[Row, ...] = (
    Row(
        "Journal names in requests",
        (
            "protocol.ReadRequest.journal",
            "protocol.AppendRequest.journal",
            "protocol.FragmentsRequest.journal",
            "protocol.ApplyRequest.Change.delete",
            "gateway path",
        ),
        "a journal",
        "validated as a journal name (no '.', '..' or empty segments, no escapes), then resolved "
        "under the caller's claims: a journal they do not select is JOURNAL_NOT_FOUND with an "
        "empty route, a change to it UNAUTHENTICATED",
        (
            "test_spellings_of_a_hidden_journal_name_find_nothing_in_any_journal_rpc",
            "test_spellings_of_a_hidden_journal_in_the_gateways_path_find_nothing",
        ),
    ),
    Row(
        "A peer's Replicate proposal",
        (
            "protocol.Fragment.journal",
            "protocol.Fragment.backing_store",
            "protocol.Fragment.path_postfix",
            "protocol.ReplicateRequest.deprecated_journal",
        ),
        "the journal a spool belongs to; a store and a path",
        "the journal is resolved under the caller's claims; a proposal naming a store or a "
        "postfix is a mismatch (only the persister sets them), so nothing is written elsewhere",
        ("test_a_replicate_proposal_cannot_name_a_store_or_postfix_of_its_own",),
    ),
    Row(
        "Shard ids in requests",
        (
            "consumer.StatRequest.shard",
            "consumer.GetHintsRequest.shard",
            "consumer.UnassignRequest.shards",
            "consumer.ApplyRequest.Change.delete",
        ),
        "a shard",
        "validated as a shard id, then authorized by the `id` meta-label and the labels of the "
        "spec it names: a hidden shard is SHARD_NOT_FOUND, a change to it UNAUTHENTICATED",
        ("test_spellings_of_a_hidden_shard_id_find_nothing_in_any_shard_rpc",),
    ),
)

# Fields that name nothing a tenant could reach through, and why (by kind).
_SELECTOR = "a label selector: it narrows what the caller's claims already select, never widens it"
_HEADER = (
    "a proxying broker's header: checked against this broker's own view (cluster, process, "
    "revision) and never dialled; the route is recomputed from etcd"
)
_SCALAR = "a number, flag, duration or content: it names no resource"
_LABELS = (
    "labels: what selectors match, authorized as the spec they belong to (a change is checked "
    "against the claims as written and as it stands)"
)

NOT_NAMES: dict[str, str] = {
    **dict.fromkeys(
        [
            "protocol.ListRequest.selector",
            "consumer.ListRequest.selector",
            "protocol.LabelSelector.include",
            "protocol.LabelSelector.exclude",
        ],
        _SELECTOR,
    ),
    **dict.fromkeys(
        [
            "protocol.ReadRequest.header",
            "protocol.AppendRequest.header",
            "protocol.ReplicateRequest.header",
            "protocol.FragmentsRequest.header",
            "consumer.StatRequest.header",
            "protocol.Header.process_id",
            "protocol.Header.route",
            "protocol.Header.etcd",
            "protocol.ProcessSpec.ID.zone",
            "protocol.ProcessSpec.ID.suffix",
            "protocol.Route.members",
            "protocol.Route.primary",
            "protocol.Route.endpoints",
            "protocol.Header.Etcd.cluster_id",
            "protocol.Header.Etcd.member_id",
            "protocol.Header.Etcd.revision",
            "protocol.Header.Etcd.raft_term",
        ],
        _HEADER,
    ),
    **dict.fromkeys(
        [
            "protocol.LabelSet.labels",
            "protocol.Label.name",
            "protocol.Label.value",
            "protocol.Label.prefix",
            "protocol.JournalSpec.labels",
            "consumer.ShardSpec.labels",
            "protocol.AppendRequest.check_registers",
            "protocol.AppendRequest.union_registers",
            "protocol.AppendRequest.subtract_registers",
            "protocol.ReplicateRequest.registers",
        ],
        _LABELS,
    ),
    **dict.fromkeys(
        [
            "protocol.ListRequest.watch",
            "protocol.ListRequest.watch_resume",
            "protocol.ApplyRequest.changes",
            "protocol.ApplyRequest.Change.expect_mod_revision",
            "protocol.ApplyRequest.Change.upsert",
            "protocol.JournalSpec.replication",
            "protocol.JournalSpec.fragment",
            "protocol.JournalSpec.Fragment.length",
            "protocol.JournalSpec.Fragment.compression_codec",
            "protocol.JournalSpec.Fragment.refresh_interval",
            "protocol.JournalSpec.Fragment.retention",
            "protocol.JournalSpec.Fragment.flush_interval",
            "protocol.JournalSpec.flags",
            "protocol.JournalSpec.max_append_rate",
            "protocol.JournalSpec.suspend",
            "protocol.JournalSpec.Suspend.level",
            "protocol.JournalSpec.Suspend.offset",
            "protocol.ReadRequest.offset",
            "protocol.ReadRequest.block",
            "protocol.ReadRequest.do_not_proxy",
            "protocol.ReadRequest.metadata_only",
            "protocol.ReadRequest.end_offset",
            "protocol.ReadRequest.begin_mod_time",
            "protocol.ReadRequest.min_etcd_revision",
            "protocol.AppendRequest.do_not_proxy",
            "protocol.AppendRequest.content",
            "protocol.AppendRequest.offset",
            "protocol.AppendRequest.suspend",
            "protocol.AppendRequest.min_etcd_revision",
            "protocol.ReplicateRequest.proposal",
            "protocol.Fragment.begin",
            "protocol.Fragment.end",
            "protocol.Fragment.sum",
            "protocol.SHA1Sum.part1",
            "protocol.SHA1Sum.part2",
            "protocol.SHA1Sum.part3",
            "protocol.Fragment.compression_codec",
            "protocol.Fragment.mod_time",
            "protocol.ReplicateRequest.content",
            "protocol.ReplicateRequest.content_delta",
            "protocol.ReplicateRequest.acknowledge",
            "protocol.FragmentsRequest.begin_mod_time",
            "protocol.FragmentsRequest.end_mod_time",
            "protocol.FragmentsRequest.page_limit",
            "protocol.FragmentsRequest.signatureTTL",
            "protocol.FragmentsRequest.do_not_proxy",
            "protocol.FragmentStoreHealthRequest.check_delete",
            "consumer.ApplyRequest.changes",
            "consumer.ApplyRequest.Change.expect_mod_revision",
            "consumer.ApplyRequest.Change.upsert",
            "consumer.ShardSpec.sources",
            "consumer.ShardSpec.Source.min_offset",
            "consumer.ShardSpec.max_txn_duration",
            "consumer.ShardSpec.min_txn_duration",
            "consumer.ShardSpec.disable",
            "consumer.ShardSpec.hot_standbys",
            "consumer.ShardSpec.disable_wait_for_ack",
            "consumer.ShardSpec.ring_buffer_size",
            "consumer.ShardSpec.read_channel_size",
            "consumer.UnassignRequest.only_failed",
            "consumer.UnassignRequest.dry_run",
            "consumer.StatRequest.ReadThroughEntry.value",
        ],
        _SCALAR,
    ),
    "protocol.FragmentsRequest.next_page_token": (
        "an offset to resume from, encoded: it pages within the one journal the request names"
    ),
    **dict.fromkeys(
        [
            "consumer.StatRequest.extension",
            "consumer.ListRequest.extension",
            "consumer.ApplyRequest.extension",
            "consumer.GetHintsRequest.extension",
        ],
        "bytes for the application's own use; the framework does not read them",
    ),
}


def _walk(descriptor: Descriptor, seen: set[str]) -> Iterator[str]:
    if descriptor.full_name in seen:
        return
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        yield field.full_name
        nested = field.message_type
        if nested is not None and not nested.full_name.startswith("google.protobuf."):
            yield from _walk(nested, seen)


def every_field() -> list[str]:
    """The fields of every request of every service, of what they carry, and of the recovery
    log's hints and ops (which reach a consumer through Shard Apply, etcd and the log)."""
    seen: set[str] = set()
    out: list[str] = []
    for module in (pb, cpb, lpb):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                out.extend(_walk(method.input_type, seen))
    out.extend(_walk(rpb.FSMHints.DESCRIPTOR, seen))
    out.extend(_walk(rpb.RecordedOp.DESCRIPTOR, seen))
    return out


def _row_fields() -> set[str]:
    return {f for row in ROWS for f in row.fields}


def test_every_field_is_classified() -> None:
    fields = set(every_field())
    assert len(fields) > 150  # The walk reaches every service.
    named = _row_fields() | set(NOT_NAMES)
    assert sorted(fields - named) == [], "fields with neither a row nor a reason"
    assert sorted(named - fields - {"gateway path"}) == [], "rows naming fields that do not exist"
    assert not _row_fields() & set(NOT_NAMES), "a field both names a resource and does not"


def test_every_row_has_escape_attempts_here() -> None:
    missing = [t for row in ROWS for t in row.tests if not callable(globals().get(t))]
    assert missing == []
    assert all(row.tests for row in ROWS)


def test_the_threat_models_table_has_every_row() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("### What names a resource", 1)[1].split("\n## ", 1)[0]
    titles = re.findall(r"^\| \*\*(.+?)\*\*", table, flags=re.MULTILINE)
    assert titles == [row.title for row in ROWS]
    for row in ROWS:
        line = next(line for line in table.splitlines() if line.startswith(f"| **{row.title}**"))
        for test in row.tests:
            assert test in line, (row.title, test)
