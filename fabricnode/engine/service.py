"""The engine service: the supervised child's lifecycle, as the mesh sees it.

    spawn ── loading ──► /health + /v1/models answer ──► SERVING (models, engine kind, url)
                │                                         │ scrape /metrics every
                │                                         │ ``metrics_interval_s`` → load channel;
                │                                         │ re-read /v1/models every
                │                                         │ ``models_interval_s`` → entry's models
                └── exits, or hangs (no /health answer ───┴─► DOWN signed and pushed at once
                    and no progress: ``liveness``)

The model list is read again while the engine serves, so models that come and go at runtime
(LoRA adapters loaded and unloaded through vLLM's API) are in the entry within
``models_interval_s`` plus a gossip round; the entry is re-signed only when the list changed.
What the engine lists is bounded to what the entry can carry (``models.publishable``: extras
dropped with a reason, logged when the set of drops changes, counted in ``statistics``), and a
list that cannot be read (no answer, an error, not JSON, over ``MAX_LISTING_BYTES``, no model)
leaves the last good one in place.

A child exit is noticed through its pidfd the moment it happens, so DOWN reaches the mesh in
well under a second. A missed health check is not a death: ``liveness.EngineLiveness`` weighs
``unhealthy_after`` unanswered checks in a row against evidence of progress (the engine's
process group using CPU, its token counters moving). A busy engine stays SERVING, for at most
``busy_limit_s`` without an answer; only a hang (no answer and no progress, or busy past that)
is DOWN, with the verdict's reason on the entry and in the log, and the hung child is stopped.
On shutdown the agent signs LEFT first and calls ``begin_drain``, then ``stop`` once the drain
says so (``engine.drain``). While it drains, the engine is never stopped or restarted by this
service: Slurm signalled it too, so it refuses new connections (no answer to ``/health``, no
``/metrics``) and may use little CPU while it finishes its streams, which is not a hang.
``stop`` sends SIGTERM and waits ``kill_after_s`` before SIGKILL: by default the engine's own
shutdown grace (``command.shutdown_grace_s``) plus ``KILL_MARGIN_S``, at least
``MIN_KILL_AFTER_S``; a hung engine has nothing to finish and gets ``SHORT_KILL_AFTER_S``.

With ``sleep_after_s`` the serving engine is put to sleep after that long without requests and
woken by the next one (``sleep``: ``EngineSleep``; the agent hands ``wake`` to the data plane).

Restart policy (``restart``: ``no``, ``on-failure`` — a non-zero exit or a hang — or
``always``; at most ``max_restarts`` times, waiting ``restart_backoff_s`` times the attempt
number): a restarted engine is a new session. ``new_session`` (from the agent) retires the
old session as LEFT and continues under a fresh key from JOIN, so nothing the old engine
announced carries over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import trio

from fabricnode.engine.command import EngineCommand, option_values, shutdown_grace_s
from fabricnode.engine.kvreader import KvEventReader, KvEventStatistics
from fabricnode.engine.liveness import EngineLiveness, Health
from fabricnode.engine.metrics import engine_load, parse_samples, progress_total
from fabricnode.engine.models import (
    MAX_LISTING_BYTES,
    Listing,
    publishable,
    read_listing,
    room_for_models,
)
from fabricnode.engine.process import (
    SHORT_KILL_AFTER_S,
    EngineError,
    EngineProcess,
    group_cpu_seconds,
    wait_ready,
)
from fabricnode.engine.sleep import EngineSleep
from fabricnode.mesh.registry import MAX_LABEL_VALUE, EngineInfo, State
from fabricnode.mesh.schema import (
    ENGINE_ERROR_LABEL,
    PARENTS_LABEL,
    PRIORITY_SCHEDULING_LABEL,
    SERVING_SINCE_LABEL,
    SLEEPING_LABEL,
)
from fabricnode.mesh.service import GossipService

log = logging.getLogger("fabricnode.engine.service")

RESTART_POLICIES = ("no", "on-failure", "always")
MIN_KILL_AFTER_S = 10.0
KILL_MARGIN_S = 5.0  # past the engine's own grace: its teardown


def stop_timeout_s(command: EngineCommand) -> float:
    """How long ``stop`` waits after SIGTERM before SIGKILL: the engine's own shutdown grace
    and a margin, so the agent never undercuts it."""
    grace = shutdown_grace_s(command) or 0.0
    return max(MIN_KILL_AFTER_S, grace + KILL_MARGIN_S)


@dataclass(frozen=True)
class EngineStatistics:
    state: str  # loading | serving | down | stopped
    pid: int | None
    returncode: int | None
    scrapes: int
    scrape_errors: int
    model_reads: int  # model lists read while serving
    model_read_errors: int  # ... that could not be read (the last good list stayed)
    models_dropped: dict[str, int]  # reason -> models of the latest list the entry left out
    kv_events: KvEventStatistics | None = None  # its KV-cache events (None: not read)


class EngineService:
    def __init__(
        self,
        command: EngineCommand,
        gossip: GossipService,
        *,
        log_path: Path | None = None,
        metrics_interval_s: float = 0.5,
        models_interval_s: float = 2.0,
        health_interval_s: float = 1.0,
        unhealthy_after: int = 3,
        busy_limit_s: float = 120.0,
        kill_after_s: float | None = None,
        restart: str = "no",
        max_restarts: int = 3,
        restart_backoff_s: float = 1.0,
        new_session: Callable[[], None] | None = None,
        inflight: Callable[[], int] = lambda: 0,
        served: Callable[[], int] = lambda: 0,
        sleep_after_s: float | None = None,
        on_sleep_change: Callable[[bool], None] = lambda asleep: None,
        env: dict[str, str] | None = None,
        kv_reader: KvEventReader | None = None,
    ) -> None:
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart policy {restart!r} not in {RESTART_POLICIES}")
        self.command = command
        self.gossip = gossip
        self.metrics_interval_s = metrics_interval_s
        self.models_interval_s = models_interval_s
        self.health_interval_s = health_interval_s
        self.unhealthy_after = unhealthy_after
        self.busy_limit_s = busy_limit_s  # longest a busy engine may leave /health unanswered
        self.liveness = self._new_liveness()
        self.busy_episodes = 0  # times the engine was found busy, not dead
        self.log_path = log_path
        if kill_after_s is None:
            kill_after_s = stop_timeout_s(command)
        self.kill_after_s = kill_after_s
        self.restart = restart
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.new_session = new_session
        self.env = env  # the child's environment (None: the agent's)
        # Reads the engine's KV-cache events for as long as the service runs (``kvreader``).
        self.kv_reader = kv_reader
        self.inflight = inflight  # requests the agent has in flight to the engine
        self.served = served  # requests the agent has sent to the engine, ever
        self.sleep_after_s = sleep_after_s  # idle sleep (``sleep``); None: never
        self.on_sleep_change = on_sleep_change
        self.sleeper: EngineSleep | None = None  # the serving engine's, with sleep_after_s
        self.restarts = 0
        self.process = self._new_process()
        self.state = "loading"
        self.stopping = False
        self.draining = False  # the node leaves: only ``stop`` ends the engine now
        self.scrapes = 0
        self.scrape_errors = 0
        self.model_reads = 0
        self.model_read_errors = 0
        self.models_dropped: dict[str, int] = {}
        self._models_failing = False

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            self.state,
            self.process.pid,
            self.process.returncode,
            self.scrapes,
            self.scrape_errors,
            self.model_reads,
            self.model_read_errors,
            dict(self.models_dropped),
            self.kv_reader.statistics() if self.kv_reader is not None else None,
        )

    def _new_liveness(self) -> EngineLiveness:
        return EngineLiveness(
            unhealthy_after=self.unhealthy_after,
            busy_limit_s=self.busy_limit_s,
            progress_window_s=3 * self.health_interval_s + self.metrics_interval_s,
        )

    def _new_process(self) -> EngineProcess:
        listener = self.command.listener
        return EngineProcess(
            self.command.argv,
            log_path=self.log_path,
            env=self.env,
            kill_after_s=self.kill_after_s,
            pass_fds=(listener.fileno(),) if listener is not None else (),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        reader = self.kv_reader
        if reader is None:
            await self._supervise(task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await self._supervise(task_status=task_status)
            nursery.cancel_scope.cancel()

    async def _supervise(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        async with httpx.AsyncClient() as client:
            while True:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.process.run)
                    if not started:
                        task_status.started()
                        started = True
                    nursery.start_soon(self._serve, client)
                    await self.process.exited.wait()
                    nursery.cancel_scope.cancel()
                if self.stopping or self.draining:
                    return  # exited while the node drains (Slurm signalled it too): no restart
                code = self.process.returncode
                self._mark_down(f"engine exited with status {code}")
                if not self._should_restart(code):
                    return
                self.restarts += 1
                await trio.sleep(self.restart_backoff_s * self.restarts)
                if self.stopping:
                    return
                log.info("restarting the engine (%d of %d)", self.restarts, self.max_restarts)
                if self.new_session is not None:
                    self.new_session()
                self.state = "loading"
                if self.kv_reader is not None:
                    self.kv_reader.engine_restarted()
                self.process = self._new_process()
                self.liveness = self._new_liveness()

    def _should_restart(self, code: int | None) -> bool:
        if self.restarts >= self.max_restarts or self.restart == "no":
            return False
        return self.restart == "always" or code != 0

    def begin_drain(self) -> None:
        """The node leaves: from now on the engine is stopped by ``stop`` only (no verdict of
        the health checks stops it, no exit restarts it)."""
        self.draining = True

    async def stop(self) -> None:
        """Stop the child (after the agent signed LEFT): group SIGTERM, then SIGKILL."""
        self.stopping = True
        await self.process.stop()
        if self.state != "down":
            self.state = "stopped"

    async def _serve(self, client: httpx.AsyncClient) -> None:
        url = self.command.url
        try:
            models = await wait_ready(url, client=client, exited=self.process.exited)
        except EngineError:
            return  # the exit watcher marks DOWN
        if self.stopping or self.draining:
            return
        version = await self._engine_version(client)
        changes = self._models_changes(Listing(tuple(models), 0))
        labels = self._priority_labels(changes.get("labels"))
        # when this session first served: the controller learns a job's start-up time from it
        # (also after a takeover, for jobs its predecessor submitted)
        since = f"{self.gossip.wall_clock():.3f}"
        kept = [kv for kv in labels if kv[0] != SERVING_SINCE_LABEL]
        changes["labels"] = tuple(sorted([*kept, (SERVING_SINCE_LABEL, since)]))
        self.gossip.update_self(
            state=State.SERVING, engine=EngineInfo(self.command.kind, version, url), **changes
        )
        self.state = "serving"
        served = self.gossip.core.self_entry.body.models
        log.info("engine ready at %s: serving %s", url, ", ".join(m.id for m in served))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._scrape_metrics, client)
            nursery.start_soon(self._refresh_models, client)
            if self.sleep_after_s is not None:
                self.sleeper = EngineSleep(
                    url,
                    self.gossip,
                    sleep_after_s=self.sleep_after_s,
                    inflight=self.inflight,
                    served=self.served,
                    on_change=self.on_sleep_change,
                )
                nursery.start_soon(self.sleeper.run, client)
            why = await self._watch_health(client)
            nursery.cancel_scope.cancel()
        # Hung: DOWN first (routing stops at once), then stop the child; the exit watcher
        # will see it exit and leave DOWN as it is.
        self._mark_down(f"engine hung: {why}")
        await self.process.stop(min(self.kill_after_s, SHORT_KILL_AFTER_S))  # no grace to honour

    async def wake(self) -> bool:
        """Wake the engine if it sleeps (``sleep.EngineSleep.wake``); True once awake."""
        sleeper = self.sleeper
        return True if sleeper is None else await sleeper.wake()

    async def _engine_version(self, client: httpx.AsyncClient) -> str:
        """``/version`` as vLLM (and the simulated engine) answer it; "" when not offered."""
        try:
            r = await client.get(f"{self.command.url}/version", timeout=2.0)
            version = r.json().get("version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return ""
        return version[:64] if isinstance(version, str) else ""

    async def _watch_health(self, client: httpx.AsyncClient) -> str:
        """Probe ``/health`` every ``health_interval_s`` and weigh each miss against the
        engine's progress (``liveness``) until it is hung; returns why."""
        liveness = self.liveness
        busy = False
        quiet = False  # logged that a draining engine stopped answering
        while True:
            await trio.sleep(self.health_interval_s)
            try:
                r = await client.get(f"{self.command.url}/health", timeout=self.health_interval_s)
                if r.status_code == 200:
                    liveness.answered(trio.current_time())
                else:
                    liveness.unanswered(trio.current_time(), f"answered {r.status_code}")
            except httpx.HTTPError as exc:
                liveness.unanswered(trio.current_time(), type(exc).__name__)
            pid = self.process.pid
            if liveness.failures and pid is not None:
                cpu = await trio.to_thread.run_sync(group_cpu_seconds, pid)
                liveness.cpu(trio.current_time(), cpu)
            verdict = liveness.verdict(trio.current_time())
            if self.draining:
                if verdict.health is not Health.HEALTHY and not quiet:
                    quiet = True
                    log.info(
                        "engine %s; the node drains: the engine is shutting down on its own "
                        "signal and is left to finish its requests",
                        verdict.reason,
                    )
                continue
            if verdict.health is Health.HUNG:
                return verdict.reason
            if verdict.health is Health.BUSY and not busy:
                self.busy_episodes += 1
                log.warning("engine %s", verdict.reason)
            elif verdict.health is Health.HEALTHY and busy:
                log.info("engine answers /health again")
            busy = verdict.health is Health.BUSY

    def _quantization(self) -> str | None:
        quant = option_values(self.command.argv, "--quantization", "-q")
        return quant[-1][:64] if quant else None

    def _priority_labels(self, labels: object) -> tuple[tuple[str, str], ...]:
        """``labels`` (the entry's when None) with ``fabric.priority_scheduling`` set as the
        engine command says (``EngineCommand.priority_scheduling``): the ingresses put the
        priority of batch-tier requests only into requests for such engines."""
        if not isinstance(labels, tuple):
            labels = self.gossip.core.self_entry.body.labels
        kept = [kv for kv in labels if kv[0] != PRIORITY_SCHEDULING_LABEL]
        if self.command.priority_scheduling:
            kept.append((PRIORITY_SCHEDULING_LABEL, "1"))
        return tuple(sorted(kept))

    def _models_changes(self, listing: Listing) -> dict[str, object]:
        """The entry's ``models`` and labels for ``listing``; empty when they would not change
        or the listing has no model the entry can carry (the last good list stays)."""
        body = self.gossip.core.self_entry.body
        pub = publishable(
            listing, quantization=self._quantization(), room_bytes=room_for_models(body)
        )
        if pub.dropped != self.models_dropped:
            if pub.dropped:
                log.warning(
                    "the entry leaves out models the engine lists: %s (registry limits)",
                    ", ".join(f"{n} {reason}" for reason, n in sorted(pub.dropped.items())),
                )
            self.models_dropped = pub.dropped
        if not pub.models:
            return {}
        parents = tuple(kv for kv in body.labels if kv[0] == PARENTS_LABEL)
        if pub.models == body.models and pub.labels == parents:
            return {}
        others = [kv for kv in body.labels if kv[0] != PARENTS_LABEL]
        return {"models": pub.models, "labels": tuple(sorted([*others, *pub.labels]))}

    async def _refresh_models(self, client: httpx.AsyncClient) -> None:
        """Re-read the engine's model list every ``models_interval_s``; re-sign on a change."""
        while True:
            await trio.sleep(self.models_interval_s)
            listing = await self._read_models(client)
            if listing is None or self.state != "serving" or self.gossip.core.left:
                continue
            self.model_reads += 1
            before = {m.id for m in self.gossip.core.self_entry.body.models}
            changes = self._models_changes(listing)
            if not changes:
                continue
            try:
                self.gossip.update_self(**changes)
            except ValueError as exc:  # an entry over its size: kept as it was
                self.model_read_errors += 1
                log.warning("model list not published: %s", exc)
                continue
            after = {m.id for m in self.gossip.core.self_entry.body.models}
            log.info(
                "engine models changed: +[%s] -[%s]",
                ", ".join(sorted(after - before)),
                ", ".join(sorted(before - after)),
            )

    async def _read_models(self, client: httpx.AsyncClient) -> Listing | None:
        """The engine's ``/v1/models``, or None when it cannot be read or lists no model."""
        try:
            listing = read_listing(orjson.loads(await self._get_listing(client)))
            why = "" if listing.models else "no model listed"
        except EngineError as exc:
            why = str(exc)
        except (httpx.HTTPError, ValueError) as exc:  # orjson's errors are ValueErrors
            why = type(exc).__name__
        if why:
            self.model_read_errors += 1
            if not self._models_failing:
                log.warning("engine model list unreadable (%s): keeping the last one", why)
            self._models_failing = True
            return None
        if self._models_failing:
            log.info("engine model list readable again")
        self._models_failing = False
        return listing

    async def _get_listing(self, client: httpx.AsyncClient) -> bytes:
        """The body of ``GET /v1/models``; EngineError past ``MAX_LISTING_BYTES`` or not 200."""
        timeout = min(5.0, max(1.0, self.models_interval_s))
        async with client.stream("GET", f"{self.command.url}/v1/models", timeout=timeout) as r:
            if r.status_code != 200:
                raise EngineError(f"answered {r.status_code}")
            data = bytearray()
            async for chunk in r.aiter_bytes():
                data += chunk
                if len(data) > MAX_LISTING_BYTES:
                    raise EngineError(f"larger than {MAX_LISTING_BYTES} bytes")
            return bytes(data)

    async def _scrape_metrics(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                r = await client.get(f"{self.command.url}/metrics", timeout=2.0)
                r.raise_for_status()
                samples = parse_samples(r.text)
                load = engine_load(samples)
                self.liveness.counters(trio.current_time(), progress_total(samples))
                self.scrapes += 1
                self.gossip.publish_load(
                    waiting=load.waiting,
                    running=load.running,
                    kv_usage=min(1.0, max(0.0, load.kv_usage)),
                    inflight=self.inflight(),
                )
            except httpx.HTTPError:
                self.scrape_errors += 1
            await trio.sleep(self.metrics_interval_s)

    def _mark_down(self, why: str) -> None:
        if self.state == "down" or self.gossip.core.left:
            return
        self.state = "down"
        log.warning("%s: announcing DOWN", why)
        said = self.process.last_error()
        error = f"{why}: {said}" if said else why
        # the engine's own words on the entry: the controller reports them for a failed start
        labels = [
            (k, v)
            for k, v in self.gossip.core.self_entry.body.labels
            if k not in (ENGINE_ERROR_LABEL, SLEEPING_LABEL)
        ]
        labels.append((ENGINE_ERROR_LABEL, error[:MAX_LABEL_VALUE]))  # what every peer decodes
        self.gossip.update_self(state=State.DOWN, labels=tuple(sorted(labels)))
