"""The registry of locations in etcd, under a replication prefix (default
`/gazette/replication`):

* `PREFIX/locations/NAME`: the location's declaration, kept for good once its process first
  started (or `gazctl replication add` declared it): `{"journal": ..., "broker": ...}`, its
  local event log and the broker address of the cluster that holds it (locations in different
  clusters read each other's logs by that address); with `add`, also the journal's fragment
  `store` and `replication`, to make it anew after a disaster;
* `PREFIX/endpoints/NAME`: `{"endpoint": ..., "pid": ...}` under the lease of the process that
  owns the location's writer and serves its Location service, gone when that process is;
* `PREFIX/topology-op` and `PREFIX/topology/OP`: the topology's authoritative history, every
  change an operator command recorded, in command order (`replication.commands`).

gazctl and the location processes look locations up here; an unknown name is refused in one line
that lists the known ones."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import aetcd

__all__ = [
    "DEFAULT_PREFIX",
    "LocationEntry",
    "UnknownLocation",
    "check_name",
    "endpoint_key",
    "location_key",
    "lookup",
    "read_locations",
]

DEFAULT_PREFIX = "/gazette/replication"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class UnknownLocation(LookupError):
    """A location name that is not registered; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


def check_name(name: str) -> str:
    """`name`, if it is a valid location name (ValueError naming it, if not)."""
    if not _NAME.match(name):
        raise ValueError(
            f"location name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return name


def location_key(prefix: str, name: str) -> bytes:
    return f"{prefix.rstrip('/')}/locations/{name}".encode()


def endpoint_key(prefix: str, name: str) -> bytes:
    return f"{prefix.rstrip('/')}/endpoints/{name}".encode()


@dataclass(frozen=True)
class LocationEntry:
    name: str
    journal: str
    broker: str
    endpoint: str = ""  # Empty: no process serves the location now.
    pid: int = 0
    store: str = ""  # Its journal's fragment store, as declared by `add` ("": none declared).
    replication: int = 0  # Its journal's replication, as declared by `add` (0: not declared).


async def read_locations(etcd: aetcd.Client, prefix: str) -> dict[str, LocationEntry]:
    """Every registered location, with the endpoint of its process if one is up."""
    base = prefix.rstrip("/")
    declared: dict[str, dict[str, str]] = {}
    live: dict[str, dict[str, object]] = {}
    for kv in await etcd.get_prefix(f"{base}/".encode()):
        key = kv.key.decode()
        kind, _, name = key[len(base) + 1 :].partition("/")
        try:
            body = json.loads(kv.value)
        except ValueError:
            continue  # Not ours: ignored, as a watcher ignores a foreign key.
        if kind == "locations" and isinstance(body, dict):
            declared[name] = body
        elif kind == "endpoints" and isinstance(body, dict):
            live[name] = body
    out = {}
    for name, body in sorted(declared.items()):
        up = live.get(name, {})
        out[name] = LocationEntry(
            name,
            str(body.get("journal", "")),
            str(body.get("broker", "")),
            str(up.get("endpoint", "")),
            int(str(up.get("pid", 0))),
            str(body.get("store", "")),
            int(str(body.get("replication", 0))),
        )
    return out


async def lookup(etcd: aetcd.Client, prefix: str, *names: str) -> list[LocationEntry]:
    """The entries of `names`, in order (UnknownLocation naming the first unknown one)."""
    known = await read_locations(etcd, prefix)
    for name in names:
        if name not in known:
            listed = ", ".join(known) or "none"
            raise UnknownLocation(
                f"unknown location {name!r}: no location of that name is registered under "
                f"{prefix} (known: {listed})"
            )
    return [known[n] for n in names]
