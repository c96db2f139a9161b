"""``FederationConfig``: what makes an agent a gateway of its site, checked once.

``fabricnode.config.load_config`` builds it from ``fabric start``'s flags (``--gateway``,
``--federation-listen``, ``--site-key``, ``--peer-sites``, ``--federation-peer``;
docs/federation.md) with ``federation_config``; ``link.Gateway`` runs it. Timings have their
units in their names and defaults that suit a WAN of 10-300 ms round trips.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fabricnode.addr import WILDCARD_HOSTS, join_hostport, split_hostport
from fabricnode.errors import ConfigError
from fabricnode.federation.sitekey import check_site_name

DEFAULT_FEDERATION_PORT = 7950


@dataclass(frozen=True)
class FederationConfig:
    gateway: str  # HOST:PORT other sites reach this gateway at (its federation port)
    listen_host: str
    listen_port: int
    site_key_path: Path  # site.key; its certificate is site.pem beside it
    peer_sites_dir: Path  # the pinned peer certificates (*.pem)
    peers: tuple[tuple[str, str], ...] = ()  # (site, HOST:PORT): where to dial first
    # Our site (the agent's --site): the gateway refuses a site key of another site; None (only
    # in tests that build the config by hand): the one the site key's certificate names.
    site: str | None = None
    summary_period_s: float = 1.0  # rebuild our summary this often; send it when it changed
    keepalive_s: float = 2.0  # and send a fresh one at least this often
    ping_interval_s: float = 1.0
    handshake_timeout_s: float = 10.0
    send_timeout_s: float = 10.0  # a peer that takes no bytes this long is dropped
    idle_timeout_s: float = 10.0  # a peer that sends nothing this long is dropped
    # A link to a site that cannot be reached is dialed again every few seconds (a SYN each),
    # so that the views agree within seconds of a heal: at most 15 s between dials, and a
    # connect left hanging for 5 s, left a gateway of a site cut for 60 s unaware of the heal
    # 10 s after it (the emulated WAN's acceptance test); one SYN every ~2 s is nothing.
    dial_timeout_s: float = 3.0
    backoff_min_s: float = 0.5
    backoff_max_s: float = 2.0
    max_connections: int = 64  # incoming links, at once
    # Cross-site requests (ALPN fabric-http/1): connections carrying them, at once, each way.
    max_http_connections: int = 256
    stale_floor_s: float = 5.0  # see view.ViewConfig
    rtt_factor: float = 4.0


def federation_config(
    *,
    gateway: str | None,
    listen: str | None,
    site_key: str | None,
    peer_sites: str | None,
    peers: Iterable[str] = (),
) -> FederationConfig | None:
    """The gateway's configuration from its flags; None when ``--gateway`` is not given (and
    then no other federation flag may be)."""
    given = [flag for flag, value in (
        ("--federation-listen", listen),
        ("--site-key", site_key),
        ("--peer-sites", peer_sites),
    ) if value]  # fmt: skip
    peer_list = list(peers)
    if peer_list:
        given.append("--federation-peer")
    if not gateway:
        if given:
            raise ConfigError(f"{given[0]} makes sense only for a gateway: add --gateway HOST:PORT")
        return None
    host, port = _addr("--gateway", gateway)
    if host in WILDCARD_HOSTS or not host or port == 0:
        raise ConfigError(
            f"--gateway {gateway!r}: the address other sites reach this gateway at (a host and "
            "a port; listen elsewhere with --federation-listen)"
        )
    if listen:
        listen_host, listen_port = _addr("--federation-listen", listen)
        listen_host = listen_host or "0.0.0.0"
    else:
        listen_host, listen_port = "0.0.0.0", port
    if not site_key:
        raise ConfigError("--gateway needs --site-key FILE (make one: fabric keys site-new)")
    if not peer_sites:
        raise ConfigError("--gateway needs --peer-sites DIR (the peer sites' certificates)")
    return FederationConfig(
        gateway=join_hostport(host, port),
        listen_host=listen_host,
        listen_port=listen_port,
        site_key_path=Path(site_key).expanduser(),
        peer_sites_dir=Path(peer_sites).expanduser(),
        peers=tuple(parse_peer(p) for p in peer_list),
    )


def parse_peer(text: str) -> tuple[str, str]:
    """``SITE=HOST:PORT`` of ``--federation-peer``."""
    site, sep, addr = text.partition("=")
    if not sep:
        raise ConfigError(f"--federation-peer {text!r}: expected SITE=HOST:PORT")
    check_site_name(site.strip(), "--federation-peer site")
    host, port = _addr("--federation-peer", addr.strip())
    if not host or host in WILDCARD_HOSTS or port == 0:
        raise ConfigError(f"--federation-peer {text!r}: needs a host and a non-zero port")
    return site.strip(), join_hostport(host, port)


def _addr(flag: str, text: str) -> tuple[str, int]:
    try:
        return split_hostport(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
