"""Test certificates: one CA and leaf certificates whose subjectAltName carries kvmesh
identities (``kvmesh://ROLE/ID``, ``kvmesh://client``; docs/net.md, "The handshake")."""

from __future__ import annotations

import datetime
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class TestCA:
    """A CA in ``directory``; :meth:`issue` writes a leaf and returns (cert, key) paths."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name("kvmesh test CA"))
            .issuer_name(_name("kvmesh test CA"))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = _write(
            os.path.join(directory, "ca.pem"), self.cert.public_bytes(serialization.Encoding.PEM)
        )

    def issue(self, name: str, *uris: str) -> tuple[str, str]:
        """A leaf named ``name`` whose subjectAltName holds ``uris`` (and DNS localhost)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName("localhost")]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        c = _write(
            os.path.join(self.dir, f"{name}.pem"), cert.public_bytes(serialization.Encoding.PEM)
        )
        k = _write(
            os.path.join(self.dir, f"{name}.key"),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        return c, k
