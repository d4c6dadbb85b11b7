"""`up --tls` and `up --auth`: the cluster's throwaway CA and certificates (`<dir>/tls`) and
token key (`<dir>/auth-key`), the flags that make a server use them, and the environment that
makes a client (gazctl, consumers, Spark, location processes) use them."""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from plumbing.tls import DevPKI, make_dev_pki, write_private


@dataclass(frozen=True)
class DevSecurity:
    """`up --tls`: a throwaway CA and certificates under <dir>/tls, every process serving TLS
    (client certificates required) and dialling its peers and etcd with them. `up --auth`: a
    random key in <dir>/auth-key that every process verifies tokens with, and clients sign with.
    Clients (gazctl, consumers, Spark, location processes) take them from the environment,
    under upstream's variable names."""

    pki: DevPKI | None = None
    auth_key: str = ""
    auth_key_file: Path | None = None  # <dir>/auth-key, which holds auth_key

    @staticmethod
    def make(root: Path, tls: bool, auth: bool) -> DevSecurity:
        pki = make_dev_pki(root / "tls") if tls else None
        key = ""
        if auth:
            path = root / "auth-key"
            if not path.exists():
                write_private(path, base64.b64encode(secrets.token_bytes(32)))
            key = path.read_text().strip()
            return DevSecurity(pki, key, path)
        return DevSecurity(pki, key)

    @property
    def scheme(self) -> str:
        return "https" if self.pki else "http"

    def server_flags(self, service: str) -> list[str]:
        return self.pki.server_flags(service) if self.pki is not None else []

    def location_flags(self) -> list[str]:
        """A location process's Location service: TLS and token checks as the brokers'."""
        flags: list[str] = []
        if self.pki is not None:
            p = self.pki
            flags += [
                "--replication.server-cert-file", str(p.server_cert),
                "--replication.server-cert-key-file", str(p.server_key),
                "--replication.server-ca-file", str(p.ca_cert),
            ]  # fmt: skip
        if self.auth_key:  # A file, not the key: a command line is anyone's to read (`ps`).
            flags += ["--replication.auth-keys-file", str(self.auth_key_file)]
        return flags

    def environment(self) -> dict[str, str]:
        """What a client of the cluster needs: BROKER_*, CONSUMER_* and ETCD_* files, and the
        key (a server takes $BROKER_AUTH_KEYS and $CONSUMER_AUTH_KEYS as its own)."""
        env: dict[str, str] = {}
        if self.pki is not None:
            for service in ("BROKER", "CONSUMER", "ETCD"):
                env[f"{service}_CERT_FILE"] = str(self.pki.client_cert)
                env[f"{service}_CERT_KEY_FILE"] = str(self.pki.client_key)
                env[f"{service}_TRUSTED_CA_FILE"] = str(self.pki.ca_cert)
        if self.auth_key:
            env["BROKER_AUTH_KEYS"] = env["CONSUMER_AUTH_KEYS"] = self.auth_key
        return env

    def apply(self) -> None:
        """Make this process, and every process it starts, a client of the cluster."""
        from plumbing import credentials

        os.environ.update(self.environment())
        credentials.reset_defaults()
