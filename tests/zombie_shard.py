"""A shard run outside any consumer process (`python -m tests.zombie_shard`), as a zombie runs
it: a stream-sum summer of one shard against a JSON-file store, with no lease and no etcd, so it
goes on believing it owns the shard after a real consumer process took it. It prints `restored`
once it fenced the store; a commit refused by a newer instance's fence prints `fenced out: ...`
and exits 3; any other failure exits 1."""

from __future__ import annotations

import argparse
import asyncio
import sys

from broker.client.append_service import AppendService
from broker.client.routes import Router
from consumer.examples.stream_sum import Summer
from consumer.protocol import cpb
from consumer.store import FencedOut, JSONFileStore
from consumer.transaction import Shard, Source, run_shard
from message.framing import JSONLines
from message.publisher import Publisher
from message.types import DictMessages


class _Announcing(JSONFileStore):
    async def restore_checkpoint(self) -> cpb.Checkpoint:
        checkpoint = await super().restore_checkpoint()
        print("restored", flush=True)
        return checkpoint


async def main(broker: str, store_root: str, shard_id: str, source: str) -> int:
    spec = cpb.ShardSpec(id=shard_id, sources=[cpb.ShardSpec.Source(journal=source)])
    spec.max_txn_duration.FromMilliseconds(200)
    router = Router(broker)
    try:
        async with AppendService(router) as service:
            shard = Shard(spec, service, Publisher(service, DictMessages(), JSONLines()))
            store = _Announcing(store_root, shard_id)
            sources = [Source(source, DictMessages(), JSONLines())]
            await run_shard(shard, Summer(store_root), store, sources, lambda: router.stub_for(""))
    except BaseException as exc:
        errors = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        fenced = [e for e in errors if isinstance(e, FencedOut)]
        if fenced:
            print(f"fenced out: {fenced[0]}", flush=True)
            return 3
        print(f"failed: {type(errors[0]).__name__}: {errors[0]}", flush=True)
        return 1
    finally:
        await router.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--broker", "--store-root", "--shard", "--source"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.broker, args.store_root, args.shard, args.source)))
