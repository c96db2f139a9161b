"""sockio: the data plane's reading of trio's clock, and its reactor on real sockets."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from fabricnode.dataplane.sockio import (
    CLIENT_GONE,
    RECV_BYTES,
    LoopClock,
    Reactor,
    SocketClosed,
    Watchdog,
    Watched,
    client_gone,
)


def test_bound_to_the_system_clock_it_reads_the_same_time_as_trio() -> None:
    async def main() -> None:
        clock = LoopClock()
        clock.bind()
        before = trio.current_time()
        mine = clock.now()
        after = trio.current_time()
        assert before <= mine <= after
        await trio.sleep(0.01)
        assert clock.now() - mine >= 0.01

    trio.run(main)


def test_bound_to_a_mock_clock_it_follows_the_mock() -> None:
    mock = trio.testing.MockClock()

    async def main() -> None:
        clock = LoopClock()
        clock.bind()
        start = clock.now()
        assert start == trio.current_time()
        mock.jump(5.0)
        assert clock.now() == start + 5.0

    trio.run(main, clock=mock)


def test_unbound_or_bound_in_another_run_it_asks_trio() -> None:
    clock = LoopClock()

    async def main() -> None:
        assert clock.now() == trio.current_time()

    trio.run(main, clock=trio.testing.MockClock())
    trio.run(main, clock=trio.testing.MockClock())


# == Reactor: the data plane's own edge-triggered waits ====================================


@contextlib.asynccontextmanager
async def running_reactor() -> AsyncIterator[Reactor]:
    reactor = Reactor()
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        yield reactor
        nursery.cancel_scope.cancel()


def nonblocking_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def tcp_pair(rcvbuf: int) -> tuple[socket.socket, socket.socket]:
    """Connected loopback TCP sockets (sender blocking, receiver non-blocking with ``rcvbuf``)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # inherited by accept
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    receiver.setblocking(False)
    return sender, receiver


async def test_a_waiting_reader_wakes_when_data_arrives() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(b)
        got: list[bytes] = []

        async def reader() -> None:
            got.append(await reactor.recv_later(b))

        with trio.fail_after(2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await trio.sleep(0.02)
                assert not got
                a.send(b"hello")
        assert got == [b"hello"]
    a.close()
    b.close()


@contextlib.asynccontextmanager
async def listening_reactor(sock: socket.socket) -> AsyncIterator[Reactor]:
    """A running reactor with ``sock`` registered, kept listening by a reader parked on
    another socket: edges for ``sock`` are delivered while nobody waits on it."""
    other, other_peer = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(sock)
        reactor.register(other)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_recv_quietly, reactor, other)
            await trio.sleep(0.02)
            yield reactor
            nursery.cancel_scope.cancel()
    other.close()
    other_peer.close()


async def test_an_edge_that_came_while_nobody_waited_is_not_lost() -> None:
    a, b = nonblocking_pair()
    async with listening_reactor(b) as reactor:
        a.send(b"early")
        await trio.sleep(0.02)  # the reactor sees b's edge; nobody waits on b yet
        assert reactor._regs[b.fileno()].readable
        with trio.fail_after(2):
            assert await reactor.recv_later(b) == b"early"
    a.close()
    b.close()


@pytest.mark.parametrize("pair", ["socketpair", "tcp"])
async def test_a_close_that_came_with_the_last_data_is_not_waited_for(pair: str) -> None:
    """Data and the peer's FIN in one edge: the read returns the data, the EOF stays queued
    and no edge will announce it. The next wait must return (EOF), not sleep for ever: a
    stream whose node closed right after its last piece hung the ingress this way (1 churn run
    in 5, on a loaded machine)."""
    a, b = tcp_pair(rcvbuf=65536) if pair == "tcp" else nonblocking_pair()
    async with listening_reactor(b) as reactor:
        a.sendall(b"last piece")
        a.shutdown(socket.SHUT_WR)
        await trio.sleep(0.05)  # one edge (or two) delivered while nobody waits on b
        with trio.fail_after(2):
            assert await reactor.recv_later(b) == b"last piece"
            assert await reactor.recv_later(b) == b""
            assert await reactor.recv_some(b) == b""  # and it stays so
    a.close()
    b.close()


@pytest.mark.parametrize("first_read", ["recv_some", "try_recv"])
async def test_a_read_that_filled_its_buffer_does_not_wait_for_an_edge_that_will_not_come(
    first_read: str,
) -> None:
    total = RECV_BYTES * 2 + 1000
    sender, receiver = tcp_pair(rcvbuf=8 * RECV_BYTES)
    async with running_reactor() as reactor:
        reactor.register(receiver)
        await trio.to_thread.run_sync(sender.sendall, b"x" * total)
        await trio.sleep(0.05)  # everything queued at the receiver; no more edges will come
        # As if one edge had woken a reader for all of it: the reactor holds no edge now.
        reactor._regs[receiver.fileno()].readable = False
        received = 0
        with trio.fail_after(2):
            if first_read == "try_recv":
                first = reactor.try_recv(receiver) or b""
            else:
                first = await reactor.recv_some(receiver)
            assert len(first) == RECV_BYTES  # the case under test: a full buffer, more queued
            received += len(first)
            while received < total:
                received += len(await reactor.recv_later(receiver))
        assert received == total
    sender.close()
    receiver.close()


async def test_closing_a_socket_wakes_its_waiter() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(b)
        outcome: list[str] = []
        with trio.fail_after(2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_note_closed, reactor, b, outcome)
                await trio.sleep(0.02)
                reactor.close(b)
        assert outcome == ["closed"]
        assert b.fileno() == -1
    a.close()


async def test_a_cancelled_wait_leaves_the_socket_usable() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(b)
        with trio.move_on_after(0.02):
            await reactor.recv_later(b)
            raise AssertionError("nothing was sent")
        a.send(b"later")
        with trio.fail_after(2):
            assert await reactor.recv_later(b) == b"later"
    a.close()
    b.close()


async def test_two_readers_of_one_socket_are_refused() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reactor.recv_later, b)
            await trio.sleep(0.02)
            with pytest.raises(trio.BusyResourceError):
                await reactor.recv_later(b)
            nursery.cancel_scope.cancel()
    a.close()
    b.close()


async def test_send_all_waits_for_room_until_everything_went_out() -> None:
    total = 8 * 1024 * 1024  # far more than the socket buffers hold
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(a)
        received = 0

        async def slow_reader() -> None:
            nonlocal received
            while received < total:
                await trio.sleep(0.001)
                with contextlib.suppress(BlockingIOError):
                    received += len(b.recv(RECV_BYTES))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow_reader)
                await reactor.send_all(a, b"y" * total)
        assert received == total
    a.close()
    b.close()


async def test_without_a_running_reactor_waits_fall_back_to_trio() -> None:
    a, b = nonblocking_pair()
    reactor = Reactor()  # never started
    reactor.register(b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send_later, a, b"via trio")
        with trio.fail_after(2):
            assert await reactor.recv_later(b) == b"via trio"
    a.close()
    b.close()


async def test_stopping_the_reactor_wakes_its_waiters() -> None:
    a, b = nonblocking_pair()
    reactor = Reactor()
    outcome: list[str] = []
    with trio.fail_after(2):
        await _reader_woken_when_the_reactor_stops(reactor, b, outcome)
    assert outcome == ["closed"]
    assert not reactor.running
    a.close()
    b.close()


async def _reader_woken_when_the_reactor_stops(
    reactor: Reactor, sock: socket.socket, outcome: list[str]
) -> None:
    async with trio.open_nursery() as outer:
        reactor_scope = trio.CancelScope()

        async def run_reactor(task_status: trio.TaskStatus[None]) -> None:
            with reactor_scope:
                await reactor.run(task_status=task_status)

        await outer.start(run_reactor)
        reactor.register(sock)
        outer.start_soon(_note_closed, reactor, sock, outcome)
        await trio.sleep(0.02)
        reactor_scope.cancel()


async def test_a_socket_number_reused_after_an_unseen_close_registers_again() -> None:
    async with running_reactor() as reactor:
        a, b = nonblocking_pair()
        reactor.register(b)
        number = b.fileno()
        b.close()  # behind the reactor's back
        a.close()
        for _ in range(4):  # the kernel hands out the lowest free numbers: it comes back
            c, d = nonblocking_pair()
            if number in (c.fileno(), d.fileno()):
                break
            c.close()
            d.close()
        reused = d if d.fileno() == number else c
        other = c if reused is d else d
        reactor.register(reused)
        other.send(b"again")
        with trio.fail_after(2):
            assert await reactor.recv_later(reused) == b"again"
        c.close()
        d.close()


async def _send_later(sock: socket.socket, data: bytes) -> None:
    await trio.sleep(0.02)
    sock.send(data)


async def test_while_not_batching_waits_go_to_trio_and_the_reactor_stays_idle() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.batching = False
        reactor.register(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send_later, a, b"direct")
            with trio.fail_after(2):
                assert await reactor.recv_later(b) == b"direct"
        assert reactor.parks == 0 and reactor.waiting == 0
    a.close()
    b.close()


async def test_an_edge_queued_while_the_reactor_idled_wakes_the_next_waiter() -> None:
    a, b = nonblocking_pair()
    async with running_reactor() as reactor:
        reactor.register(b)
        await trio.sleep(0.02)  # nobody waits: the reactor does not listen
        a.send(b"queued")
        await trio.sleep(0.02)
        with trio.fail_after(2):
            assert await reactor.recv_later(b) == b"queued"
        assert reactor.waiting == 0
    a.close()
    b.close()


async def test_the_count_of_waiting_tasks_follows_parks_wakes_aborts_and_closes() -> None:
    pairs = [nonblocking_pair() for _ in range(3)]
    async with running_reactor() as reactor:
        for _, b in pairs:
            reactor.register(b)
        async with trio.open_nursery() as nursery:
            for _, b in pairs:
                nursery.start_soon(_recv_quietly, reactor, b)
            await trio.sleep(0.02)
            assert reactor.waiting == 3
            pairs[0][0].send(b"x")  # woken by data
            reactor.close(pairs[1][1])  # woken by close
            await trio.sleep(0.02)
            assert reactor.waiting == 1
            nursery.cancel_scope.cancel()  # the last one aborted
        assert reactor.waiting == 0
    for a, b in pairs:
        a.close()
        b.close()


async def _recv_quietly(reactor: Reactor, sock: socket.socket) -> None:
    await _note_closed(reactor, sock, [])


async def _note_closed(reactor: Reactor, sock: socket.socket, outcome: list[str]) -> None:
    """Wait to read ``sock``; note "closed" if it was closed meanwhile."""
    try:
        await reactor.recv_later(sock)
    except SocketClosed:
        outcome.append("closed")


def test_batching_follows_how_many_requests_overlap() -> None:
    reactor = Reactor()
    reactor.batching = False
    seen = []
    for _ in range(5):  # 1..5 at once: batching from the 4th on
        reactor.request_started()
        seen.append(reactor.batching)
    for _ in range(5):  # 4..0 left: still batching until at most 1 is
        reactor.request_ended()
        seen.append(reactor.batching)
    assert seen == [False, False, False, True, True, True, True, True, False, False]


# == clients that went away ==================================================================


def accepted_pair() -> tuple[socket.socket, socket.socket]:
    """(our accepted side, the peer's side), both blocking."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


def test_client_gone_sees_a_close_or_a_reset_but_not_a_quiet_or_pipelining_client() -> None:
    server, client = accepted_pair()
    with server, client:
        assert not client_gone(server)
        client.sendall(b"GET / HTTP/1.1\r\n")  # a pipelined next request: still there
        assert not client_gone(server)
        assert server.recv(100)
        client.close()
        assert client_gone(server)
    server, client = accepted_pair()
    with server:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()  # RST
        assert client_gone(server)


async def test_the_watchdog_closes_an_exchange_whose_client_went_away() -> None:
    reactor = Reactor()
    watchdog = Watchdog(0.01, reactor)
    upstream, engine = accepted_pair()
    downstream, client = accepted_pair()
    with upstream, engine, downstream:
        reactor.register(upstream)
        watch = Watched(upstream)
        watch.client = downstream
        watchdog.watched.add(watch)
        async with trio.open_nursery() as nursery:
            await nursery.start(watchdog.run)
            with trio.fail_after(5):
                await trio.sleep(0.05)
                assert not watch.expired, "a client that is still there is waited for"
                client.close()
                with pytest.raises((SocketClosed, trio.ClosedResourceError)):
                    await reactor.recv_later(upstream)
            nursery.cancel_scope.cancel()
        assert watch.expired == CLIENT_GONE
        assert engine.recv(1) == b"", "the engine side sees the upstream connection close"
