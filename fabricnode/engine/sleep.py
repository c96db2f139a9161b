"""Idle sleep: put a serving engine to sleep after a quiet spell, wake it when it is wanted.

vLLM's sleep mode (``POST /sleep?level=1``: weights offloaded to host memory, KV cache freed;
``POST /wake_up``; ``GET /is_sleeping``) gives a job that holds its GPUs a warm replica that
wakes in seconds where a cold start takes minutes. With ``fabric start --sleep-after S`` the
agent asks its engine to sleep once no request reached it for ``S`` seconds.

Theory of operation
-------------------
* ``IdleSleep`` (pure, every call takes ``now``) says when the engine is due: the agent's
  in-flight count to its engine and its count of requests served locally are sampled every
  ``poll_s``; any request seen resets the idle clock, and so does a wake-up.
* ``EngineSleep`` (trio + httpx) acts on it. Before the first sleep it probes
  ``GET /is_sleeping`` once: a 404 (no sleep mode, or vLLM without ``VLLM_SERVER_DEV_MODE=1``)
  or an engine that refuses ``/sleep`` means no sleep for this engine: logged once, never tried
  again. A connection error is only a missed turn.
* Falling asleep: the node is marked first (``on_change(True)``: the local data plane holds
  requests for the engine until it is awake; ``fabric.sleeping=<level>`` on the signed entry:
  ingresses stop routing to it while the model has an awake replica), then ``/sleep`` is sent.
  Only with nothing in flight to the engine.
* Waking (``wake``: the data plane calls it for a request that reached a sleeping engine, from
  this node's ingress or forwarded by another): ``/wake_up``, then the marks come off. Sleeping
  and waking are serialised by one lock, so a request that arrives while the engine falls
  asleep waits for that and then wakes it; concurrent requests share one wake-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import trio

from fabricnode.mesh.schema import SLEEPING_LABEL
from fabricnode.mesh.service import GossipService

log = logging.getLogger("fabricnode.engine.sleep")

SLEEP_LEVEL = 1  # weights kept in host memory: the fast wake-up
SLEEP_TIMEOUT_S = 120.0  # offloading a large model's weights takes seconds
WAKE_TIMEOUT_S = 300.0
MAX_POLL_S = 1.0


@dataclass
class IdleSleep:
    """When an engine has been idle for ``sleep_after_s`` (pure)."""

    sleep_after_s: float
    last_active: float
    served: int = 0  # the count of requests served, as last seen

    def observe(self, now: float, inflight: int, served: int) -> None:
        """A sample of the engine's traffic: anything in flight or served since is activity."""
        if inflight > 0 or served != self.served:
            self.last_active = now
            self.served = served

    def due(self, now: float) -> bool:
        return now - self.last_active >= self.sleep_after_s

    def woke(self, now: float) -> None:
        self.last_active = now


@dataclass(frozen=True)
class SleepStatistics:
    state: str  # unknown | unsupported | awake | asleep
    sleeps: int
    wake_ups: int
    wake_failures: int


class EngineSleep:
    """Idle sleep and on-demand wake-up of one engine process (module docstring)."""

    def __init__(
        self,
        url: str,
        gossip: GossipService,
        *,
        sleep_after_s: float,
        inflight: Callable[[], int],
        served: Callable[[], int],
        on_change: Callable[[bool], None] = lambda asleep: None,
        level: int = SLEEP_LEVEL,
        poll_s: float | None = None,
    ) -> None:
        self.url = url
        self.gossip = gossip
        self.sleep_after_s = sleep_after_s
        self.inflight = inflight
        self.served = served
        self.on_change = on_change
        self.level = level
        self.poll_s = poll_s if poll_s is not None else min(MAX_POLL_S, sleep_after_s / 4)
        self.supported: bool | None = None  # None until probed
        self.asleep = False
        self.sleeps = 0
        self.wake_ups = 0
        self.wake_failures = 0
        self._lock = trio.Lock()
        self._client: httpx.AsyncClient | None = None
        self._policy: IdleSleep | None = None

    def statistics(self) -> SleepStatistics:
        if self.supported is None:
            state = "unknown"
        elif not self.supported:
            state = "unsupported"
        else:
            state = "asleep" if self.asleep else "awake"
        return SleepStatistics(state, self.sleeps, self.wake_ups, self.wake_failures)

    async def run(self, client: httpx.AsyncClient) -> None:
        """Watch the engine's traffic and put it to sleep when due (the engine serves)."""
        self._client = client
        policy = self._policy = IdleSleep(self.sleep_after_s, trio.current_time(), self.served())
        try:
            while self.supported is not False:
                await trio.sleep(self.poll_s)
                now = trio.current_time()
                policy.observe(now, self.inflight(), self.served())
                if self.asleep or not policy.due(now):
                    continue
                if self.supported is None:
                    await self._probe(client)
                    continue  # probed: look again at the next turn (a request may have come)
                async with self._lock:
                    policy.observe(trio.current_time(), self.inflight(), self.served())
                    if not self.asleep and policy.due(trio.current_time()):
                        await self._sleep(client)
        finally:
            if self.asleep:  # the engine is gone (or stopping): nothing sleeps any more
                self.asleep = False
                self.on_change(False)

    async def _probe(self, client: httpx.AsyncClient) -> None:
        try:
            r = await client.get(f"{self.url}/is_sleeping", timeout=5.0)
        except httpx.HTTPError as exc:
            log.info("cannot ask the engine whether it sleeps (%s): trying again later", exc)
            return
        if r.status_code == 404:
            self._unsupported("GET /is_sleeping answers 404")
            return
        try:
            sleeping = r.json().get("is_sleeping") if r.status_code == 200 else None
        except (ValueError, AttributeError):
            sleeping = None
        if not isinstance(sleeping, bool):
            self._unsupported(f"GET /is_sleeping answers {r.status_code} {r.text[:120]!r}")
            return
        self.supported = True
        log.info("the engine has a sleep mode: it sleeps after %g s idle", self.sleep_after_s)
        if sleeping:  # put to sleep by someone else: mark it, the next request wakes it
            self._mark(True)

    def _unsupported(self, why: str) -> None:
        self.supported = False
        log.warning("the engine has no sleep mode (%s): --sleep-after has no effect", why)

    async def _sleep(self, client: httpx.AsyncClient) -> None:
        if self.inflight():
            return
        self._mark(True)  # first: no new request reaches the engine while it falls asleep
        try:
            r = await client.post(
                f"{self.url}/sleep", params={"level": self.level}, timeout=SLEEP_TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            log.warning("the engine did not answer POST /sleep (%s): still awake", exc)
            self._mark(False)
            return
        if r.status_code != 200:
            self._mark(False)
            self._unsupported(f"POST /sleep answers {r.status_code} {r.text[:200]!r}")
            return
        self.sleeps += 1
        log.info("engine asleep (level %d) after %g s without requests", self.level,
                 self.sleep_after_s)  # fmt: skip

    async def wake(self) -> bool:
        """Wake the engine if it sleeps; True once it is awake (False: it would not wake)."""
        if not self.asleep:
            return True
        async with self._lock:
            if not self.asleep:
                return True  # another request woke it meanwhile
            client = self._client
            if client is None:
                return False
            t0 = trio.current_time()
            try:
                r = await client.post(f"{self.url}/wake_up", timeout=WAKE_TIMEOUT_S)
                ok = r.status_code == 200
                why = f"{r.status_code} {r.text[:200]!r}"
            except httpx.HTTPError as exc:
                ok, why = False, str(exc)
            if not ok:
                self.wake_failures += 1
                log.warning("the engine did not wake up (POST /wake_up: %s)", why)
                return False
            self.wake_ups += 1
            now = trio.current_time()
            if self._policy is not None:
                self._policy.woke(now)
            self._mark(False)
            log.info("engine awake after %.2f s", now - t0)
            return True

    def _mark(self, asleep: bool) -> None:
        self.asleep = asleep
        self.on_change(asleep)
        labels = ((SLEEPING_LABEL, str(self.level)),) if asleep else ()
        if not self.gossip.core.left:
            self.gossip.relabel(SLEEPING_LABEL, labels)
