"""The agent: composition root of one ``fabric start`` process.

It builds every service from one ``AgentConfig`` and owns them in one trio nursery:
the UDP+TCP gossip transport, the ``GossipService`` driving the ``MeshCore`` (which re-reads the
cluster keyring file when it changes, so rotation needs no restart), the admin API on hypercorn,
a rendezvous watcher and a liveness logger. Services start with ``nursery.start`` and report
ready through ``task_status``; cancellation of the nursery stops them all.

Joining: the agent appends its gossip address to the rendezvous file *before* reading it, so of
any two agents starting together the later one always sees the earlier one and they cannot form
two separate meshes. Seeds are the ``--join`` addresses plus the addresses read from the file;
while it knows no reachable member it re-reads the file every ``rendezvous_poll_s``.

Ready lines. Once every listener is bound the entry point prints to stdout, flushed, exactly::

    fabric: session <32 hex session id>
    fabric: http http://<advertised host>:<port>
    fabric: admin http://<advertised host>:<port>     (only with --admin)
    fabric: gossip <advertised host>:<port>

in that order: ``gossip`` is always the last line, so a reader can stop there
(``parse_ready_lines`` is the matching parser). Nothing else is ever written to stdout; logs
(stdlib ``logging``, each line tagged with the short session id) go to stderr.

Leaving: SIGTERM or SIGINT → sign LEFT, push it directly to several members and gossip it for
``leave_linger_s`` → stop the HTTP servers (in-flight requests get ``http_shutdown_grace_s``) →
exit 0. A second signal while leaving stops at once.

Inside a Slurm job whose end time is known the agent also leaves on its own, by the same path,
``leave_before_end_s`` before the end (``slurm_env.plan_leave``; at most half the time the job
has left): Slurm's own warning (``#SBATCH --signal``) is only delivered at slurmctld's periodic
time-limit check, and the SIGTERM at the time limit leaves only ``KillWait`` to drain. Just
before leaving it asks scontrol for the end time again, and waits longer if the limit was
extended. A SIGTERM that arrives after such a leave began is the first signal, not a second.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import trio

from fabricnode import native
from fabricnode.addr import join_hostport
from fabricnode.asgi import bind_http_socket, serve_http
from fabricnode.config import AgentConfig
from fabricnode.control.app import AdminApp
from fabricnode.control.views import liveness_of
from fabricnode.dataplane.accounting import RequestLog
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.dataplane.ingress import Ingress
from fabricnode.engine.command import EngineCommand
from fabricnode.engine.service import EngineService
from fabricnode.errors import ConfigError, FabricError
from fabricnode.host.hardware import default_host
from fabricnode.host.hardware import discover as discover_gpus
from fabricnode.host.rendezvous import announce, read_peers
from fabricnode.host.slurm import (
    LeavePlan,
    SlurmJob,
    discover_job,
    plan_leave,
    query_end_time,
    replan_leave,
)
from fabricnode.mesh.assignment import SignedAssignment
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity, ProviderKey
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import Addresses, EngineInfo, EntryBody, Hardware, State
from fabricnode.mesh.service import GossipService, UdpTcpTransport

if TYPE_CHECKING:
    pass

log = logging.getLogger("fabricnode.agent")

READY_PREFIX = "fabric: "
LIVENESS_LOG_INTERVAL_S = 1.0
ASSIGNMENT_POLL_S = 0.25  # how fast a JOIN-only node notices an assignment for it


# -- ready lines ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentAddresses:
    """Where a running agent can be reached (advertised addresses, actual ports)."""

    session_id: str
    http_url: str
    gossip_addr: str
    admin_url: str | None = None


def ready_lines(addrs: AgentAddresses) -> list[str]:
    lines = [f"{READY_PREFIX}session {addrs.session_id}", f"{READY_PREFIX}http {addrs.http_url}"]
    if addrs.admin_url:
        lines.append(f"{READY_PREFIX}admin {addrs.admin_url}")
    lines.append(f"{READY_PREFIX}gossip {addrs.gossip_addr}")
    return lines


def parse_ready_lines(text: str) -> AgentAddresses | None:
    """The addresses printed by a ready agent, or None until its ``gossip`` line is there."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith(READY_PREFIX):
            continue
        key, _, value = line[len(READY_PREFIX) :].partition(" ")
        found[key] = value.strip()
        if key == "gossip":
            return AgentAddresses(
                found.get("session", ""), found.get("http", ""), value.strip(), found.get("admin")
            )
    return None


# -- readiness --------------------------------------------------------------------------------


class JoinTracker:
    """Decides when the agent counts as joined (``/ready``); once joined it stays joined.

    Joined means: some other member answered (we know one alive), or there was nobody to join
    (no seeds at start: we are the first), or ``timeout_s`` passed without an answer — every seed
    was a stale rendezvous line, so we are the founder of a new mesh and should serve anyway.
    """

    def __init__(
        self,
        core: MeshCore,
        *,
        had_seeds: bool,
        started_at: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.had_seeds = had_seeds
        self.started_at = started_at
        self.timeout_s = timeout_s
        self.clock = clock
        self.reason = ""

    def is_ready(self) -> bool:
        if self.reason:
            return True
        if not self.had_seeds:
            self.reason = "no peers to join: starting a new mesh"
        elif any(m.status == Liveness.ALIVE for m in self.core.members.members.values()):
            self.reason = "joined the mesh"
        elif self.clock() - self.started_at >= self.timeout_s:
            self.reason = f"no peer answered in {self.timeout_s:g} s: starting a new mesh"
        return bool(self.reason)


# -- HTTP -------------------------------------------------------------------------------------


# -- the agent --------------------------------------------------------------------------------


class Agent:
    """One agent process's services; ``run`` owns them all."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        identity: Identity | None = None,
        wall_clock: Callable[[], float] = time.time,
        job_end_now: Callable[[str], float | None] = query_end_time,
    ) -> None:
        self.config = config
        self.identity = identity or Identity.generate()
        self.wall_clock = wall_clock
        self.job_end_now = job_end_now  # blocking (scontrol): called in a thread
        self.leave_plan: LeavePlan | None = None
        # Load the keyring now, before any socket exists: a missing key is the most common
        # mistake and deserves one clear line (KeyFileError names `fabric keys new-cluster`).
        self.keyring = Keyring.load(config.cluster_key_path)
        self.provider_key = (
            ProviderKey.load(config.provider_key_path) if config.provider_key_path else None
        )
        # A malformed API keys file stops the start: an ingress must not run open by mistake.
        self.api_keys = ApiKeyStore.load(config.api_keys_path) if config.api_keys_path else None
        self.ingress: Ingress | None = None
        self.core: MeshCore | None = None
        self.gossip: GossipService | None = None
        self.tracker: JoinTracker | None = None
        self.engine: EngineService | None = None
        self.plan_labels: tuple[tuple[str, str], ...] = ()  # set once an assignment arrives
        self._stop = trio.Event()
        self._finished = trio.Event()
        self._ingress_done = trio.Event()

    @property
    def session_id(self) -> str:
        return self.identity.session_id

    def request_stop(self) -> None:
        """Begin a graceful leave (safe to call before ``run`` has started)."""
        self._stop.set()

    async def wait_finished(self) -> None:
        """Return once ``run`` has returned (after the leave) or failed."""
        await self._finished.wait()

    def join_body(
        self,
        now: float,
        http_url: str,
        gossip_addr: str,
        hardware: Hardware | None = None,
        job: SlurmJob | None = None,
    ) -> EntryBody:
        cfg = self.config
        expires = now + min(cfg.mesh.entry_ttl_s, cfg.mesh.registry.max_entry_ttl_s)
        labels = [*cfg.labels, *self.plan_labels]
        if job is not None:
            labels += [("slurm.job_id", job.job_id), ("slurm.partition", job.partition)]
            if job.end_time is not None and job.end_time > now:
                # The lease never outlives the job; MeshCore renews it up to this cap.
                labels.append(("fabric.job_end", f"{job.end_time:.0f}"))
                expires = min(expires, job.end_time)
        provider, cert = cfg.provider, None
        if self.provider_key is not None:
            key = self.provider_key
            provider = key.provider  # the certified name, whatever --provider said
            cert = key.certify(self.identity.public_key, now + cfg.provider_cert_ttl_s)
        return EntryBody(
            session_id=self.identity.session_id,
            public_key=self.identity.public_key,
            state=State.JOIN,
            version=1,
            provider=provider,
            addresses=Addresses(http=http_url, gossip=gossip_addr),
            hardware=hardware or Hardware(host=default_host(self.config.host_env)),
            engine=EngineInfo(),
            models=(),
            labels=tuple(labels),
            started_at=now,
            updated_at=now,
            expires_at=expires,
            provider_cert=cert,
        )

    def discover_host(self) -> tuple[Hardware, SlurmJob | None]:
        """GPUs and Slurm job of this process (runs nvidia-smi/scontrol: call in a thread)."""
        env = self.config.host_env
        gpus = discover_gpus(env, host=default_host(env), sim_gpu=self.config.sim_gpu)
        return gpus.to_hardware(), discover_job(env)

    async def run(
        self, *, task_status: trio.TaskStatus[AgentAddresses] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await self._run(task_status)
        finally:
            self._finished.set()

    async def _run(self, task_status: trio.TaskStatus[AgentAddresses]) -> None:
        cfg = self.config
        transport = await UdpTcpTransport.bind(cfg.gossip_host, cfg.gossip_port, cfg.advertise_host)
        gossip_addr = transport.local_addr
        http_sock = bind_http_socket(cfg.http_host, cfg.http_port, "--http")
        http_url = _url(cfg.advertise_host, http_sock)
        admin_sock: socket.socket | None = None
        admin_url: str | None = None
        if cfg.admin_host is not None and cfg.admin_port is not None:
            admin_sock = bind_http_socket(cfg.admin_host, cfg.admin_port, "--admin")
            admin_url = _url(cfg.advertise_host, admin_sock)

        hardware, job = await trio.to_thread.run_sync(self.discover_host)
        now = self.wall_clock()
        body = self.join_body(now, http_url, gossip_addr, hardware, job)
        core = MeshCore(self.identity, self.keyring, body, now, cfg.mesh)
        gossip = GossipService(
            core,
            transport,
            wall_clock=self.wall_clock,
            keyring_path=cfg.cluster_key_path,
            keyring_poll_s=cfg.keyring_poll_s,
        )
        seeds = [*cfg.join, *await self._announce_and_read(gossip_addr)]
        core.bootstrap(seeds)
        tracker = JoinTracker(
            core, had_seeds=bool(seeds), started_at=time.monotonic(), timeout_s=cfg.join_timeout_s
        )
        self.core, self.gossip, self.tracker = core, gossip, tracker
        log.info(
            "session %s provider %s gossip %s http %s seeds %d",
            core.self_id,
            cfg.provider,
            gossip_addr,
            http_url,
            len(seeds),
        )
        log.info("data plane %s", native.status)

        def new_session() -> None:
            # A restarted engine is a new session: fresh key, fresh entry from JOIN.
            self.identity = Identity.generate()
            now = self.wall_clock()
            body = self.join_body(now, http_url, gossip_addr, hardware, job)
            core.new_session(self.identity, body, now)
            gossip.poke()
            log.info("new session %s for the restarted engine", self.identity.session_id)

        # The ingress first: it asks for the engine lazily (``self.engine`` when a request
        # comes), and the engine reports the ingress's local in-flight count as its load.
        def serving_engine_url() -> str | None:
            engine = self.engine
            if engine is None or engine.state != "serving" or core.left:
                return None
            return engine.command.url

        request_log = RequestLog(cfg.request_log_path) if cfg.request_log_path else None
        ingress = Ingress(
            core,
            config=cfg.ingress,
            wall_clock=self.wall_clock,
            serving_engine_url=serving_engine_url,
            api_keys=self.api_keys,
            request_log=request_log,
        )
        self.ingress = ingress

        def engine_service(command: EngineCommand) -> EngineService:
            return EngineService(
                command,
                core,
                gossip,
                log_path=self._engine_log_path(core.self_id),
                wall_clock=self.wall_clock,
                restart=cfg.restart,
                max_restarts=cfg.max_restarts,
                new_session=new_session,
                inflight=lambda: ingress.local_inflight,
            )

        # Without an engine command the node stays JOIN-only until an operator's assignment
        # gives it one (``_await_assignment``); everything below reads ``self.engine``.
        self.engine = engine_service(cfg.engine) if cfg.engine is not None else None

        def ready() -> bool:
            engine = self.engine
            return tracker.is_ready() and (engine is None or engine.state == "serving")

        def app(agent_endpoints: bool) -> AdminApp:
            return AdminApp(
                core,
                is_ready=ready,
                transport=transport,
                keyring=gossip,
                wall_clock=self.wall_clock,
                agent_endpoints=agent_endpoints,
                extra_metrics=ingress.render_metrics,
                request_log_path=cfg.request_log_path,
            )

        # The public port is the data plane; paths outside /v1 go to the control app inline.
        # With --admin the agent endpoints move to a hypercorn port of their own and the public
        # port keeps only health/ready.
        ingress.control_app = app(admin_sock is None)
        http_shutdown = trio.Event()
        admin_done = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(transport.run)
            await nursery.start(gossip.run)
            grace = cfg.http_shutdown_grace_s
            nursery.start_soon(self._serve_ingress, ingress, http_sock, http_shutdown, grace)
            if admin_sock is not None:
                await nursery.start(
                    serve_http, app(True), admin_sock, http_shutdown, grace, admin_done
                )
            else:
                admin_done.set()
            if self.api_keys is not None:
                nursery.start_soon(self._reload_api_keys, self.api_keys)
            if request_log is not None:
                nursery.start_soon(self._flush_request_log, ingress, request_log)
            if self.engine is not None:
                await nursery.start(self.engine.run)
            else:
                nursery.start_soon(
                    self._await_assignment, nursery, core, gossip, hardware, engine_service
                )
            nursery.start_soon(self._watch_rendezvous, core, gossip, gossip_addr)
            nursery.start_soon(self._log_changes, core, tracker)
            if job is not None:
                self.leave_plan = self._plan_leave(job, now)
                if self.leave_plan is not None:
                    nursery.start_soon(self._leave_before_end, self.leave_plan, job.job_id)
                if job.end_time is not None:
                    nursery.start_soon(self._follow_job_end, core, gossip, job)
            task_status.started(AgentAddresses(core.self_id, http_url, gossip_addr, admin_url))

            await self._stop.wait()
            # Order matters: refuse new forwards (ingresses fail over, invisibly to clients),
            # sign LEFT (peers stop routing to us), let what our engine accepted finish, stop
            # the engine, then close the doors.
            ingress.leaving = True
            log.info("leaving: signing LEFT and spreading it for %g s", cfg.leave_linger_s)
            await gossip.leave(cfg.leave_linger_s)
            engine = self.engine
            if engine is not None:
                with trio.move_on_after(cfg.drain_timeout_s) as drain:
                    await ingress.wait_local_idle()
                if drain.cancelled_caught:
                    log.warning(
                        "%d requests still running after %g s: stopping the engine anyway",
                        ingress.local_inflight,
                        cfg.drain_timeout_s,
                    )
                await engine.stop()
            http_shutdown.set()
            with trio.move_on_after(cfg.http_shutdown_grace_s + 1.0):
                await self._ingress_done.wait()
                await admin_done.wait()
            if request_log is not None:
                ingress.settle()
                await trio.to_thread.run_sync(request_log.flush)
            nursery.cancel_scope.cancel()
        log.info("left the mesh")

    async def _serve_ingress(
        self, ingress: Ingress, sock: socket.socket, shutdown: trio.Event, grace_s: float
    ) -> None:
        try:
            await ingress.serve(sock, shutdown, grace_s)
        finally:
            self._ingress_done.set()

    async def _reload_api_keys(self, store: ApiKeyStore) -> None:
        """Pick up ``fabric keys api-*`` edits of the keys file without a restart."""
        while True:
            await trio.sleep(self.config.keyring_poll_s)
            if await trio.to_thread.run_sync(store.maybe_reload):
                log.info("API keys reloaded from %s", store.path)

    async def _flush_request_log(self, ingress: Ingress, request_log: RequestLog) -> None:
        while True:
            await trio.sleep(self.config.request_log_flush_s)
            ingress.settle()  # every request answered so far is in the log
            await trio.to_thread.run_sync(request_log.flush)

    async def _await_assignment(
        self,
        nursery: trio.Nursery,
        core: MeshCore,
        gossip: GossipService,
        hardware: Hardware,
        engine_service: Callable[[EngineCommand], EngineService],
    ) -> None:
        """JOIN-only node: launch the engine an operator assigns us (``fabric plan --apply``).

        The outcome is published as labels on our entry (``fabric.plan``, ``fabric.plan_status``)
        so the operator sees it with ``fabric nodes`` / ``fabric plan --apply`` without logging
        in here. Acts once: a running engine is never replaced by a later plan.
        """
        template = self.config.engine_template
        seen: SignedAssignment | None = None
        while not self._stop.is_set():
            await trio.sleep(ASSIGNMENT_POLL_S)
            item = core.assignments.get(core.self_id)
            if item is None or item is seen or core.left:
                continue
            seen = item
            a = item.body
            where = f"plan {a.plan_id}: {a.model} tp={a.tp} dp={a.dp}"
            if template is None:
                log.warning("%s assigned to us, but this agent has no --engine-template", where)
                self._set_plan_labels(core, gossip, a.plan_id, "no engine template")
                continue
            if a.gpus > max(1, hardware.gpu_count):
                log.warning("%s needs %d GPUs; this node has %d", where, a.gpus, hardware.gpu_count)
                self._set_plan_labels(core, gossip, a.plan_id, f"needs {a.gpus} GPUs")
                continue
            try:
                command = template.render(a.model, a.tp, a.dp, hardware.gpu_type)
            except ConfigError as exc:
                log.warning("%s: cannot render the engine template: %s", where, exc)
                self._set_plan_labels(core, gossip, a.plan_id, f"error: {exc}"[:200])
                continue
            log.info("%s from operator %s: starting %s", where, item.operator, command.argv)
            self._set_plan_labels(core, gossip, a.plan_id, "launching")
            self.engine = engine_service(command)
            await nursery.start(self.engine.run)
            return

    def _set_plan_labels(
        self, core: MeshCore, gossip: GossipService, plan_id: str, status: str
    ) -> None:
        self.plan_labels = (("fabric.plan", plan_id), ("fabric.plan_status", status))
        self._relabel(core, gossip, "fabric.plan", self.plan_labels)

    def _relabel(
        self,
        core: MeshCore,
        gossip: GossipService,
        prefix: str,
        labels: tuple[tuple[str, str], ...],
    ) -> None:
        """Re-sign our entry with its labels under ``prefix`` replaced by ``labels``."""
        kept = [(k, v) for k, v in core.self_entry.body.labels if not k.startswith(prefix)]
        core.update_self(self.wall_clock(), labels=tuple(sorted([*kept, *labels])))
        gossip.poke()

    def _plan_leave(self, job: SlurmJob, now: float) -> LeavePlan | None:
        margin = self.config.leave_before_end_s
        plan = plan_leave(job.end_time, margin, now)
        if plan is None:
            why = "leave margin off" if job.end_time is not None else "its end time is unknown"
            log.info("Slurm job %s: %s; leaving on SIGTERM only", job.job_id, why)
            return None
        note = ", half the time it has left" if plan.shortened else ""
        log.info(
            "Slurm job %s ends in %.0f s: leaving %.0f s before its end%s (--leave-before-end %g)",
            job.job_id,
            plan.end_time - now,
            plan.margin_s,
            note,
            margin,
        )
        return plan

    async def _leave_before_end(self, plan: LeavePlan, job_id: str) -> None:
        async def end_now() -> float | None:
            return await trio.to_thread.run_sync(self.job_end_now, job_id)

        plan = await wait_leave_time(plan, wall_clock=self.wall_clock, end_time_now=end_now)
        self.leave_plan = plan
        if not self._stop.is_set():
            log.info(
                "Slurm job %s ends in %.0f s: leaving the mesh before it is killed",
                job_id,
                plan.end_time - self.wall_clock(),
            )
            self.request_stop()

    async def _follow_job_end(self, core: MeshCore, gossip: GossipService, job: SlurmJob) -> None:
        """The registry lease is capped at the job's end (label ``fabric.job_end``): move the
        cap when the time limit changes, or peers drop us at the old end while we still serve."""
        assert job.end_time is not None

        async def end_now() -> float | None:
            return await trio.to_thread.run_sync(self.job_end_now, job.job_id)

        def moved(end_time: float) -> None:
            self._relabel(core, gossip, "fabric.job_end", (("fabric.job_end", f"{end_time:.0f}"),))

        await follow_job_end(
            job.end_time, wall_clock=self.wall_clock, end_time_now=end_now, on_change=moved
        )

    def _engine_log_path(self, session_id: str) -> Path | None:
        if self.config.job_log_dir is not None:
            return self.config.job_log_dir / "engine.log"
        if self.config.log_dir is None:
            return None
        return self.config.log_dir / f"{self.config.job_id}-{session_id[:8]}" / "engine.log"

    async def _announce_and_read(self, gossip_addr: str) -> list[str]:
        path = self.config.rendezvous_path
        if path is None:
            return []
        try:
            await trio.to_thread.run_sync(announce, path, gossip_addr, self.identity.session_id)
        except OSError as exc:
            log.warning("cannot announce in rendezvous file %s: %s", path, exc)
        return await trio.to_thread.run_sync(_read_peers, path, gossip_addr)

    async def _watch_rendezvous(self, core: MeshCore, gossip: GossipService, own: str) -> None:
        """While isolated, look for newly announced peers (agents that started after us)."""
        path = self.config.rendezvous_path
        if path is None:
            return
        while True:
            await trio.sleep(self.config.rendezvous_poll_s)
            if core.left or core.members.reachable():
                continue
            peers = await trio.to_thread.run_sync(_read_peers, path, own)
            if peers:
                core.bootstrap(peers)
                gossip.poke()

    async def _log_changes(self, core: MeshCore, tracker: JoinTracker) -> None:
        """Log joins and every change of a member's lifecycle state or liveness."""
        seen: dict[str, tuple[str, str]] = {}
        was_ready = False
        while True:
            if not was_ready and tracker.is_ready():
                was_ready = True
                log.info("ready: %s", tracker.reason)
            current: dict[str, tuple[str, str]] = {}
            for entry in core.registry:
                sid = entry.session_id
                if sid == core.self_id:
                    continue
                current[sid] = (entry.body.state.label, liveness_of(core, entry).label)
                if seen.get(sid) != current[sid]:
                    state, liveness = current[sid]
                    log.info("member %s %s: %s, %s", sid[:8], entry.body.provider, state, liveness)
            for sid in seen.keys() - current.keys():
                log.info("member %s forgotten", sid[:8])
            seen = current
            await trio.sleep(LIVENESS_LOG_INTERVAL_S)


async def wait_leave_time(
    plan: LeavePlan,
    *,
    wall_clock: Callable[[], float],
    end_time_now: Callable[[], Awaitable[float | None]],
    max_sleep_s: float = 30.0,
) -> LeavePlan:
    """Return at ``plan.leave_at`` by ``wall_clock`` (re-read at least every ``max_sleep_s``, so
    a stepped or suspended clock is noticed), after asking ``end_time_now`` whether the job's
    end moved: an extended time limit re-plans and waits again. Returns the plan acted on."""
    while True:
        delay = plan.leave_at - wall_clock()
        if delay > 0:
            await trio.sleep(min(delay, max_sleep_s))
            continue
        later = replan_leave(plan, await end_time_now(), wall_clock())
        if later is None:
            return plan
        log.info(
            "the job's time limit was extended by %.0f s: leaving later",
            later.end_time - plan.end_time,
        )
        plan = later


async def follow_job_end(
    end_time: float,
    *,
    wall_clock: Callable[[], float],
    end_time_now: Callable[[], Awaitable[float | None]],
    on_change: Callable[[float], None],
    min_poll_s: float = 30.0,
    max_sleep_s: float = 1800.0,
) -> None:
    """Keep the lease cap on the job's end when an admin changes the time limit.

    Asks ``end_time_now`` (scontrol) at half the time left, at least ``min_poll_s`` apart and
    at most ``max_sleep_s`` apart (a few queries per job, more only near its end), and calls
    ``on_change`` with the new end when it moved. Returns once the known end has passed.
    """
    while True:
        left = end_time - wall_clock()
        if left <= 0:
            return
        await trio.sleep(min(max(left / 2, min_poll_s), max_sleep_s, left))
        found = await end_time_now()
        if found is not None and abs(found - end_time) >= 1.0:
            log.info("the job's end moved by %+.0f s: the entry's lease follows", found - end_time)
            end_time = found
            on_change(found)


def _read_peers(path: Path, own: str) -> list[str]:
    return read_peers(path, exclude=own)


def _url(advertise_host: str, sock: socket.socket) -> str:
    return f"http://{join_hostport(advertise_host, sock.getsockname()[1])}"


# -- process entry ----------------------------------------------------------------------------


class _SessionFilter(logging.Filter):
    def __init__(self, session: str) -> None:
        super().__init__()
        self.session = session

    def filter(self, record: logging.LogRecord) -> bool:
        record.session = self.session
        return True


def configure_logging(level: str, session_id: str, stream: TextIO | None = None) -> None:
    """Log lines to stderr, each tagged with the short session id (``fabric start`` only)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_SessionFilter(session_id[:8]))
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s [%(session)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("hypercorn.error").setLevel(max(root.level, logging.WARNING))
    # httpx logs every engine health/metrics poll at INFO: twice a second of noise.
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))


def run_agent(config: AgentConfig, *, out: TextIO | None = None) -> int:
    """Run one agent until SIGTERM/SIGINT, then leave gracefully; returns the exit status.

    Prints the ready lines (module docstring) to ``out`` (stdout). ``FabricError`` (bad key
    file, port in use, ...) propagates for the caller to show as one line.
    """
    agent = Agent(config)  # a bad key file fails here, before logging is set up
    configure_logging(config.log_level, agent.session_id)
    try:
        trio.run(_main, agent, out or sys.stdout)
    except BaseExceptionGroup as group:
        error = _first_fabric_error(group)
        if error is not None:
            raise error from None
        raise
    return 0


async def _main(agent: Agent, out: TextIO) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_handle_signals, signals, agent, nursery.cancel_scope)
            addrs = await nursery.start(agent.run)
            for line in ready_lines(addrs):
                print(line, file=out)
            out.flush()
            await agent.wait_finished()
            nursery.cancel_scope.cancel()  # the signal handler task


async def _handle_signals(
    signals: AsyncIterator[int], agent: Agent, scope: trio.CancelScope
) -> None:
    count = 0
    async for signum in signals:
        count += 1
        if count == 1:
            log.info("%s received: leaving the mesh", signal.Signals(signum).name)
            agent.request_stop()
        else:
            log.warning("second signal: stopping without finishing the leave")
            scope.cancel()
            return


def _first_fabric_error(group: BaseExceptionGroup[BaseException]) -> FabricError | None:
    for exc in group.exceptions:
        if isinstance(exc, FabricError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            inner = _first_fabric_error(exc)
            if inner is not None:
                return inner
    return None
