"""Site keys and certificates: made, shown, pinned; every bad configuration refused clearly."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fabricnode.errors import ConfigError, KeyFileError
from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.sitekey import (
    CERT_FILE,
    KEY_FILE,
    PeerSites,
    SiteCert,
    SiteKey,
    check_site_name,
)
from fabricnode.mesh.identity import key_fingerprint


def test_new_site_key_writes_a_private_key_and_a_certificate_naming_the_site(
    tmp_path: Path,
) -> None:
    key = generate_site_key("site-a", tmp_path)
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    loaded = SiteKey.load(tmp_path / KEY_FILE)
    assert loaded.site == "site-a"
    assert loaded.fingerprint == key.fingerprint == key_fingerprint(key.cert.public_key)
    assert SiteCert.load(tmp_path / CERT_FILE).fingerprint == key.fingerprint


def test_a_key_whose_certificate_is_another_keys_is_refused(
    tmp_path: Path, site_keys: dict[str, SiteKey]
) -> None:
    with pytest.raises(KeyFileError, match="not the certificate of the key"):
        SiteKey.load(site_keys["A"].key_path, site_keys["B"].cert_path)


def test_a_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "site.key").write_bytes(pem)
    with pytest.raises(KeyFileError, match="not Ed25519"):
        SiteKey.load(tmp_path / "site.key")


def test_bad_pem_is_refused(tmp_path: Path) -> None:
    (tmp_path / "peer.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnope\n")
    with pytest.raises(KeyFileError, match="not a PEM certificate"):
        PeerSites.load(tmp_path)


def test_two_certificates_for_one_site_are_refused(
    tmp_path: Path, site_keys: dict[str, SiteKey]
) -> None:
    (tmp_path / "c1.pem").write_bytes(site_keys["C"].cert.pem)
    (tmp_path / "c2.pem").write_bytes(site_keys["C-fake"].cert.pem)
    with pytest.raises(KeyFileError, match="two certificates for site 'C'"):
        PeerSites.load(tmp_path)


def test_a_peer_certificate_with_our_own_site_name_is_refused(
    tmp_path: Path, site_keys: dict[str, SiteKey]
) -> None:
    (tmp_path / "c.pem").write_bytes(site_keys["C-fake"].cert.pem)
    with pytest.raises(KeyFileError, match="our own site"):
        PeerSites.load(tmp_path, own=site_keys["C"].cert)


def test_peer_directory_pins_each_site_by_name_and_fingerprint(
    tmp_path: Path, site_keys: dict[str, SiteKey]
) -> None:
    for name in ("B", "C"):
        (tmp_path / f"{name}.pem").write_bytes(site_keys[name].cert.pem)
    (tmp_path / "README").write_text("not a certificate: ignored")
    peers = PeerSites.load(tmp_path, own=site_keys["A"].cert)
    assert peers.sites == ("B", "C")
    c = site_keys["C"]
    assert peers.by_fingerprint(c.fingerprint) == peers.get("C")
    assert peers.by_fingerprint(site_keys["C-fake"].fingerprint) is None
    assert "BEGIN CERTIFICATE" in peers.ca_data()


def test_a_missing_peer_directory_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read the peer sites directory"):
        PeerSites.load(tmp_path / "nope")


@pytest.mark.parametrize("name", ["", "-a", "a b", "a/b", "x" * 65, "é"])
def test_bad_site_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        check_site_name(name)
