"""``fabric plan``: solve a placement and print it; ``--apply`` assigns it to JOIN-only nodes.

The inventory and the workload come from files or the live mesh (``cli.planning`` reads them and
follows an applied plan); ``scheduler.plan`` solves. The scheduler is an optional extra, so it
is imported when the command runs and a missing one is a one-line error naming the extra.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import (
    JsonOption,
    agent_client,
    command_group,
    console,
    handled,
    print_json,
    usage_error,
)
from fabricnode.config import default_operator_key_path
from fabricnode.errors import ConfigError
from fabricnode.mesh.identity import OperatorKey

commands = command_group()


@commands.command(
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
        typer.Option(
            metavar="PATH",
            help="Extra catalog: a GPU/model TOML file, a model's config.json or a model "
            "directory holding one (repeatable).",
        ),
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            metavar="MODE",
            help="fair (max-min served share first when overloaded, then throughput, then "
            "latency) | latency | throughput.",
        ),
    ] = "fair",
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
        from cli import planning
        from scheduler.catalog import load_catalog
        from scheduler.node_assign import assign_layout
        from scheduler.plan import plan as solve_plan
        from scheduler.workload import load_inventory, load_workloads
    except ImportError as exc:  # the optional extra is missing
        raise ConfigError(
            f"the placement planner needs fabricnode[scheduler] ({exc.name} is missing): "
            "pip install 'fabricnode[scheduler]'"
        ) from None
    try:
        planning.check_window(window)
    except ConfigError as exc:
        usage_error("plan", str(exc))
    key = None
    if apply:  # a missing key must fail before minutes of solving, not after
        key = OperatorKey.load(operator_key or default_operator_key_path(os.environ))
    cat = load_catalog(catalog or ())
    notes: list[str] = []
    view = None
    found: list[dict[str, Any]] = []
    if inventory is None or workload is None or apply:
        with agent_client("plan") as client:
            found = client.nodes()
        view = planning.mesh_view(found, cat)
        notes += view.notes
    inv: Any
    if inventory is not None and not apply:
        inv = load_inventory(inventory, cat)
    else:
        assert view is not None
        if not view.inventory:
            raise ConfigError(
                "no GPUs in the mesh: no alive JOIN or SERVING node announces GPUs of a catalog "
                "type (start agents, or pass --inventory FILE)"
            )
        inv = view.groups  # the mesh's nodes, each agent one node
    if workload is not None:
        loads = load_workloads(workload, cat)
    else:
        loads, more = planning.mesh_workloads(found, window, cat)
        notes += more

    if apply and inventory is not None:
        notes.append("--apply places on the mesh's nodes, whatever --inventory said")

    def progress(p: Any) -> None:
        if not as_json:
            print(f"  {p.elapsed_s:6.1f}s {p.phase:<8} {p.message}", file=sys.stderr)

    result = solve_plan(
        inv, loads, catalog=cat, mode=mode, solver=solver, time_limit_s=time_limit,
        progress=progress,
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
            print_json(doc)
        return
    assert key is not None and view is not None
    assert result.layout is not None
    node_plan = assign_layout(result.layout.engines, view.nodes)
    plan_id = planning.new_plan_id()
    signed = planning.sign_assignments(node_plan, key, plan_id, time.time(), ttl)
    applied: dict[str, Any] = {"plan_id": plan_id, "operator": key.fingerprint}
    applied.update(node_plan.to_json())
    if not as_json:
        _render_node_plan(node_plan, plan_id)
    failed = False
    if signed:
        with agent_client("plan") as client:
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

            status = planning.follow(
                client, node_plan.assignments, plan_id, timeout_s=wait, on_change=changed
            )
        applied["status"] = status
        not_serving = [sid for sid, st in status.items() if st != planning.SERVING]
        failed = failed or bool(not_serving)
        if not as_json:
            done = len(status) - len(not_serving)
            print(f"{done} of {len(status)} assigned nodes serving (plan {plan_id})")
    elif not as_json:
        print("nothing to apply: no JOIN-only node is needed (or none can host the plan)")
    doc["apply"] = applied
    if as_json:
        print_json(doc)
    if failed:
        raise typer.Exit(1)


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _render_plan(doc: dict[str, Any]) -> None:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("MODEL", "GPU", "GPUS", "TP", "DP", "NODES"):
        table.add_column(column)
    for a in doc["allocations"]:
        nodes = ", ".join(_short(n) for n in a.get("nodes", []))
        table.add_row(a["model"], a["pool"], str(a["gpus"]), str(a["tp"]), str(a["dp"]), nodes)
    solver = doc["solver"]
    print(f"placement ({doc['mode']} mode, {solver['name']} in {solver['seconds']:.1f} s)")
    console().print(table)
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
    console().print(summary)
    if doc.get("overload"):
        print(doc["overload"])
    for u in doc["unservable"]:
        print(f"cannot serve {u['model']}: {'; '.join(u['reasons'])}")
    for note in doc["notes"]:
        print(f"note: {note}")


def _short(node: str) -> str:
    """A node's name as the table shows it: session ids cut to 12 characters, like ``nodes``."""
    return node if "#" in node else node[:12]


def _render_node_plan(node_plan: Any, plan_id: str) -> None:
    print(f"apply (plan {plan_id}):")
    for a in node_plan.assignments:
        idle = f", {a.idle_gpus} GPUs idle" if a.idle_gpus else ""
        print(f"  {a.session_id[:12]}  {a.model} on {a.tp}x{a.dp} {a.gpu}{idle}")
    for (model, gpu), gpus in sorted(node_plan.serving_gpus.items()):
        print(f"  already serving: {model} on {gpus} {gpu}")
    for u in node_plan.unplaced:
        print(
            f"  not placed: {u.replicas} x {u.model} (tp={u.tp}) on {u.gpu}: its node serves "
            "another model (apply never stops a running engine)"
        )
    if node_plan.idle_nodes:
        print(f"  {len(node_plan.idle_nodes)} JOIN nodes stay unassigned")
