"""What the elastic controller is doing, from any agent (``GET /fabric/v1/fleet``, the
dashboard's Controller view).

``/fabric/v1/controller`` answers only on an agent that runs a controller. This finds the acting
one as the controllers themselves do (``elastic.observe.acting_controller``) and asks it
(``peers``), so a page on any agent shows it. The answer is 200 whether or not the mesh has a
controller: ``controller`` is then null, and the page says so.
"""

from __future__ import annotations

from typing import Any

from fabricnode.control.peerauth import CONTROLLER_PATH
from fabricnode.control.peers import PeerClient
from fabricnode.elastic.controller import Controller, summarise
from fabricnode.elastic.observe import acting_controller
from fabricnode.mesh.core import MeshCore

Json = dict[str, Any]


async def fleet_view(core: MeshCore, controller: Controller | None, peers: PeerClient) -> Json:
    current = core.services.current
    leader = acting_controller(core)
    status: Json | None = None
    if leader is not None:
        if controller is not None and leader.session_id == core.self_entry.session_id:
            status = dict(summarise(controller))
        elif leader.http:
            status = await peers.get_json(leader.http, leader.session_id, CONTROLLER_PATH)
    return {
        "services": None if current is None else current.describe(),
        "acting": None
        if leader is None
        else {"session_id": leader.session_id, "http": leader.http or None},
        "controller": status,
    }
