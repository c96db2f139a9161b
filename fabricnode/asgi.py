"""Serving raw ASGI apps with hypercorn's trio worker: one place for the plumbing.

The agent's control surface and the simulated engine both bind their socket themselves (a busy
port is then one clear ``ConfigError``, and port 0 tells us the port the kernel picked) and hand
it to hypercorn through ``fd://``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from fabricnode.addr import join_hostport
from fabricnode.errors import ConfigError

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of request header ``name`` (lower case), decoded as latin-1."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def bind_http_socket(host: str, port: int, flag: str) -> socket.socket:
    """Bind (not listen) a TCP socket; ``flag`` names the option in the error message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = join_hostport(host, port)
        raise ConfigError(f"{flag}: cannot listen on {where}: {exc.strerror or exc}") from None
    return sock


async def serve_http(
    app: object,
    sock: socket.socket,
    shutdown: trio.Event,
    grace_s: float,
    done: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on a bound socket until ``shutdown`` is set (then in-flight requests get
    ``grace_s``); ``done`` is set when the server has stopped."""
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = grace_s
    config.include_server_header = False
    try:
        await hypercorn_serve(
            cast("ASGIFramework", app),
            config,
            shutdown_trigger=shutdown.wait,
            task_status=task_status,
        )
    finally:
        done.set()


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol for apps with nothing to set up or tear down."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
