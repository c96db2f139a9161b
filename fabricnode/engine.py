"""The engine service: the supervised child's lifecycle, as the mesh sees it.

    spawn ── loading ──► /health + /v1/models answer ──► SERVING (models, engine kind, url)
                │                                         │ scrape /metrics every
                │                                         │ ``metrics_interval_s`` → load channel
                └── exits, or stops answering /health ────┴─► DOWN signed and pushed at once

A child exit is noticed through its pidfd the moment it happens, so DOWN reaches the mesh in
well under a second. A hang (no /health answer ``unhealthy_after`` times in a row) is DOWN too,
and the hung child is stopped. On shutdown the agent signs LEFT first, then calls ``stop``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from fabricnode.engine_cmd import EngineCommand
from fabricnode.engine_metrics import engine_load, parse_samples
from fabricnode.gossip import GossipService
from fabricnode.mesh import MeshCore
from fabricnode.registry import EngineInfo, ModelInfo, State
from fabricnode.supervisor import EngineError, EngineProcess, wait_ready

log = logging.getLogger("fabricnode.engine")


@dataclass(frozen=True)
class EngineStatistics:
    state: str  # loading | serving | down | stopped
    pid: int | None
    returncode: int | None
    scrapes: int
    scrape_errors: int


class EngineService:
    def __init__(
        self,
        command: EngineCommand,
        core: MeshCore,
        gossip: GossipService,
        *,
        log_path: Path | None = None,
        wall_clock: Callable[[], float] = time.time,
        metrics_interval_s: float = 0.5,
        health_interval_s: float = 1.0,
        unhealthy_after: int = 3,
        kill_after_s: float = 10.0,
    ) -> None:
        self.command = command
        self.core = core
        self.gossip = gossip
        self.wall_clock = wall_clock
        self.metrics_interval_s = metrics_interval_s
        self.health_interval_s = health_interval_s
        self.unhealthy_after = unhealthy_after
        self.process = EngineProcess(command.argv, log_path=log_path, kill_after_s=kill_after_s)
        self.state = "loading"
        self.stopping = False
        self.scrapes = 0
        self.scrape_errors = 0

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            self.state, self.process.pid, self.process.returncode, self.scrapes, self.scrape_errors
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
            await nursery.start(self.process.run)
            task_status.started()
            nursery.start_soon(self._serve, client, nursery.cancel_scope)
            await self.process.exited.wait()
            if not self.stopping:
                self._mark_down(f"engine exited with status {self.process.returncode}")
            nursery.cancel_scope.cancel()

    async def stop(self) -> None:
        """Stop the child (after the agent signed LEFT): group SIGTERM, then SIGKILL."""
        self.stopping = True
        await self.process.stop()
        if self.state != "down":
            self.state = "stopped"

    async def _serve(self, client: httpx.AsyncClient, scope: trio.CancelScope) -> None:
        url = self.command.url
        try:
            models = await wait_ready(url, client=client, exited=self.process.exited)
        except EngineError:
            return  # the exit watcher marks DOWN
        if self.stopping:
            return
        self.core.update_self(
            self.wall_clock(),
            state=State.SERVING,
            models=tuple(ModelInfo(m.id, m.max_model_len) for m in models),
            engine=EngineInfo(self.command.kind, "", url),
        )
        self.gossip.poke()
        self.state = "serving"
        log.info("engine ready at %s: serving %s", url, ", ".join(m.id for m in models))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._scrape_metrics, client)
            await self._watch_health(client)
            nursery.cancel_scope.cancel()
        # Hung: DOWN first (routing stops at once), then stop the child; the exit watcher
        # will see it exit and leave DOWN as it is.
        self._mark_down(f"engine stopped answering {url}/health")
        self.stopping = True
        await self.process.stop()

    async def _watch_health(self, client: httpx.AsyncClient) -> None:
        failures = 0
        while failures < self.unhealthy_after:
            await trio.sleep(self.health_interval_s)
            try:
                r = await client.get(f"{self.command.url}/health", timeout=self.health_interval_s)
                failures = 0 if r.status_code == 200 else failures + 1
            except httpx.HTTPError:
                failures += 1

    async def _scrape_metrics(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                r = await client.get(f"{self.command.url}/metrics", timeout=2.0)
                r.raise_for_status()
                load = engine_load(parse_samples(r.text))
                self.scrapes += 1
                inflight = self.core.loads.get(self.core.self_id)
                self.core.publish_load(
                    self.wall_clock(),
                    waiting=load.waiting,
                    running=load.running,
                    kv_usage=min(1.0, max(0.0, load.kv_usage)),
                    inflight=inflight.inflight if inflight is not None else 0,
                )
                self.gossip.poke()
            except httpx.HTTPError:
                self.scrape_errors += 1
            await trio.sleep(self.metrics_interval_s)

    def _mark_down(self, why: str) -> None:
        if self.state == "down" or self.core.left:
            return
        self.state = "down"
        log.warning("%s: announcing DOWN", why)
        self.core.update_self(self.wall_clock(), state=State.DOWN)
        self.gossip.poke()
