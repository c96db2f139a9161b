"""Non-blocking sockets driven directly by trio, the reactor that waits for them, and the deadline
watchdog that times them out.

The data plane does not use ``trio.SocketStream``: each of its calls is a checkpoint, and a
timeout scope per read costs a sizeable share of the whole per-request budget
(docs/benchmarks.md, "Per-call costs behind the data plane"). Here a read is one ``recv`` system
call when data is there, and a wait on the ``Reactor`` only when it is not; where data cannot be
there yet (an answer to what we just sent) the wait comes first, so no read fails with
``EAGAIN``. A send is one ``send`` (``try_send``, no coroutine) unless the socket buffer is full.

Why a reactor of our own: ``trio.lowlevel.wait_readable`` re-arms a one-shot epoll registration
on every wait (an ``epoll_ctl`` system call) and runs trio's interpreted registration bookkeeping
twice per wait, and the data plane waits twice per proxied request. ``Reactor`` registers each
data-plane socket once, edge-triggered, in an epoll set of its own; one trio task waits for that
set to become readable and wakes the tasks whose sockets are ready. That pays under load, when
one wakeup serves many sockets, and costs a second task step per wait when requests come one at
a time, so the owner turns ``batching`` on only while requests overlap (see ``Reactor``).
Against trio's waits it lowers the agent's CPU per request under load and changes nothing at
c=1 (docs/benchmarks-history.md, "2026-11-24: the data plane's own reactor"). Edge-triggered means
"wake me when something new arrives", so a wait must follow a read that drained the socket: the
reactor remembers an edge that came while nobody waited, a read that filled its whole buffer (more
may be queued), and a peer's close (data and FIN can arrive in one edge: the read returns the data,
and the EOF behind it would get no edge of its own), and such a wait returns at once (after a
checkpoint).

System calls per proxied JSON request on a pooled upstream connection, batching: ``recv``
client, ``send`` upstream, ``recv`` upstream, ``send`` client, plus ``epoll_wait`` calls shared by
every task ready at the same time (a few per hundred requests under load); through trio's waits,
one ``epoll_ctl`` more per wait.

Timeouts cost nothing per request: a socket that has a deadline is registered with a
``Watchdog`` (a set insert), and one task wakes every ``interval_s`` to close the sockets whose
deadline passed, whose ``still_wanted`` check fails, or whose ``client`` went away (an
upstream exchange answering a client that closed its connection: closing the upstream connection
is how an engine learns to abort the request and free its sequence). Closing goes through
``Reactor.close``, which wakes a task waiting on that socket with ``trio.ClosedResourceError``;
the owner then reads ``expired`` to tell a timeout from a peer's reset. Deadlines are therefore
accurate to ``interval_s``, which is plenty for timeouts of seconds.
"""

from __future__ import annotations

import errno
import math
import select
import socket
from collections.abc import Callable
from time import perf_counter

import outcome
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


def try_send(sock: socket.socket, data: bytes | memoryview) -> int:
    """How much of ``data`` went out at once (0 if none fit); ``SocketClosed`` if the peer is gone.

    Most sends on the data plane fit the socket buffer: this needs no coroutine
    (``Reactor.send_all`` finishes the rest).
    """
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise SocketClosed(str(exc)) from None


# Edge-triggered: an event when something new arrives, not while data is there (see Reactor).
_REGISTER = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
_READ_EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# The peer closed (or the connection failed): the socket stays readable for good (EOF or the
# error), and no edge will say so again.
_HUP_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_WRITE_EVENTS = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
_MAX_EVENTS = 1024
# The reactor batches while more than BATCH_ABOVE requests are being answered at once, and stops
# once no more than UNBATCH_AT are (see Reactor: batching pays only under load).
BATCH_ABOVE = 3
UNBATCH_AT = 1


class _Registration:
    """One socket in a reactor: who waits on it, and what it may have that nobody waited for."""

    __slots__ = ("fd", "hup", "reactor", "readable", "reader", "want_out", "writable", "writer")

    def __init__(self, fd: int, reactor: Reactor) -> None:
        self.fd = fd
        self.reactor = reactor  # whose count of waiting tasks a wake or an abort lowers
        self.reader: trio.lowlevel.Task | None = None
        self.writer: trio.lowlevel.Task | None = None
        # An edge that came while nobody waited, or a read that filled its whole buffer: the
        # next wait must not sleep, since no new edge may come for data already there.
        self.readable = False
        self.writable = False
        self.want_out = False  # EPOLLOUT is asked for (only once a send found the buffer full)
        # The peer's FIN (or an error) was seen: every wait returns at once from now on. Data
        # and FIN can come in one edge; a read then returns the data, the EOF is still queued,
        # and a wait for another edge would never end.
        self.hup = False

    def readable_now(self) -> None:
        """An edge for reading: wake the reader, or remember it for the next one."""
        task = self.reader
        if task is None:
            self.readable = True
        else:
            self.reader = None
            self.reactor.waiting -= 1
            trio.lowlevel.reschedule(task)

    def writable_now(self) -> None:
        """An edge for writing: wake the writer, or remember it for the next one."""
        task = self.writer
        if task is None:
            self.writable = True
        else:
            self.writer = None
            self.reactor.waiting -= 1
            trio.lowlevel.reschedule(task)

    def abort_read(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self.reader = None
        self.reactor.waiting -= 1
        return trio.lowlevel.Abort.SUCCEEDED

    def abort_write(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self.writer = None
        self.reactor.waiting -= 1
        return trio.lowlevel.Abort.SUCCEEDED

    def wake_closed(self) -> None:
        """Wake whoever waits on this socket with ``trio.ClosedResourceError``."""
        reader, writer = self.reader, self.writer
        self.reader = self.writer = None
        if reader is not None:
            self.reactor.waiting -= 1
            trio.lowlevel.reschedule(reader, outcome.Error(trio.ClosedResourceError("closed")))
        if writer is not None:
            self.reactor.waiting -= 1
            trio.lowlevel.reschedule(writer, outcome.Error(trio.ClosedResourceError("closed")))


class Reactor:
    """Waits for the data plane's sockets (see the module docstring for why and how).

    ``register`` a socket once, right after accept or connect; wait and read through the
    reactor's methods; close through ``close``. ``run`` is the task that delivers readiness.

    Batching pays only under load: with one request at a time, every wait through the reactor
    is one trio wait (on the epoll set) plus a second task step to wake the waiter, where
    trio's own wait is one (more CPU per request at c=1: docs/benchmarks-history.md,
    "2026-11-24: the data plane's own reactor"). So the owner brackets each request it answers
    with ``request_started``/``request_ended``, which turn ``batching`` on while requests
    overlap, and the waits go straight to trio's ``wait_readable``/``wait_writable`` otherwise;
    sockets stay registered either way (edges meanwhile only leave flags, which cost at most one
    empty ``recv`` later). The reactor's task listens only while some task waits through it.
    Until ``run`` starts (tests that drive an ``Exchange`` on its own), and for sockets never
    registered, waits use trio's.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._regs: dict[int, _Registration] = {}
        self.waiting = 0  # tasks waiting through the reactor now
        self._task: trio.lowlevel.Task | None = None  # run's task, when it idles
        self._idle = False
        self.running = False
        self.batching = True  # off while the owner's requests do not overlap (see above)
        self.answering = 0  # requests the owner is answering now (request_started/_ended)
        self.parks = 0  # waits that went through the reactor (statistics)

    def register(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        try:
            self._epoll.register(fd, _REGISTER)
        except FileExistsError:
            self._epoll.modify(fd, _REGISTER)  # an fd number whose last socket left unseen
        old = self._regs.get(fd)
        if old is not None:
            old.wake_closed()  # nobody can wait on a socket that was closed; to be sure
        self._regs[fd] = _Registration(fd, self)

    def close(self, sock: socket.socket) -> None:
        """Close a socket a task may be waiting on (it wakes with ``ClosedResourceError``).

        Closing the descriptor also takes it out of the epoll set.
        """
        fd = sock.fileno()
        if fd == -1:
            return
        reg = self._regs.pop(fd, None)
        if reg is not None:
            reg.wake_closed()
        close(sock)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver readiness until cancelled (start it before any registered socket waits)."""
        epoll = self._epoll
        regs = self._regs
        self.running = True
        task_status.started()
        try:
            while True:
                if self.waiting == 0:
                    # Nobody waits through us: stop listening (edges queue in the epoll set)
                    # until a task parks and wakes us.
                    self._task = trio.lowlevel.current_task()
                    self._idle = True
                    await trio.lowlevel.wait_task_rescheduled(self._abort_idle)
                    continue
                await trio.lowlevel.wait_readable(epoll.fileno())
                while True:
                    events = epoll.poll(0, _MAX_EVENTS)
                    for fd, flags in events:
                        reg = regs.get(fd)
                        if reg is None:
                            continue
                        if flags & _READ_EVENTS:
                            if flags & _HUP_EVENTS:
                                reg.hup = True
                            reg.readable_now()
                        if flags & _WRITE_EVENTS:
                            reg.writable_now()
                    if len(events) < _MAX_EVENTS:
                        break
        finally:
            self.running = False
            self._idle = False
            for reg in regs.values():  # nobody would ever wake them now
                reg.wake_closed()

    def request_started(self) -> None:
        """The owner began answering a request: batch once more than BATCH_ABOVE overlap."""
        self.answering += 1
        if self.answering > BATCH_ABOVE:
            self.batching = True

    def request_ended(self) -> None:
        """The owner answered a request: stop batching once no more than UNBATCH_AT are left."""
        self.answering -= 1
        if self.answering <= UNBATCH_AT:
            self.batching = False

    def _abort_idle(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._idle = False
        return trio.lowlevel.Abort.SUCCEEDED

    def _park(self) -> None:
        """A task is about to wait through the reactor: wake the reactor if it idles."""
        self.waiting += 1
        self.parks += 1
        if self._idle:
            self._idle = False
            task = self._task
            if task is not None:
                trio.lowlevel.reschedule(task)

    async def wait_readable(self, sock: socket.socket, drained: bool = False) -> None:
        """Until ``sock`` may have something to read (``drained``: a read just found nothing).

        Raises ``trio.ClosedResourceError`` when the socket is closed meanwhile.
        """
        reg = self._regs.get(sock.fileno())
        if reg is None or not self.running or not self.batching:
            await trio.lowlevel.wait_readable(sock)
            return
        if reg.hup:
            await trio.lowlevel.checkpoint()  # EOF (or an error) is there to read
            return
        if drained:
            reg.readable = False
        elif reg.readable:
            reg.readable = False
            await trio.lowlevel.checkpoint()  # never loop on a busy socket without yielding
            return
        if reg.reader is not None:
            raise trio.BusyResourceError("another task is already waiting to read this socket")
        reg.reader = trio.lowlevel.current_task()
        self._park()
        await trio.lowlevel.wait_task_rescheduled(reg.abort_read)

    async def wait_writable(self, sock: socket.socket) -> None:
        """Until a send that found the buffer full may go on."""
        reg = self._regs.get(sock.fileno())
        if reg is None or not self.running or not self.batching:
            await trio.lowlevel.wait_writable(sock)
            return
        reg.writable = False  # the send before this found no room
        if not reg.want_out:
            reg.want_out = True
            # Re-arming re-checks readiness: room freed since the send shows as an event now.
            self._epoll.modify(reg.fd, _REGISTER | select.EPOLLOUT)
        if reg.writer is not None:
            raise trio.BusyResourceError("another task is already waiting to write this socket")
        reg.writer = trio.lowlevel.current_task()
        self._park()
        await trio.lowlevel.wait_task_rescheduled(reg.abort_write)

    def _maybe_more(self, sock: socket.socket) -> None:
        """A read filled its whole buffer: more may be queued, with no edge to tell."""
        reg = self._regs.get(sock.fileno())
        if reg is not None:
            reg.readable = True

    def try_recv(self, sock: socket.socket) -> bytes | None:
        """Bytes that arrived (b"" at end of stream), None if none yet; ``SocketClosed`` on
        errors."""
        try:
            data = sock.recv(RECV_BYTES)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise SocketClosed(str(exc)) from None
        if len(data) == RECV_BYTES:
            self._maybe_more(sock)
        return data

    async def recv_some(self, sock: socket.socket) -> bytes:
        """Bytes that arrived (b"" at end of stream); ``SocketClosed`` on a reset or closed
        socket.

        Tries ``recv`` first: use it where data is likely there already.
        """
        while True:
            data = self.try_recv(sock)
            if data is not None:
                return data
            try:
                await self.wait_readable(sock, True)
            except (trio.ClosedResourceError, OSError) as exc:
                raise SocketClosed(str(exc)) from None

    async def recv_later(self, sock: socket.socket) -> bytes:
        """``recv_some`` for data that cannot be there yet: waits for readiness before reading.

        Use it where the peer has to answer first (the upstream right after the request went
        out; a keep-alive client right after its response went out): an optimistic ``recv``
        there is a system call and a ``BlockingIOError`` that almost always come back
        empty-handed.
        """
        drained = False
        while True:
            try:
                await self.wait_readable(sock, drained)
            except (trio.ClosedResourceError, OSError) as exc:
                raise SocketClosed(str(exc)) from None
            data = self.try_recv(sock)
            if data is not None:
                return data
            drained = True  # a stale edge: wait for a new one

    async def send_all(self, sock: socket.socket, data: bytes | memoryview) -> None:
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
                    await self.wait_writable(sock)
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
        try:
            infos = await trio.to_thread.run_sync(
                socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM
            )
        except UnicodeError:  # a name no lookup can encode (``a..b``): as if it did not resolve
            raise OSError(f"cannot resolve {host!r}") from None
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


def client_gone(sock: socket.socket) -> bool:
    """True if a client that is waiting for our answer closed or reset its connection.

    A non-blocking peek: EOF or an error means gone; bytes (a pipelined next request) or
    nothing to read mean it is still there (EOF behind pipelined bytes is seen at our write).
    """
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True


CLIENT_GONE = "client gone"  # Watched.expired when its client went away


class Watched:
    """A socket with a deadline (``math.inf`` = none), an optional liveness check, and the
    client socket whose request it serves (checked by the watchdog: ``client_gone``)."""

    __slots__ = ("client", "deadline", "expired", "sock", "still_wanted")

    def __init__(
        self,
        sock: socket.socket,
        deadline: float = math.inf,
        still_wanted: Callable[[], bool] | None = None,
    ) -> None:
        self.sock = sock
        self.deadline = deadline
        self.still_wanted = still_wanted
        self.client: socket.socket | None = None
        self.expired = ""  # why the watchdog closed it ("" = it did not)


class Watchdog:
    """Closes watched sockets past their deadline (see the module docstring)."""

    def __init__(self, interval_s: float = 0.5, reactor: Reactor | None = None) -> None:
        self.interval_s = interval_s
        # The reactor the watched sockets wait through (closing wakes their waiters).
        self.reactor = reactor if reactor is not None else Reactor()
        self.clock = LoopClock()
        self.watched: set[Watched] = set()
        self.expired_total = 0

    def expire(self, w: Watched, why: str) -> None:
        if not w.expired:
            w.expired = why
            self.expired_total += 1
        self.watched.discard(w)
        self.reactor.close(w.sock)

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
                elif w.client is not None and client_gone(w.client):
                    self.expire(w, CLIENT_GONE)
