"""The agent: composition root of one ``fabric start`` process.

It builds every service from one ``AgentConfig`` and owns them in one trio nursery, in this
order: the UDP+TCP gossip transport and the ``GossipService`` driving the ``MeshCore`` (which
re-reads the cluster keyring file when it changes, so rotation needs no restart); the ingress
(``dataplane``) with the admin app inline or on its own hypercorn port; the engine service, or
for a JOIN-only node the assignment follower (``engine.follower``); the rendezvous watcher
(``host.rendezvous``), the member log (``control.memberlog``), in a Slurm job the follower
of the job's end (``host.lease``) and, with ``--gateway``, the federation link
(``federation.link.Gateway``). Each behaviour lives in the package that owns it; this module
only wires them, prints the ready lines and orders the leave. Services start with
``nursery.start`` and report ready through ``task_status``; cancelling the nursery stops them.

Joining: the agent appends its gossip address to the rendezvous file *before* reading it
(``rendezvous.announce_and_read``), so of any two agents starting together the later one always
sees the earlier one. Seeds are the ``--join`` addresses plus the addresses read from the file.

Ready lines. Once every listener is bound the entry point prints to stdout, flushed, exactly::

    fabric: session <32 hex session id>
    fabric: http http://<advertised host>:<port>
    fabric: admin http://<advertised host>:<port>     (only with --admin)
    fabric: gossip <advertised host>:<port>

in that order: ``gossip`` is always the last line, so a reader can stop there
(``parse_ready_lines`` is the matching parser). Nothing else is ever written to stdout; logs
(``fabricnode.logs``: stdlib ``logging``, each line tagged with the short session id) go to
stderr.

Leaving: SIGTERM or SIGINT → the drain (``engine.drain``: this module only carries out what it
decides) → refuse new forwards, sign LEFT, push it directly to several members and gossip it
for ``leave_linger_s`` → let the engine finish every request in flight to it (this node's
clients' and those other ingresses forwarded), until the drain deadline (``drain_timeout_s``
after the signal, never past the Slurm job's end less ``drain.JOB_END_MARGIN_S``), where the
rest is handed over to other nodes by stream resume → stop the engine → let the requests this
ingress still answers on other nodes finish (at most the deadline again) → stop the HTTP servers
(``http_shutdown_grace_s`` for what is left) → exit 0. The engine's own shutdown grace (it gets
Slurm's SIGTERM too) is set to outlast the drain (``engine.command.with_shutdown_grace``). A
second signal while leaving stops at once. Inside a
Slurm job whose end is known the agent also leaves on its own by the same path,
``leave_before_end_s`` before the end (``host.lease.follow_job``, which also moves that moment
when an admin changes the time limit); a SIGTERM that arrives after such a leave began is the
first signal, not a second.
"""

from __future__ import annotations

import logging
import resource
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import trio

from fabricnode import native
from fabricnode.addr import join_hostport
from fabricnode.asgi import bind_http_socket, serve_http
from fabricnode.batch.api import BatchApi
from fabricnode.batch.metrics import render as render_batch_metrics
from fabricnode.batch.store import BatchStore
from fabricnode.batch.worker import BatchWorker
from fabricnode.config import AgentConfig, engine_env
from fabricnode.control.app import AdminApp
from fabricnode.control.loadhistory import LoadHistory
from fabricnode.control.memberlog import log_member_changes
from fabricnode.control.meshstats import MeshStats
from fabricnode.control.peers import PeerClient
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.dataplane.ingress import Ingress
from fabricnode.dataplane.sites import SiteOffer
from fabricnode.elastic.controller import Controller
from fabricnode.elastic.demand import Declared, wanted_labels
from fabricnode.elastic.follow import ForecastScaler
from fabricnode.elastic.plans import plans_from_text
from fabricnode.elastic.slurmctl import SlurmControl
from fabricnode.engine.command import EngineCommand, with_shutdown_grace
from fabricnode.engine.drain import HANDOVER_S, Action, Drain
from fabricnode.engine.drain import deadline_s as drain_deadline_s
from fabricnode.engine.follower import AssignmentFollower
from fabricnode.engine.kvreader import reader_for
from fabricnode.engine.service import KILL_MARGIN_S, EngineService, EngineStatistics
from fabricnode.errors import FabricError
from fabricnode.federation.link import Gateway
from fabricnode.federation.metrics import render as render_federation_metrics
from fabricnode.host import rendezvous
from fabricnode.host.hardware import default_host
from fabricnode.host.hardware import discover as discover_gpus
from fabricnode.host.lease import follow_job, lease_label
from fabricnode.host.slurm import SlurmJob, discover_job, query_end_time
from fabricnode.logs import configure_logging
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity, ProviderKey
from fabricnode.mesh.join import JoinTracker
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Addresses, EngineInfo, EntryBody, Hardware, State
from fabricnode.mesh.schema import (
    CONTROLLER_LABEL,
    JOB_END_LABEL,
    SLURM_JOB_LABEL,
    SLURM_PARTITION_LABEL,
    WANTED_LABEL,
    Standing,
)
from fabricnode.mesh.service import GossipService, UdpTcpTransport
from fabricnode.requestlog.writer import RequestLog

log = logging.getLogger("fabricnode.agent")

READY_PREFIX = "fabric: "


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
        # Load the keyring now, before any socket exists: a missing key is the most common
        # mistake and deserves one clear line (KeyFileError names `fabric keys new-cluster`).
        self.keyring = Keyring.load(config.cluster_key_path)
        self.provider_key = (
            ProviderKey.load(config.provider_key_path) if config.provider_key_path else None
        )
        # A malformed API keys file stops the start: an ingress must not run open by mistake.
        self.api_keys = ApiKeyStore.load(config.api_keys_path) if config.api_keys_path else None
        # --gateway: the site key and the pinned peer certificates, read now for the same reason.
        self.gateway = (
            Gateway.load(config.federation, wall_clock=wall_clock) if config.federation else None
        )
        self.ingress: Ingress | None = None
        self.core: MeshCore | None = None
        self.gossip: GossipService | None = None
        self.engine: EngineService | None = None
        self.follower: AssignmentFollower | None = None  # JOIN-only nodes: the plan labels
        self._stop = trio.Event()
        self._job_end: float | None = None  # the Slurm job's end (Unix time), as last known
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
        labels = [*cfg.labels, *(self.follower.labels if self.follower else ())]
        if job is not None:
            labels += [(SLURM_JOB_LABEL, job.job_id), (SLURM_PARTITION_LABEL, job.partition)]
            if job.end_time is not None and job.end_time > now:
                # The lease never outlives the job; MeshCore renews it up to this cap.
                labels.append(lease_label(job.end_time))
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
            site=cfg.site,
        )

    def _batch(
        self,
        core: MeshCore,
        ingress: Ingress,
        http_sock: socket.socket,
        declared: Declared,
        tracker: JoinTracker,
    ) -> BatchWorker | None:
        """The Batch API on the ingress, and this agent's share of the work (None: no worker,
        ``--batch-concurrency 0``; the API still answers)."""
        cfg = self.config
        if cfg.batch_dir is None:
            return None
        store = BatchStore(cfg.batch_dir)
        port = http_sock.getsockname()[1]
        host = cfg.http_host if cfg.http_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        loopback = f"http://{join_hostport(host, port)}"

        def is_gone(holder: str) -> bool:
            # Only what the mesh knows for sure: an unknown holder may be a worker we have not
            # heard of yet, and its lease's expiry decides.
            if not tracker.is_ready():
                return False
            entry = core.registry.get(holder)
            return entry is not None and core.standing_of(entry) <= Standing.LEAVING

        def known_model(model: str) -> bool:
            table = ingress.table
            if table.routes(model) or table.sleeping(model) or declared.hold_s(model):
                return True
            # Across sites: a gateway knows what its peer sites serve; another agent only
            # that its site has gateways, and a line no site serves fails on its own.
            offers = ingress.across.offers
            if offers is not None:
                return any(o.replicas for o in offers(model))
            return bool(table.gateways())

        worker = None
        if cfg.batch.concurrency > 0:
            worker = BatchWorker(
                store,
                config=cfg.batch,
                worker_id=lambda: core.self_id,
                ingress_url=lambda: loopback,
                owner_token=lambda: ingress.batch_token or "",
                is_gone=is_gone,
                known_model=known_model,
                wall_clock=self.wall_clock,
            )
        ingress.batch_app = BatchApi(
            store,
            wall_clock=self.wall_clock,
            max_file_bytes=cfg.ingress.max_body_bytes,
            key_quota_bytes=cfg.batch.key_quota_bytes,
            store_quota_bytes=cfg.batch.store_quota_bytes,
            poke_worker=worker.poke if worker is not None else lambda: None,
        )
        return worker

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
        core = MeshCore(
            self.identity,
            self.keyring,
            self.join_body(now, http_url, gossip_addr, hardware, job),
            now,
            cfg.mesh,
        )
        gossip = GossipService(
            core,
            transport,
            wall_clock=self.wall_clock,
            keyring_path=cfg.cluster_key_path,
            keyring_poll_s=cfg.keyring_poll_s,
        )
        rendezvous_seeds = (
            await rendezvous.announce_and_read(cfg.rendezvous_path, gossip_addr, self.session_id)
            if cfg.rendezvous_path is not None
            else []
        )
        seeds = [*cfg.join, *rendezvous_seeds]
        gossip.bootstrap(seeds)
        tracker = JoinTracker(
            core,
            had_seeds=bool(seeds),
            started_at=time.monotonic(),
            timeout_s=cfg.join_timeout_s,
            clock=time.monotonic,
        )
        self.core, self.gossip = core, gossip
        log.info(
            "session %s provider %s site %s gossip %s http %s seeds %d",
            core.self_id,
            cfg.provider,
            cfg.site,
            gossip_addr,
            http_url,
            len(seeds),
        )
        log.info("data plane %s", native.status)

        def new_session() -> None:
            # A restarted engine is a new session: fresh key, fresh entry from JOIN.
            self.identity = Identity.generate()
            body = self.join_body(self.wall_clock(), http_url, gossip_addr, hardware, job)
            gossip.new_session(self.identity, body)
            log.info("new session %s for the restarted engine", self.identity.session_id)

        # The ingress first: it asks for the engine lazily (``self.engine`` when a request
        # comes), and the engine reports the ingress's local in-flight count as its load.
        def serving_engine_url() -> str | None:
            engine = self.engine
            if engine is None or engine.state != "serving" or core.left:
                return None
            return engine.command.url

        def local_engine_up() -> bool:
            # Not ``serving_engine_url``: a leaving agent takes no new requests but its
            # engine finishes the ones it accepted.
            engine = self.engine
            return engine is not None and engine.state == "serving"

        request_log = RequestLog(cfg.request_log_path) if cfg.request_log_path else None
        declared = Declared(core)

        def on_waiting(waiting: Mapping[str, int]) -> None:
            # the acting controller starts a replica for a model we hold requests for
            gossip.relabel(WANTED_LABEL, wanted_labels(waiting))

        ingress = Ingress(
            core,
            config=cfg.ingress,
            wall_clock=self.wall_clock,
            serving_engine_url=serving_engine_url,
            local_engine_up=local_engine_up,
            api_keys=self.api_keys,
            request_log=request_log,
            declared=declared.hold_s,
            declared_models=declared.models,
            model_sites=declared.sites,
            site=cfg.site,
            on_waiting=on_waiting,
            wake_local=self._wake_engine,
            # This agent's Batch API worker sends its requests with this secret in the batch
            # owner header (dataplane.tiers): batch tier, on behalf of a tenant's key.
            batch_token=secrets.token_hex(16),
        )
        self.ingress = ingress
        gossip.on_change = ingress.mesh_changed  # load reports and nodes reach its waiters
        ingress.site = ingress.attempts.site = cfg.site
        if self.gateway is not None:
            self._wire_gateway(self.gateway, ingress)

        def on_sleep_change(asleep: bool) -> None:
            ingress.local_asleep = asleep

        # The engine gets Slurm's SIGTERM with the agent: it must let its requests run for as
        # long as the drain may last, and then some.
        engine_grace_s = cfg.drain_timeout_s + HANDOVER_S + KILL_MARGIN_S

        def engine_service(command: EngineCommand) -> EngineService:
            command = with_shutdown_grace(command, engine_grace_s)
            reader = None
            if cfg.kv_events:  # its KV-cache events: the reader binds, the engine connects
                reader, command = reader_for(command)
            return EngineService(
                command,
                gossip,
                log_path=self._engine_log_path(core.self_id),
                restart=cfg.restart,
                max_restarts=cfg.max_restarts,
                new_session=new_session,
                inflight=lambda: ingress.local_inflight,
                served=lambda: ingress.local_served,
                sleep_after_s=cfg.sleep_after_s,
                on_sleep_change=on_sleep_change,
                env=engine_env(cfg, command),
                kv_reader=reader,
            )

        # Without an engine command the node stays JOIN-only until an operator's assignment
        # gives it one (``_launch_assigned``); everything below reads ``self.engine``.
        if cfg.engine is not None:
            self.engine = engine_service(cfg.engine)
        elif cfg.serve_model is not None and cfg.engine_template is not None:
            # --serve: the template rendered now, on every GPU of the node (the controller's
            # jobs ask Slurm for exactly the GPUs one replica needs)
            tp = max(1, hardware.gpu_count)
            command = cfg.engine_template.render(cfg.serve_model, tp, 1, hardware.gpu_type)
            log.info("serving %s: %s", cfg.serve_model, " ".join(command.argv))
            self.engine = engine_service(command)
        else:
            self.follower = AssignmentFollower(gossip, cfg.engine_template, hardware)

        def ready() -> bool:
            engine = self.engine
            return tracker.is_ready() and (engine is None or engine.state == "serving")

        controller = self._controller(core, gossip, ingress)

        def engine_statistics() -> EngineStatistics | None:
            engine = self.engine
            return None if engine is None else engine.statistics()

        batch_worker = self._batch(core, ingress, http_sock, declared, tracker)
        batch_metrics = render_batch_metrics(batch_worker.statistics) if batch_worker else None
        gateway = self.gateway
        federation_metrics = render_federation_metrics(gateway.statistics) if gateway else None

        def data_plane_metrics() -> bytes:
            page = ingress.render_metrics()
            if batch_metrics is not None:
                page += batch_metrics()
            return page + federation_metrics() if federation_metrics is not None else page

        # The dashboard's figures: this ingress's counts, the mesh's on demand; each node's
        # recent load, sampled from the gossiped reports.
        peers = PeerClient(core.keyring, core.self_entry.session_id, wall_clock=self.wall_clock)
        stats = MeshStats(core, ingress.recent_export, self.wall_clock, peers)
        load_history = LoadHistory()

        def engine_argv() -> tuple[str, ...] | None:
            engine = self.engine
            return None if engine is None else tuple(engine.command.argv)

        def app(agent_endpoints: bool) -> AdminApp:
            return AdminApp(
                core,
                is_ready=ready,
                transport=transport,
                keyring=gossip,
                wall_clock=self.wall_clock,
                agent_endpoints=agent_endpoints,
                extra_metrics=data_plane_metrics,
                request_log_path=cfg.request_log_path,
                wake_gossip=gossip.poke,
                controller=controller,
                engine=engine_statistics,
                stats=stats,
                load_history=load_history,
                engine_command=engine_argv,
                sites=gateway.sites_doc if gateway is not None else None,
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
            nursery.start_soon(load_history.run, core)
            if self.api_keys is not None:
                nursery.start_soon(self._reload_api_keys, self.api_keys)
            if request_log is not None:
                nursery.start_soon(self._flush_request_log, ingress, request_log)
            if self.engine is not None:
                await nursery.start(self.engine.run)
            elif self.follower is not None:
                nursery.start_soon(self._launch_assigned, nursery, self.follower, engine_service)
            if cfg.rendezvous_path is not None:
                nursery.start_soon(
                    rendezvous.watch, cfg.rendezvous_path, gossip, cfg.rendezvous_poll_s
                )
            nursery.start_soon(log_member_changes, core, tracker)
            if controller is not None:
                nursery.start_soon(controller.run)
            if batch_worker is not None:
                await nursery.start(batch_worker.run)
            if job is not None:
                self._start_job_follower(nursery, job, gossip)
            if gateway is not None:
                await nursery.start(gateway.run, core, tracker.is_ready)
            task_status.started(AgentAddresses(core.self_id, http_url, gossip_addr, admin_url))

            if job is not None:
                self._job_end = job.end_time
            await self._stop.wait()
            await self._drain(ingress, gossip)
            http_shutdown.set()
            with trio.move_on_after(cfg.http_shutdown_grace_s + 1.0):
                await self._ingress_done.wait()
                await admin_done.wait()
            if request_log is not None:
                ingress.settle()
                await trio.to_thread.run_sync(request_log.flush)
            nursery.cancel_scope.cancel()
        log.info("left the mesh")

    def _wire_gateway(self, gateway: Gateway, ingress: Ingress) -> None:
        """Cross-site requests (docs/federation.md): the requests peer sites' gateways send
        come in through the link to the data plane, and the data plane sends ours out through
        the link, to the gateways the view says serve the model."""
        gateway.http_handler = ingress.serve_remote
        ingress.pool.dialer = gateway.dial_http
        ingress.across.offers = self._site_offers(gateway)

    def _site_offers(self, gateway: Gateway) -> Callable[[str], list[SiteOffer]]:
        """What the gateway's view of the peer sites says of a model, per site that lists it
        (``sites.SiteOffer``): the data plane routes by it, the controller counts by it."""
        view = gateway.view
        wall_clock = self.wall_clock

        def offers(model: str) -> list[SiteOffer]:
            now = wall_clock()
            found = []
            for site in view.sites:
                summary = view.summary(site)
                cap = summary.body.models.get(model) if summary is not None else None
                if summary is None or cap is None:
                    continue
                found.append(
                    SiteOffer(
                        site,
                        summary.body.gateways,
                        view.routable(site, now),
                        view.rtt(site),
                        cap.replicas,
                        cap.admitting,
                        cap.waiting,
                        view.fresh(site, now),
                        start_s=cap.start_s,
                    )
                )
            return found

        return offers

    async def _drain(self, ingress: Ingress, gossip: GossipService) -> None:
        """Leave as the drain decides (``engine.drain``); returns when the doors may close."""
        cfg = self.config
        engine = self.engine
        deadline_s = drain_deadline_s(cfg.drain_timeout_s, self._job_end, self.wall_clock())
        drain = Drain(deadline_s=deadline_s, has_engine=engine is not None)
        now = trio.current_time
        acts = drain.leave(now(), engine=ingress.local_inflight, relayed=ingress.relayed_inflight)
        log.info(
            "leaving: %d requests in flight to the engine, %d answered by this ingress; "
            "deadline in %g s",
            ingress.local_inflight,
            ingress.relayed_inflight,
            deadline_s,
        )
        while True:
            more: list[Action] = []
            for act in acts:
                if act is Action.STOP_ACCEPTING:
                    # Refuse forwards (ingresses fail over, invisibly to clients), sign LEFT
                    # (every ingress, ours too, routes elsewhere).
                    ingress.leaving = True
                    if engine is not None:
                        engine.begin_drain()
                    log.info("leaving: signing LEFT and spreading it for %g s", cfg.leave_linger_s)
                    await gossip.leave(cfg.leave_linger_s)
                elif act is Action.HAND_OVER:
                    n = ingress.hand_over()
                    log.warning(
                        "drain deadline (%g s): %d requests still on the engine handed over to "
                        "other nodes",
                        deadline_s,
                        n,
                    )
                elif act is Action.STOP_ENGINE and engine is not None:
                    await engine.stop()
                    more += drain.engine_stopped(now(), relayed=ingress.relayed_inflight)
                elif act is Action.CLOSE_DOORS:
                    stats = drain.statistics()
                    log.info(
                        "drained in %.1f s: %d requests were in flight to the engine, %d of "
                        "them handed over",
                        now() - (stats.began_at or now()),
                        stats.engine_at_start,
                        stats.handed_over,
                    )
                    return
            if more:
                acts = more
                continue
            if engine is not None and engine.process.exited.is_set():
                acts = drain.engine_stopped(now(), relayed=ingress.relayed_inflight)
                if acts:
                    continue
            # The counts as they are now, before waiting for them to change: the requests in
            # flight may all have ended while the actions above ran (signing LEFT lingers a
            # second), and no change would come to wake the wait; the drain then sat until its
            # 30 s deadline (a time-limited job's slot held 18 s, a SIGTERMed agent not gone
            # in 15 s, in make test)
            acts = drain.update(
                now(), engine=ingress.local_inflight, relayed=ingress.relayed_inflight
            )
            if acts:
                continue
            with trio.move_on_at(drain.next_deadline()):
                await ingress.wait_inflight_change()
            acts = drain.update(
                now(), engine=ingress.local_inflight, relayed=ingress.relayed_inflight
            )

    async def _wake_engine(self) -> bool:
        """The data plane's way to wake our sleeping engine (``EngineService.wake``)."""
        engine = self.engine
        return engine is not None and await engine.wake()

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

    async def _launch_assigned(
        self,
        nursery: trio.Nursery,
        follower: AssignmentFollower,
        engine_service: Callable[[EngineCommand], EngineService],
    ) -> None:
        """JOIN-only node: start the engine of the first assignment that can be carried out."""
        command = await follower.next_engine()
        if self._stop.is_set():
            return
        self.engine = engine_service(command)
        await nursery.start(self.engine.run)

    def _start_job_follower(
        self, nursery: trio.Nursery, job: SlurmJob, gossip: GossipService
    ) -> None:
        """Keep the lease cap and our leave time on the job's end (``host.lease``)."""
        if job.end_time is None:
            log.info("Slurm job %s: its end time is unknown; leaving on SIGTERM only", job.job_id)
            return

        async def end_now() -> float | None:
            return await trio.to_thread.run_sync(self.job_end_now, job.job_id)

        def end_moved(end_time: float) -> None:
            self._job_end = end_time
            gossip.relabel(JOB_END_LABEL, (lease_label(end_time),))

        nursery.start_soon(
            partial(
                follow_job,
                job.job_id,
                job.end_time,
                margin_s=self.config.leave_before_end_s,
                wall_clock=self.wall_clock,
                end_time_now=end_now,
                on_end_moved=end_moved,
                on_leave=lambda plan: self.request_stop(),
            )
        )

    def _controller(
        self, core: MeshCore, gossip: GossipService, ingress: Ingress
    ) -> Controller | None:
        """``--controller``: the elastic control loop (one of the controller agents acts). On a
        gateway it sees the other sites (``sitespread``), and says how long its starts take:
        in our site's summary, and to our data plane (``sites`` rule 8)."""
        cc = self.config.controller
        if cc is None:
            return None
        if cc.output:  # Slurm opens the batch output before the job runs: the directory first
            Path(cc.output).parent.mkdir(parents=True, exist_ok=True)
        slurm = SlurmControl(
            cc.mesh_tag, cc.sbatch_script, cc.user, dry_run=cc.dry_run, output=cc.output
        )
        controller = Controller(
            core,
            slurm,
            plans_from_text,
            lambda labels: gossip.relabel(CONTROLLER_LABEL, labels),
            scaler=ForecastScaler(core),
            interval_s=cc.interval_s,
            wall_clock=self.wall_clock,
            site=self.config.site,
        )
        if self.gateway is not None:
            controller.serving_elsewhere = self._serving_elsewhere(self.gateway)
            self.gateway.starts = lambda: controller.starts
            ingress.across.start_here = controller.start_here
        return controller

    def _serving_elsewhere(self, gateway: Gateway) -> Callable[[str], dict[str, int]]:
        """What the other sites serve of a model (``elastic.sitespread``): the replicas of each
        routable peer site that lists it, by the gateway's site offers. Routable, not fresh: an
        idle site's summary comes once a keep-alive, often a little past ``fresh``'s bound, and
        a share that followed it would start and cancel jobs; a site cut off stops being
        routable within ``max(5 s, 4 x RTT + 2 s)``."""
        offers = self._site_offers(gateway)
        return lambda model: {o.site: o.replicas for o in offers(model) if o.routable}

    def _engine_log_path(self, session_id: str) -> Path | None:
        if self.config.job_log_dir is not None:
            return self.config.job_log_dir / "engine.log"
        if self.config.log_dir is None:
            return None
        return self.config.log_dir / f"{self.config.job_id}-{session_id[:8]}" / "engine.log"


def _url(advertise_host: str, sock: socket.socket) -> str:
    return f"http://{join_hostport(advertise_host, sock.getsockname()[1])}"


# -- process entry ----------------------------------------------------------------------------


def run_agent(config: AgentConfig, *, out: TextIO | None = None) -> int:
    """Run one agent until SIGTERM/SIGINT, then leave gracefully; returns the exit status.

    Prints the ready lines (module docstring) to ``out`` (stdout). ``FabricError`` (bad key
    file, port in use, ...) propagates for the caller to show as one line.
    """
    agent = Agent(config)  # a bad key file fails here, before logging is set up
    configure_logging(config.log_level, agent.session_id)
    _raise_open_files_limit(config.ingress.max_connections + RESERVED_FILES)
    try:
        trio.run(_main, agent, out or sys.stdout)
    except BaseExceptionGroup as group:
        error = _first_fabric_error(group)
        if error is not None:
            raise error from None
        # A bug: the operator needs the whole traceback in the agent's log, not one line.
        log.critical("the agent failed on an unexpected error", exc_info=group)
        raise
    except Exception:
        log.critical("the agent failed on an unexpected error", exc_info=True)
        raise
    return 0


RESERVED_FILES = 1024  # descriptors beyond client connections: upstreams, gossip, logs


def _raise_open_files_limit(wanted: int) -> None:
    """Raise the soft limit on open files toward ``wanted`` (at most the hard limit), as nginx
    does: the default soft limit on many clusters is 1024, far below ``max_connections``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit to %d: %s", target, exc)
        else:
            log.info("open files limit raised from %d to %d", soft, target)


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
