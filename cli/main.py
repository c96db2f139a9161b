"""The ``fabric`` command: parses, calls library code, renders. Nothing else lives here.

Exit status: 0 success, 1 a failed operation (agent unreachable, key file missing, unknown
node, ...), 2 bad usage (unknown option, malformed value). Errors are one line on stderr,
``fabric: error: ...``; ``--debug`` shows the traceback instead.

``fabric start -- ENGINE_CMD`` supervises the engine command (argv passed through exactly).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from cli.slurm_cmd import slurm_app
from fabricnode.config import (
    default_cluster_key_path,
    default_operator_key_path,
    default_provider_key_path,
)
from fabricnode.control.client import AdminClient, agent_base_url
from fabricnode.errors import ConfigError, FabricError, KeyFileError
from fabricnode.mesh.identity import OperatorKey, ProviderKey
from fabricnode.mesh.keyring import KEY_ID_BYTES, Keyring, new_cluster_key

DEFAULT_AGENT = "http://127.0.0.1:8080"
STATES = ("join", "serving", "down", "left")

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class CliState:
    agent_url: str = DEFAULT_AGENT
    debug: bool = False


# The global options of the command being run (set by the root callback, read by commands).
_STATE: ContextVar[CliState] = ContextVar("fabric_cli_state")


app = typer.Typer(
    name="fabric",
    help="Peer-to-peer OpenAI-compatible LLM serving mesh for Slurm clusters.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
keys_app = typer.Typer(
    help="Cluster keys (create, rotate), provider keys and ingress API keys.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(keys_app, name="keys")
app.add_typer(slurm_app, name="slurm")


# -- plumbing ---------------------------------------------------------------------------------


def _state() -> CliState:
    return _STATE.get(CliState())


def _error(message: str) -> None:
    print(f"fabric: error: {message}", file=sys.stderr)


def _usage_error(command: str, message: str) -> NoReturn:
    print(f"fabric {command}: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn expected failures into one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (FabricError, OSError) as exc:
            if _state().debug:
                raise
            if isinstance(exc, OSError) and not isinstance(exc, FabricError):
                where = f"{exc.filename}: " if exc.filename else ""
                _error(f"{where}{exc.strerror or exc}")
            else:
                _error(str(exc))
            raise typer.Exit(1) from None

    return wrapper


def _console() -> Console:
    # Wide when piped, so tables are not wrapped at 80 columns in logs and scripts.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _client(command: str) -> AdminClient:
    """A client of the agent named by --agent / $FABRIC_AGENT; a malformed URL is bad usage."""
    try:
        url = agent_base_url(_state().agent_url)
    except ConfigError as exc:
        _usage_error(command, f"--agent: {exc}")
    return AdminClient(url)


def _check_labels(labels: list[str] | None) -> list[str]:
    for label in labels or []:
        key, sep, _ = label.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{label!r}: expected KEY=VALUE", param_hint="--label")
    return labels or []


@app.callback()
def _root(
    ctx: typer.Context,
    agent: Annotated[
        str,
        typer.Option(
            "--agent",
            metavar="URL",
            envvar="FABRIC_AGENT",
            help="Agent to talk to (default $FABRIC_AGENT, else http://127.0.0.1:8080).",
            show_envvar=False,
        ),
    ] = DEFAULT_AGENT,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    state = ctx.obj if isinstance(ctx.obj, CliState) else CliState()
    state.agent_url = agent
    state.debug = debug
    ctx.obj = state
    _STATE.set(state)


# -- fabric start -----------------------------------------------------------------------------


@app.command(
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
    drain_timeout: Annotated[
        float | None,
        typer.Option(metavar="SECONDS", help="On leave, let accepted requests finish (30)."),
    ] = None,
    leave_before_end: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="In a Slurm job, start leaving this long before its time limit (120; 0 = off).",
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
) -> None:
    from fabricnode.config import load_config

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
            engine_cmd=engine_cmd or (),
            engine_url=engine_url,
            sim=sim,
            sim_gpu=sim_gpu,
            restart=restart,
            max_restarts=max_restarts,
            labels=label or (),
            log_level=log_level,
            policy=policy,
            api_keys=api_keys,
            request_log=request_log,
            max_body_mb=max_body_mb,
            drain_timeout_s=drain_timeout,
            leave_before_end_s=leave_before_end,
            engine_template=engine_template,
            model_paths=model_path or (),
            trust_operators=trust_operator or (),
        )
    except ConfigError as exc:
        _usage_error("start", str(exc))
    from fabricnode.agent import run_agent  # trio and hypercorn: only when running an agent

    raise typer.Exit(run_agent(config))


# -- fabric keys ------------------------------------------------------------------------------

ClusterKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--cluster-key",
        metavar="PATH",
        help="Keyring file (default $FABRIC_CLUSTER_KEY, else $FABRIC_HOME/cluster.key).",
        show_default=False,
    ),
]


def _key_path(path: Path | None) -> Path:
    return path if path is not None else default_cluster_key_path(os.environ)


def _ring_doc(path: Path, ring: Keyring) -> dict[str, Any]:
    """``--json`` of the keys commands: where the ring is, its primary key id and all ids."""
    return {"path": str(path), "primary": ring.primary.hex(), "keys": ring.key_ids()}


def _key_id(text: str) -> bytes:
    try:
        kid = bytes.fromhex(text)
    except ValueError:
        kid = b""
    if len(kid) != KEY_ID_BYTES:
        raise typer.BadParameter(
            f"{text!r} is not a key id ({2 * KEY_ID_BYTES} hex digits, see `fabric keys list`)"
        )
    return kid


@keys_app.command("new-cluster", help="Create a cluster keyring holding one new key.")
@handled
def keys_new_cluster(
    path: Annotated[
        Path | None,
        typer.Argument(help="Where (default $FABRIC_CLUSTER_KEY, else $FABRIC_HOME/cluster.key)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    target = _key_path(path)
    if target.exists() and not force:
        raise KeyFileError(
            f"{target} already exists (agents using it would lose the mesh); "
            "pass --force to overwrite it, or rotate with `fabric keys add`"
        )
    ring = Keyring.with_key(new_cluster_key())
    ring.save(target)
    if as_json:
        _print_json(_ring_doc(target, ring))
        return
    print(f"created cluster keyring {target} with key {ring.primary.hex()}")


@keys_app.command("add", help="Add a new key to the keyring (not primary); prints its id.")
@handled
def keys_add(cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    kid = ring.add(new_cluster_key())
    ring.save(path)
    if as_json:
        _print_json({**_ring_doc(path, ring), "added": kid.hex()})
        return
    print(kid.hex())


@keys_app.command("use", help="Make KEYID the primary key (agents seal with it).")
@handled
def keys_use(keyid: str, cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    kid = _key_id(keyid)
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    ring.use(kid)
    ring.save(path)
    if as_json:
        _print_json(_ring_doc(path, ring))
        return
    print(f"primary key is now {kid.hex()}")


@keys_app.command("remove", help="Remove KEYID (not the primary) from the keyring.")
@handled
def keys_remove(
    keyid: str, cluster_key: ClusterKeyOption = None, as_json: JsonOption = False
) -> None:
    kid = _key_id(keyid)
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    ring.remove(kid)
    ring.save(path)
    if as_json:
        _print_json({**_ring_doc(path, ring), "removed": kid.hex()})
        return
    print(f"removed key {kid.hex()}")


@keys_app.command("list", help="Key ids in the keyring; the primary one is marked.")
@handled
def keys_list(cluster_key: ClusterKeyOption = None, as_json: JsonOption = False) -> None:
    path = _key_path(cluster_key)
    ring = Keyring.load(path)
    primary = ring.primary.hex()
    if as_json:
        _print_json(_ring_doc(path, ring))
        return
    for kid in ring.key_ids():
        print(f"{kid} primary" if kid == primary else kid)


@keys_app.command("new-provider", help="Create a long-lived provider key; prints its fingerprint.")
@handled
def keys_new_provider(
    path: Annotated[
        Path | None, typer.Argument(help="Where (default $FABRIC_HOME/provider.key).")
    ] = None,
    provider: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="Provider name (default $USER).", show_default=False),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    name = provider or os.environ.get("USER", "")
    if not name:
        _usage_error("keys new-provider", "no provider name: pass --provider NAME")
    target = path if path is not None else default_provider_key_path(os.environ)
    if target.exists() and not force:
        raise KeyFileError(f"{target} already exists; pass --force to overwrite it")
    key = ProviderKey.generate(name)
    key.save(target)
    if as_json:
        _print_json({"path": str(target), "provider": name, "fingerprint": key.fingerprint})
        return
    print(f"created provider key {target} for {name!r}, fingerprint {key.fingerprint}")


@keys_app.command(
    "new-operator",
    help="Create an operator key (signs `fabric plan --apply`); prints the fingerprint agents "
    "must trust (--trust-operator / FABRIC_TRUST_OPERATORS).",
)
@handled
def keys_new_operator(
    path: Annotated[
        Path | None, typer.Argument(help="Where (default $FABRIC_HOME/operator.key).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    as_json: JsonOption = False,
) -> None:
    target = path if path is not None else default_operator_key_path(os.environ)
    if target.exists() and not force:
        raise KeyFileError(f"{target} already exists; pass --force to overwrite it")
    key = OperatorKey.generate()
    key.save(target)
    if as_json:
        _print_json({"path": str(target), "fingerprint": key.fingerprint})
        return
    print(f"created operator key {target}, fingerprint {key.fingerprint}")
    print(f"agents act on its plans when started with --trust-operator {key.fingerprint}")


# -- fabric keys api-* (ingress API keys) -------------------------------------------------------

ApiKeysFileOption = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        metavar="PATH",
        help="API keys file (default $FABRIC_HOME/api-keys.json).",
        show_default=False,
    ),
]


def _api_keys_path(path: Path | None) -> Path:
    from fabricnode.dataplane.apikeys import default_api_keys_path

    return path if path is not None else default_api_keys_path(os.environ)


@keys_app.command(
    "api-new",
    help="Create an ingress API key for NAME. The token goes to stdout, once: it is not stored "
    "(the file keeps only its hash). Creating the first key turns auth on.",
)
@handled
def keys_api_new(
    name: str,
    providers: Annotated[
        str | None,
        typer.Option(metavar="P1,P2", help="Only these providers (names or fingerprints) serve."),
    ] = None,
    rate: Annotated[
        float | None, typer.Option(metavar="R", help="Rate limit, requests per second.")
    ] = None,
    burst: Annotated[
        int | None, typer.Option(metavar="B", help="Burst size (default: one second's worth).")
    ] = None,
    keys_file: ApiKeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    from fabricnode.dataplane.apikeys import ApiKeyStore, RateLimit, check_key_name

    allow: list[str] | None = None
    try:
        check_key_name(name)
        if providers is not None:
            allow = [p.strip() for p in providers.split(",")]
            if not all(allow):
                raise ConfigError(f"--providers {providers!r}: expected NAME[,NAME...]")
        if rate is not None:
            RateLimit.of(rate, burst)
        elif burst is not None:
            raise ConfigError("--burst needs --rate")
    except ConfigError as exc:
        _usage_error("keys api-new", str(exc))
    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    try:
        token, key = store.new_key(name, allow, rate, burst)
    except ConfigError as exc:
        _usage_error("keys api-new", str(exc))
    if as_json:
        _print_json({"path": str(path), "token": token, **key.public()})
        return
    print(token)
    print(
        f"created API key {key.key_id} for {name!r} in {path}; the token above is shown only "
        "this once and cannot be recovered: store it now",
        file=sys.stderr,
    )


@keys_app.command("api-list", help="Ingress API keys (never their secrets or hashes).")
@handled
def keys_api_list(
    keys_file: ApiKeysFileOption = None,
    as_json: JsonOption = False,
) -> None:
    import time as _time

    from fabricnode.dataplane.apikeys import ApiKeyStore

    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    found = store.list()
    if as_json:
        _print_json(
            {"path": str(path), "enabled": store.enabled, "keys": [k.public() for k in found]}
        )
        return
    if not store.enabled:
        print(f"no API keys file at {path}: the ingress runs open (no auth)")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("KEY ID", "NAME", "STATUS", "CREATED", "PROVIDERS", "RATE"):
        table.add_column(column, no_wrap=column != "PROVIDERS")
    for k in found:
        table.add_row(
            k.key_id,
            k.name,
            "revoked" if k.disabled else "active",
            _time.strftime("%Y-%m-%d %H:%M UTC", _time.gmtime(k.created_at)),
            ", ".join(k.providers) if k.providers is not None else "any",
            f"{k.rate.rate_per_s:g}/s burst {k.rate.burst}" if k.rate else "-",
        )
    _console().print(table)
    active = sum(1 for k in found if not k.disabled)
    print(f"{active} active key{'s' if active != 1 else ''} of {len(found)}")


@keys_app.command(
    "api-revoke", help="Revoke an ingress API key by key id, or by name if it has one active key."
)
@handled
def keys_api_revoke(
    key_id_or_name: str, keys_file: ApiKeysFileOption = None, as_json: JsonOption = False
) -> None:
    from fabricnode.dataplane.apikeys import ApiKeyStore

    path = _api_keys_path(keys_file)
    store = ApiKeyStore.load(path)
    if not store.enabled:
        raise KeyFileError(f"no API keys file at {path} (nothing to revoke)")
    key, changed = store.revoke(key_id_or_name)
    if as_json:
        _print_json({"path": str(path), "changed": changed, **key.public()})
        return
    if changed:
        print(f"revoked API key {key.key_id} ({key.name}); agents drop it within a second or two")
    else:
        print(f"API key {key.key_id} ({key.name}) was already revoked")


# -- reading the registry ---------------------------------------------------------------------

NODE_COLUMNS = (
    "SESSION", "PROVIDER", "STATE", "LIVENESS", "HOST", "GPUS", "MODELS", "LOAD", "AGE"
)  # fmt: skip


@app.command(help="Registry entries as this agent sees them.")
@handled
def nodes(
    state: Annotated[
        str | None, typer.Option(metavar="STATE", help="join|serving|down|left.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(metavar="MODEL", help="Only nodes serving it.")
    ] = None,
    gpu: Annotated[str | None, typer.Option(metavar="TYPE", help="Only this GPU type.")] = None,
    label: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="Label (repeatable).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    if state is not None and state.lower() not in STATES:
        raise typer.BadParameter(f"{state!r}: choose {'|'.join(STATES)}", param_hint="--state")
    labels = _check_labels(label)
    with _client("nodes") as client:
        found = client.nodes(
            state=state.lower() if state else None, model=model, gpu=gpu, labels=labels
        )
    if as_json:
        _print_json({"nodes": found})
        return
    now = time.time()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in NODE_COLUMNS:
        table.add_column(column, no_wrap=column != "MODELS")
    for n in found:
        table.add_row(
            n["session_id"][:12],
            n["provider"],
            n["state"],
            n["liveness"],
            n["hardware"]["host"] or "-",
            _gpus(n["hardware"]),
            ", ".join(m["id"] for m in n["models"]) or "-",
            _load(n["load"]),
            _age(now - n["started_at"]),
        )
    _console().print(table)
    print(f"{len(found)} node{'s' if len(found) != 1 else ''}")


@app.command(help="One registry entry in full (a unique prefix of the session id is enough).")
@handled
def node(
    session_id: Annotated[
        str, typer.Argument(metavar="SESSION_ID", help="Session id, or a unique prefix of it.")
    ],
    as_json: JsonOption = False,
) -> None:
    if not session_id.strip():
        _usage_error("node", "SESSION_ID is empty (see `fabric nodes` for the ids)")
    with _client("node") as client:
        entry = client.node(session_id.strip())
    if as_json:
        _print_json(entry)
        return
    rows = _flatten(entry)
    now = time.time()
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        if key.endswith("_at") and value != "-":
            value = _when(float(value), now)
        print(f"{key:<{width}}  {value}")


@app.command(help="Models served across the mesh, with node counts and aggregate load.")
@handled
def models(as_json: JsonOption = False) -> None:
    with _client("models") as client:
        found = client.models()
    if as_json:
        _print_json({"models": found})
        return
    if not found:
        print("no models announced in the mesh yet")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("MODEL", "NODES", "SERVING", "GPU TYPES", "GPUS", "WAITING", "RUNNING", "KV"):
        table.add_column(column)
    for m in found:
        load = m["load"]
        kv = load["kv_usage"]
        table.add_row(
            m["id"],
            str(m["nodes"]),
            str(m["serving"]),
            ", ".join(m["gpu_types"]) or "-",
            str(m["gpus"]),
            str(load["waiting"]),
            str(load["running"]),
            "-" if kv is None else f"{kv:.0%}",
        )
    _console().print(table)


def _gpus(hw: dict[str, Any]) -> str:
    if not hw["gpu_count"]:
        return "-"
    return f"{hw['gpu_count']}x{hw['gpu_type'] or 'gpu'}"


def _load(load: dict[str, Any] | None) -> str:
    if load is None:
        return "-"
    return f"w{load['waiting']} r{load['running']} kv{load['kv_usage']:.0%}"


def _age(seconds: float) -> str:
    """kubectl-style: 45s, 12m, 5h, 3d."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _when(ts: float, now: float) -> str:
    """A Unix time as UTC, and how long ago (or from now)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    delta = now - ts
    return f"{stamp} ({_age(delta)} ago)" if delta >= 0 else f"{stamp} (in {_age(-delta)})"


def _flatten(doc: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(doc, dict):
        if not doc:
            return [(prefix, "-")] if prefix else []
        rows: list[tuple[str, str]] = []
        for key, value in doc.items():
            rows.extend(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return rows
    if isinstance(doc, list):
        if not doc:
            return [(prefix, "-")]
        rows = []
        for i, value in enumerate(doc):
            rows.extend(_flatten(value, f"{prefix}[{i}]"))
        return rows
    return [(prefix, "-" if doc is None or doc == "" else str(doc))]


# -- plan -------------------------------------------------------------------------------------


@app.command(
    help="Place models on GPUs: how many GPUs of each type each model gets, with what TP x DP, "
    "predicted against memP. Inventory and workload come from files or the live mesh "
    "(alive JOIN/SERVING nodes; the agents' request logs). --apply assigns JOIN-only nodes."
)
@handled
def plan(
    workload: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="Workload TOML ([[model]] name, rate, input_mean, output_mean)."
        ),
    ] = None,
    inventory: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Inventory TOML ([gpus] TYPE = COUNT); default: mesh."),
    ] = None,
    catalog: Annotated[
        list[Path] | None,
        typer.Option(metavar="FILE", help="Extra GPU/model catalog TOML (repeatable)."),
    ] = None,
    mode: Annotated[
        str, typer.Option(metavar="MODE", help="latency | throughput | fair.")
    ] = "latency",
    solver: Annotated[str, typer.Option(metavar="NAME", help="cpsat | exact | greedy.")] = "cpsat",
    time_limit: Annotated[
        float, typer.Option(metavar="SECONDS", min=0.1, max=3600, help="Solver time limit.")
    ] = 10.0,
    window: Annotated[
        float,
        typer.Option(metavar="SECONDS", help="Request-log window for the mesh workload (3600)."),
    ] = 3600.0,
    apply: Annotated[
        bool, typer.Option("--apply", help="Assign the plan to JOIN-only nodes and follow them.")
    ] = False,
    operator_key: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="Operator key for --apply ($FABRIC_HOME/operator.key)."),
    ] = None,
    wait: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", min=0, max=86400, help="--apply: follow nodes this long (300)."
        ),
    ] = 300.0,
    ttl: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", min=10, max=7 * 86400, help="--apply: assignments expire after."
        ),
    ] = 1800.0,
    as_json: JsonOption = False,
) -> None:
    try:
        from cli import plan_cmd
        from scheduler.catalog import load_catalog
        from scheduler.node_assign import PoolAllocation, assign_nodes
        from scheduler.plan import plan as solve_plan
        from scheduler.workload import load_inventory, load_workloads
    except ImportError as exc:  # the optional extra is missing
        raise ConfigError(
            f"the placement planner needs fabricnode[scheduler] ({exc.name} is missing): "
            "pip install 'fabricnode[scheduler]'"
        ) from None
    try:
        plan_cmd.check_window(window)
    except ConfigError as exc:
        _usage_error("plan", str(exc))
    key = None
    if apply:  # a missing key must fail before minutes of solving, not after
        key = OperatorKey.load(operator_key or default_operator_key_path(os.environ))
    cat = load_catalog(catalog or ())
    notes: list[str] = []
    view = None
    found: list[dict[str, Any]] = []
    if inventory is None or workload is None or apply:
        with _client("plan") as client:
            found = client.nodes()
        view = plan_cmd.mesh_view(found, cat)
        notes += view.notes
    if inventory is not None:
        inv = load_inventory(inventory, cat)
    else:
        assert view is not None
        if not view.inventory:
            raise ConfigError(
                "no GPUs in the mesh: no alive JOIN or SERVING node announces GPUs of a catalog "
                "type (start agents, or pass --inventory FILE)"
            )
        inv = view.inventory
    if workload is not None:
        loads = load_workloads(workload, cat)
    else:
        loads, more = plan_cmd.mesh_workloads(found, window, cat)
        notes += more

    if apply and inventory is not None:
        notes.append("--apply places on the mesh's nodes, whatever --inventory said")

    def progress(p: Any) -> None:
        if not as_json:
            print(f"  {p.elapsed_s:6.1f}s {p.phase:<8} {p.message}", file=sys.stderr)

    # Planned for the mesh's nodes: no replica wider than the biggest node of its GPU type.
    max_tp = view.largest_node if view is not None and (apply or inventory is None) else None
    result = solve_plan(
        inv, loads, catalog=cat, mode=mode, solver=solver, time_limit_s=time_limit,
        progress=progress, max_tp=max_tp,
    )  # fmt: skip
    doc = result.to_json()
    doc["notes"] = [*notes, *result.notes]
    doc["workload"] = [
        {"model": w.model, "rate": w.rate_rps, "input_mean": w.input_mean,
         "output_mean": w.output_mean, "input_std": w.input_std, "output_std": w.output_std}
        for w in loads
    ]  # fmt: skip
    if not as_json:
        _render_plan(doc)
    if not apply:
        if as_json:
            _print_json(doc)
        return
    assert key is not None and view is not None
    pools = [PoolAllocation(a.model, a.gpu, a.tp, a.dp) for a in result.placement.allocations]
    node_plan = assign_nodes(pools, view.nodes, plan_cmd.smallest_tp_for(cat, loads))
    plan_id = plan_cmd.new_plan_id()
    signed = plan_cmd.sign_assignments(node_plan, key, plan_id, time.time(), ttl)
    applied: dict[str, Any] = {"plan_id": plan_id, "operator": key.fingerprint}
    applied.update(node_plan.to_json())
    if not as_json:
        _render_node_plan(node_plan, plan_id)
    failed = False
    if signed:
        with _client("plan") as client:
            results = client.post_assignments([a.to_json() for a in signed])
            refused = [r for r in results if r.get("result") not in ("new", "stale")]
            for r in refused:
                failed = True
                if not as_json:
                    print(f"  {r['target'][:12]}: the agent refused it ({r['result']})")
            if refused and any(r["result"] == "untrusted" for r in refused) and not as_json:
                print(
                    f"  (agents act on plans of trusted operators only: start them with "
                    f"--trust-operator {key.fingerprint})"
                )

            def changed(sid: str, status: str) -> None:
                if not as_json:
                    print(f"  {sid[:12]}  {status}")

            status = plan_cmd.follow(
                client, node_plan.assignments, plan_id, timeout_s=wait, on_change=changed
            )
        applied["status"] = status
        not_serving = [sid for sid, st in status.items() if st != plan_cmd.SERVING]
        failed = failed or bool(not_serving)
        if not as_json:
            done = len(status) - len(not_serving)
            print(f"{done} of {len(status)} assigned nodes serving (plan {plan_id})")
    elif not as_json:
        print("nothing to apply: no JOIN-only node is needed (or none can host the plan)")
    doc["apply"] = applied
    if as_json:
        _print_json(doc)
    if failed:
        raise typer.Exit(1)


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _render_plan(doc: dict[str, Any]) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("MODEL", "GPU", "GPUS", "TP", "DP"):
        table.add_column(column)
    for a in doc["allocations"]:
        table.add_row(a["model"], a["gpu"], str(a["gpus"]), str(a["tp"]), str(a["dp"]))
    solver = doc["solver"]
    print(f"placement ({doc['mode']} mode, {solver['name']} in {solver['seconds']:.1f} s)")
    _console().print(table)
    summary = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("PREDICTED", "THROUGHPUT", "SERVED", "E2E MEAN", "TTFT MEAN"):
        summary.add_column(column)
    for name, p in (("this plan", doc["predicted"]), ("memP", doc["memp"]["predicted"])):
        summary.add_row(
            name,
            _fmt(p["throughput_rps"], " req/s"),
            _fmt(None if p["served_fraction"] is None else 100 * p["served_fraction"], "%", 1),
            _fmt(p["e2e_s"], " s"),
            _fmt(p["ttft_s"], " s", 3),
        )
    _console().print(summary)
    for u in doc["unservable"]:
        print(f"cannot serve {u['model']}: {'; '.join(u['reasons'])}")
    for note in doc["notes"]:
        print(f"note: {note}")


def _render_node_plan(node_plan: Any, plan_id: str) -> None:
    print(f"apply (plan {plan_id}):")
    for a in node_plan.assignments:
        idle = f", {a.idle_gpus} GPUs idle" if a.idle_gpus else ""
        sub = " (substitute: the plan's nodes ran out)" if a.substitute else ""
        print(f"  {a.session_id[:12]}  {a.model} on {a.tp}x{a.dp} {a.gpu}{idle}{sub}")
    for (model, gpu), gpus in sorted(node_plan.serving_gpus.items()):
        print(f"  already serving: {model} on {gpus} {gpu}")
    for u in node_plan.unplaced:
        print(f"  not placed: {u.replicas} x {u.model} (tp={u.tp}) on {u.gpu}: no JOIN node fits")
    if node_plan.idle_nodes:
        print(f"  {len(node_plan.idle_nodes)} JOIN nodes stay unassigned")


# -- demo -------------------------------------------------------------------------------------


@app.command(
    help="Run a local mesh with simulated engines (no GPU, no Slurm): watch it converge, serve "
    "requests through several agents, survive a kill -9 and a leave, then stop it all. "
    "With --serve it stays up as an OpenAI endpoint until Ctrl-C."
)
@handled
def demo(
    nodes: Annotated[int, typer.Option("--nodes", min=3, max=32, help="How many agents.")] = 4,
    serve: Annotated[
        bool,
        typer.Option(
            "--serve", help="After the crash, keep the mesh up (prints the OpenAI base URL)."
        ),
    ] = False,
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            min=1,
            max=65535,
            metavar="PORT",
            help="HTTP port of the agent printed as the OpenAI base URL (default: a free "
            "one); 8080 lets a plain `fabric nodes` find it.",
        ),
    ] = None,
) -> None:
    from cli.demo import run_demo

    raise typer.Exit(run_demo(nodes, serve=serve, port=port))


# -- sim-engine -------------------------------------------------------------------------------


@app.command(
    "sim-engine",
    help="Run the simulated OpenAI-compatible engine (see `fabric sim-engine --help`).",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sim_engine(ctx: typer.Context) -> None:
    from fabricnode.simengine.__main__ import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))


# -- entry point ------------------------------------------------------------------------------


def run(argv: list[str]) -> int:
    """Run the CLI on ``argv``; returns the exit status (one-line errors, see module doc)."""
    state = CliState()
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="fabric", obj=state, standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        return 130
    except Exception as exc:
        code = getattr(exc, "exit_code", None)
        if isinstance(code, int) and hasattr(exc, "format_message"):  # click's usage errors
            return _show_click_error(exc, code)
        if state.debug:
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)")
        return 1
    return int(result) if isinstance(result, int) else 0


def _show_click_error(exc: Exception, code: int) -> int:
    ctx = getattr(exc, "ctx", None)
    where = getattr(ctx, "command_path", "") or "fabric"
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        print(ctx.get_help(), file=sys.stderr)
        return code
    hint = f" (see `{where} --help`)" if code == 2 else ""
    message = getattr(exc, "format_message", lambda: str(exc))()
    print(f"{where}: error: {message}{hint}", file=sys.stderr)
    return code


def main() -> None:
    """Console entry point of ``fabric``."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
