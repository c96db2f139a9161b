"""The floor of the data plane's design: the least a trio + httptools relay does per request.

One task per client connection, one upstream connection per client connection, the request
and the response framed by httptools and passed on whole: no routing, filters, metrics,
accounting, timeouts or error handling. Sockets wait through the data plane's own reactor
(``fabricnode.dataplane.sockio.Reactor``, compiled when the native build is current), as the agent's
do. ``bench/router.py --targets trio-floor`` runs it in front of the same backend as the other
routers, so the agent's figures can be read against what its event loop, reactor and parser
cost on their own.

Usage: python bench/trio_floor.py --port PORT --upstream-port PORT
"""

from __future__ import annotations

import argparse
import socket

import httptools
import trio

from fabricnode.dataplane.sockio import Reactor, SocketClosed


class _Framing:
    """httptools callbacks: only whether the message is complete."""

    def __init__(self) -> None:
        self.done = False

    def on_message_complete(self) -> None:
        self.done = True


async def _relay(reactor: Reactor, client: socket.socket, upstream_port: int) -> None:
    upstream = socket.create_connection(("127.0.0.1", upstream_port))
    upstream.setblocking(False)
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reactor.register(upstream)
    request = _Framing()
    request_parser = httptools.HttpRequestParser(request)
    try:
        while True:
            data = await reactor.recv_later(client)
            if not data:
                return
            request.done = False
            request_parser.feed_data(data)
            pieces = [data]
            while not request.done:
                data = await reactor.recv_later(client)
                if not data:
                    return
                request_parser.feed_data(data)
                pieces.append(data)
            reactor.request_started()  # batching under load, as the agent's reactor does
            try:
                upstream.sendall(b"".join(pieces))
                response = _Framing()
                response_parser = httptools.HttpResponseParser(response)
                pieces = []
                while not response.done:
                    data = await reactor.recv_later(upstream)
                    if not data:
                        return
                    response_parser.feed_data(data)
                    pieces.append(data)
                client.sendall(b"".join(pieces))
            finally:
                reactor.request_ended()
    except (OSError, SocketClosed):
        pass
    finally:
        reactor.close(upstream)
        reactor.close(client)


async def serve(port: int, upstream_port: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    listener.setblocking(False)
    reactor = Reactor()
    reactor.batching = False  # until requests overlap
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                client, _ = listener.accept()
            except BlockingIOError:
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reactor.register(client)
            nursery.start_soon(_relay, reactor, client, upstream_port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args()
    trio.run(serve, args.port, args.upstream_port)


if __name__ == "__main__":
    main()
