"""Where the fault harness's processes live, and how the links between them are cut.

`Loopback` puts etcd, the store emulator and every broker on 127.0.0.1: no partitions.

`Namespaces` (root, `ip netns`) gives each broker a network namespace of its own, joined to a
bridge in the harness's namespace by a veth pair. Every address is one the harness creates on a
private 10.x.y.0/24 subnet: the bridge holds the clients' address (.1, the primary one, so the
workload's connections come from it), etcd's (.2) and the store's (.3); broker i is .(10+i)
inside its namespace. A link is cut by a blackhole route in the namespace of each broker on it
(to the other end's address), so packets between the two ends are dropped while every other link
keeps working; nothing is routed off the machine. Everything is removed in `close`.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess

log = logging.getLogger(__name__)

ETCD = "etcd"
STORE = "store"


class PartitionsUnsupported(RuntimeError):
    pass


class Network:
    """Addresses of the cluster's parts; endpoints are `ETCD`, `STORE` or a broker index."""

    name = "network"
    etcd_host = "127.0.0.1"
    store_host = "127.0.0.1"
    partitions = False

    def broker_host(self, index: int) -> str:
        return "127.0.0.1"

    def command(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run where broker `index` lives."""
        return argv

    def cut(self, a: int | str, b: int | str) -> None:
        raise PartitionsUnsupported(f"{self.name}: no partitions (network namespaces need root)")

    def mend(self, a: int | str, b: int | str) -> None:
        raise PartitionsUnsupported(self.name)

    def close(self) -> None:
        pass


class Loopback(Network):
    name = "loopback"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def namespaces_unavailable() -> str:
    """Why `Namespaces` cannot be used here ("" if it can)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    return ""


class Namespaces(Network):
    name = "namespaces"
    partitions = True

    def __init__(self, brokers: int, rng: random.Random | None = None) -> None:
        reason = namespaces_unavailable()
        if reason:
            raise PartitionsUnsupported(f"network namespaces unavailable: {reason}")
        rng = rng or random.Random()
        self.tag = f"gzf{os.getpid() % 0xFFFF:04x}{rng.randrange(0x100):02x}"
        self.bridge = f"{self.tag}br"
        self.subnet = self._free_subnet(rng)
        self.etcd_host = f"{self.subnet}.2"
        self.store_host = f"{self.subnet}.3"
        self.namespaces: list[str] = []
        self._bridge_made = False
        self._cuts: set[tuple[str, str]] = set()  # (namespace, blackholed address)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            for host in (1, 2, 3):
                _ip("addr", "add", f"{self.subnet}.{host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index in range(brokers):
                self._add_broker(index)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet(rng: random.Random) -> str:
        used = _ip("-4", "-o", "addr").stdout + _ip("-4", "route").stdout
        for _ in range(100):
            subnet = f"10.{rng.randrange(100, 250)}.{rng.randrange(256)}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet for the fault harness")

    def _namespace(self, index: int) -> str:
        return f"{self.tag}b{index}"

    def _add_broker(self, index: int) -> None:
        ns = self._namespace(index)
        veth = f"{self.tag}v{index}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self.broker_host(index)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def broker_host(self, index: int) -> str:
        return f"{self.subnet}.{10 + index}"

    def _address(self, end: int | str) -> str:
        if end == ETCD:
            return self.etcd_host
        if end == STORE:
            return self.store_host
        assert isinstance(end, int)
        return self.broker_host(end)

    def command(self, index: int, argv: list[str]) -> list[str]:
        # `ip netns exec` execs the command itself: the child's pid is the broker's.
        return ["ip", "netns", "exec", self._namespace(index), *argv]

    def _blackholes(self, a: int | str, b: int | str) -> list[tuple[str, str]]:
        out = []
        if isinstance(a, int):
            out.append((self._namespace(a), self._address(b)))
        if isinstance(b, int):
            out.append((self._namespace(b), self._address(a)))
        if not out:
            raise ValueError(f"a cut needs a broker at one end: {a} / {b}")
        return out

    def cut(self, a: int | str, b: int | str) -> None:
        """Drop every packet between `a` and `b` (at least one of them a broker)."""
        for ns, address in self._blackholes(a, b):
            if (ns, address) not in self._cuts:
                _ip("-n", ns, "route", "add", "blackhole", f"{address}/32")
                self._cuts.add((ns, address))

    def mend(self, a: int | str, b: int | str) -> None:
        for ns, address in self._blackholes(a, b):
            if (ns, address) in self._cuts:
                _ip("-n", ns, "route", "del", "blackhole", f"{address}/32", check=False)
                self._cuts.discard((ns, address))

    def mend_all(self) -> None:
        for ns, address in list(self._cuts):
            _ip("-n", ns, "route", "del", "blackhole", f"{address}/32", check=False)
        self._cuts.clear()

    def close(self) -> None:
        """Remove every namespace (with its veth pair) and the bridge."""
        for ns in self.namespaces:
            result = _ip("netns", "del", ns, check=False)
            if result.returncode:
                log.warning("ip netns del %s: %s", ns, result.stderr.strip())
        self.namespaces.clear()
        self._cuts.clear()
        if self._bridge_made:
            result = _ip("link", "del", self.bridge, check=False)
            if result.returncode:
                log.warning("ip link del %s: %s", self.bridge, result.stderr.strip())
            self._bridge_made = False
