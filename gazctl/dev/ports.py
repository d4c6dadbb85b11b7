"""The ports a dev cluster listens on, kept in `<dir>/ports.json` after `down`: the next `up`
listens on them again where still free (and says which moved), so exported addresses keep
working."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plumbing.local_etcd import free_port

PORTS = "ports.json"


@dataclass
class Ports:
    """The ports a dev cluster listens on, kept from one `up` to the next."""

    etcd_client: int
    etcd_peer: int
    brokers: list[int]
    consumers: list[int] = field(default_factory=list)
    postgres: int = 0
    locations: dict[str, list[int]] = field(default_factory=dict)  # Name: [broker, service].

    def save(self, directory: Path) -> None:
        (directory / PORTS).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(directory: Path) -> Ports | None:
        try:
            doc = json.loads((directory / PORTS).read_text())
            ports = Ports(
                int(doc["etcd_client"]),
                int(doc["etcd_peer"]),
                [int(p) for p in doc["brokers"]],
                [int(p) for p in doc.get("consumers", [])],
                int(doc.get("postgres", 0)),
                {str(n): [int(p) for p in ps] for n, ps in doc.get("locations", {}).items()},
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ports


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as etcd and gRPC servers do,
    with SO_REUSEADDR: connections of an earlier run in TIME_WAIT do not hold it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def choose_ports(
    previous: Ports | None,
    brokers: int,
    consumers: int = 0,
    postgres: bool = False,
    locations: Sequence[str] = (),
) -> tuple[Ports, list[str]]:
    """The previous run's ports where still free, new ones where not (or for new processes);
    and a line for each process that moved."""
    old = previous or Ports(0, 0, [])
    reserved = {old.etcd_client, old.etcd_peer, *old.brokers, *old.consumers, old.postgres}
    reserved |= {p for ports in old.locations.values() for p in ports}
    moved: list[str] = []

    def pick(role: str, before: int, then: str = "") -> int:
        if before and port_is_free(before):
            return before
        port = free_port()
        while port in reserved:  # Another process's remembered port: keep it for that one.
            port = free_port()
        reserved.add(port)
        if before:
            moved.append(f"{role}: port {before} is taken by another process, so {role} "
                         f"listens on port {port}{then}")  # fmt: skip
        return port

    again = "; export BROKER_ADDRESS again (as printed below)"
    ports = Ports(
        pick("etcd", old.etcd_client),
        pick("etcd (peer)", old.etcd_peer),
        [
            pick(
                f"broker-{i}",
                old.brokers[i] if i < len(old.brokers) else 0,
                again,
            )
            for i in range(brokers)
        ],
        [
            pick(
                f"consumer-{i}",
                old.consumers[i] if i < len(old.consumers) else 0,
                "; export CONSUMER_ADDRESS again (as printed below)",
            )
            for i in range(consumers)
        ],
        pick("postgres", old.postgres, "; export POSTGRES_DSN again") if postgres else old.postgres,
        {
            name: [
                pick(f"location-{name}-broker", (old.locations.get(name) or [0, 0])[0]),
                pick(f"location-{name}", (old.locations.get(name) or [0, 0])[1]),
            ]
            for name in locations
        },
    )
    return ports, moved
