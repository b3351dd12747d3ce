"""Certificates made at run time for the TLS tests (no key is ever committed): a CA, and
leaf certificates it signs for 127.0.0.1 and localhost, usable as server and client."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CA:
    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.path = folder / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, dns_names: tuple[str, ...] | None = None) -> tuple[Path, Path]:
        """(certificate, key) files for `cn`, valid for 127.0.0.1 and localhost (or, given
        `dns_names`, for those names only)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        san = x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in dns_names] if dns_names is not None else
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                       ExtendedKeyUsageOID.CLIENT_AUTH])
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(san, False).add_extension(usage, False)
                .sign(self.key, hashes.SHA256()))
        cert_path = self.folder / f"{self.name}-{cn}.crt"
        key_path = self.folder / f"{self.name}-{cn}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return cert_path, key_path
