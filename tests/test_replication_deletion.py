"""`gazctl replication delete` when a neighbour cannot answer (found by the replication campaign's
operator-commands scenario, issue 38): the rule needs the CVV of every directly connected
location, so the deletion is refused, at once, in one line naming the neighbour; the location
that refuses is not said to be unreachable (that reads as "perhaps done"), and nothing is
deleted."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aetcd

from broker.testing import EtcdServer
from replication import registry
from replication.journals import apply_location_journals
from tests.conftest import BrokerProcess
from tests.helpers.locations import LocationProcesses, refused
from tests.helpers.waiting import until_blocking


def test_a_deletion_whose_neighbour_cannot_answer_is_refused_at_once_naming_it(
    location_broker: BrokerProcess,
    locations: LocationProcesses,
    etcd_server: EtcdServer,
    etcd_prefix: str,
) -> None:
    asyncio.run(apply_location_journals(location_broker.address, "A", "B"))
    for name in "AB":
        locations.start(name, location_broker.address)
    locations.ok("connect", "A", "B", "--both")
    locations.ok("emit", "A", '{"n": 1}', '{"n": 2}')
    until_blocking(lambda: locations.status("B")["cvv"].get("A", 0) >= 2, "B holds A's events")
    last = locations.status("A")["last_seq"]
    held = [e["seq"] for e in locations.events("A")]

    # B's process is gone: nobody serves it.
    locations.stop("B")
    line = refused(locations, "delete", "A", "--through", str(last))
    assert "location A is unreachable" not in line, line
    assert "A may not delete through" in line and "location B is unreachable" in line, line

    # B's endpoint takes connections and answers nothing (a partition that drops its packets,
    # a paused process): the refusal still comes well before gazctl's own deadline (30 s).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    prefix = f"{etcd_prefix}/replication"
    key = registry.endpoint_key(prefix, "B")
    endpoint = json.dumps({"endpoint": f"http://127.0.0.1:{silent.getsockname()[1]}", "pid": 1})

    async def put(value: str | None) -> None:
        async with aetcd.Client(host=etcd_server.host, port=etcd_server.client_port) as etcd:
            if value is None:
                await etcd.delete(key)
            else:
                await etcd.put(key, value.encode())

    try:
        asyncio.run(put(endpoint))
        began = time.monotonic()
        line = refused(locations, "delete", "A", "--through", str(last))
        took = time.monotonic() - began
        assert "location A is unreachable" not in line, line
        assert "A may not delete through" in line and "location B is unreachable" in line, line
        assert took < 20, f"refused after {took:.1f}s: {line}"
    finally:
        asyncio.run(put(None))
        silent.close()

    status = locations.status("A")
    assert status["deleted_through"] == 0 and status["dvv"] == {}
    assert [e["seq"] for e in locations.events("A")] == held
