"""Idle sleep of an engine, in process under trio's MockClock, against a fake engine behind
httpx's MockTransport: it is put to sleep once idle, marked on our entry and for the data plane,
woken once for concurrent requests, and an engine without sleep mode is probed once and left
alone."""

from __future__ import annotations

import time

import httpx
import trio
import trio.testing

from fabricnode.engine.sleep import EngineSleep
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.schema import SLEEPING_LABEL
from fabricnode.mesh.service import GossipService
from fabricnode.testing.simnet import make_body
from tests.support.notransport import NoTransport

URL = "http://engine.test"


def gossip() -> GossipService:
    me = Identity.from_seed(b"sleepy")
    now = time.time()
    core = MeshCore(
        me, Keyring.with_key(b"k" * 32), make_body(me, NoTransport.local_addr, now), now
    )
    return GossipService(core, NoTransport())


class FakeEngine:
    """vLLM's sleep endpoints (or none: ``supported=False`` answers 404 like vLLM without
    VLLM_SERVER_DEV_MODE)."""

    def __init__(self, supported: bool = True) -> None:
        self.supported = supported
        self.sleeping = False
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        call = f"{request.method} {request.url.path}"
        if request.url.query:
            call += f"?{request.url.query.decode()}"
        self.calls.append(call)
        if not self.supported:
            return httpx.Response(404, json={"detail": "Not Found"})
        if call == "GET /is_sleeping":
            return httpx.Response(200, json={"is_sleeping": self.sleeping})
        if call.startswith("POST /sleep"):
            self.sleeping = True
            return httpx.Response(200, json={"status": "sleeping", "level": 1})
        if call == "POST /wake_up":
            self.sleeping = False
            return httpx.Response(200, json={"status": "awake", "tags": None})
        return httpx.Response(404)


class Traffic:
    def __init__(self) -> None:
        self.inflight = 0
        self.served = 0
        self.marks: list[bool] = []


def sleeper(g: GossipService, traffic: Traffic, after_s: float = 30.0) -> EngineSleep:
    return EngineSleep(
        URL,
        g,
        sleep_after_s=after_s,
        inflight=lambda: traffic.inflight,
        served=lambda: traffic.served,
        on_change=traffic.marks.append,
    )


def labels(g: GossipService) -> dict[str, str]:
    return dict(g.core.self_entry.body.labels)


async def test_an_idle_engine_sleeps_is_marked_and_one_wake_up_serves_concurrent_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine, g, traffic = FakeEngine(), gossip(), Traffic()
    s = sleeper(g, traffic)
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(s.run, client)
        await trio.sleep(29)
        assert not engine.sleeping and engine.calls == []
        await trio.sleep(5)
        assert engine.sleeping and s.asleep
        assert engine.calls == ["GET /is_sleeping", "POST /sleep?level=1"]
        assert labels(g)[SLEEPING_LABEL] == "1" and traffic.marks == [True]
        assert s.statistics().state == "asleep"
        woke: list[bool] = []

        async def request() -> None:
            woke.append(await s.wake())

        async with trio.open_nursery() as requests:
            for _ in range(3):
                requests.start_soon(request)
        assert woke == [True, True, True]
        assert engine.calls.count("POST /wake_up") == 1
        assert not engine.sleeping and SLEEPING_LABEL not in labels(g)
        assert traffic.marks == [True, False]
        traffic.served += 1  # the requests went to the engine
        await trio.sleep(20)
        assert not engine.sleeping  # the idle clock started again at the wake-up
        await trio.sleep(15)
        assert engine.sleeping  # idle again: asleep again, probed only once
        assert engine.calls.count("GET /is_sleeping") == 1
        assert s.statistics().sleeps == 2 and s.statistics().wake_ups == 1
        nursery.cancel_scope.cancel()
    assert traffic.marks[-1] is False  # stopped: the data plane no longer waits for a wake


async def test_traffic_keeps_the_engine_awake(autojump_clock: trio.testing.MockClock) -> None:
    engine, g, traffic = FakeEngine(), gossip(), Traffic()
    s = sleeper(g, traffic, after_s=10.0)
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(s.run, client)
        for _ in range(20):  # a request every 5 s for 100 s
            await trio.sleep(5)
            traffic.served += 1
        traffic.inflight = 1  # then one long request for 60 s
        await trio.sleep(60)
        assert engine.calls == [] and not s.asleep
        traffic.inflight = 0
        await trio.sleep(12)
        assert engine.sleeping
        nursery.cancel_scope.cancel()


async def test_an_engine_without_sleep_mode_is_probed_once_and_never_put_to_sleep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine, g, traffic = FakeEngine(supported=False), gossip(), Traffic()
    s = sleeper(g, traffic, after_s=5.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        with trio.move_on_after(3600):
            await s.run(client)  # returns once it knows
        assert engine.calls == ["GET /is_sleeping"]
        assert s.statistics().state == "unsupported"
        assert SLEEPING_LABEL not in labels(g) and traffic.marks == []
        assert await s.wake()  # nothing to wake: a request goes straight on
