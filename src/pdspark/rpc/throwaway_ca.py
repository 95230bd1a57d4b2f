"""`ThrowawayCA`: a certificate authority made for one run of `pdspark up --tls`, and the certificates it issues to
the services of that run, so that a local cluster runs on mutual TLS without an operator's PKI.

Every file lives in one directory the caller owns (private: `pdspark up` makes it 0700 and removes it on exit); keys
are written 0600. The CA's key never leaves memory: nothing can issue another certificate once the run is over.
A certificate names its service's role as a URI SAN (`urn:pdspark:role:<role>`), which the workers check against
the RPC called (`pdspark.rpc.peer_roles`); its DNS/IP SANs are the hosts it serves at, so peers verify it as they
would any server's. Certificates serve both ends of a connection (server and client auth): a decode worker is the
client of a prefill worker.

NOTE: `cryptography` is imported only here, and only when a CA is made: no service needs it to serve.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

ROLE_URI_PREFIX = "urn:pdspark:role:"
_VALIDITY = datetime.timedelta(days=7)  # a run; the files are gone when it ends anyway
_CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class IssuedCert:
    """Paths of one service's certificate and private key (PEM)."""

    cert: str
    key: str


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with its final mode: a key is never readable by others, not even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class ThrowawayCA:
    def __init__(self, directory: str | Path, name: str = "pdspark throwaway CA"):
        """Make the CA (an EC P-256 key in memory) and write its certificate to `<directory>/ca.pem`."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.directory = Path(directory)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._subject = subject
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = str(self.directory / "ca.pem")
        _write(Path(self.ca_path), self._pem(self._cert), 0o644)

    @staticmethod
    def _pem(cert) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, role: str | None, hosts: tuple[str, ...] = (), loopback: bool = True) -> IssuedCert:
        """A certificate for service `name` (its common name and file names) of `role` (None: naming no role),
        valid for `hosts` (IPs, DNS names, wildcards such as `*.pdspark-prefill.ns.svc`) and, with `loopback`, this
        machine's loopback names (127.0.0.1, ::1, localhost), for server and client authentication."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys((*hosts, *(("127.0.0.1", "::1", "localhost") if loopback else ()))):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        if role is not None:
            names.append(x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role))
        subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
        if role is not None:
            subject.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(self._subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        issued = IssuedCert(str(self.directory / f"{name}.pem"), str(self.directory / f"{name}.key"))
        _write(Path(issued.cert), self._pem(cert), 0o644)
        _write(Path(issued.key), key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), 0o600)
        return issued
