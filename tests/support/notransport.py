"""A gossip transport that sends nowhere and never receives: for a ``GossipService`` whose
mesh is beside the point (the engine supervision tests drive one agent's own entry)."""

from __future__ import annotations

import trio


class NoTransport:
    local_addr = "10.0.0.9:7946"

    async def send(self, addr: str, data: bytes, reliable: bool) -> None:
        pass

    async def receive(self) -> tuple[bytes, str | None, bool]:
        await trio.sleep_forever()
        raise AssertionError
