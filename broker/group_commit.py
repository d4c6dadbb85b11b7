"""Group commit: appends read whole, waiting for a journal's pipeline, committed together.

An append of less than 64 KiB at the journal's head is read whole before it waits for the
replica's pipeline (`broker.append_api.WHOLE_APPEND`). It then waits in the replica's
`GroupCommit` holding a `Ticket`, for whichever comes first: the pipeline (it then commits
alone, or leads a group), or adoption by the append holding the pipeline. A holder read whole
itself adopts those waiting on an equivalent route, in arrival order (`GroupCommit.adopt`), and
the resulting `Group` gives each append its own span, SHA-1 and registers, or its own refusal,
checked as it would be alone (`Group.plan`). The holder sends the group's content and one
commit proposal, reads one round of acknowledgements, and settles the group (`Group.settle`):
every append it adopted is answered through its ticket's `outcome`, a future only this module
resolves. Every append of a group commits, or none does.

The appends of a group never touch each other's state: an adopted append's state machine reads
its `Outcome` and moves itself to FINISHED or ERROR.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from allocator.keyspace import route_equivalent
from broker.fragment import fragments as frag
from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from broker.resolver import Resolution

# The most appends one group commits (its holder's own included).
MAX_GROUP = 256
# The largest journal offset (2^63-1, as upstream's int64): no append may end past it.
MAX_OFFSET = (1 << 63) - 1


class Refusal(enum.Enum):
    """Why an append of a group is left out of it: each is what it would meet alone."""

    REGISTER_MISMATCH = "register_mismatch"  # Its check_registers, against the group's registers.
    OFFSET_OVERFLOW = "offset_overflow"  # It would end past MAX_OFFSET.
    CLIENT_GONE = "client_gone"  # Its client left before the group was proposed.


@dataclass
class Outcome:
    """How a group answered one append it adopted. `span` is set when it committed; else
    `refusal` (left out of the group, alone) or `failure` (the group's round failed)."""

    resolution: Resolution  # The holder's: the route and header the append was committed on.
    registers: pb.LabelSet  # The journal's registers as of its commit, or of its refusal.
    span: pb.Fragment | None = None
    refusal: Refusal | None = None
    failure: BaseException | None = None


class Ticket:
    """One append read whole, in a group commit: waiting in a replica's `GroupCommit`, then
    (as a holder's own, or adopted) planned into a `Group`."""

    __slots__ = (
        "adopted",
        "client_gone",
        "content",
        "outcome",
        "refusal",
        "registers",
        "request",
        "resolution",
        "span",
    )

    def __init__(
        self,
        request: pb.AppendRequest,
        content: bytes,
        resolution: Resolution,
        client_gone: asyncio.Event | None,
    ) -> None:
        self.request = request
        self.content = content
        self.resolution = resolution
        self.client_gone = client_gone
        # Set by `GroupCommit.adopt` alone: the append then waits for `outcome`, which its
        # group resolves once (and nothing else does).
        self.adopted = False
        self.outcome: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        # What `Group.plan` decided for it.
        self.span: pb.Fragment | None = None
        self.registers = pb.LabelSet()
        self.refusal: Refusal | None = None

    @property
    def gone(self) -> bool:
        """Whether its client left (its RPC was cancelled, or its deadline passed)."""
        return self.client_gone is not None and self.client_gone.is_set()


class Group:
    """One round of group commit: the holder's append first, then those it adopted."""

    def __init__(self, holder: Ticket, adopted: list[Ticket]) -> None:
        self.holder = holder
        self.tickets = [holder, *adopted]
        self.registers = pb.LabelSet()  # As the group leaves them, once planned.
        self._settled = False

    @property
    def size(self) -> int:
        """The bytes of content of every append in it (before any refusal)."""
        return sum(len(ticket.content) for ticket in self.tickets)

    def plan(self, fragment: pb.Fragment, registers: pb.LabelSet) -> bytes:
        """Give each append, in turn, its span after `fragment` (the spool's) and the registers
        the appends before it leave, or its refusal: its client left, its `check_registers`
        does not match those registers (the holder's was checked already, as any append's),
        or it would end past MAX_OFFSET. An adopted append refused is answered at once. Returns
        the group's content, the spans' in order (empty if every append was refused)."""
        offset = fragment.end
        current = pb.LabelSet()
        current.CopyFrom(registers)
        contents: list[bytes] = []
        for ticket in self.tickets:
            request = ticket.request
            check = request.check_registers if request.HasField("check_registers") else None
            refusal: Refusal | None = None
            if ticket.gone:
                refusal = Refusal.CLIENT_GONE
            elif (
                ticket is not self.holder
                and check is not None
                and current.labels
                and not labels.matches(check, current)
            ):
                refusal = Refusal.REGISTER_MISMATCH
            elif offset + len(ticket.content) > MAX_OFFSET:
                refusal = Refusal.OFFSET_OVERFLOW
            if refusal is not None:
                ticket.refusal = refusal
                ticket.registers.CopyFrom(current)
                if ticket is not self.holder:
                    self._answer(ticket, Outcome(self.holder.resolution, ticket.registers, refusal=refusal))  # fmt: skip
                continue
            if request.HasField("subtract_registers"):
                current = labels.subtract(current, request.subtract_registers)
            if request.HasField("union_registers"):
                current = labels.union(request.union_registers, current)
            ticket.registers.CopyFrom(current)
            ticket.span = pb.Fragment(
                journal=fragment.journal,
                begin=offset,
                end=offset + len(ticket.content),
                sum=frag.sum_from_digest(hashlib.sha1(ticket.content).digest()),
                compression_codec=fragment.compression_codec,
            )
            offset = ticket.span.end
            contents.append(ticket.content)
        self.registers = current
        return b"".join(contents)

    def settle(self, failure: BaseException | None) -> None:
        """Answer every adopted append not refused: committed with its span (`failure` None:
        the group's commit was acknowledged by every replica), else failed as the round did.
        Only the first call answers."""
        if self._settled:
            return
        self._settled = True
        for ticket in self.tickets[1:]:
            if ticket.refusal is not None:
                continue  # Answered when refused.
            outcome = Outcome(self.holder.resolution, ticket.registers)
            if failure is None and ticket.span is not None:
                outcome.span = ticket.span
            else:
                outcome.failure = failure or RuntimeError("the group's commit failed")
            self._answer(ticket, outcome)

    @staticmethod
    def _answer(ticket: Ticket, outcome: Outcome) -> None:
        if not ticket.outcome.done():
            ticket.outcome.set_result(outcome)


class GroupCommit:
    """A replica's appends read whole that wait for its pipeline, in arrival order."""

    def __init__(self) -> None:
        self._waiting: list[Ticket] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def join(
        self,
        request: pb.AppendRequest,
        content: bytes,
        resolution: Resolution,
        client_gone: asyncio.Event | None,
    ) -> Ticket:
        """Wait here (until `leave`), to be adopted by the append holding the pipeline."""
        ticket = Ticket(request, content, resolution, client_gone)
        self._waiting.append(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """No longer wait (the pipeline was taken, the client left, or the wait was cut
        short); an adopted ticket left already."""
        if not ticket.adopted:
            self._waiting.remove(ticket)

    def adopt(
        self,
        request: pb.AppendRequest,
        content: bytes,
        resolution: Resolution,
        client_gone: asyncio.Event | None,
    ) -> Group:
        """The group of the append holding the pipeline (read whole, on `resolution`): it and
        up to MAX_GROUP - 1 appends waiting on an equivalent route whose client is still there,
        in arrival order. Each adopted leaves the queue, and is answered by the group."""
        holder = Ticket(request, content, resolution, client_gone)
        adopted: list[Ticket] = []
        keep: list[Ticket] = []
        for ticket in self._waiting:
            if (
                len(adopted) < MAX_GROUP - 1
                and not ticket.gone  # It leaves by itself.
                and route_equivalent(ticket.resolution.route, resolution.route)
            ):
                ticket.adopted = True
                adopted.append(ticket)
            else:
                keep.append(ticket)
        self._waiting = keep
        return Group(holder, adopted)
