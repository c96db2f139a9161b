"""Who may call which control path: the access rules of the agent's control app when it is
served through the data plane's public port with API keys on.

The ingress (``dataplane.ingress``) hands every path outside ``/v1`` to the control app in its
own task and says, in the ASGI scope, whether it checks API keys (``KEYS_SCOPE``) and which
key the caller named (``KEY_SCOPE``: the ``ApiKey``, or None for none or an unknown one), as it
passes the Batch API its caller's key id. The decision is made here:

* with keys on, the registry views, ``/metrics`` and the dashboard's data (every node, engine
  addresses) need an admin key: 401 ``invalid_api_key`` without a valid key, 403
  ``insufficient_permissions`` with a key that is not an admin's;
* open to anyone: the probes (``/health``, ``/ready``, ``/ping``, ``/version``), a posted
  assignment (it carries its operator's signature), and the dashboard's files (they hold no
  data: the page asks for a key and reads the guarded APIs with it);
* ``/ui/session`` (open) tells the dashboard what the key it sends may read, so that the page
  asks for a key before it reads anything instead of collecting 401s;
* another agent asking on its dashboard's behalf (a verified ``X-Fabric-Peer`` header:
  ``PEER_SCOPE``, set by the app, ``peerauth``) may GET the few read-only paths agents ask
  each other for (``peerauth.PEER_PATHS``) and nothing else; a peer header that does not
  verify (``PEER_REFUSED_SCOPE``) is refused with 403 and its reason, whatever key came with
  it. No client's key is ever needed between agents, so none is ever sent.

Served on its own port (``--admin``), the app sees no ``KEYS_SCOPE``: nothing is checked there
and ``/ui/session`` says so. Pure: decisions from the scope, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fabricnode.control.peerauth import PEER_PATHS
from fabricnode.dataplane.asgi_call import KEY_SCOPE, KEYS_SCOPE
from fabricnode.dataplane.keytable import ApiKey
from fabricnode.mesh.assignment import ASSIGNMENTS_PATH

__all__ = [
    "KEYS_SCOPE",
    "KEY_SCOPE",
    "PEER_REFUSED_SCOPE",
    "PEER_SCOPE",
    "is_open",
    "refusal",
    "ui_session",
]

PEER_SCOPE = "fabric.peer"  # the session id of the agent whose peer header verified
PEER_REFUSED_SCOPE = "fabric.peer_refused"  # why a peer header did not verify
PEER_RAW_PATHS = frozenset(p.encode() for p in PEER_PATHS)

OPEN_PATHS = (b"/health", b"/ready", b"/ping", b"/version")
UI_SESSION_PATH = "/ui/session"
ASSIGNMENTS_RAW_PATH = ASSIGNMENTS_PATH.encode()

MISSING_KEY = (
    401,
    "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)",
    "invalid_api_key",
)
BAD_PEER = "a request from another agent that does not verify: {}"
NOT_FOR_PEERS = (
    403,
    "a request from another agent may only read the paths agents ask each other for",
    "insufficient_permissions",
)
NOT_ADMIN = (
    403,
    "this API key may not read the agent's registry or metrics (an operator makes one that "
    "may: fabric keys api-new NAME --admin)",
    "insufficient_permissions",
)


def is_open(raw_path: bytes, method: str) -> bool:
    """Control paths anyone may call while API keys are on."""
    return (
        raw_path in OPEN_PATHS
        or (raw_path == ASSIGNMENTS_RAW_PATH and method == "POST")
        or raw_path == b"/"
        or raw_path == b"/favicon.ico"
        or raw_path == b"/ui"
        or raw_path.startswith(b"/ui/")
    )


def _key(scope: Mapping[str, Any]) -> ApiKey | None:
    key = scope.get(KEY_SCOPE)
    return key if isinstance(key, ApiKey) else None


def refusal(scope: Mapping[str, Any]) -> tuple[int, str, str] | None:
    """The error (status, message, code) a request gets before the app answers it, or None."""
    if scope.get(KEYS_SCOPE) is not True:
        return None
    raw_path = scope.get("raw_path")
    if not isinstance(raw_path, bytes):
        raw_path = str(scope.get("path", "")).encode()
    refused = scope.get(PEER_REFUSED_SCOPE)
    if refused is not None:
        return 403, BAD_PEER.format(refused), "invalid_peer_request"
    if is_open(raw_path, str(scope.get("method", "GET"))):
        return None
    if scope.get(PEER_SCOPE) is not None:
        return None if raw_path in PEER_RAW_PATHS else NOT_FOR_PEERS
    key = _key(scope)
    if key is None:
        return MISSING_KEY
    if not key.admin:
        return NOT_ADMIN
    return None


def ui_session(scope: Mapping[str, Any]) -> dict[str, Any]:
    """What the dashboard may read with the key it sent (``UI_SESSION_PATH``)."""
    if scope.get(KEYS_SCOPE) is not True:
        return {"keys_required": False, "key": None, "admin": True}
    key = _key(scope)
    return {
        "keys_required": True,
        "key": None if key is None else key.name,
        "admin": key is not None and key.admin,
    }
