"""The consumer campaign's harness: stream-sum's summers as real processes over the broker
campaign's cluster (`tests/faults/harness.py`: etcd, three brokers, network namespaces), with a
real PostgreSQL for the `postgres` store, a chunk workload and the collection of what the run did.

As root, each consumer runs in a network namespace of its own on the cluster's bridge (the
cluster's nodes from `brokers` on), so a consumer can be cut from etcd or from the brokers as a
broker is; PostgreSQL listens on the bridge's store address. Without root, everything is on
127.0.0.1 and the partition scenarios are skipped. The JSON stores of every summer share one
directory (so a shard's state follows it between processes, fenced by the store's lock and
fence); a consumer's TMPDIR, where its replicas' local directories go, may be a symlink.

A supervisor restarts, as a service manager would, any consumer that exits when no fault holds
it down. Every process is stopped by its pid in `close`, on failure as on success.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from broker.client import JournalsClient
from broker.client.append_service import AppendService
from broker.protocol import consumer_pb2_grpc as cpb_grpc
from broker.protocol import protocol_pb2 as pb
from consumer.client import ShardsClient
from consumer.examples import stream_sum
from consumer.protocol import cpb
from message.framing import JSONLines
from message.mapping import Partition, modulo_mapping
from message.publisher import Publisher, Reader, read_committed
from message.sequencer import Sequencer
from message.types import DictMessages
from tests.faults.consumer_checker import OK, ChunkOp, ConsumerHistory, ShardStatus, SumRead
from tests.faults.harness import (
    Cluster,
    ClusterConfig,
    HarnessError,
    _free_port,
    _stop,
    describe,
    signal_slot,
)
from tests.faults.history import History
from tests.helpers.server_fork import ForkedPopen

ETCD_PREFIX = "/gazette-faults-consumers"
PREFIX = "faults/stream-sum"
ROOT = Path(__file__).parents[2]
# Log lines that show a fault at work: a zombie's commit refused by its store's fence, stray
# bytes in a recovery log read past, a standby taking over the log it tails.
EVIDENCE = {
    "fenced": "FencedOut",
    "stray bytes read past": "are not a frame",
    "standby take-overs": "takes over the log it tails",
    # A replica's hints read that met etcd down and was tried again (issue 38): the etcd kills
    # struck a replica as it started.
    "hints reads retried": "reading its hints: etcd unavailable",
}


@dataclass
class ConsumerConfig:
    workdir: Path
    store: str = "json"  # json | postgres | sqlite
    consumers: int = 3
    brokers: int = 3
    partitions: int = 3
    lease: float = 2.0  # The consumers' etcd lease.
    # The brokers': longer, so that a loaded machine does not lapse every broker's lease at once
    # (a fault of the brokers, which loses what only their spools held, not the consumers').
    broker_lease: float = 5.0
    namespaces: bool = False
    symlink_tmp: bool = False  # Every consumer's TMPDIR a symlink to its real directory.


@dataclass
class ConsumerSlot:
    index: int
    node: int  # Its namespace among the cluster's nodes.
    host: str
    port: int
    tmpdir: Path
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    held: bool = False  # Down on purpose: the supervisor leaves it be.
    paused: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return f"summer-{self.index}"

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ConsumerHarness:
    def __init__(self, config: ConsumerConfig, history: ConsumerHistory, rng: random.Random):
        self.config = config
        self.history = history
        self.rng = rng
        # The broker cluster records its own notes and faults; they join ours at the end.
        self.cluster_history = History(scenario=history.scenario, seed=history.seed)
        self.cluster_history._t0 = history._t0
        self.cluster = Cluster(
            ClusterConfig(
                config.workdir, brokers=config.brokers, lease=config.broker_lease,
                namespaces=config.namespaces, extra_nodes=config.consumers,
            ),
            self.cluster_history,
            rng=random.Random(rng.random()),
        )  # fmt: skip
        self.consumers: list[ConsumerSlot] = []
        self.pg_proc: subprocess.Popen[bytes] | None = None
        self.pg_port = 0
        self.pg_root: Path | None = None
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def workdir(self) -> Path:
        return self.config.workdir

    # ---- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> ConsumerHarness:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        await self.cluster.start()
        (self.workdir / "stores").mkdir(exist_ok=True)
        if self.config.store == "postgres":
            self.pg_port = _free_port(self.cluster.network.store_host)
            self.start_postgres()
        network = self.cluster.network
        for index in range(self.config.consumers):
            node = self.config.brokers + index
            host = network.broker_host(node)
            port = 8080 if self.config.namespaces else _free_port(host)
            tmpdir = self.workdir / f"tmp-c{index}"
            if self.config.symlink_tmp:
                real = self.workdir / f"real-tmp-c{index}"
                real.mkdir()
                tmpdir.symlink_to(real, target_is_directory=True)
            else:
                tmpdir.mkdir()
            self.consumers.append(ConsumerSlot(index, node, host, port, tmpdir))
        for slot in self.consumers:
            self._spawn(slot)
        await asyncio.gather(*(self._ready(slot) for slot in self.consumers))
        await self._create_journals()
        await stream_sum._setup(
            self.cluster.brokers[0].address, self.consumers[0].address,
            self.config.partitions, 3, self.config.store, PREFIX,
            1 if self.config.store == "sqlite" else 0,
        )  # fmt: skip
        self._supervisor = asyncio.create_task(self._supervise(), name="consumer supervisor")
        if not await self.wait_primaries(timeout=60):
            raise HarnessError(f"shards without a primary 60 s after setup: {await self.shards()}")

    def journals(self) -> list[str]:
        names = [stream_sum.chunk_journal(i, PREFIX) for i in range(self.config.partitions)]
        names.append(stream_sum.sums_journal(PREFIX))
        if self.config.store == "sqlite":
            names += [self.recovery_log(shard) for shard in self.shard_ids()]
        return names

    async def _create_journals(self) -> None:
        """The example's journals, created ahead of its setup (which keeps them) with the
        campaign's fragment store: a journal without one holds its content only in the
        replicas' spools, and brokers restarted one after another lose it with the last."""
        specs = []
        for name in self.journals():
            spec = self.cluster.spec(name)
            if "/recovery/" in name:
                spec.labels.labels[0].value = stream_sum.RECOVERYLOG
            specs.append(spec)
        async with JournalsClient(self.cluster.brokers[0].address) as client:
            await client.apply([pb.ApplyRequest.Change(upsert=spec) for spec in specs])

    async def persisted(self, timeout: float) -> bool:
        """Whether every journal's fragments but its open one are persisted, polled until
        `timeout`: until then a broker restarted since holds only what was appended after."""
        deadline = time.monotonic() + timeout
        waiting = self.journals()
        while waiting and time.monotonic() < deadline:
            still = []
            for journal in waiting:
                try:
                    stub = self.cluster.dialer.journal_stub(self.cluster.any_address())
                    listed = await stub.ListFragments(pb.FragmentsRequest(journal=journal), timeout=5)  # fmt: skip
                    fragments = sorted((f.spec for f in listed.fragments), key=lambda f: f.end)
                    if not all(f.backing_store for f in fragments[:-1]):
                        still.append(journal)
                except Exception:
                    still.append(journal)
            waiting = still
            if waiting:
                await asyncio.sleep(0.5)
        return not waiting

    async def close(self) -> None:
        errors: list[str] = []
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(BaseException):
                await self._supervisor
            self._supervisor = None
        for slot in self.consumers:
            try:
                _stop(slot.proc, signal.SIGKILL)
            except Exception as exc:
                errors.append(f"{slot.id}: {exc}")
        try:
            _stop(self.pg_proc, signal.SIGINT)  # PostgreSQL's fast shutdown.
        except Exception as exc:
            errors.append(f"postgres: {exc}")
        self.pg_proc = None
        if self.pg_root is not None:
            shutil.rmtree(self.pg_root, ignore_errors=True)
        try:
            await self.cluster.close()
        except Exception as exc:
            errors.append(str(exc))
        self.history.notes = sorted([*self.history.notes, *self.cluster_history.notes])
        if errors:
            raise HarnessError("; ".join(errors))

    # ---- PostgreSQL ---------------------------------------------------------------------------

    @property
    def postgres_dsn(self) -> str:
        from consumer import local_postgres

        return local_postgres.postgres_dsn(self.pg_port, self.cluster.network.store_host)

    def start_postgres(self) -> None:
        from consumer import local_postgres

        if self.pg_root is None:
            # Its own directory under the system's temporary one: the server's user (as root,
            # `postgres`) must reach it, and a scenario's directory is private to root.
            self.pg_root = Path(tempfile.mkdtemp(prefix="gazette-faults-pg-"))
        root = self.pg_root
        fresh = not (root / "data").exists()
        local_postgres.init_cluster(root)
        if fresh:  # Consumers connect from their namespaces' addresses on the bridge.
            with (root / "data" / "pg_hba.conf").open("a") as hba:
                hba.write("host all all 10.0.0.0/8 trust\n")
        host = self.cluster.network.store_host
        log = self.workdir / "logs" / "postgres.log"
        with log.open("ab") as out:
            self.pg_proc = subprocess.Popen(
                local_postgres.postgres_command(root, self.pg_port, host),
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        local_postgres.wait_postgres_ready(self.pg_proc, root, self.pg_port, log, host=host)
        self.history.note(f"postgres started (pid {self.pg_proc.pid})")

    def stop_postgres(self, sig: int = signal.SIGKILL) -> None:
        """Stop PostgreSQL (SIGKILL: a crash; it recovers from its WAL when started again)."""
        proc, self.pg_proc = self.pg_proc, None
        if proc is None:
            return
        if sig == signal.SIGKILL:
            # The postmaster's children go with it only once it is gone; kill them by pid too.
            children = _children(proc.pid)
            _stop(proc, sig)
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Its shared memory is released once every child exited.
            deadline = time.monotonic() + 10
            while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            _stop(proc, sig)

    # ---- consumers ----------------------------------------------------------------------------

    def _spawn(self, slot: ConsumerSlot) -> None:
        slot.incarnation += 1
        argv = [
            sys.executable, "-m", "consumer.examples.stream_sum", "serve",
            "--consumer.id", slot.id,
            "--consumer.host", slot.host, "--consumer.port", str(slot.port),
            "--consumer.drain-timeout", "2s",
            "--broker.address", self.cluster.brokers[slot.index % self.config.brokers].address,
            "--etcd.address", self.cluster.etcd_endpoint, "--etcd.prefix", ETCD_PREFIX,
            "--etcd.lease", f"{self.config.lease:g}s",
            "--summer.store-root", str(self.workdir / "stores"),
        ]  # fmt: skip
        if self.config.store == "postgres":
            argv += ["--summer.postgres", self.postgres_dsn]
        env = dict(os.environ, TMPDIR=str(slot.tmpdir), PYTHONUNBUFFERED="1")
        log = self.workdir / "logs" / f"{slot.id}.{slot.incarnation}.log"
        with log.open("wb") as out:
            slot.proc = ForkedPopen(
                self.cluster.network.command(slot.node, argv),
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            )  # fmt: skip
        slot.paused = False
        self.history.note(f"{slot.id} started (incarnation {slot.incarnation}, pid {slot.proc.pid})")  # fmt: skip

    async def _ready(self, slot: ConsumerSlot, timeout: float = 40) -> None:
        """Wait until the consumer answers List."""
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(f"{slot.host}:{slot.port}") as channel:
            stub = cpb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]
            while True:
                assert slot.proc is not None
                if slot.proc.poll() is not None:
                    log = self.workdir / "logs" / f"{slot.id}.{slot.incarnation}.log"
                    raise HarnessError(
                        f"{slot.id} exited {slot.proc.returncode} while starting: "
                        f"{log.read_text(errors='replace')[-1500:]}"
                    )
                try:
                    await stub.List(cpb.ListRequest(), timeout=1)
                    return
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise HarnessError(f"{slot.id} not ready in {timeout}s") from None
                    await asyncio.sleep(0.1)

    async def _start(self, slot: ConsumerSlot) -> None:
        async with slot.lock:
            if slot.running():
                return
            if slot.proc is not None and not slot.held:
                self.history.note(f"{slot.id} had exited ({slot.proc.returncode}): restarting")
            slot.held = False
            self._spawn(slot)
            await self._ready(slot)

    async def start_consumer(self, slot: ConsumerSlot) -> None:
        await self._start(slot)

    async def kill_etcd_at_next_assignment(self, timeout: float) -> bool:
        """SIGKILL etcd (by its pid) the moment the allocator writes a new assignment of a
        shard, within `timeout`, else at `timeout`: the replica it assigns reads its hints from
        etcd as it starts, so the kill meets that read, as an etcd crash at any moment may.
        Whether an assignment came (the harness watches etcd as the consumers do, and without
        their apply delay it is usually first)."""
        from aetcd import rpc

        from plumbing.etcd import parse_etcd_address

        host, port = parse_etcd_address(self.cluster.etcd_endpoint)
        prefix = f"{ETCD_PREFIX}/assign/".encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        came = False
        channel = grpc.aio.insecure_channel(f"{host}:{port}")
        try:
            call = rpc.WatchStub(channel).Watch()
            create = rpc.WatchCreateRequest(
                key=prefix, range_end=end, filters=[rpc.WatchCreateRequest.NODELETE]
            )
            async with asyncio.timeout(timeout):
                await call.write(rpc.WatchRequest(create_request=create))
                while not came:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        break
                    came = any(event.kv.version == 1 for event in response.events)
        except TimeoutError:
            pass
        except grpc.aio.AioRpcError as exc:
            self.history.note(f"watching assignments: {describe(exc)}")
        finally:
            self.cluster.stop_etcd()
            await channel.close(None)
        return came

    async def stopped(self, slot: ConsumerSlot, timeout: float) -> None:
        """Until the consumer's process exited (one stopping gracefully drains first); SIGKILL
        by its pid after `timeout`."""
        deadline = time.monotonic() + timeout
        while slot.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if slot.running():
            self.history.note(f"{slot.id} still running {timeout:g}s after its stop: SIGKILL")
            self.signal(slot, signal.SIGKILL)

    async def _supervise(self) -> None:
        restarts: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(0.25)
                for slot in self.consumers:
                    task = restarts.get(slot.index)
                    if task is not None and task.done():
                        if not task.cancelled() and task.exception() is not None:
                            self.history.note(f"supervisor could not restart {slot.id}: {task.exception()}")  # fmt: skip
                        del restarts[slot.index]
                    if slot.held or slot.running() or slot.lock.locked():
                        continue
                    if slot.index not in restarts:
                        restarts[slot.index] = asyncio.create_task(self._start(slot))
        finally:
            for task in restarts.values():
                task.cancel()
            await asyncio.gather(*restarts.values(), return_exceptions=True)

    def signal(self, slot: ConsumerSlot, sig: signal.Signals) -> None:
        signal_slot(slot, sig)

    async def ensure_running(self) -> list[str]:
        """Resume paused consumers and start any that are down (held ones too)."""
        for slot in self.consumers:
            if slot.paused:
                self.signal(slot, signal.SIGCONT)
        dead = [slot for slot in self.consumers if not slot.running()]
        for slot in dead:
            slot.held = False
        await asyncio.gather(*(self._start(slot) for slot in self.consumers))
        return [slot.id for slot in dead]

    def live(self) -> list[ConsumerSlot]:
        return [s for s in self.consumers if s.running() and not s.paused]

    async def shards(self) -> list[Any]:
        """Every shard as a live consumer lists it (route and replica statuses)."""
        for slot in self.live():
            try:
                async with ShardsClient(slot.address, timeout=3) as client:
                    return list((await client.list()).shards)
            except Exception:
                continue
        return []

    async def primary_of(self, shard: str) -> ConsumerSlot | None:
        for s in await self.shards():
            if s.spec.id == shard and s.route.primary >= 0:
                suffix = s.route.members[s.route.primary].suffix
                return next((c for c in self.consumers if c.id == suffix), None)
        return None

    async def wait_primaries(self, timeout: float) -> bool:
        """Wait until every shard's primary replica says PRIMARY."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listed = await self.shards()
            if len(listed) == self.config.partitions and all(
                s.route.primary >= 0
                and len(s.status) > s.route.primary
                and s.status[s.route.primary].code == cpb.ReplicaStatus.PRIMARY
                for s in listed
            ):
                return True
            await asyncio.sleep(0.3)
        return False

    def shard_ids(self) -> list[str]:
        return [stream_sum.shard_id(i, PREFIX) for i in range(self.config.partitions)]

    def recovery_log(self, shard: str) -> str:
        return f"{PREFIX}/recovery/{shard}"

    # ---- faults ---------------------------------------------------------------------------------

    def fault(self, kind: str, target: str, detail: str = "") -> Any:
        from tests.faults.consumer_checker import FaultRecord

        record = FaultRecord(kind, target, self.history.now(), detail=detail)
        self.history.faults.append(record)
        self.history.note(f"fault {kind} {target} {detail}".rstrip())
        return record

    def heal(self, record: Any) -> None:
        record.end = self.history.now()
        self.history.note(f"healed {record.kind} {record.target}")

    async def heal_all(self) -> None:
        await self.cluster.heal_all()
        if self.config.store == "postgres" and (self.pg_proc is None or self.pg_proc.poll() is not None):  # fmt: skip
            self.start_postgres()
        for record in self.history.faults:
            if record.end < 0:
                self.heal(record)
        started = await self.ensure_running()
        if started:
            self.history.note(f"restarted {started}")

    async def settle_shards(self, timeout: float) -> None:
        """After healing: wait for every shard's primary; a FAILED replica is recorded, and,
        when the scenario's own faults may explain it, unassigned as an operator would
        (`gazctl shards unassign --failed`), so the shard starts again."""
        deadline = time.monotonic() + timeout
        own = bool(set(self.history.own_faults) & {f.kind for f in self.history.faults})
        seen: set[tuple[str, str, str]] = set()
        while time.monotonic() < deadline:
            failed = []
            for s in await self.shards():
                for member, status in zip(s.route.members, s.status, strict=False):
                    if status.code == cpb.ReplicaStatus.FAILED:
                        key = (s.spec.id, member.suffix, "; ".join(status.errors))
                        if key not in seen:
                            seen.add(key)
                            record = ShardStatus(s.spec.id, member.suffix, "FAILED", list(status.errors), self.history.now())  # fmt: skip
                            self.history.failures.append(record)
                            self.history.note(f"{s.spec.id} FAILED on {member.suffix}: {key[2]}")
                        failed.append(s.spec.id)
            if failed and own:
                try:
                    async with ShardsClient(self.live()[0].address, timeout=5) as client:
                        await client.unassign(sorted(set(failed)), only_failed=True)
                    self.history.note(f"unassigned FAILED {sorted(set(failed))}")
                except Exception as exc:
                    self.history.note(f"unassign failed: {describe(exc)}")
            elif not failed and await self.wait_primaries(timeout=1):
                return
            await asyncio.sleep(0.5)
        self.history.note(f"shards not all primary {timeout:g}s after healing")

    async def record_statuses(self) -> None:
        at = self.history.now()
        for s in await self.shards():
            for member, status in zip(s.route.members, s.status, strict=False):
                code = cpb.ReplicaStatus.Code.Name(status.code)
                self.history.statuses.append(
                    ShardStatus(s.spec.id, member.suffix, code, list(status.errors), at)
                )

    def scan_logs(self) -> None:
        """The summers' logs: chunks out of sequence (a violation), and what shows that a
        scenario's faults did their work (counted, not judged)."""
        for log in sorted((self.workdir / "logs").glob("summer-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "OutOfSequence" in line or "out of sequence" in line:
                    self.history.log_problems.append(f"{log.name}: {line.strip()[:300]}")
                for name, words in EVIDENCE.items():
                    if words in line:
                        self.history.evidence[name] = self.history.evidence.get(name, 0) + 1

    # ---- the sums, read back --------------------------------------------------------------------

    async def read_sums(self, expected: set[str], timeout: float) -> None:
        """Read the sums journal from its start, read committed, until every expected stream
        has a sum (and a moment more, for any second one) or `timeout`; record them all."""
        sums = stream_sum.sums_journal(PREFIX)
        deadline = time.monotonic() + timeout
        complete_at: float | None = None
        while True:
            found: list[SumRead] = []
            try:
                stub = self.cluster.dialer.journal_stub(self.cluster.any_address())
                reader = Reader(DictMessages(), JSONLines())
                async with asyncio.timeout(20):
                    async for envelope in read_committed(stub, sums, reader, Sequencer(), 0):
                        if envelope.is_ack:
                            continue
                        m = envelope.message
                        found.append(
                            SumRead(
                                m["stream"], m["sum"], m["chunks"], m["shard"], m.get("fence"),
                                m.get("restored", 0.0), m.get("pid", 0), envelope.begin, len(found),
                            )
                        )  # fmt: skip
            except Exception as exc:
                self.history.note(f"reading {sums} failed: {describe(exc)}")
                await asyncio.sleep(1)
                if time.monotonic() > deadline:
                    break
                continue
            self.history.sums = found
            have = {s.stream for s in found}
            if expected <= have:
                if complete_at is None:
                    complete_at = time.monotonic()
                elif time.monotonic() - complete_at > 2:
                    return
            if time.monotonic() > deadline:
                missing = len(expected - have)
                self.history.note(f"{missing} sums missing {timeout:g}s after healing")
                return
            await asyncio.sleep(1)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ChunkWorkload:
    """Publishes chunks of streams, at most `concurrent` in progress at once (streams complete
    all through the run), each committed at once, recording each with its acknowledgement.
    `stop` lets the streams in progress finish and starts no new one."""

    def __init__(
        self,
        harness: ConsumerHarness,
        seed: int,
        *,
        chunks: int = 8,
        concurrent: int = 6,
        pace: float = 0.03,
    ) -> None:
        self.harness = harness
        self.history = harness.history
        self.rng = random.Random(f"{seed}/chunks")
        self.chunks, self.concurrent, self.pace = chunks, concurrent, pace
        self.stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._service: AppendService | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="chunk workload")

    async def stop(self, timeout: float) -> None:
        """Finish the streams in progress and wait (up to `timeout`) for every acknowledgement."""
        self.stopping.set()
        assert self._task is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self.history.note(f"the workload did not finish within {timeout:g}s")
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _run(self) -> None:
        cluster = self.harness.cluster
        rng = self.rng
        service = AppendService(
            lambda _journal: cluster.dialer.journal_stub(rng.choice(cluster.addresses())),
            max_retry_delay=0.5,
        )
        publisher: Publisher[dict[str, Any]] = Publisher(service, DictMessages(), JSONLines())
        parts = [stream_sum.chunk_journal(i, PREFIX) for i in range(self.harness.config.partitions)]
        partitions = [Partition(p, stream_sum.NDJSON) for p in parts]
        mapping = modulo_mapping(stream_sum._stream_key, lambda: partitions)
        run = f"{self.history.seed:x}-{rng.getrandbits(24):06x}"
        cursors: dict[str, int] = {}
        started = 0
        try:
            while True:
                while not self.stopping.is_set() and len(cursors) < self.concurrent:
                    cursors[f"{run}-{started:05d}"] = 0
                    started += 1
                if not cursors:
                    break
                stream = rng.choice(sorted(cursors))
                seq = cursors[stream] + 1
                last = seq == self.chunks
                op = ChunkOp(stream, seq, rng.randint(-1000, 1000), last)
                op.journal = mapping({"stream": stream}).journal
                op.invoked = self.history.now()
                self.history.chunks.append(op)
                span = await publisher.publish_committed(
                    mapping, {"stream": stream, "seq": seq, "value": op.value, "last": last}
                )
                span.batch.add_done_callback(functools.partial(self._settled, op, span))
                if last:
                    del cursors[stream]
                else:
                    cursors[stream] = seq
                await asyncio.sleep(rng.uniform(0, 2 * self.pace))
            await service.flush()
        finally:
            await service.close()

    def _settled(self, op: ChunkOp, span: Any, batch: asyncio.Future[int]) -> None:
        op.completed = self.history.now()
        if batch.cancelled():
            op.error = "cancelled"
        elif batch.exception() is not None:
            op.error = describe(batch.exception())  # type: ignore[arg-type]
        else:
            op.outcome, op.offset = OK, batch.result() + span.offset
