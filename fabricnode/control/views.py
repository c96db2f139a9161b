"""JSON views of the registry, as the admin API and ``fabric --json`` show them
(docs/admin-guide.md, "JSON reference").

A view joins three things that live apart on purpose: the owner-signed entry (what a node says
about itself), this agent's *local* liveness view of it (a crashed node cannot sign its own
death, so liveness is never part of the entry), and the latest unsigned load report. Keys are
stable and always present (``null`` when unknown), so scripts can rely on the shape.

Entry view keys, in order: ``session_id, provider, verified_provider, site, state, version,
liveness, addresses{http,gossip}, hardware{gpu_type,gpu_count,gpu_memory_gb,host},
engine{kind,version,url}, models[{id,max_model_len,quantization,parent}], labels{},
load{waiting,running,kv_usage,inflight,updated_at}|null, started_at, updated_at, expires_at``
(times are Unix seconds; ``parent`` is an adapter's base model, else ``null``).
``verified_provider`` is the fingerprint of a provider key that certified the session, or
``null``: the free-text ``provider`` is only a claim. ``site`` is the site the owner signed
(``mesh.sites``; ``default`` for an entry signed before sites existed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import EntryBody, SignedEntry, State
from fabricnode.mesh.schema import CONTROL_COUNTS, SLEEPING_LABEL, Standing, model_parents

Json = dict[str, Any]
# The liveness shown for an entry no probe vouches for (``liveness_of``).
UNVOUCHED = Standing.UNVOUCHED.label


def liveness_of(core: MeshCore, entry: SignedEntry) -> str:
    """This agent's view, as the admin views show it: ``alive``, ``suspect``, ``dead``,
    ``left`` (a signed LEFT is final whatever the member table says), or ``unvouched`` for an
    entry whose owner no probe vouches for (not a member with a gossip address: not yet
    learned, or an entry no one can probe). The router never sends to an unvouched entry and
    the control plane does not count it (``schema.Standing.UNVOUCHED``), so no view calls it
    alive: a cluster-key holder's phantom would otherwise look like a healthy node.
    """
    if entry.body.state == State.LEFT:
        return Liveness.LEFT.label
    if core.standing_of(entry) is Standing.UNVOUCHED:
        return UNVOUCHED
    status = core.liveness(entry.session_id)
    return Liveness.ALIVE.label if status is None else status.label  # None: this agent


def entry_view(core: MeshCore, entry: SignedEntry, now: float) -> Json:
    body = entry.body
    load = core.loads.get(entry.session_id)
    return {
        "session_id": body.session_id,
        "provider": body.provider,
        "verified_provider": entry.verified_provider(now, core.verifier),
        "site": body.site,
        "state": body.state.label,
        "version": body.version,
        "liveness": liveness_of(core, entry),
        "addresses": {"http": body.addresses.http, "gossip": body.addresses.gossip},
        "hardware": {
            "gpu_type": body.hardware.gpu_type,
            "gpu_count": body.hardware.gpu_count,
            "gpu_memory_gb": body.hardware.gpu_memory_gb,
            "host": body.hardware.host,
        },
        "engine": {
            "kind": body.engine.kind,
            "version": body.engine.version,
            "url": body.engine.url,
        },
        "models": _models(body),
        "labels": dict(body.labels),
        "load": None
        if load is None
        else {
            "waiting": load.waiting,
            "running": load.running,
            "kv_usage": load.kv_usage,
            "inflight": load.inflight,
            "updated_at": load.at,
        },
        "started_at": body.started_at,
        "updated_at": body.updated_at,
        "expires_at": body.expires_at,
    }


def _models(body: EntryBody) -> list[Json]:
    """The entry's models; ``parent`` names an adapter's (LoRA) base model (``fabric.parents``)."""
    parents = model_parents(body)
    return [
        {
            "id": m.id,
            "max_model_len": m.max_model_len,
            "quantization": m.quantization,
            "parent": parents.get(m.id),
        }
        for m in body.models
    ]


def node_views(
    core: MeshCore,
    now: float,
    *,
    state: State | None = None,
    model: str | None = None,
    gpu: str | None = None,
    labels: Iterable[tuple[str, str]] = (),
    site: str | None = None,
) -> list[Json]:
    """Entries matching every filter given, ordered by session id (stable across calls)."""
    entries = core.registry.query(state=state, model=model, gpu=gpu, labels=labels, site=site)
    return [entry_view(core, e, now) for e in sorted(entries, key=lambda e: e.session_id)]


def match_sessions(core: MeshCore, prefix: str) -> list[SignedEntry]:
    """Entries whose session id is ``prefix`` or starts with it (an exact match wins)."""
    prefix = prefix.lower()
    exact = core.registry.get(prefix)
    if exact is not None:
        return [exact]
    if not prefix:
        return []
    return sorted(
        (e for e in core.registry if e.session_id.startswith(prefix)),
        key=lambda e: e.session_id,
    )


def models_view(core: MeshCore, now: float) -> list[Json]:
    """Per model announced by a JOIN or SERVING entry: where it runs and its aggregate load.

    ``nodes`` counts the SERVING entries the control plane counts (standing at least
    ``schema.CONTROL_COUNTS``: probed members not known down, dead or left; unlike
    ``/v1/models``, also suspect ones); ``serving`` only those it sees alive (not suspect: the
    ones a request goes to first); ``asleep`` those of the ``nodes`` whose engine sleeps
    (``fabric.sleeping``: woken by a request). ``gpu_types``, ``gpus`` and the load (the latest
    reports summed; ``kv_usage`` their mean) are of the ``nodes`` nodes, so a crashed node's
    hardware and last report drop out. ``max_model_len``, ``quantizations`` and
    ``providers`` are of every announcing entry; ``parent`` (an adapter's base model, else
    ``null``) is the first such entry's, by session id. ``sites`` breaks the counts down by
    site: one row ``{"site", "nodes", "serving", "asleep", "gpus"}`` per site of an announcing
    entry, sorted by name (a site whose entries are all JOIN or not counted has 0 nodes).
    """
    acc: dict[str, Json] = {}
    for entry in sorted(core.registry, key=lambda e: e.session_id):
        body = entry.body
        if body.state not in (State.JOIN, State.SERVING):
            continue
        live = liveness_of(core, entry)
        counted = body.state == State.SERVING and core.standing_of(entry) >= CONTROL_COUNTS
        asleep = any(key == SLEEPING_LABEL for key, _ in body.labels)
        load = core.loads.get(entry.session_id)
        parents = model_parents(body)
        for m in body.models:
            row = acc.setdefault(
                m.id,
                {
                    "id": m.id,
                    "nodes": 0,
                    "serving": 0,
                    "asleep": 0,
                    "gpu_types": set(),
                    "gpus": 0,
                    "max_model_len": None,
                    "parent": None,
                    "quantizations": set(),
                    "providers": set(),
                    "load": {"waiting": 0, "running": 0, "inflight": 0, "kv_usage": []},
                    "sites": {},
                },
            )
            if m.max_model_len is not None:
                row["max_model_len"] = max(row["max_model_len"] or 0, m.max_model_len)
            if m.quantization:
                row["quantizations"].add(m.quantization)
            if row["parent"] is None:
                row["parent"] = parents.get(m.id)  # an adapter's base model (LoRA)
            row["providers"].add(body.provider)
            at_site = row["sites"].setdefault(body.site, _site_row(body.site))
            if not counted:
                continue
            for counts in (row, at_site):
                counts["nodes"] += 1
                if live == Liveness.ALIVE.label:
                    counts["serving"] += 1
                if asleep:
                    counts["asleep"] += 1
                counts["gpus"] += body.hardware.gpu_count
            if body.hardware.gpu_type:
                row["gpu_types"].add(body.hardware.gpu_type)
            if load is not None:
                row["load"]["waiting"] += load.waiting
                row["load"]["running"] += load.running
                row["load"]["inflight"] += load.inflight
                row["load"]["kv_usage"].append(load.kv_usage)
    out = []
    for model_id in sorted(acc):
        row = acc[model_id]
        usages: list[float] = row["load"]["kv_usage"]
        row["load"]["kv_usage"] = sum(usages) / len(usages) if usages else None
        for key in ("gpu_types", "quantizations", "providers"):
            row[key] = sorted(row[key])
        row["sites"] = [row["sites"][site] for site in sorted(row["sites"])]
        out.append(row)
    return out


def _site_row(site: str) -> Json:
    return {"site": site, "nodes": 0, "serving": 0, "asleep": 0, "gpus": 0}
