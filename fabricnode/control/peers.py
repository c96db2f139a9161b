"""Asking other agents' read-only JSON APIs on behalf of a dashboard (``meshstats``, ``fleet``).

One pooled httpx client per agent, bounded (``CONCURRENCY`` connections), each answer given
``TIMEOUT_S`` and cut at ``MAX_ANSWER_BYTES``. Any failure (refused, slow, not 200, not JSON,
too large) is None: a peer that does not answer is left out of a view, never an error of it.
Nothing of the caller's request is passed on, its credentials least of all: each request
carries this agent's own signed ``X-Fabric-Peer`` header, bound to the agent asked
(``peerauth``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import httpx
import trio

from fabricnode.control import peerauth
from fabricnode.mesh.keyring import Keyring

CONCURRENCY = 16
TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 4 * 1024 * 1024

Json = dict[str, Any]


class PeerClient:
    """Asks other agents as this one (``own_session``, holding ``keyring``)."""

    def __init__(
        self,
        keyring: Keyring,
        own_session: str,
        timeout_s: float = TIMEOUT_S,
        wall_clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: httpx.MockTransport
    ) -> None:
        self.transport = transport
        self.keyring = keyring
        self.own_session = own_session
        self.timeout_s = timeout_s
        self.wall_clock = wall_clock
        self._client: httpx.AsyncClient | None = None

    async def get_json(
        self, base_url: str, target: str, path: str, params: dict[str, str] | None = None
    ) -> Json | None:
        """GET ``path`` (with ``params``) of the agent at ``base_url`` whose session id is
        ``target``; its JSON object, or None."""
        if self._client is None:
            limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=8)
            self._client = httpx.AsyncClient(
                timeout=self.timeout_s, limits=limits, transport=self.transport
            )
        # The query is encoded here, once, so that what is signed is what is sent.
        signed_path = f"{path}?{urlencode(params)}" if params else path
        headers = {
            peerauth.HEADER: peerauth.sign(
                self.keyring,
                sender=self.own_session,
                target=target,
                path=signed_path,
                now=self.wall_clock(),
            )
        }
        try:
            with trio.fail_after(self.timeout_s):
                async with self._client.stream(
                    "GET", base_url.rstrip("/") + signed_path, headers=headers
                ) as r:
                    if r.status_code != 200:
                        return None
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_ANSWER_BYTES:
                            return None
            doc = json.loads(body)
        except (httpx.HTTPError, trio.TooSlowError, ValueError, OSError):
            return None
        return doc if isinstance(doc, dict) else None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
