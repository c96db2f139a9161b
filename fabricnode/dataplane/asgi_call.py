"""Calling the agent's ASGI control app inline, in the connection's own task.

Paths outside ``/v1/`` on the public port go to ``fabricnode.control.app.AdminApp`` through this
adapter rather than through hypercorn: one port, one HTTP parser, no second server. The app is
passed in by the agent, so the data plane never imports the control package. The Batch API
(``fabricnode.batch.api``) is answered the same way on ``/v1/files*`` and ``/v1/batches*``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

import trio

from fabricnode.dataplane.clientconn import ClientConn
from fabricnode.dataplane.http1 import HOP_RESPONSE_HEADERS, Request, response_head

AsgiApp = Callable[[Mapping[str, Any], Any, Any], Awaitable[None]]
# What the ingress tells the control app in the scope (``control.access`` decides with it):
# whether it checks API keys (a bool), and the key the caller named (an ``ApiKey``, or None).
KEYS_SCOPE = "fabric.api_keys"
KEY_SCOPE = "fabric.api_key"
# What the ingress tells the Batch API (``batch.api``): the caller's API key id, "-" without keys.
OWNER_SCOPE = "fabric.owner"


async def call_asgi(
    app: AsgiApp, req: Request, extra: Mapping[str, Any] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Run one request through an ASGI app in this task (no hypercorn on the public port);
    ``extra`` joins the scope (the Batch API learns its caller's key id so)."""
    raw_path, _, query = req.target.partition(b"?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method.decode("latin-1"),
        "scheme": "http",
        "path": unquote_to_bytes(raw_path).decode("utf-8", "replace"),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": list(req.headers.items()),
        "server": None,
        "client": None,
    }
    if extra:
        scope.update(extra)
    body_sent = False
    status = 500
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if body_sent:
            await trio.sleep_forever()
        body_sent = True
        return {"type": "http.request", "body": req.body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


async def answer_asgi(
    conn: ClientConn, req: Request, app: AsgiApp, extra: Mapping[str, object] | None
) -> bool:
    """Answer ``req`` with an ASGI app (the control app, the Batch API) in this task."""
    status, headers, body = await call_asgi(app, req, extra)
    # The app's own headers go out (Allow on a 405, caching, content type), framing ours.
    kept = [(n, v) for n, v in headers if n.lower() not in HOP_RESPONSE_HEADERS]
    kept.append((b"content-length", b"%d" % len(body)))
    head = response_head(status, kept)
    await conn.reactor.send_all(conn.sock, head if req.method == b"HEAD" else head + body)
    return True
