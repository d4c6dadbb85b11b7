"""Fragments: content-addressed spans of a journal, and the Spool that builds them.

A replica applies replicated content and proposals to its Spool; completed fragments are what
gets persisted to fragment stores under their content names.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from broker.fragment.spool import CompletedFragment, Spool, SpoolError, SpoolObserver

_SPOOL_NAMES = frozenset({"CompletedFragment", "Spool", "SpoolError", "SpoolObserver"})


def __getattr__(name: str) -> Any:
    """The Spool's names on first use: a client reading fragments never builds one, and the
    spool's metrics would cost every `gazctl` run the Prometheus client's import."""
    if name in _SPOOL_NAMES:
        from broker.fragment import spool

        return getattr(spool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
