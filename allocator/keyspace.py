"""The allocator's etcd key layout and value decoding, shared by brokers and consumers.

Under a root prefix: `items/{id}` holds a spec, `members/{zone}#{suffix}` a member spec written
under the member's lease, and `assign/{item}#{zone}#{suffix}#{slot}` an assignment (slot 0 is the
primary). `#` separates because every token alphabet excludes it.

Brokers also keep `paths/{storage}/{segment}` (escaped), empty keys which journal Applies bump to
serialize only those that could claim meeting fragment paths (see `path_lock_key`); they are not
mirrored (`broker.keyspace.broker_keyspace`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote

from google.protobuf.message import Message

from broker.protocol import protocol_pb2 as pb

ITEMS = "/items/"
MEMBERS = "/members/"
ASSIGNMENTS = "/assign/"
PATHS = "/paths/"
SEP = "#"

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Item:
    id: str
    spec: Message


@dataclass(frozen=True)
class Member:
    zone: str
    suffix: str
    spec: Message


@dataclass(frozen=True)
class Assignment:
    item_id: str
    member_zone: str
    member_suffix: str
    slot: int
    value: Message | None


def item_key(root: str, item_id: str) -> str:
    return f"{root}{ITEMS}{item_id}"


def member_key(root: str, zone: str, suffix: str) -> str:
    return f"{root}{MEMBERS}{zone}{SEP}{suffix}"


def assignment_key(root: str, item_id: str, zone: str, suffix: str, slot: int) -> str:
    return f"{root}{ASSIGNMENTS}{item_id}{SEP}{zone}{SEP}{suffix}{SEP}{slot}"


def path_lock_key(root: str, storage: str, segment: str) -> str:
    """The etcd key an Apply bumps (and compares) for the fragment paths it claims in `storage`
    whose key directory begins with `segment`: two paths that meet (equal or nested) share both,
    so Applies that could race past each other's path check contend on it, and others never.
    Each part is escaped whole, so no storage or segment spells another's key."""
    return f"{root}{PATHS}{quote(storage, safe='')}/{quote(segment, safe='')}"


def new_decoder(
    root: str,
    item_type: type[Message],
    member_type: type[Message],
    assignment_type: type[Message] | None,
) -> Callable[[str, bytes], object]:
    """A keyspace value decoder for the allocator layout under `root`.

    Brokers decode items as JournalSpec, members as BrokerSpec and assignments as Route;
    consumers use ShardSpec, ConsumerSpec and ReplicaStatus.
    """

    def decode(key: str, raw: bytes) -> object:
        if key.startswith(root + ITEMS):
            spec = item_type.FromString(raw)
            item_id = key[len(root) + len(ITEMS) :]
            return Item(item_id, spec)
        if key.startswith(root + MEMBERS):
            zone, sep, suffix = key[len(root) + len(MEMBERS) :].partition(SEP)
            if not sep:
                raise ValueError(f"member key {key!r} lacks '{SEP}'")
            return Member(zone, suffix, member_type.FromString(raw))
        if key.startswith(root + ASSIGNMENTS):
            parts = key[len(root) + len(ASSIGNMENTS) :].split(SEP)
            if len(parts) != 4:
                raise ValueError(f"assignment key {key!r} is not item#zone#suffix#slot")
            value = assignment_type.FromString(raw) if (assignment_type and raw) else None
            return Assignment(parts[0], parts[1], parts[2], int(parts[3]), value)
        raise ValueError(f"unexpected key {key!r} outside the allocator layout")

    return decode


class _DecodedKV(Protocol):
    @property
    def decoded(self) -> object: ...


def build_route(
    assignments: Sequence[_DecodedKV], members: Callable[[str, str], Member | None]
) -> pb.Route:
    """The Route of one item from its assignments: members ordered on (zone, suffix), the
    primary the slot-0 assignment (or -1), and each member's advertised endpoint."""
    route = pb.Route(primary=-1)
    decoded = sorted(
        (a for a in (kv.decoded for kv in assignments) if isinstance(a, Assignment)),
        key=lambda a: (a.member_zone, a.member_suffix),
    )
    for index, assignment in enumerate(decoded):
        route.members.add(zone=assignment.member_zone, suffix=assignment.member_suffix)
        if assignment.slot == 0:
            route.primary = index
    endpoints = []
    for assignment in decoded:
        member = members(assignment.member_zone, assignment.member_suffix)
        spec = member.spec if member is not None else None
        # A BrokerSpec's or a ConsumerSpec's process: routes of shards carry consumer endpoints.
        process = getattr(spec, "process_spec", None)
        endpoints.append(process.endpoint if isinstance(process, pb.ProcessSpec) else "")
    if any(endpoints):
        route.endpoints.extend(endpoints)
    return route


def route_equivalent(a: pb.Route, b: pb.Route) -> bool:
    """Same members and primary (endpoints are presentation, not topology)."""
    return a.primary == b.primary and list(a.members) == list(b.members)


def assignment_holds(assignment: object, route: pb.Route) -> bool:
    """Whether an assignment's value advertises `route` (its replica synchronized on it)."""
    return (
        isinstance(assignment, Assignment)
        and isinstance(assignment.value, pb.Route)
        and route_equivalent(assignment.value, route)
    )


def route_matches_assignments(route: pb.Route, assignments: Sequence[_DecodedKV]) -> bool:
    """A journal is consistent when every assignment holds the route they imply."""
    return all(assignment_holds(kv.decoded, route) for kv in assignments)
