"""The agent's configuration: one frozen object, built from CLI flags and environment in one place.

``load_config`` is the only function that reads the environment for the agent, so every default
is visible here and a test can pass its own ``env``. Precedence: a flag given on the command
line wins over the environment, which wins over the built-in default. Invalid values raise
``ConfigError`` with one line naming the flag or variable at fault.

Environment: ``FABRIC_HOME`` (default ``~/.config/fabric``), ``FABRIC_JOIN`` (comma-separated
gossip addresses), ``FABRIC_CLUSTER_KEY`` (path of the cluster keyring), ``USER`` (provider),
``FABRIC_RENDEZVOUS`` (the rendezvous file, default ``$FABRIC_HOME/rendezvous``),
``FABRIC_LOG_DIR`` (logs, default ``$FABRIC_HOME/logs``), ``FABRIC_JOB_LOG_DIR`` (this agent's
own log directory, set by the sbatch wrapper: ``engine.log`` and ``requests.jsonl`` go straight
into it), ``FABRIC_LEAVE_BEFORE_END`` (seconds, as ``--leave-before-end``), ``FABRIC_SITE``
(as ``--site``; else ``SLURM_CLUSTER_NAME``, which Slurm sets in a job, else ``default``).

Advertised address (what peers and clients are told to contact): ``--advertise`` if given; else
the gossip bind host when it is a specific address (a loopback bind advertises the loopback
address, so a laptop-local mesh never leaks onto the LAN); else the HTTP bind host when that is
specific; else this host's primary address, found by "connecting" an unsent UDP socket towards a
non-routable address and reading which local address the kernel picked (no packet leaves);
else ``127.0.0.1``.
"""

from __future__ import annotations

import getpass
import math
import os
import shlex
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fabricnode.addr import WILDCARD_HOSTS, join_hostport, split_hostport, valid_host
from fabricnode.batch.worker_config import BatchConfig
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.routing import POLICY_NAMES
from fabricnode.elastic.slurmctl import mesh_tag
from fabricnode.engine.command import (
    VLLM,
    EngineCommand,
    inspect_engine_cmd,
    sim_engine_command,
)
from fabricnode.engine.template import EngineTemplate, parse_template
from fabricnode.errors import ConfigError
from fabricnode.federation.settings import FederationConfig, federation_config
from fabricnode.federation.summary import GATEWAY_LABEL
from fabricnode.host.hardware import parse_sim_gpu
from fabricnode.host.slurm import (
    DEFAULT_LEAVE_BEFORE_END_S,
    cluster_name_of,
    find_sbatch_script,
    job_id_of,
)
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.registry import MAX_LABEL_KEY, MAX_LABEL_VALUE
from fabricnode.mesh.sites import DEFAULT_SITE, SITE_LABEL, site_problem

DEFAULT_HTTP = "0.0.0.0:8080"
MAX_BATCH_CONCURRENCY = 4096
DEFAULT_GOSSIP = "0.0.0.0:7946"
LOG_LEVELS = ("debug", "info", "warning", "error")
# --label flags at most: the rest of the registry's MAX_LABELS is the fabric's own labels'
# (about 20 at most, fabric.wanted's included) and the site's.
MAX_OPERATOR_LABELS = 32


@dataclass(frozen=True)
class ControllerConfig:
    """``--controller``: run the elastic control loop (``fabricnode.elastic.controller``)."""

    sbatch_script: Path  # the fabric-serve.sbatch wrapper the jobs run
    user: str  # whose Slurm jobs are ours
    mesh_tag: str  # tags the jobs of this mesh (a digest of $FABRIC_HOME's path)
    dry_run: bool = False  # print the sbatch/scancel commands instead of running them
    interval_s: float = 2.0
    output: str | None = None  # the jobs' batch output file (Slurm's %j pattern)


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent process needs to know before it starts."""

    cluster_key_path: Path
    rendezvous_path: Path | None  # None: no rendezvous file (only --join seeds)
    provider: str
    advertise_host: str
    provider_key_path: Path | None = None  # certifies our session key (verified provider)
    site: str = DEFAULT_SITE  # the site this agent belongs to (mesh.sites), in its entry
    engine: EngineCommand | None = None  # the supervised child; None: a JOIN-only node
    # A JOIN-only node with a template launches its engine when an operator assigns a model.
    engine_template: EngineTemplate | None = None
    # With a template: serve this model from the start (tp = the node's GPUs), no assignment.
    serve_model: str | None = None
    log_dir: Path | None = None  # engine logs go to <log_dir>/<job>-<session>/engine.log
    job_log_dir: Path | None = None  # if set, the engine log is <job_log_dir>/engine.log
    sim_gpu: str | None = None  # TYPE[:COUNT[:MEMORY_GB]] instead of nvidia-smi discovery
    restart: str = "no"  # engine restart policy: no | on-failure | always
    max_restarts: int = 3
    provider_cert_ttl_s: float = 30 * 86400.0  # certificate lifetime; far beyond any job
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    gossip_host: str = "0.0.0.0"
    gossip_port: int = 7946
    admin_host: str | None = None  # None: agent endpoints share the --http port
    admin_port: int | None = None
    join: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    log_level: str = "info"
    rendezvous_poll_s: float = 3.0  # re-read the rendezvous file this often while isolated
    join_timeout_s: float = 10.0  # after this long with no answer we found a new mesh (ready)
    leave_linger_s: float = 1.0  # keep gossiping our LEFT entry this long on shutdown
    http_shutdown_grace_s: float = 2.0  # let in-flight HTTP requests finish on shutdown
    keyring_poll_s: float = 1.0  # notice edits of the cluster keyring file this fast
    # On leave, requests in flight to our engine get this long (from the signal) to finish;
    # then those left are handed over by stream resume (``engine.drain``; agent.py).
    drain_timeout_s: float = 30.0
    # Put the engine to sleep after this long without requests (vLLM's sleep mode); None: never.
    sleep_after_s: float | None = None
    # Read the engine's KV-cache events (vLLM's, the simulated engine's), turning them on for
    # an engine the agent starts (``engine.kvreader``); ``--no-kv-events``: never.
    kv_events: bool = True
    # Inside a Slurm job with a known end time, start leaving this long before it (at most
    # half the time the job has left when the agent starts); 0 = only on SIGTERM.
    leave_before_end_s: float = DEFAULT_LEAVE_BEFORE_END_S
    api_keys_path: Path | None = None  # hashed API keys; no file = the ingress runs open
    request_log_path: Path | None = None  # trace-schema request log (JSON lines); None = off
    request_log_flush_s: float = 1.0
    # The Slurm job id ("local" outside Slurm): it names the engine's and the request log.
    job_id: str = "local"
    # The environment as the agent started: GPU and Slurm discovery read it (nvidia-smi's
    # CUDA_VISIBLE_DEVICES, SLURM_*), so that no module but this one reads os.environ.
    host_env: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False, repr=False)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    ingress: IngressConfig = field(default_factory=IngressConfig)
    controller: ControllerConfig | None = None
    # The Batch API's files and batches (shared by every job: $FABRIC_HOME/batches); None: off.
    batch_dir: Path | None = None
    batch: BatchConfig = field(default_factory=BatchConfig)
    # --gateway: this agent is one of its site's gateways (fabricnode.federation); None: not.
    federation: FederationConfig | None = None

    @property
    def http_bind(self) -> str:
        return join_hostport(self.http_host, self.http_port)

    @property
    def gossip_bind(self) -> str:
        return join_hostport(self.gossip_host, self.gossip_port)

    @property
    def admin_bind(self) -> str | None:
        if self.admin_host is None or self.admin_port is None:
            return None
        return join_hostport(self.admin_host, self.admin_port)


def fabric_home(env: Mapping[str, str]) -> Path:
    """``$FABRIC_HOME``, else ``~/.config/fabric``."""
    home = env.get("FABRIC_HOME")
    return Path(home).expanduser() if home else Path("~/.config/fabric").expanduser()


def default_cluster_key_path(env: Mapping[str, str]) -> Path:
    """``$FABRIC_CLUSTER_KEY``, else ``$FABRIC_HOME/cluster.key`` (shared with ``fabric keys``)."""
    explicit = env.get("FABRIC_CLUSTER_KEY")
    return Path(explicit).expanduser() if explicit else fabric_home(env) / "cluster.key"


def default_provider_key_path(env: Mapping[str, str]) -> Path:
    return fabric_home(env) / "provider.key"


def default_operator_key_path(env: Mapping[str, str]) -> Path:
    return fabric_home(env) / "operator.key"


def default_api_keys_path(env: Mapping[str, str]) -> Path:
    """``$FABRIC_HOME/api-keys.json`` (shared by ``fabric keys api-*`` and the agent)."""
    return fabric_home(env) / "api-keys.json"


def load_config(
    *,
    http: str | None = None,
    gossip: str | None = None,
    admin: str | None = None,
    advertise: str | None = None,
    join: Iterable[str] = (),
    rendezvous: str | None = None,
    cluster_key: str | None = None,
    provider: str | None = None,
    provider_key: str | None = None,
    site: str | None = None,
    engine_cmd: Sequence[str] = (),
    engine_url: str | None = None,
    sim: str | None = None,
    sim_gpu: str | None = None,
    sim_args: str | None = None,
    engine_template: str | None = None,
    model_paths: Sequence[str] = (),
    trust_operators: Iterable[str] = (),
    restart: str | None = None,
    max_restarts: int | None = None,
    labels: Iterable[str] = (),
    log_level: str | None = None,
    policy: str | None = None,
    api_keys: str | None = None,
    request_log: str | None = None,
    max_body_mb: float | None = None,
    limits: ConnectionLimits | None = None,
    tiers: TierLimits | None = None,
    drain_timeout_s: float | None = None,
    leave_before_end_s: float | None = None,
    sleep_after_s: float | None = None,
    kv_events: bool = True,
    batch_concurrency: int | None = None,
    batch_key_quota_gb: float | None = None,
    batch_store_quota_gb: float | None = None,
    batch_input_buffer_mb: float | None = None,
    controller: bool = False,
    controller_dry_run: bool = False,
    serve: str | None = None,
    gateway: GatewayFlags | None = None,
    env: Mapping[str, str] | None = None,
    mesh: MeshConfig | None = None,
) -> AgentConfig:
    """Build the agent configuration from flags (``None``/empty: not given) and environment.

    ``rendezvous=""`` disables the rendezvous file; ``request_log=""`` disables the request log.
    Defaults: API keys from ``$FABRIC_HOME/api-keys.json`` (auth is on once that file exists),
    request log ``$FABRIC_LOG_DIR/requests-<job>-<pid>.jsonl`` (``$FABRIC_JOB_LOG_DIR/
    requests.jsonl`` under the sbatch wrapper).
    """
    env = os.environ if env is None else env
    http_host, http_port = _bind("--http", http or DEFAULT_HTTP)
    gossip_host, gossip_port = _bind("--gossip", gossip or DEFAULT_GOSSIP)
    admin_host: str | None = None
    admin_port: int | None = None
    if admin:
        admin_host, admin_port = _bind("--admin", admin)
    seeds = list(join) or [s for s in env.get("FABRIC_JOIN", "").split(",") if s.strip()]
    join_addrs = tuple(_join_addr(s, "--join" if join else "FABRIC_JOIN") for s in seeds)
    if rendezvous is None:
        from_env = env.get("FABRIC_RENDEZVOUS", "").strip()
        rendezvous_path: Path | None = (
            Path(from_env).expanduser() if from_env else fabric_home(env) / "rendezvous"
        )
    else:
        rendezvous_path = Path(rendezvous).expanduser() if rendezvous else None
    key_path = Path(cluster_key).expanduser() if cluster_key else default_cluster_key_path(env)
    level = (log_level or "info").lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
    home = fabric_home(env)
    job_id = job_id_of(env) or "local"
    keys_path = Path(api_keys).expanduser() if api_keys else default_api_keys_path(env)
    log_dir = Path(env["FABRIC_LOG_DIR"]).expanduser() if env.get("FABRIC_LOG_DIR") else None
    log_dir = log_dir or home / "logs"
    job_log_dir = env.get("FABRIC_JOB_LOG_DIR", "").strip()
    job_logs = Path(job_log_dir).expanduser() if job_log_dir else None
    if request_log is None and job_logs is not None:
        log_path: Path | None = job_logs / "requests.jsonl"
    elif request_log is None:
        log_path = log_dir / f"requests-{job_id}-{os.getpid()}.jsonl"
    else:
        log_path = Path(request_log).expanduser() if request_log else None
    engine = _engine(engine_cmd, engine_url, sim, sim_gpu, sim_args)
    template = _engine_template(engine_template, model_paths, env, has_engine=engine is not None)
    operators = _trusted_operators(trust_operators, env)
    control = _controller(controller or controller_dry_run, controller_dry_run, operators, env)
    if control is not None:
        control = replace(control, output=str(log_dir / "slurm-%j.out"))
    if serve is not None and (template is None or not serve.strip()):
        raise ConfigError("--serve MODEL renders --engine-template: give both")
    flags = gateway or GatewayFlags()
    federation = federation_config(
        gateway=flags.gateway,
        listen=flags.listen,
        site_key=flags.site_key,
        peer_sites=flags.peer_sites,
        peers=flags.peers,
    )
    agent_site = _site(site, env)
    own_labels = parse_labels(labels)
    if federation is not None:  # the site's summary lists every gateway its registry knows
        federation = replace(federation, site=agent_site)  # its key must be this site's
        own_labels = tuple(sorted({**dict(own_labels), GATEWAY_LABEL: federation.gateway}.items()))
    return AgentConfig(
        federation=federation,
        controller=control,
        serve_model=serve.strip() if serve is not None else None,
        api_keys_path=keys_path,
        request_log_path=log_path,
        drain_timeout_s=_drain(drain_timeout_s),
        sleep_after_s=_sleep_after(sleep_after_s),
        kv_events=kv_events,
        batch_dir=home / "batches",
        batch=_batch(
            batch_concurrency, batch_key_quota_gb, batch_store_quota_gb, batch_input_buffer_mb
        ),
        leave_before_end_s=_leave_before_end(leave_before_end_s, env),
        ingress=_ingress(policy, max_body_mb, limits or ConnectionLimits(), tiers or TierLimits()),
        cluster_key_path=key_path,
        rendezvous_path=rendezvous_path,
        provider=_provider(provider, env),
        site=agent_site,
        provider_key_path=Path(provider_key).expanduser() if provider_key else None,
        engine=engine,
        engine_template=template,
        log_dir=log_dir,
        job_log_dir=job_logs,
        sim_gpu=_sim_gpu(sim_gpu),
        restart=_restart(restart),
        max_restarts=_max_restarts(max_restarts),
        advertise_host=_advertise_host(advertise, gossip_host, http_host),
        http_host=http_host,
        http_port=http_port,
        gossip_host=gossip_host,
        gossip_port=gossip_port,
        admin_host=admin_host,
        admin_port=admin_port,
        join=join_addrs,
        labels=own_labels,
        log_level=level,
        job_id=job_id,
        host_env=dict(env),
        mesh=replace(mesh or MeshConfig(), trusted_operators=operators),
    )


@dataclass(frozen=True)
class GatewayFlags:
    """``fabric start``'s federation flags as given (None/empty: not given); see
    ``fabricnode.federation.settings``."""

    gateway: str | None = None  # --gateway HOST:PORT
    listen: str | None = None  # --federation-listen HOST:PORT
    site_key: str | None = None  # --site-key FILE
    peer_sites: str | None = None  # --peer-sites DIR
    peers: tuple[str, ...] = ()  # --federation-peer SITE=HOST:PORT


@dataclass(frozen=True)
class ConnectionLimits:
    """The data plane's global bounds as given on the command line (None: the default)."""

    max_buffered_body_mb: float | None = None
    max_connections: int | None = None
    max_connections_per_client: int | None = None


@dataclass(frozen=True)
class TierLimits:
    """The batch tier's thresholds as given on the command line (None: the default); see
    ``IngressConfig`` and ``fabricnode.dataplane.tiers``."""

    batch_kv_threshold: float | None = None
    batch_max_waiting: int | None = None
    batch_max_inflight_per_node: int | None = None
    max_batch_waiting: int | None = None
    batch_max_wait_s: float | None = None
    batch_priority: int | None = None
    batch_prefill_tokens_per_s: float | None = None
    batch_preempt_kv_threshold: float | None = None


def _tier_limits(given: TierLimits) -> dict[str, Any]:
    """The batch tier's settings from ``given``, each checked (``ConfigError`` names the flag)."""
    out: dict[str, Any] = {}
    checks: tuple[tuple[str, str, float, float], ...] = (
        ("batch_kv_threshold", "--batch-kv-threshold", 0.0, 1.0),
        ("batch_max_waiting", "--batch-max-waiting", 0, 1_000_000),
        ("batch_max_inflight_per_node", "--batch-max-inflight-per-node", 1, 1_000_000),
        ("max_batch_waiting", "--max-batch-waiting", 1, 1_000_000),
        ("batch_max_wait_s", "--batch-max-wait", 0.0, 86_400.0),
        ("batch_priority", "--batch-priority", 1, 1_000_000),
        ("batch_prefill_tokens_per_s", "--batch-prefill-rate", 0.0, 1e9),
        ("batch_preempt_kv_threshold", "--batch-preempt-kv", 0.0, 1.0),
    )
    for name, flag, low, high in checks:
        value = getattr(given, name)
        if value is None:
            continue
        # a threshold of 0 would never let batch work through, and nor would a wait of 0
        exclusive = name in ("batch_kv_threshold", "batch_max_wait_s", "batch_preempt_kv_threshold")
        above = value > low if exclusive else value >= low
        if not (math.isfinite(value) and above and value <= high):
            bound = "more than" if exclusive else "at least"
            raise ConfigError(f"{flag} {value:g}: expected {bound} {low:g}, at most {high:g}")
        out[name] = value
    return out


def _ingress(
    policy: str | None, max_body_mb: float | None, limits: ConnectionLimits, tiers: TierLimits
) -> IngressConfig:
    defaults = IngressConfig()
    name = (policy or defaults.policy).lower()
    if name not in POLICY_NAMES:
        raise ConfigError(f"--policy {policy!r}: choose one of {', '.join(POLICY_NAMES)}")
    max_body = defaults.max_body_bytes
    if max_body_mb is not None:
        if not 0 < max_body_mb <= 1024:
            raise ConfigError(f"--max-body-mb {max_body_mb:g}: expected more than 0, at most 1024")
        max_body = int(max_body_mb * 1024 * 1024)
    buffered = defaults.max_buffered_body_bytes
    if limits.max_buffered_body_mb is not None:
        mb = limits.max_buffered_body_mb
        if not max_body / (1024 * 1024) <= mb <= 65536:
            raise ConfigError(
                f"--max-buffered-body-mb {mb:g}: expected at least --max-body-mb, at most 65536"
            )
        buffered = int(mb * 1024 * 1024)
    total = limits.max_connections or defaults.max_connections
    if not 16 <= total <= 1_000_000:
        raise ConfigError(f"--max-connections {total}: expected 16..1000000")
    per_client = limits.max_connections_per_client or min(
        defaults.max_connections_per_client, total
    )
    if not 1 <= per_client <= total:
        raise ConfigError(
            f"--max-connections-per-client {per_client}: expected 1..--max-connections ({total})"
        )
    config = IngressConfig(
        policy=name,
        max_body_bytes=max_body,
        max_buffered_body_bytes=buffered,
        max_connections=total,
        max_connections_per_client=per_client,
        busy_connections=total * 3 // 4,
    )
    return replace(config, **_tier_limits(tiers))


def _drain(value: float | None) -> float:
    if value is None:
        return 30.0
    if not 0 <= value <= 3600:
        raise ConfigError(f"--drain-timeout {value:g}: expected 0..3600 seconds")
    return value


MAX_SLEEP_AFTER_S = 7 * 86400.0


def _batch(
    concurrency: int | None,
    key_quota_gb: float | None,
    store_quota_gb: float | None,
    input_buffer_mb: float | None = None,
) -> BatchConfig:
    defaults = BatchConfig()
    if concurrency is None:
        concurrency = defaults.concurrency
    if not 0 <= concurrency <= MAX_BATCH_CONCURRENCY:
        raise ConfigError(
            f"--batch-concurrency {concurrency}: expected 0 (no batch worker) to "
            f"{MAX_BATCH_CONCURRENCY}"
        )
    quotas = {}
    for flag, value, name in (
        ("--batch-key-quota-gb", key_quota_gb, "key_quota_bytes"),
        ("--batch-store-quota-gb", store_quota_gb, "store_quota_bytes"),
    ):
        if value is None:
            continue
        if not 0 < value <= 1024 * 1024:  # also rejects NaN
            raise ConfigError(f"{flag} {value:g}: expected more than 0, at most 1048576 GB")
        quotas[name] = int(value * 1024**3)
    if input_buffer_mb is not None:
        if not 1 <= input_buffer_mb <= 64 * 1024:  # also rejects NaN
            raise ConfigError(
                f"--batch-input-buffer-mb {input_buffer_mb:g}: expected 1 to 65536 MiB"
            )
        quotas["input_buffer_bytes"] = int(input_buffer_mb * 1024**2)
    return replace(defaults, concurrency=concurrency, **quotas)


def _sleep_after(value: float | None) -> float | None:
    if value is None:
        return None
    if not 0 < value <= MAX_SLEEP_AFTER_S:  # also rejects NaN
        raise ConfigError(f"--sleep-after {value:g}: expected more than 0, at most 604800 seconds")
    return value


def engine_env(config: AgentConfig, command: EngineCommand) -> dict[str, str] | None:
    """The environment of the engine child (None: the agent's own). vLLM serves its sleep
    endpoints only with ``VLLM_SERVER_DEV_MODE=1``: set for it when the node sleeps when idle
    (the engine listens on loopback, behind the agent, which forwards only ``/v1``)."""
    if config.sleep_after_s is None or command.kind != VLLM:
        return None
    if "VLLM_SERVER_DEV_MODE" in config.host_env:
        return None  # the researcher's own choice
    return {**config.host_env, "VLLM_SERVER_DEV_MODE": "1"}


def _leave_before_end(value: float | None, env: Mapping[str, str]) -> float:
    source = "--leave-before-end"
    if value is None:
        text = env.get("FABRIC_LEAVE_BEFORE_END", "").strip()
        if not text:
            return DEFAULT_LEAVE_BEFORE_END_S
        source = "FABRIC_LEAVE_BEFORE_END"
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{source} {text!r}: expected seconds (0 = off)") from None
    if not 0 <= value <= 7 * 86400:  # also rejects NaN
        raise ConfigError(f"{source} {value:g}: expected 0 (off) to 604800 seconds")
    return value


def parse_labels(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` strings to sorted pairs (a repeated key keeps its last value)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--label {item!r}: expected KEY=VALUE")
        if len(key) > MAX_LABEL_KEY:
            raise ConfigError(f"--label {item!r}: key longer than {MAX_LABEL_KEY} characters")
        if len(value) > MAX_LABEL_VALUE:
            raise ConfigError(f"--label {key}: value longer than {MAX_LABEL_VALUE} characters")
        if not (key + value).isprintable():  # shown in tables and logs on every agent
            raise ConfigError(f"--label {item!r}: a control, format or line-separator character")
        if key == SITE_LABEL:
            raise ConfigError(f"--label {key}: the site is set with --site NAME")
        out[key] = value
    if len(out) > MAX_OPERATOR_LABELS:
        raise ConfigError(f"--label: {len(out)} labels, at most {MAX_OPERATOR_LABELS}")
    return tuple(sorted(out.items()))


def _bind(flag: str, text: str) -> tuple[str, int]:
    try:
        host, port = split_hostport(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    return host or "0.0.0.0", port


def _join_addr(text: str, source: str) -> str:
    try:
        host, port = split_hostport(text)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not host or port == 0:
        raise ConfigError(f"{source}: {text!r} needs a host and a non-zero port")
    return join_hostport(host, port)


# Flags the agent sets itself on the simulated engine it launches.
_SIM_OWN_FLAGS = ("--model", "--host", "--port", "--fd", "--gpu")


def _engine(
    argv: Sequence[str],
    url: str | None,
    sim: str | None,
    sim_gpu: str | None,
    sim_args: str | None = None,
) -> EngineCommand | None:
    if sim and argv:
        raise ConfigError("give either --sim MODEL or an engine command after --, not both")
    if sim_args and not sim:
        raise ConfigError("--sim-args needs --sim MODEL")
    if argv:
        return inspect_engine_cmd(argv, url)
    if not sim:
        return None
    try:
        extra = shlex.split(sim_args or "")
    except ValueError as exc:
        raise ConfigError(f"--sim-args: {exc}") from None
    for word in extra:
        if word.split("=", 1)[0] in _SIM_OWN_FLAGS:
            raise ConfigError(f"--sim-args: {word.split('=', 1)[0]} is set by the agent")
    return sim_engine_command(sim, (sim_gpu or "H100").split(":")[0], *extra)


def _engine_template(
    flag: str | None, model_paths: Sequence[str], env: Mapping[str, str], *, has_engine: bool
) -> EngineTemplate | None:
    text = flag if flag is not None else env.get("FABRIC_ENGINE_TEMPLATE", "")
    if not text.strip():
        if model_paths:
            raise ConfigError("--model-path only applies with --engine-template")
        return None
    if has_engine:
        if flag is None:
            return None  # a template from the environment: this node already runs an engine
        raise ConfigError(
            "--engine-template is for nodes started without an engine (they wait for "
            "`fabric plan --apply`); this one runs the engine given after -- or by --sim"
        )
    return parse_template(text, model_paths)


def _trusted_operators(flags: Iterable[str], env: Mapping[str, str]) -> tuple[str, ...]:
    items = list(flags)
    source = "--trust-operator"
    if not items:
        items = env.get("FABRIC_TRUST_OPERATORS", "").split(",")
        source = "FABRIC_TRUST_OPERATORS"
    out: list[str] = []
    for item in items:
        fp = item.strip().lower()
        if not fp:
            continue
        if len(fp) != 16 or any(c not in "0123456789abcdef" for c in fp):
            raise ConfigError(
                f"{source} {item!r}: expected an operator key fingerprint (16 hex digits, as "
                "`fabric keys new-operator` prints it)"
            )
        if fp not in out:
            out.append(fp)
    return tuple(out)


def _controller(
    wanted: bool, dry_run: bool, operators: Sequence[str], env: Mapping[str, str]
) -> ControllerConfig | None:
    if not wanted:
        return None
    if not operators:
        raise ConfigError(
            "--controller acts on the operator's service file: trust its key with "
            "--trust-operator FINGERPRINT (or $FABRIC_TRUST_OPERATORS)"
        )
    script = find_sbatch_script(env)
    if script is None:
        raise ConfigError(
            "--controller submits slurm/fabric-serve.sbatch: not found beside this install; "
            "set FABRIC_SBATCH_SCRIPT=/path/to/fabric-serve.sbatch"
        )
    tag = mesh_tag(str(fabric_home(env).expanduser().resolve()).encode())
    user = env.get("USER") or _login_name()
    if not user:
        raise ConfigError("--controller: cannot tell whose Slurm jobs to list (set $USER)")
    return ControllerConfig(script, user, tag, dry_run)


def _restart(policy: str | None) -> str:
    policy = (policy or "no").lower()
    if policy not in ("no", "on-failure", "always"):
        raise ConfigError(f"--restart {policy!r}: choose no, on-failure or always")
    return policy


def _max_restarts(n: int | None) -> int:
    if n is None:
        return 3
    if not 0 <= n <= 1000:
        raise ConfigError(f"--max-restarts {n}: expected 0..1000")
    return n


def _sim_gpu(spec: str | None) -> str | None:
    if spec:
        parse_sim_gpu(spec, host="check")  # fail at start-up with a clear line, not later
    return spec or None


def _provider(flag: str | None, env: Mapping[str, str]) -> str:
    name = flag or env.get("USER") or _login_name()
    if not name:
        raise ConfigError("no provider name: pass --provider NAME or set USER")
    if len(name) > 64:
        raise ConfigError(f"--provider {name!r}: longer than 64 characters")
    return name


def _site(flag: str | None, env: Mapping[str, str]) -> str:
    """``--site``, else ``$FABRIC_SITE``, else the Slurm cluster of the job we run in, else
    ``default``; a name that breaks the rules of ``mesh.sites`` is refused, naming its source."""
    if flag is not None:
        name, source = flag.strip(), "--site"
    elif env.get("FABRIC_SITE", "").strip():
        name, source = env["FABRIC_SITE"].strip(), "FABRIC_SITE"
    else:
        cluster = cluster_name_of(env)
        if cluster is None:
            return DEFAULT_SITE
        name, source = cluster, "SLURM_CLUSTER_NAME"
    problem = site_problem(name)
    if problem:
        if source == "SLURM_CLUSTER_NAME":  # not the user's choice: say what to do instead
            problem = f"(the default site) {problem}; pass --site NAME"
        raise ConfigError(f"{source} {name[:64]!r}: {problem}")
    return name


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return ""


def _advertise_host(flag: str | None, gossip_host: str, http_host: str) -> str:
    if flag:
        # Peers drop an entry whose addresses name a host no lookup can encode (``addr``): one
        # advertised so would start an agent no peer ever lists. Refused here, with the rule.
        if flag in WILDCARD_HOSTS or not valid_host(flag):
            raise ConfigError(
                f"--advertise {flag!r}: expected an IP address or a host name (dot-separated "
                "labels of letters, digits, hyphens and underscores), not a wildcard"
            )
        return flag
    for host in (gossip_host, http_host):
        if host not in WILDCARD_HOSTS:
            return host
    return primary_address()


def primary_address() -> str:
    """This host's address on its default route, or 127.0.0.1 when it has none.

    ``connect`` on a UDP socket sends nothing; it only makes the kernel choose a source address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.254.254.254", 1))
            addr = str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return addr if addr and addr != "0.0.0.0" else "127.0.0.1"
