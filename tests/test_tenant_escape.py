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
from tests.escape_claims import *  # noqa: F403
from tests.escape_locations import *  # noqa: F403
from tests.escape_names import *  # noqa: F403
from tests.escape_persist import *  # noqa: F403
from tests.escape_playback import *  # noqa: F403
from tests.escape_shards import *  # noqa: F403
from tests.escape_stores import *  # noqa: F403

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
        "Journal specs: name and fragment stores",
        ("protocol.JournalSpec.name", "protocol.JournalSpec.Fragment.stores"),
        "where a journal's fragments live: a store (and its `find`/`replace` rewrite) and the "
        "journal's path in it",
        "the spec is authorized as written and as it stands; store URLs must be canonical (the "
        "refusal names the canonical form; brokers canonicalise what they read from etcd); no "
        "two journals' fragment paths are equal or nested, checked against every journal in the "
        "same guarded transaction (a clash with a journal the caller cannot see is refused as "
        "any unauthorized change), under lock keys only Applies whose paths could meet share; "
        "an s3 `endpoint` is a bare origin, and with a selector `endpoint` and `profile` are "
        "only as the spec replaced has them; with a selector, a path new to the journal must "
        "hold no object (fragments a deleted or moved journal left behind); a broker excludes "
        "other journals' paths from a listing, and persists a fragment only by the spec of the "
        "journal that wrote it (not one created under its name since)",
        (
            "test_a_journal_cannot_name_another_journals_fragments",
            "test_non_canonical_store_spellings_are_refused_naming_the_canonical_form",
            "test_concurrent_applies_cannot_race_past_each_others_path_check",
            "test_a_spec_written_to_etcd_directly_does_not_reach_an_older_journals_fragments",
            "test_an_s3_endpoint_that_is_not_a_bare_origin_is_refused_for_every_caller",
            "test_a_restricted_token_cannot_choose_a_stores_endpoint_or_profile",
            "test_a_restricted_token_cannot_claim_fragments_a_journal_left_behind",
            "test_a_store_that_cannot_be_listed_refuses_a_restricted_apply_unavailable",
            "test_another_tenants_apply_flood_does_not_fail_a_tenants_applies",
            "test_a_deleted_journals_last_fragment_is_never_persisted_by_a_journal_created_in_its_name",
        ),
    ),
    Row(
        "Path postfix templates",
        ("protocol.JournalSpec.Fragment.path_postfix_template",),
        "a directory under the journal's path",
        "a template that could render '.', '..', an empty segment or an absolute path is "
        "refused at Apply; a rendered postfix is checked again before a fragment is written",
        ("test_path_postfix_templates_cannot_climb_out_of_their_journal",),
    ),
    Row(
        "FragmentStoreHealth's store",
        (
            "protocol.FragmentStoreHealthRequest.fragment_store",
            "protocol.FragmentStoreHealthRequest.check_delete_prefix",
        ),
        "a store, and probe objects written (and deleted) in it",
        "takes APPLY; the delete prefix is a clean relative key directory; with a selector, "
        "only a store a visible journal names, and every probe's key, after the store's "
        "rewrite, lies inside that journal's own path, never store-wide",
        (
            "test_a_health_probe_of_a_shared_store_stays_inside_the_callers_journal",
            "test_check_delete_prefix_is_a_clean_key_directory_for_every_caller",
            "test_check_delete_prefix_lies_inside_a_visible_journal_after_the_stores_rewrite",
        ),
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
    Row(
        "Hint keys: a shard's id, hint prefix and backups",
        (
            "consumer.ShardSpec.id",
            "consumer.ShardSpec.hint_prefix",
            "consumer.ShardSpec.hint_backups",
        ),
        "etcd keys `<hint_prefix>/<id>.primary` and `.backup.N`",
        "for every caller, `hint_prefix` is the application's hint root (`<etcd prefix>/hints`, "
        "filled in when empty) or unchanged from the spec replaced, so every shard's keys are "
        "distinct and inside the consumer's keyspace; at most 16 backups; a shard without a "
        "recovery log has no hint keys; with a selector, a shard is not created while hints a "
        "deleted shard of its id left behind remain (compared absent in the create's "
        "transaction; refused as any unauthorized change), and GetHints names no other log",
        (
            "test_a_hint_prefix_outside_the_consumers_hint_root_is_refused_and_writes_nothing",
            "test_a_huge_hint_backups_is_refused_in_one_line",
            "test_hints_a_deleted_shard_left_behind_are_not_read_by_whoever_recreates_its_id",
            "test_hints_a_deleted_shard_left_behind_do_not_reveal_its_log_to_whoever_recreates_its_id",
            "test_a_shard_without_a_recovery_log_probes_no_key_its_id_spells",
        ),
    ),
    Row(
        "Recovery logs and sources",
        ("consumer.ShardSpec.recovery_log_prefix", "consumer.ShardSpec.Source.journal"),
        "journals the consumer fences and appends to, or reads, with its own credentials",
        "with a selector, each must exist and be selected by the caller's claims, as the "
        "consumer lists it at the brokers; an absent and a hidden journal get the same "
        "refusal; brokers that cannot be asked: UNAVAILABLE, never accepted",
        (
            "test_a_hidden_or_absent_recovery_log_or_source_is_refused_identically",
            "test_an_unreachable_broker_refuses_a_restricted_apply_unavailable",
        ),
    ),
    Row(
        "Hints given at Apply",
        (
            "consumer.ApplyRequest.Change.primary_hints",
            "recoverylog.FSMHints.log",
            "recoverylog.Segment.log",
        ),
        "the primary hint key, and the logs played back",
        "only with a recovery log, written to the shard's own key; `log` must be the shard's "
        "own log; with a selector, the logs of segments are checked as sources are",
        (
            "test_hints_without_a_recovery_log_cannot_name_a_key_outside_the_hint_root",
            "test_primary_hints_cannot_name_a_hidden_log",
        ),
    ),
    Row(
        "Paths in hints and in the recovery log",
        (
            "recoverylog.Property.path",
            "recoverylog.RecordedOp.Create.path",
            "recoverylog.RecordedOp.Link.path",
        ),
        "files in the shard's directory",
        "a path must be rooted and cleanly spelled (no '.', '..' or empty segments, no NUL, not "
        "the staging area): refused at Apply, and a playback meeting one fails the shard in one "
        "line; files are made live relative to the directory, each directory opened from the "
        "one above without following symlinks, created exclusively, 0600",
        (
            "test_escape_shard_apply_refuses_escaping_primary_hints",
            "test_escape_escaping_hints_planted_in_etcd_fail_the_shard_and_write_nothing",
            "test_escape_escaping_ops_in_its_own_recovery_log_fail_the_shard_and_write_nothing",
        ),
    ),
    Row(
        "Stat's read_through",
        ("consumer.StatRequest.read_through", "consumer.StatRequest.ReadThroughEntry.key"),
        "journals the shard must have read through",
        "each must be a source of the shard (authorized when it was applied); anything else is "
        "refused alike",
        ("test_stats_read_through_names_only_the_shards_own_sources",),
    ),
    Row(
        "Location names",
        (
            "gazette_py.replication.Change.Connection.source",
            "gazette_py.replication.Change.Connection.target",
            "gazette_py.replication.Change.FailOver.previous",
            "gazette_py.replication.Change.FailOver.source",
            "gazette_py.replication.Change.FailOver.target",
            "gazette_py.replication.Change.retired",
            "gazette_py.replication.ResetProgressRequest.source",
            "gazette_py.replication.JoinRequest.sources",
            "gazette_py.replication.TrustClockRequest.without",
            "gazette_py.replication.ReadRequest.or_emitter",
            "gazette_py.replication.ReadRequest.cvv",
            "gazette_py.replication.Clock.TimesEntry.key",
        ),
        "other locations (edges of the topology, sources, emitters)",
        "with a selector, every location a request names must be registered and its log "
        "journal, as its brokers list it now, selected by the claims; else NOT_FOUND as a "
        "location that does not exist (fails closed when the journal cannot be listed); Delete "
        "needs its neighbours selected, Recover every location; names in answers are filtered",
        (
            "test_a_location_name_in_any_request_field_is_refused_as_if_it_did_not_exist",
            "test_a_location_whose_log_cannot_be_listed_is_refused_as_if_it_did_not_exist",
            "test_recover_is_refused_to_a_token_that_does_not_select_every_location",
            "test_those_not_heard_from_are_listed_only_as_the_caller_sees_them",
            "test_a_token_that_selects_both_locations_connects_them",
        ),
    ),
    Row(
        "Token claims",
        (),
        "what a token selects (`sel`) and grants (`cap`), until when (`exp`)",
        "decoded as upstream's Go does: wrong types refused, keys matched case-insensitively, "
        "out-of-range times refused in one line; a call without a token (`AA==`) ends after an "
        "hour",
        (
            "test_a_malformed_selector_claim_is_refused_and_lists_nothing",
            "test_a_selector_claim_in_other_spellings_confines_its_bearer_as_go_reads_it",
            "test_an_exp_claim_golang_jwt_refuses_is_a_one_line_refusal",
        ),
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
    **dict.fromkeys(
        [
            "recoverylog.FSMHints.live_nodes",
            "recoverylog.FnodeSegments.fnode",
            "recoverylog.FnodeSegments.segments",
            "recoverylog.Segment.author",
            "recoverylog.Segment.first_seq_no",
            "recoverylog.Segment.first_offset",
            "recoverylog.Segment.first_checksum",
            "recoverylog.Segment.last_seq_no",
            "recoverylog.Segment.last_offset",
            "recoverylog.FSMHints.properties",
            "recoverylog.RecordedOp.seq_no",
            "recoverylog.RecordedOp.checksum",
            "recoverylog.RecordedOp.author",
            "recoverylog.RecordedOp.first_offset",
            "recoverylog.RecordedOp.last_offset",
            "recoverylog.RecordedOp.create",
            "recoverylog.RecordedOp.link",
            "recoverylog.RecordedOp.unlink",
            "recoverylog.RecordedOp.write",
            "recoverylog.RecordedOp.property",
            "recoverylog.RecordedOp.Link.fnode",
            "recoverylog.RecordedOp.Write.fnode",
            "recoverylog.RecordedOp.Write.offset",
            "recoverylog.RecordedOp.Write.length",
        ],
        "a number or a container of the recovery log's bookkeeping: fnodes are staged as "
        "`.fnodes/<n>`, which no recorded path may name",
    ),
    "recoverylog.Property.content": (
        "a property file's content: written as a regular file, never followed as a link"
    ),
    "recoverylog.RecordedOp.log": (
        "set by the player to the journal it read the op from, never taken from the log"
    ),
    **dict.fromkeys(
        [
            "gazette_py.replication.EmitRequest.payloads",
            "gazette_py.replication.ReadRequest.after",
            "gazette_py.replication.ReadRequest.limit",
            "gazette_py.replication.ReadRequest.wait",
            "gazette_py.replication.Clock.times",
            "gazette_py.replication.Clock.TimesEntry.value",
            "gazette_py.replication.ChangeRequest.change",
            "gazette_py.replication.Change.connected",
            "gazette_py.replication.Change.disconnected",
            "gazette_py.replication.Change.filtered",
            "gazette_py.replication.Change.failed_over",
            "gazette_py.replication.ChangeRequest.record",
            "gazette_py.replication.ChangeRequest.op",
            "gazette_py.replication.DeleteRequest.through",
            "gazette_py.replication.ResetProgressRequest.seq",
        ],
        _SCALAR + " (or a container whose location names have their own row)",
    ),
    **dict.fromkeys(
        [
            "gazette_py.replication.ReadRequest.filter",
            "gazette_py.replication.Change.Connection.filter",
            "gazette_py.replication.Change.FailOver.filter",
        ],
        "a replication filter: it selects among the events of the location's own log, so a "
        "filter naming a hidden location reads nothing of it "
        "(test_a_filter_naming_a_hidden_location_reads_nothing_of_it)",
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
