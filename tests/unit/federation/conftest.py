"""Site keys made once per test session (key generation and certificates are the slow part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.sitekey import SiteKey


@pytest.fixture(scope="session")
def site_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteKey]:
    """Keys of sites A, B and C, and an impostor's key that also calls itself C ("C-fake")."""
    root: Path = tmp_path_factory.mktemp("sites")
    keys = {}
    for name, site in (("A", "A"), ("B", "B"), ("C", "C"), ("C-fake", "C")):
        (root / name).mkdir()
        keys[name] = generate_site_key(site, root / name)
    return keys
