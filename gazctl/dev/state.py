"""The dev cluster's processes as `up` recorded them in `<dir>/cluster.json`: each one's pid,
address, log, the marker its command line must hold to be ours, and how to start it again."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

STATE = "cluster.json"


@dataclass
class Proc:
    role: str
    pid: int
    address: str
    log: str
    marker: str  # a string the process's command line must contain for it to be ours
    # How `up` started it, so that `up` (for a process that died) and `restart` start it the
    # same way again: its command, what it adds to the environment (the cluster's TLS and key
    # come from <dir>), and the etcd key it holds under its lease (its member key, revoked
    # before it starts again, so the new process need not wait for the old lease to expire).
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    lease_key: str = ""


@dataclass
class ClusterState:
    dir: str
    etcd: Proc
    brokers: list[Proc] = field(default_factory=list)
    postgres: Proc | None = None
    consumers: list[Proc] = field(default_factory=list)
    app: str = ""
    # Replication: each location's process, and the broker of its own cluster.
    locations: list[Proc] = field(default_factory=list)
    location_brokers: list[Proc] = field(default_factory=list)
    tls: bool = False
    auth: bool = False

    def all(self) -> list[Proc]:
        """Every process, in the order to stop them: consumers, locations, brokers,
        PostgreSQL, etcd."""
        return [
            *self.consumers,
            *self.locations,
            *self.location_brokers,
            *self.brokers,
            *([self.postgres] if self.postgres else []),
            self.etcd,
        ]

    def tiers(self) -> list[list[Proc]]:
        """`all` in the tiers `down` stops together: consumers and locations, then their
        brokers, then PostgreSQL, then etcd. Members of a tier stopped together each see the
        others exiting, so none waits out its drain timeout for a hand-off to a member that is
        leaving too; each broker still persists what its spools hold before it exits."""
        return [
            tier
            for tier in (
                [*self.consumers, *self.locations],
                [*self.location_brokers, *self.brokers],
                [self.postgres] if self.postgres else [],
                [self.etcd],
            )
            if tier
        ]

    def groups(self) -> list[tuple[str, list[Proc]]]:
        """The processes by kind, in the order to start them (each needs those before it)."""
        return [
            ("etcd", [self.etcd]),
            ("brokers", self.brokers),
            ("postgres", [self.postgres] if self.postgres else []),
            ("consumers", self.consumers),
            ("location brokers", self.location_brokers),
            ("locations", self.locations),
        ]

    def start_order(self) -> list[Proc]:
        return [proc for _, group in self.groups() for proc in group]

    def find(self, name: str) -> Proc:
        """The process `dev status` shows as `name`; else one line naming the valid ones."""
        for proc in self.all():
            if proc.role == name:
                return proc
        names = ", ".join(p.role for p in self.start_order())
        raise click.ClickException(f"no process {name!r} in the dev cluster in {self.dir}: "
                                   f"give one of {names}")  # fmt: skip

    def location_names(self) -> list[str]:
        return [p.role.removeprefix("location-") for p in self.locations]

    def save(self) -> None:
        Path(self.dir, STATE).write_text(json.dumps(asdict(self), indent=2))

    @staticmethod
    def load(directory: Path) -> ClusterState | None:
        path = directory / STATE
        if not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
            return ClusterState(
                dir=doc["dir"],
                etcd=Proc(**doc["etcd"]),
                brokers=[Proc(**b) for b in doc["brokers"]],
                postgres=Proc(**doc["postgres"]) if doc.get("postgres") else None,
                consumers=[Proc(**c) for c in doc.get("consumers", [])],
                app=str(doc.get("app", "")),
                locations=[Proc(**c) for c in doc.get("locations", [])],
                location_brokers=[Proc(**c) for c in doc.get("location_brokers", [])],
                tls=bool(doc.get("tls", False)),
                auth=bool(doc.get("auth", False)),
            )
        except (ValueError, KeyError, TypeError):
            return None


def brokers_address(state: ClusterState) -> str:
    """Every broker's address, comma-separated: what clients and consumers dial, so that
    killing any one broker leaves them reaching the others."""
    return ",".join(b.address for b in state.brokers)


def load_state(directory: str) -> ClusterState:
    root = Path(directory).resolve()
    state = ClusterState.load(root)
    if state is None:
        raise click.ClickException(f"no dev cluster in {root}: start one with `gazctl dev up`")
    return state
