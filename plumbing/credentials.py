"""What a client dials with: TLS files and an authorizer, per service (`broker`, `consumer`).

Library calls take `credentials=`; when they are not given, the process's defaults apply: those a
command set from its flags (`set_default`), else upstream's environment variables
(`BROKER_CERT_FILE`, `BROKER_CERT_KEY_FILE`, `BROKER_TRUSTED_CA_FILE`, `BROKER_AUTH_KEYS`,
`BROKER_AUTH_TOKEN`, and `CONSUMER_*` likewise), so that an application, a consumer or a Spark
executor configured as upstream's are dials as they say with no code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from plumbing import auth
from plumbing.tls import ClientTLS, dial_target


@dataclass(frozen=True)
class Credentials:
    tls: ClientTLS = field(default_factory=ClientTLS)
    auth: auth.Authorizer = auth.NOOP_AUTH

    def open_channel(
        self, address: str, options: Sequence[tuple[str, Any]] = (), *, what: str = "broker address"
    ) -> grpc.aio.Channel:
        """A channel to `address`: TLS for `https://`, plaintext for `http://`, with this
        authorizer's tokens on every call; several addresses, separated by commas, for any of
        them that answers (see plumbing.tls.dial_target). AddressError for an address that is
        neither."""
        dial = dial_target(address, what=what)
        if dial.authority is not None:
            options = [*options, ("grpc.default_authority", dial.authority)]
        if dial.secure:
            creds = self.tls.channel_credentials
            channel = grpc.aio.secure_channel(dial.target, creds, options=options)
        else:
            channel = grpc.aio.insecure_channel(dial.target, options=options)
        return auth.authorized_channel(channel, self.auth)

    def explain(self, address: str, detail: str) -> str:
        """`detail` of a failure to reach `address`, with what it most likely means where gRPC
        says only that the socket closed: a plaintext client's connection closed by a server
        that speaks TLS, or a TLS handshake refused for want of an acceptable client
        certificate."""
        if "Socket closed" not in detail:
            return detail
        try:
            secure = dial_target(address).secure
        except ValueError:
            return detail
        cert_flag, key_flag, _ = self.tls.flags
        if not secure:
            why = "the server speaks TLS: use https://"
        elif not self.tls.cert_file:
            why = f"the server requires a client certificate: give {cert_flag} and {key_flag}"
        else:
            why = (
                f"the server refused the client certificate ({cert_flag}): it requires one "
                "signed by its CA"
            )
        return f"{why} (the server closed the connection: {detail})"


def from_settings(
    service: str,
    *,
    cert_file: str = "",
    key_file: str = "",
    ca_file: str = "",
    auth_keys: str = "",
    auth_token: str = "",
) -> Credentials:
    """Credentials from a service's flag values, each file checked (TLSConfigError or
    AuthConfigError name the flag that is wrong)."""
    flags = (f"--{service}.cert-file", f"--{service}.cert-key-file", f"--{service}.trusted-ca-file")
    if service == "etcd":
        auth_keys = auth_token = ""  # etcd's own authentication is not used.
    tls = ClientTLS(cert_file, key_file, ca_file, flags=flags)
    tls.check()
    return Credentials(tls, auth.authorizer_of(auth_keys, auth_token, f"--{service}.auth-keys"))


def from_environment(service: str) -> Credentials:
    env = service.upper()
    return from_settings(
        service,
        cert_file=os.environ.get(f"{env}_CERT_FILE", ""),
        key_file=os.environ.get(f"{env}_CERT_KEY_FILE", ""),
        ca_file=os.environ.get(f"{env}_TRUSTED_CA_FILE", ""),
        auth_keys=os.environ.get(f"{env}_AUTH_KEYS", ""),
        auth_token=os.environ.get(f"{env}_AUTH_TOKEN", ""),
    )


_defaults: dict[str, Credentials] = {}


def set_default(service: str, credentials: Credentials) -> None:
    _defaults[service] = credentials


def default(service: str = "broker") -> Credentials:
    found = _defaults.get(service)
    if found is None:
        found = _defaults[service] = from_environment(service)
    return found


def reset_defaults() -> None:
    """Forget the defaults (tests that change the environment)."""
    _defaults.clear()
