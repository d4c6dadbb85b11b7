"""Journal (and later shard) specifications as operators write them: hierarchical YAML with
inheritance and hoisting, and Go duration text.
"""

from spec.journals import (
    JournalEntry,
    JournalNode,
    SpecError,
    decode_journals,
    decode_tree,
    encode_journals,
    encode_tree,
    flatten,
    hoist,
)

__all__ = [
    "JournalEntry",
    "JournalNode",
    "SpecError",
    "decode_journals",
    "decode_tree",
    "encode_journals",
    "encode_tree",
    "flatten",
    "hoist",
]
