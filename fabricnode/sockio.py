"""Non-blocking sockets driven directly by trio, and the deadline watchdog that times them out.

The data plane does not use ``trio.SocketStream``: each of its calls is a checkpoint, and a
timeout scope per read costs ≈27 µs (notes/data-plane-measurements.md), an eighth of the whole
per-request budget. Here a read is one ``recv`` system call when data is there, and
``trio.lowlevel.wait_readable`` only when it is not; where data cannot be there yet (an answer
to what we just sent) the wait comes first, so no read fails with ``EAGAIN``. A send is one
``send`` (``try_send``, no coroutine) unless the socket buffer is full.

System calls per proxied JSON request on a pooled upstream connection: ``recv`` client, ``send``
upstream, ``epoll_ctl`` (trio re-arms its one-shot registration), ``recv`` upstream, ``send``
client, ``epoll_ctl`` for the client's next request, plus ``epoll_wait`` calls shared by every
task ready at the same time (two per request when idle, a few per hundred under load).

Timeouts cost nothing per request: a socket that has a deadline is registered with a
``Watchdog`` (a set insert), and one task wakes every ``interval_s`` to close the sockets whose
deadline passed (or whose ``still_wanted`` check fails). Closing goes through
``trio.lowlevel.notify_closing``, which wakes a task waiting on that socket with
``trio.ClosedResourceError``; the owner then reads ``expired`` to tell a timeout from a peer's
reset. Deadlines are therefore accurate to ``interval_s``, which is plenty for timeouts of
seconds.
"""

from __future__ import annotations

import errno
import math
import socket
from collections.abc import Callable
from time import perf_counter

import trio

RECV_BYTES = 256 * 1024


class LoopClock:
    """trio's current time, read in one C call when trio runs on its system clock.

    ``trio.current_time()`` is three interpreted calls deep (run context, runner, clock), and
    the data plane reads the time several times per request. trio's ``SystemClock`` is
    ``offset + perf_counter()`` with a random offset fixed for the run: ``bind`` reads the
    offset once, inside the run, and ``now`` is then that sum. Any other clock (``MockClock``
    in tests), or an unbound LoopClock, is asked through ``trio.current_time()`` as usual.
    """

    __slots__ = ("_direct", "_offset")

    def __init__(self) -> None:
        self._direct = False
        self._offset = 0.0

    def bind(self) -> None:
        """Follow the clock of the trio run we are in (call inside it)."""
        clock = trio.lowlevel.current_clock()
        offset = getattr(clock, "offset", None)
        # Checked by name: trio does not export SystemClock. Its current_time is exactly
        # ``self.offset + perf_counter()``, which test_sockio holds it to.
        self._direct = type(clock).__name__ == "SystemClock" and isinstance(offset, float)
        self._offset = offset if isinstance(offset, float) else 0.0

    def now(self) -> float:
        if self._direct:
            return self._offset + perf_counter()
        return trio.current_time()


class SocketClosed(Exception):
    """The peer closed or reset the connection, or the watchdog closed it (see ``expired``)."""


async def recv_some(sock: socket.socket) -> bytes:
    """Bytes that arrived (b"" at end of stream); ``SocketClosed`` on a reset or closed socket.

    Tries ``recv`` first: use it where data is likely there already.
    """
    while True:
        try:
            return sock.recv(RECV_BYTES)
        except BlockingIOError:
            pass
        except OSError as exc:
            raise SocketClosed(str(exc)) from None
        try:
            await trio.lowlevel.wait_readable(sock)
        except (trio.ClosedResourceError, OSError) as exc:
            raise SocketClosed(str(exc)) from None


def try_recv(sock: socket.socket) -> bytes | None:
    """Bytes that arrived (b"" at end of stream), None if none yet; ``SocketClosed`` on errors."""
    try:
        return sock.recv(RECV_BYTES)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise SocketClosed(str(exc)) from None


async def recv_later(sock: socket.socket) -> bytes:
    """``recv_some`` for data that cannot be there yet: waits for readiness before reading.

    Use it where the peer has to answer first (the upstream right after the request went out;
    a keep-alive client right after its response went out): an optimistic ``recv`` there is a
    system call and a ``BlockingIOError`` that almost always come back empty-handed.
    """
    while True:
        try:
            await trio.lowlevel.wait_readable(sock)
        except (trio.ClosedResourceError, OSError) as exc:
            raise SocketClosed(str(exc)) from None
        try:
            return sock.recv(RECV_BYTES)
        except BlockingIOError:
            pass  # a spurious wakeup: wait again
        except OSError as exc:
            raise SocketClosed(str(exc)) from None


def try_send(sock: socket.socket, data: bytes | memoryview) -> int:
    """How much of ``data`` went out at once (0 if none fit); ``SocketClosed`` if the peer is gone.

    Most sends on the data plane fit the socket buffer: this needs no coroutine (``send_all``
    finishes the rest).
    """
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise SocketClosed(str(exc)) from None


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send everything; ``SocketClosed`` when the peer is gone."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise SocketClosed(str(exc)) from None
        view = view[sent:]
        if view:
            try:
                await trio.lowlevel.wait_writable(sock)
            except (trio.ClosedResourceError, OSError) as exc:
                raise SocketClosed(str(exc)) from None


async def connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket with TCP_NODELAY (``OSError`` if refused).

    ``host`` should be an IP address (the registry advertises addresses); a name is resolved
    in a worker thread.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
        addr: tuple[str, int] = (host, port)
    except OSError:
        infos = await trio.to_thread.run_sync(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        addr = (str(sockaddr[0]), int(sockaddr[1]))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(addr)
        if code == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, f"connect to {host}:{port}: {errno.errorcode.get(code, code)}")
    except BaseException:
        close(sock)
        raise
    return sock


def close(sock: socket.socket) -> None:
    """Close a socket a task may be waiting on (it wakes with ``ClosedResourceError``)."""
    if sock.fileno() == -1:
        return
    trio.lowlevel.notify_closing(sock)
    sock.close()


def peer_closed(sock: socket.socket) -> bool:
    """True if an idle pooled connection was closed by its peer (EOF or error waiting)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # nothing to read: still open
    except OSError:
        return True
    return True  # EOF, or unsolicited bytes on an idle connection: unusable either way


class Watched:
    """A socket with a deadline (``math.inf`` = none) and an optional liveness check."""

    __slots__ = ("deadline", "expired", "sock", "still_wanted")

    def __init__(
        self,
        sock: socket.socket,
        deadline: float = math.inf,
        still_wanted: Callable[[], bool] | None = None,
    ) -> None:
        self.sock = sock
        self.deadline = deadline
        self.still_wanted = still_wanted
        self.expired = ""  # why the watchdog closed it ("" = it did not)


class Watchdog:
    """Closes watched sockets past their deadline (see the module docstring)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.clock = LoopClock()
        self.watched: set[Watched] = set()
        self.expired_total = 0

    def expire(self, w: Watched, why: str) -> None:
        if not w.expired:
            w.expired = why
            self.expired_total += 1
        self.watched.discard(w)
        close(w.sock)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.interval_s)
            now = self.clock.now()
            for w in list(self.watched):
                if w.deadline <= now:
                    self.expire(w, "timeout")
                elif w.still_wanted is not None and not w.still_wanted():
                    self.expire(w, "unwanted")
