"""Helpers over `protocol.Fragment`: SHA-1 sums, content-addressed names and paths, and the
journal register checks and updates that appends carry. Names and codec extensions are upstream's,
so fragments written by either implementation are listed and read by the other.
"""

from __future__ import annotations

import hashlib
import re
import struct

from broker.protocol import labels
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import (
    MAX_JOURNAL_NAME_LEN,
    ValidationError,
    clean_path,
    validate_journal_name,
    validate_path_component,
)

__all__ = [
    "SHA1_SIZE",
    "ZERO_DIGEST",
    "apply_register_updates",
    "check_registers",
    "codec_extension",
    "codec_from_extension",
    "content_length",
    "content_name",
    "content_path",
    "digest_of",
    "parse_content_name",
    "parse_relative_path",
    "sum_from_digest",
    "sum_of",
    "zero_sum",
]

SHA1_SIZE = 20
# The digest of a fragment without content: all zeros by convention, not SHA-1 of b"".
ZERO_DIGEST = bytes(SHA1_SIZE)

_SUM_LAYOUT = struct.Struct(">QQI")
_INT64_MAX = (1 << 63) - 1

_EXTENSIONS: dict[int, str] = {
    pb.NONE: ".raw",
    pb.GZIP: ".gz",
    pb.ZSTANDARD: ".zst",
    pb.SNAPPY: ".sz",
    # Upstream writes no extension for this codec (".gzod" is planned), and reads both.
    pb.GZIP_OFFLOAD_DECOMPRESSION: "",
}
_CODECS_BY_EXTENSION: dict[str, pb.CompressionCodec] = {
    ".raw": pb.NONE,
    ".gz": pb.GZIP,
    ".gzip": pb.GZIP,
    ".zst": pb.ZSTANDARD,
    ".zstandard": pb.ZSTANDARD,
    ".sz": pb.SNAPPY,
    ".snappy": pb.SNAPPY,
    "": pb.GZIP_OFFLOAD_DECOMPRESSION,
    ".gzod": pb.GZIP_OFFLOAD_DECOMPRESSION,
}

# What Go's strconv.ParseInt(s, 16, 64) and hex.DecodeString accept; Python's int(s, 16) and
# bytes.fromhex would also take "0x", "_" and whitespace, which upstream rejects.
_SIGNED_HEX = re.compile(r"[+-]?[0-9a-fA-F]+")
_SHA1_HEX = re.compile(r"[0-9a-fA-F]{40}")


# --- Sums ----------------------------------------------------------------------------------------


def sum_from_digest(digest: bytes) -> pb.SHA1Sum:
    """The SHA1Sum of a 20-byte digest, split big-endian into 8 + 8 + 4 bytes."""
    if len(digest) != SHA1_SIZE:
        raise ValueError(f"a SHA-1 digest has {SHA1_SIZE} bytes, not {len(digest)}")
    part1, part2, part3 = _SUM_LAYOUT.unpack(digest)
    return pb.SHA1Sum(part1=part1, part2=part2, part3=part3)


def digest_of(sha1_sum: pb.SHA1Sum) -> bytes:
    """The 20-byte digest of a SHA1Sum (all zeros for an unset sum)."""
    return _SUM_LAYOUT.pack(sha1_sum.part1, sha1_sum.part2, sha1_sum.part3)


def sum_of(content: bytes) -> pb.SHA1Sum:
    """The SHA1Sum of `content`, as a digest (b"" gives SHA-1 of b"", not the zero sum)."""
    return sum_from_digest(hashlib.sha1(content).digest())


def zero_sum() -> pb.SHA1Sum:
    """The sum every empty fragment carries."""
    return pb.SHA1Sum()


# --- Names and paths -----------------------------------------------------------------------------


def content_length(fragment: pb.Fragment) -> int:
    """Bytes of journal content in the fragment (uncompressed, whatever its codec)."""
    return fragment.end - fragment.begin


def codec_extension(codec: pb.CompressionCodec) -> str:
    """The file extension of fragments compressed with `codec`."""
    try:
        return _EXTENSIONS[codec]
    except KeyError:
        raise ValueError(f"compression codec {codec} has no file extension") from None


def codec_from_extension(extension: str) -> pb.CompressionCodec:
    """The codec of a fragment file extension ("" included), case-insensitively."""
    try:
        return _CODECS_BY_EXTENSION[extension.lower()]
    except KeyError:
        raise ValidationError(
            "compression_codec", extension, f"unrecognized compression extension {extension!r}"
        ) from None


def content_name(fragment: pb.Fragment) -> str:
    """The content-addressed file name: `{begin:016x}-{end:016x}-{sha1 hex}{extension}`."""
    return (
        f"{fragment.begin:016x}-{fragment.end:016x}-{digest_of(fragment.sum).hex()}"
        f"{codec_extension(fragment.compression_codec)}"
    )


def content_path(journal: str, path_postfix: str, name: str) -> str:
    """Where a fragment lives under a store's root: `journal/path_postfix/name`, without
    empty segments (as Go's path.Join, which also cleans the result)."""
    parts = [part for part in (journal, path_postfix, name) if part]
    return clean_path("/".join(parts)) if parts else ""


def _split_extension(name: str) -> tuple[str, str]:
    # Go's path.Ext: the suffix from the final '.', or "" when there is none.
    dot = name.rfind(".")
    return (name, "") if dot < 0 else (name[:dot], name[dot:])


def _parse_offset(text: str, field: str, name: str) -> int:
    if not _SIGNED_HEX.fullmatch(text):
        raise ValidationError(field, name, f"{text!r} is not a hexadecimal offset (in {name!r})")
    value = int(text, 16)
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise ValidationError(field, name, f"{text!r} is out of range for an offset")
    return value


def parse_content_name(name: str, *, journal: str = "", path_postfix: str = "") -> pb.Fragment:
    """The Fragment named by a content name (see `content_name`), of `journal` and `path_postfix`.

    Raises ValidationError for a name that is not a fragment's, or a fragment that is invalid
    (begin after end, a bad journal name when one is given, a postfix that is not a clean path
    of valid characters, or has a '.' or '..' segment: the fragment could not be read back at
    the path it was found at).
    """
    stem, extension = _split_extension(name)
    fields = stem.split("-")
    if len(fields) != 3:
        raise ValidationError("name", name, f"{name!r} is not a fragment name")
    begin = _parse_offset(fields[0], "begin", name)
    end = _parse_offset(fields[1], "end", name)
    if not _SHA1_HEX.fullmatch(fields[2]):
        raise ValidationError("sum", name, f"{fields[2]!r} is not a 40-digit hex SHA-1 sum")
    codec = codec_from_extension(extension)
    if journal:
        validate_journal_name(journal)
    if begin > end:
        raise ValidationError("begin", name, f"begin {begin} is after end {end} (in {name!r})")
    # Checked before protobuf holds it: a store may list names that are not even UTF-8.
    validate_path_component(
        path_postfix, field="path_postfix", min_len=0, max_len=MAX_JOURNAL_NAME_LEN
    )
    if path_postfix and any(part in (".", "..") for part in path_postfix.split("/")):
        raise ValidationError(
            "path_postfix",
            path_postfix,
            f"{path_postfix!r} has a '.' or '..' segment, so the fragment cannot be read back "
            "at the path it was found at",
        )
    return pb.Fragment(
        journal=journal,
        begin=begin,
        end=end,
        sum=sum_from_digest(bytes.fromhex(fields[2])),
        compression_codec=codec,
        path_postfix=path_postfix,
    )


def parse_relative_path(journal: str, relative: str) -> pb.Fragment:
    """The Fragment at `relative`, a path under the journal's directory of a store: an optional
    path postfix, then a content name (how store listings are read back)."""
    postfix, _, name = relative.rpartition("/")
    return parse_content_name(name, journal=journal, path_postfix=postfix)


# --- Registers -----------------------------------------------------------------------------------


def check_registers(selector: pb.LabelSelector | None, registers: pb.LabelSet) -> bool:
    """Whether an append expecting `selector` may proceed given the journal's `registers`.

    Empty registers match every selector: they are the "unlocked" state of cooperative locks,
    and what journals restart with if etcd consensus (and so the registers) is lost, which must
    not lock out a writer that held the lock before.
    """
    if selector is None or not registers.labels:
        return True
    return labels.matches(selector, registers)


def apply_register_updates(
    registers: pb.LabelSet, union: pb.LabelSet | None, subtract: pb.LabelSet | None
) -> pb.LabelSet:
    """The registers after a committed append: `subtract` is removed first, then `union` is
    merged, its values replacing any current values of the same label name."""
    updated = registers
    if subtract is not None and subtract.labels:
        updated = labels.subtract(updated, subtract)
    if union is not None and union.labels:
        updated = labels.union(union, updated)
    return labels.normalize(updated)
