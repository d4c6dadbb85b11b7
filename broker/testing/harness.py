"""In-process brokers for tests: `async with BrokerHarness(...)` runs a real broker (real etcd,
real gRPC on a loopback port) inside the caller's event loop, and stops it on exit."""

from __future__ import annotations

from types import TracebackType

from broker.client import JournalsClient
from broker.server import Broker, BrokerConfig


class BrokerHarness:
    """One broker in this process. Applications can embed it in their own tests."""

    def __init__(
        self,
        etcd_address: str,
        etcd_prefix: str,
        *,
        zone: str = "local",
        id: str = "broker-0",
        lease: float = 5.0,
        watch_delay: float = 0.0,
        file_root: str = "",
        drain_timeout: float = 2.0,
        run_allocator: bool = True,
        persist_interval: float = 60.0,
        auth_keys: str = "",
    ) -> None:
        """`auth_keys`: as `--broker.auth-keys` (base64 keys; the broker then verifies tokens)."""
        self.config = BrokerConfig(
            zone=zone,
            id=id,
            host="127.0.0.1",
            port=0,
            file_root=file_root,
            etcd_address=etcd_address,
            etcd_prefix=etcd_prefix,
            etcd_lease=lease,
            watch_delay=watch_delay,
            drain_timeout=drain_timeout,
            run_allocator=run_allocator,
            persist_interval=persist_interval,
            auth_keys=auth_keys,
        )
        self.broker = Broker(self.config)

    @property
    def endpoint(self) -> str:
        return self.broker.endpoint

    def client(self) -> JournalsClient:
        return JournalsClient(self.endpoint)

    async def __aenter__(self) -> BrokerHarness:
        await self.broker.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.broker.stop(grace=1.0)
