"""Journal and shard specifications as operators write them: hierarchical journal YAML with
inheritance and hoisting, shardspace YAML with a common part pushed down and hoisted, and Go
duration text.
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
from spec.shards import (
    ShardEntry,
    ShardSpace,
    decode_shards,
    decode_shardspace,
    encode_shards,
    encode_shardspace,
    hoist_shards,
    push_down,
)

__all__ = [
    "JournalEntry",
    "JournalNode",
    "ShardEntry",
    "ShardSpace",
    "SpecError",
    "decode_journals",
    "decode_shards",
    "decode_shardspace",
    "decode_tree",
    "encode_journals",
    "encode_shards",
    "encode_shardspace",
    "encode_tree",
    "flatten",
    "hoist",
    "hoist_shards",
    "push_down",
]
