"""Site keys, their certificates and the peer sites an operator pins.

A **site key** is an Ed25519 key kept by a site's operator (``fabric keys site-new``, which
``keygen`` serves): the
private key in ``site.key`` (PKCS#8 PEM, mode 0600) and a self-signed X.509 certificate in
``site.pem`` beside it whose subject common name is the site's name. Its **fingerprint** is the
scheme of every other key of fabric (``mesh.identity.key_fingerprint``: the first 16 hex digits
of the SHA-256 of the raw 32-byte public key), so ``fabric keys site-show`` prints what an
operator compares on the phone.

The certificate serves twice: its key signs the site's summaries (``summary``), and the TLS
handshake of the federation port presents it (``link``). Trust is pinning, with no certificate
authority: a site federates with exactly the sites whose certificates its operator copied into
its **peer directory** (``--peer-sites DIR``, every ``*.pem`` file in it). Loading refuses, with
one line each: a file that is not a PEM certificate, a key that is not Ed25519, a site name
that is not a valid one, two certificates for one site name, and a peer certificate with our
own site name or our own key.

Reads files only (no sockets, no clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from fabricnode.errors import ConfigError, KeyFileError
from fabricnode.mesh.identity import key_fingerprint

KEY_FILE = "site.key"
CERT_FILE = "site.pem"
MAX_SITE_NAME = 64
MAX_PEER_SITES = 256
MAX_CERT_FILE_BYTES = 64 * 1024
_SITE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def site_name_problem(name: str) -> str:
    """What is wrong with ``name`` as a site's name (``""``: nothing): 1 to 64 letters, digits,
    dots, hyphens and underscores, starting with a letter or digit."""
    if not name or len(name) > MAX_SITE_NAME:
        return f"a site name has 1 to {MAX_SITE_NAME} characters"
    if not set(name) <= _SITE_CHARS or not name[0].isalnum():
        return "a site name is letters, digits, '.', '-' and '_', starting with a letter or digit"
    return ""


def check_site_name(name: str, what: str = "site") -> str:
    problem = site_name_problem(name)
    if problem:
        raise ConfigError(f"{what} {name[:80]!r}: {problem}")
    return name


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class SiteCert:
    """A site's certificate: its name, its raw Ed25519 public key and the PEM it came from."""

    site: str
    public_key: bytes
    pem: bytes
    origin: str = ""  # the file it was read from, for messages

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)

    @classmethod
    def from_pem(cls, pem: bytes, origin: str) -> SiteCert:
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            raise KeyFileError(f"{origin}: not a PEM certificate") from None
        return cls.from_x509(cert, origin)

    @classmethod
    def from_der(cls, der: bytes, origin: str) -> SiteCert:
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            raise KeyFileError(f"{origin}: not a certificate") from None
        return cls.from_x509(cert, origin)

    @classmethod
    def from_x509(cls, cert: x509.Certificate, origin: str) -> SiteCert:
        key = cert.public_key()
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFileError(f"{origin}: the certificate's key is not Ed25519")
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        site = names[0].value if len(names) == 1 else ""
        if not isinstance(site, str) or site_name_problem(site):
            raise KeyFileError(f"{origin}: the certificate's common name is not a site name")
        pem = cert.public_bytes(serialization.Encoding.PEM)
        return cls(site, raw_public(key), pem, origin)

    @classmethod
    def load(cls, path: Path) -> SiteCert:
        return cls.from_pem(_read(path, "certificate"), str(path))


@dataclass(frozen=True)
class SiteKey:
    """Our site's private key and its certificate (the files' paths: TLS loads them)."""

    private_key: Ed25519PrivateKey
    cert: SiteCert
    key_path: Path
    cert_path: Path

    @property
    def site(self) -> str:
        return self.cert.site

    @property
    def fingerprint(self) -> str:
        return self.cert.fingerprint

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    @staticmethod
    def cert_path_for(key_path: Path) -> Path:
        """The certificate beside a key file: ``site.key`` → ``site.pem``."""
        return key_path.with_suffix(".pem")

    @classmethod
    def load(cls, key_path: Path, cert_path: Path | None = None) -> SiteKey:
        cert_path = cert_path or cls.cert_path_for(key_path)
        raw = _read(key_path, "site key")
        try:
            private = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError):
            raise KeyFileError(f"{key_path}: not an unencrypted PEM private key") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(
                f"{key_path}: the key is not Ed25519 (make one: fabric keys site-new)"
            )
        cert = SiteCert.load(cert_path)
        if raw_public(private.public_key()) != cert.public_key:
            raise KeyFileError(f"{cert_path} is not the certificate of the key {key_path}")
        return cls(private, cert, key_path, cert_path)


@dataclass(frozen=True)
class PeerSites:
    """The pinned certificates of the sites we federate with, by site and by fingerprint."""

    by_site: dict[str, SiteCert]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_by_fingerprint", {c.fingerprint: c for c in self.by_site.values()}
        )

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(sorted(self.by_site))

    def get(self, site: str) -> SiteCert | None:
        return self.by_site.get(site)

    def by_fingerprint(self, fingerprint: str) -> SiteCert | None:
        found: dict[str, SiteCert] = getattr(self, "_by_fingerprint")  # noqa: B009
        return found.get(fingerprint)

    def ca_data(self) -> str:
        """Every pinned certificate as one PEM string: the TLS trust store."""
        return "".join(c.pem.decode() for c in sorted(self.by_site.values(), key=lambda c: c.site))

    @classmethod
    def of(cls, certs: list[SiteCert], own: SiteCert | None = None) -> PeerSites:
        by_site: dict[str, SiteCert] = {}
        keys: dict[bytes, SiteCert] = {}
        for cert in certs:
            if own is not None and cert.site == own.site:
                raise KeyFileError(
                    f"{cert.origin}: a peer certificate for our own site {own.site!r}"
                )
            if own is not None and cert.public_key == own.public_key:
                raise KeyFileError(f"{cert.origin}: a peer certificate of our own site key")
            if cert.site in by_site:
                raise KeyFileError(
                    f"two certificates for site {cert.site!r}: {by_site[cert.site].origin} and "
                    f"{cert.origin} (keep one)"
                )
            if cert.public_key in keys:
                raise KeyFileError(
                    f"{cert.origin} and {keys[cert.public_key].origin} hold one key for two sites"
                )
            by_site[cert.site] = cert
            keys[cert.public_key] = cert
        if len(by_site) > MAX_PEER_SITES:
            raise KeyFileError(f"more than {MAX_PEER_SITES} peer sites")
        return cls(by_site)

    @classmethod
    def load(cls, directory: Path, own: SiteCert | None = None) -> PeerSites:
        """Every ``*.pem`` in ``directory`` (sorted by name) as a pinned peer site."""
        try:
            files = sorted(p for p in directory.iterdir() if p.suffix == ".pem" and p.is_file())
        except OSError as exc:
            raise KeyFileError(
                f"cannot read the peer sites directory {directory}: {exc.strerror}"
            ) from None
        return cls.of([SiteCert.load(p) for p in files], own)


def _read(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CERT_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(raw) > MAX_CERT_FILE_BYTES:
        raise KeyFileError(f"{path}: larger than {MAX_CERT_FILE_BYTES} bytes")
    return raw
