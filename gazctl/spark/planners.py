"""Planning processes: the stream source's scans in processes of their own.

A scan (`Planner.scan`) is Python bound to one core: it decodes each message's UUID and runs the
Tally. When two or more journals hold enough to read (`PARALLEL_PLANNING_BYTES`), the driver runs
their scans in planning processes, one per core it has (option `planningProcesses`), and waits;
otherwise in its own process. The processes start at the first batch that needs them and stay
until the query stops (`Scanners.close`).

A planning process is `python -m gazctl.spark.planners DRIVER_PID`: it imports no PySpark (a
tenth of a second to start, where a `multiprocessing` child of Spark's driver-side Python would
import Spark's own runner), takes each job as a length-prefixed pickle on its stdin and answers
on its stdout, and ends within half a second of its driver however the driver ends (a thread
watches its parent). A process whose call fails or is abandoned (the driver's call cancelled) is
stopped, never reused: it may still be answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import IO, Any

from broker.client.journals import JournalsClient
from gazctl.spark.journals import JobError
from gazctl.spark.stream_plan import Planner, Scan, ScanJob, StreamOptions, gathered

log = logging.getLogger(__name__)

# Content to plan, across two or more journals, that pays for planning in processes of their
# own (started once per query, in a few tenths of a second, and kept).
PARALLEL_PLANNING_BYTES = 16 << 20
STOP_WAIT = 5.0  # Seconds a planning process has to exit when asked, before it is killed.


class Scanners:
    """Where a driver's scans run: in its own process, or in planning processes."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.processes = planner.options.planning_processes
        self._idle: list[PlanningProcess] = []
        self._all: list[PlanningProcess] = []

    def may_run_apart(self, jobs: list[ScanJob]) -> bool:
        """Whether `jobs` could run in planning processes (if they have enough to read)."""
        return self.processes > 1 and len(jobs) > 1

    def parallel(self, jobs: list[ScanJob], pending: int) -> bool:
        """Whether `jobs`, which would read `pending` bytes, run in planning processes."""
        return self.may_run_apart(jobs) and pending >= PARALLEL_PLANNING_BYTES

    async def run(self, client: JournalsClient, jobs: list[ScanJob], pending: int) -> list[Scan]:
        """The jobs' scans, in order."""
        if not self.parallel(jobs, pending):
            return await gathered([self.here(client, job) for job in jobs])
        results: list[Scan | None] = [None] * len(jobs)
        queue = list(enumerate(jobs))
        queue.reverse()  # Popped from the end: in order.
        options = self.planner.options

        async def work() -> None:
            process = self._take()
            try:
                while queue:
                    index, job = queue.pop()
                    results[index] = await asyncio.to_thread(process.call, options, job)
            except BaseException:
                process.stop()  # Failed or abandoned mid-call: it may still be answering.
                self._all.remove(process)
                raise
            self._idle.append(process)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self.processes, len(jobs))):
                    group.create_task(work())
        except BaseExceptionGroup as failed:  # The first failure, as one line (a JobError).
            raise _first(failed) from None
        return [r for r in results if r is not None]

    async def here(self, client: JournalsClient, job: ScanJob) -> Scan:
        """A scan in this process."""
        return await self.planner.scan(
            client, job.journal, job.kind, job.start, job.bound, first=job.first,
            exact=job.exact, limited=job.limited,
        )  # fmt: skip

    def pids(self) -> list[int]:
        return [p.process.pid for p in self._all]

    def close(self) -> None:
        """Stop the planning processes, each waited for by its pid."""
        processes, self._all, self._idle = self._all, [], []
        for process in processes:
            process.stop()

    def _take(self) -> PlanningProcess:
        if self._idle:
            return self._idle.pop()
        process = PlanningProcess.start()
        self._all.append(process)
        return process


class PlanningProcess:
    """One planning process, and the pipes to it."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self._lock = threading.Lock()  # One call at a time.

    @classmethod
    def start(cls) -> PlanningProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # As the driver imports.
        process = subprocess.Popen(
            [sys.executable, "-m", "gazctl.spark.planners", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        return cls(process)

    def call(self, options: StreamOptions, job: ScanJob) -> Scan:
        """Run one scan there (blocking: the caller runs it in a thread)."""
        with self._lock:
            assert self.process.stdin is not None and self.process.stdout is not None
            try:
                _write(self.process.stdin, pickle.dumps((options, job)))
                answer = _read(self.process.stdout)
            except (BrokenPipeError, OSError):
                answer = None
            if answer is None:
                raise JobError(
                    f"a planning process (pid {self.process.pid}) exited while planning journal "
                    f"{job.journal} (exit status {self.process.poll()}): see its error above; "
                    "option planningProcesses=1 plans in the driver's own process"
                )
            try:
                kind, value = pickle.loads(answer)
            except Exception as exc:
                raise JobError(
                    f"a planning process (pid {self.process.pid}) answered what cannot be read "
                    f"while planning journal {job.journal}: {type(exc).__name__}: {exc}"
                ) from None
            if kind == "error":
                raise value
            return value  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Ask it to exit (its stdin closed), then kill it if it has not; wait for it."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """A group's first failure, a JobError before any other."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return next((e for e in leaves if isinstance(e, JobError)), leaves[0])


def _write(stream: IO[bytes], data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "big"))
    stream.write(data)
    stream.flush()


def _read(stream: IO[bytes]) -> bytes | None:
    """A frame, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    size = int.from_bytes(head, "big")
    data = stream.read(size)
    return data if len(data) == size else None


def _scan(options: StreamOptions, job: ScanJob) -> Scan:
    from gazctl.spark.stream_plan import collection_paused

    async def scan() -> Scan:
        async with JournalsClient(options.broker) as client:
            return await Scanners(Planner(options)).here(client, job)

    with collection_paused():
        return asyncio.run(scan())


def _dies_with(driver: int) -> None:
    """This process ends within half a second of its driver, however the driver ends: a thread
    of its own watches its parent (the kernel's parent-death signal would follow the driver's
    thread that started it, not the driver)."""

    def watch() -> None:
        while os.getppid() == driver:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """A planning process: scans asked on stdin, answered on stdout, until stdin ends."""
    _dies_with(int(argv[1]))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    jobs, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # Nothing else may write into the answers.
    while (asked := _read(jobs)) is not None:
        options, job = pickle.loads(asked)
        try:
            answer: tuple[str, Any] = ("ok", _scan(options, job))
        except Exception as exc:  # Raised again in the driver (a JobError: its one line).
            try:
                pickle.loads(pickle.dumps(exc))  # (Some pickle, and then do not unpickle.)
            except Exception:
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            answer = ("error", exc)
        _write(answers, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
