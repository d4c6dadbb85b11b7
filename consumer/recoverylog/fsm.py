"""The recovery log's state machine (upstream's `recoverylog.FSM`), and the operations' framing.

Each recorded operation is a fixed protobuf frame: the magic word `66 33 93 36`, a little-endian
uint32 length, and a `RecordedOp`; a write's bytes follow its frame, outside it. Operations are
sequenced: each carries the next sequence number and the checksum of everything before it, the
CRC-32C (Castagnoli) chained over each earlier applied operation's protobuf bytes (the frame
without its header). The FSM applies an operation only if both match, so only a linear, consistent
history is applied, and a log that forked (two recorders at once) is read along one branch: the
one its hints name, by author, segment by segment.

Paths are rooted at the recorder's directory ("/db", "/sub/000001.sst"), in one clean spelling:
a path of any other (empty, "." or ".." segments, NUL, the player's staging `.fnodes`) is refused
by `apply` and by the FSM's hints with `UnsafePath`, as no recorder writes one. Upstream joins
paths to the directory as they come; shards are a tenant boundary here, and a log or hints that
could climb out of the directory would let whoever writes them write files anywhere the consumer
can.

Files are *fnodes*: a file across its links, renames and unlinks, identified by the sequence
number of the operation that created it. The FSM tracks which fnodes are live, their links, and
the segments of log holding their operations, from which `build_hints` makes the hints a later
player needs (only the live files' segments; the rest of the log can be skipped, and pruned).
"""

from __future__ import annotations

import enum
import secrets
import struct
from dataclasses import dataclass, field

import google_crc32c

from broker.protocol import protocol_pb2 as pb
from broker.protocol import recorded_op_pb2 as rpb
from broker.protocol.validate import quote
from consumer.recoverylog.segments import Segment, SegmentSet

__all__ = [
    "FRAME_MAGIC",
    "FSM",
    "Applied",
    "FSMError",
    "UnsafePath",
    "author_fence",
    "checksum_extend",
    "decode_header",
    "encode_frame",
    "live_log_segments",
    "new_author",
    "recorded_path_problem",
]

FRAME_MAGIC = b"\x66\x33\x93\x36"
HEADER = 8
_LENGTH = struct.Struct("<I")
# Bounds a frame's length when reading: a larger one means the log is not where we think.
MAX_FRAME = 1 << 26


def checksum_extend(checksum: int, data: bytes) -> int:
    """CRC-32C of `data`, continuing `checksum` (as Go's crc32.Update with the Castagnoli table)."""
    return int(google_crc32c.extend(checksum, data))


def encode_frame(op: rpb.RecordedOp) -> bytes:
    """The fixed protobuf frame of `op` (its header, then its bytes)."""
    body = op.SerializeToString()
    return FRAME_MAGIC + _LENGTH.pack(len(body)) + body


def decode_header(header: bytes) -> int:
    """The length of the protobuf body that follows this 8-byte header; ValueError if it is not
    a frame's header (the log is corrupt, or not read at a frame's start)."""
    if header[:4] != FRAME_MAGIC:
        raise ValueError(f"not a recovery-log frame (header {header.hex()})")
    (length,) = _LENGTH.unpack_from(header, 4)
    if length > MAX_FRAME:
        raise ValueError(f"a recovery-log frame of {length} bytes: corrupt")
    return int(length)


def new_author() -> int:
    """A random author, in [1, 2^32 - 1]."""
    return 1 + secrets.randbelow((1 << 32) - 1)


_DIGITS = "0123456789abcdefghijklmnopqrstuv"


def _base32(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 32)
        out = _DIGITS[d] + out
        if n == 0:
            return out


def author_fence(author: int) -> pb.LabelSet:
    """The journal register that fences a log to `author` (upstream's `Author.Fence`: label
    `author`, the author in base 32 as Go's strconv.FormatUint writes it)."""
    return pb.LabelSet(labels=[pb.Label(name="author", value=_base32(author))])


# The player stages files in this directory of the played one: no recorded path may name it.
STAGING = ".fnodes"


def recorded_path_problem(path: str) -> str:
    """What is wrong with `path` as the path of a recorded file or property ("" if nothing):
    it must be rooted at the directory ("/" then names, a leading "/" optional as Go's
    `filepath.Join` takes either), each name non-empty, neither "." nor "..", without NUL,
    and not the player's staging."""
    if "\x00" in path:
        return "holds a NUL character"
    names = path.removeprefix("/").split("/")
    if names == [""]:
        return "names the directory itself, not a file in it"
    if any(name == ".." for name in names):
        return "has a '..' segment (paths are rooted at the shard's directory and never leave it)"
    if any(name in ("", ".") for name in names):
        return "is not a clean path (an empty or '.' segment)"
    if names[0] == STAGING:
        return f"is under {STAGING}/, the player's own staging"
    return ""


class UnsafePath(ValueError):
    """A recorded or hinted path that could name a file outside the directory, or that no
    recorder writes: the log or hints cannot be used (unlike FSMError, it is not skipped)."""


def _check_path(path: str, what: str) -> None:
    problem = recorded_path_problem(path)
    if problem:
        raise UnsafePath(f"{what} path {quote(path)} {problem}")


class FSMError(Exception):
    """An operation the FSM did not apply (no state changed)."""


class WrongSeqNo(FSMError):
    pass


class ChecksumMismatch(FSMError):
    pass


class NotHintedAuthor(FSMError):
    """Consistent, perhaps, but by an author the hints do not name next: a dead branch."""


class ExpectedHintedFnode(FSMError):
    pass


class LinkExists(FSMError):
    pass


class NoSuchLink(FSMError):
    pass


class PropertyExists(FSMError):
    pass


class Applied(enum.Enum):
    """How `FSM.apply` took an operation: APPLIED, or UNTRACKED: sequenced (the FSM stepped)
    but of an fnode the hints say is dead later, so its local effects can be skipped."""

    APPLIED = "applied"
    UNTRACKED = "untracked"


@dataclass
class FnodeState:
    links: set[str] = field(default_factory=set)
    segments: list[Segment] = field(default_factory=list)


def live_log_segments(hints: rpb.FSMHints) -> tuple[list[int], SegmentSet]:
    """The hinted live fnodes, in order, and the segments holding them (ValueError if the
    hints are inconsistent)."""
    fnodes: list[int] = []
    segments = SegmentSet()
    for node in hints.live_nodes:
        if not node.segments or node.segments[0].first_seq_no != node.fnode:
            raise ValueError(f"hinted fnode {node.fnode} does not begin its first segment")
        if fnodes and fnodes[-1] >= node.fnode:
            raise ValueError(f"hinted fnodes out of order: {fnodes[-1]} then {node.fnode}")
        fnodes.append(node.fnode)
        for s in node.segments:
            segments.add(Segment.of(s, hints.log))
    if segments and segments[-1].log != hints.log:
        raise ValueError(
            f"the hints' log {hints.log} is not the log of their last segment {segments[-1].log}"
        )
    return fnodes, segments


class FSM:
    """Applies recorded operations in order, checking sequence numbers and checksums; built
    from hints (`FSM(hints)`), it applies only the hinted branch of the log."""

    def __init__(self, hints: rpb.FSMHints) -> None:
        if not hints.log:
            raise ValueError("hints name no log")
        fnodes, segments = live_log_segments(hints)
        self.next_seq_no = 1
        self.next_checksum = 0
        self.last_log = hints.log
        for prop in hints.properties:
            _check_path(prop.path, "hinted property")
        self.properties: dict[str, str] = {p.path: p.content for p in hints.properties}
        self.live_nodes: dict[int, FnodeState] = {}
        self.links: dict[str, int] = {}
        self.hinted_segments: list[Segment] = list(segments)
        self.hinted_fnodes: list[int] = fnodes
        if segments:
            self.next_seq_no = segments[0].first_seq_no
            self.next_checksum = segments[0].first_checksum

    def has_remaining_hints(self) -> bool:
        return bool(self.hinted_segments or self.hinted_fnodes)

    def apply(self, op: rpb.RecordedOp, body: bytes) -> Applied:
        """Step by `op` (whose protobuf bytes are `body`), with its meta-fields `log`,
        `first_offset` and `last_offset` set; FSMError if it does not apply, UnsafePath if it
        is in sequence but names a path outside the directory (nothing changed either way)."""
        if self.hinted_segments and self.hinted_segments[0].author != op.author:
            raise NotHintedAuthor(f"author {op.author} is not the next hinted author")
        if op.seq_no != self.next_seq_no:
            raise WrongSeqNo(f"seq_no {op.seq_no}, expected {self.next_seq_no}")
        if op.checksum != self.next_checksum:
            raise ChecksumMismatch(f"checksum {op.checksum}, expected {self.next_checksum}")
        # Before any state changes: the op would be applied, so its path must be one we write.
        for kind in ("create", "link", "unlink", "property"):
            if op.HasField(kind):
                _check_path(getattr(op, kind).path, f"recorded {kind}")

        outcome = Applied.APPLIED
        if op.HasField("create"):
            outcome = self._create(op)
        elif self.hinted_fnodes and self.hinted_fnodes[0] == op.seq_no:
            raise ExpectedHintedFnode(f"op {op.seq_no} is not a create, and an fnode was hinted")
        elif op.HasField("link"):
            outcome = self._link(op)
        elif op.HasField("unlink"):
            outcome = self._unlink(op)
        elif op.HasField("write"):
            outcome = self._write(op)
        elif op.HasField("property"):
            if op.property.path in self.links:
                raise LinkExists(f"property {op.property.path} is a linked path")
            self.properties[op.property.path] = op.property.content

        self.next_seq_no += 1
        self.next_checksum = checksum_extend(self.next_checksum, body)
        self.last_log = op.log
        if self.hinted_segments and self.hinted_segments[0].last_seq_no < self.next_seq_no:
            self.hinted_segments.pop(0)
            if self.hinted_segments:
                self.next_seq_no = self.hinted_segments[0].first_seq_no
                self.next_checksum = self.hinted_segments[0].first_checksum
        return outcome

    def _create(self, op: rpb.RecordedOp) -> Applied:
        path = op.create.path
        if path in self.links:
            raise LinkExists(f"create of {path}, which exists")
        if path in self.properties:
            raise PropertyExists(f"create of {path}, a property")
        fnode = op.seq_no
        if self.hinted_fnodes:
            if self.hinted_fnodes[0] != fnode:
                return Applied.UNTRACKED
            self.hinted_fnodes.pop(0)
        node = FnodeState({path})
        self._extend(node, op)
        self.live_nodes[fnode] = node
        self.links[path] = fnode
        return Applied.APPLIED

    def _link(self, op: rpb.RecordedOp) -> Applied:
        path, fnode = op.link.path, op.link.fnode
        if path in self.links:
            raise LinkExists(f"link of {path}, which exists")
        if path in self.properties:
            raise PropertyExists(f"link of {path}, a property")
        node = self.live_nodes.get(fnode)
        if node is None:
            return Applied.UNTRACKED
        node.links.add(path)
        self.links[path] = fnode
        self._extend(node, op)
        return Applied.APPLIED

    def _unlink(self, op: rpb.RecordedOp) -> Applied:
        path, fnode = op.unlink.path, op.unlink.fnode
        node = self.live_nodes.get(fnode)
        if node is None:
            return Applied.UNTRACKED
        if path not in node.links:
            raise NoSuchLink(f"unlink of {path}, not a link of fnode {fnode}")
        del self.links[path]
        node.links.discard(path)
        self._extend(node, op)
        if not node.links:
            del self.live_nodes[fnode]
        return Applied.APPLIED

    def _write(self, op: rpb.RecordedOp) -> Applied:
        node = self.live_nodes.get(op.write.fnode)
        if node is None:
            return Applied.UNTRACKED
        self._extend(node, op)
        return Applied.APPLIED

    @staticmethod
    def _extend(node: FnodeState, op: rpb.RecordedOp) -> None:
        segments = node.segments
        if segments and segments[-1].author == op.author and segments[-1].log == op.log:
            segments[-1].last_seq_no = op.seq_no
            segments[-1].last_offset = op.last_offset
            return
        segments.append(
            Segment(op.author, op.seq_no, op.first_offset, op.checksum, op.seq_no,
                    op.last_offset, op.log)
        )  # fmt: skip

    def build_hints(self, log: str) -> rpb.FSMHints:
        """Hints from which a player rebuilds this state: the live fnodes in order, each with
        its segments (a segment of `log` leaves its log out), and the properties."""
        hints = rpb.FSMHints(log=log)
        for fnode in sorted(self.live_nodes):
            node = hints.live_nodes.add(fnode=fnode)
            node.segments.extend(s.message(log) for s in self.live_nodes[fnode].segments)
        for path in sorted(self.properties):
            hints.properties.add(path=path, content=self.properties[path])
        return hints
