"""Fragments: content-addressed spans of a journal, and the Spool that builds them.

A replica applies replicated content and proposals to its Spool; completed fragments are what
gets persisted to fragment stores under their content names.
"""

from broker.fragment.fragments import (
    ZERO_DIGEST,
    apply_register_updates,
    check_registers,
    codec_extension,
    codec_from_extension,
    content_length,
    content_name,
    content_path,
    digest_of,
    parse_content_name,
    parse_relative_path,
    sum_from_digest,
    sum_of,
    zero_sum,
)
from broker.fragment.spool import CompletedFragment, Spool, SpoolError, SpoolObserver

__all__ = [
    "ZERO_DIGEST",
    "CompletedFragment",
    "Spool",
    "SpoolError",
    "SpoolObserver",
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
