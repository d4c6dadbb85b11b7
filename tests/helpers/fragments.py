"""Persisted fragments made directly in a store, exactly as a broker persists them: for tests
of what reads and rewrites stores (the Spark jobs) without running brokers to fill them."""

from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Sequence

from broker.fragment import codecs
from broker.fragment.content import fragment_path
from broker.fragment.fragments import sum_from_digest
from broker.fragment.stores import FragmentStore
from broker.protocol import protocol_pb2 as pb


def put_fragment(
    store: FragmentStore,
    journal: str,
    begin: int,
    content: bytes,
    codec: int = pb.NONE,
    postfix: str = "",
) -> pb.Fragment:
    """Persist `content` as the fragment of `journal` at [begin, begin + len)."""
    fragment = pb.Fragment(
        journal=journal,
        begin=begin,
        end=begin + len(content),
        sum=sum_from_digest(hashlib.sha1(content).digest()),
        compression_codec=pb.CompressionCodec.ValueType(codec),
        backing_store=store.url,
        path_postfix=postfix,
    )
    data = codecs.compress(fragment.compression_codec, content)
    store.put(
        fragment_path(fragment),
        io.BytesIO(data),
        len(data),
        codecs.content_encoding(fragment.compression_codec),
    )
    return fragment


def put_pieces(
    store: FragmentStore,
    journal: str,
    content: bytes,
    cuts: Sequence[int],
    codec: int = pb.NONE,
    postfix: str = "",
) -> list[pb.Fragment]:
    """`content` persisted as fragments cut at the offsets `cuts` (sorted, inside the content)."""
    points = [0, *cuts, len(content)]
    return [
        put_fragment(store, journal, a, content[a:b], codec, postfix)
        for a, b in itertools.pairwise(points)
        if b > a
    ]
