"""The command line of a consumer application (upstream's `runconsumer`): `serve` runs a
consumer process with upstream's flags (`--consumer.*`, `--broker.*`, `--etcd.*`, `--log.*`,
each also from its environment variable) until SIGTERM or SIGINT, then exits gracefully (its
shards handed to other processes). Bad flags are one line and exit 2; a process that cannot
start, or whose lease is lost, says why in one line and exits 1."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click
import grpc

from broker.client.journals import ApplyConflict, BrokerUnavailable
from broker.protocol import protocol_pb2 as pb
from broker.protocol.validate import ValidationError
from consumer.protocol import DEFAULT_MAX_HOT_STANDBYS, cpb, validate_consumer_spec
from consumer.runtime import CONSUMER_PEER_TLS_FLAGS, Consumer, ConsumerApplication, ConsumerConfig
from plumbing import auth, credentials, runtime
from plumbing import config as cfg
from plumbing.etcd import etcd_tls, parse_etcd_address
from plumbing.tasks import first_of
from plumbing.tls import ClientTLS, ServerTLS, TLSConfigError, dial_target
from spec.durations import DurationError, parse_go_duration

__all__ = ["run_command", "serve_command", "serve_config"]

AppFactory = Callable[[dict[str, Any]], ConsumerApplication]
T = TypeVar("T")


def _seconds(flag: str, value: str) -> float:
    try:
        return parse_go_duration(value) / 1e9
    except DurationError as exc:
        raise click.ClickException(f"{flag}: {exc}") from None


def consumer_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            cfg.option("--consumer.zone", default="local", help="Availability zone within which this process is running"),
            cfg.option("--consumer.id", default=socket.gethostname, show_default="hostname", help="Unique ID of this process"),
            cfg.option("--consumer.host", default="127.0.0.1", help="Addressable, advertised hostname or IP of this process"),
            cfg.option("--consumer.port", default=8080, type=click.IntRange(0, 65535), help="Service port for gRPC requests (0 picks a free port)"),
            cfg.option("--consumer.limit", default=32, type=click.IntRange(0), help="Maximum number of shards this process will allocate"),
            cfg.option("--consumer.max-hot-standbys", default=DEFAULT_MAX_HOT_STANDBYS, type=click.IntRange(0), help="Maximum effective hot standbys of any one shard"),
            cfg.option("--consumer.watch-delay", default="30ms", help="Delay applied to the application of watched etcd events"),
            cfg.option("--consumer.drain-timeout", default="30s", help="On SIGTERM, how long to wait for this process's shards to move elsewhere"),
            cfg.option("--broker.address", default="http://localhost:8080", help="Service address of a Gazette broker"),
            cfg.option("--etcd.address", default="http://localhost:2379", help="etcd service address"),
            cfg.option("--etcd.lease", env="ETCD_LEASE_TTL", default="20s", help="Time-to-live of the etcd lease"),
            cfg.option("--etcd.prefix", default="", help="etcd base prefix of this application's shards and processes (default: /gazette/consumers/APPLICATION; one per application and release)"),
            cfg.option("--log.level", default="info", type=click.Choice(["trace", "debug", "info", "warn", "error", "fatal"]), help="Logging level"),
            cfg.option("--log.format", default="text", type=click.Choice(["json", "text", "color"]), help="Logging output format"),
        ]
    ):  # fmt: skip
        f = decorator(f)
    f = cfg.option("--consumer.auth-keys", default="", show_default=False, help="Whitespace or comma separated, base64-encoded keys used to sign (first key) and verify (all keys) Authorization tokens")(f)  # fmt: skip
    f = cfg.tls_server_options("consumer")(f)
    f = cfg.tls_client_options("broker")(f)
    f = cfg.http_options("consumer")(f)
    return cfg.etcd_tls_options(f)


def config_of(opts: dict[str, Any], name: str = "consumer") -> ConsumerConfig:
    """The process's configuration, each bad flag refused in one line naming it."""
    config = ConsumerConfig(
        id=opts["consumer_id"],
        zone=opts["consumer_zone"],
        host=opts["consumer_host"],
        port=opts["consumer_port"],
        limit=opts["consumer_limit"],
        max_hot_standbys=opts["consumer_max_hot_standbys"],
        watch_delay=_seconds("--consumer.watch-delay", opts["consumer_watch_delay"]),
        drain_timeout=_seconds("--consumer.drain-timeout", opts["consumer_drain_timeout"]),
        broker_address=opts["broker_address"],
        etcd_address=opts["etcd_address"],
        etcd_lease=_seconds("--etcd.lease", opts["etcd_lease"]),
        etcd_prefix=(opts["etcd_prefix"] or f"/gazette/consumers/{name}").rstrip("/"),
        auth_keys=opts["consumer_auth_keys"],
        http=cfg.http_config(opts, "consumer"),
    )
    try:
        config.server_tls = ServerTLS(opts["consumer_server_cert_file"], opts["consumer_server_cert_key_file"], opts["consumer_server_ca_file"], prefix="--consumer.server")  # fmt: skip
        config.server_tls.check()
        config.peer_tls = ClientTLS(opts["consumer_peer_cert_file"], opts["consumer_peer_cert_key_file"], opts["consumer_peer_ca_file"], flags=CONSUMER_PEER_TLS_FLAGS)  # fmt: skip
        config.peer_tls.check()
        config.etcd_tls = etcd_tls(opts["etcd_cert_file"], opts["etcd_cert_key_file"], opts["etcd_trusted_ca_file"])  # fmt: skip
        if config.auth_keys.strip():
            auth.parse_keys(config.auth_keys, "--consumer.auth-keys")
        config.broker_credentials = credentials.from_settings(
            "broker",
            cert_file=opts["broker_cert_file"],
            key_file=opts["broker_cert_key_file"],
            ca_file=opts["broker_trusted_ca_file"],
            auth_keys=opts["broker_auth_keys"],
            auth_token=opts["broker_auth_token"],
        )
    except (TLSConfigError, auth.AuthConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    # The application's own clients of brokers (its setup, publishers) dial alike.
    credentials.set_default("broker", config.broker_credentials)
    spec = cpb.ConsumerSpec(
        process_spec=pb.ProcessSpec(
            id=pb.ProcessSpec.ID(zone=config.zone, suffix=config.id),
            endpoint=f"http://{config.host}:{config.port or 8080}",
        )
    )
    flags = {
        "process_spec.id.zone": "--consumer.zone",
        "process_spec.id.suffix": "--consumer.id",
        "process_spec.endpoint": "--consumer.host",
    }
    try:
        validate_consumer_spec(spec)
    except ValidationError as exc:
        raise click.ClickException(f"{flags.get(exc.field, exc.field)}: {exc.problem}") from None
    try:
        parse_etcd_address(config.etcd_address)
        dial_target(config.broker_address, what="--broker.address")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if not config.etcd_prefix.startswith("/"):
        raise click.ClickException(f"--etcd.prefix {config.etcd_prefix!r}: must start with '/'")
    if config.etcd_lease < 1:
        raise click.ClickException(f"--etcd.lease: {config.etcd_lease:g}s is below 1s")
    return config


def run_command(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine of an application's command (setup, publish...): a broker or consumer
    that refuses or cannot be reached, or a bad value, is one line (click's error)."""
    try:
        return asyncio.run(coro)
    except (BrokerUnavailable, ApplyConflict, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except grpc.aio.AioRpcError as exc:
        detail = (exc.details() or "").split("\n")[0]
        raise click.ClickException(f"refused ({exc.code().name}): {detail}") from None


def one_line(exc: BaseException) -> str:
    """An error as one line: gRPC's own (etcd's or a broker's) by its code and first detail."""
    if isinstance(exc, grpc.aio.AioRpcError):
        detail = (exc.details() or "").split("\n")[0]
        return f"{exc.code().name}: {detail}"
    text = str(exc).strip().split("\n")[0]
    return text or type(exc).__name__


async def _serve(config: ConsumerConfig, app: ConsumerApplication, name: str) -> int:
    consumer = Consumer(config, app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await consumer.start()
    except Exception as exc:
        click.echo(f"{name}: cannot start: {one_line(exc)}", err=True)
        return 1
    await first_of(stop.wait(), consumer.done.wait())
    failure = consumer.failure
    await consumer.stop()
    if failure is not None:
        click.echo(f"{name}: {one_line(failure)}", err=True)
        return 1
    return 0


def serve_config(config: ConsumerConfig, app: ConsumerApplication, name: str) -> int:
    """Run a consumer process of `app` until SIGTERM or SIGINT; its exit code."""
    runtime.tune_gc()
    return asyncio.run(_serve(config, app, name))


def serve_command(
    name: str, app_factory: AppFactory, *app_options: Callable[[Any], Any]
) -> click.Command:
    """A `serve` command for an application: upstream's consumer flags, plus the application's
    own options (`app_options`, click decorators), whose values `app_factory` receives."""

    def serve(**opts: Any) -> None:
        """Serve as a consumer of this application until SIGTERM or SIGINT."""
        cfg.setup_logging(opts["log_level"], opts["log_format"])
        config = config_of(opts, name)
        app = app_factory(opts)
        sys.exit(serve_config(config, app, name))

    command: Any = serve
    for option in reversed(app_options):
        command = option(command)
    return click.command("serve")(consumer_options(command))
