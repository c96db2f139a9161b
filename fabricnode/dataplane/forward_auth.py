"""Authenticating agent-to-agent forwards: an ingress proves it holds the cluster key.

An ingress that routes a request to another node's agent adds one header::

    X-Fabric-Forward: 1 <key id hex> <unix ms> <nonce hex> <ingress session id> <mac hex>

``mac = HMAC-SHA256(cluster key, "fabric/fwd/v1" | key id | ms | nonce | ingress | target
session id | method | path | SHA-256(body) [| "sites=" sites])``. The serving agent
recomputes it with the key of that id from its own keyring (so rotation works as it does for
gossip), checks the time is within ``max_skew_s`` and that the MAC was not seen before (a
bounded replay cache), and only then forwards to its engine. Binding the target session id
means a forward captured on the way to one node cannot be replayed to another; binding the
body means it cannot be reused for a different prompt. A forward limited to sites (data
residency, ``residency``) carries them in ``X-Fabric-Sites``, and the MAC covers that value
too (the last part, present only then, so a forward without it is the same as before
residency): a forward cannot be re-sent with its sites widened or dropped. A peer without the
cluster key cannot produce the header at all: anyone can still use a node's public ``/v1``
like any client, but only as an ingress that routes (and counts, and enforces API keys),
never straight into the engine.

The same construction, under another domain string (``domain=``), signs the read-only
requests agents make of each other on a dashboard's behalf (``control.peerauth``): a MAC made
for one purpose never verifies for the other.

Pure: no I/O, the time is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict

from fabricnode.mesh.keyring import Keyring

HEADER = b"x-fabric-forward"
DOMAIN = b"fabric/fwd/v1"
VERSION = b"1"


class ForwardRejected(Exception):
    """The forward header is missing a part, stale, replayed or does not verify."""


def _mac(
    domain: bytes,
    key: bytes,
    kid: bytes,
    ms: bytes,
    nonce: bytes,
    sender: bytes,
    target: bytes,
    method: bytes,
    path: bytes,
    body: bytes,
    sites: bytes | None = None,
) -> bytes:
    msg = b"|".join(
        (domain, kid, ms, nonce, sender, target, method, path, hashlib.sha256(body).digest())
    )
    if sites is not None:
        msg += b"|sites=" + sites
    return hmac.new(key, msg, hashlib.sha256).digest()


def sign_forward(
    keyring: Keyring,
    *,
    sender: str,
    target: str,
    method: bytes,
    path: bytes,
    body: bytes,
    now: float,
    domain: bytes = DOMAIN,
    sites: bytes | None = None,
) -> bytes:
    """The header value for one forward attempt (a fresh nonce every call); ``sites``: the
    ``X-Fabric-Sites`` value it goes with (None: the request has no such header)."""
    kid = keyring.primary
    key = keyring.keys[kid]
    kid_hex = kid.hex().encode()
    ms = b"%d" % int(now * 1000)
    nonce = os.urandom(8).hex().encode()
    sender_b = sender.encode()
    mac = _mac(
        domain, key, kid_hex, ms, nonce, sender_b, target.encode(), method, path, body, sites
    )
    return b" ".join((VERSION, kid_hex, ms, nonce, sender_b, mac.hex().encode()))


class ForwardVerifier:
    """Checks forward headers addressed to ``own_session`` (see the module docstring)."""

    def __init__(
        self,
        keyring: Keyring,
        *,
        max_skew_s: float = 30.0,
        replay_cache: int = 65536,
        domain: bytes = DOMAIN,
    ) -> None:
        self.keyring = keyring
        self.domain = domain
        self.max_skew_s = max_skew_s
        self.replay_cache = replay_cache
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self.rejected = 0

    def verify(
        self,
        value: bytes,
        *,
        own_session: str,
        method: bytes,
        path: bytes,
        body: bytes,
        now: float,
        sites: bytes | None = None,
    ) -> str:
        """The ingress session id that sent it; ``ForwardRejected`` with the reason if not valid.
        ``sites``: the request's ``X-Fabric-Sites`` value, None when it has none."""
        try:
            return self._verify(value, own_session, method, path, body, now, sites)
        except ForwardRejected:
            self.rejected += 1
            raise

    def _verify(
        self,
        value: bytes,
        own_session: str,
        method: bytes,
        path: bytes,
        body: bytes,
        now: float,
        sites: bytes | None,
    ) -> str:
        parts = value.split(b" ")
        if len(parts) != 6 or parts[0] != VERSION:
            raise ForwardRejected("malformed forward header")
        _, kid_hex, ms, nonce, sender, mac_hex = parts
        try:
            kid = bytes.fromhex(kid_hex.decode("ascii"))
            mac = bytes.fromhex(mac_hex.decode("ascii"))
            sent_at = int(ms) / 1000.0
            sender_id = sender.decode("ascii")
        except (ValueError, UnicodeDecodeError, OverflowError):
            # OverflowError: a time of hundreds of digits is an int no float can hold
            raise ForwardRejected("malformed forward header") from None
        key = self.keyring.keys.get(kid)
        if key is None:
            raise ForwardRejected("forward signed with a key not in this agent's keyring")
        if abs(now - sent_at) > self.max_skew_s:
            raise ForwardRejected("forward header too old or from the future")
        expected = _mac(
            self.domain,
            key,
            kid_hex,
            ms,
            nonce,
            sender,
            own_session.encode(),
            method,
            path,
            body,
            sites,
        )
        if not hmac.compare_digest(mac, expected):
            raise ForwardRejected("forward header does not verify")
        seen = self._seen
        if mac in seen:
            raise ForwardRejected("forward header replayed")
        seen[mac] = sent_at
        while len(seen) > self.replay_cache:
            seen.popitem(last=False)
        # Entries older than the skew window can never match again (the time check rejects
        # them first), so the cache only has to cover one window of traffic.
        while seen:
            oldest_mac, oldest_at = next(iter(seen.items()))
            if now - oldest_at <= self.max_skew_s:
                break
            del seen[oldest_mac]
        return sender_id
