"""Calling the agent's ASGI control app inline, in the connection's own task.

Paths outside ``/v1/`` on the public port go to ``fabricnode.control.app.AdminApp`` through this
adapter rather than through hypercorn: one port, one HTTP parser, no second server. The app is
passed in by the agent, so the data plane never imports the control package. The Batch API
(``fabricnode.batch.api``) is answered the same way on ``/v1/files*`` and ``/v1/batches*``.

Responses: an answer the app sends in one body message (``more_body`` false: the control app's
pages and JSON, the Batch API's objects) goes out whole with its ``content-length``. An answer
in several messages (a Batch API file download) is streamed: each piece goes to the socket before
the app's ``send`` returns, so what is held is one piece, whatever the body's size. Its framing
is the app's ``content-length`` if it gave one, else chunked (HTTP/1.0: the body ends with the
connection). An app that stops before its last piece leaves the connection to be closed, so the
client sees a short body, never a complete-looking one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

import trio

from fabricnode.dataplane.clientconn import ClientConn, client_send
from fabricnode.dataplane.http1 import HOP_RESPONSE_HEADERS, Request, response_head

AsgiApp = Callable[[Mapping[str, Any], Any, Any], Awaitable[None]]
# What the ingress tells the control app in the scope (``control.access`` decides with it):
# whether it checks API keys (a bool), and the key the caller named (an ``ApiKey``, or None).
KEYS_SCOPE = "fabric.api_keys"
KEY_SCOPE = "fabric.api_key"
# What the ingress tells the Batch API (``batch.api``): the caller's API key id, "-" without keys.
OWNER_SCOPE = "fabric.owner"
DEFAULT_IDLE_S = 600.0  # a client that stops reading a streamed answer is cut after this


def asgi_scope(req: Request, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ASGI scope of ``req``; ``extra`` joins it (the Batch API learns its caller's key id
    so)."""
    raw_path, _, query = req.target.partition(b"?")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": req.http_version,
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
    return scope


class AsgiResponder:
    """The ``send`` of one ASGI call: writes the app's answer to the client (see the module
    docstring for whole and streamed answers)."""

    __slots__ = (
        "chunked",
        "conn",
        "declared",
        "done",
        "head_only",
        "headers",
        "http10",
        "idle_s",
        "sent",
        "started",
        "status",
    )

    def __init__(self, conn: ClientConn, req: Request, idle_s: float) -> None:
        self.conn = conn
        self.head_only = req.method == b"HEAD"
        self.http10 = req.http_version == "1.0"
        self.idle_s = idle_s
        self.status = 500  # what an app that never starts its answer gets
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = False  # our head went out
        self.done = False  # all of the answer went out
        self.chunked = False
        self.declared = -1  # the app's content-length of a streamed answer (-1: none given)
        self.sent = 0  # body bytes of a streamed answer sent so far

    async def send(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            return
        if kind != "http.response.body" or self.done:
            return
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        if not self.started:
            if not more:
                await self._whole(body)
                return
            await self._start_stream()
            if self.done:  # HEAD: the head is all
                return
        await self._piece(body)
        if not more:
            await self._end()

    async def finish(self) -> None:
        """The app returned: an answer it never sent is sent now (its status, no body); one it
        left unfinished ends with the connection."""
        if not self.started:
            await self._whole(b"")
        elif not self.done:
            self.conn.closing = True
            self.done = True

    def _kept(self) -> list[tuple[bytes, bytes]]:
        # The app's own headers go out (Allow on a 405, caching, content type), framing ours.
        return [(n, v) for n, v in self.headers if n.lower() not in HOP_RESPONSE_HEADERS]

    async def _whole(self, body: bytes) -> None:
        kept = self._kept()
        kept.append((b"content-length", b"%d" % len(body)))
        head = response_head(self.status, kept)
        self.started = True
        self.done = True
        await client_send(self.conn, head if self.head_only else head + body, self.idle_s)

    async def _start_stream(self) -> None:
        kept = self._kept()
        for name, value in self.headers:
            if name.lower() == b"content-length" and value.strip().isdigit():
                self.declared = int(value)
        if self.declared >= 0:
            kept.append((b"content-length", b"%d" % self.declared))
        elif self.head_only:
            pass  # no body follows: no framing to announce
        elif self.http10:
            self.conn.closing = True  # HTTP/1.0 has no chunks: the body ends with the connection
        else:
            self.chunked = True
            kept.append((b"transfer-encoding", b"chunked"))
        head = response_head(self.status, kept, keep_alive=not self.conn.closing)
        self.started = True
        if self.head_only:
            self.done = True
        await client_send(self.conn, head, self.idle_s)

    async def _piece(self, body: bytes) -> None:
        if not body:
            return
        if self.declared >= 0:
            room = self.declared - self.sent
            if len(body) > room:  # the app sent more than it said: the extra cannot go out
                body = body[:room]
                self.conn.closing = True
            if not body:
                return
        self.sent += len(body)
        if self.chunked:
            await client_send(self.conn, b"%x\r\n" % len(body) + body + b"\r\n", self.idle_s)
        else:
            await client_send(self.conn, body, self.idle_s)

    async def _end(self) -> None:
        self.done = True
        if self.chunked:
            await client_send(self.conn, b"0\r\n\r\n", self.idle_s)
        elif self.declared >= 0 and self.sent != self.declared:
            self.conn.closing = True  # short of what it said: the client must not wait for more
        elif self.declared < 0:
            self.conn.closing = True  # HTTP/1.0: the close ends the body


async def answer_asgi(
    conn: ClientConn,
    req: Request,
    app: AsgiApp,
    extra: Mapping[str, object] | None,
    idle_s: float = DEFAULT_IDLE_S,
) -> bool:
    """Answer ``req`` with an ASGI app (the control app, the Batch API) in this task."""
    scope = asgi_scope(req, extra)
    responder = AsgiResponder(conn, req, idle_s)
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if body_sent:
            await trio.sleep_forever()
        body_sent = True
        return {"type": "http.request", "body": req.body, "more_body": False}

    await app(scope, receive, responder.send)
    await responder.finish()
    return not conn.closing
