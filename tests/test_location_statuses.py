"""The Location service maps errors to statuses narrowly: a request's bad value is
INVALID_ARGUMENT, but a defect of ours (a KeyError, a TypeError) is INTERNAL and logged, never
blamed on the caller. A unit test of the service's guard, with a fake gRPC context (the
end-to-end refusals are in test_replication_locations and test_replication_commands)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from aetcd import exceptions as etcd_errors

from replication import location_pb2 as lpb
from replication.connections import ConnectionState, Phase
from replication.process import LocationConfig, LocationProcess
from replication.service import LocationService


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted


async def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    server = LocationProcess(LocationConfig("A", "http://127.0.0.1:1", "http://127.0.0.1:2"))

    async def failing(_request: Any) -> Any:
        raise exc

    handle = LocationService(server)._guard("Status", failing, lpb.StatusRequest)
    context = FakeContext()
    with pytest.raises(Aborted):
        await handle(b"", context)
    assert context.aborted is not None
    return context.aborted


@pytest.mark.parametrize("defect", [KeyError("B"), TypeError("unhashable type: 'list'")])
async def test_a_defect_is_internal_and_logged_not_the_callers_fault(
    defect: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="replication"):
        code, details = await status_of(defect)
    assert code == grpc.StatusCode.INTERNAL, details
    assert details.startswith("location A: Status failed on an internal error (")
    assert type(defect).__name__ in details
    assert any(r.exc_info and r.exc_info[1] is defect for r in caplog.records), "not logged"


async def test_a_bad_value_in_the_request_is_invalid_argument() -> None:
    code, details = await status_of(ValueError("filter 'x=': expected a value"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "A: filter 'x=': expected a value"


async def test_etcd_away_is_unavailable() -> None:
    code, details = await status_of(etcd_errors.ConnectionFailedError("connection refused"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details == "location A: cannot reach etcd: connection refused"


def test_a_connections_state_shows_its_phase_and_what_it_waits_for() -> None:
    state = ConnectionState("B", "")
    assert state.state == "starting"
    state.enter(Phase.WAITING, "DVV-B [1] is not <= CVV-A [0]")
    assert state.message(0).state == "waiting: DVV-B [1] is not <= CVV-A [0]"
    state.enter(Phase.RETRYING, error="unreachable")
    assert (state.state, state.error) == ("retrying", "unreachable")
    state.enter(Phase.REPLICATING)
    assert (state.state, state.error, state.why) == ("replicating", "", "")
