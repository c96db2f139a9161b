"""``fabric services``: the mesh's service file, desired against actual; ``apply`` replaces it.

* ``fabric services apply FILE`` checks the file here (every problem, with its line, and
  nothing is sent when there is one), signs it with the operator key and hands it to the
  agent, which spreads it through the mesh. Agents accept it only from an operator they trust.
* ``fabric services`` shows the file the agent holds and, per declared model, its min/max, the
  acting controller's target and its jobs (serving, starting, pending in the Slurm queue,
  draining) with the state and the reason, then the controller's last decisions. The acting
  controller is found in the registry (``fabricnode.elastic.leader``) and asked directly.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import JsonOption, agent_client, console, handled, print_json, state
from fabricnode.config import default_operator_key_path
from fabricnode.control.client import AdminClient
from fabricnode.elastic.leader import Candidate, acting
from fabricnode.elastic.servicefile import ServiceSpec, parse
from fabricnode.errors import AgentApiError, ConfigError
from fabricnode.mesh.identity import OperatorKey
from fabricnode.mesh.schema import CONTROLLER_LABEL, SERVICE_LABEL
from fabricnode.mesh.servicedoc import ServicesBody

services_app = typer.Typer(
    help="The mesh's service file (models kept served through Slurm): show it against what "
    "runs, or apply a new one.",
    invoke_without_command=True,
    rich_markup_mode=None,
)

Json = dict[str, Any]


@services_app.callback()
@handled
def services(ctx: typer.Context, as_json: JsonOption = False) -> None:
    if ctx.invoked_subcommand is not None:
        return
    with agent_client("services") as client:
        held = client.services()
        nodes = client.nodes()
        doc = status_doc(held, nodes, _controller_status(nodes))
    if as_json:
        print_json(doc)
    else:
        _render(doc)


@services_app.command("apply", help="Check, sign and apply a service file to the whole mesh.")
@handled
def apply(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The service file (TOML).")],
    operator_key: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="Operator key ($FABRIC_HOME/operator.key)."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the service file: {exc.strerror}") from None
    spec = parse(text, str(file))  # every problem with its line; nothing is sent then
    key = OperatorKey.load(operator_key or default_operator_key_path(os.environ))
    signed = ServicesBody(time.time(), text, key.public_key).sign(key)
    with agent_client("services") as client:
        result = client.post_services(signed.to_json())
    outcome = str(result.get("result"))
    doc = {"result": outcome, "digest": spec.digest(), "operator": key.fingerprint,
           "models": [m.name for m in spec.models]}  # fmt: skip
    if as_json:
        print_json(doc)
    elif outcome == "new":
        names = ", ".join(doc["models"]) or "no model"
        print(f"applied service file {spec.digest()} ({names}); it spreads through the mesh")
    if outcome == "untrusted":
        raise ConfigError(
            f"the agent does not trust operator {key.fingerprint}: start the agents (and the "
            f"controllers) with --trust-operator {key.fingerprint}"
        )
    if outcome not in ("new", "stale"):
        raise ConfigError(f"the agent refused the service file: {outcome}")


def status_doc(held: Json, nodes: list[Json], controller: Json | None) -> Json:
    """``fabric services --json``: the file, each model desired against actual, decisions."""
    current = held.get("services")
    spec: ServiceSpec | None = None
    problem = None
    if current is not None:
        try:
            spec = parse(str(current.get("text", "")), "the mesh's service file")
        except ConfigError as exc:
            problem = str(exc)
    by_model = {m["model"]: m for m in (controller or {}).get("models", [])}
    shares = (controller or {}).get("site_shares") or {}
    models = []
    for m in spec.models if spec is not None else ():
        running = [n for n in nodes if _label(n, SERVICE_LABEL) == m.name]
        live = [n for n in running if n.get("liveness") == "alive"]
        st = by_model.get(m.name, {})
        models.append(
            {
                "model": m.name,
                "min_replicas": m.min_replicas,
                "max_replicas": m.max_replicas,
                "target": st.get("target"),
                "serving": sum(1 for n in live if n.get("state") == "serving"),
                "starting": st.get("starting", sum(1 for n in live if n.get("state") == "join")),
                "pending": st.get("pending"),
                "draining": st.get("draining"),
                "state": st.get("state", "no controller"),
                "note": st.get("note", ""),
                "reason": st.get("reason", ""),
                "learned": st.get("learned", {}),  # what the acting controller learned of it
                # its site's share of a model counted across sites (prefer_sites)
                "site_share": shares.get(m.name),
            }
        )
    return {
        "file": None if current is None else {k: v for k, v in current.items() if k != "text"},
        "invalid": problem,
        "controller": None
        if controller is None
        else {k: controller.get(k) for k in ("role", "acting", "error", "last_pass_at", "dry_run")},
        "models": models,
        "decisions": (controller or {}).get("decisions", []),
        "commands": (controller or {}).get("commands", []),
    }


def _label(node: Json, key: str) -> str:
    labels = node.get("labels") or {}
    return str(labels.get(key, "")) if isinstance(labels, dict) else ""


def _controller_status(nodes: list[Json]) -> Json | None:
    candidates = []
    for n in nodes:
        since = _label(n, CONTROLLER_LABEL)
        try:
            when = float(since)
        except ValueError:
            continue
        dead = n.get("liveness") in ("dead", "left") or n.get("state") in ("down", "left")
        url = (n.get("addresses") or {}).get("http", "")
        candidates.append(Candidate(str(n["session_id"]), when, dead, str(url)))
    leader = acting(candidates)
    if leader is None or not leader.http:
        return None
    try:
        with AdminClient(leader.http, api_key=state().api_key) as ctl:
            return ctl.get_json("/fabric/v1/controller")
    except AgentApiError:
        return None


def _render(doc: Json) -> None:
    f = doc["file"]
    if f is None:
        print("no service file applied (fabric services apply FILE)")
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["issued_at"]))
    print(f"service file {f['digest']} from operator {f['operator']}, applied {when}")
    if doc["invalid"]:
        print(f"invalid (nothing changes): {doc['invalid']}")
    ctl = doc["controller"]
    if ctl is None:
        print("controller: none found (start one: fabric start --controller)")
    else:
        dry = " (dry run)" if ctl.get("dry_run") else ""
        print(f"controller: {str(ctl.get('acting') or '-')[:12]} acting{dry}")
        if ctl.get("error"):
            print(f"  {ctl['error']}")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("MODEL", "MIN", "MAX", "TARGET", "SERVING", "STARTING", "PENDING",
                   "DRAINING", "STATE"):  # fmt: skip
        table.add_column(column)
    for m in doc["models"]:
        state = m["state"] + (f": {m['note']}" if m["note"] else "")
        cells = [m["model"], m["min_replicas"], m["max_replicas"], m["target"], m["serving"],
                 m["starting"], m["pending"], m["draining"], state]  # fmt: skip
        table.add_row(*("-" if c is None else str(c) for c in cells))
    console().print(table)
    for m in doc["models"]:
        if m.get("site_share"):
            print(f"  {m['model']}: {m['site_share']}")
    for d in doc["decisions"][-10:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
        job = f" job {d['job_id']}" if d.get("job_id") else ""
        print(f"  {when} {d['action']} {d['model'] or '-'}{job}: {d['reason']}")
    for c in doc["commands"]:
        print(f"  would run: {c}")
