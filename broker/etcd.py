"""Thin helpers over the aetcd client for what aetcd does not expose directly.

aetcd's `transaction()` drops the response header, but an Apply must wait for the keyspace to
reach the transaction's revision, so transactions go through the raw KV stub here.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd import rpc


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    cluster_id: int
    member_id: int
    raft_term: int


def parse_etcd_address(address: str) -> tuple[str, int]:
    """Split an `http://host:port` etcd address (upstream's --etcd.address form)."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    if parsed.scheme not in ("http", "unix") or not parsed.hostname:
        raise ValueError(f"--etcd.address {address!r}: expected http://HOST:PORT")
    return parsed.hostname, parsed.port or 2379


def connect(address: str, timeout: float | None = None) -> aetcd.Client:
    host, port = parse_etcd_address(address)
    # gRPC's default reconnect backoff grows to 2 minutes; an etcd restart should cost seconds.
    options = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.max_reconnect_backoff_ms": 2000}
    return aetcd.Client(host=host, port=port, timeout=timeout, options=options)


def put_keeping_lease(key: bytes, value: bytes) -> Any:
    """A transaction Put that keeps the key's current lease (etcd's ignore_lease)."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, ignore_lease=True))


async def txn(client: aetcd.Client, compare: Sequence[Any], success: Sequence[Any]) -> TxnResult:
    """Run one etcd transaction and return whether it succeeded, with its header."""
    await client.connect()
    ops = [
        op if isinstance(op, rpc.RequestOp) else client._ops_to_requests([op])[0] for op in success
    ]
    request = rpc.TxnRequest(
        compare=[c.build_message() for c in compare],
        success=ops,
        failure=[],
    )
    try:
        response = await client.kvstub.Txn(
            request, timeout=client._timeout, metadata=client.metadata
        )
    except rpc.AioRpcError as exc:
        aetcd.exceptions._handle_exception(exc)
        raise
    header = response.header
    return TxnResult(
        succeeded=bool(response.succeeded),
        revision=int(header.revision),
        cluster_id=int(header.cluster_id),
        member_id=int(header.member_id),
        raft_term=int(header.raft_term),
    )
