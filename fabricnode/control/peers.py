"""Asking other agents' read-only JSON APIs on behalf of a dashboard (``meshstats``, ``fleet``).

One pooled httpx client per agent, bounded (``CONCURRENCY`` connections), each answer given
``TIMEOUT_S`` and cut at ``MAX_ANSWER_BYTES``. Any failure (refused, slow, not 200, not JSON,
too large) is None: a peer that does not answer is left out of a view, never an error of it.
The caller's ``Authorization`` header is passed on, nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

CONCURRENCY = 16
TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 4 * 1024 * 1024

Json = dict[str, Any]


class PeerClient:
    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def get_json(
        self,
        base_url: str,
        path: str,
        params: dict[str, str] | None = None,
        authorization: str | None = None,
    ) -> Json | None:
        if self._client is None:
            limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=8)
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
        headers = {"authorization": authorization} if authorization else {}
        try:
            with trio.fail_after(self.timeout_s):
                async with self._client.stream(
                    "GET", base_url.rstrip("/") + path, params=params, headers=headers
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
