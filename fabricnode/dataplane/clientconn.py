"""A client connection of the ``/v1`` data plane and how a response is sent on it.

A response piece is sent at once when the socket takes it (most do: no coroutine is created);
only the rest waits, with the stream's idle deadline, so a client that stops reading cannot
hold the connection and its upstream for ever (``send_rest``). An error answer goes out whole
(``send_error``), in the dialect of the request's path.
"""

from __future__ import annotations

import math
import socket

import trio

from fabricnode.dataplane.http1 import full_response
from fabricnode.dataplane.request import error_body_for
from fabricnode.dataplane.sockio import Reactor, SocketClosed, Watched, try_send


class ClientGone(Exception):
    """The client went away while we were answering it."""


class ClientConn:
    """One client connection."""

    __slots__ = ("closing", "reactor", "sock", "watch")

    def __init__(self, sock: socket.socket, watch: Watched, reactor: Reactor) -> None:
        self.sock = sock
        self.watch = watch
        self.reactor = reactor  # the one its socket is registered with
        self.closing = False


def send_now(conn: ClientConn, data: bytes) -> int:
    """Send what fits at once (most responses do: no coroutine); ``ClientGone`` if gone."""
    try:
        return try_send(conn.sock, data)
    except SocketClosed:
        raise ClientGone from None


async def send_rest(conn: ClientConn, data: bytes, sent: int, idle_s: float) -> None:
    """Send ``data[sent:]``; ``ClientGone`` if the client is gone or stopped reading.

    A client that stops reading must not hold the connection (and the upstream) for ever: when
    its socket buffer is full, it gets ``idle_s`` to take the rest of the piece (the same idle
    deadline as the upstream's). A send that goes through at once needs no deadline.
    """
    watch = conn.watch
    watch.deadline = trio.current_time() + idle_s
    try:
        await conn.reactor.send_all(conn.sock, memoryview(data)[sent:])
    except SocketClosed:
        raise ClientGone from None
    watch.deadline = math.inf


async def client_send(conn: ClientConn, data: bytes, idle_s: float) -> None:
    """Send a piece of a response (see ``send_rest``)."""
    sent = send_now(conn, data)
    if sent < len(data):
        await send_rest(conn, data, sent, idle_s)


async def send_error(
    conn: ClientConn,
    status: int,
    message: str,
    code: str,
    *,
    close: bool = False,
    extra: list[tuple[bytes, bytes]] | None = None,
    head_only: bool = False,
    path: bytes = b"",
) -> None:
    """An error answer, in the dialect of the request's ``path`` (``error_body_for``)."""
    await conn.reactor.send_all(
        conn.sock,
        full_response(
            status,
            error_body_for(path, status, message, code),
            extra=extra,
            keep_alive=not close,
            head_only=head_only,
        ),
    )


async def linger(conn: ClientConn, linger_s: float, max_bytes: int) -> None:
    """After an early error answer (413 while the body still arrives), end our side and drop
    what the client still sends, at most ``max_bytes`` for at most ``linger_s``, so that it can
    finish sending and read our answer: closing on unread bytes would reset the connection.
    The caller closes the socket afterwards."""
    sock = conn.sock
    try:
        sock.shutdown(socket.SHUT_WR)  # the answer is whole: end our side now
    except OSError:
        return
    conn.watch.deadline = trio.current_time() + linger_s + 1.0  # the watchdog as a backstop
    left = max_bytes
    with trio.move_on_after(linger_s):
        try:
            while left > 0:
                data = await conn.reactor.recv_some(sock)
                if not data:
                    return
                left -= len(data)
        except (SocketClosed, OSError):
            return
