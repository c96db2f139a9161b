"""``fabric nodes``, ``fabric node``, ``fabric models``: the registry as one agent sees it.

Each asks the agent named by ``--agent`` (``fabricnode.control.client``) and prints a table, or
the agent's JSON with ``--json``. Times are shown kubectl-style (``45s``, ``12m``, ``5h``).
The tables' columns are always the same, one site or many: ``SITE`` in ``fabric nodes``,
``SITES`` (nodes per site, ``A:2,C:1``) in ``fabric models``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import (
    JsonOption,
    agent_client,
    check_labels,
    command_group,
    console,
    handled,
    print_json,
    usage_error,
)
from fabricnode.mesh.schema import SLEEPING_LABEL
from fabricnode.mesh.sites import site_problem

commands = command_group()

STATES = ("join", "serving", "down", "left")

NODE_COLUMNS = (
    "SESSION", "SITE", "PROVIDER", "STATE", "LIVENESS", "HOST", "GPUS", "MODELS", "LOAD", "AGE"
)  # fmt: skip


@commands.command(help="Registry entries as this agent sees them.")
@handled
def nodes(
    state: Annotated[
        str | None, typer.Option(metavar="STATE", help="join|serving|down|left.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(metavar="MODEL", help="Only nodes serving it.")
    ] = None,
    gpu: Annotated[str | None, typer.Option(metavar="TYPE", help="Only this GPU type.")] = None,
    site: Annotated[str | None, typer.Option(metavar="SITE", help="Only this site's.")] = None,
    label: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="Label (repeatable).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    if state is not None and state.lower() not in STATES:
        raise typer.BadParameter(f"{state!r}: choose {'|'.join(STATES)}", param_hint="--state")
    if site is not None and site_problem(site):
        raise typer.BadParameter(f"{site!r}: {site_problem(site)}", param_hint="--site")
    labels = check_labels(label)
    with agent_client("nodes") as client:
        found = client.nodes(
            state=state.lower() if state else None,
            model=model,
            gpu=gpu,
            labels=labels,
            site=site,
        )
    if as_json:
        print_json({"nodes": found})
        return
    now = time.time()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in NODE_COLUMNS:
        table.add_column(column, no_wrap=column != "MODELS")
    for n in found:
        table.add_row(
            n["session_id"][:12],
            n.get("site") or "-",  # an agent from before sites: "-"
            n["provider"],
            _state(n),
            n["liveness"],
            n["hardware"]["host"] or "-",
            _gpus(n["hardware"]),
            ", ".join(m["id"] for m in n["models"]) or "-",
            _load(n["load"]),
            _age(now - n["started_at"]),
        )
    console().print(table)
    print(f"{len(found)} node{'s' if len(found) != 1 else ''}")


@commands.command(help="One registry entry in full (a unique prefix of the session id is enough).")
@handled
def node(
    session_id: Annotated[
        str, typer.Argument(metavar="SESSION_ID", help="Session id, or a unique prefix of it.")
    ],
    as_json: JsonOption = False,
) -> None:
    if not session_id.strip():
        usage_error("node", "SESSION_ID is empty (see `fabric nodes` for the ids)")
    with agent_client("node") as client:
        entry = client.node(session_id.strip())
    if as_json:
        print_json(entry)
        return
    rows = _flatten(entry)
    asleep = _asleep(entry)
    if asleep is not None:  # in words, after the state
        at = next(i for i, (key, _) in enumerate(rows) if key == "state") + 1
        rows.insert(at, ("sleep", asleep))
    now = time.time()
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        if key.endswith("_at") and value != "-":
            value = _when(float(value), now)
        print(f"{key:<{width}}  {value}")


@commands.command(help="Models served across the mesh, with node counts and aggregate load.")
@handled
def models(as_json: JsonOption = False) -> None:
    with agent_client("models") as client:
        found = client.models()
    if as_json:
        print_json({"models": found})
        return
    if not found:
        print("no models announced in the mesh yet")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    columns = ("MODEL", "NODES", "SERVING", "ASLEEP", "SITES", "GPU TYPES", "GPUS", "WAITING")
    for column in (*columns, "RUNNING", "KV"):
        table.add_column(column)
    for m in found:
        load = m["load"]
        kv = load["kv_usage"]
        table.add_row(
            m["id"],
            str(m["nodes"]),
            str(m["serving"]),
            str(m.get("asleep", 0)),
            _sites(m.get("sites")),
            ", ".join(m["gpu_types"]) or "-",
            str(m["gpus"]),
            str(load["waiting"]),
            str(load["running"]),
            "-" if kv is None else f"{kv:.0%}",
        )
    console().print(table)


def _sites(rows: list[dict[str, Any]] | None) -> str:
    """Nodes per site, ``A:2,C:1`` (one word, for ``awk``); ``-`` from an agent before sites."""
    return ",".join(f"{r['site']}:{r['nodes']}" for r in rows or ()) or "-"


def _state(n: dict[str, Any]) -> str:
    return f"{n['state']}, asleep" if _asleep(n) is not None else n["state"]


def _asleep(n: dict[str, Any]) -> str | None:
    """What a sleeping engine means, in words (None: not asleep)."""
    level = (n.get("labels") or {}).get(SLEEPING_LABEL)
    if level is None or n.get("state") != "serving":
        return None
    return (
        f"asleep (sleep level {level}): not routed while its models have an awake replica; "
        "the next request that needs it wakes it"
    )


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
