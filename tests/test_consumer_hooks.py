"""An application's optional hooks are declared (`consumer.hooks`) and checked as it loads: a
malformed one is refused in one line naming it and its expected shape, before anything runs."""

from __future__ import annotations

import sys
import types
from typing import Any

import click
import pytest

from consumer.__main__ import load_application
from consumer.hooks import AppHooks, HookError, StoreHooks


class Base:
    async def new_store(self, shard: Any) -> Any: ...
    async def consume_message(
        self, shard: Any, store: Any, envelope: Any, publisher: Any
    ) -> None: ...
    async def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None: ...


class Full(Base):
    async def begin_txn(self, shard: Any, store: Any) -> None: ...
    async def finished_txn(self, shard: Any, store: Any, committed: Any) -> None: ...
    def message_type(self, journal_spec: Any) -> Any: ...
    async def init_application(self, consumer: Any) -> None: ...
    async def close_application(self) -> None: ...
    async def run_primary(self, consumer: Any, spec: Any, ready: Any) -> None: ...
    async def run_standby(self, consumer: Any, spec: Any) -> None: ...


def test_the_hooks_an_application_gives_are_found_and_the_rest_are_none() -> None:
    full, bare = AppHooks.of(Full()), AppHooks.of(Base())
    for name in AppHooks.__dataclass_fields__:
        assert getattr(full, name) is not None, name
        assert getattr(bare, name) is None, name


class SyncBegin(Base):
    def begin_txn(self, shard: Any, store: Any) -> None: ...


class AsyncMessageType(Base):
    async def message_type(self, journal_spec: Any) -> Any: ...


class FinishedTwoArgs(Base):
    async def finished_txn(self, shard: Any, store: Any) -> None: ...


class InitNotCallable(Base):
    init_application = "soon"


@pytest.mark.parametrize(
    ("app", "says"),
    [
        (SyncBegin(), "SyncBegin.begin_txn must be a coroutine function (async def): `async def begin_txn(self, shard, store)`"),
        (AsyncMessageType(), "AsyncMessageType.message_type must be a plain function, not async: `def message_type(self, journal_spec)`"),
        (FinishedTwoArgs(), "FinishedTwoArgs.finished_txn takes other parameters than `async def finished_txn(self, shard, store, committed)`"),
        (InitNotCallable(), "InitNotCallable.init_application is not a method: give it as `async def init_application(self, consumer)`"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else "",
)  # fmt: skip
def test_a_malformed_hook_is_named_with_the_shape_it_must_have(app: object, says: str) -> None:
    with pytest.raises(HookError) as caught:
        AppHooks.of(app)
    assert str(caught.value) == says


def test_the_consumer_command_refuses_a_malformed_hook_as_it_loads_the_application(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("hooks_test_app")
    module.SyncBegin = SyncBegin  # type: ignore[attr-defined]
    module.Full = Full  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hooks_test_app", module)
    with pytest.raises(click.UsageError) as caught:
        load_application("hooks_test_app:SyncBegin")
    message = caught.value.format_message()
    assert "\n" not in message
    assert message.startswith("--app 'hooks_test_app:SyncBegin': SyncBegin.begin_txn must be")
    assert isinstance(load_application("hooks_test_app:Full"), Full)


class Hinting:
    pipelined_commits = 4

    async def build_hints(self) -> Any: ...


class BadDepth:
    pipelined_commits = 0


class SyncHints:
    def build_hints(self) -> Any: ...


def test_a_stores_optional_parts_are_found_and_checked() -> None:
    hooks = StoreHooks.of(Hinting())
    assert hooks.pipelined_commits == 4 and hooks.build_hints is not None
    assert StoreHooks.of(object()) == StoreHooks()
    with pytest.raises(HookError, match=r"BadDepth\.pipelined_commits must be an int >= 1, not 0"):
        StoreHooks.of(BadDepth())
    with pytest.raises(HookError, match=r"SyncHints\.build_hints must be a coroutine function"):
        StoreHooks.of(SyncHints())
