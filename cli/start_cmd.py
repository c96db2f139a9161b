"""``fabric start -- ENGINE_CMD``: run an agent (the options become an ``AgentConfig``).

The engine command after ``--`` is passed through exactly; ``fabricnode.config.load_config``
checks the options (a bad one is exit status 2) and ``fabricnode.agent.run_agent`` runs the
agent until it leaves. trio and hypercorn are imported only here, when an agent runs.
"""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import command_group, handled, usage_error
from fabricnode.errors import ConfigError

commands = command_group()


@commands.command(
    context_settings={"allow_interspersed_args": False},
    help="Run an agent: join the mesh and serve the agent API. SIGTERM/SIGINT leave gracefully.",
)
@handled
def start(
    engine_cmd: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- ENGINE_CMD",
            help="Engine to supervise, e.g. -- vllm serve MODEL --port 8000.",
            show_default=False,
        ),
    ] = None,
    http: Annotated[
        str | None,
        typer.Option(metavar="HOST:PORT", help="HTTP API (0.0.0.0:8080; port 0 = free)."),
    ] = None,
    gossip: Annotated[
        str | None,
        typer.Option(metavar="HOST:PORT", help="Gossip, UDP+TCP (0.0.0.0:7946; 0 = free)."),
    ] = None,
    admin: Annotated[
        str | None, typer.Option(metavar="HOST:PORT", help="Serve the agent endpoints separately.")
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(metavar="HOST", help="Host peers should use (default: primary address)."),
    ] = None,
    join: Annotated[
        list[str] | None,
        typer.Option(metavar="HOST:PORT", help="Gossip address of any member (repeatable)."),
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Shared rendezvous file ($FABRIC_HOME/rendezvous)."),
    ] = None,
    cluster_key: Annotated[
        str | None, typer.Option(metavar="PATH", help="Cluster keyring ($FABRIC_CLUSTER_KEY).")
    ] = None,
    provider: Annotated[
        str | None, typer.Option(metavar="NAME", help="Provider name (default $USER).")
    ] = None,
    site: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="Site of this agent ($FABRIC_SITE, else the Slurm cluster's name, else default).",
        ),
    ] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(metavar="URL", help="Where the engine serves (default: from its --port)."),
    ] = None,
    restart: Annotated[
        str | None,
        typer.Option(metavar="POLICY", help="Restart the engine: no|on-failure|always (no)."),
    ] = None,
    max_restarts: Annotated[
        int | None, typer.Option(metavar="N", help="At most N engine restarts (3).")
    ] = None,
    sim: Annotated[
        str | None,
        typer.Option(metavar="MODEL", help="Run the built-in simulated engine serving MODEL."),
    ] = None,
    sim_gpu: Annotated[
        str | None,
        typer.Option(metavar="TYPE[:N[:GB]]", help="Announce these GPUs instead of nvidia-smi's."),
    ] = None,
    sim_args: Annotated[
        str | None,
        typer.Option(
            metavar="FLAGS",
            help="More flags for the simulated engine, e.g. '--slowdown 10 --seed 3'.",
        ),
    ] = None,
    provider_key: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="Provider key that certifies this agent (see `fabric keys new-provider`).",
        ),
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="Label (repeatable).")
    ] = None,
    log_level: Annotated[
        str, typer.Option(metavar="LEVEL", help="debug|info|warning|error.")
    ] = "info",
    policy: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="Routing policy (default prefix-pending)."),
    ] = None,
    api_keys: Annotated[
        str | None,
        typer.Option(
            metavar="PATH", help="API keys file ($FABRIC_HOME/api-keys.json; absent = open)."
        ),
    ] = None,
    request_log: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Request log, JSON lines ('' = off)."),
    ] = None,
    max_body_mb: Annotated[
        float | None, typer.Option(metavar="MB", help="Largest request body (16).")
    ] = None,
    max_buffered_body_mb: Annotated[
        float | None,
        typer.Option(metavar="MB", help="Request bodies all connections may hold at once (512)."),
    ] = None,
    max_connections: Annotated[
        int | None, typer.Option(metavar="N", help="Client connections, in all (4096).")
    ] = None,
    max_connections_per_client: Annotated[
        int | None,
        typer.Option(metavar="N", help="Client connections from one address (1024)."),
    ] = None,
    batch_kv_threshold: Annotated[
        float | None,
        typer.Option(
            metavar="FRACTION",
            help="Batch tier (X-Fabric-Priority: batch): send batch requests only to nodes whose "
            "KV cache is less full than this (0.7).",
        ),
    ] = None,
    batch_max_waiting: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Batch tier: send batch requests only to nodes whose engine has at most N "
            "requests queued (0).",
        ),
    ] = None,
    batch_max_inflight_per_node: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Batch tier: at most N of this ingress's batch requests per node (32).",
        ),
    ] = None,
    max_batch_waiting: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Batch tier: batch requests this ingress holds while no node has room, in all "
            "(4096; past it 503).",
        ),
    ] = None,
    batch_max_wait: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Batch tier: longest a batch request waits for room (600; then 503).",
        ),
    ] = None,
    batch_priority: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Batch tier: the priority field batch requests carry to engines started with "
            "--scheduling-policy priority (1; interactive ones: vLLM's default, 0).",
        ),
    ] = None,
    batch_preempt_kv: Annotated[
        float | None,
        typer.Option(
            metavar="FRACTION",
            help="Batch tier: when a node's engine queues requests with its KV cache this full, "
            "take back this ingress's newest batch requests there (they wait for room again) "
            "(0.9; 1 = never).",
        ),
    ] = None,
    batch_prefill_rate: Annotated[
        float | None,
        typer.Option(
            metavar="TOKENS_PER_S",
            help="Batch tier: send each node at most this many batch prompt tokens per second, "
            "one request at a time, so batch prefills do not pile up in one engine step "
            "(0 = no pacing).",
        ),
    ] = None,
    drain_timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="On leave, let the requests in flight to the engine finish for this long, then "
            "hand the rest over to other replicas by stream resume (30; never past the Slurm "
            "job's end).",
        ),
    ] = None,
    leave_before_end: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="In a Slurm job, start leaving this long before its time limit (120; 0 = off).",
        ),
    ] = None,
    sleep_after: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Put the engine to sleep after this long without requests (vLLM's sleep "
            "mode: add --enable-sleep-mode to vLLM); the next request wakes it (off).",
        ),
    ] = None,
    kv_events: Annotated[
        bool,
        typer.Option(
            "--kv-events/--no-kv-events",
            help="Read the engine's KV-cache events (vLLM, the simulated engine), turning "
            "them on with a localhost port for an engine this agent starts (on).",
        ),
    ] = True,
    batch_concurrency: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Batch API requests this agent's worker sends at once, as batch-tier "
            "requests (64; 0 = this agent works no batches, its Batch API still answers).",
        ),
    ] = None,
    batch_key_quota_gb: Annotated[
        float | None,
        typer.Option(
            metavar="GB",
            help="Bytes of Batch API files one API key may keep in the shared store (4).",
        ),
    ] = None,
    batch_store_quota_gb: Annotated[
        float | None,
        typer.Option(
            metavar="GB",
            help="Bytes of Batch API files all keys together may keep in the store (64).",
        ),
    ] = None,
    batch_input_buffer_mb: Annotated[
        float | None,
        typer.Option(
            metavar="MIB",
            help="Batch request lines this agent's worker holds read ahead, in all batches; "
            "past it, it takes no more shards until some are sent (64).",
        ),
    ] = None,
    engine_template: Annotated[
        str | None,
        typer.Option(
            metavar="CMD",
            help="No engine yet: launch CMD when `fabric plan --apply` assigns a model "
            "({model} {model_path} {tp} {dp} {gpus} {port}; 'sim' = simulated engine; "
            "$FABRIC_ENGINE_TEMPLATE).",
        ),
    ] = None,
    model_path: Annotated[
        list[str] | None,
        typer.Option(metavar="MODEL=PATH", help="{model_path} of MODEL (repeatable)."),
    ] = None,
    trust_operator: Annotated[
        list[str] | None,
        typer.Option(
            metavar="FINGERPRINT",
            help="Accept assignments signed by this operator key (repeatable; "
            "$FABRIC_TRUST_OPERATORS).",
        ),
    ] = None,
    serve: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help="Serve MODEL from the start with --engine-template (tp = this node's GPUs), "
            "as the controller's jobs do.",
        ),
    ] = None,
    controller: Annotated[
        bool,
        typer.Option(
            "--controller",
            help="Run the elastic controller: keep the service file's models served through "
            "Slurm (one of the --controller agents acts; the others stand by).",
        ),
    ] = False,
    controller_dry_run: Annotated[
        bool,
        typer.Option(
            "--controller-dry-run",
            help="Like --controller, but only show the sbatch/scancel commands it would run.",
        ),
    ] = False,
    gateway: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="Make this agent a gateway of its site: the address other sites reach its "
            "federation port at (TCP, mutual TLS; docs/federation.md). Needs --site-key and "
            "--peer-sites.",
        ),
    ] = None,
    federation_listen: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="Where the federation port listens (default 0.0.0.0 and --gateway's port).",
        ),
    ] = None,
    site_key: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="The site key (site.key, its certificate site.pem beside it; "
            "`fabric keys site-new`).",
        ),
    ] = None,
    peer_sites: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="The certificates (*.pem) of the sites this gateway federates with: only "
            "they may connect, and only their summaries are taken.",
        ),
    ] = None,
    federation_peer: Annotated[
        list[str] | None,
        typer.Option(
            metavar="SITE=HOST:PORT",
            help="A gateway of a peer site to dial (repeatable); more are learned from its "
            "summaries.",
        ),
    ] = None,
) -> None:
    from fabricnode.config import ConnectionLimits, GatewayFlags, TierLimits, load_config

    try:
        config = load_config(
            http=http,
            gossip=gossip,
            admin=admin,
            advertise=advertise,
            join=join or (),
            rendezvous=rendezvous,
            cluster_key=cluster_key,
            provider=provider,
            provider_key=provider_key,
            site=site,
            engine_cmd=engine_cmd or (),
            engine_url=engine_url,
            sim=sim,
            sim_gpu=sim_gpu,
            sim_args=sim_args,
            restart=restart,
            max_restarts=max_restarts,
            labels=label or (),
            log_level=log_level,
            policy=policy,
            api_keys=api_keys,
            request_log=request_log,
            max_body_mb=max_body_mb,
            limits=ConnectionLimits(
                max_buffered_body_mb, max_connections, max_connections_per_client
            ),
            tiers=TierLimits(
                batch_kv_threshold,
                batch_max_waiting,
                batch_max_inflight_per_node,
                max_batch_waiting,
                batch_max_wait,
                batch_priority,
                batch_prefill_rate,
                batch_preempt_kv,
            ),
            drain_timeout_s=drain_timeout,
            leave_before_end_s=leave_before_end,
            sleep_after_s=sleep_after,
            kv_events=kv_events,
            batch_concurrency=batch_concurrency,
            batch_key_quota_gb=batch_key_quota_gb,
            batch_store_quota_gb=batch_store_quota_gb,
            batch_input_buffer_mb=batch_input_buffer_mb,
            engine_template=engine_template,
            model_paths=model_path or (),
            trust_operators=trust_operator or (),
            controller=controller,
            controller_dry_run=controller_dry_run,
            serve=serve,
            gateway=GatewayFlags(
                gateway, federation_listen, site_key, peer_sites, tuple(federation_peer or ())
            ),
        )
    except ConfigError as exc:
        usage_error("start", str(exc))
    from fabricnode.agent import run_agent  # trio and hypercorn: only when running an agent

    raise typer.Exit(run_agent(config))
