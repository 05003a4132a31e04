"""Certificates and keys for a loopback-only control plane, and the admin kubeconfig.

Every key is ECDSA P-256 (kubeadm's ``encryptionAlgorithm: ECDSA-P256``), not RSA-2048: with 1,000 agents each
opening a TLS connection and the kubelet minting each one a ServiceAccount token, RSA signatures (the serving
certificate's in every handshake, the token signer's) took about 8 % of the API server's CPU on the scale
benchmark (docs/scale.md); a P-256 signature costs a small fraction of that."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def admin_cert(self) -> Path:
        return self.directory / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.directory / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.directory / "sa.pub"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common: str, org: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if org:
        parts.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(parts)


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
            # digitalSignature only: an ECDSA key signs (ECDHE handshakes); it never enciphers a key.
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("kubernetes"),
                    x509.DNSName("kubernetes.default.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
                ]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def generate(directory: Path) -> Pki:
    """A CA, the apiserver's serving cert, an admin client cert (system:masters) and the SA key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    ca_key = _key()
    ca_name = _name("weightsync-local-ca")
    ca = _issue(ca_name, ca_key, ca_name, ca_key, ca=True)
    _write_key(pki.ca_key, ca_key)
    pki.ca_cert.write_bytes(_pem(ca))

    serving_key = _key()
    _write_key(pki.serving_key, serving_key)
    pki.serving_cert.write_bytes(_pem(_issue(_name("kube-apiserver"), serving_key, ca_name, ca_key, server=True)))

    admin_key = _key()
    _write_key(pki.admin_key, admin_key)
    pki.admin_cert.write_bytes(_pem(_issue(_name("weightsync-admin", "system:masters"), admin_key, ca_name, ca_key)))

    sa_key = _key()
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki


def client_certificate(pki: Pki, name: str, common_name: str, organization: str | None = None) -> tuple[Path, Path]:
    """A client certificate signed by the cluster's CA (e.g. a kubelet's: ``system:node:<node>`` in
    ``system:nodes``), written as ``<name>.crt`` and ``<name>.key`` next to the others; returns their paths."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key} is not an ECDSA key")
    ca_name = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()).subject
    key = _key()
    cert, key_path = pki.directory / f"{name}.crt", pki.directory / f"{name}.key"
    _write_key(key_path, key)
    cert.write_bytes(_pem(_issue(_name(common_name, organization), key, ca_name, ca_key)))
    return cert, key_path


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(
    pki: Pki,
    server: str,
    *,
    token: str | None = None,
    user: str = "admin",
    client: tuple[Path, Path] | None = None,
) -> str:
    """A kubeconfig for ``server``: the admin's client cert, another ``client`` (cert, key), or a bearer token
    (a ServiceAccount's)."""
    cert, key = client or (pki.admin_cert, pki.admin_key)
    credentials: dict[str, str] = (
        {"token": token} if token else {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}
    )
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "weightsync-local",
                "cluster": {"server": server, "certificate-authority-data": _b64(pki.ca_cert)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "weightsync-local", "context": {"cluster": "weightsync-local", "user": user}}],
        "current-context": "weightsync-local",
    }
    return yaml.safe_dump(config, sort_keys=False)
