"""Agents asking each other on a dashboard's behalf: signed with the cluster key, never with the
caller's credentials.

A dashboard on any agent shows the whole mesh: the agent asks the others for their own counts
(``meshstats``), a node's engine command (``enginecmd``) and the acting controller's status
(``fleet``). Those answers need an admin key where API keys are on. Passing the page's
``Authorization`` on would send an admin's bearer token to every address the registry lists,
and an address in the registry is only what some cluster-key holder signed. So an agent asks
with its own credential instead: one header,

    X-Fabric-Peer: 1 <key id hex> <unix ms> <nonce hex> <asking session id> <mac hex>

built as the data plane's forward header is (``dataplane.forward_auth``) under its own domain
string, so that neither header verifies as the other. The MAC binds the cluster key, the time,
a fresh nonce, the asking agent, the *target* agent's session id (the audience: a request
captured on its way to one agent is refused by every other), the method and the exact path with
its query. The target accepts it only within ``MAX_SKEW_S`` of its own clock and only once
(a bounded replay cache), and then only for the read-only paths in ``PEER_PATHS``: a valid
header opens nothing else. What it proves is "an agent holding the cluster key asked", which is
what the registry's entries themselves prove; a client's key never leaves the agent it was
sent to.

Pure: no I/O; the time is passed in.
"""

from __future__ import annotations

from fabricnode.dataplane.forward_auth import ForwardRejected, ForwardVerifier, sign_forward
from fabricnode.mesh.keyring import Keyring

HEADER = "x-fabric-peer"
DOMAIN = b"fabric/peer/v1"
MAX_SKEW_S = 30.0
REPLAY_CACHE = 4096  # headers remembered; a dashboard's fan-out is a few requests a second

# The read-only paths one agent asks another for, and the only ones a verified peer header
# opens where API keys are on (``access.refusal``).
STATS_PATH = "/fabric/v1/stats"  # with ?scope=self: that agent's own counts (``meshstats``)
SELF_ENGINE_PATH = "/fabric/v1/self/engine"  # its engine's command, redacted (``enginecmd``)
CONTROLLER_PATH = "/fabric/v1/controller"  # the controller's status (``fleet``)
PEER_PATHS = frozenset((STATS_PATH, SELF_ENGINE_PATH, CONTROLLER_PATH))

__all__ = ["PeerRejected", "PeerVerifier", "sign"]

PeerRejected = ForwardRejected


def sign(keyring: Keyring, *, sender: str, target: str, path: str, now: float) -> str:
    """The header value for one GET of ``path`` (with its query, exactly as sent) asked of the
    agent whose session id is ``target``."""
    value = sign_forward(
        keyring,
        sender=sender,
        target=target,
        method=b"GET",
        path=path.encode(),
        body=b"",
        now=now,
        domain=DOMAIN,
    )
    return value.decode("ascii")


class PeerVerifier:
    """Checks peer headers addressed to this agent (module docstring)."""

    def __init__(self, keyring: Keyring, own_session: str) -> None:
        self.own_session = own_session
        self._verifier = ForwardVerifier(
            keyring, max_skew_s=MAX_SKEW_S, replay_cache=REPLAY_CACHE, domain=DOMAIN
        )

    @property
    def rejected(self) -> int:
        return self._verifier.rejected

    def verify(self, value: bytes, *, method: str, target: bytes, now: float) -> str:
        """The asking agent's session id; ``PeerRejected`` saying why if the header is not one
        this agent accepts for ``method`` on ``target`` (the raw path and query)."""
        if method not in ("GET", "HEAD"):
            raise PeerRejected("a peer header is only for reading")
        return self._verifier.verify(
            value,
            own_session=self.own_session,
            method=b"GET",
            path=target,
            body=b"",
            now=now,
        )
