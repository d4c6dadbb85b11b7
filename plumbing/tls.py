"""TLS as upstream configures it, from PEM files named by flags.

A server serves TLS when it is given a certificate and its key (`--broker.server-cert-file`,
`--broker.server-cert-key-file`); given a CA as well (`--broker.server-ca-file`), it requires a
client certificate that CA signed, and refuses connections without one. A client (`--broker.cert-file`,
`--broker.cert-key-file`, `--broker.trusted-ca-file`; `--broker.peer-*` for brokers dialling
each other) verifies servers against the trusted CA, or the system's roots when none is given,
and presents its certificate when given one. Whether a connection uses TLS is decided by the
address: `https://` is dialled with TLS, `http://` in plaintext; servers with TLS advertise
`https://` endpoints. Files are read and checked when a process starts, so a missing or
mismatched file is one line naming its flag, not a failure at the first connection.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """A TLS file that cannot be used: the message names the flag and what to do."""


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{flag} {path!r}: {exc.strerror or exc} (give a readable PEM file)") from None  # fmt: skip
    if b"-----BEGIN" not in data:
        raise TLSConfigError(f"{flag} {path!r}: not a PEM file (give a PEM-encoded file)")
    return data


def _check_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"{cert_flag} {cert!r} and {key_flag} {key!r}: the certificate and key do not load "
            f"together ({exc.reason or exc}); give a certificate and its own private key"
        ) from None


def _check_ca(path: str, flag: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{flag} {path!r}: not a CA certificate bundle ({exc.reason or exc})") from None  # fmt: skip


@dataclass(frozen=True)
class ServerTLS:
    """A server's TLS files; `prefix` names its flags (`--broker.server`, `--consumer.server`)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    prefix: str = "--broker.server"

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def check(self) -> None:
        p = self.prefix
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = (("cert-file", "cert-key-file") if self.cert_file else ("cert-key-file", "cert-file"))  # fmt: skip
            raise TLSConfigError(f"{p}-{given} is given without {p}-{missing}: give both, or neither")  # fmt: skip
        if self.ca_file and not self.cert_file:
            raise TLSConfigError(
                f"{p}-ca-file needs {p}-cert-file and {p}-cert-key-file (client certificates "
                "are verified only on a TLS server)"
            )
        if not self.enabled:
            return
        _read(self.cert_file, f"{p}-cert-file")
        _read(self.key_file, f"{p}-cert-key-file")
        _check_pair(self.cert_file, self.key_file, f"{p}-cert-file", f"{p}-cert-key-file")
        if self.ca_file:
            _read(self.ca_file, f"{p}-ca-file")
            _check_ca(self.ca_file, f"{p}-ca-file")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=ca is not None
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same settings for the HTTP port (metrics, the gateway)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.set_alpn_protocols(["http/1.1"])
        if self.ca_file:
            context.load_verify_locations(cafile=self.ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS files; `flags` names them (cert, key, CA) for error messages."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    flags: tuple[str, str, str] = (
        "--broker.cert-file",
        "--broker.cert-key-file",
        "--broker.trusted-ca-file",
    )

    def check(self) -> None:
        cert_flag, key_flag, ca_flag = self.flags
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = (cert_flag, key_flag) if self.cert_file else (key_flag, cert_flag)
            raise TLSConfigError(f"{given} is given without {missing}: give both, or neither")
        if self.cert_file:
            _read(self.cert_file, cert_flag)
            _read(self.key_file, key_flag)
            _check_pair(self.cert_file, self.key_file, cert_flag, key_flag)
        if self.ca_file:
            _read(self.ca_file, ca_flag)
            _check_ca(self.ca_file, ca_flag)

    @functools.cached_property
    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC's credentials of these files (read once)."""
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        key = Path(self.key_file).read_bytes() if self.key_file else None
        cert = Path(self.cert_file).read_bytes() if self.cert_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


class AddressError(ValueError):
    """An address that is not `http://HOST:PORT` or `https://HOST:PORT`."""


def split_address(address: str, *, what: str = "broker address") -> tuple[str, bool]:
    """`http(s)://host:port` (or a bare `host:port`) as a gRPC target `host:port` and whether
    it is dialled with TLS."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:  # A port that is not a number, or out of range.
        port = 0
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port:
        raise AddressError(f"{what} {address!r}: expected http://HOST:PORT or https://HOST:PORT")
    host = parsed.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}", parsed.scheme == "https"


@dataclass(frozen=True)
class DialTarget:
    """Where a client dials: a gRPC `target`, whether with TLS, and the `authority` its TLS
    checks the server's certificate against (None: the target's own host)."""

    target: str
    secure: bool
    authority: str | None = None


def dial_target(address: str, *, what: str = "broker address") -> DialTarget:
    """One address (`http(s)://host:port`), or several separated by commas: any of them
    answers, each tried in turn while the others are down (gRPC's pick_first over the list),
    as a client of consumers, or of brokers, reaches whichever process is alive. Several
    must share a scheme and be IP addresses (a name is resolved to its own list by DNS)."""
    parts = [part.strip() for part in address.split(",")]
    if len(parts) == 1:
        target, secure = split_address(address, what=what)
        return DialTarget(target, secure)
    split = [split_address(part, what=what) for part in parts if part]
    if len({secure for _, secure in split}) > 1:
        raise AddressError(f"{what} {address!r}: mixes http:// and https:// addresses")
    families = set()
    for target, _ in split:
        host = target.rsplit(":", 1)[0].strip("[]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise AddressError(
                f"{what} {address!r}: a list of addresses takes IP addresses, and {host} is a "
                "name: give one address per name"
            ) from None
    if len(families) > 1:
        raise AddressError(f"{what} {address!r}: mixes IPv4 and IPv6 addresses")
    scheme = "ipv4" if families == {4} else "ipv6"
    targets = [target for target, _ in split]
    return DialTarget(f"{scheme}:{','.join(targets)}", split[0][1], authority=targets[0])


# ---- throwaway certificates (gazctl dev up --tls, tests) ---------------------------------------


@dataclass(frozen=True)
class DevPKI:
    """Paths of a throwaway CA, a server certificate (for every process of a local cluster)
    and a client certificate, all signed by the CA."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_flags(self, service: str) -> list[str]:
        """A server's TLS flags on these files (`--broker.server-*` and `--broker.peer-*`, or a
        consumer's): client certificates required, peers dialled with the server's own."""
        s = service
        return [
            f"--{s}.server-cert-file", str(self.server_cert),
            f"--{s}.server-cert-key-file", str(self.server_key),
            f"--{s}.server-ca-file", str(self.ca_cert),
            f"--{s}.peer-cert-file", str(self.server_cert),
            f"--{s}.peer-cert-key-file", str(self.server_key),
            f"--{s}.peer-ca-file", str(self.ca_cert),
        ]  # fmt: skip

    def client_tls(self) -> ClientTLS:
        """A client's settings: the client certificate, and the CA to verify servers with."""
        return ClientTLS(str(self.client_cert), str(self.client_key), str(self.ca_cert))


def write_private(path: Path, data: bytes) -> None:
    """Write a secret (a private key, an auth key) readable by its owner alone from the start:
    created 0600 under a temporary name (never wider, whatever the umask), then renamed over
    `path`, so that no reader sees it half-written or with wider permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_dev_pki(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), *, ca_name: str = "gazette-py dev CA") -> DevPKI:  # fmt: skip
    """Write a CA and certificates for `hosts` into `directory` (kept if already there)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    pki = DevPKI(*(directory / n for n in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key")))  # fmt: skip
    if all(p.exists() for p in (pki.ca_cert, pki.server_cert, pki.client_cert)):
        return pki
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365))

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        write_private(
            path,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_key(pki.ca_key, ca_key)
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(
        name: str, usages: list[x509.ObjectIdentifier], cert_path: Path, key_path: Path
    ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(validity[0])
            .not_valid_after(validity[1])
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    # Servers dial their peers with their own certificate: it serves both ends.
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    leaf("gazette-py server", both, pki.server_cert, pki.server_key)
    leaf("gazette-py client", [ExtendedKeyUsageOID.CLIENT_AUTH], pki.client_cert, pki.client_key)
    return pki
