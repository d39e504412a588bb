"""Optional TLS for the gRPC traffic between peers: credentials from PEM files, and a small private CA.

A run over the internet should encrypt its exchanges: weights are the whole value of the run. Configure a node
with its certificate and key (``tls_cert``, ``tls_key``) and the run's CA (``tls_ca``): the server then requires
client certificates signed by that CA (mutual TLS), calls go out over TLS verifying the peer against the same CA,
and a plaintext peer can neither call the node nor be called by it. Peers are dialled by IP address, so the
certificate names one shared server name (``tls_server_name``, default ``noloco-node``) that every node's
certificate carries and every caller checks, instead of each peer's changing address.

``noloco-node tls init`` writes a CA and node certificates with :func:`write_ca` and :func:`write_node_cert`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from noloco_node.errors import NolocoError

DEFAULT_SERVER_NAME = "noloco-node"


class TlsError(NolocoError):
    """TLS is configured but its files cannot be used."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path | None = None
    server_name: str = DEFAULT_SERVER_NAME

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes() if self.ca else None
        except OSError as error:
            raise TlsError(f"cannot read TLS file {error.filename}: {error.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_ca(directory: Path, *, days: int = 3650) -> tuple[Path, Path]:
    """A new CA for one run: ``ca.pem`` (give it to every node) and ``ca.key`` (keep it off the nodes)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "noloco-node run CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca_pem, ca_key = directory / "ca.pem", directory / "ca.key"
    ca_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(ca_key, _pem_key(key))
    return ca_pem, ca_key


def write_node_cert(
    directory: Path,
    name: str,
    *,
    ca_dir: Path,
    server_name: str = DEFAULT_SERVER_NAME,
    hosts: tuple[str, ...] = (),
    days: int = 825,
) -> tuple[Path, Path]:
    """``<name>.pem`` and ``<name>.key`` signed by the CA in ``ca_dir``, valid as server and client, for
    ``server_name`` and any extra host names or IP addresses."""
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(server_name)]
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, _pem_key(key))
    return cert_path, key_path
