"""The simulated engine's trio driver: the pure ``Scheduler`` run in trio time.

``EngineDriver`` owns the scheduler and one task that steps it, sleeping each step's duration,
and hands each request's tokens to its channel when the step ends; the app (``server``) submits
requests, aborts them when their client leaves and cuts them all short for sleep. ``StepLog``
writes a JSON line per step for experiments (``--step-log``).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import replace

import trio

from fabricnode.kvevents.wire import Batch
from fabricnode.simengine.kvpublish import KvPublisher
from fabricnode.simengine.model import EngineConfig, Request, Scheduler, Step, TokenEvent


class StepLog:
    """One JSON line per engine step, for experiments (``--step-log``): where a request's time
    to first token went. Fields: ``t`` (trio time the step started), ``duration_s``,
    ``prefill_tokens``, ``decode_tokens``, ``admitted`` (``[priority, prompt tokens, seconds
    queued]`` per request it admitted), ``waiting`` (the same for the queue after it, at most
    ``MAX_WAITING`` of them) and ``queued`` (the queue's length), ``preempted`` (requests
    preempted), ``kv_usage``. Written as each step starts; line-buffered."""

    MAX_WAITING = 64

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (long-lived)

    def write(self, scheduler: Scheduler, step: Step) -> None:
        now = step.started_at
        requests = scheduler.requests

        def row(req: Request) -> list[float]:
            return [req.priority, len(req.prompt), round(now - req.arrived_at, 4)]

        admitted = [row(requests[rid]) for rid in step.admitted if rid in requests]
        waiting = [row(req) for req in itertools.islice(scheduler.waiting, self.MAX_WAITING)]
        doc = {
            "t": round(now, 4),
            "duration_s": round(step.duration_s, 5),
            "prefill_tokens": step.prefill_tokens,
            "decode_tokens": step.decode_tokens,
            "admitted": admitted,
            "waiting": waiting,
            "queued": len(scheduler.waiting),
            "preempted": len(step.preempted),
            "kv_usage": round(scheduler.statistics().kv_cache_usage, 4),
        }
        self._file.write(json.dumps(doc) + "\n")

    def close(self) -> None:
        self._file.close()


class EngineDriver:
    """Runs the scheduler in trio time: one task steps it, sleeping each step's duration, and
    hands each request's tokens to the request's channel when the step ends. A preempted request
    just gets no token for a while: the scheduler never produces an index twice, so every token
    goes to its channel exactly once, in order."""

    def __init__(
        self,
        config: EngineConfig,
        slowdown: float = 1.0,
        step_log: StepLog | None = None,
        kv_publisher: KvPublisher | None = None,
    ) -> None:
        self.config = replace(config, speed=config.speed / slowdown)
        self.scheduler = Scheduler(self.config)
        self.step_log = step_log
        # The prefix cache's changes, published as vLLM's KV-cache events after each step
        # (``kvpublish``); None: the engine records none.
        self.kv_publisher = kv_publisher
        self._channels: dict[int, trio.MemorySendChannel[TokenEvent]] = {}
        self._wake = trio.Event()
        self.hung = False

    def submit(
        self, prompt: list[int], max_tokens: int, salt: bytes = b"", priority: int = 0
    ) -> tuple[int, trio.MemoryReceiveChannel[TokenEvent]]:
        """Queue a request (``ValueError`` if it can never be served, or has a priority the
        scheduling policy refuses); its tokens arrive on the returned channel, which closes
        after the last one. ``salt``: its LoRA adapter's."""
        rid = self.scheduler.submit(prompt, max_tokens, trio.current_time(), salt, priority)
        send, recv = trio.open_memory_channel[TokenEvent](math.inf)
        self._channels[rid] = send
        self._wake.set()
        return rid, recv

    def abort(self, rid: int) -> None:
        self.scheduler.abort(rid)
        channel = self._channels.pop(rid, None)
        if channel is not None:
            channel.close()

    def free_kv(self) -> None:
        """Sleep: cut every request short and forget the KV cache (the prefix cache too)."""
        for rid in list(self._channels):
            self.abort(rid)
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
        self.scheduler.cache.clear()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """What the prefix cache recorded since the last call, as one batch (vLLM publishes
        one a step)."""
        publisher = self.kv_publisher
        if publisher is None:
            return
        events = self.scheduler.take_kv_events()
        if events:
            publisher.publish(Batch(time.time(), tuple(events), 0))

    async def run(self) -> None:
        while True:
            if self.hung:
                await trio.sleep_forever()
            step = self.scheduler.step(trio.current_time())
            if step is None:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            if self.step_log is not None:
                self.step_log.write(self.scheduler, step)
            await trio.sleep_until(step.ends_at)
            while self.hung:
                await trio.sleep_forever()
            self._publish_kv_events()
            for event in step.events:
                channel = self._channels.get(event.request_id)
                if channel is None:
                    continue
                channel.send_nowait(event)
                if event.finish_reason is not None:
                    channel.close()
                    del self._channels[event.request_id]
                    self.scheduler.release(event.request_id)
