"""The optional parts of a consumer application and of its stores, declared: each is a Protocol
below, and `AppHooks.of(app)` and `StoreHooks.of(store)` find the ones given, check each, and
hand them out typed. A consumer process checks its application as it loads it (`gazette-consumer
serve` refuses a malformed hook in one line); the runtime and the transaction loop read hooks
from these, never by name.

Upstream declares the same as optional Go interfaces (`BeginFinisher`, `MessageProducer`, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import asyncio

    from broker.protocol import protocol_pb2 as pb
    from consumer.protocol import cpb
    from message.types import MessageType


@runtime_checkable
class BeginsTxn(Protocol):
    async def begin_txn(self, shard: Any, store: Any) -> None:
        """As a transaction begins, before its first message."""


@runtime_checkable
class FinishesTxn(Protocol):
    async def finished_txn(self, shard: Any, store: Any, committed: asyncio.Task[Any]) -> None:
        """Once a transaction starts to commit; `committed` resolves with its commit."""


@runtime_checkable
class ChoosesMessageTypes(Protocol):
    def message_type(self, journal: pb.JournalSpec) -> MessageType[Any]:
        """The message type of a source journal (default: JSON objects, as dicts)."""
        ...


@runtime_checkable
class InitsApplication(Protocol):
    async def init_application(self, consumer: Any) -> None:
        """As the process starts, before it serves (upstream's `InitApplication`)."""


@runtime_checkable
class ClosesApplication(Protocol):
    async def close_application(self) -> None:
        """As the process stops, after its shards stopped."""


@runtime_checkable
class ServesPrimary(Protocol):
    async def run_primary(
        self, consumer: Any, spec: cpb.ShardSpec, ready: Callable[[], Awaitable[None]]
    ) -> None:
        """Run as a shard's primary instead of the transaction loop; `await ready()` once it
        fenced out any earlier primary and serves (only then is it advertised PRIMARY)."""


@runtime_checkable
class FollowsAsStandby(Protocol):
    async def run_standby(self, consumer: Any, spec: cpb.ShardSpec) -> None:
        """Run by each standby (STANDBY) of a shard until the replica stops."""


@runtime_checkable
class BuildsHints(Protocol):
    async def build_hints(self) -> Any:
        """A store's recovery-log hints, built as the store syncs (default: the recorder's)."""


# Each hook: its Protocol, whether it is a coroutine function, and its parameters after self.
APP_HOOKS: dict[str, tuple[type, bool, tuple[str, ...]]] = {
    "begin_txn": (BeginsTxn, True, ("shard", "store")),
    "finished_txn": (FinishesTxn, True, ("shard", "store", "committed")),
    "message_type": (ChoosesMessageTypes, False, ("journal_spec",)),
    "init_application": (InitsApplication, True, ("consumer",)),
    "close_application": (ClosesApplication, True, ()),
    "run_primary": (ServesPrimary, True, ("consumer", "spec", "ready")),
    "run_standby": (FollowsAsStandby, True, ("consumer", "spec")),
}
STORE_HOOKS: dict[str, tuple[type, bool, tuple[str, ...]]] = {
    "build_hints": (BuildsHints, True, ()),
}


class HookError(TypeError):
    """An application's (or store's) hook that is not what its Protocol declares."""


def _checked(owner: object, name: str, spec: tuple[type, bool, tuple[str, ...]]) -> Any:
    """`owner`'s hook `name` if it gives one (checked), else None."""
    _protocol, is_async, params = spec
    hook = getattr(owner, name, None)
    if hook is None:
        return None
    shape = f"{'async ' if is_async else ''}def {name}(self{''.join(', ' + p for p in params)})"
    where = f"{type(owner).__name__}.{name}"
    if not callable(hook):
        raise HookError(f"{where} is not a method: give it as `{shape}`")
    if inspect.iscoroutinefunction(hook) != is_async:
        kind = "a coroutine function (async def)" if is_async else "a plain function, not async"
        raise HookError(f"{where} must be {kind}: `{shape}`")
    try:
        inspect.signature(hook).bind(*params)
    except TypeError:
        raise HookError(f"{where} takes other parameters than `{shape}`") from None
    except ValueError:  # No signature to read (a builtin): take it as given.
        pass
    return hook


@dataclass(frozen=True)
class AppHooks:
    """The optional hooks an application gives, each checked against its Protocol."""

    begin_txn: Callable[[Any, Any], Awaitable[None]] | None = None
    finished_txn: Callable[[Any, Any, asyncio.Task[Any]], Awaitable[None]] | None = None
    message_type: Callable[[pb.JournalSpec], MessageType[Any]] | None = None
    init_application: Callable[[Any], Awaitable[None]] | None = None
    close_application: Callable[[], Awaitable[None]] | None = None
    run_primary: Callable[[Any, cpb.ShardSpec, Callable[[], Awaitable[None]]], Awaitable[None]] | None = None  # fmt: skip
    run_standby: Callable[[Any, cpb.ShardSpec], Awaitable[None]] | None = None

    @classmethod
    def of(cls, app: object) -> AppHooks:
        """The hooks `app` gives; HookError names the first malformed one."""
        return cls(**{name: _checked(app, name, spec) for name, spec in APP_HOOKS.items()})


@dataclass(frozen=True)
class StoreHooks:
    """The optional parts a store gives: `build_hints`, and `pipelined_commits`, how many of
    its commits may be in flight at once (default 1)."""

    build_hints: Callable[[], Awaitable[Any]] | None = None
    pipelined_commits: int = 1

    @classmethod
    def of(cls, store: object) -> StoreHooks:
        depth = getattr(store, "pipelined_commits", 1)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise HookError(f"{type(store).__name__}.pipelined_commits must be an int >= 1, not {depth!r}")  # fmt: skip
        hooks = {name: _checked(store, name, spec) for name, spec in STORE_HOOKS.items()}
        return cls(pipelined_commits=depth, **hooks)
