"""Server processes for the tests that start as children of the test, from a process that has
their modules imported already.

A broker, location or consumer process the tests start (`python -m broker.main serve ...`) spends
0.3 to 0.45 s of CPU importing before it does anything, and the suite starts some 500 of them.
`ForkedPopen` is a `subprocess.Popen` that starts such a command as a clone of a per-process
"zygote" (`python -m tests.helpers.server_fork SOCKET`) which imported those modules once. What
the test gets is still a process of its own and of the test's: the clone is made with
CLONE_PARENT, so its parent is the test's process, as a spawned one's would be; `wait`, `poll`,
signals and exit codes work as they do for any child. The clone has the command's stdin,
stdout and stderr (or the test's), its environment, its directory, and every other descriptor
closed (as `close_fds` does).

What a fresh interpreter reads as it starts, a clone has from its zygote, so:
- each start-up environment (the PYTHON* variables: buffering, paths, warnings, the hash seed;
  the locale's) has a zygote of its own, started with it (at most four a test process);
- the environment variables the zygote's imports read are recorded, and a command whose
  environment differs in one of them starts as a fresh interpreter;
- so does a command that asks `Popen` for more than its descriptors, environment and directory
  (`preexec_fn`, `pass_fds`, a new session, other users), or that is not `python -m`.
Clones of one zygote share its hash seed.

The zygote clones itself with the raw system call, which glibc's `fork` does not know of, so the
zygote does what `fork` does around it that a Python process needs: CPython's before- and after-
fork hooks (locks, `os.register_at_fork`, threading's state), and the thread id glibc keeps for
the calling thread (CLONE_CHILD_SETTID into it, as `fork` itself asks the kernel to). It holds no
thread but its main one; it refuses to clone otherwise.

`GAZETTE_TESTS_FORK_SERVERS=0` turns it off: every command starts as a fresh interpreter."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import platform
import runpy
import select
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# Imported once by the zygote: the servers' own modules and the libraries under them. None of
# them reads the environment as it imports, other than what `_recording_environment` records.
PRELOAD = (
    "asyncio",
    "grpc",
    "grpc.aio",
    "aetcd",
    "click",
    "yaml",
    "google.protobuf.json_format",
    "broker.main",
    "consumer.main",
    "consumer.runtime",
    "replication.process",
    "replication.host",
)
# Imported before the recording starts: what they read of the environment as they import is
# read again in each clone (`_become`). wsgiref's handlers copy the whole environment (for WSGI
# apps; prometheus_client imports them).
UNRECORDED = ("wsgiref.handlers",)

CLONE_PARENT = 0x00008000
CLONE_CHILD_SETTID = 0x01000000
CLONE_CHILD_CLEARTID = 0x00200000
SIGCHLD = 17
SYS_CLONE = 56  # x86_64: clone(flags, stack, parent_tid, child_tid, tls)


class _Clone:
    """The raw clone the zygote makes of itself, wrapped as CPython wraps `fork`."""

    def __init__(self) -> None:
        self.api = ctypes.PyDLL(None, use_errno=True)  # Calls that hold the GIL, as the hooks must.
        self.api.syscall.restype = ctypes.c_long
        self.api.syscall.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
        self.api.pthread_self.restype = ctypes.c_void_p
        self.tid_address = self._tid_address()

    def _tid_address(self) -> int:
        """Where glibc keeps this thread's id (in its thread descriptor): the one int equal to
        it among the descriptor's first 2 KiB."""
        base = self.api.pthread_self()
        tid = threading.get_native_id()
        ints = (ctypes.c_int32 * 512).from_address(base)
        found = [i for i, value in enumerate(ints) if value == tid]
        if len(found) != 1:
            raise RuntimeError(f"no single thread id in glibc's thread descriptor: {found}")
        return int(base) + 4 * found[0]

    def __call__(self) -> int:
        """As os.fork: 0 in the child, its pid in this process; the child's parent is this
        process's parent."""
        if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
            raise RuntimeError("the zygote has more than one thread: it cannot clone")
        flags = CLONE_PARENT | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
        self.api.PyOS_BeforeFork()
        pid = self.api.syscall(SYS_CLONE, flags, None, None, self.tid_address, None)
        if pid == 0:
            self.api.PyOS_AfterFork_Child()
        else:
            error = ctypes.get_errno() if pid < 0 else 0
            self.api.PyOS_AfterFork_Parent()
            if pid < 0:
                raise OSError(error, os.strerror(error))
        return int(pid)


def _recording_environment(names: set[str]) -> Any:
    """Install a recorder of the environment variables read through os.environ (by name, or
    all of them as "*" when it is iterated); returns what undoes it."""
    environ_type = type(os.environ)
    getitem, iterate = environ_type.__getitem__, environ_type.__iter__

    def recorded_getitem(self: Any, key: str) -> Any:
        names.add(key)
        return getitem(self, key)

    def recorded_iter(self: Any) -> Any:
        names.add("*")
        return iterate(self)

    environ_type.__getitem__ = recorded_getitem  # type: ignore[method-assign]
    environ_type.__iter__ = recorded_iter  # type: ignore[method-assign]

    def undo() -> None:
        environ_type.__getitem__ = getitem  # type: ignore[method-assign]
        environ_type.__iter__ = iterate  # type: ignore[method-assign]

    return undo


def preload(modules: tuple[str, ...]) -> dict[str, str | None]:
    """Import `modules` (and UNRECORDED first), and return the environment variables they read
    as they imported, with their values. What was imported then stays out of the collector's
    way: a fork's or clone's collections would touch (and so copy) every page it is on."""
    for name in UNRECORDED:
        importlib.import_module(name)
    names: set[str] = set()
    undo = _recording_environment(names)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        undo()
    gc.collect()
    gc.freeze()
    return {name: os.environ.get(name) for name in sorted(names)}


def take_environment(env: dict[str, str]) -> None:
    """In a fork or clone: `env` as its environment, read again where the preloaded modules
    keep what they read of it."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR is read again at the first use.
    import wsgiref.handlers

    wsgiref.handlers.BaseHandler.os_environ = wsgiref.handlers.read_environ()


def agrees(env: dict[str, str], read: dict[str, str | None]) -> bool:
    """Whether `env` has the values of `read` (variables a preload read, and their values)."""
    return all(env.get(name) == value for name, value in read.items())


def _serve(path: str) -> dict[str, Any]:
    """Serve until killed; returns only in a clone, with its request, its descriptors in place,
    its directory and environment set."""
    read = preload(PRELOAD)
    clone = _Clone()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(json.dumps({"ready": True, "read": read}), flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            os._exit(0)  # Its test process is gone (its end of the pipe closed).
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = clone()
            except OSError as e:
                conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
                pid = -1
            if pid == 0:
                listener.close()
                conn.detach()
                _become(request, fds)
                return request  # type: ignore[no-any-return]
            for fd in fds:
                os.close(fd)
            if pid > 0:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the clone: the request's descriptors as 0, 1 and 2 and no other, its directory and
    environment."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2:
            with contextlib.suppress(OSError):  # The listing's own, closed already.
                os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # As `python -m` puts its directory first.
    take_environment(request["env"])


def main() -> None:
    request = _serve(sys.argv[1])
    # The command, as `python -m MODULE ARGS` runs it; the interpreter then exits as that does.
    sys.argv = [sys.argv[0], *request["args"]]
    # Run as `__main__` only, as in a fresh interpreter (a preloaded one is imported again if
    # something imports it by name).
    sys.modules.pop(request["module"], None)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def startup_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What of `env` an interpreter reads as it starts (PYTHON*: buffering, paths, warnings,
    the hash seed...; the locale): a clone runs with its zygote's, so each differing one has a
    zygote of its own."""
    return tuple(sorted(
        (k, v) for k, v in env.items()
        if k.startswith(("PYTHON", "LC_")) or k in ("LANG", "LANGUAGE")
    ))  # fmt: skip


class Zygote:
    """One zygote process, started with an environment, and stopped by `stop`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="gazette-zygote-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.server_fork", self.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.stop()
            raise RuntimeError("the server zygote did not start")
        # The variables it read as it imported, and their values then.
        self.read: dict[str, str | None] = json.loads(line)["read"]

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "socket")

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.dir)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command with `env` may be its clone: it agrees on every variable the zygote
        read as it imported."""
        return agrees(env, self.read)

    def spawn(
        self, module: str, args: list[str], env: dict[str, str], cwd: str, fds: list[int]
    ) -> int:
        """The pid of a clone running `python -m MODULE ARGS`."""
        request = {"module": module, "args": args, "env": env, "cwd": cwd}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the server zygote went away")
                reply += chunk
        answer = json.loads(reply)
        if "error" in answer:
            raise OSError(f"the server zygote could not clone: {answer['error']}")
        return int(answer["pid"])


class Zygotes:
    """This (test) process's zygotes, one per start-up environment (at most `LIMIT`), each
    started at its first use; `stop` stops them by pid."""

    LIMIT = 4

    def __init__(self) -> None:
        self.started: dict[tuple[tuple[str, str], ...], Zygote] = {}
        self.lock = threading.Lock()  # Tests start processes from threads too.
        self.owner = 0  # The pid they belong to: a forked test process starts its own.

    def enabled(self) -> bool:
        """On unless turned off; the clone call is x86_64 Linux's."""
        on = os.environ.get("GAZETTE_TESTS_FORK_SERVERS", "1") != "0"
        return on and sys.platform == "linux" and platform.machine() == "x86_64"

    def stop(self) -> None:
        with self.lock:
            if self.owner == os.getpid():
                for zygote in self.started.values():
                    zygote.stop()
            self.started.clear()

    def spawn(
        self, module: str, args: list[str], env: dict[str, str], cwd: str, fds: list[int]
    ) -> int | None:
        """The pid of a clone running `python -m MODULE ARGS` (None: start it fresh)."""
        key = startup_environment(env)
        with self.lock:
            if self.owner != os.getpid():
                if not self.owner:
                    atexit.register(self.stop)  # A process that never stops them (a campaign).
                self.started.clear()  # Its parent's, inherited by a fork.
                self.owner = os.getpid()
            zygote = self.started.get(key)
            if zygote is not None and not zygote.running():
                zygote.stop()
                del self.started[key]
                zygote = None
            if zygote is None:
                if len(self.started) >= self.LIMIT:
                    return None
                zygote = self.started[key] = Zygote(env)
        if not zygote.serves(env):
            return None
        return zygote.spawn(module, args, env, cwd, fds)


ZYGOTES = Zygotes()


class ForkedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """`subprocess.Popen`, which starts `[sys.executable, "-m", MODULE, ...]` as a clone of the
    zygote, a child of this process all the same; any other command as Popen does."""

    def _execute_child(  # type: ignore[override]
        self, args: Any, executable: Any, preexec_fn: Any, close_fds: bool, pass_fds: Any,
        cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: bool, p2cread: int,
        p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
        restore_signals: bool, gid: Any, gids: Any, uid: Any, umask: int,
        start_new_session: bool, process_group: int,
    ) -> None:  # fmt: skip
        everything = (args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                      creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                      errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                      process_group)  # fmt: skip
        directory = os.fsdecode(cwd) if cwd is not None else os.getcwd()
        plain = (
            ZYGOTES.enabled()
            and isinstance(args, list) and len(args) >= 3
            and args[0] == sys.executable and args[1] == "-m"
            and all(isinstance(a, str) for a in args)
            and executable is None and preexec_fn is None and close_fds and not pass_fds
            and not shell and restore_signals and gid is None and gids is None and uid is None
            and umask < 0 and not start_new_session and process_group == -1
            and os.path.isdir(directory)
        )  # fmt: skip
        pid = None
        if plain:
            full_env = {os.fsdecode(k): os.fsdecode(v) for k, v in (env or os.environ).items()}
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]  # fmt: skip
            pid = ZYGOTES.spawn(args[2], args[3:], full_env, directory, fds)
        if pid is None:
            super()._execute_child(*everything)  # type: ignore[misc]
            return
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
