"""The `gazctl dev` commands (up, down, status, kill, restart), the processes' table and the
exports `up` prints."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from gazctl.dev.cluster import start_again, start_cluster
from gazctl.dev.processes import check_app, location_names
from gazctl.dev.security import DevSecurity
from gazctl.dev.state import STATE, ClusterState, brokers_address, load_state
from gazctl.dev.supervisor import is_running, process_state, stop_pid, stop_pids
from gazctl.render import console, err_console


def print_exports(state: ClusterState) -> None:
    """The environment the other gazctl commands take (stdout's last lines: `eval` them);
    ETCD_ADDRESS is for consumer processes (`--etcd.address`)."""
    click.echo(f"export ETCD_ADDRESS={state.etcd.address}")
    security = DevSecurity.make(Path(state.dir), state.tls, state.auth)
    for name, value in security.environment().items():
        click.echo(f"export {name}={value}")
    # Every broker: a client reaches whichever is alive (plumbing.tls.dial_target).
    click.echo(f"export BROKER_ADDRESS={brokers_address(state)}")
    click.echo(f"export BROKER_FILE_ROOT={Path(state.dir) / 'fragments'}")
    if state.postgres is not None:
        click.echo(f"export POSTGRES_DSN={state.postgres.address}")
    if state.consumers:
        # Every consumer: a client reaches whichever is alive (plumbing.tls.dial_target).
        addresses = ",".join(c.address for c in state.consumers)
        click.echo(f"export CONSUMER_ADDRESS={addresses}")


STATE_STYLE = {
    "running": "[green]{}[/green]",
    "paused": "[yellow]{}[/yellow]",
    "down": "[red]{}[/red]",
}


def print_status(state: ClusterState, to: Console = console) -> None:
    """The processes' table (`up` puts it on stderr: its stdout is the exports alone)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("Process", "PID", "Address", "State", "Log"):
        table.add_column(column)
    for proc in state.all():
        alive = process_state(proc)
        table.add_row(
            proc.role, str(proc.pid), proc.address, STATE_STYLE[alive].format(alive), proc.log
        )
    to.print(table)


@click.group()
def dev() -> None:
    """A local development cluster: etcd, brokers, and consumers, on loopback; `kill` and
    `restart` one of them to try failover."""


dir_option = click.option(
    "--dir", "directory", default=".gazette-dev", show_default=True, type=click.Path(file_okay=False),
    help="Folder holding the cluster's state, logs, etcd data and file:// fragment store",
)  # fmt: skip


@dev.command("up")
@dir_option
@click.option(
    "--brokers", default=3, show_default=True, type=click.IntRange(1, 32), help="Number of brokers"
)
@click.option(
    "--consumers", default=None, type=click.IntRange(1, 32),
    help="Consumer processes of --app to start (default 2 with --app)",
)  # fmt: skip
@click.option(
    "--app", default=None,
    help="The consumers' application: an example (word-count, stream-sum) or module:Name",
)  # fmt: skip
@click.option(
    "--postgres", is_flag=True,
    help="Also run PostgreSQL (word-count keeps its counts there; others get POSTGRES_DSN)",
)  # fmt: skip
@click.option(
    "--locations", default=None,
    help="Also run a replication network's locations: a count (3: A, B, C) or names (east,west), each in a cluster of its own",
)  # fmt: skip
@click.option(
    "--tls", is_flag=True,
    help="Run every process on TLS, with a throwaway CA and certificates made in <dir>/tls (client certificates required)",
)  # fmt: skip
@click.option(
    "--auth", is_flag=True,
    help="Require authorization tokens, signed with a random key made in <dir>/auth-key",
)  # fmt: skip
@click.option(
    "--timeout",
    default=60.0,
    show_default=True,
    help="Seconds to wait for the cluster to become ready",
)
def up(
    directory: str,
    brokers: int,
    consumers: int | None,
    app: str | None,
    postgres: bool,
    locations: str | None,
    tls: bool,
    auth: bool,
    timeout: float,
) -> None:
    """Start etcd and brokers (and PostgreSQL, and consumer processes of an application), wait
    until all are ready, and print BROKER_ADDRESS, BROKER_FILE_ROOT (the file:// fragment
    stores' root), CONSUMER_ADDRESS and POSTGRES_DSN to export: stdout holds those exports
    alone (the processes' table goes to stderr), so `eval "$(gazctl dev up)"` sets them.

    On a cluster some of whose processes died (or were stopped by `dev kill`), start only
    those, on their ports, ids and folders, and leave the others running; a flag that differs
    from the running cluster's (--brokers 5 for a cluster of 3) is refused: `dev down` first.

    Consumers run with CONSUMER_STORE_ROOT (a folder for JSON-file stores) and POSTGRES_DSN in
    their environment, under the etcd prefix /gazette/consumers/NAME. `--app stream-sum` also
    runs the example's `setup` (its chunk and sum journals, and a shard per chunk journal) and
    waits until every shard has a primary. Started again on the same folder, the cluster keeps
    its data and its addresses (each port that is still free), so exported variables keep
    working.

    With --locations, each location runs in a broker cluster of its own with its process
    (`python -m replication serve`), registered under /gazette/replication: connect them with
    `gazctl replication connect`.

    With --tls, etcd, brokers and consumers serve TLS and require client certificates, all
    from a throwaway CA in <dir>/tls; with --auth they verify tokens signed with <dir>/auth-key.
    The printed exports (BROKER_CERT_FILE, BROKER_AUTH_KEYS, ...) make gazctl their client."""
    if consumers is not None and app is None:
        raise click.UsageError("--consumers needs --app: the application they run")
    if app is not None:
        check_app(app, postgres)
    names = location_names(locations) if locations else []
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    existing = ClusterState.load(root)
    if existing is not None and any(is_running(p) for p in existing.all()):
        requested = {
            "brokers": brokers, "consumers": consumers, "app": app, "postgres": postgres,
            "locations": names, "tls": tls, "auth": auth,
        }  # fmt: skip
        ctx = click.get_current_context()
        given = {
            k: v
            for k, v in requested.items()
            if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT
        }
        resume(existing, given, directory, timeout)
        return
    if existing is not None:
        # Stale state from a crash or a reboot: none of its processes runs.
        (root / STATE).unlink(missing_ok=True)
        click.echo(f"cleaned stale dev cluster state in {root}", err=True)
    consumers = consumers or (2 if app is not None else 0)
    state = start_cluster(root, brokers, consumers, app, postgres, names, tls, auth, timeout)
    print_status(state, err_console)
    print_exports(state)


@dev.command("down")
@dir_option
@click.option("--purge", is_flag=True, help="Also delete the folder (etcd data, fragments, logs)")
def down(directory: str, purge: bool) -> None:
    """Stop the dev cluster's processes by pid."""
    root = Path(directory).resolve()
    state = ClusterState.load(root)
    if state is None:
        click.echo(f"no dev cluster in {root}", err=True)
    else:
        stopped = sum(stop_pids(tier, say=True) for tier in state.tiers())
        (root / STATE).unlink(missing_ok=True)
        click.echo(f"stopped {stopped} process(es) of the dev cluster in {root}", err=True)
    if purge and root.exists():
        if (root / "postgres").is_symlink():
            shutil.rmtree((root / "postgres").resolve(), ignore_errors=True)
        shutil.rmtree(root)


@dev.command("status")
@dir_option
def status(directory: str) -> None:
    """Show the dev cluster's processes, each running, paused (`dev kill --signal STOP`) or
    down; exits 1 if one is down (`gazctl dev up` starts those)."""
    state = load_state(directory)
    print_status(state)
    if not all(is_running(p) for p in state.all()):
        sys.exit(1)


def signal_named(ctx: click.Context, param: click.Parameter, value: str) -> signal.Signals:
    """`--signal`: by name (KILL, SIGKILL, kill) or number (9)."""
    text = value.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise click.BadParameter(
            f"{value!r} is not a signal (e.g. KILL, TERM, STOP, CONT, INT, HUP)"
        ) from None


@dev.command("kill")
@dir_option
@click.option(
    "--signal", "sig", default="KILL", show_default=True, callback=signal_named,
    help="The signal to send: KILL, TERM, STOP (pause), CONT (resume), INT, HUP, or a number",
)  # fmt: skip
@click.argument("name")
def kill(directory: str, sig: signal.Signals, name: str) -> None:
    """Send a signal to one process of the dev cluster: NAME as `dev status` shows it
    (etcd, broker-0, consumer-1, postgres, location-east, location-east-broker). After KILL,
    returns once the process is gone. `gazctl dev up` starts again whatever is down."""
    state = load_state(directory)
    proc = state.find(name)
    if not is_running(proc):
        raise click.ClickException(
            f"{name} is already down (pid {proc.pid}): `gazctl dev up` starts it again"
        )
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        raise click.ClickException(f"{name} exited (pid {proc.pid}) before the signal") from None
    if sig == signal.SIGKILL:
        deadline = time.monotonic() + 10
        while is_running(proc) and time.monotonic() < deadline:
            time.sleep(0.02)
    click.echo(f"sent {sig.name} to {name} (pid {proc.pid})", err=True)


@dev.command("restart")
@dir_option
@click.option(
    "--timeout", default=60.0, show_default=True,
    help="Seconds to wait for it to stop (then SIGKILL), and then to become ready",
)  # fmt: skip
@click.argument("name")
def restart(directory: str, timeout: float, name: str) -> None:
    """Stop one process of the dev cluster (SIGTERM, then SIGKILL after --timeout), and start
    it again as `up` did: its ports, id and folders; returns once it is ready. NAME as `dev
    status` shows it."""
    state = load_state(directory)
    proc = state.find(name)
    before = proc.pid
    stop_pid(proc, timeout, say=True)
    start_again(state, [proc], timeout)
    click.echo(f"restarted {name}: pid {before} -> {proc.pid}", err=True)


FLAGS = {"postgres", "tls", "auth"}


def as_flag(name: str, value: object) -> str:
    """How `up` would be given `value`: `--brokers 3`, `--tls`, `no --app`."""
    if name in FLAGS:
        return f"--{name}" if value else f"no --{name}"
    if value is None or value == []:
        return f"no --{name}"
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return f"--{name} {value}"


def resume(
    state: ClusterState, given: Mapping[str, object], directory: str, timeout: float
) -> None:
    """`up` on a cluster of which some processes run: the flags `given` must describe it;
    start those that are down, and leave the others running."""
    running = {
        "brokers": len(state.brokers),
        "consumers": len(state.consumers),
        "app": state.app or None,
        "postgres": state.postgres is not None,
        "locations": state.location_names(),
        "tls": state.tls,
        "auth": state.auth,
    }
    differ = [name for name, value in given.items() if running[name] != value]
    if differ:
        have = ", ".join(as_flag(n, running[n]) for n in differ)
        want = ", ".join(as_flag(n, given[n]) for n in differ)
        raise click.ClickException(
            f"the dev cluster in {state.dir} runs with {have}, not {want}: stop it first "
            f"(`gazctl dev down --dir {directory}`), or leave the flag out to keep it as it is"
        )
    down = [p for p in state.start_order() if not is_running(p)]
    if not down:
        DevSecurity.make(Path(state.dir), state.tls, state.auth).apply()
        click.echo(f"a dev cluster is already running in {state.dir}:", err=True)
        print_status(state, err_console)
        print_exports(state)
        return
    start_again(state, down, timeout)
    others = len(state.all()) - len(down)
    click.echo(
        f"started {', '.join(p.role for p in down)}; {others} other"
        f"{' was' if others == 1 else 's were'} running",
        err=True,
    )
    print_status(state, err_console)
    print_exports(state)
