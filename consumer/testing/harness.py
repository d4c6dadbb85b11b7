"""In-process consumers for tests: `ConsumerGroup` runs consumers of an application inside
the caller's event loop (real etcd, real brokers, real gRPC on loopback ports), each started
with `start` and all stopped together on exit, as upstream's consumertest does."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import TracebackType
from typing import Any

import aetcd

from broker.testing import EtcdServer
from consumer.runtime import Consumer, ConsumerApplication, ConsumerConfig


class ConsumerGroup:
    """Consumers of applications in this process, under the etcd `root` (apart from the
    brokers' prefix), dialling the broker at `broker_address`.

    `await group.start(app)` starts one (ids `consumer-0`, `consumer-1`, ... unless given);
    `await group.stop(consumer)` stops one gracefully (its shards handed over); leaving the
    group stops the others together and removes the group's keys from etcd."""

    def __init__(self, etcd: EtcdServer, broker_address: str, root: str, **options: Any) -> None:
        self.etcd, self.broker_address, self.root = etcd, broker_address, root
        # ConsumerConfig fields every consumer of the group gets (`start` may override them):
        # a short lease and drain, so that tests of take-overs take seconds.
        self.options: dict[str, Any] = {"etcd_lease": 2.0, "drain_timeout": 10.0, **options}
        self.consumers: list[Consumer] = []
        self._started = 0

    def config(self, consumer_id: str | None = None, **options: Any) -> ConsumerConfig:
        """The configuration `start` gives a consumer."""
        if consumer_id is None:
            consumer_id = f"consumer-{self._started}"
        config = ConsumerConfig(
            id=consumer_id,
            broker_address=self.broker_address,
            etcd_address=self.etcd.endpoint,
            etcd_prefix=self.root,
        )
        return replace(config, **{**self.options, **options})

    async def start(
        self, app: ConsumerApplication, consumer_id: str | None = None, **options: Any
    ) -> Consumer:
        """A consumer of `app`, started (announced, serving the Shard service) and owned by
        the group; `options` are ConsumerConfig fields."""
        consumer = Consumer(self.config(consumer_id, **options), app)
        self._started += 1
        await consumer.start()
        self.consumers.append(consumer)
        return consumer

    async def stop(self, consumer: Consumer) -> None:
        """Stop one consumer gracefully: its shards move to the others before it exits."""
        self.consumers.remove(consumer)
        await consumer.stop()

    def primary_of(self, shard_id: str) -> Consumer:
        """The running consumer of the group that hosts the shard's primary replica now."""
        for consumer in self.consumers:
            replica = consumer.replicas.get(shard_id)
            if replica is not None and replica.slot == 0:
                return consumer
        raise LookupError(f"no consumer of the group hosts the primary of {shard_id}")

    @property
    def address(self) -> str:
        """The Shard service address of a running consumer (any answers for every shard)."""
        if not self.consumers:
            raise RuntimeError("no consumer of the group is running")
        return self.consumers[0].endpoint

    async def stop_all(self) -> None:
        """Stop every running consumer, together: each sees the others leaving, so none waits
        to hand its shards over to them."""
        running, self.consumers = self.consumers, []
        await asyncio.gather(*(c.stop() for c in running))

    async def __aenter__(self) -> ConsumerGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.stop_all()
        finally:
            async with aetcd.Client(host=self.etcd.host, port=self.etcd.client_port) as client:
                await client.delete_prefix(self.root.encode())
