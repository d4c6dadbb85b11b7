"""One source of truth per setting: a flag, its environment variable and its INI key.

Options are named as upstream (`--broker.zone`, `$BROKER_ZONE`); the INI file (`gazette.ini` for
the broker, `gazctl.ini` for the CLI) is searched in `.`, `~/.config/gazette/` and
`$APPLICATION_CONFIG_ROOT`, with a `[broker]` section holding `zone = ...`. Precedence is flag,
then environment, then INI file, then default.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def option(flag: str, *, env: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """A click option named after an upstream dotted flag, bound to its environment variable.
    A flag that takes a secret (`--broker.auth-keys`) comes with its `-file` form too
    (`secret_file_option`), so that the secret need never be on a command line."""
    dest = flag.lstrip("-").replace(".", "_").replace("-", "_")
    if env is None:
        env = dest.upper()
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", "default" in kwargs)
    plain = click.option(flag, dest, envvar=env, **kwargs)
    if flag.rpartition(".")[2] not in SECRET_KEYS:
        return plain
    with_file = secret_file_option(flag, dest, env)

    def apply(f: F) -> F:
        return plain(with_file(f))

    return apply


class SecretFileError(click.ClickException):
    pass


def read_secret_file(flag: str, path: str) -> str:
    """The secret in the file `path` given to `flag` (a `-file` flag), stripped; else one line
    naming the flag and the path."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SecretFileError(f"{flag} {path}: not a text file") from None
    if not value:
        raise SecretFileError(f"{flag} {path}: the file is empty")
    return value


def secret_file_option(flag: str, dest: str, env: str) -> Callable[[F], F]:
    """`FLAG-file PATH` (and `$ENV_FILE`): the secret of `flag` read from a file. Before the
    command runs, the file's content becomes `flag`'s value. The more specific source wins
    (a flag over a variable over an INI file); both from the same source is one line naming
    them, as is a file that cannot be read."""
    import functools

    file_flag, file_dest, file_env = f"{flag}-file", f"{dest}_file", f"{env}_FILE"

    def apply(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **opts: Any) -> Any:
            path = opts.pop(file_dest, "") or ""
            if path:
                ctx = click.get_current_context(silent=True)
                plain_source = file_source = None
                if ctx is not None:
                    plain_source = ctx.get_parameter_source(dest)
                    file_source = ctx.get_parameter_source(file_dest)
                given = bool(opts.get(dest))
                if given and (plain_source is None or plain_source == file_source):
                    raise SecretFileError(f"{flag} and {file_flag} are both given: one, not both")
                if not given or _precedence(file_source) < _precedence(plain_source):
                    opts[dest] = read_secret_file(file_flag, path)
            return f(*args, **opts)

        out: Any = click.option(
            file_flag,
            file_dest,
            envvar=file_env,
            default="",
            show_default=False,
            show_envvar=True,
            help=f"Path to a file holding the value of {flag} (instead of {flag} itself, "
            "which a command line would show)",
        )(wrapper)
        return out  # type: ignore[no-any-return]

    return apply


def _precedence(source: click.core.ParameterSource | None) -> int:
    from click.core import ParameterSource

    order = [ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.DEFAULT_MAP]
    return order.index(source) if source in order else len(order)


def ini_search_paths(name: str) -> list[Path]:
    roots = [Path(".")]
    for var in ("HOME", "UserProfile"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]) / ".config" / "gazette")
    if os.environ.get("APPLICATION_CONFIG_ROOT"):
        roots.append(Path(os.environ["APPLICATION_CONFIG_ROOT"]))
    return [root / name for root in roots]


class ConfigFileError(click.ClickException):
    pass


def load_ini(name: str) -> tuple[Path | None, dict[str, dict[str, str]]]:
    """The first INI file found, as {section: {key: value}} with lower-cased names."""
    for path in ini_search_paths(name):
        if not path.is_file():
            continue
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as exc:
            message = str(exc).splitlines()[0]
            raise ConfigFileError(f"config file {path}: {message}") from exc
        sections = {
            section.lower(): {k.lower(): v for k, v in parser.items(section)}
            for section in parser.sections()
        }
        return path, sections
    return None, {}


def _dotted(param: click.Parameter) -> tuple[str, str] | None:
    for opt in param.opts:
        if opt.startswith("--") and "." in opt:
            section, _, key = opt[2:].partition(".")
            return section.lower(), key.lower()
    return None


def default_map(
    command: click.Command, ini: dict[str, dict[str, str]], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A click default_map for `command` and its sub-commands from INI sections. A section may
    be scoped to a command path (`[journals.broker]`), which wins over the plain `[broker]`."""
    out: dict[str, Any] = {}
    for param in command.params:
        dotted = _dotted(param)
        if dotted is None or param.name is None:
            continue
        section, key = dotted
        # The most specific scope wins: [journals.list.broker], [journals.broker], [broker].
        scopes = [".".join((*path[:n], section)) for n in range(len(path), -1, -1)]
        for scope in scopes:
            if key in ini.get(scope, {}):
                out[param.name] = ini[scope][key]
                break
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            nested = default_map(sub, ini, (*path, name))
            if nested:
                out[name] = nested
    return out


def iter_dotted_options(command: click.Command) -> Iterator[tuple[str, str, click.Option]]:
    seen: set[tuple[str, str]] = set()
    stack = [command]
    while stack:
        cmd = stack.pop(0)
        for param in cmd.params:
            dotted = _dotted(param)
            if dotted and dotted not in seen and isinstance(param, click.Option):
                seen.add(dotted)
                yield dotted[0], dotted[1], param
        if isinstance(cmd, click.Group):
            stack.extend(cmd.commands.values())


# Settings whose values are secrets: print-config shows that they are set, not what they are.
SECRET_KEYS = frozenset({"auth-keys", "auth-token"})


def render_ini(command: click.Command, ini: dict[str, dict[str, str]]) -> str:
    """The combined configuration (environment, then INI, then defaults) in INI form."""
    sections: dict[str, list[str]] = {}
    for section, key, param in sorted(iter_dotted_options(command), key=lambda t: (t[0], t[1])):
        envvar = param.envvar if isinstance(param.envvar, str) else None
        if envvar and envvar in os.environ:
            value: Any = os.environ[envvar]
        elif key in ini.get(section, {}):
            value = ini[section][key]
        else:
            value = param.default() if callable(param.default) else param.default
        if value is None:
            value = ""
        elif key in SECRET_KEYS and value:
            value = "<hidden>"  # A secret is never printed (give it again where it is used).
        elif isinstance(value, bool):
            value = "true" if value else "false"
        comment = f"; {param.help}" if param.help else ""
        lines = sections.setdefault(section, [])
        if comment:
            lines.append(comment)
        lines.append(f"{key} = {value}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


def tls_server_options(service: str) -> Callable[[F], F]:
    """A server's TLS flags (`--broker.server-cert-file` ...) and the peer ones it dials other
    processes of its kind with (`--broker.peer-cert-file` ...), as upstream names them."""
    s = service
    specs = [
        (f"--{s}.server-cert-file", "Path to the server TLS certificate"),
        (f"--{s}.server-cert-key-file", "Path to the server TLS private key"),
        (f"--{s}.server-ca-file", "Path to the trusted CA for client verification of server certificates (when given, clients must present a certificate it signed)"),
        (f"--{s}.peer-cert-file", "Path to the client TLS certificate for peer-to-peer requests"),
        (f"--{s}.peer-cert-key-file", "Path to the client TLS private key for peer-to-peer requests"),
        (f"--{s}.peer-ca-file", "Path to the trusted CA for client verification of peer server certificates (default: the system's)"),
    ]  # fmt: skip

    def apply(f: F) -> F:
        for flag, text in reversed(specs):
            f = option(flag, default="", help=text, show_default=False)(f)
        return f

    return apply


def tls_client_options(service: str) -> Callable[[F], F]:
    """A client's TLS flags for `service` (`--broker.cert-file`, `--broker.cert-key-file`,
    `--broker.trusted-ca-file`) and, but for etcd, its authorization ones
    (`--broker.auth-keys`, `--broker.auth-token`), as upstream names them."""
    specs = [
        ("cert-file", "Path to the client TLS certificate"),
        ("cert-key-file", "Path to the client TLS private key"),
        ("trusted-ca-file", "Path to the trusted CA for client verification of server certificates (default: the system's)"),
    ]  # fmt: skip
    if service != "etcd":
        specs += [
            ("auth-keys", "Whitespace or comma separated, base64-encoded keys. The first key is used to sign Authorization tokens."),
            ("auth-token", f"A pre-shared Authorization token to send (instead of tokens signed with --{service}.auth-keys)"),
        ]  # fmt: skip

    def apply(f: F) -> F:
        for name, text in reversed(specs):
            f = option(f"--{service}.{name}", default="", help=text, show_default=False)(f)
        return f

    return apply


CREDENTIAL_NAMES = ("cert_file", "cert_key_file", "trusted_ca_file", "auth_keys", "auth_token")


def client_credentials(*services: str) -> Callable[[F], F]:
    """A command's client TLS (and authorization) flags for each of `services`, applied as the
    process's default credentials (plumbing.credentials) before the command runs, so every
    client it makes dials as they say; they are exported to the environment too, under
    upstream's variable names, for the processes it starts (Spark's workers). A bad file or key
    is one line naming its flag."""
    import functools

    def apply(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **opts: Any) -> Any:
            from plumbing import credentials
            from plumbing.auth import AuthConfigError
            from plumbing.tls import TLSConfigError

            for service in services:
                values = {
                    name: opts.pop(f"{service}_{name}", "") or "" for name in CREDENTIAL_NAMES
                }
                try:
                    creds = credentials.from_settings(
                        service,
                        cert_file=values["cert_file"],
                        key_file=values["cert_key_file"],
                        ca_file=values["trusted_ca_file"],
                        auth_keys=values["auth_keys"],
                        auth_token=values["auth_token"],
                    )
                except (TLSConfigError, AuthConfigError) as exc:
                    raise click.ClickException(str(exc)) from None
                credentials.set_default(service, creds)
                for name, value in values.items():
                    variable = f"{service}_{name}".upper()
                    if value:
                        os.environ[variable] = value
                    else:
                        os.environ.pop(variable, None)
            return f(*args, **opts)

        out: Any = wrapper
        for service in reversed(services):
            out = tls_client_options(service)(out)
        return out  # type: ignore[no-any-return]

    return apply


def logging_from_options(f: F) -> F:
    """Configure logging from the command's `--log.level` and `--log.format` before it runs
    (gazctl's commands: warnings of the client library, in the format asked for)."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, **opts: Any) -> Any:
        if "log_level" in opts and "log_format" in opts:
            setup_logging(opts["log_level"], opts["log_format"])
        return f(*args, **opts)

    return wrapper  # type: ignore[return-value]


def etcd_tls_options(f: F) -> F:
    """`--etcd.cert-file`, `--etcd.cert-key-file`, `--etcd.trusted-ca-file` (for https://)."""
    return tls_client_options("etcd")(f)


def http_options(service: str) -> Callable[[F], F]:
    """The HTTP port of a broker or consumer (`--broker.http-port`: metrics and, for brokers,
    the gateway), CORS origins, and upstream's `--debug.port` and `--debug.private`."""
    s = service

    def apply(f: F) -> F:
        f = option("--debug.private", is_flag=True, default=False, help="When true, don't serve diagnostics (/debug/metrics, /debug/ready) over the HTTP port")(f)  # fmt: skip
        f = option("--debug.port", default=None, type=click.IntRange(0, 65535), help="Port for diagnostics on loopback: /debug/metrics, /debug/ready and /debug/stacks (every thread's and task's stack); 0 picks a free one")(f)  # fmt: skip
        f = option(f"--{s}.allow-origin", default="", show_default=False, help="Origins to allow in CORS contexts, separated by commas (* for any)")(f)  # fmt: skip
        return option(f"--{s}.http-port", default=None, type=click.IntRange(0, 65535), help="Port for HTTP requests: /debug/metrics, /debug/ready" + (" and the journal gateway (GET, HEAD, PUT /JOURNAL)" if s == "broker" else "") + "; 0 picks a free one (default: no HTTP port)")(f)  # fmt: skip

    return apply


def http_config(opts: dict[str, Any], service: str) -> Any:
    from plumbing.http_config import HTTPConfig

    origins = tuple(
        o.strip() for o in (opts[f"{service}_allow_origin"] or "").split(",") if o.strip()
    )
    return HTTPConfig(
        port=opts[f"{service}_http_port"],
        debug_port=opts["debug_port"],
        private=bool(opts["debug_private"]),
        allow_origins=origins,
    )


LOG_LEVELS = ["trace", "debug", "info", "warn", "error", "fatal"]
LOG_FORMATS = ["json", "text", "color"]


def log_options(f: F) -> F:
    """`--log.level` and `--log.format`, as upstream's servers take them."""
    f = option("--log.format", default="text", type=click.Choice(LOG_FORMATS), help="Logging output format")(f)  # fmt: skip
    return option("--log.level", default="info", type=click.Choice(LOG_LEVELS), help="Logging level")(f)  # fmt: skip


def setup_logging(level: str, fmt: str) -> None:
    """Logging as `--log.level` and `--log.format` ask, on stderr (servers and consumers)."""
    from plumbing import logs

    logs.setup(level, fmt)
