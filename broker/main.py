"""`gazette`: the broker server command (`gazette serve`, `gazette print-config`)."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import click

from broker.server import PEER_TLS_FLAGS, Broker, BrokerConfig
from plumbing import auth, metrics, runtime
from plumbing import config as cfg
from plumbing.etcd import etcd_tls
from plumbing.membership import AnnounceError
from plumbing.tasks import first_of
from plumbing.tls import ClientTLS, ServerTLS, TLSConfigError

INI_NAME = "gazette.ini"


def _duration(flag: str, value: Any) -> float:
    from spec.durations import DurationError, parse_go_duration

    try:
        return parse_go_duration(str(value)) / 1e9
    except DurationError as exc:
        raise click.ClickException(f"{flag}: {exc}") from None


# The least exit flush that still suspends each journal at its end when its store fails (the
# flush gives up SUSPEND_MARGIN, 3 s, before its bound): below it, a stop over a failing or slow
# store could leave a journal unsuspended, and its offsets handed out again after a restart.
MIN_EXIT_FLUSH_TIMEOUT = 5.0


def _exit_flush_timeout(value: Any) -> float:
    seconds = _duration("--broker.exit-flush-timeout", value)
    if seconds < MIN_EXIT_FLUSH_TIMEOUT:
        raise click.ClickException(
            f"--broker.exit-flush-timeout {value}: must be at least "
            f"{MIN_EXIT_FLUSH_TIMEOUT:g}s (a stopping broker needs that long to persist what it "
            "holds, or to record each journal's end when its store does not take it)"
        )
    return seconds


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name="gazette-py", prog_name="gazette", message="%(prog)s %(version)s"
)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Serve a Gazette broker."""
    _, ini = cfg.load_ini(INI_NAME)
    ctx.obj = ini
    ctx.default_map = cfg.default_map(cli, ini)


@cli.command()
@cfg.option(
    "--broker.zone", default="local", help="Availability zone within which this process is running"
)
@cfg.option(
    "--broker.id",
    default=socket.gethostname,
    show_default="hostname",
    help="Unique ID of this process",
)
@cfg.option(
    "--broker.host",
    default=socket.gethostname,
    show_default="hostname",
    help="Addressable, advertised hostname or IP of this process",
)
@cfg.option(
    "--broker.port",
    default=8080,
    type=click.IntRange(0, 65535),
    help="Service port for gRPC requests (0 picks a free port)",
)
@cfg.option(
    "--broker.listen-host",
    default="",
    help="Interface to listen on (default: loopback if --broker.host is loopback, else all)",
)
@cfg.option("--broker.file-root", default="", help="Local path which roots file:// fragment stores")
@cfg.option(
    "--broker.limit",
    default=1024,
    type=int,
    help="Maximum number of journals the broker will allocate",
)
@cfg.option(
    "--broker.max-replication",
    default=9,
    type=int,
    help="Maximum effective replication of any one journal",
)
@cfg.option(
    "--broker.min-append-rate",
    default=65536,
    type=int,
    help="Minimum rate (bytes/s) at which a client may stream Append content",
)
@cfg.option(
    "--broker.max-append-rate",
    default=0,
    type=int,
    help="Max rate (bytes/s) of appends across all journals (0 is unlimited)",
)
@cfg.option(
    "--broker.watch-delay",
    default="30ms",
    help="Delay applied to the application of watched etcd events",
)
@cfg.option(
    "--broker.max-grpc-recv-size",
    default=4194304,
    type=int,
    help="Maximum gRPC message size the broker accepts",
)
@cfg.option(
    "--broker.drain-timeout",
    default="30s",
    help="On SIGTERM, how long to wait for the allocator to move this broker's journals away",
)
@cfg.option(
    "--broker.exit-flush-timeout",
    default="30s",
    help="On SIGTERM, how long to keep trying to persist the content this broker holds to its "
    "journals' stores (ours; upstream's persister tries until it succeeds)",
)
@cfg.option(
    "--broker.persist-interval",
    default="1m",
    help="How long a replica waits before checking that a completed fragment was persisted",
)
@cfg.option(
    "--broker.auto-suspend",
    is_flag=True,
    default=False,
    help="Automatically suspend journals which have persisted all fragments and are idle",
)
@cfg.option(
    "--broker.pulse-interval",
    default="1m",
    help="How often a journal's primary pulses its replicas (with --broker.auto-suspend, a "
    "journal may be suspended after 15 pulses on an unchanged route)",
)
@cfg.option(
    "--broker.metrics-journal-labels",
    type=bool,
    default=True,
    help="Label metrics with journal names and store URLs; false: sums without names instead "
    "(for brokers shared by tenants who must not learn of each other's journals)",
)
@cfg.tls_server_options("broker")
@cfg.option("--broker.auth-keys", default="", help="Whitespace or comma separated, base64-encoded keys. The first key is used to sign Authorization tokens.", show_default=False)  # fmt: skip
@cfg.option("--etcd.address", default="http://localhost:2379", help="etcd service address")
@cfg.option(
    "--etcd.prefix",
    default="/gazette/cluster",
    help="etcd base prefix for broker state and coordination",
)
@cfg.option(
    "--etcd.lease", env="ETCD_LEASE_TTL", default="20s", help="Time-to-live of the etcd lease"
)
@cfg.http_options("broker")
@cfg.etcd_tls_options
@cfg.log_options
def serve(**opts: Any) -> None:
    """Serve as a Gazette broker with the provided configuration, until SIGTERM or SIGINT."""
    cfg.setup_logging(opts["log_level"], opts["log_format"])
    metrics.set_journal_labels(opts["broker_metrics_journal_labels"])
    config = BrokerConfig(
        zone=opts["broker_zone"],
        id=opts["broker_id"],
        host=opts["broker_host"],
        port=opts["broker_port"],
        listen_host=opts["broker_listen_host"],
        file_root=opts["broker_file_root"],
        limit=opts["broker_limit"],
        max_replication=opts["broker_max_replication"],
        min_append_rate=opts["broker_min_append_rate"],
        max_append_rate=opts["broker_max_append_rate"],
        watch_delay=_duration("--broker.watch-delay", opts["broker_watch_delay"]),
        drain_timeout=_duration("--broker.drain-timeout", opts["broker_drain_timeout"]),
        exit_flush_timeout=_exit_flush_timeout(opts["broker_exit_flush_timeout"]),
        persist_interval=_duration("--broker.persist-interval", opts["broker_persist_interval"]),
        auto_suspend=opts["broker_auto_suspend"],
        pulse_interval=_duration("--broker.pulse-interval", opts["broker_pulse_interval"]),
        max_grpc_recv_size=opts["broker_max_grpc_recv_size"],
        etcd_address=opts["etcd_address"],
        etcd_prefix=opts["etcd_prefix"].rstrip("/"),
        etcd_lease=_duration("--etcd.lease", opts["etcd_lease"]),
        server_tls=ServerTLS(
            opts["broker_server_cert_file"],
            opts["broker_server_cert_key_file"],
            opts["broker_server_ca_file"],
        ),
        peer_tls=ClientTLS(
            opts["broker_peer_cert_file"],
            opts["broker_peer_cert_key_file"],
            opts["broker_peer_ca_file"],
            flags=PEER_TLS_FLAGS,
        ),
        etcd_tls=etcd_tls(
            opts["etcd_cert_file"],
            opts["etcd_cert_key_file"],
            opts["etcd_trusted_ca_file"],
            check=False,  # Checked below, with the other flags.
        ),
        auth_keys=opts["broker_auth_keys"],
        http=cfg.http_config(opts, "broker"),
    )
    _check(config)
    runtime.tune_gc()
    sys.exit(asyncio.run(_serve(config)))


def _check(config: BrokerConfig) -> None:
    """Reject a configuration the broker could not run with, naming the flag."""
    from broker.protocol import protocol_pb2 as pb
    from broker.protocol import validate
    from plumbing.etcd import parse_etcd_address

    spec = pb.BrokerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone=config.zone, suffix=config.id),
            endpoint=f"http://{config.host}:{config.port or 8080}",
        ),
        journal_limit=config.limit,
    )
    flags = {
        "process_spec.id.zone": "--broker.zone",
        "process_spec.id.suffix": "--broker.id",
        "process_spec.endpoint": "--broker.host",
    }
    try:
        validate.validate_broker_spec(spec)
    except validate.ValidationError as exc:
        flag = flags.get(exc.field, "--broker.limit" if "limit" in exc.field else exc.field)
        raise click.ClickException(f"{flag}: {exc.problem}") from None
    try:
        config.server_tls.check()
        config.peer_tls.check()
        config.etcd_tls.check()
        if config.auth_keys.strip():
            auth.parse_keys(config.auth_keys, "--broker.auth-keys")
    except (TLSConfigError, auth.AuthConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        parse_etcd_address(config.etcd_address)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if not config.etcd_prefix.startswith("/"):
        raise click.ClickException(f"--etcd.prefix {config.etcd_prefix!r}: must start with '/'")
    if config.file_root and not Path(config.file_root).is_dir():
        raise click.ClickException(
            f"--broker.file-root {config.file_root!r}: not a directory (create it, or give an "
            "existing one)"
        )
    if config.etcd_lease < 1:
        raise click.ClickException(f"--etcd.lease: {config.etcd_lease:g}s is below 1s")


async def _serve(config: BrokerConfig) -> int:
    broker = Broker(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await broker.start()
    except (AnnounceError, OSError) as exc:
        click.echo(f"gazette: {exc}", err=True)
        return 1
    except Exception as exc:
        click.echo(f"gazette: cannot start: {exc.__class__.__name__}: {exc}", err=True)
        return 1
    await first_of(stop.wait(), broker.done.wait())
    failure = broker.failure
    await broker.stop()
    if failure is not None:
        click.echo(f"gazette: {failure}", err=True)
        return 1
    return 0


@cli.command("print-config")
@click.pass_context
def print_config(ctx: click.Context) -> None:
    """Print the combined configuration (gazette.ini, environment, defaults) in INI form."""
    click.echo(cfg.render_ini(cli, ctx.obj or {}), nl=False)


def main() -> None:
    cli(prog_name="gazette")


if __name__ == "__main__":
    main()
