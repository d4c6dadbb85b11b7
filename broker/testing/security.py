"""TLS and authorization for brokers started by tests and benchmarks: throwaway certificates
(client certificates required) and/or a key the brokers verify tokens with and clients sign with."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plumbing.auth import NOOP_AUTH, KeyedAuth
from plumbing.credentials import Credentials
from plumbing.tls import ClientTLS, DevPKI, make_dev_pki


@dataclass(frozen=True)
class Security:
    pki: DevPKI | None = None
    key: bytes = b""

    @staticmethod
    def make(
        directory: Path, *, tls: bool, auth: bool, hosts: Sequence[str] = ("localhost", "127.0.0.1")
    ) -> Security:
        """Certificates for `hosts` under `directory` (with `tls`), and a random key (`auth`)."""
        pki = make_dev_pki(directory / "pki", tuple(hosts)) if tls else None
        return Security(pki, secrets.token_bytes(32) if auth else b"")

    def broker_flags(self) -> list[str]:
        flags: list[str] = []
        if self.pki is not None:
            flags += self.pki.server_flags("broker")
        if self.key:
            flags += ["--broker.auth-keys", base64.b64encode(self.key).decode()]
        return flags

    def credentials(self) -> Credentials:
        """What a client of such brokers dials with."""
        tls = self.pki.client_tls() if self.pki is not None else ClientTLS()
        return Credentials(tls, KeyedAuth([self.key]) if self.key else NOOP_AUTH)
