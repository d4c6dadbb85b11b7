"""What each process of a dev cluster runs: a broker's command line, a consumer's (an example
`--app` or module:Name, checked to import before anything starts), and the names `--locations`
gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from gazctl.dev.security import DevSecurity

ETCD_PREFIX = "/gazette/cluster"


def broker_command(
    i: int,
    port: int,
    etcd: str,
    file_root: Path,
    prefix: str = ETCD_PREFIX,
    name: str = "",
    security: DevSecurity = DevSecurity(),
) -> list[str]:
    return [
        sys.executable, "-m", "broker.main", "serve", *security.server_flags("broker"),
        "--broker.zone", "local",
        "--broker.id", name or f"broker-{i}",
        "--broker.host", "127.0.0.1",
        "--broker.port", str(port),
        "--broker.file-root", str(file_root),
        "--etcd.address", etcd,
        "--etcd.prefix", prefix,
        "--etcd.lease", "10s",
        "--broker.drain-timeout", "5s",
        # A dev cluster's stores are local directories: they take a fragment in milliseconds
        # or not at all (a directory gone), so `dev down` does not wait half a minute a broker
        # on one that does not.
        "--broker.exit-flush-timeout", "5s",
    ]  # fmt: skip


LOCATION_STORE = "file:///replication/"


def location_names(text: str) -> list[str]:
    """`--locations`: a count (3: A, B, C) or names separated by commas."""
    from replication.registry import check_name

    if text.isdigit():
        count = int(text)
        if not 1 <= count <= 26:
            raise click.BadParameter(f"{count}: give 1 to 26 locations", param_hint="--locations")
        return [chr(ord("A") + i) for i in range(count)]
    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        for name in names:
            check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--locations") from None
    if not names or len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r}: give distinct names, e.g. east,west", param_hint="--locations")  # fmt: skip
    return names


# The examples `--app` takes by short name: their module, and the flags of their stores.
EXAMPLES = {
    "word-count": "consumer.examples.word_count",
    "stream-sum": "consumer.examples.stream_sum",
}


def app_name(app: str) -> str:
    """The application's name, which names its etcd prefix (/gazette/consumers/NAME)."""
    if app in EXAMPLES:
        return app
    return app.partition(":")[2].lower() or app


# The extra of gazette-py that brings each optional module an application or store imports.
EXTRAS = {
    "apsw": "sqlite",
    "asyncpg": "sql",
    "pyspark": "spark",
    "pyarrow": "spark",
    "pandas": "spark",
    "boto3": "s3",
    "google": "gcs",
}


# Run as the consumers will be (this interpreter, this folder on sys.path): import each module
# named, then check that the application's factory exists. Prints one line on failure.
_IMPORT_PROBE = """
import importlib, sys
module, attr, *others = sys.argv[1:]
for name in (module, *others):
    try:
        loaded = importlib.import_module(name)
    except ImportError as exc:
        print(f"{name}\t{exc.name or ''}\t{exc}")
        sys.exit(3)
    except Exception as exc:
        print(f"{name}\t\t{type(exc).__name__}: {exc}")
        sys.exit(3)
    if name == module and attr and not callable(getattr(loaded, attr, None)):
        print(f"{name}\t\thas no class or factory {attr}")
        sys.exit(3)
"""


def check_app(app: str, postgres: bool = False) -> None:
    """An --app that names an example, or module:Name, whose module (and, with --postgres, the
    SQL store's driver) imports as the consumers will import it; else one line naming the extra
    to install, before anything starts (a consumer that cannot import fails only after etcd and
    the brokers started)."""
    if app in EXAMPLES:
        module, name = EXAMPLES[app], ""
    else:
        module, _, name = app.partition(":")
        if not module or not name:
            raise click.BadParameter(
                f"{app!r} is neither an example ({', '.join(EXAMPLES)}) nor module:Name",
                param_hint="--app",
            )
    probe = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, module, name, *(["asyncpg"] if postgres else [])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode == 0:
        return
    failed, missing, reason = [*probe.stdout.strip().split("\t", 2), "", "", ""][:3]
    if not failed:  # The probe itself failed: say what it printed, on one line.
        reason = " ".join(probe.stderr.split()[-12:]) or f"exit status {probe.returncode}"
        failed = module
    if missing and (module == missing or module.startswith(f"{missing}.")):  # The app's own.
        raise click.BadParameter(f"{app!r}: no module {missing} to import", param_hint="--app")
    extra = EXTRAS.get(missing.partition(".")[0])
    advice = f": pip install 'gazette-py[{extra}]'" if extra else ""
    raise click.ClickException(
        f"--app {app}: the consumers cannot import {failed} ({reason}){advice}"
    )


def consumer_command(
    app: str,
    i: int,
    port: int,
    etcd: str,
    broker: str,
    stores: Path,
    postgres: str | None,
    security: DevSecurity = DevSecurity(),
) -> list[str]:
    if app in EXAMPLES:
        cmd = [sys.executable, "-m", EXAMPLES[app], "serve"]
        if app == "word-count":
            cmd += ["--wordcount.postgres", postgres] if postgres else []
            cmd += [] if postgres else ["--wordcount.store-root", str(stores)]
        else:
            cmd += ["--summer.store-root", str(stores)]
    else:
        cmd = [sys.executable, "-m", "consumer", "serve", "--app", app]
    return [
        *cmd,
        "--consumer.zone", "local",
        "--consumer.id", f"consumer-{i}",
        "--consumer.port", str(port),
        "--consumer.host", "127.0.0.1",
        "--broker.address", broker,
        "--etcd.address", etcd,
        "--etcd.prefix", f"/gazette/consumers/{app_name(app)}",
        "--etcd.lease", "10s",
        "--consumer.drain-timeout", "5s",
        *security.server_flags("consumer"),
    ]  # fmt: skip
