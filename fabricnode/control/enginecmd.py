"""A node's engine command, for the dashboard's Node view (``GET /fabric/v1/nodes/{id}/engine``).

The command is not in the signed entry (entries are gossiped to every member and kept small,
and a command line can hold secrets): only the node's own agent knows it. So an agent answers
for itself from its engine (``/fabric/v1/self/engine``) and asks the node's agent for any other
(``peers``), always answering 200 with ``command`` null and the reason when it cannot tell, so
a page never logs an error for a node that left.

Secrets are hidden (``redact``: by the engines' own argument grammar, inside JSON values and
in URLs) by the agent that answers and again by the one that asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fabricnode.control.peerauth import SELF_ENGINE_PATH
from fabricnode.control.peers import PeerClient
from fabricnode.control.redact import redact

Json = dict[str, Any]


def own_engine(argv: Sequence[str] | None) -> Json:
    if argv is None:
        return {"command": None, "reason": "this node runs no engine"}
    return {"command": redact(argv), "reason": None}


async def node_engine(peers: PeerClient, session_id: str, http: str) -> Json:
    """What the node's agent (``session_id``, at ``http``) says of its engine."""
    if not http:
        return {"command": None, "reason": "the node has no HTTP address"}
    doc = await peers.get_json(http, session_id, SELF_ENGINE_PATH)
    if doc is None:
        return {"command": None, "reason": "the node's agent did not answer"}
    command = doc.get("command")
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        return {"command": None, "reason": str(doc.get("reason") or "the node did not say")[:200]}
    return {"command": redact(command), "reason": None}  # hidden here too, whatever it sent
