"""Making a site key: an Ed25519 key and its self-signed certificate (``fabric keys site-new``).

Apart from ``sitekey`` because a certificate's validity is dates (``datetime``), which the
pure modules that load keys (``summary``, ``view``) must not import.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fabricnode.federation.sitekey import CERT_FILE, KEY_FILE, SiteCert, SiteKey, check_site_name
from fabricnode.mesh.identity import write_private

CERT_VALIDITY_DAYS = 20 * 365  # pinned, not expiring: an operator replaces it by hand


def generate_site_key(site: str, directory: Path) -> SiteKey:
    """A new key and self-signed certificate for ``site``, written to ``directory``
    (``site.key``, mode 0600, and ``site.pem``)."""
    check_site_name(site)
    private = Ed25519PrivateKey.generate()
    cert_pem = self_signed_pem(private, site)
    key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
    key_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_private(key_path, key_pem)
    tmp = cert_path.with_name(f".{cert_path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(cert_pem)
    os.replace(tmp, cert_path)
    return SiteKey(private, SiteCert.from_pem(cert_pem, str(cert_path)), key_path, cert_path)


def self_signed_pem(private: Ed25519PrivateKey, site: str) -> bytes:
    """A self-signed certificate of ``private`` naming ``site`` (usable by TLS servers and
    clients both: the federation port is mutual)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, site)])
    public = private.public_key()
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(public)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(private, algorithm=None)  # Ed25519 signs without a separate hash
    )
    return cert.public_bytes(serialization.Encoding.PEM)
