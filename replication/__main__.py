"""`python -m replication serve --location NAME`: the process of one location (it owns its log's
writer, serves the Location service and runs the connections into it) until SIGTERM or SIGINT.

`python -m replication host`: a location host, a consumer process whose shards are locations
(`gazctl replication add` declares them): it runs the primaries the allocator gives it and keeps
hot standbys of others, which take over when their primary's host dies (see replication.host).

Bad flags are one line and exit 2; a process that cannot start says why in one line and exits 1.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import click

from consumer.main import consumer_options, one_line
from plumbing import auth
from plumbing import config as cfg
from plumbing.tls import ServerTLS, TLSConfigError
from replication import registry
from replication.process import LocationConfig, LocationProcess, StartError
from spec.durations import DurationError, parse_go_duration


@click.group()
def main() -> None:
    """Replication networks: location processes."""


@main.command("serve")
@cfg.option("--location", required=True, help="Name of the location this process serves")
@cfg.option(
    "--journal",
    default="",
    help="Journal of the location's local event log (default: replication/LOCATION)",
)
@cfg.option(
    "--broker.address",
    default="http://localhost:8080",
    help="Service address of a broker of the cluster that holds the location's log",
)
@cfg.option(
    "--etcd.address",
    default="http://localhost:2379",
    help="etcd service address of the replication registry",
)
@cfg.option(
    "--replication.prefix",
    default=registry.DEFAULT_PREFIX,
    help="etcd prefix of the replication registry (one per replication network)",
)
@cfg.option(
    "--replication.host",
    default="127.0.0.1",
    help="Addressable, advertised hostname or IP of this process",
)
@cfg.option(
    "--replication.port",
    default=0,
    type=click.IntRange(0, 65535),
    help="Port of the Location service (0 picks a free port)",
)
@cfg.option(
    "--replication.batch", default=1000, type=click.IntRange(1), help="Events per replication batch"
)
@cfg.option(
    "--etcd.lease", default="10s", help="Time-to-live of the etcd lease of this process's endpoint"
)
@cfg.option("--replication.server-cert-file", default="", show_default=False, help="Path to the Location service's TLS certificate (serves TLS when given)")  # fmt: skip
@cfg.option("--replication.server-cert-key-file", default="", show_default=False, help="Path to the Location service's TLS private key")  # fmt: skip
@cfg.option("--replication.server-ca-file", default="", show_default=False, help="Path to the trusted CA of callers' client certificates (when given, callers must present one)")  # fmt: skip
@cfg.option("--replication.auth-keys", default="", show_default=False, help="Whitespace or comma separated, base64-encoded keys that verify callers' tokens")  # fmt: skip
@cfg.log_options
@cfg.client_credentials("broker", "etcd")
def serve(**opts: Any) -> None:  # fmt: skip
    """Serve one location until SIGTERM or SIGINT."""
    cfg.setup_logging(opts["log_level"], opts["log_format"])
    try:
        lease = parse_go_duration(opts["etcd_lease"]) / 1e9
    except DurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--etcd.lease") from None
    if not opts["replication_prefix"].startswith("/"):
        raise click.BadParameter("must start with '/'", param_hint="--replication.prefix")
    try:
        config = LocationConfig(
            location=opts["location"],
            broker_address=opts["broker_address"],
            etcd_address=opts["etcd_address"],
            prefix=opts["replication_prefix"].rstrip("/"),
            journal=opts["journal"],
            host=opts["replication_host"],
            port=opts["replication_port"],
            lease=max(1.0, lease),
            batch=opts["replication_batch"],
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--location") from None
    config.server_tls = ServerTLS(
        opts["replication_server_cert_file"],
        opts["replication_server_cert_key_file"],
        opts["replication_server_ca_file"],
        prefix="--replication.server",
    )
    config.auth_keys = opts["replication_auth_keys"]
    try:
        config.server_tls.check()
        if config.auth_keys.strip():
            auth.parse_keys(config.auth_keys, "--replication.auth-keys")
    except (TLSConfigError, auth.AuthConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(asyncio.run(_serve(config)))


async def _serve(config: LocationConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.Event()
    server = LocationProcess(config)
    announce = asyncio.ensure_future(_announce(server, ready))
    try:
        await server.run(stop, ready)
    except StartError as exc:
        click.echo(f"location {config.location}: cannot start: {exc}", err=True)
        return 1
    except Exception as exc:
        click.echo(f"location {config.location}: {one_line(_first(exc))}", err=True)
        return 1
    finally:
        announce.cancel()
    return 0


async def _announce(server: LocationProcess, ready: asyncio.Event) -> None:
    await ready.wait()
    print(f"location {server.name} serving at {server.endpoint}", flush=True)


@main.command("host")
@cfg.option(
    "--replication.prefix",
    default=registry.DEFAULT_PREFIX,
    help="etcd prefix of the replication registry (one per replication network)",
)
@cfg.option(
    "--replication.batch", default=1000, type=click.IntRange(1), help="Events per replication batch"
)
@cfg.option(
    "--replication.lease", default="10s",
    help="Time-to-live of the etcd lease of each location's endpoint",
)  # fmt: skip
@cfg.option("--replication.server-cert-file", default="", show_default=False, help="Path to the Location services' TLS certificate (serve TLS when given)")  # fmt: skip
@cfg.option("--replication.server-cert-key-file", default="", show_default=False, help="Path to the Location services' TLS private key")  # fmt: skip
@cfg.option("--replication.server-ca-file", default="", show_default=False, help="Path to the trusted CA of callers' client certificates (when given, callers must present one)")  # fmt: skip
@cfg.option("--replication.auth-keys", default="", show_default=False, help="Whitespace or comma separated, base64-encoded keys that verify callers' tokens")  # fmt: skip
@consumer_options
def host(**opts: Any) -> None:  # fmt: skip
    """Host locations (and standbys of locations) until SIGTERM or SIGINT. Its shard keyspace
    is PREFIX/hosts unless --etcd.prefix says otherwise."""
    from consumer.main import config_of, serve_config
    from replication.host import HostSettings, LocationHost, hosts_prefix

    cfg.setup_logging(opts["log_level"], opts["log_format"])
    prefix = opts["replication_prefix"]
    if not prefix.startswith("/"):
        raise click.BadParameter("must start with '/'", param_hint="--replication.prefix")
    try:
        lease = parse_go_duration(opts["replication_lease"]) / 1e9
    except DurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--replication.lease") from None
    opts["etcd_prefix"] = opts["etcd_prefix"] or hosts_prefix(prefix)
    config = config_of(opts, "locations")
    settings = HostSettings(
        prefix=prefix.rstrip("/"), batch=opts["replication_batch"], lease=max(1.0, lease),
        server_tls=ServerTLS(
            opts["replication_server_cert_file"], opts["replication_server_cert_key_file"],
            opts["replication_server_ca_file"], prefix="--replication.server",
        ),
        auth_keys=opts["replication_auth_keys"],
    )  # fmt: skip
    try:
        settings.server_tls.check()
        if settings.auth_keys.strip():
            auth.parse_keys(settings.auth_keys, "--replication.auth-keys")
    except (TLSConfigError, auth.AuthConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(serve_config(config, LocationHost(settings), "location host"))


def _first(exc: BaseException) -> BaseException:
    """The first failure inside a task group's exception group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    main()
