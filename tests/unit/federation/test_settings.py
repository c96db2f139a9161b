"""The gateway's flags: checked once, with one line naming the flag at fault."""

from __future__ import annotations

import pytest

from fabricnode.config import GatewayFlags, load_config
from fabricnode.errors import ConfigError
from fabricnode.federation.settings import federation_config, parse_peer


def test_no_gateway_no_federation_and_no_stray_flags() -> None:
    assert federation_config(gateway=None, listen=None, site_key=None, peer_sites=None) is None
    with pytest.raises(ConfigError, match="--site-key makes sense only for a gateway"):
        federation_config(gateway=None, listen=None, site_key="k", peer_sites=None)


def test_gateway_flags_become_the_config_and_label_the_entry(tmp_path: object) -> None:
    config = load_config(
        gateway=GatewayFlags(
            "gw.a.example:7950", None, "/k/site.key", "/k/peers", ("C=gw.c:7950",)
        ),
        rendezvous="",
        env={"USER": "me"},
    )
    fed = config.federation
    assert fed is not None
    assert (fed.gateway, fed.listen_host, fed.listen_port) == ("gw.a.example:7950", "0.0.0.0", 7950)
    assert fed.peers == (("C", "gw.c:7950"),)
    assert ("fabric.gateway", "gw.a.example:7950") in config.labels


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gateway": "0.0.0.0:7950"}, "the address other sites reach"),
        ({"gateway": "gw:0"}, "the address other sites reach"),
        ({"gateway": "gw:7950", "site_key": None}, "needs --site-key"),
        ({"gateway": "gw:7950", "peer_sites": None}, "needs --peer-sites"),
    ],
)
def test_bad_gateway_flags_are_refused(kw: dict[str, str | None], message: str) -> None:
    args: dict[str, str | None] = {
        "gateway": None, "listen": None, "site_key": "k", "peer_sites": "d", **kw,
    }  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        federation_config(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["C", "C=", "=gw:1", "C=gw:0", "C=0.0.0.0:7950", "a b=gw:1"])
def test_bad_peers_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--federation-peer"):
        parse_peer(text)
